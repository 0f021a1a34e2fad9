"""Tools that measure, check, draw or run the kernels; no kernel imports anything here."""
