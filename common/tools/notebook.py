"""What the notebooks call: show a stage's code and its diffs, compile it, run and check it,
time it. The notebooks import the stage files and display them; they never paste kernels.

MODE is "gpu" when this machine's GPU runs one of the two tracks (then the GPU cells launch
the kernels and check them), else "compile-only" (the GPU cells say they are skipped and why).
Override with TUTORIAL_NB_MODE=gpu|compile-only. Every helper that does not need a GPU works
without one; the compile summaries (PTX, registers, shared memory) of both tracks are shown in
both modes.

Changing a kernel from a notebook: edit the stage file and call reload_stage(n), or leave the
file alone and override settings of the kernel class for one call, e.g.
measure(1, shapes, variants={"ab_buffers=2": dict(ab_buffers=2)}) or
compile_summary(1, "hopper", settings=dict(ab_buffers=2)). Both build a kernel object whose
configuration differs, which common.compile.cached_compile keys on, so the new kernel is what
gets compiled and timed."""

import ast
import contextlib
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

from common import arch, outputs
from common import compile as compile_cache
from common.tools import stage_table

# The notebooks check outputs as the tests do: every fresh output is NaN until written
# (common/outputs.py; the timed cells turn the fill off).
outputs.set_poison(True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("gpu", "compile-only")

# The track this machine's GPU runs, or None (no GPU, or a GPU of neither track).
GPU_TRACK = arch.track_of_capability(arch.compute_capability())


def _mode():
    forced = os.environ.get("TUTORIAL_NB_MODE", "").strip()
    if forced:
        if forced not in MODES:
            raise ValueError(f"TUTORIAL_NB_MODE = {forced!r}; allowed: {', '.join(MODES)}")
        return forced
    return (
        "gpu" if GPU_TRACK is not None and arch.gpu_track_available(GPU_TRACK) else "compile-only"
    )


MODE = _mode()
# The track the GPU cells run: this GPU's; the walkthrough text follows the Hopper track.
TRACK = GPU_TRACK or "hopper"

# What a notebook run did, for tests/test_notebooks.py: reset by start().
LOG = {
    "stage": None,
    "compiled": [],
    "verified": [],
    "measured": [],
    "missing": [],
    "errors": [],
    "traced": [],
}

# The instruction families each track's compile summary prints excerpts of.
PTX_EXCERPTS = {
    "hopper": (
        r"wgmma\.mma_async",
        r"cp\.async\.bulk\.tensor",
        r"mbarrier\.try_wait",
        r"shfl\.sync\.bfly",
        r"ex2\.approx",
    ),
    "blackwell": (
        r"tcgen05\.mma",
        r"tcgen05\.ld",
        r"tcgen05\.st",
        r"tcgen05\.alloc",
        r"cp\.async\.bulk\.tensor",
    ),
}
SKELETON = ("__init__", "__call__", "kernel", "compile_args", "gemm", "qk", "attention")
KERNEL_CLASS = {"hopper": "Sm90Kernel", "blackwell": "Sm100Kernel"}
ENTRY_AND_DRIVER = ("compile_args", "gemm", "qk", "attention")


# --------------------------------------------------------------------------------------------
# Display: rich in Jupyter, plain text under common/tools/nbrun.py and in scripts
# --------------------------------------------------------------------------------------------

# common.tools.nbrun --execute-to installs a sink here: sink(kind, payload) with kind "markdown"
# (payload (markdown, plain text)) or "code" (payload (text, language)), so that the executed
# copies it writes carry the same rich outputs Jupyter shows.
_SINK = None


def set_display_sink(sink):
    """Route markdown and code displays to sink(kind, payload) (None: back to print/IPython)."""
    global _SINK
    _SINK = sink


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _code(text, language="python"):
    if _SINK is not None:
        _SINK("code", (text, language))
    elif _ipython():
        from IPython.display import Code, display

        display(Code(text, language=language))
    else:
        print(text)


def _markdown(md, plain=None):
    if _SINK is not None:
        _SINK("markdown", (md, plain if plain is not None else md))
    elif _ipython():
        from IPython.display import Markdown, display

        display(Markdown(md))
    else:
        print(plain if plain is not None else md)


def _md_cell(x):
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(header, rows):
    """A table as Markdown in Jupyter, as aligned text elsewhere."""
    rows = [[str(x) for x in r] for r in rows]
    md = (
        "| "
        + " | ".join(_md_cell(h) for h in header)
        + " |\n|"
        + " --- |" * len(header)
        + "\n"
        + "\n".join("| " + " | ".join(_md_cell(x) for x in r) + " |" for r in rows)
    )
    plain_rows = [[x.replace("`", "") for x in r] for r in rows]
    widths = (
        [max(len(str(x)) for x in col) for col in zip(header, *plain_rows)]
        if rows
        else [len(h) for h in header]
    )
    plain = "\n".join(
        [
            " | ".join(h.ljust(w) for h, w in zip(header, widths)),
            "-+-".join("-" * w for w in widths),
        ]
        + [" | ".join(x.ljust(w) for x, w in zip(r, widths)) for r in plain_rows]
    )
    _markdown(md, plain)


def note(text):
    """A visible note (a missing stage file, a skipped GPU cell)."""
    _markdown(f"> **Note.** {text}", f"NOTE: {text.replace('`', '')}")


# --------------------------------------------------------------------------------------------
# Stage files
# --------------------------------------------------------------------------------------------


def stage_path(stage, track, relative=False):
    rel = os.path.join("stages", stage_table.stage(stage).package, f"{track}.py")
    return rel if relative else os.path.join(ROOT, rel)


def available(stage, track):
    """Whether stage `stage` of `track` exists; if not, say so once (no exception)."""
    if track not in arch.TRACKS:
        raise ValueError(f"track = {track!r}; allowed: {', '.join(arch.TRACKS)}")
    if os.path.exists(stage_path(stage, track)) and stage_table.available(stage, track):
        return True
    if (stage, track) not in LOG["missing"]:
        LOG["missing"].append((stage, track))
        note(
            f"`{stage_path(stage, track, True)}` does not exist yet (stage {stage}, {track} track). "
            "The cells that need it show this note instead; re-run the notebook once the file has landed."
        )
    return False


def start(stage, heading=None):
    """First cell of every notebook: where we are, what will run, which files exist. heading:
    the notebook's own "Stage N - title" where it has no kernel of its own and `stage` names
    the kernel it runs (stage 15 runs stage 14's)."""
    st = stage_table.stage(stage)
    heading = heading or f"Stage {stage} - {st.title}"
    for k in LOG:
        LOG[k] = [] if isinstance(LOG[k], list) else None
    LOG["stage"] = stage
    gpu = arch.gpu_description()
    if MODE == "gpu":
        what = (
            f"**GPU mode** on {gpu}: the {TRACK} kernels are launched and checked against the "
            "fp64 reference and timed; both tracks are also compiled for their compile summaries."
        )
    else:
        what = (
            f"**Compile-only mode** ({_why_no_gpu()}): every stage is compiled for sm_90a and "
            "sm_100a with fake tensors and its PTX inspected; the cells that launch kernels say "
            "they are skipped."
        )
    have = []
    for n in sorted({max(1, stage - 1), stage}):
        for t in arch.TRACKS:
            ok = os.path.exists(stage_path(n, t))
            have.append(f"`{stage_path(n, t, True)}` {'present' if ok else 'not written yet'}")
    _markdown(
        f"{heading}. {what}\n\n" + "; ".join(have) + ".",
        f"{heading}. {what.replace('**', '')}\n" + "; ".join(have).replace("`", "") + ".",
    )


def _source_file(stage, track):
    with open(stage_path(stage, track)) as f:
        return f.read()


def _parse(stage, track):
    """The file's syntax tree, or None (with a note) when it does not parse."""
    try:
        return ast.parse(_source_file(stage, track))
    except SyntaxError as e:
        note(f"`{stage_path(stage, track, True)}` does not parse: {e}")
        LOG["errors"].append(f"{stage_path(stage, track, True)}: {e}")
        return None


def _find_node(body, qualname):
    node = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def _node_lines(node):
    """(first, last) 1-based line numbers of a definition, decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno


def _ast_lookup(source, qualname):
    """Source text of a top-level object or a method (Class.method), decorators included."""
    node = _find_node(ast.parse(source).body, qualname)
    if node is None:
        return None
    first, last = _node_lines(node)
    return textwrap.dedent("\n".join(source.splitlines()[first - 1 : last]))


def _get_source(stage, track, qualname):
    """inspect.getsource of the imported object; the file's own text (ast) if it does not import."""
    try:
        obj = stage_table.track_module(stage, track)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return textwrap.dedent(inspect.getsource(obj))
    except AttributeError:
        return None
    except Exception:
        if _parse(stage, track) is None:
            return ""
        return _ast_lookup(_source_file(stage, track), qualname)


def outline(stage, track="hopper"):
    """[(qualified name, kind)] of the file's top-level functions, classes and methods, in order."""
    tree = _parse(stage, track)
    out = []
    if tree is None:
        return out
    for n in tree.body:
        if isinstance(n, ast.ClassDef):
            out.append((n.name, "class"))
            out += [
                (f"{n.name}.{m.name}", "method")
                for m in n.body
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((n.name, "function"))
    return out


def helper_names(stage, track="hopper"):
    """Functions and methods of the file beyond the skeleton every stage keeps."""
    if not available(stage, track):
        return []
    return [
        q
        for q, kind in outline(stage, track)
        if kind != "class"
        and q.split(".")[-1] not in SKELETON
        and not q.split(".")[-1].startswith("_")
    ]


def _section(source, banner):
    """Lines from the first comment line starting with `banner` (e.g. '# 2.') to the next numbered
    banner of the same depth, or to the end of the enclosing block."""
    lines = source.splitlines()
    num = re.match(r"#\s*(\d+)\.", banner.strip())
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith(banner.strip())), None)
    if start is None:
        return None
    indent = len(lines[start]) - len(lines[start].lstrip())
    nxt = re.compile(rf"^\s{{{indent},}}#\s*{int(num.group(1)) + 1}\.\s") if num else None
    end = len(lines)
    for i in range(start + 1, len(lines)):
        ln = lines[i]
        if nxt is not None and nxt.match(ln):
            end = i
            break
        if ln.strip() and len(ln) - len(ln.lstrip()) < indent:
            end = i
            break
    while end > start and not lines[end - 1].strip():
        end -= 1
    return textwrap.dedent("\n".join(lines[start:end]))


