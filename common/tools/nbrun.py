"""A plain in-process notebook runner: executes a notebook's code cells in order in one
namespace, with matplotlib on the Agg backend. Enough to verify notebooks on machines without
Jupyter (the GPU machine) and in CI (compile-only mode, no GPU).

    python -m common.tools.nbrun notebooks/*.ipynb
    python -m common.tools.nbrun --execute-to docs/notebooks notebooks/*.ipynb

--execute-to DIR also writes an executed copy of each notebook into DIR: the same cells (same
ids, same sources), each code cell with the outputs it produced here - stdout and stderr as text,
the helpers' tables and code listings as Markdown, matplotlib figures as PNG at --dpi (80) - and
a first Markdown cell naming the GPU, the mode and the date of the run. The copies are valid
nbformat 4.5 notebooks, written with the json module alone (no Jupyter needed), and slim (see
slim_outputs: palette PNGs, no long text/plain twin of a Markdown output). To slim copies
written before, in place:

    python -c "from common.tools import nbrun; nbrun.slim_notebooks('docs/notebooks/*.ipynb')"
"""

import argparse
import base64
import contextlib
import datetime
import glob
import io
import json
import os
import re
import sys
import time
import traceback

NBFORMAT_MINOR = 5


def load_notebook(path):
    with open(path) as f:
        return json.load(f)


def code_cells(path):
    nb = load_notebook(path)
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            src = "".join(cell["source"])
            # IPython magics and shell escapes are not Python; notebooks avoid them.
            yield i, src


def _lines(text):
    """Text as nbformat stores it: a list of lines, each but the last ending in a newline."""
    return text.splitlines(keepends=True)


# text/plain of a rich output, where the rich form is what every notebook viewer shows.
PLAIN_PLACEHOLDERS = {
    "text/markdown": "<Markdown: see the rendered output>",
    "text/html": "<HTML: see the rendered output>",
}
LONG_PLAIN = 200  # characters: a text/plain twin longer than this is replaced


def palette_png(png):
    """PNG bytes re-encoded as a 256-colour palette PNG of the same pixel size (the figures are
    flat colours and text; Pillow's fast octree kept every channel of the tutorial's figures
    within 15 of 255 levels), then losslessly recompressed by oxipng where it is installed.
    Returns `png` itself where that is not smaller, where Pillow is missing, and for pictures
    with transparent pixels."""
    try:
        from PIL import Image
    except ImportError:
        return png
    with Image.open(io.BytesIO(png)) as img:
        rgba = img.convert("RGBA")
    if rgba.getextrema()[3][0] < 255:
        return png
    pal = rgba.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    out = io.BytesIO()
    pal.save(out, format="PNG", optimize=True)
    best = out.getvalue()
    try:
        import oxipng  # optional (pip install pyoxipng): some 10 % more, lossless
    except ImportError:
        pass
    else:
        best = min(best, oxipng.optimize_from_memory(best, level=4), key=len)
    return best if len(best) < len(png) else png


def slim_outputs(nb):
    """Shrink the outputs of the notebook `nb` (an nbformat dict) in place: every image/png
    re-encoded by palette_png, and every text/plain over LONG_PLAIN characters that sits next
    to a text/markdown or text/html replaced by a one-line placeholder (viewers show the rich
    form; the plain twin doubled the size of the tables and listings). Returns the characters
    saved."""
    saved = 0
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            data = out.get("data")
            if not data:
                continue
            png = data.get("image/png")
            if png is not None:
                b64 = "".join(png) if isinstance(png, list) else png
                small = base64.b64encode(palette_png(base64.b64decode(b64))).decode("ascii")
                if len(small) < len(b64):
                    saved += len(b64) - len(small)
                    data["image/png"] = small
            plain = data.get("text/plain")
            rich = next((PLAIN_PLACEHOLDERS[k] for k in PLAIN_PLACEHOLDERS if k in data), None)
            if plain is not None and rich is not None:
                text = "".join(plain) if isinstance(plain, list) else plain
                if len(text) > LONG_PLAIN:
                    saved += len(text) - len(rich)
                    data["text/plain"] = _lines(rich) if isinstance(plain, list) else rich
    return saved


