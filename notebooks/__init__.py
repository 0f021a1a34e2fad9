"""The notebooks (stage<N>_*.ipynb, generated from source/) and their figures (figures/)."""