def show_source(stage, track="hopper", names=None, section=None):
    """Display a stage file: the whole file (names=None), selected top-level objects or methods
    (names=["Sm90Kernel.__init__", "compile_args"]), or one numbered section of the kernel
    (section="# 2. Main loop"). Syntax-highlighted in Jupyter, plain text elsewhere."""
    if not available(stage, track):
        return
    rel = stage_path(stage, track, True)
    if section is not None:
        text = _section(_source_file(stage, track), section)
        if text is None:
            note(f"`{rel}` has no section starting with `{section}`.")
            LOG["errors"].append(f"{rel}: no section {section!r}")
            return
        _markdown(f"`{rel}`, section `{section}`:", f"--- {rel}, section {section!r} ---")
        _code(text)
        return
    if names is None:
        _markdown(f"`{rel}`:", f"--- {rel} ---")
        _code(_source_file(stage, track))
        return
    if isinstance(names, str):
        names = [names]
    for q in names:
        text = _get_source(stage, track, q)
        if text == "":
            continue
        if text is None:
            have = ", ".join(n for n, _ in outline(stage, track))
            note(f"`{rel}` defines no `{q}`; it defines: {have}.")
            LOG["errors"].append(f"{rel}: no {q}")
            continue
        _markdown(f"`{rel}`: `{q}`", f"--- {rel}: {q} ---")
        _code(text)


# --------------------------------------------------------------------------------------------
# Kernel configuration: read it, override it for a call, reload an edited stage file
# --------------------------------------------------------------------------------------------


def _kernel_class(stage, track):
    return getattr(stage_table.track_module(stage, track), KERNEL_CLASS[track])


@contextlib.contextmanager
def kernel_settings(stage, track="hopper", **settings):
    """Within the block, every kernel object of stage `stage` (`track`) is built with these
    settings in place of the values its __init__ writes, e.g.
    `with nb.kernel_settings(1, "hopper", ab_buffers=2): ...`. The override happens as __init__
    assigns the attribute, so settings __init__ derives from it follow (Blackwell stage 1 derives
    its K slots from ab_buffers). The compile cache keys on the kernel's attributes, so the
    modified kernel is compiled anew. The launch plans and remembered calls (keyed by the
    kernel class, common/attention_host.py) are forgotten on entry and on exit: a call inside
    the block must not reuse the plan of the same call made before it, nor a call after the
    block the plan made inside it. An unknown name raises AttributeError."""
    if not settings:
        yield
        return
    cls = _kernel_class(stage, track)
    compile_cache.clear_launch_plans()
    orig_init = cls.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        prev = cls.__dict__.get("__setattr__")  # an enclosing kernel_settings' override, if any

        def overriding_setattr(obj, name, value):
            (prev or object.__setattr__)(obj, name, settings.get(name, value))

        cls.__setattr__ = overriding_setattr
        try:
            orig_init(self, *args, **kwargs)
        finally:
            if prev is None:
                if "__setattr__" in cls.__dict__:
                    del cls.__setattr__
            else:
                cls.__setattr__ = prev
        unknown = [k for k in settings if k not in vars(self)]
        if unknown:
            raise AttributeError(
                f"{cls.__name__}.__init__ ({stage_path(stage, track, True)}) sets no "
                f"{', '.join(unknown)}; the settings it has: {', '.join(sorted(vars(self)))}"
            )

    cls.__init__ = __init__
    try:
        yield
    finally:
        cls.__init__ = orig_init
        compile_cache.clear_launch_plans()


def reload_stage(stage, track=None):
    """Re-import a stage file after you edited it (e.g. `self.ab_buffers = 2` in
    stages/stage1_gemm/hopper.py), so that the cells below build, compile and time the edited
    kernel: the new module defines a new kernel class, which the compile cache keys on. Both
    tracks by default. Prints the settings of the reloaded kernel."""
    tracks = [track] if track else list(arch.TRACKS)
    for t in tracks:
        if not available(stage, t):
            continue
        importlib.reload(stage_table.track_module(stage, t))
        for key in [k for k in _REPORTS if k[0] == stage and k[1] == t]:
            del _REPORTS[key]
    pkg = f"stages.{stage_table.stage(stage).package}"
    if pkg in sys.modules:
        importlib.reload(sys.modules[pkg])
    for t in tracks:
        cfg = kernel_config(stage, t)
        if cfg:
            print(
                f"reloaded {stage_path(stage, t, True)}: "
                + ", ".join(f"{k}={v!r}" for k, v in cfg.items() if not isinstance(v, type))
            )


def kernel_config(stage, track="hopper", settings=None):
    """The settings the kernel class's __init__ fixes (tile sizes, pipeline depths, warp roles...),
    read from the object compile_args builds: {name: int | float | str | bool | tuple}. The
    pictures take their parameters from here, so they follow the stage file. `settings`:
    overrides, as in kernel_settings."""
    if not available(stage, track):
        return {}
    try:
        with kernel_settings(stage, track, **(settings or {})):
            kernel, _ = stage_table.track_module(stage, track).compile_args(
                torch.bfloat16, stage_table.stage(stage).compile_shape
            )
    except Exception as e:
        note(f"could not build the stage {stage} ({track}) kernel object: {type(e).__name__}: {e}")
        LOG["errors"].append(f"stage {stage} {track}: compile_args failed: {e}")
        return {}
    simple = (int, float, str, bool, tuple)
    return {
        k: v for k, v in vars(kernel).items() if isinstance(v, simple) and not k.startswith("_")
    }


def show_config(stage, track="hopper", settings=None):
    """kernel_config as a table."""
    cfg = kernel_config(stage, track, settings)
    if cfg:
        _markdown(
            f"Settings of `{KERNEL_CLASS[track]}` in `{stage_path(stage, track, True)}` (bf16):",
            f"--- settings of {KERNEL_CLASS[track]} in {stage_path(stage, track, True)} (bf16) ---",
        )
        _table(("attribute", "value"), [(k, repr(v)) for k, v in cfg.items()])
    return cfg


def show_docstring(stage, track="hopper"):
    """The file's opening docstring: 'Stage N - title. Changes from stage N-1: ...'."""
    if not available(stage, track):
        return
    tree = _parse(stage, track)
    if tree is None:
        return
    doc = ast.get_docstring(tree)
    _markdown(
        f"`{stage_path(stage, track, True)}`, docstring:",
        f"--- {stage_path(stage, track, True)}, docstring ---",
    )
    _code(doc or "(no docstring)", language="text")


# --------------------------------------------------------------------------------------------
# Trace time: the layouts CuTe computes, printed while the kernel is traced
# --------------------------------------------------------------------------------------------

_TRACED = {}


def _trace_record(name, value):
    layout = getattr(value, "layout", None)
    _TRACED[name] = str(layout if layout is not None else value)


def trace_layouts(stage, track="hopper", names=(), shape=None, show=True):
    """Compile the stage's kernel with a Python print-like hook after the line that defines each
    of `names` in `kernel` (its parameters at the top), and return {name: layout as CuTe prints
    it}. Python code in a CuTe kernel runs once, while the kernel is traced, so this shows the
    static layouts the real code computes - the trace-time counterpart of cute.printf. The stage
    file itself is not changed: a copy with the hooks is compiled (fake tensors, no GPU)."""
    if not available(stage, track):
        return {}
    rel = stage_path(stage, track, True)
    text = _source_file(stage, track)
    tree = ast.parse(text)
    kern = _find_node(tree.body, f"{KERNEL_CLASS[track]}.kernel")
    if kern is None:
        note(f"`{rel}` has no `{KERNEL_CLASS[track]}.kernel` to trace.")
        LOG["errors"].append(f"{rel}: no kernel method")
        return {}
    lines = text.splitlines()
    inserts = []  # (insert after this 0-based line index, indent, name)
    params = {a.arg for a in kern.args.args}
    first = kern.body[0]
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        first = kern.body[1]
    found = set()
    for name in names:
        if name in params:
            inserts.append((first.lineno - 2, first.col_offset, name))
            found.add(name)
    for node in ast.walk(kern):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            for n in [t] if isinstance(t, ast.Name) else getattr(t, "elts", []):
                if isinstance(n, ast.Name) and n.id in names and n.id not in found:
                    found.add(n.id)
                    inserts.append((node.end_lineno - 1, node.col_offset, n.id))
    missing = [n for n in names if n not in found]
    if missing:
        note(f"`{rel}`: `kernel` defines no {', '.join(missing)} to trace.")
        LOG["errors"].append(f"{rel}: trace_layouts found no {missing}")
    for after, indent, name in sorted(inserts, key=lambda x: -x[0]):
        lines.insert(after + 1, " " * indent + f"_nb_trace({name!r}, {name})")
    lines.insert(0, "from common.tools.notebook import _trace_record as _nb_trace  # noqa")
    _TRACED.clear()
    modname = f"_nb_trace_stage{stage}_{track}"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{modname}.py")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        try:
            spec.loader.exec_module(mod)
            from common.tools.ptx import compile_for_arch

            kernel, args = mod.compile_args(
                torch.bfloat16, tuple(shape or stage_table.stage(stage).compile_shape)
            )
            compile_for_arch(kernel, args, arch.ARCH_OF_TRACK[track])
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            note(f"tracing stage {stage} ({track}) failed: {type(e).__name__}: {msg}")
            LOG["errors"].append(f"stage {stage} {track}: trace failed: {msg}")
            return {}
        finally:
            sys.modules.pop(modname, None)
    got = {n: _TRACED[n] for n in names if n in _TRACED}
    LOG["traced"].append((stage, track))
    if show:
        shape_txt = tuple(shape or stage_table.stage(stage).compile_shape)
        _markdown(
            f"Layouts in `{KERNEL_CLASS[track]}.kernel` of `{rel}` as CuTe computes them at trace "
            f"time, shape {shape_txt}, bf16 (`shape:stride`; `1@0` = one step of coordinate 0):",
            f"--- layouts in {KERNEL_CLASS[track]}.kernel of {rel}, traced for shape {shape_txt}, bf16 ---",
        )
        _table(("tensor", "layout (shape:stride)"), [(n, f"`{v}`") for n, v in got.items()])
    return got


