"""What the notebooks call: show a stage's code and its diffs, compile it, run and check it,
time it. The notebooks import the stage files and display them; they never paste kernels.

MODE is "gpu" when this machine's GPU runs one of the two tracks (then the GPU cells launch
the kernels and check them), else "compile-only" (the GPU cells say they are skipped and why,
and show the compile summary instead). Override with TUTORIAL_NB_MODE=gpu|compile-only.
Every helper that does not need a GPU works without one."""

import ast
import dataclasses
import difflib
import inspect
import os
import re
import shutil
import subprocess
import textwrap
import time

import torch

from . import arch, stages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
LOG = {"stage": None, "compiled": [], "verified": [], "measured": [], "missing": [], "errors": []}

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


# --------------------------------------------------------------------------------------------
# Display: rich in Jupyter, plain text under common/nbrun.py and in scripts
# --------------------------------------------------------------------------------------------


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _code(text, language="python"):
    if _ipython():
        from IPython.display import Code, display

        display(Code(text, language=language))
    else:
        print(text)


def _markdown(md, plain=None):
    if _ipython():
        from IPython.display import Markdown, display

        display(Markdown(md))
    else:
        print(plain if plain is not None else md)


def _table(header, rows):
    """A table as Markdown in Jupyter, as aligned text elsewhere."""
    rows = [[str(x) for x in r] for r in rows]
    md = (
        "| "
        + " | ".join(header)
        + " |\n|"
        + " --- |" * len(header)
        + "\n"
        + "\n".join("| " + " | ".join(r) + " |" for r in rows)
    )
    widths = (
        [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        if rows
        else [len(h) for h in header]
    )
    plain = "\n".join(
        [
            " | ".join(h.ljust(w) for h, w in zip(header, widths)),
            "-+-".join("-" * w for w in widths),
        ]
        + [" | ".join(x.ljust(w) for x, w in zip(r, widths)) for r in rows]
    )
    _markdown(md, plain)


def note(text):
    """A visible note (a missing stage file, a skipped GPU cell)."""
    _markdown(f"> **Note.** {text}", f"NOTE: {text}")


# --------------------------------------------------------------------------------------------
# Stage files
# --------------------------------------------------------------------------------------------


def stage_path(stage, track, relative=False):
    rel = os.path.join("stages", stages.stage(stage).package, f"{track}.py")
    return rel if relative else os.path.join(ROOT, rel)


def available(stage, track):
    """Whether stage `stage` of `track` exists; if not, say so once (no exception)."""
    if track not in arch.TRACKS:
        raise ValueError(f"track = {track!r}; allowed: {', '.join(arch.TRACKS)}")
    if os.path.exists(stage_path(stage, track)) and stages.available(stage, track):
        return True
    if (stage, track) not in LOG["missing"]:
        LOG["missing"].append((stage, track))
        note(
            f"`{stage_path(stage, track, True)}` does not exist yet (stage {stage}, {track} track). "
            "The cells that need it show this note instead; re-run the notebook once the file has landed."
        )
    return False


def start(stage):
    """First cell of every notebook: where we are, what will run, which files exist."""
    st = stages.stage(stage)
    for k in LOG:
        LOG[k] = [] if isinstance(LOG[k], list) else None
    LOG["stage"] = stage
    gpu = arch.gpu_description()
    if MODE == "gpu":
        what = (
            f"**GPU mode** on {gpu}: the {TRACK} kernels are launched and checked against the "
            "fp64 reference; the other track is compile-checked."
        )
    else:
        why = (
            "there is no CUDA GPU here"
            if GPU_TRACK is None and arch.compute_capability() is None
            else f"{gpu} runs neither track"
            if GPU_TRACK is None
            else "TUTORIAL_NB_MODE=compile-only"
        )
        what = (
            f"**Compile-only mode** ({why}): every stage is compiled for sm_90a and sm_100a with fake "
            "tensors and its PTX inspected; the cells that launch kernels say they are skipped."
        )
    have = []
    for n in sorted({max(1, stage - 1), stage}):
        for t in arch.TRACKS:
            ok = os.path.exists(stage_path(n, t))
            have.append(f"`{stage_path(n, t, True)}` {'present' if ok else 'not written yet'}")
    _markdown(
        f"Stage {stage} - {st.title}. {what}\n\n" + "; ".join(have) + ".",
        f"Stage {stage} - {st.title}. {what}\n" + "; ".join(have) + ".",
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


def _ast_lookup(source, qualname):
    """Source text of a top-level object or a method (Class.method), decorators included."""
    tree = ast.parse(source)
    lines = source.splitlines()
    body, node = tree.body, None
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
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))


