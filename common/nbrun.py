"""A plain in-process notebook runner: executes a notebook's code cells in order in one
namespace, with matplotlib on the Agg backend. Enough to verify notebooks on machines without
Jupyter (the H200 machine) and in CI (compile-only mode, no GPU)."""

import json
import os
import sys
import time


def code_cells(path):
    with open(path) as f:
        nb = json.load(f)
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            src = "".join(cell["source"])
            # IPython magics and shell escapes are not Python; notebooks avoid them.
            yield i, src


def run_notebook(path, verbose=True):
    """Execute every code cell of `path`; raises with the cell number on the first failure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.abspath(path)
    cells = list(code_cells(path))
    ns = {"__name__": "__main__", "__file__": path}
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if root not in sys.path:
        sys.path.insert(0, root)
    old = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(path)))
    try:
        for i, src in cells:
            t0 = time.perf_counter()
            try:
                exec(compile(src, f"{os.path.basename(path)}[cell {i}]", "exec"), ns)
            except Exception as e:
                raise RuntimeError(f"{path}: code cell {i} failed: {type(e).__name__}: {e}") from e
            finally:
                plt.close("all")
            if verbose:
                print(
                    f"  {os.path.basename(path)} cell {i}: {time.perf_counter() - t0:.1f} s",
                    flush=True,
                )
    finally:
        os.chdir(old)
    return ns


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(f"running {p}", flush=True)
        run_notebook(p)
        print(f"ok {p}", flush=True)