# --------------------------------------------------------------------------------------------
# Diffs
# --------------------------------------------------------------------------------------------


def diff_text(old_rel, new_rel):
    """`git diff --no-index --stat` then the unified diff, as `make diff-N` prints them; difflib
    when git is not installed."""
    git = shutil.which("git")
    if git:
        out = []
        for extra in (["--stat"], []):
            p = subprocess.run(
                [git, "--no-pager", "diff", "--no-index", "--no-color", *extra, old_rel, new_rel],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if p.returncode not in (0, 1):
                break
            out.append(p.stdout.rstrip("\n"))
        else:
            return "\n".join(x for x in out if x)
    with open(os.path.join(ROOT, old_rel)) as f:
        a = f.read().splitlines(keepends=True)
    with open(os.path.join(ROOT, new_rel)) as f:
        b = f.read().splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"a/{old_rel}", f"b/{new_rel}"))


def _diff_stat(text):
    plus = sum(1 for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
    minus = sum(1 for ln in text.splitlines() if ln.startswith("-") and not ln.startswith("---"))
    return plus, minus


def _show_diff_text(text, max_lines, hint):
    lines = text.splitlines()
    if max_lines is not None and len(lines) > max_lines:
        text = "\n".join(lines[:max_lines]) + f"\n... ({len(lines) - max_lines} more lines: {hint})"
    _code(text or "(no differences)", language="diff")


def _class_lines(stage, track):
    """(first line number, lines) of the kernel class of a stage file: what a kernel-only diff
    compares (the module docstring, imports, compile_args and the entry function left out)."""
    text = _source_file(stage, track)
    node = _find_node(ast.parse(text).body, KERNEL_CLASS[track])
    if node is None:
        return None, []
    first, last = _node_lines(node)
    return first, text.splitlines(keepends=True)[first - 1 : last]


def _method_at(stage, track, line):
    """Kernel-class method containing file line `line` (1-based), for diff hunk headers."""
    node = _find_node(ast.parse(_source_file(stage, track)).body, KERNEL_CLASS[track])
    best = None
    for m in getattr(node, "body", []):
        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first, last = _node_lines(m)
            if first <= line <= last:
                best = m.name
    return f"{KERNEL_CLASS[track]}.{best}" if best else KERNEL_CLASS[track]


def kernel_diff_text(stage, track="hopper", context=3):
    """Unified diff of the kernel class of stage - 1 against stage's (same track), each hunk
    headed by the method it falls in, line numbers those of the files."""
    old_rel, new_rel = stage_path(stage - 1, track, True), stage_path(stage, track, True)
    a0, a = _class_lines(stage - 1, track)
    b0, b = _class_lines(stage, track)
    out = [
        f"--- {old_rel} (class {KERNEL_CLASS[track]})",
        f"+++ {new_rel} (class {KERNEL_CLASS[track]})",
    ]
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        changed_j = next((j for tag, _, _, j, _ in group if tag != "equal"), j1)
        where = _method_at(stage, track, b0 + changed_j)
        out.append(f"@@ -{a0 + i1},{i2 - i1} +{b0 + j1},{j2 - j1} @@ {where}")
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                out += [" " + ln.rstrip("\n") for ln in a[x1:x2]]
                continue
            out += ["-" + ln.rstrip("\n") for ln in a[x1:x2]]
            out += ["+" + ln.rstrip("\n") for ln in b[y1:y2]]
    return "\n".join(out) if len(out) > 2 else ""


def show_diff(stage, track="hopper", max_lines=None, whole_file=False):
    """What stage `stage` changes in the kernel over stage - 1 in the same track: the diff of the
    kernel class only (no docstring, imports or entry-function hunks; the docstring is shown on
    its own). whole_file=True: the output of `make diff-N TRACK=track`."""
    if stage < 2:
        note("stage 1 is the first stage: there is no previous stage to diff against.")
        return
    if not (available(stage - 1, track) and available(stage, track)):
        return
    if whole_file:
        old, new = stage_path(stage - 1, track, True), stage_path(stage, track, True)
        text = diff_text(old, new)
        plus, minus = _diff_stat(text)
        _markdown(
            f"`make diff-{stage} TRACK={track}`: **+{plus} -{minus}** lines",
            f"--- make diff-{stage} TRACK={track}: +{plus} -{minus} lines ---",
        )
        _show_diff_text(text, max_lines, f"make diff-{stage} TRACK={track}")
        return
    text = kernel_diff_text(stage, track)
    plus, minus = _diff_stat(text)
    _markdown(
        f"Kernel diff, stage {stage - 1} -> {stage} ({track}), class `{KERNEL_CLASS[track]}` only: "
        f"**+{plus} -{minus}** lines (docstring above; `make diff-{stage} TRACK={track}` shows the "
        "whole files, entry function included):",
        f"--- kernel diff, stage {stage - 1} -> {stage} ({track}), class {KERNEL_CLASS[track]} only: "
        f"+{plus} -{minus} lines (make diff-{stage} TRACK={track}: whole files) ---",
    )
    _show_diff_text(text, max_lines, f"make diff-{stage} TRACK={track}")


def diff_map(stage, track="hopper"):
    """A map to read `make diff-N TRACK=track` with: for each part of the file (method,
    function, the class's own lines, the module's docstring and imports) the lines the diff adds
    and removes there, in the order of stage N's file, and whether the part is new in stage N
    or gone from it (common/tools/diff_sizes.py: method_sizes). Returns the rows."""
    from common.tools import diff_sizes

    if stage < 2 or not (available(stage - 1, track) and available(stage, track)):
        return []
    old, new = stage_path(stage - 1, track), stage_path(stage, track)
    have_old, have_new = set(diff_sizes.owners(old)), set(diff_sizes.owners(new))
    rows = []
    for name, added, removed in diff_sizes.method_sizes(old, new):
        where = "new" if name not in have_old else "gone" if name not in have_new else ""
        rows.append((f"`{name}`", added, removed, where))
    total_added, total_removed = sum(r[1] for r in rows), sum(r[2] for r in rows)
    _markdown(
        f"Where the lines of `make diff-{stage} TRACK={track}` fall "
        f"(+{total_added} -{total_removed}, whole files):",
        f"--- where the lines of make diff-{stage} TRACK={track} fall "
        f"(+{total_added} -{total_removed}, whole files) ---",
    )
    _table(("part of the file", "added", "removed", f"in stage {stage}"), rows)
    return rows


# The same concept in the two tracks: (concept, hopper pattern, blackwell pattern, first stage).
# Patterns are regular expressions over the kernel class's source, matched on CuTe DSL calls
# rather than variable names where possible; a pattern of None means "not in this track" and
# the table says why.
CONCEPTS = (
    ("tiled MMA (host)", r"make_trivial_tiled_mma\(", r"make_trivial_tiled_mma\(", 1),
    ("128B-swizzled smem layouts", r"make_smem_layout_a\(", r"make_smem_layout_a\(", 1),
    ("TMA descriptors (host)", r"make_tiled_tma_atom\(", r"make_tiled_tma_atom_A\(", 1),
    ("launch: grid and block", r"\.launch\(", r"\.launch\(", 1),
    ("barriers: pipeline objects", r"Pipeline\w+\.create\(", r"Pipeline\w+\.create\(", 1),
    ("CTA tile of a global tensor", r"local_tile\(", r"local_tile\(", 1),
    ("TMA partition", r"tma_partition\(", r"tma_partition\(", 1),
    ("MMA operands: smem descriptors", r"make_fragment_A\(", r"make_fragment_A\(", 1),
    (
        "accumulator",
        r"make_rmem_tensor\(\s*\w+\.partition_shape_C",
        r"tmem\.allocate\(|\.allocate\(self\.num_tmem",
        1,
    ),
    ("who loads: warp roles", r"if warp_idx == 0", r"if warp_idx == self\.\w*tma\w*", 1),
    (
        "producer waits for an empty slot",
        r"producer_acquire\(",
        r"_prod\w*\.acquire_and_advance\(",
        1,
    ),
    ("TMA load of a tile", r"cute\.copy\(\s*tma\w*,\s*\w+\[", r"cute\.copy\(\s*tma\w*,\s*\w+\[", 1),
    ("consumer waits for a full slot", r"consumer_wait\(", r"_cons\w*\.wait_and_advance\(", 1),
    ("MMA issued", r"cute\.gemm\(", r"cute\.gemm\(", 1),
    ("MMAs complete: wait / commit to a barrier", r"warpgroup\.wait_group\(", r"\.commit\(\)", 1),
    (
        "slot released after its MMAs",
        r"consumer_release\(|release_slot\(",
        r"\.release\(\)",
        1,
    ),
    ("accumulator -> registers", r"make_tiled_copy_C\(", r"Ld32x32bOp", 1),
    (
        "output stored",
        r"cute\.copy\(\s*tma_atom_\w+,\s*t\w+s\w+,|self\.store_rows\(",
        r"autovec_copy\(|cute\.copy\(\s*tma\w*,\s*t\w+s\w+,",
        1,
    ),
    ("second MMA, P @ V: A operand from", r"OperandSource\.RMEM", r"OperandSource\.TMEM", 3),
    ("V as the B operand (MN-major)", r"sVt\s*=", r"sV\s*=", 3),
    ("keys beyond Sk masked", r"mask_keys\(|>= seqlen_k", r"mask_keys\(|>= seqlen_k", 3),
    ("row max", r"warp_reduction_max\(", r"ReductionOp\.MAX", 3),
    ("exp2 with log2(e) folded in", r"exp2\(", r"exp2\(", 3),
    ("P handed to the PV MMA", r"acc_as_operand_a\(", r"St32x32bOp", 3),
    ("divide by row_sum", r"rcp_approx\(", r"rcp_approx\(|log2\(\s*row_sum", 3),
    ("K and V share the ring", r"tma_atom_v", r"kv_producer_entries", 4),
    (
        "rescale of O by row_scale",
        r"\.store\(.*row_scale",
        r"\.store\(.*row_scale",
        5,
    ),
    ("LSE written", r"LSE\w*\[[^\]]*\]\s*=", r"LSE\w*\[[^\]]*\]\s*=", 5),
    ("KV-tile range, one for every role", r"self\.kv_tile_range\(", r"self\.kv_tile_range\(", 6),
    (
        "element mask only on edge tiles",
        r"self\.crosses_mask_edge\(|self\.mask_edges\(",
        r"self\.crosses_mask_edge\(",
        6,
    ),
    ("safe max for a row with no key", r"m_safe = ", r"row_max_safe = ", 6),
    ("KV head of a query head (GQA)", r"kv_head = ", r"kv_head = ", 7),
    ("per-sequence offsets and lengths", r"self\.seq_info\(", r"self\.seq_info\(", 7),
    ("V rows past seqlen_k zeroed (packed)", r"self\.zero_rows\(", r"self\.zero_keys\(", 7),
)


def concept_lines(stage, track, pattern):
    """[(file line, code)] of each match of `pattern` in the kernel class of the stage file,
    outside comments; code is the start of the statement the match is in."""
    first, lines = _class_lines(stage, track)
    if first is None:
        return []
    text = "".join(lines)
    spans = [
        (n.lineno, n.end_lineno, isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        for n in ast.walk(ast.parse(textwrap.dedent(text)))
        if isinstance(n, ast.stmt)
    ]
    out, seen = [], set()
    for m in re.finditer(pattern, text):
        i = text.count("\n", 0, m.start())
        col = m.start() - (text.rfind("\n", 0, m.start()) + 1)
        if "#" in lines[i][:col]:
            continue
        inner = max((sp for sp in spans if sp[0] <= i + 1 <= sp[1]), default=None)
        if inner is not None and inner[2]:
            continue  # inside a docstring
        start = inner[0] - 1 if inner else i
        if start in seen:
            continue
        seen.add(start)
        code = lines[start].strip()
        if code.endswith(("(", "[", ",")) and start + 1 < len(lines):
            code += " " + lines[start + 1].strip()
        out.append((first + start, code))
    return out


def cross_track_table(stage, max_code=64):
    """One row per concept of the stage: where it lives in hopper.py and in blackwell.py (file
    line and code). The two tracks share the algorithm, TMA and the mbarrier pipeline; this table
    lines them up instead of a whole-file diff. Concepts a pattern no longer finds are listed
    (and logged as errors, so the notebook test catches a rename)."""
    if not (available(stage, "hopper") and available(stage, "blackwell")):
        return []
    rows, missing = [], []

    def cell(track, pattern):
        hits = concept_lines(stage, track, pattern)
        if not hits:
            return None
        line, code = hits[0]
        code = code if len(code) <= max_code else code[: max_code - 3] + "..."
        more = f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""
        return f"l. {line}{more}: `{code}`"

    for concept, hp, bp, since in CONCEPTS:
        if stage < since:
            continue
        h, b = cell("hopper", hp), cell("blackwell", bp)
        for track, got in (("hopper", h), ("blackwell", b)):
            if got is None:
                missing.append(f"{concept} ({track})")
        rows.append((concept, h or "(not found)", b or "(not found)"))
    _markdown(
        f"Stage {stage}, the same concepts in both tracks (`{stage_path(stage, 'hopper', True)}` | "
        f"`{stage_path(stage, 'blackwell', True)}`; line numbers of the files):",
        f"--- stage {stage}: the same concepts in {stage_path(stage, 'hopper', True)} and "
        f"{stage_path(stage, 'blackwell', True)} ---",
    )
    _table(("concept", "hopper.py", "blackwell.py"), rows)
    if missing:
        note(
            "no match for: "
            + "; ".join(missing)
            + " (common.tools.notebook.CONCEPTS needs updating)."
        )
        LOG["errors"].append(f"stage {stage}: cross-track table misses {missing}")
    return rows


# --------------------------------------------------------------------------------------------
# Compiling (no GPU needed)
# --------------------------------------------------------------------------------------------

_REPORTS = {}


def _settings_key(settings):
    return tuple(sorted((k, repr(v)) for k, v in (settings or {}).items()))


def compile_report(stage, track, shape=None, settings=None, options=None):
    """common.tools.ptx.compile_only, cached per (stage, track, shape, settings, options, kernel
    class) for this process; None (and a note) when the file is missing or does not compile.
    `options`: the compile_args options of the stage file (stage 6 on: causal, window; stage 7
    on: kv_heads, varlen), e.g. options=dict(varlen=True) for stage 7's packed kernel."""
    if not available(stage, track):
        return None
    key = (
        stage,
        track,
        tuple(shape) if shape else None,
        _settings_key(settings),
        id(_kernel_class(stage, track)),
        _settings_key(options),
    )
    if key not in _REPORTS:
        from common.tools.ptx import compile_only

        try:
            with kernel_settings(stage, track, **(settings or {})):
                _REPORTS[key] = compile_only(stage, track, shape=shape, **(options or {}))
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            note(f"stage {stage} ({track}) does not compile: {msg}")
            LOG["errors"].append(f"stage {stage} {track}: compile failed: {msg}")
            return None
    r = _REPORTS[key]
    if (stage, track) not in LOG["compiled"]:
        LOG["compiled"].append((stage, track))
    return r


def cubin_registers(cubin):
    """Registers per thread of the (single) kernel in a cubin, read from its ELF `.nv.info`
    section (attribute EIATTR_REGCOUNT), or None. This is the count of the binary the CuTe DSL
    built with its own assembler, so it needs no ptxas on the machine."""
    try:
        if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
            return None
        shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        secs = [
            struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)
        ]
        strtab = secs[shstrndx][4]
        found = []
        for sec in secs:
            end = cubin.index(b"\0", strtab + sec[0])
            if cubin[strtab + sec[0] : end] != b".nv.info":
                continue
            p, stop = sec[4], sec[4] + sec[5]
            while p + 2 <= stop:
                fmt, attr = cubin[p], cubin[p + 1]
                if fmt == 0x04:  # EIFMT_SVAL: u16 size, payload
                    size = struct.unpack_from("<H", cubin, p + 2)[0]
                    if attr == 0x2F and size >= 8:  # EIATTR_REGCOUNT: (symbol, registers)
                        found.append(struct.unpack_from("<II", cubin, p + 4)[1])
                    p += 4 + size
                elif fmt == 0x03:  # EIFMT_HVAL: u16 value
                    p += 4
                elif fmt in (0x01, 0x02):  # EIFMT_NVAL / EIFMT_BVAL
                    p += 2 if fmt == 0x01 else 3
                else:
                    break
        return max(found) if found else None
    except (IndexError, ValueError, struct.error):
        return None


@functools.lru_cache(maxsize=None)
def ptxas_info():
    """{path, release, targets} of the ptxas on PATH (release as `ptxas --version` prints it,
    targets the sm_* names `ptxas --help` allows), or None when there is none."""
    exe = shutil.which("ptxas")
    if exe is None:
        return None

    def run(*args):
        try:
            p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)
            return p.stdout + p.stderr
        except (OSError, subprocess.SubprocessError):
            return ""

    version = run("--version")
    m = re.search(r"release (\d+\.\d+)", version)
    helptext = run("--help")
    allowed = re.search(
        r"^--gpu-name\b.*?Allowed values for this option:(.*?)(?:\n\s*\n|Default value)",
        helptext,
        re.S | re.M,
    )
    targets = sorted(set(re.findall(r"sm_\d+[a-z]?", allowed.group(1)))) if allowed else []
    return {"path": exe, "release": m.group(1) if m else "(unknown release)", "targets": targets}