def _get_source(stage, track, qualname):
    """inspect.getsource of the imported object; the file's own text (ast) if it does not import."""
    try:
        obj = stages.track_module(stage, track)
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


def kernel_config(stage, track="hopper"):
    """The settings the kernel class's __init__ fixes (tile sizes, pipeline depths, warp roles...),
    read from the object compile_args builds: {name: int | float | str | bool | tuple}. The
    pictures take their parameters from here, so they follow the stage file."""
    if not available(stage, track):
        return {}
    try:
        kernel, _ = stages.track_module(stage, track).compile_args(
            torch.bfloat16, stages.stage(stage).compile_shape
        )
    except Exception as e:
        note(f"could not build the stage {stage} ({track}) kernel object: {type(e).__name__}: {e}")
        LOG["errors"].append(f"stage {stage} {track}: compile_args failed: {e}")
        return {}
    simple = (int, float, str, bool, tuple)
    return {
        k: v for k, v in vars(kernel).items() if isinstance(v, simple) and not k.startswith("_")
    }


def show_config(stage, track="hopper"):
    """kernel_config as a table."""
    cfg = kernel_config(stage, track)
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


def show_diff(stage, track="hopper", max_lines=None):
    """What stage `stage` changes over stage - 1 in the same track: the output of
    `make diff-N TRACK=track`."""
    if stage < 2:
        note("stage 1 is the first stage: there is no previous stage to diff against.")
        return
    if not (available(stage - 1, track) and available(stage, track)):
        return
    old, new = stage_path(stage - 1, track, True), stage_path(stage, track, True)
    text = diff_text(old, new)
    plus, minus = _diff_stat(text)
    _markdown(
        f"`make diff-{stage} TRACK={track}`: **+{plus} -{minus}** lines",
        f"--- make diff-{stage} TRACK={track}: +{plus} -{minus} lines ---",
    )
    _show_diff_text(text, max_lines, f"make diff-{stage} TRACK={track}")


def show_cross_track_diff(stage, max_lines=300):
    """hopper.py against blackwell.py of one stage: the same algorithm, another machine."""
    if not (available(stage, "hopper") and available(stage, "blackwell")):
        return
    old, new = stage_path(stage, "hopper", True), stage_path(stage, "blackwell", True)
    text = diff_text(old, new)
    plus, minus = _diff_stat(text)
    _markdown(
        f"`{old}` -> `{new}`: **+{plus} -{minus}** lines",
        f"--- {old} -> {new}: +{plus} -{minus} lines ---",
    )
    _show_diff_text(text, max_lines, f"git diff --no-index {old} {new}")


# --------------------------------------------------------------------------------------------
# Compiling (no GPU needed)
# --------------------------------------------------------------------------------------------

_REPORTS = {}


def compile_report(stage, track, shape=None):
    """common.compile.compile_only, cached per (stage, track, shape) for this process; None (and
    a note) when the file is missing or does not compile."""
    if not available(stage, track):
        return None
    key = (stage, track, tuple(shape) if shape else None)
    if key not in _REPORTS:
        from .compile import compile_only

        try:
            _REPORTS[key] = compile_only(stage, track, shape=shape)
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            note(f"stage {stage} ({track}) does not compile: {msg}")
            LOG["errors"].append(f"stage {stage} {track}: compile failed: {msg}")
            return None
    r = _REPORTS[key]
    if (stage, track) not in LOG["compiled"]:
        LOG["compiled"].append((stage, track))
    return r


