"""Build notebooks/stage*.ipynb from their single sources, notebooks/source/stage*_*.py.

Each source is a plain Python file in jupytext's percent format (`# %%` starts a code cell,
`# %% [markdown]` a Markdown cell whose lines are comments): it runs as a script, reads as a
diff, and is formatted and linted with the rest of the tree. jupytext reads it; this script only
pins what jupytext would otherwise leave random or machine-dependent, so that the committed
notebooks are reproducible byte for byte and tests/test_notebooks.py can compare them:

- cell ids are stage<N>-<index> (jupytext draws random ones),
- the notebook metadata is fixed (kernel spec, language, the jupytext pairing
  `ipynb,source//py:percent`, so that jupytext in Jupyter edits both files together),
- cells carry no metadata and code cells no outputs.

    python notebooks/source/gen.py [OUT_DIR]     (make notebooks-source; OUT_DIR defaults to notebooks/)

Without the id pinning the same conversion is
`jupytext --to ipynb --output notebooks/stage1_gemm.ipynb notebooks/source/stage1_gemm.py`.
"""

import glob
import json
import os
import re
import sys

import jupytext

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOKS = os.path.dirname(HERE)
METADATA = {
    "jupytext": {"formats": "ipynb,source//py:percent"},
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python", "pygments_lexer": "ipython3"},
}


def sources():
    """The notebook sources, in stage order: notebooks/source/stage<N>_<name>.py."""
    return sorted(glob.glob(os.path.join(HERE, "stage*_*.py")))


def build(src):
    """The .ipynb text that `src` (a percent-format source) generates."""
    stage = int(re.match(r"stage(\d+)_", os.path.basename(src)).group(1))
    nb = jupytext.read(src, fmt="py:percent")
    cells = []
    for i, cell in enumerate(nb.cells):
        out = {
            "cell_type": cell.cell_type,
            "id": f"stage{stage}-{i:02d}",
            "metadata": {},
            "source": cell.source.splitlines(keepends=True),
        }
        if cell.cell_type == "code":
            out["execution_count"] = None
            out["outputs"] = []
        elif cell.cell_type != "markdown":
            raise ValueError(f"{src}: cell {i} is a {cell.cell_type} cell; use code or markdown")
        cells.append(out)
    doc = {"cells": cells, "metadata": METADATA, "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for src in sources():
        path = os.path.join(out_dir, os.path.basename(src)[: -len(".py")] + ".ipynb")
        text = build(src)
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}: {len(json.loads(text)['cells'])} cells")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else NOTEBOOKS)