def _arch_key(name):
    m = re.match(r"sm_(\d+)([a-z]?)", name)
    return (int(m.group(1)), m.group(2)) if m else (0, "")


def _ptxas_first_error(ptx, arch_name):
    """The first line of ptxas's own complaint about `ptx` (not its closing 'aborted' line)."""
    info = ptxas_info()
    if info is None or not ptx:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        try:
            p = subprocess.run(
                [info["path"], f"-arch={arch_name}", "-o", os.path.join(d, "k.cubin"), src],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except (OSError, subprocess.SubprocessError):
            return None
    lines = [ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    useful = [ln for ln in lines if "aborted due to errors" not in ln]
    return (useful or lines or [None])[0]


def ptxas_problem(res, arch_name, ptx=None):
    """A sentence saying why ptxas gave no register count for `arch_name`, or None. ptxas_resources
    in common.compile returns {"error": <its last line>} when ptxas fails, which for an older
    ptxas facing sm_100a is a bare 'ptxas fatal : Ptx assembly aborted due to errors': this names
    the ptxas, its release and its newest target instead (or, with `ptx`, ptxas's first real
    error line)."""
    info = ptxas_info()
    if res is None:
        return "no ptxas on PATH (install the CUDA toolkit to see registers and spills)"
    if not res.get("error"):
        return None
    if info is None:
        return f"ptxas failed: {res['error']}"
    if info["targets"] and arch_name not in info["targets"]:
        newest = max(info["targets"], key=_arch_key)
        return (
            f"ptxas {info['release']} ({info['path']}) cannot assemble {arch_name}: its newest "
            f"target is {newest}. The kernel itself compiled (the CuTe DSL assembles with its own "
            "bundled compiler); only this report's spill counts need a ptxas of CUDA 12.9 or newer"
        )
    detail = _ptxas_first_error(ptx, arch_name) or res["error"]
    return f"ptxas {info['release']} ({info['path']}) failed for {arch_name}: {detail}"


def spill_note(res, arch_name, ptx=None):
    """Why `ptxas -v` gave no spill count, in a few words. The kernels themselves are assembled
    by the CuTe DSL's own bundled compiler; only the spill count needs a ptxas on PATH that reads
    the DSL's PTX version (a CUDA toolkit at least as new as the DSL)."""
    info = ptxas_info()
    if res is None or info is None:
        return "no ptxas on PATH (the CUDA toolkit's ptxas counts them)"
    detail = (
        _ptxas_first_error(ptx, arch_name) or res.get("error", "") if ptx else res.get("error", "")
    )
    m = re.search(r"Unsupported \.version (\d+\.\d+)", detail or "")
    if m:
        return (
            f"the ptxas on PATH (CUDA {info['release']}) is older than this PTX (ISA {m.group(1)}); "
            "a newer CUDA toolkit's ptxas counts them"
        )
    return ptxas_problem(res, arch_name, ptx)


def compile_summary(
    stage, track="hopper", shape=None, patterns=None, excerpt_lines=3, settings=None, options=None
):
    """Compile stage `stage` of `track` for its arch with fake tensors (no GPU) and show: compile
    time, registers and spills, dynamic shared memory, the byte counts the full barriers expect
    (expect_tx), how many of each instruction family the PTX holds, and a few PTX lines of the
    families the stage is about. `settings`: kernel settings to override (kernel_settings), to
    see what a change costs without editing the file. `options`: compile_args options (stage 7's
    packed kernel: options=dict(varlen=True))."""
    r = compile_report(stage, track, shape, settings, options)
    if r is None:
        return None
    from common.tools.ptx import expect_tx_immediates, ptx_lines

    res = r.resources
    rows = [("target", f"{r.arch} ({track})")]
    if settings:
        rows.append(("settings changed", ", ".join(f"{k}={v!r}" for k, v in settings.items())))
    if options:
        rows.append(("compile options", ", ".join(f"{k}={v!r}" for k, v in options.items())))
    rows += [
        ("shape", str(r.shape)),
        ("dtype", r.dtype),
        ("compile time", f"{r.seconds:.1f} s"),
    ]
    regs = cubin_registers(r.cubin)
    if res and "registers" in res:
        rows.append(("registers / thread", f"{res['registers']} (ptxas)"))
        rows.append(
            (
                "spills (store / load bytes)",
                f"{res.get('spill_stores', 0)} / {res.get('spill_loads', 0)}",
            )
        )
    else:
        rows.append(
            (
                "registers / thread",
                f"{regs} (from the cubin the CuTe DSL built)" if regs else "(not available)",
            )
        )
        rows.append(("spills", "not counted: " + spill_note(res, r.arch, r.ptx)))
    if r.shared_memory_bytes:
        smem = r.shared_memory_bytes
        rows.append(("dynamic shared memory / CTA", f"{smem} B ({smem / 1024:.1f} KiB)"))
    tx = [b for b in expect_tx_immediates(r.ptx) if b is not None]
    if tx:
        rows.append(
            (
                "expect_tx bytes (per arrive.expect_tx)",
                ", ".join(f"{b} ({b / 1024:g} KiB)" for b in sorted(set(tx))),
            )
        )
    rows += [(f"PTX: {k}", str(v)) for k, v in r.counts.items() if v]
    _markdown(
        f"**Compile summary, stage {stage} ({track})**",
        f"=== compile summary, stage {stage} ({track}) ===",
    )
    _table(("", "value"), rows)
    excerpt = []
    for pat in patterns or PTX_EXCERPTS[track]:
        got = ptx_lines(r.ptx, pat, limit=excerpt_lines)
        if got:
            excerpt.append(f"// {pat.replace(chr(92), '')}")
            excerpt += [ln if len(ln) <= 150 else ln[:120] + " ... " + ln[-25:] for ln in got]
    if excerpt:
        _code("\n".join(excerpt), language="text")
    return r


# --------------------------------------------------------------------------------------------
# Running and checking (GPU)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Verification:
    stage: int
    track: str
    shape: tuple
    out: torch.Tensor
    ref: torch.Tensor
    check: object  # common.tools.verify.CheckResult of the main output
    lse_check: object  # CheckResult of the LSE (stage 5), else None


def _why_no_gpu():
    return (
        "no CUDA GPU is visible"
        if arch.compute_capability() is None
        else f"{arch.gpu_description()} runs neither track"
        if GPU_TRACK is None
        else "TUTORIAL_NB_MODE=compile-only"
    )


def _skip(what, stage):
    note(
        f"{what} skipped: this cell launches the stage {stage} kernel, which needs an sm_90 (H100/H200) or "
        f"sm_100 (B200/GB200) GPU, and {_why_no_gpu()}. The compile summaries above show what the "
        "compiler produced."
    )


def run_and_verify(stage, shape=None, seed=0, settings=None):
    """GPU mode: launch stage `stage` of this GPU's track on seeded inputs (outputs poisoned with
    NaN first), wait with a deadline, and check against the fp64 reference and PyTorch's own
    low-precision error (common.tools.verify); raise AssertionError with the report if it fails.
    `settings`: kernel settings to override (kernel_settings). Compile-only mode: say that the
    cell is skipped and why."""
    shape = tuple(shape or stage_table.stage(stage).compile_shape)
    if MODE != "gpu":
        _skip("Run and verify", stage)
        return None
    track = arch.track()
    if not available(stage, track):
        return None
    from common.tools.verify import compare, run_with_deadline
    from common.tools.workloads import make_case

    case = make_case(stage, track, shape, seed=seed)
    with kernel_settings(stage, track, **(settings or {})):
        compiled_before = compile_cache.cache_size()
        t0 = time.perf_counter()
        out = run_with_deadline(case.run, 60, f"stage {stage} ({track})")
        first = time.perf_counter() - t0
        compiled = compile_cache.cache_size() > compiled_before
        ref = case.ref()
        chk = compare(
            f"stage {stage} {track} {shape}", out, ref, rtol=case.rtol, torch_lowp=case.lowp()
        )
        lse_chk = None
        if stage == 5:
            from common.tools.reference import attention_ref

            entry = getattr(stage_table.track_module(stage, track), stage_table.stage(stage).entry)
            q, k, v = case.args
            _, lse = run_with_deadline(
                lambda: entry(q, k, v, return_lse=True), 60, "stage 5 with return_lse"
            )
            # LSE is fp32 from fp32 statistics: a relative error around 1e-6 is expected; 1e-4
            # leaves room for exp2/log2 approximations and would still catch a wrong base (log2
            # vs ln) or a missing scale.
            lse_chk = compare(f"stage 5 LSE {shape}", lse, attention_ref(q, k, v)[1], rtol=1e-4)
    _table(
        (
            "check",
            "relative error",
            "bound",
            "PyTorch's own error",
            "max abs error",
            "worst element",
            "verdict",
        ),
        [
            (
                c.name,
                f"{c.rel_err:.2e}",
                f"{c.bound:.2e}",
                "-" if c.torch_rel_err is None else f"{c.torch_rel_err:.2e}",
                f"{c.max_abs_err:.2e}",
                f"{c.worst_index}: {c.worst_out:.5g} vs {c.worst_ref:.5g}",
                "pass" if c.passed else "FAIL",
            )
            for c in (chk, lse_chk)
            if c is not None
        ],
    )
    launch = "compile + run" if compiled else "run; its kernel was compiled earlier in this process"
    print(
        f"bound = min(hard bound, 3 x PyTorch's own error + 1e-6); this cell's launch ({launch}) "
        f"took {first:.1f} s on {arch.gpu_description()}"
    )
    for c in (chk, lse_chk):
        if c is not None and not c.passed:
            LOG["errors"].append(str(c))
            raise AssertionError(str(c))
    LOG["verified"].append((stage, track, shape))
    return Verification(stage, track, shape, out, ref, chk, lse_chk)


def _cpu_standin(stage, seed=0):
    """PyTorch's own low-precision result against fp64, on the CPU, for a small shape: what
    bf16 rounding alone costs, shown where no GPU can run the kernel."""
    from common.tools import inputs, reference

    if stage == 1:
        a, b = inputs.gemm_inputs(256, 256, 256, torch.bfloat16, seed, device="cpu")
        return (a @ b.T), reference.gemm_ref(a, b), "PyTorch bf16 GEMM 256^3 on the CPU"
    q, k, v = inputs.attention_inputs(
        1, 1, 256, 128 if stage == 3 else 512, 128, torch.bfloat16, seed, device="cpu"
    )
    if stage == 2:
        return (
            (q @ k.transpose(-1, -2)).float() * 128**-0.5,
            reference.qk_ref(q, k),
            "PyTorch bf16 Q K^T on the CPU",
        )
    return (
        reference.attention_lowp(q, k, v),
        reference.attention_ref(q, k, v)[0],
        "PyTorch bf16 attention (SDPA math) on the CPU",
    )


def error_picture(stage, result=None, standin=None):
    """GPU mode: |out - ref| of the kernel's checked output, for the (b, h) slice that holds the
    worst element (named in the title, the same element as the table's). Without a GPU: for
    stage 1 (or standin=True) the same map for PyTorch's own bf16 computation on the CPU - the
    yardstick, uniform rounding noise; for later stages a note, since that picture would only
    repeat stage 1's noise."""
    from common.tools import plots

    if result is not None:
        return plots.error_heatmap(
            result.out,
            result.ref,
            title=f"stage {stage} ({result.track}) kernel |out - fp64 ref|, {arch.gpu_description()}",
        )
    if standin is None:
        standin = stage == 1
    if not standin:
        note(
            "no kernel ran, so there is no error map of it here. In GPU mode this cell draws the "
            "kernel's |out - ref| for the slice holding its worst element; a correct kernel shows "
            "uniform rounding noise like the stand-in of stage 1 (section 6), while a bug shows "
            "structure (a tile, a row band, a column of keys). `nb.error_picture(n, standin=True)` "
            "draws the CPU stand-in."
        )
        return None
    out, ref, what = _cpu_standin(stage)
    return plots.error_heatmap(
        out, ref, title=f"NO KERNEL RAN - stand-in: {what}, |out - fp64 ref| (rounding noise)"
    )


def measure(
    stage, shapes, baselines=None, also_stages=(), variants=None, with_fa4=False, causal=False
):
    """GPU mode: time stage `stage` and its baselines (cuBLAS or SDPA, all in the same run, inputs
    rotated past L2; common.tools.bench.measure) at each shape, the stages in `also_stages`
    (same entry signature) on the same shapes, and each variant {label: settings} of the stage's
    own kernel (kernel_settings: the modified kernel is compiled anew and timed in the same run);
    print a table naming the GPU and date, draw a bar chart, return {shape: {name: TFLOP/s}}.
    with_fa4=True adds FA4 (flash_attn.cute) to the baselines where it imports. causal=True (stage
    6 on): everything causal, the baselines too, FLOPs halved as the FlashAttention papers count.
    Compile-only mode: skipped."""
    if MODE != "gpu":
        _skip("Measure", stage)
        return None
    track = arch.track()
    if not available(stage, track):
        return None
    from common.tools import plots
    from common.tools.bench import measure as bench_measure
    from common.tools.timing import gpu_and_date
    from common.tools.workloads import make_case

    gpu, date = gpu_and_date()
    results, rows = {}, []
    for shape in shapes:
        mask = dict(causal=True) if causal else {}
        case = make_case(stage, track, tuple(shape), seed=1, with_fa4=with_fa4, **mask)
        also = [
            make_case(other, track, tuple(shape), seed=1, **mask)
            for other in also_stages
            if available(other, track)
        ]
        # the stage, its baselines and the other stages in the same interleaved rounds
        res = bench_measure(case, names=baselines, also=also)
        for label, settings in (variants or {}).items():
            with kernel_settings(stage, track, **settings):
                var = bench_measure(make_case(stage, track, tuple(shape), seed=1, **mask), names=())
            res[f"stage {stage} ({label})"] = var[f"stage {stage}"]
        results[str(tuple(shape))] = {k: v[1] for k, v in res.items()}
        mine = res[f"stage {stage}"][1]
        for name, (ms, tf) in res.items():
            ratio = "-" if name == f"stage {stage}" else f"{mine / tf:.2f}x"
            rows.append((str(tuple(shape)), name, f"{ms:.3f}", f"{tf:.0f}", ratio))
        torch.cuda.empty_cache()
    _table(("shape", "kernel", "ms", "TFLOP/s", f"stage {stage} speed-up over it"), rows)
    print(
        f"measured on {gpu}, {date}; medians of CUDA-event timings after warm-up, all in this run; "
        f"'speed-up' = stage {stage}'s TFLOP/s / that kernel's (above 1: stage {stage} is faster)"
    )
    LOG["measured"].append((stage, track))
    plots.bench_bars(results, f"stage {stage} ({track}) on {gpu}, {date}")
    return results


# --------------------------------------------------------------------------------------------
# Stages 6-8: masks, GQA and packed sequences (host twins shown; kernels run, checked and timed)
# --------------------------------------------------------------------------------------------

# Where the GPU cells of stages 6-8 put their inputs (tests run these helpers with CPU stand-ins).
DEVICE = "cuda"

# (label, (B, H, Sq, Sk, D), options) run by run_and_verify_cases by default: the masks of stage 6
# with the edge cases its tests cover. Options are those of the stage's attention(); kv_heads
# (Hkv, stage 7 on) gives K and V that many heads.
MASK_CASES = (
    ("causal, Sq = Sk", (1, 4, 300, 300, 128), dict(causal=True)),
    ("causal, Sq < Sk", (1, 4, 200, 520, 128), dict(causal=True)),
    ("causal, Sq > Sk: rows with no key", (1, 4, 520, 200, 128), dict(causal=True)),
    ("window (100, 0): edge inside a tile", (1, 4, 400, 400, 128), dict(window=(100, 0))),
    ("window (128, 128), D = 64", (1, 4, 512, 512, 64), dict(window=(128, 128))),
    ("causal, Sq = 1 (decode)", (2, 4, 1, 700, 128), dict(causal=True)),
)


def table(header, rows):
    """A table: Markdown in Jupyter, aligned text elsewhere (the helpers' own tables)."""
    _table(header, rows)


def show_function(fn):
    """Display a host-side function of common/ (a stage's pure-Python twin, e.g.
    common.masks.kv_tile_range) the way show_source displays the stage files. A decorated
    function (`@cute.kernel`, `@cute.jit`) is shown from its own file, not the decorator's."""
    fn = inspect.unwrap(fn)
    rel = os.path.relpath(inspect.getsourcefile(fn), ROOT)
    _markdown(f"`{rel}`: `{fn.__qualname__}`", f"--- {rel}: {fn.__qualname__} ---")
    _code(textwrap.dedent(inspect.getsource(fn)))


def varlen_lengths(count=16, low=64, high=2048, seed=2026):
    """The packed batch of `make bench`'s stage 7 rows (common/tools/bench.py): `count` lengths
    drawn uniformly from [low, high) with a fixed seed by the CPU generator, the same on every
    machine."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (count,), generator=g).tolist()


def _gqa_expand(q, k, v):
    """K and V repeated to Q's head count (query head h reads KV head h // group): for the fp64
    reference only; the kernels read the shared heads through their TMA coordinates."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _check_row(label, shape, hkv, mask, o_chk, lse_chk):
    empty = int((~mask.any(-1)).sum())
    return (
        label,
        str(tuple(shape)) + ("" if hkv is None else f", Hkv = {hkv}"),
        str(empty),
        "-" if o_chk is None else f"{o_chk.rel_err:.2e} / {o_chk.bound:.2e}",
        "-" if lse_chk is None else f"{lse_chk.rel_err:.2e}",
        "pass",
    )


_CHECK_HEADER = (
    "case",
    "(B, H, Sq, Sk, D)",
    "rows with no key",
    "O: rel. error / bound",
    "LSE: rel. error",
    "verdict",
)


def run_and_verify_cases(stage, cases=MASK_CASES, seed=0):
    """GPU mode: run the stage's attention() on each (label, shape, options) case (bf16, outputs
    poisoned with NaN), with return_lse, and check O and LSE against the fp64 reference with the
    explicit boolean mask (common.masks.visible; never SDPA's is_causal): O within 3x PyTorch's
    own bf16 error, LSE within 1e-4, and every row that sees no key exactly O = 0, LSE = -inf
    (common.tools.verify.check_attention). Raises AssertionError on a failure. Compile-only mode:
    skipped."""
    if MODE != "gpu":
        _skip("Run and verify", stage)
        return None
    track = arch.track()
    if not available(stage, track):
        return None
    from common import masks
    from common.tools import inputs
    from common.tools.verify import check_attention, run_with_deadline

    entry = getattr(stage_table.track_module(stage, track), "attention")
    rows = []
    for i, (label, shape, options) in enumerate(cases):
        opts = dict(options)
        B, H, Sq, Sk, D = shape
        hkv = opts.pop("kv_heads", None)
        q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, torch.bfloat16, seed + i, DEVICE)
        if hkv is not None:
            _, k, v = inputs.attention_inputs(
                B, hkv, Sq, Sk, D, torch.bfloat16, seed + 100 + i, DEVICE
            )
        o, lse = run_with_deadline(
            lambda: entry(q, k, v, return_lse=True, **opts), 60, f"stage {stage} ({label})"
        )
        left, right = masks.resolve_window(opts.get("causal", False), opts.get("window"), Sq, Sk)
        mask = masks.visible(Sq, Sk, left, right, q.device)
        kf, vf = _gqa_expand(q, k, v)
        try:
            o_chk, lse_chk = check_attention(label, o, q, kf, vf, lse=lse, mask=mask)
        except AssertionError as e:
            LOG["errors"].append(f"stage {stage} {label}: {e}")
            raise
        rows.append(_check_row(label, shape, hkv, mask, o_chk, lse_chk))
        LOG["verified"].append((stage, track, tuple(shape)))
    _table(_CHECK_HEADER, rows)
    print(
        f"stage {stage} ({track}) on {arch.gpu_description()}: every case against the fp64 "
        "reference with the explicit mask; rows with no key must be O = 0 and LSE = -inf exactly"
    )
    return rows


def run_and_verify_varlen(
    stage,
    lens_q,
    lens_k=None,
    heads=4,
    kv_heads=2,
    head_dim=128,
    causal=False,
    window=None,
    seed=0,
    plant_nan=True,
):
    """GPU mode: attention_varlen on packed sequences (lens_q / lens_k tokens, GQA heads / kv_heads),
    each sequence checked against the fp64 reference of that sequence alone (its own mask,
    bottom-right per sequence). plant_nan=True then runs once more per sequence b with every row
    of Q, K and V outside b set to NaN: b's O and LSE must still pass (a tile read or written
    across a sequence boundary would carry the NaN in), and the table says whether they are
    bit for bit those of the first run. Compile-only mode: skipped."""
    if MODE != "gpu":
        _skip("Run and verify", stage)
        return None
    track = arch.track()
    if not available(stage, track):
        return None
    from common import masks
    from common.tools.verify import check_attention, run_with_deadline

    lens_k = list(lens_q) if lens_k is None else list(lens_k)
    mod = stage_table.track_module(stage, track)
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, head_dim, generator=g, device=DEVICE).to(torch.bfloat16)
    k, v = (
        torch.randn(sum(lens_k), kv_heads, head_dim, generator=g, device=DEVICE).to(torch.bfloat16)
        for _ in range(2)
    )
    cq, ck = [0], [0]
    for a, b in zip(lens_q, lens_k):
        cq.append(cq[-1] + a)
        ck.append(ck[-1] + b)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in (cq, ck))

    def run(q, k, v):
        return run_with_deadline(
            lambda: mod.attention_varlen(
                q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True
            ),
            60,
            f"stage {stage} attention_varlen",
        )

    def check(b, o, lse, label):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            return None, None, None
        as_bhsd = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
        qb, ob, lb = as_bhsd(q[q0:q1]), as_bhsd(o[q0:q1]), lse[:, q0:q1].unsqueeze(0)
        if k1 == k0:
            if not ((ob == 0).all() and (lb == float("-inf")).all()):
                raise AssertionError(f"{label}: no key at all, yet O != 0 or LSE != -inf")
            return torch.zeros(q1 - q0, 0, dtype=torch.bool), None, None
        kb, vb = _gqa_expand(qb, as_bhsd(k[k0:k1]), as_bhsd(v[k0:k1]))
        left, right = masks.resolve_window(causal, window, q1 - q0, k1 - k0)
        mask = masks.visible(q1 - q0, k1 - k0, left, right, q.device)
        o_chk, lse_chk = check_attention(label, ob, qb, kb, vb, lse=lb, mask=mask)
        return mask, o_chk, lse_chk

    header = _CHECK_HEADER[:-1] + ("NaN outside it: verdict, bits", "verdict")
    rows = []
    try:
        o, lse = run(q, k, v)
        for b in range(len(lens_q)):
            label = f"sequence {b}"
            mask, o_chk, lse_chk = check(b, o, lse, label)
            if mask is None:
                rows.append((label, f"Sq = 0, Sk = {lens_k[b]}", "-", "-", "-", "-", "no rows"))
                continue
            planted = "-"
            if plant_nan:
                qn, kn, vn = q.clone(), k.clone(), v.clone()
                for t, c in ((qn, cq), (kn, ck), (vn, ck)):
                    t[: c[b]] = float("nan")
                    t[c[b + 1] :] = float("nan")
                on, lsen = run(qn, kn, vn)
                check(b, on, lsen, f"{label}, NaN planted outside it")
                same = torch.equal(on[cq[b] : cq[b + 1]], o[cq[b] : cq[b + 1]]) and torch.equal(
                    lsen[:, cq[b] : cq[b + 1]], lse[:, cq[b] : cq[b + 1]]
                )
                planted = "pass, " + ("identical" if same else "differ")
            row = _check_row(
                label, (1, heads, lens_q[b], lens_k[b], head_dim), kv_heads, mask, o_chk, lse_chk
            )
            rows.append(row[:-1] + (planted, "pass"))
    except AssertionError as e:
        LOG["errors"].append(f"stage {stage} attention_varlen: {e}")
        raise
    _table(header, rows)
    mask_txt = "causal" if causal else f"window {window}" if window else "no mask"
    print(
        f"stage {stage} ({track}) attention_varlen on {arch.gpu_description()}: {len(lens_q)} "
        f"packed sequences, H = {heads}, Hkv = {kv_heads}, D = {head_dim}, {mask_txt}"
    )
    LOG["verified"].append((stage, track, ("varlen", tuple(lens_q), tuple(lens_k))))
    return rows