def compile_summary(stage, track="hopper", shape=None, patterns=None, excerpt_lines=3):
    """Compile stage `stage` of `track` for its arch with fake tensors (no GPU) and show: compile
    time, registers and spills (ptxas), dynamic shared memory, how many of each instruction family
    the PTX holds, and a few PTX lines of the families the stage is about."""
    r = compile_report(stage, track, shape)
    if r is None:
        return None
    res = r.resources or {}
    rows = [
        ("target", f"{r.arch} ({track})"),
        ("shape", str(r.shape)),
        ("dtype", r.dtype),
        ("compile time", f"{r.seconds:.1f} s"),
    ]
    if "registers" in res:
        rows.append(("registers / thread", str(res["registers"])))
        rows.append(
            (
                "spills (store / load bytes)",
                f"{res.get('spill_stores', 0)} / {res.get('spill_loads', 0)}",
            )
        )
    elif res.get("error"):
        rows.append(("ptxas", res["error"][:80]))
    else:
        rows.append(("registers / thread", "(ptxas not installed)"))
    if r.shared_memory_bytes:
        smem = r.shared_memory_bytes
        rows.append(("dynamic shared memory / CTA", f"{smem} B ({smem / 1024:.1f} KiB)"))
    rows += [(f"PTX: {k}", str(v)) for k, v in r.counts.items() if v]
    _markdown(
        f"**Compile summary, stage {stage} ({track})**",
        f"=== compile summary, stage {stage} ({track}) ===",
    )
    _table(("", "value"), rows)
    from .compile import ptx_lines

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
    check: object  # common.checker.CheckResult of the main output
    lse_check: object  # CheckResult of the LSE (stage 5), else None


def _skip(what, stage):
    why = (
        "no CUDA GPU is visible"
        if arch.compute_capability() is None
        else f"{arch.gpu_description()} runs neither track"
        if GPU_TRACK is None
        else "TUTORIAL_NB_MODE=compile-only"
    )
    note(
        f"{what} skipped: this cell launches the stage {stage} kernel, which needs an sm_90 (H100/H200) or "
        f"sm_100 (B200/GB200) GPU, and {why}."
    )


def run_and_verify(stage, shape=None, seed=0):
    """GPU mode: launch stage `stage` of this GPU's track on seeded inputs (outputs poisoned with
    NaN first), wait with a deadline, and check against the fp64 reference and PyTorch's own
    low-precision error (common.checker); raise AssertionError with the report if it fails.
    Compile-only mode: say that the cell is skipped and why, and show the compile summary."""
    shape = tuple(shape or stages.stage(stage).compile_shape)
    if MODE != "gpu":
        _skip("Run and verify", stage)
        compile_summary(stage, TRACK)
        return None
    track = arch.track()
    if not available(stage, track):
        return None
    from .cases import make_case
    from .checker import compare, run_with_deadline

    case = make_case(stage, track, shape, seed=seed)
    t0 = time.perf_counter()
    out = run_with_deadline(case.run, 60, f"stage {stage} ({track})")
    first = time.perf_counter() - t0
    ref = case.ref()
    chk = compare(
        f"stage {stage} {track} {shape}", out, ref, rtol=case.rtol, torch_lowp=case.lowp()
    )
    lse_chk = None
    if stage == 5:
        from .reference import attention_ref

        entry = getattr(stages.track_module(stage, track), stages.stage(stage).entry)
        q, k, v = case.args
        _, lse = run_with_deadline(
            lambda: entry(q, k, v, return_lse=True), 60, "stage 5 with return_lse"
        )
        # LSE is fp32 from fp32 statistics: a relative error around 1e-6 is expected; 1e-4 leaves room
        # for exp2/log2 approximations and would still catch a wrong base (log2 vs ln) or a missing scale.
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
    print(f"first launch (compile + run) took {first:.1f} s on {arch.gpu_description()}")
    for c in (chk, lse_chk):
        if c is not None and not c.passed:
            LOG["errors"].append(str(c))
            raise AssertionError(str(c))
    LOG["verified"].append((stage, track, shape))
    return Verification(stage, track, shape, out, ref, chk, lse_chk)