def slim_notebooks(*patterns):
    """slim_outputs on executed notebook files (paths or glob patterns), rewritten in place in
    write_notebook's format. Returns {path: (bytes before, bytes after)}."""
    sizes = {}
    for path in sorted({p for pat in patterns for p in glob.glob(pat)}):
        before = os.path.getsize(path)
        nb = load_notebook(path)
        if slim_outputs(nb):
            write_notebook(nb, path)
        sizes[path] = (before, os.path.getsize(path))
    return sizes


class _Outputs:
    """The outputs of one cell, in the order they were produced (a file-like object for stdout
    and stderr, plus display() for the helpers' rich output and the figures)."""

    def __init__(self, name="stdout", sink=None):
        self.items = [] if sink is None else sink.items
        self.name = name

    def write(self, text):
        if not text:
            return 0
        last = self.items[-1] if self.items else None
        if last is not None and last["output_type"] == "stream" and last["name"] == self.name:
            last["text"] += text
        else:
            self.items.append({"output_type": "stream", "name": self.name, "text": text})
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False

    def display(self, data):
        self.items.append({"output_type": "display_data", "data": data, "metadata": {}})

    def rich(self, kind, payload):
        """The sink of common.tools.notebook.set_display_sink."""
        if kind == "markdown":
            md, plain = payload
            self.display({"text/markdown": md, "text/plain": plain})
        elif kind == "code":
            text, language = payload
            lang = "" if language in ("text", None) else language
            self.display({"text/markdown": f"```{lang}\n{text}\n```", "text/plain": text})
        else:
            raise ValueError(f"unknown display kind {kind!r}")

    def figures(self, plt, dpi):
        for num in plt.get_fignums():
            fig = plt.figure(num)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
            w, h = fig.get_size_inches()
            self.display(
                {
                    # full colour here: slim_outputs makes it a palette PNG, once
                    "image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                    "text/plain": f"<Figure size {w * 100:.0f}x{h * 100:.0f} with {len(fig.axes)} Axes>",
                }
            )

    def as_nbformat(self):
        out = []
        for item in self.items:
            item = dict(item)
            if item["output_type"] == "stream":
                item["text"] = _lines(item["text"])
            elif item["output_type"] == "display_data":
                item["data"] = {
                    k: (v if k == "image/png" else _lines(v)) for k, v in item["data"].items()
                }
            out.append(item)
        return out