def measure_masks(stage, shapes, mask_options=None, with_fa4=False):
    """GPU mode: time the stage with each mask of `mask_options` ({label: attention() options},
    default causal) and without a mask, at each (B, H, Sq, Sk, D), all in the same run (inputs
    rotated past L2); causal also against SDPA flash and cuDNN causal (and FA4 with with_fa4).
    FLOPs: causal as the FlashAttention papers count it (half the full count), other masks the
    visible (query, key) pairs x 4 D. Next to each time: its ratio to the no-mask time and the
    share of tile pairs the kernel computes (common.masks.tile_counts), the ideal of that ratio.
    Compile-only mode: skipped."""
    if MODE != "gpu":
        _skip("Measure", stage)
        return None
    track = arch.track()
    if not available(stage, track):
        return None
    from common import masks
    from common.tools import plots
    from common.tools.bench import measure as bench_measure
    from common.tools.timing import gpu_and_date
    from common.tools.workloads import make_case

    mask_options = mask_options or {"causal": dict(causal=True)}
    bM, bN = kernel_config(stage, track).get("cta_tile", (128, 128))[:2]
    entry = getattr(stage_table.track_module(stage, track), "attention")
    gpu, date = gpu_and_date()
    me = f"stage {stage}"
    results, rows = {}, []
    for shape in shapes:
        B, H, Sq, Sk, D = shape
        full_case = make_case(stage, track, tuple(shape), seed=1)
        ms_full, tf_full = bench_measure(full_case, names=())[me]
        res = {f"{me} (no mask)": tf_full}
        rows.append(
            (str(tuple(shape)), me, "none", f"{ms_full:.3f}", f"{tf_full:.0f}", "1.00", "1.00")
        )
        for label, opts in mask_options.items():
            left, right = masks.resolve_window(
                opts.get("causal", False), opts.get("window"), Sq, Sk
            )
            counts = masks.tile_counts(Sq, Sk, left, right, bM, bN)
            share = (counts["partial"] + counts["full"]) / counts["all"]
            if opts == {"causal": True}:
                case = make_case(stage, track, tuple(shape), seed=1, with_fa4=with_fa4, causal=True)
                timed = bench_measure(case)
            else:
                case = dataclasses.replace(
                    full_case,
                    fn=lambda q, k, v, o=dict(opts): entry(q, k, v, **o),
                    flops=4 * B * H * D * masks.visible_pairs(Sq, Sk, left, right),
                    baselines={},
                )
                timed = bench_measure(case, names=())
            for name, (ms, tf) in timed.items():
                mine = name == me
                res[f"{name} ({label})"] = tf
                rows.append(
                    (
                        str(tuple(shape)),
                        name,
                        label,
                        f"{ms:.3f}",
                        f"{tf:.0f}",
                        f"{ms / ms_full:.2f}" if mine else "-",
                        f"{share:.3f}" if mine else "-",
                    )
                )
        results[str(tuple(shape))] = res
        torch.cuda.empty_cache()
    _table(
        (
            "shape",
            "kernel",
            "mask",
            "ms",
            "TFLOP/s",
            f"time / {me} no-mask time",
            "tile pairs computed / all",
        ),
        rows,
    )
    print(
        f"measured on {gpu}, {date}; medians of CUDA-event timings after warm-up, all in this run. "
        "The last two columns side by side: the time the mask saves against the tiles it skips."
    )
    LOG["measured"].append((stage, track))
    plots.bench_bars(results, f"stage {stage} ({track}) with masks on {gpu}, {date}")
    return results