def _cpu_standin(stage, seed=0):
    """PyTorch's own low-precision result against fp64, on the CPU, for a small shape: what
    bf16 rounding alone costs, shown where no GPU can run the kernel."""
    from . import inputs, reference

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


def error_picture(stage, result=None):
    """|out - ref| of the kernel's checked output (GPU mode), or, without a GPU, the same map for
    PyTorch's own bf16 computation on the CPU (the yardstick the kernel is held to)."""
    from . import plots

    if result is not None:
        return plots.error_heatmap(
            result.out,
            result.ref,
            title=f"stage {stage} ({result.track}) |out - ref|, {arch.gpu_description()}",
        )
    out, ref, what = _cpu_standin(stage)
    return plots.error_heatmap(out, ref, title=f"no kernel run here - {what}: |out - fp64 ref|")


def measure(stage, shapes, baselines=None, also_stages=()):
    """GPU mode: time stage `stage` and its baselines (cuBLAS or SDPA, all in the same run, inputs
    rotated past L2; common.benchmarks.measure) at each shape, and the stages in `also_stages`
    (same entry signature) on the same shapes; print a table naming the GPU and date, draw a bar
    chart, return {shape: {name: TFLOP/s}}. Compile-only mode: skipped."""
    if MODE != "gpu":
        _skip("Measure", stage)
        return None
    track = arch.track()
    if not available(stage, track):
        return None
    from . import plots
    from .bench import gpu_and_date
    from .benchmarks import measure as bench_measure
    from .cases import make_case

    gpu, date = gpu_and_date()
    results, rows = {}, []
    for shape in shapes:
        res = bench_measure(make_case(stage, track, tuple(shape), seed=1), names=baselines)
        for other in also_stages:
            if available(other, track):
                res.update(bench_measure(make_case(other, track, tuple(shape), seed=1), names=()))
        results[str(tuple(shape))] = {k: v[1] for k, v in res.items()}
        mine = res[f"stage {stage}"][1]
        for name, (ms, tf) in res.items():
            ratio = "" if name == f"stage {stage}" else f"{tf / mine:.2f}x"
            rows.append((str(tuple(shape)), name, f"{ms:.3f}", f"{tf:.0f}", ratio))
        torch.cuda.empty_cache()
    _table(("shape", "kernel", "ms", "TFLOP/s", "baseline / stage"), rows)
    print(
        f"measured on {gpu}, {date}; medians of CUDA-event timings after warm-up, all in this run"
    )
    LOG["measured"].append((stage, track))
    plots.bench_bars(results, f"stage {stage} ({track}) on {gpu}, {date}")
    return results


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
    if os.path.exists(stage_path(stage, "blackwell")) and stages.available(stage, "blackwell"):
        try:
            mod = stages.track_module(stage, "blackwell")
            kernel, _ = mod.compile_args(torch.bfloat16, stages.stage(stage).compile_shape)
            found = {}
            for reg, attr in _TMEM_ATTRS.items():
                v = getattr(kernel, attr, None)
                if isinstance(v, int):
                    found[reg] = v
            if found:
                regions = [
                    (n, found.get("S" if n == "C" else n, s), w, what) for n, s, w, what in regions
                ]
                source = (
                    "the offsets the stage file's Sm100Kernel sets ("
                    + ", ".join(f"{k} at column {v}" for k, v in found.items())
                    + ")"
                )
            alloc = getattr(kernel, "num_tmem_alloc_cols", None) or alloc
        except Exception as e:  # the picture still shows the plan
            source += f"; reading the kernel failed: {type(e).__name__}"
    return regions, alloc, source


def show_tmem(stage, head_dim=128, block_n=128):
    from . import plots

    regions, alloc, source = tmem_plan(stage, head_dim, block_n)
    print(f"TMEM columns from {source}")
    return plots.tmem_columns(
        regions,
        alloc_cols=alloc,
        title=f"Stage {stage}, Blackwell: tensor memory of one CTA (128 lanes x 512 columns)",
    )