def run_notebook(path, verbose=True, record=False, dpi=80):
    """Execute every code cell of `path`; raises with the cell number on the first failure.
    record=True: returns (namespace, {cell index: nbformat outputs}) with everything each cell
    printed, displayed and drew; else the namespace, output going to this process's stdout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.abspath(path)
    cells = list(code_cells(path))
    ns = {"__name__": "__main__", "__file__": path}
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if root not in sys.path:
        sys.path.insert(0, root)
    notebook = None
    if record:
        from common.tools import notebook
    recorded = {}
    old = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(path)))
    try:
        for i, src in cells:
            t0 = time.perf_counter()
            out = _Outputs("stdout") if record else None
            try:
                with contextlib.ExitStack() as stack:
                    if record:
                        stack.enter_context(contextlib.redirect_stdout(out))
                        stack.enter_context(contextlib.redirect_stderr(_Outputs("stderr", out)))
                        notebook.set_display_sink(out.rich)
                        stack.callback(notebook.set_display_sink, None)
                    exec(compile(src, f"{os.path.basename(path)}[cell {i}]", "exec"), ns)
                    if record:
                        out.figures(plt, dpi)
            except Exception as e:
                if record:
                    out.items.append(
                        {
                            "output_type": "error",
                            "ename": type(e).__name__,
                            "evalue": str(e),
                            "traceback": traceback.format_exception(type(e), e, e.__traceback__),
                        }
                    )
                    recorded[i] = out.as_nbformat()
                raise RuntimeError(f"{path}: code cell {i} failed: {type(e).__name__}: {e}") from e
            finally:
                plt.close("all")
            if record:
                recorded[i] = out.as_nbformat()
            if verbose:
                print(
                    f"  {os.path.basename(path)} cell {i}: {time.perf_counter() - t0:.1f} s",
                    file=sys.__stdout__,
                    flush=True,
                )
    finally:
        os.chdir(old)
    return (ns, recorded) if record else ns


def run_description():
    """(GPU, mode, versions) of this machine, as the header of an executed copy states them."""
    import torch

    from common import arch
    from common.tools import notebook

    try:
        from importlib.metadata import version

        dsl = version("nvidia-cutlass-dsl")
    except Exception:
        dsl = "(unknown)"
    versions = f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvidia-cutlass-dsl {dsl}"
    return arch.gpu_description(), notebook.MODE, versions


def rebase_links(markdown):
    """Markdown links and images written for notebooks/ (`](../docs/results/x.png)`), rebased for
    the executed copy one folder deeper, in docs/notebooks/: `](../` -> `](../../`."""
    return re.sub(r"\]\(\.\./", "](../../", markdown)


def executed_copy(path, recorded, when=None):
    """The notebook at `path` with the outputs of `recorded` and a first Markdown cell naming
    the GPU, the mode and the date: a dict in nbformat 4.5."""
    nb = load_notebook(path)
    gpu, mode, versions = run_description()
    when = when or datetime.datetime.now(datetime.timezone.utc)
    name = os.path.basename(path)
    header = (
        f"> **Executed copy of [`notebooks/{name}`](../../notebooks/{name})**, with the outputs of "
        f"one run on **{gpu}**, **{when.date().isoformat()}** ({mode} mode; {versions}; "
        f"{when.strftime('%H:%M')} UTC). Produced by `python -m common.tools.nbrun --execute-to "
        "docs/notebooks notebooks/*.ipynb`. The code cells are exactly those of the notebook "
        "(tests/test_notebooks.py checks it); every number and figure below is from this run, "
        "except what a cell reads from `docs/results/` (its GPU and date named in the cell or the text above it). "
        "To run it yourself, open the notebook in `notebooks/`."
    )
    cells = [
        {
            "cell_type": "markdown",
            "id": "executed-copy-header",
            "metadata": {},
            "source": _lines(header),
        }
    ]
    count = 0
    for i, cell in enumerate(nb["cells"]):
        cell = dict(cell)
        if cell["cell_type"] == "markdown":
            cell["source"] = _lines(rebase_links("".join(cell["source"])))
        if cell["cell_type"] == "code":
            count += 1
            cell["execution_count"] = count
            cell["outputs"] = recorded.get(i, [])
        cells.append(cell)
    nb["cells"] = cells
    nb["nbformat"], nb["nbformat_minor"] = 4, NBFORMAT_MINOR
    return nb


def write_notebook(nb, path):
    with open(path, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False, sort_keys=True)
        f.write("\n")
    try:  # validate where nbformat is installed (it is not needed to write)
        import nbformat

        nbformat.validate(nbformat.reads(json.dumps(nb), as_version=4))
    except ImportError:
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("notebooks", nargs="+")
    ap.add_argument("--execute-to", metavar="DIR", help="write executed copies with outputs here")
    ap.add_argument("--dpi", type=int, default=80, help="resolution of the figures (default 80)")
    args = ap.parse_args(argv)
    sizes = []
    for p in args.notebooks:
        print(f"running {p}", flush=True)
        if args.execute_to:
            _, recorded = run_notebook(p, record=True, dpi=args.dpi)
            os.makedirs(args.execute_to, exist_ok=True)
            dest = os.path.join(args.execute_to, os.path.basename(p))
            nb = executed_copy(p, recorded)
            slim_outputs(nb)
            write_notebook(nb, dest)
            sizes.append((dest, os.path.getsize(dest)))
            print(f"wrote {dest} ({sizes[-1][1] / 1024:.0f} KiB)", flush=True)
        else:
            run_notebook(p)
        print(f"ok {p}", flush=True)
    if sizes:
        print(f"executed copies: {sum(s for _, s in sizes) / 1024:.0f} KiB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