def measure_varlen(stage, lens=None, heads=16, head_dim=128, causal=(False, True), with_fa4=False):
    """GPU mode: packed sequences (lens tokens each; default varlen_lengths(), make bench's batch)
    through the stage's attention_varlen, against the same batch padded to the longest sequence
    through the stage's own attention() (B = len(lens): the work padding costs) and through SDPA
    cuDNN with a key-padding mask (where cuDNN refuses the mask: without it, the same padded
    work, as make bench does), and FA4's varlen with with_fa4, all in the same run. Useful
    TFLOP/s count the real tokens' FLOPs only. The padded runs are timed, not checked (the
    stage's padded run has no key-padding mask; its time is that of the padded work).
    Compile-only mode: skipped."""
    if MODE != "gpu":
        _skip("Measure", stage)
        return None
    track = arch.track()
    if not available(stage, track):
        return None
    from torch.nn.attention import SDPBackend

    from common.outputs import no_poison
    from common.tools import plots, reference, timing
    from common.tools.timing import gpu_and_date

    lens = list(lens or varlen_lengths())
    mod = stage_table.track_module(stage, track)
    gpu, date = gpu_and_date()
    H, D, n_seq = heads, head_dim, len(lens)
    total, longest = sum(lens), max(lens)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(total, H, D, device=DEVICE).to(torch.bfloat16) for _ in range(3))
    padded = [torch.zeros(n_seq, H, longest, D, device=DEVICE, dtype=q.dtype) for _ in range(3)]
    keep = torch.zeros(n_seq, longest, dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(lens):
        for t, src in zip(padded, (q, k, v)):
            t[b, :, :n] = src[offsets[b] : offsets[b] + n].transpose(0, 1)
        keep[b, :n] = True
    fa4 = None
    if with_fa4:
        try:
            from flash_attn.cute import flash_attn_varlen_func as fa4
        except Exception:
            note("FA4 (flash_attn.cute) does not import here: its varlen row is left out.")
    me = f"stage {stage}"
    results, rows = {}, []
    with no_poison():
        for c in causal:
            flops = sum(reference.attention_flops(1, H, n, n, D, c) for n in lens)
            runs = {
                f"{me} packed": lambda c=c: mod.attention_varlen(
                    q, k, v, cu, cu, longest, longest, causal=c
                ),
                f"{me} padded batch": lambda c=c: mod.attention(*padded, causal=c),
            }
            qi = torch.arange(longest, device=DEVICE)
            sdpa_mask = keep[:, None, None, :]
            if c:
                sdpa_mask = sdpa_mask & (qi[None, :] <= qi[:, None])[None, None]

            cudnn = timing.pinned(
                SDPBackend.CUDNN_ATTENTION,
                lambda m=sdpa_mask: torch.nn.functional.scaled_dot_product_attention(
                    *padded, attn_mask=m
                ),
            )
            # Where cuDNN takes no boolean mask: the same padded work (the padding's results are
            # discarded), as make bench falls back to.
            cudnn_unmasked = timing.pinned(
                SDPBackend.CUDNN_ATTENTION,
                lambda c=c: torch.nn.functional.scaled_dot_product_attention(*padded, is_causal=c),
            )

            runs["SDPA cuDNN padded (key mask)"] = cudnn
            runs["SDPA cuDNN padded (no mask, same work)"] = cudnn_unmasked
            if fa4 is not None:
                runs["FA4 varlen"] = lambda c=c: fa4(
                    q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=c
                )
            timed = {}
            for name, fn in runs.items():
                if name.startswith("SDPA cuDNN padded (no mask") and any(
                    n.startswith("SDPA cuDNN") for n in timed
                ):
                    continue  # the masked run worked: no fallback needed
                try:
                    fn()
                    timed[name] = timing.time_ms(fn, [()])
                except Exception as e:  # a backend that cannot run this is reported, not fatal
                    print(f"{name}: not available ({type(e).__name__}: {str(e)[:80]})")
            mine = timed.get(f"{me} packed")
            label = "causal" if c else "no mask"
            res = {}
            for name, ms in timed.items():
                tf = timing.tflops(flops, ms)
                res[name] = tf
                pairs = total if "packed" in name or "varlen" in name else n_seq * longest
                rows.append(
                    (
                        label,
                        name,
                        f"{pairs} x {H}",
                        f"{ms:.3f}",
                        f"{tf:.0f}",
                        "-" if name == f"{me} packed" or mine is None else f"{ms / mine:.2f}x",
                    )
                )
            results[label] = res
    _table(
        ("mask", "kernel", "query rows x heads", "ms", "useful TFLOP/s", "packed speed-up"),
        rows,
    )
    print(
        f"measured on {gpu}, {date}: {n_seq} sequences of {min(lens)}-{longest} tokens "
        f"({total} in all; padded: {n_seq} x {longest} = {n_seq * longest}), H = {H}, D = {D}; "
        "useful TFLOP/s count the real tokens' FLOPs only"
    )
    LOG["measured"].append((stage, track))
    plots.bench_bars(results, f"stage {stage} ({track}) packed vs padded on {gpu}, {date}")
    return results


def measure_calls(stage, calls, title=None):
    """GPU mode: time each of `calls` ({label: (fn, flops)}, fn() launching the work on inputs it
    holds) in the same run (medians of CUDA-event timings after warm-up, inputs not rotated: use
    inputs larger than L2), print ms and TFLOP/s next to the first call's, draw the bars, return
    {label: TFLOP/s}. For comparisons the other helpers do not make (GQA against MHA, say).
    Compile-only mode: skipped."""
    if MODE != "gpu":
        _skip("Measure", stage)
        return None
    track = arch.track()
    if not available(stage, track):
        return None
    from common.outputs import no_poison
    from common.tools import plots, timing

    gpu, date = timing.gpu_and_date()
    rows, res, first = [], {}, None
    with no_poison():
        for label, (fn, flops) in calls.items():
            fn()
            ms = timing.time_ms(fn, [()])
            tf = timing.tflops(flops, ms)
            first = first if first is not None else tf
            res[label] = tf
            rows.append((label, f"{ms:.3f}", f"{tf:.0f}", f"{tf / first:.2f}"))
    _table(("call", "ms", "TFLOP/s", f"TFLOP/s / {next(iter(calls))}'s"), rows)
    print(f"measured on {gpu}, {date}; all in this run")
    LOG["measured"].append((stage, track))
    plots.bench_bars({title or f"stage {stage}": res}, f"stage {stage} ({track}) on {gpu}, {date}")
    return res


# --------------------------------------------------------------------------------------------
# Blackwell: the TMEM plan of a stage
# --------------------------------------------------------------------------------------------

_TMEM_ATTRS = {"S": "tmem_s_offset", "P": "tmem_p_offset", "O": "tmem_o_offset"}


def tmem_plan(stage, head_dim=128, block_n=128):
    """(regions, alloc_cols, source) for plots.tmem_columns: read from the Blackwell kernel object
    when it exposes tmem_*_offset attributes, else the plan of the stage description (S: block_n
    fp32 columns at 0; P: block_n bf16 = block_n / 2 columns written over S from column 32; O:
    head_dim fp32 columns after S)."""
    if stage <= 2:
        name = "C" if stage == 1 else "S"
        regions, alloc = [(name, 0, block_n, "fp32 accumulator")], block_n
    else:
        regions = [
            ("S", 0, block_n, "fp32"),
            ("P", 32, block_n // 2, "bf16, 2 per column"),
            ("O", block_n, head_dim, "fp32"),
        ]
        alloc = 1 << (block_n + head_dim - 1).bit_length()
    source = "the stage plan (the stage file exposes no tmem_*_offset attributes)"
    if os.path.exists(stage_path(stage, "blackwell")) and stage_table.available(stage, "blackwell"):
        try:
            mod = stage_table.track_module(stage, "blackwell")
            kernel, _ = mod.compile_args(torch.bfloat16, stage_table.stage(stage).compile_shape)
            found = {}
            for reg, attr in _TMEM_ATTRS.items():
                v = getattr(kernel, attr, None)
                if isinstance(v, int):
                    found[reg] = v
            if found:
                regions = [
                    (n, found.get("S" if n == "C" else n, s), w, what) for n, s, w, what in regions
                ]
                # Stage 1's GEMM accumulator sits where S will from stage 2 on (tmem_s_offset).
                names = {"S": "the accumulator (S from stage 2 on)"} if stage == 1 else {}
                source = (
                    "the offsets the stage file's Sm100Kernel sets ("
                    + ", ".join(f"{names.get(k, k)} at column {v}" for k, v in found.items())
                    + ")"
                )
            alloc = getattr(kernel, "num_tmem_alloc_cols", None) or alloc
        except Exception as e:  # the picture still shows the plan
            source += f"; reading the kernel failed: {type(e).__name__}"
    return regions, alloc, source


def show_tmem(stage, head_dim=128, block_n=128):
    from common.tools import plots

    regions, alloc, source = tmem_plan(stage, head_dim, block_n)
    print(f"TMEM columns from {source}")
    return plots.tmem_columns(
        regions,
        alloc_cols=alloc,
        title=f"Stage {stage}, Blackwell: tensor memory of one CTA (128 lanes x 512 columns)",
    )


def exercise(id):
    """Show exercise `id` (common/tools/exercises.py): the file to edit and what to do."""
    from common.tools import exercises

    ex = exercises.exercise(id)
    rel = os.path.relpath(ex.path, ROOT)
    _markdown(
        f"**Exercise {ex.id}** (edit `{rel}`): {ex.task}\n\nThen re-run the next cell: it loads "
        "the file as it is on disk now, "
        + (
            "compiles it without a GPU"
            if os.path.basename(ex.path) in ("hopper.py", "blackwell.py")
            else "runs its check on the CPU"
        )
        + " and says whether the edit did what was asked"
        + (
            "; on a GPU of this track it also runs the edited kernel and says what its output "
            "does against the fp64 reference"
            if ex.gpu_check is not None
            else ""
        )
        + ". Undo the edit afterwards (`git checkout "
        + rel
        + "`).",
        plain=f"Exercise {ex.id} (edit {rel}): {ex.task}",
    )


def check_exercise(id):
    """The check cell of exercise `id`: 'done' or 'not yet', with what it measured."""
    from common.tools import exercises

    r = exercises.check(id, show=False)
    _markdown(f"**Exercise {id}, {r}**", f"exercise {id}: {r}")
    return r
