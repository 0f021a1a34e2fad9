"""Exercises that edit a kernel, and the checks that say whether the edit did what was asked.

A learner opens the stage file named by the exercise, makes the edit, and re-runs the notebook's
check cell, which calls `check(id)`. The check loads the stage file *as it is on disk now* under a
fresh module name (no restart, no stale import), compiles it for its track's arch with fake
tensors (no GPU needed) and reads what the edit must change: PTX instruction counts, the shared
memory the kernel asks for, the CPU schedule model's verdict. It prints "done" or "not yet" with
the numbers it saw, and returns a Result.

Each exercise also carries its `solution`: the exact text replacements in the stage file that do
what it asks. The tests (tests/test_exercises.py) apply it to a copy of the file and require the
check to say "done", and require it to say "not yet" on the file as committed, so a check that
cannot fail, or a solution that no longer applies, fails CI.
"""

import atexit
import dataclasses
import importlib.util
import itertools
import os
import re
import shutil
import sys
import tempfile
import types
from typing import Callable

from common.arch import gpu_track_available
from common.tools import stage_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FRESH = itertools.count()


@dataclasses.dataclass(frozen=True)
class Result:
    done: bool
    message: str

    def __str__(self):
        return ("done: " if self.done else "not yet: ") + self.message

    def __repr__(self):
        # What Jupyter or a REPL echoes after check() has printed the message: not it again.
        return f"Result(done={self.done})"


@dataclasses.dataclass(frozen=True)
class Exercise:
    id: str  # "4a": stage 4, first exercise
    stage: int
    track: str  # the track whose file the learner edits
    task: str  # what to change and what to watch, in the notebook's words
    solution: tuple  # ((old text, new text), ...): each old text occurs once in the file
    check: Callable  # check(module) -> Result, on the stage module as loaded from disk
    hint: str = ""  # one line for a stuck learner: python -m common.tools.exercises ID --hint
    # gpu_check(module) -> str: what the edited kernel does on a GPU of its track (its output
    # against the fp64 reference); run only where such a GPU exists, appended to the Result.
    gpu_check: Callable | None = None
    # The file the learner edits, relative to the repository root, where it is not the track's
    # kernel file: stage 15's ring.py, the same on both tracks (track None).
    file: str = ""

    @property
    def path(self):
        return os.path.join(ROOT, self.file) if self.file else stage_path(self.stage, self.track)


def stage_path(stage, track):
    return os.path.join(ROOT, "stages", stage_table.stage(stage).package, f"{track}.py")


def load_stage_file(stage, track, edits=(), path=None):
    """Import the stage file (default: the one on disk now) under a fresh module name, after
    applying `edits` ((old, new) text replacements, each of which must match exactly once)."""
    path = path or stage_path(stage, track)
    with open(path) as f:
        text = f.read()
    for old, new in edits:
        n = text.count(old)
        if n != 1:
            raise ValueError(
                f"{os.path.relpath(path, ROOT)}: the text to replace occurs {n} times "
                f"(needs exactly 1): {old!r}"
            )
        text = text.replace(old, new)
    # The DSL reads a @cute.jit function's source from its file when it compiles, so the copy
    # stays on disk until the process ends.
    name = f"_exercise_stage{stage}_{track}_{next(_FRESH)}"
    tmp = os.path.join(_scratch(), f"{name}.py")
    with open(tmp, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(name, tmp)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception:
        del sys.modules[name]
        raise
    return mod


_SCRATCH = []


def _scratch():
    if not _SCRATCH:
        d = tempfile.mkdtemp(prefix="exercises-")
        atexit.register(shutil.rmtree, d, True)
        _SCRATCH.append(d)
    return _SCRATCH[0]


def compile_module(mod, track, dtype=None, shape=(2, 4, 512, 1024, 128), **options):
    """(kernel, ptx, cubin) of `mod`'s kernel compiled for the track's arch with fake tensors."""
    import torch

    from common.arch import ARCH_OF_TRACK
    from common.tools.ptx import compile_for_arch

    kernel, args = mod.compile_args(dtype or torch.bfloat16, shape, **options)
    ptx, cubin = compile_for_arch(kernel, args, ARCH_OF_TRACK[track])
    return kernel, ptx, cubin


def gpu_attention_error(
    mod, shape=(2, 4, 512, 1024, 128), kv_heads=None, nan_keys=0, deadline=60, **options
):
    """Run the (edited) module's attention on a GPU with seeded inputs and return (relative error
    of O against the fp64 reference, whether O holds NaN). nan_keys > 0 plants NaN in the first
    nan_keys keys of K and V, which the reference treats as 0 (they must be keys no query sees).
    A kernel that has not finished `deadline` seconds after its launch raises TimeoutError."""
    import torch

    from common import masks
    from common.tools import inputs, reference
    from common.tools.verify import rel_err, run_with_deadline

    B, H, Sq, Sk, D = shape
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, seed=3)
    if kv_heads:
        _, k, v = inputs.attention_inputs(B, kv_heads, Sq, Sk, D, seed=4)
    if nan_keys:
        k[:, :, :nan_keys] = float("nan")
        v[:, :, :nan_keys] = float("nan")
    o = run_with_deadline(lambda: mod.attention(q, k, v, **options), deadline, "the edited kernel")
    torch.cuda.synchronize()
    kr, vr = k.nan_to_num(0.0), v.nan_to_num(0.0)
    if kv_heads:
        kr, vr = (t.repeat_interleave(H // kv_heads, dim=1) for t in (kr, vr))
    mask = None
    if options.get("causal") or options.get("window"):
        lr = masks.resolve_window(options.get("causal", False), options.get("window"), Sq, Sk)
        mask = masks.visible(Sq, Sk, *lr, device=q.device)
    ref, _ = reference.attention_ref(q, kr, vr, mask=mask)
    has_nan = bool(torch.isnan(o).any())
    return (float("nan") if has_nan else rel_err(o, ref)), has_nan


def describe_error(err, has_nan):
    if has_nan:
        return "O holds NaN"
    verdict = "right" if err < 1e-2 else "wrong"
    return f"O is {verdict}: relative error {err:.1e} against the fp64 reference"


def gpu_attention_in_subprocess(
    mod, shape=(2, 4, 512, 1024, 128), seconds=30, compile_seconds=600, **options
):
    """Run the (edited) module's attention on the GPU in a Python process of its own, with a
    deadline, and say what happened: the kernel's output against the fp64 reference
    (describe_error), or that it did not finish. A kernel that hangs (a barrier that never
    completes) leaves the GPU context of its process unusable, so an edit that may hang is never
    launched in the notebook's own process; the process that ran it is ended. The deadline
    counts from the launch; compile_seconds more are allowed for what comes before it (starting
    Python, importing, compiling the kernel)."""
    import json
    import subprocess

    code = (
        "import sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from common.tools import exercises\n"
        f"exercises._gpu_child({mod.__file__!r}, {tuple(shape)!r}, {seconds!r}, {options!r})\n"
    )
    hang = (
        f"the edited kernel did not finish within {seconds} s of its launch: it hangs (it ran in "
        "a process of its own, which was then ended)"
    )
    try:
        p = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=seconds + compile_seconds,
        )
    except subprocess.TimeoutExpired:
        return hang
    line = next((ln for ln in p.stdout.splitlines()[::-1] if ln.startswith("RESULT ")), None)
    if line is None:
        last = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        return f"the process running the edited kernel failed: {last}"
    out = json.loads(line[len("RESULT ") :])
    if out.get("hang"):
        return hang
    if "error" in out:
        return f"the launch failed: {out['error']}"
    return "the kernel finished: " + describe_error(out["err"], out["nan"])


def _gpu_child(path, shape, seconds, options):
    """gpu_attention_in_subprocess's other process: load the stage file at `path`, run it, print
    one RESULT line and exit at once (os._exit: a hung kernel must not hold up the exit)."""
    import json

    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        err, has_nan = gpu_attention_error(mod, tuple(shape), deadline=seconds, **options)
        out = {"err": err, "nan": has_nan}
    except TimeoutError:
        out = {"hang": True}
    except Exception as e:
        first = error_line(e)
        out = {"error": f"{type(e).__name__}: {first}"}
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


def error_line(e):
    """One line for an exception from an edited stage file: its first line without the DSL's
    terminal colours, and, where the DSL names a place (`--> file:line`), that line of the edited
    file and its text."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    # A syntax error names the edited copy (load_stage_file's module): name the learner's file.
    text = re.sub(
        r"_exercise_stage(\d+)_(hopper|blackwell)_\d+\.py",
        lambda m: os.path.relpath(stage_path(int(m.group(1)), m.group(2)), ROOT),
        text,
    )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    first = lines[0].removeprefix("error:").strip()
    if first.endswith(":") and len(lines) > 1:
        # "Operation creation failed:" says nothing alone; the reason is on the next line.
        first += " " + lines[1].removeprefix("error:").removeprefix(" unknown:").strip()
    place = next((m for m in map(re.compile(r"^-->\s*\S+:(\d+)$").match, lines) if m), None)
    if place:
        number = place.group(1)
        code = next(
            (line.split("|", 1)[1].strip() for line in lines if line.startswith(number + " |")),
            "",
        )
        first += f" (line {number} of the edited file" + (f": `{code}`)" if code else ")")
    return first


def ptxas_warnings(ptx, arch="sm_90a"):
    """The lines of `ptxas -v` that start with a warning or performance code ("(C7514) ..."), or
    None where no ptxas on PATH assembles this PTX (none installed, or one older than the PTX
    ISA the DSL writes). The kernels themselves are assembled by the DSL's own compiler."""
    import re
    import subprocess

    exe = shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run(
            [exe, f"-arch={arch}", "-v", "-o", os.path.join(d, "k.cubin"), src],
            capture_output=True,
            text=True,
            timeout=300,
        )
    if p.returncode != 0:
        return None
    text = p.stdout + p.stderr
    return [m.group(0).strip() for m in re.finditer(r"\(C\d{4}\)[^\n]*", text)]


# ---------------------------------------------------------------- the exercises
# One section per stage; each exercise is a check function and its registration. Anchor a
# solution on code, not on a comment, so that a reworded comment does not break it.

_ALL = []

# ---------------------------------------------------------------- stage 2


def _wgmma_shapes(ptx):
    """The distinct m<M>n<N>k<K> shapes of the wgmma.mma_async statements in the PTX."""
    import re

    return sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))


def _gpu_2a(mod):
    import torch

    from common.tools import inputs, reference
    from common.tools.verify import rel_err, run_with_deadline

    q, k, _ = inputs.attention_inputs(2, 4, 512, 512, 128, seed=3)
    s = run_with_deadline(lambda: mod.qk(q, k), 60, "the edited kernel")
    torch.cuda.synchronize()
    err = rel_err(s, reference.qk_ref(q, k))
    return f"S is {'right' if err < 1e-3 else 'wrong'}: relative error {err:.1e} against fp64"


def _check_2a(mod):
    # Shared memory = Q (bM x D, 2 B) + kv_slots K tiles (bN x D, 2 B) + the fp32 S staging tile
    # (bM x bN, 4 B) + 1 KiB of barriers and alignment.
    from common.tools.ptx import count_ptx

    kernel, ptx, _ = compile_module(mod, "hopper")
    bM, bN, D = kernel.cta_tile
    q, k, s = bM * D * 2 / 1024, bN * D * 2 / 1024, bM * bN * 4 / 1024
    kib = kernel.shared_memory_bytes / 1024
    shapes = ", ".join(_wgmma_shapes(ptx))
    n = count_ptx(ptx)["wgmma.mma_async"]
    seen = (
        f"cta_tile = {tuple(kernel.cta_tile)}: {n} wgmma.mma_async ({shapes}) per K tile in the "
        f"PTX; shared memory {kib:g} KiB = Q {q:g} + {kernel.kv_slots} x {k:g} (K) + {s:g} "
        f"(S staging) + {kib - q - kernel.kv_slots * k - s:g}"
    )
    if bN == 64 and shapes == "m64n64k16" and kib == q + kernel.kv_slots * k + s + 1:
        return Result(True, seen)
    return Result(False, seen + " (the exercise wants K tiles of 64 keys)")


_ALL.append(
    Exercise(
        id="2a",
        stage=2,
        track="hopper",
        task=(
            "Halve the K tile: in `Sm90Kernel.__init__` of `stages/stage2_qk/hopper.py` set "
            "`self.cta_tile = (128, 64, head_dim)` (64 keys per K tile instead of 128). Before "
            "you run the check, predict at D = 128 the wgmma instruction shape in the PTX and "
            "the shared memory the kernel asks for (161 KiB with 128 keys: the docstring's 160 KiB of "
            "tiles plus 1 KiB of mbarriers and alignment)."
        ),
        solution=(
            (
                "        self.cta_tile = (128, 128, head_dim)",
                "        self.cta_tile = (128, 64, head_dim)",
            ),
        ),
        check=_check_2a,
        gpu_check=_gpu_2a,
        hint=(
            "m64n64k16; the K slots and the fp32 S staging tile both halve: Q 32 + 2 x 16 (K) "
            "+ 32 (S staging) + 1 (mbarriers, alignment) = 97 KiB"
        ),
    )
)

# ---------------------------------------------------------------- stage 3


def _tcgen05_ld_shapes(ptx):
    """The distinct shapes (32x32b.x32, ...) of the tcgen05.ld statements in the PTX."""
    import re

    return sorted(set(re.findall(r"tcgen05\.ld\.sync\.aligned\.(\w+\.x\d+)", ptx)))


def _check_3a(mod):
    # Each softmax thread reads its row of S (128 columns) and, in the epilogue, of O (D = 128
    # columns) out of TMEM in slices of tmem_load_cols: 128 / cols + 128 / cols tcgen05.ld.
    from common.tools.ptx import count_ptx

    kernel, ptx, _ = compile_module(mod, "blackwell", shape=(2, 4, 512, 128, 128))
    n = count_ptx(ptx)["tcgen05.ld"]
    shapes = ", ".join(_tcgen05_ld_shapes(ptx))
    seen = f"tmem_load_cols = {kernel.tmem_load_cols}: {n} tcgen05.ld ({shapes}) in the PTX"
    if kernel.tmem_load_cols == 64 and shapes == "32x32b.x64" and n == 4:
        return Result(True, seen + ": 2 for S's row, 2 for O's (8 of .x32 before)")
    return Result(
        False,
        seen + " (the exercise wants 64 columns per load, tcgen05.ld.32x32b.x64)",
    )


_ALL.append(
    Exercise(
        id="3a",
        stage=3,
        track="blackwell",
        task=(
            "Read TMEM in wider slices: in `stages/stage3_softmax/blackwell.py` set "
            "`self.tmem_load_cols = 64` in `Sm100Kernel.__init__`, and make the load atom match "
            "it: `tcgen05.Ld32x32bOp(tcgen05.Repetition.x64)`. Each softmax thread then reads 64 "
            "fp32 columns of its row per tcgen05.ld. Predict how many tcgen05.ld the PTX holds "
            "at D = 128 (8 now: 4 for the row of S, 4 for the row of O)."
        ),
        solution=(
            ("        self.tmem_load_cols = 32", "        self.tmem_load_cols = 64"),
            (
                "tcgen05.Ld32x32bOp(tcgen05.Repetition.x32)",
                "tcgen05.Ld32x32bOp(tcgen05.Repetition.x64)",
            ),
        ),
        check=_check_3a,
        hint=(
            "change both lines: tmem_load_cols = 64 alone still gives 8 loads of .x32, and the "
            ".x64 atom alone does not compile; then 128 / 64 loads for S and 128 / 64 for O"
        ),
    )
)

# ---------------------------------------------------------------- stage 4


def _gpu_4a(mod):
    return describe_error(*gpu_attention_error(mod))


def _check_4a(mod):
    # Q (128 x 128) + kv_slots K/V tiles (128 x 128), 2 bytes each, + 1 KiB: the barriers (8 bytes
    # each), padded to the 1,024-byte alignment of sQ that follows them.
    kernel, _, _ = compile_module(mod, "hopper")
    tile = 128 * 128 * 2
    slots = (kernel.shared_memory_bytes - 1024 - tile) / tile
    kib = kernel.shared_memory_bytes / 1024
    if kernel.kv_slots == 3 and slots == 3:
        return Result(True, f"kv_slots = 3: the kernel asks for {kib:.0f} KiB = Q + 3 x 32 KiB + 1")
    return Result(
        False,
        f"kv_slots = {kernel.kv_slots}, shared memory {kib:.0f} KiB = Q + {slots:g} x 32 KiB + 1 "
        "(the exercise wants 3 slots)",
    )


_ALL.append(
    Exercise(
        id="4a",
        stage=4,
        track="hopper",
        task=(
            "Give the K/V ring a third slot: in `Sm90Kernel.__init__` of "
            "`stages/stage4_kv_interleave/hopper.py` set `self.kv_slots = 3`. Predict the "
            "shared memory the kernel asks for at D = 128 before you run the check."
        ),
        solution=(("        self.kv_slots = 2  #", "        self.kv_slots = 3  #"),),
        check=_check_4a,
        gpu_check=_gpu_4a,
        hint="96 KiB + 32 KiB + 1 KiB (the barriers, 8 bytes each, padded to sQ's 1 KiB alignment)",
    )
)


# The CTA of stage 4 on Blackwell as the schedule model replays it (common/tools/schedule.py):
# the TMA warp, the MMA warp and the softmax warps, each role's barrier operations in the order
# stage4_kv_interleave/blackwell.py performs them, over two passes (pass 1: K; pass 2: K, V).
# The MMA warp's arrives are tcgen05.commit, three groups in the PTX: after pass 1's QK MMAs,
# after pass 2's, after the PV MMAs; the second commit of each group frees a K/V slot.
_STAGE4_MMA_COMMITS = (
    ("pass 1's QK MMAs", ("S full", "K slot free")),
    ("pass 2's QK MMAs", ("S full", "K slot free")),
    ("the PV MMAs", ("P free", "V slot free", "Q free", "O full")),
)


def _stage4_programs(kernel, released=(True, True, True)):
    """(pipes, programs) of stage 4 on Blackwell; released[g] False leaves out the K/V release
    of commit group g (pass 1's K, pass 2's K, the V of the PV MMAs)."""
    from common.tools.schedule import Op, PerTile, Pipe, Sync, Tail

    def kv_release(g, what):
        return (Op("K/V", "release", what),) if released[g] else ()

    pipes = (
        Pipe("Q", kernel.q_buffers, "TMA", "MMA"),
        Pipe("K/V", kernel.kv_slots, "TMA", "MMA"),
        Pipe("S", kernel.s_buffers, "MMA", "softmax"),
        Pipe("P", 1, "softmax", "MMA"),
        Pipe("O", 1, "MMA", "softmax"),
    )
    tmem = Sync("TMEM allocated", ("MMA", "softmax"))

    def loads(names):
        return tuple(op for n in names for op in (Op("K/V", "acquire", n), Op("K/V", "commit", n)))

    programs = {
        "TMA": (
            Op("Q", "acquire"),
            Op("Q", "commit", "Q"),
            *(PerTile(loads(names)) for names in kernel.kv_producer_entries),
            Tail("K/V"),
            Tail("Q"),
        ),
        "MMA": (
            tmem,
            Op("Q", "wait"),
            PerTile(
                (
                    Op("K/V", "wait", "K"),
                    Op("S", "acquire"),
                    Op("S", "commit"),
                    *kv_release(0, "K"),
                )
            ),
            Op("O", "acquire"),
            PerTile(
                (
                    Op("K/V", "wait", "K"),
                    Op("S", "acquire"),
                    Op("P", "peek_empty", "P's columns free"),
                    Op("S", "commit", "over P"),
                    *kv_release(1, "K"),
                    Op("P", "wait"),
                    Op("K/V", "wait", "V"),
                    Op("P", "release"),
                    *kv_release(2, "V"),
                )
            ),
            Op("Q", "release"),
            Op("O", "commit"),
        ),
        "softmax": (
            tmem,
            PerTile((Op("S", "wait"), Op("S", "release"))),
            PerTile((Op("S", "wait"), Op("S", "release"), Op("P", "acquire"), Op("P", "commit"))),
            Op("O", "wait"),
            Op("O", "release"),
        ),
    }
    return pipes, programs


def _commit_groups(ptx):
    """[(MMA kind, tcgen05.commit after that run of MMAs)] in PTX order: QK (A from shared
    memory) or PV (A from TMEM)."""
    from common.tools.ptx import TCGEN05_PV, TCGEN05_QK

    groups, after_commit = [], True
    for line in ptx.splitlines():
        s = line.strip()
        kind = "QK" if TCGEN05_QK.search(s) else "PV" if TCGEN05_PV.search(s) else None
        if kind and (after_commit or groups[-1][0] != kind):
            groups.append([kind, 0])
            after_commit = False
        elif s.startswith("tcgen05.commit") and groups:
            groups[-1][1] += 1
            after_commit = True
    return [tuple(g) for g in groups]


def _check_4b(mod):
    from common.tools import schedule

    kernel, ptx, _ = compile_module(mod, "blackwell", shape=(1, 2, 256, 512, 128))
    groups = _commit_groups(ptx)
    want = [("QK", 2), ("QK", 2), ("PV", 4)]
    seen = ", ".join(
        f"{n} after {where}" for (_, n), (where, _) in zip(groups, _STAGE4_MMA_COMMITS)
    )
    total = sum(n for _, n in groups)
    if [k for k, _ in groups] != [k for k, _ in want] or any(
        n not in (w, w - 1) for (_, n), (_, w) in zip(groups, want)
    ):
        return Result(
            False,
            f"the PTX's MMA runs and their tcgen05.commit ({groups}) are not those of the model "
            f"{want}: this check expects exactly one K/V release deleted",
        )
    released = tuple(n == w for (_, n), (_, w) in zip(groups, want))
    pipes, programs = _stage4_programs(kernel, released)
    violations = []
    for tiles in (1, 3):
        violations += [
            f"[{schedule.tiles_label(tiles)}] {v}"
            for v in schedule.simulate_cta(pipes, programs, tiles)
        ]
    head = f"the MMA warp issues {total} tcgen05.commit ({seen}); "
    if all(released):
        verdict = "; ".join(violations) if violations else "no hang, every hand-off balanced"
        return Result(
            False,
            head + f"the model, replayed over 1 and 3 KV tiles: {verdict} "
            "(the exercise wants one K/V slot release deleted)",
        )
    dropped = [
        f"the commit that frees the {names[1][0]} slot after {where}"
        for ok, (where, names) in zip(released, _STAGE4_MMA_COMMITS)
        if not ok
    ]
    hangs = [v for v in violations if "hang" in v]
    report = "; ".join(hangs or violations) or "nothing"
    return Result(
        bool(hangs),
        head + f"the model without {', '.join(dropped)} reports: {report}",
    )


_ALL.append(
    Exercise(
        id="4b",
        stage=4,
        track="blackwell",
        task=(
            "Drop a barrier release and watch the schedule model report the hang: in the MMA "
            "warp of `stages/stage4_kv_interleave/blackwell.py` delete the line "
            "`v_full.release()` (the tcgen05.commit that frees V's ring slot once the PV MMAs "
            "have read it). The check finds the missing tcgen05.commit in the PTX and replays "
            "stage 4's CTA (TMA warp, MMA warp, softmax warps) with the CPU schedule model of "
            "`common/tools/schedule.py`. Before you run it: which warp waits forever, at which "
            "barrier, even with one KV tile?"
        ),
        solution=(("            v_full.release()\n", ""),),
        check=_check_4b,
        hint="the TMA warp's tail() acquires every K/V slot before it exits",
    )
)

# ---------------------------------------------------------------- stage 5


def _ex2_multiplies(ptx):
    """For each ex2.approx in the PTX, the number of mul statements that read its result."""
    import re

    out = []
    for dst in re.findall(r"^\s*ex2\.approx\S*\s+(%r\d+),", ptx, re.M):
        uses = re.findall(r"^\s*mul\.\S+\s+%r\d+,[^;]*" + re.escape(dst) + r"\b", ptx, re.M)
        out.append(len(uses))
    return out


def _gpu_5a(mod):
    return describe_error(*gpu_attention_error(mod))


def _check_5a(mod):
    # row_scale = exp2((m_old - m_new) * scale_log2) of each of a thread's 2 rows multiplies its
    # D / 2 = 64 registers of acc_O (32 per row); the ex2 of P feed adds and conversions, not muls.
    import re

    from common.tools.ptx import count_ptx

    _, ptx, _ = compile_module(mod, "hopper")
    uses = _ex2_multiplies(ptx)
    rescales = [n for n in uses if n >= 8]
    muls = len(re.findall(r"^\s*mul\.f32\s", ptx, re.M))
    seen = f"{count_ptx(ptx)['ex2.approx']} ex2.approx and {muls} mul.f32 in the PTX (D = 128); "
    if not rescales:
        return Result(
            True,
            seen + "no ex2 result multiplies acc_O any more: the rescale of O is gone (row_sum "
            "still uses row_scale, so l stays right while O does not)",
        )
    return Result(
        False,
        seen + f"{len(rescales)} ex2 results (row_scale, one per row) each multiply "
        f"{'/'.join(str(n) for n in rescales)} registers of acc_O: O is still rescaled "
        f"({sum(rescales)} multiplies per thread per KV tile)",
    )


_ALL.append(
    Exercise(
        id="5a",
        stage=5,
        track="hopper",
        task=(
            "Forget alpha in the kernel: in `Sm90Kernel.rescale_o_and_convert_p` of "
            "`stages/stage5_online_softmax/hopper.py`, delete the loop that multiplies `acc_O` "
            "by `row_scale` (the two lines after `acc_O_mn = self.rows_view(acc_O)`). Predict "
            "how many `mul.f32` per thread per KV tile disappear at D = 128, and whether the "
            "number of `ex2.approx` changes. The check reads the PTX: which `ex2.approx` results "
            "feed multiplies of O. On a GPU, `make stage-5` then fails: the rows whose max grows "
            "after their first tile come out wrong, as in exercise 1 on the CPU."
        ),
        solution=(
            (
                "        for r in cutlass.range_constexpr(cute.size(row_scale)):\n"
                "            acc_O_mn[r, None].store(acc_O_mn[r, None].load() * row_scale[r])\n",
                "",
            ),
        ),
        check=_check_5a,
        gpu_check=_gpu_5a,
        hint="2 rows per thread x D / 4 columns each (64 at D = 128); row_scale still feeds row_sum",
    )
)

# ---------------------------------------------------------------- stage 6


def _gpu_6a(mod):
    finite = describe_error(*gpu_attention_error(mod, (2, 4, 1024, 1024, 128), causal=True))
    # Sq = 128 rows see keys i + 696 .. i + 896 of Sk = 1024: no row sees keys 0-639.
    planted = describe_error(
        *gpu_attention_error(
            mod, (2, 2, 128, 1024, 64), nan_keys=640, causal=True, window=(200, None)
        )
    )
    return f"causal, finite inputs: {finite}; NaN in keys 0-639, which no query sees: {planted}"


def _check_6a(mod):
    # The kernel's own kv_tile_range (the Python under @cute.jit, run on ints) for every Q tile
    # of a causal Sq = Sk = 8192, against the host twin common.masks.kv_tile_range.
    from common import masks

    kernel, _, _ = compile_module(mod, "hopper", causal=True)
    Sq = Sk = 8192
    left, right = masks.resolve_window(True, None, Sq, Sk)
    bM, bN, _ = kernel.cta_tile
    q_tiles, kv_tiles = -(-Sq // bM), -(-Sk // bN)
    kv_tile_range = type(kernel).kv_tile_range.__wrapped__
    loaded = needed = 0
    for m in range(q_tiles):
        lo, hi = kv_tile_range(kernel, m, Sq, Sk, left, right)
        loaded += int(hi) - int(lo)
        lo, hi = masks.kv_tile_range(m, Sq, Sk, left, right, bM, bN)
        needed += hi - lo
    seen = (
        f"causal, Sq = Sk = {Sq}: the kernel's kv_tile_range loads {loaded} of "
        f"{q_tiles * kv_tiles} tile pairs, the mask needs {needed}"
    )
    if loaded == q_tiles * kv_tiles:
        return Result(
            True,
            seen + f": every tile is loaded and multiplied, {loaded / needed:.2f}x the work; "
            "the element mask still gives P = 0 outside the band",
        )
    return Result(False, seen + ": the tiles outside the band are still skipped")


_ALL.append(
    Exercise(
        id="6a",
        stage=6,
        track="hopper",
        task=(
            "Switch tile skipping off: make `Sm90Kernel.kv_tile_range` of "
            "`stages/stage6_masks/hopper.py` return every KV tile, lo = 0 and "
            "hi = ceil(Sk / bN), whatever the mask. Predict how many of the 4096 tile pairs of "
            "a causal Sq = Sk = 8192 the kernel then loads, against the 2080 it needs. The check "
            "compiles the file and runs the kernel's own `kv_tile_range` (the Python under "
            "`@cute.jit`) on integers for every Q tile. Then think about a GPU: is O still "
            "right? (`make stage-6` has one test that plants NaN in K and V tiles no query "
            "sees.)"
        ),
        solution=(
            (
                "        lo = first_key // bN\n"
                "        hi = cutlass.max((end_key + bN - 1) // bN, lo)\n",
                "        lo = 0\n        hi = (seqlen_k + bN - 1) // bN\n",
            ),
        ),
        check=_check_6a,
        gpu_check=_gpu_6a,
        hint="64 Q tiles x 64 KV tiles; every tile outside the band crosses a mask edge",
    )
)

# ---------------------------------------------------------------- stage 7


def _tma_load_heads(ptx):
    """{head coordinate register: how it is defined} and the number of TMA loads per register:
    the third coordinate of each 4-D TMA load (S, D, head, batch) in the PTX."""
    import re

    regs = re.findall(
        r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global\S*\s+\[[^\]]*\],\s*"
        r"\[%rd\d+,\s*\{[^,]+,[^,]+,\s*(%r\d+),",
        ptx,
    )
    counts = {}
    for r in regs:
        counts[r] = counts.get(r, 0) + 1
    defs = {}
    for r in counts:
        m = re.search(r"^\s*(\S+)\s+" + re.escape(r) + r",\s*([^;]*);", ptx, re.M)
        defs[r] = f"{m.group(1)} {m.group(2)}" if m else "?"
    return counts, defs


def _gpu_7a(mod):
    return "GQA 32/8: " + describe_error(
        *gpu_attention_error(mod, (2, 32, 512, 1024, 128), kv_heads=8)
    )


def _check_7a(mod):
    _, ptx, _ = compile_module(mod, "hopper", shape=(2, 32, 512, 1024, 128), kv_heads=8)
    counts, defs = _tma_load_heads(ptx)
    seen = "head coordinate of the TMA loads (H = 32, Hkv = 8): " + "; ".join(
        f"{n} at {r} = {defs[r]}" for r, n in counts.items()
    )
    from_block = [r for r in counts if "%ctaid.y" in defs[r]]
    if len(counts) == 1 and from_block:
        return Result(
            True,
            seen + ": K and V are read at the query head's own index, as before stage 7 "
            "(query heads 8-31 now ask for KV heads that do not exist)",
        )
    return Result(
        False,
        seen + ": Q is read at the CTA's head, K and V at another coordinate (the query head "
        "divided by H / Hkv)",
    )


_ALL.append(
    Exercise(
        id="7a",
        stage=7,
        track="hopper",
        task=(
            "GQA is one TMA coordinate. In `Sm90Kernel.kernel` of "
            "`stages/stage7_gqa_varlen/hopper.py`, make every query head read the KV head of "
            "its own index, as stage 6 did: `kv_head = head`. The check compiles the file for "
            "H = 32 query heads and Hkv = 8 KV heads and reads, in the PTX, the head coordinate "
            "of every TMA load: what Q is loaded at, what K and V are. Before you run it: which "
            "PTX instruction computes the KV head in the committed file, and what do query heads "
            "8-31 read after the edit? (On a GPU `make stage-7` then fails.)"
        ),
        solution=(
            (
                "        kv_head = head // (mQ.shape[2] // mK.shape[2])\n",
                "        kv_head = head\n",
            ),
        ),
        check=_check_7a,
        gpu_check=_gpu_7a,
        hint="blockIdx.y is the query head; the committed K/V coordinate is a div.s32 of it",
    )
)

# ---------------------------------------------------------------- stage 8


def _gpu_in_own_process(mod):
    # An edit of the barriers may hang: never in the notebook's own process.
    return gpu_attention_in_subprocess(mod)


def _check_8a(mod):
    # The arrival counts the compiled kernel initialises its barriers with, and the CPU model of
    # stage 8's barrier protocol (common/tools/barrier_protocol.py) replayed with them.
    from common.tools import barrier_protocol

    kernel, ptx, _ = compile_module(mod, "hopper")
    n = kernel.kv_slots
    counts = barrier_protocol.counts_from_ptx(ptx, n)
    if counts is None:
        return Result(
            False,
            f"the PTX does not initialise the 2 + 2 x {n} barriers of stage 8's protocol "
            "(q_full, q_empty, kv_full and kv_empty of each ring slot)",
        )
    full = sorted({counts[f"full{i}"] for i in range(n)})
    empty = sorted({counts[f"empty{i}"] for i in range(n)})
    per_entry = kernel.mma_threads // 32  # consumer_release: one lane of each consumer warp
    seen = (
        f"the PTX initialises q_full with {counts['q_full']}, q_empty with "
        f"{counts['q_empty']}, kv_full[0-{n - 1}] with {'/'.join(map(str, full))} and "
        f"kv_empty[0-{n - 1}] with {'/'.join(map(str, empty))} arrivals; per ring entry "
        f"{per_entry} arrive on kv_empty (one lane of each consumer warp)"
    )
    problems = set()
    for walk in ([4], [2, 1]):  # one work tile of 4 KV tiles (8 entries), two of 2 and 1
        problems |= barrier_protocol.explore_cta(
            barrier_protocol.cta_programs(kernel, walk), counts
        )
    where = f"replayed over work tiles of 4 and of 2 + 1 KV tiles at the kernel's {n}-slot ring"
    report = "; ".join(sorted(problems)[:3]) or "no hang, no overwrite, no arrive left over"
    if empty == [per_entry]:
        return Result(
            False,
            seen + f". The model, {where}: {report} (the exercise wants kv_empty counting every "
            "consumer thread, as q_empty does)",
        )
    return Result(bool(problems), seen + f". The model with these counts, {where}: {report}")


_ALL.append(
    Exercise(
        id="8a",
        stage=8,
        track="hopper",
        task=(
            "Count the wrong arrivals. q_empty counts consumer threads (every one of the 256 "
            "arrives once the epilogue is done with Q), kv_empty counts consumer warps "
            "(consumer_release arrives from one lane of each of the 8). In `Sm90Kernel.kernel` "
            "of `stages/stage8_warp_specialized/hopper.py` make kv_empty count threads as "
            "q_empty does: `consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, "
            "self.mma_threads)`. Predict: a wrong O, a hang, or no change? The check compiles "
            "the file, reads from the PTX the counts the barriers are initialised with, and "
            "replays the barrier protocol with them on the CPU "
            "(`common/tools/barrier_protocol.py`), every interleaving of the producer and the "
            "two consumer warpgroups. On a GPU it runs the edited kernel in a process of its "
            "own, with a deadline."
        ),
        solution=(
            (
                "pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads // 32)",
                "pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads)",
            ),
        ),
        check=_check_8a,
        gpu_check=_gpu_in_own_process,
        hint="8 arrivals per ring entry against a count of 256: which wait is the first to need "
        "a completed phase of kv_empty?",
    )
)

# ---------------------------------------------------------------- stage 9


def _check_9a(mod):
    # Which of stage 9's four turn operations the compiled kernel performs (read from the
    # PTX's order of named barriers and wgmma), and the CPU turn model (common/tools/turns.py)
    # with those operations, every interleaving of the two consumer warpgroups.
    from common.tools import turns

    kernel, ptx, _ = compile_module(mod, "hopper")
    present = turns.pingpong_turn_ops(ptx)
    if present is None:
        return Result(
            False,
            f"the PTX's order of barriers and wgmma ({turns.schedule_string(ptx)}) is not stage "
            "9's with turn operations left out: the exercise deletes one turn operation and "
            "nothing else",
        )
    n = kernel.mma_warpgroups
    lost = [op for op in turns.TURN_OPS if op not in present]
    seen = f"the PTX performs {len(present)} of stage 9's 4 turn operations" + (
        f" (lost: {', '.join(lost)})" if lost else ""
    )
    problems, stuck = set(), None
    for steps in (1, 3):
        programs = [
            turns.pingpong_program(kernel, wg, steps, turn_ops=present) for wg in range(1, n + 1)
        ]
        found = turns.explore(programs, turns.pingpong_order(steps, n))
        problems |= {f"[{steps}] {p}" for p in found}
        if found and stuck is None:
            _, stuck = turns.issue_order(programs)
    where = "the model of the two consumer warpgroups, every interleaving over 1 and 3 KV tiles"
    if not problems:
        return Result(
            False,
            seen + f"; {where}: no deadlock, every barrier balanced, the tensor cores in turn "
            "(the exercise wants the last pass_turn deleted)",
        )
    report = ", ".join(turns.problem_kinds(problems)) + (
        f"; along one interleaving: {stuck}" if stuck else ""
    )
    return Result(bool(lost), seen + f"; {where}: {report}")


_ALL.append(
    Exercise(
        id="9a",
        stage=9,
        track="hopper",
        task=(
            "Lose the last turn. In `Sm90Kernel.mma_tile` of `stages/stage9_pingpong/hopper.py` "
            "delete the two lines that hand the last turn on after the loop (`if steps > 0 and "
            "warpgroup_idx < self.mma_warpgroups:` and the `self.pass_turn(warpgroup_idx)` under "
            "it). Before you run the check: which warpgroup then waits forever, at which named "
            "barrier, and what does the other one wait for meanwhile? The check compiles the "
            "file, reads from the PTX which of the four turn operations the kernel still "
            "performs, and explores every interleaving of the two consumer warpgroups with them "
            "on the CPU (`common/tools/turns.py`). On a GPU it runs the edited kernel in a "
            "process of its own, with a deadline."
        ),
        solution=(
            (
                "        if steps > 0 and warpgroup_idx < self.mma_warpgroups:\n"
                "            self.pass_turn(warpgroup_idx)\n",
                "",
            ),
        ),
        check=_check_9a,
        gpu_check=_gpu_in_own_process,
        hint="warpgroup 2 waits for the turn of its last PV; warpgroup 1 has gone on to the "
        "epilogue's barrier 1, which needs warpgroup 2 too",
    )
)

# ---------------------------------------------------------------- stage 10


def _check_10a(mod):
    # The kind of each wgmma group in the PTX's program order, and the CPU turn model of stage
    # 10 (common/tools/turns.py) with the loop's pair in that order: the tensor cores' order and
    # the reads of a GEMM's result that the waits no longer cover.
    from common.tools import turns

    kernel, ptx, _ = compile_module(mod, "hopper")
    groups = turns.wgmma_groups(ptx)
    if groups not in (["QK", "QK", "PV", "PV"], ["QK", "PV", "QK", "PV"]):
        return Result(
            False,
            f"the PTX's wgmma groups in program order are {groups}: not stage 10's (the "
            "prologue's QK, the loop's pair in either order, the last PV)",
        )
    pv_first = groups[1] == "PV"
    n = kernel.mma_warpgroups
    programs = [
        turns.overlap_program(kernel, wg, 3, False, waits=True, pv_first=pv_first)
        for wg in range(1, n + 1)
    ]
    plain = [turns.without_waits(p) for p in programs]
    order, _ = turns.issue_order(plain)
    out_of_turn = turns.explore(plain, turns.overlap_order(3, n))
    early = turns.in_flight_reads(programs[0])
    seen = (
        f"the loop issues {groups[1]} then {groups[2]} (PTX); the tensor cores' order over 3 KV "
        f"tiles: {', '.join(order)}"
    )
    if not pv_first:
        return Result(
            False,
            seen + "; each softmax reads S_j after wait_group 1, which leaves only the newest "
            "group, PV_{j-1}, running (the exercise wants PV_{j-1} issued first)",
        )
    warnings = ptxas_warnings(ptx)
    serialised = [w for w in warnings or [] if "serialized" in w]
    if serialised:
        why = re.sub(r"\s+", " ", serialised[0].split(" in the function")[0])
        compiler = (
            f". The compiler sees it too, ptxas: {why}: it makes each wgmma wait for the one "
            "before it, so S_j is complete when the softmax reads it and nothing overlaps"
        )
    elif warnings is not None:
        compiler = ". ptxas (the CUDA toolkit's) reports no serialisation"
    else:
        compiler = ""
    reads = ", ".join(gemm.split(": ")[1] for gemm, _ in early)
    return Result(
        bool(out_of_turn) and bool(early),
        seen + " (stage 10's turn issues QK_j first: 1: QK1, 1: PV0, ...). The waits no longer "
        f"cover the reads: warpgroup 1's softmax reads the results of {reads} while their wgmma "
        "may still run, since wait_group 1 now leaves QK_j, the newest group, running" + compiler,
    )


_ALL.append(
    Exercise(
        id="10a",
        stage=10,
        track="hopper",
        task=(
            "Swap the pair. In `Sm90Kernel.mma_one_n_block` of "
            "`stages/stage10_overlap/hopper.py` issue PV_{j-1} before QK_j: move the line "
            "`self.issue_qk(qk_mma, acc_S, tSrQ, tSrK, k_state.index)` below "
            "`self.issue_pv(pv_mma, acc_O, tOrP, tOrVt, v_state.index)` (the wait for V_{j-1}'s "
            "slot stays before the PV). The math is the same. Before you run the check: what "
            "does `warpgroup.wait_group(1)` wait for now, and what does the softmax read? The "
            "check compiles the file, reads the order of the wgmma groups from the PTX, and "
            "runs stage 10's turn model (`common/tools/turns.py`) with the pair in that order; "
            "where ptxas is installed it also shows what ptxas makes of the edit. On a GPU it "
            "runs the edited kernel (in a process of its own, with a deadline) and says "
            "whether O is still right."
        ),
        solution=(
            (
                "        self.issue_qk(qk_mma, acc_S, tSrQ, tSrK, k_state.index)\n"
                "        # ... and O += P_{j-1} @ V_{j-1} behind it, in the same turn.\n"
                "        kv_pipeline.consumer_wait(v_state)\n"
                "        self.issue_pv(pv_mma, acc_O, tOrP, tOrVt, v_state.index)\n",
                "        kv_pipeline.consumer_wait(v_state)\n"
                "        self.issue_pv(pv_mma, acc_O, tOrP, tOrVt, v_state.index)\n"
                "        self.issue_qk(qk_mma, acc_S, tSrQ, tSrK, k_state.index)\n",
            ),
        ),
        check=_check_10a,
        gpu_check=_gpu_in_own_process,
        hint="wgmma groups complete in the order they were committed; wait_group 1 waits for "
        "all but the newest",
    )
)

# ---------------------------------------------------------------- stage 11


def _check_11a(mod):
    # The edited kernel's own tile_coords (its plain Python, on ints) numbers the work tiles of a
    # causal launch; the CPU walk of common/tools/tile_scheduler.py hands them to 132 SMs in that
    # order, against the same tiles handed out longest first.
    import dataclasses

    from common.tools import tile_scheduler

    B, H, S = 2, 16, 8192
    kernel, _, _ = compile_module(mod, "hopper", shape=(B, H, S, S, 128), causal=True)
    plan = tile_scheduler.launch_plan(kernel, B, H, S, S, causal=True)
    coords = {(t.q_tile, t.head, t.sequence) for t in plan.tiles}
    tiles_m = -(-S // kernel.cta_tile[0])
    if len(coords) != len(plan.tiles) or len(coords) != tiles_m * H * B:
        return Result(
            False,
            f"tile_coords gives {len(coords)} distinct (Q tile, head, sequence) for "
            f"{tiles_m * H * B} tile numbers: some tile would run twice and another never (the "
            "exercise keeps every tile, only the order changes)",
        )
    lpt = sorted(plan.tiles, key=lambda t: -t.kv_tiles)
    longest = dataclasses.replace(
        plan, tiles=[dataclasses.replace(t, number=i) for i, t in enumerate(lpt)]
    )
    lead = kernel.kv_slots / 2
    got = tile_scheduler.walk(plan, 132, 1.0, lead)
    ref = tile_scheduler.walk(longest, 132, 1.0, lead)
    starts = sorted((seg for row in got.rows for seg in row if seg.tile), key=lambda s: s.start)
    first = [t.kv_tiles for t in plan.tiles[:5]]
    last = [seg.tile.kv_tiles for seg in starts[-5:]]
    seen = (
        f"causal, B = {B}, H = {H}, S = {S}, 132 SMs: the first five tiles handed out have "
        f"{first} KV tiles, the last five to start {last}; the walk ends at {got.end:g} KV tiles "
        f"(SMs busy {got.busy:.1%}), longest first at {ref.end:g} ({ref.busy:.1%})"
    )
    if got.end <= ref.end:
        return Result(
            False,
            seen + " (tile_coords still hands the Q tiles out longest first; the exercise asks "
            "for first to last)",
        )
    return Result(
        True,
        seen + f": {got.end - ref.end:g} KV tiles of tail, the longest tiles running last on a few "
        "SMs while the others have nothing left to draw",
    )


_ALL.append(
    Exercise(
        id="11a",
        stage=11,
        track="hopper",
        task=(
            "Shortest first. In `Sm90Kernel.tile_coords` of "
            "`stages/stage11_persistent/hopper.py` hand the Q tiles out in their own order: "
            "delete the two lines that reverse them (`if cutlass.const_expr(self.longest_first):` "
            "and `pid_m = tiles_m - 1 - block`), so that `pid_m = block`. Every tile still runs "
            "once; under a causal mask the first Q tiles see the fewest keys. Before you run the "
            "check: which tiles does the atomic counter hand out last, and what do the other SMs "
            "do meanwhile? The check compiles the file, numbers the tiles of a causal launch with "
            "the edited `tile_coords` and walks them over 132 SMs on the CPU "
            "(`common/tools/tile_scheduler.py`), against the same tiles longest first. On a GPU "
            "it runs the edited kernel and says whether O is still right."
        ),
        solution=(
            (
                "        pid_m = block\n"
                "        if cutlass.const_expr(self.longest_first):\n"
                "            pid_m = tiles_m - 1 - block\n",
                "        pid_m = block\n",
            ),
        ),
        check=_check_11a,
        gpu_check=_gpu_in_own_process,
        hint="the counter serves the tiles in tile-number order; a tile of 64 KV tiles drawn last "
        "ends 64 KV tiles after its draw",
    )
)

# ---------------------------------------------------------------- stage 12


def fmax_chain_depth(ptx):
    """(statements, longest chain) of the PTX's `max.f32`: each statement's depth is one more than
    the deepest `max.f32` that wrote one of its operands (registers followed by name), so the
    longest chain is how many of them must run one after the other."""
    depth, longest, count = {}, 0, 0
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%p\d+\s+)?max\.f32\s+(%\w+),\s*(%\w+),\s*(%\w+);", line)
        if m:
            dst, a, b = m.groups()
            depth[dst] = 1 + max(depth.get(a, 0), depth.get(b, 0))
            longest, count = max(longest, depth[dst]), count + 1
    return count, longest


def _check_12a(mod):
    # The compiled kernel at D = 128 (tuning 5 on): the max.f32 statements of the PTX and the
    # longest chain of them through their registers.
    kernel, ptx, _ = compile_module(mod, "hopper", shape=(2, 4, 512, 1024, 128))
    count, longest = fmax_chain_depth(ptx)
    columns = kernel.cta_tile[1] // 4  # a row's columns in one thread: 128 keys over a quad
    seen = (
        f"D = 128: {count} max.f32 in the PTX, the longest chain of them {longest} deep; a "
        f"thread holds {columns} columns of each of its rows"
    )
    if count == 0:
        return Result(False, seen + ": no max.f32 at all (tuning 5's four chains are gone?)")
    if longest < columns * 3 // 4:
        return Result(
            False,
            seen + ": the columns still run in independent chains (the exercise folds every "
            "column into chains[0])",
        )
    return Result(
        True,
        seen + ": the same fmax, but one after the other through chains[0], each waiting for "
        "the one before, where the four chains let the scheduler interleave four at a time",
    )


_ALL.append(
    Exercise(
        id="12a",
        stage=12,
        track="hopper",
        task=(
            "One chain. In `Sm90Kernel.quad_row_max` of `stages/stage12_last_percent/hopper.py` "
            "(tuning 5, the D = 128 path) fold every column into the first chain: replace "
            "`chains[c % 4] = cute.arch.fmax(chains[c % 4], acc_S_mn[r, c])` by `chains[0] = "
            "cute.arch.fmax(chains[0], acc_S_mn[r, c])`. The row max is the same number. Before "
            "you run the check: how many fmax does a thread issue per row before and after the "
            "edit, and how many of them wait for the result of the one before? The check "
            "compiles the file at D = 128 and follows the `max.f32` of the PTX through their "
            "registers: how many there are, and the longest chain of them. On a GPU it runs "
            "the edited kernel and says whether O is still right."
        ),
        solution=(
            (
                "                chains[c % 4] = cute.arch.fmax(chains[c % 4], acc_S_mn[r, c])\n",
                "                chains[0] = cute.arch.fmax(chains[0], acc_S_mn[r, c])\n",
            ),
        ),
        check=_check_12a,
        gpu_check=_gpu_in_own_process,
        hint="a thread's 32 columns of a row: four chains of 7 fmax (each starts at a column), "
        "folded in 2 steps, then the running max and the quad's 2 exchanges: 12 deep; after the "
        "edit chains[0] takes the other 28 columns, then the same 5 steps: 33 deep",
    )
)

# ---------------------------------------------------------------- stage 13

# (KV tiles of a work tile's range, splits) on which 13a runs the kernel's split_range: a decode
# step of 8,269 keys (65 KV tiles) cut 16 ways (the launch's count for B = 1, 8 KV heads on 132
# SMs), 3 ways, and 64 ways (more splits than KV tiles), and 8 KV tiles cut 16 ways.
SPLIT_CASES = ((65, 16), (65, 3), (65, 64), (8, 16))


def split_reads(split_range, kernel, tiles, num_splits, lo=0):
    """The KV tiles each split of [lo, lo + tiles) reads, by the given split_range (a kernel's, run
    on ints): [(split lo, split hi)], the tiles read past hi (or before lo), the tiles of
    [lo, hi) read other than once, and the splits that read nothing."""
    hi = lo + tiles
    ranges = [
        tuple(int(x) for x in split_range(kernel, (lo, hi), s, num_splits))
        for s in range(num_splits)
    ]
    reads = [t for a, b in ranges for t in range(a, b)]
    outside = sum(1 for t in reads if t >= hi or t < lo)
    not_once = sum(1 for t in range(lo, hi) if reads.count(t) != 1)
    empty = sum(1 for a, b in ranges if b <= a)
    return ranges, outside, not_once, empty


def _check_13a(mod):
    # The kernel's own split_range (the Python under @cute.jit, run on ints) on the ranges of
    # SPLIT_CASES, from the compiled split-KV kernel of a decode step.
    kernel, _, _ = compile_module(
        mod, "hopper", shape=(1, 32, 1, 8269, 128), kv_heads=8, num_splits=16
    )
    split_range = type(kernel).split_range.__wrapped__
    seen, past, wrong = [], 0, 0
    for tiles, num_splits in SPLIT_CASES:
        ranges, outside, not_once, empty = split_reads(split_range, kernel, tiles, num_splits)
        past += outside
        wrong += not_once
        reaching = [s for s, (a, b) in enumerate(ranges) if b > tiles]
        text = f"[0, {tiles}) cut {num_splits} ways: {empty} empty splits, {outside} tile reads past hi"
        if reaching:
            a, b = ranges[reaching[-1]]
            text += f" (split {reaching[-1]} reads [{a}, {b}))"
        seen.append(text)
    report = "; ".join(seen)
    if wrong:
        return Result(
            False,
            report + f"; {wrong} tiles of some range are read other than once: the exercise "
            "keeps n = ceil((hi - lo) / num_splits) and each split's start lo + s n",
        )
    if past == 0:
        return Result(
            False,
            report + ": every split stays inside [lo, hi) (the exercise wants the two "
            "cutlass.min(..., hi) gone)",
        )
    return Result(
        True,
        report + f": {past} KV tiles loaded and multiplied past the end of their ranges, keys "
        "past Sk or past seqused_k, or under a mask no row of the tile passes",
    )


_ALL.append(
    Exercise(
        id="13a",
        stage=13,
        track="hopper",
        task=(
            "Drop the clamps. In `Sm90Kernel.split_range` of `stages/stage13_split_kv/hopper.py` "
            "give split s the KV tiles [lo + s n, lo + (s + 1) n) without clamping either end to "
            "hi: `split_lo = lo + split * per_split` and `return split_lo, split_lo + "
            "per_split`. Before you run the check: a decode step of 8,269 keys has 65 KV tiles; "
            "cut 16 ways, which splits read past hi, and how many KV tiles past it? And 8 KV "
            "tiles cut 16 ways? Then think about what those tiles hold: zeros past the end of K "
            "and V in batch mode (TMA fills them), the next sequence's keys when packed, "
            "anything - even NaN - past seqused_k. The check compiles the file and runs the "
            "kernel's own `split_range` (the Python under `@cute.jit`) on integers."
        ),
        solution=(
            (
                "        split_lo = cutlass.min(lo + split * per_split, hi)\n"
                "        return split_lo, cutlass.min(split_lo + per_split, hi)\n",
                "        split_lo = lo + split * per_split\n"
                "        return split_lo, split_lo + per_split\n",
            ),
        ),
        check=_check_13a,
        hint="n = ceil(65 / 16) = 5: 16 x 5 = 80 tiles asked for, 65 there",
    )
)

# ---------------------------------------------------------------- stage 14

# (seqused_k, page_size, max_pages) on which 14a runs the kernel's load_tiles, one sequence each,
# a decode step over KV tiles [0, ceil(seqused_k / 128)): 1,100 keys in pages of 16 (the last
# tile's boxes 5-7 lie past the keys), 1,040 keys in pages of 64 (box 1 of the last tile), a
# full row of 33 pages of 32 (the last tile reaches past the row's end), one key, and pages of
# 256 (whole tiles: nothing lies past the last page).
PAGE_CASES = ((1100, 16, 72), (1040, 64, 20), (1056, 32, 33), (1, 16, 4), (1100, 256, 5))


class _Overlay:
    """A module seen through a few replaced names (the DSL's loop and copy, for load_tiles)."""

    def __init__(self, module, **names):
        self._module, self._names = module, names

    def __getattr__(self, name):
        return self._names[name] if name in self._names else getattr(self._module, name)


class _Recorder:
    """A tensor stand-in: `read(index)` answers each subscript and every index is recorded."""

    def __init__(self, read, log=None):
        self._read, self.log = read, log

    def __getitem__(self, index):
        if self.log is not None:
            self.log.append(index)
        return self._read(index)


def plain_method(cls, name, **names):
    """Method `name` of kernel class `cls` as plain Python: its source, read from the file the
    class was loaded from, compiled without its decorators (no @cute.jit) in the module's globals
    with `names` replacing some of them. (The DSL rewrites a @cute.jit function once it has
    compiled it, so its __wrapped__ cannot be relied on to stay plain.)"""
    import ast

    module = sys.modules[cls.__module__]
    with open(module.__file__) as f:
        tree = ast.parse(f.read())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    fn = next(n for n in body.body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    scope = dict(vars(module), **names)
    exec(compile(ast.Module([fn], type_ignores=[]), module.__file__, "exec"), scope)
    return scope[name]


def box_reads(kernel, seqused_k, table_row):
    """What the producer loads for one sequence of a decode step: the kernel's load_tiles (its
    source run as plain Python, cutlass.range and the TMA cute.copy replaced by Python's range and
    a recorder) for K of every KV tile [0, ceil(seqused_k / bN)), with pages = (the table,
    sequence 0, last_page = (seqused_k - 1) // page_size) as `load` passes them. table_row: the
    sequence's page_table row (a list). Returns [(kv_tile, box c, entry read, page, first row of
    the box in its page)]; an entry past the row reads page None."""
    import cutlass
    import cutlass.cute as cute

    bN, page_size = kernel.cta_tile[1], kernel.page_size
    copies, entries = [], []

    def entry_page(index):
        _, e = index
        return table_row[e] if 0 <= e < len(table_row) else None

    run = plain_method(
        type(kernel),
        "load_tiles",
        cutlass=_Overlay(cutlass, range=lambda *a, unroll=None: range(*a)),
        cute=_Overlay(
            cute, copy=lambda atom, src, dst, tma_bar_ptr=None: copies.append((src, dst))
        ),
    )
    pipe = types.SimpleNamespace(producer_acquire=lambda s: None, producer_get_barrier=lambda s: 0)
    state = types.SimpleNamespace(index=0, phase=0)
    # (None, box of the page, page) -> (box of the page, page); (None, c, slot) -> c
    g_boxes = _Recorder(lambda i: (i[1], i[2]))
    s_boxes = _Recorder(lambda i: i[1])
    table = _Recorder(entry_page, entries)
    reads = []
    for kv_tile in range(-(-seqused_k // bN)):
        copies.clear()
        entries.clear()
        pages = (table, 0, (seqused_k - 1) // page_size)
        run(kernel, pipe, state, kv_tile, None, g_boxes, s_boxes, pages)
        for (_, e), ((box, page), c) in zip(entries, copies, strict=True):
            reads.append((kv_tile, int(c), int(e), page, int(box) * kernel.page_rows))
    return reads


def page_reads_summary(reads, seqused_k, page_size, max_pages):
    """(boxes holding a key that read the wrong page or rows, table entries read past the
    sequence's ceil(seqused_k / page_size) pages but inside its row, entries read past the row's
    max_pages) of box_reads' list."""
    r = min(page_size, 128)
    used = -(-seqused_k // page_size)
    wrong = unchecked = past_row = 0
    for kv_tile, c, entry, _, row in reads:
        key = kv_tile * 128 + c * r
        if key < seqused_k and (entry != key // page_size or row != key % page_size):
            wrong += 1
        if used <= entry < max_pages:
            unchecked += 1
        elif entry >= max_pages:
            past_row += 1
    return wrong, unchecked, past_row


def _check_14a(mod):
    # The edited file must still compile (the paged decode kernel, pages of 16); then its
    # load_tiles runs on ints for each case of PAGE_CASES, the sequence's pages 100, 101, ... in
    # its row and -1 in the entries after them.
    import torch

    compile_module(mod, "hopper", shape=(1, 32, 1, 1100, 128), kv_heads=8, page_size=16)
    seen, wrong, unchecked, past_row = [], 0, 0, 0
    for seqused_k, page_size, max_pages in PAGE_CASES:
        kernel = mod.compile_args(
            torch.bfloat16, (1, 32, 1, max_pages * page_size, 128), kv_heads=8, page_size=page_size
        )[0]
        used = -(-seqused_k // page_size)
        row = [100 + i for i in range(used)] + [-1] * (max_pages - used)
        reads = box_reads(kernel, seqused_k, row)
        w, u, p = page_reads_summary(reads, seqused_k, page_size, max_pages)
        wrong, unchecked, past_row = wrong + w, unchecked + u, past_row + p
        top = max(e for _, _, e, _, _ in reads)
        seen.append(
            f"{seqused_k:,} key{'s' if seqused_k > 1 else ''} in pages of {page_size} ({used} of "
            f"{max_pages} entries its own): entries 0-{top} read"
        )
    report = "; ".join(seen)
    if wrong:
        return Result(
            False,
            report + f"; {wrong} boxes holding keys read the wrong page or rows: the exercise "
            "changes only which entry a box past the last page reads",
        )
    if unchecked + past_row == 0:
        return Result(
            False,
            report + ": no entry past a sequence's pages is read (the exercise wants the "
            "cutlass.min(..., last_page) gone)",
        )
    return Result(
        True,
        report + f": {unchecked} reads of entries past a sequence's pages, which the host never "
        "checks (-1 here; in a serving stack a freed page or another sequence's), and "
        f"{past_row} past the end of its row (the next sequence's row, or past the table), "
        "counted for K; V's loads read the same",
    )


_ALL.append(
    Exercise(
        id="14a",
        stage=14,
        track="hopper",
        task=(
            "Drop the clamp to the last page. In `Sm90Kernel.load_tiles` of "
            "`stages/stage14_paged_kv/hopper.py` let box c read the page_table entry of its first "
            "key whatever the sequence's length: `page = page_table[batch, key // "
            "self.page_size]`. Before you run the check: a sequence of 1,100 keys in pages of 16 "
            "owns entries 0-68 of its row; its last KV tile (keys 1,024-1,151) is 8 boxes; which "
            "entries do they read with the clamp and without it? The same for 1,056 keys in a "
            "row of 33 pages of 32, and for 1,100 keys in pages of 256. Then think about what "
            "those entries hold: the host checks only a sequence's own entries. The check "
            "compiles the file and runs the kernel's own `load_tiles` (the Python under "
            "`@cute.jit`, its TMA copy replaced by a recorder) on integers."
        ),
        solution=(
            (
                "page = page_table[batch, cutlass.min(key // self.page_size, last_page)]",
                "page = page_table[batch, key // self.page_size]",
            ),
        ),
        check=_check_14a,
        hint="the last page holds keys (seqused_k - 1) // page_size x page_size .. seqused_k - 1",
    )
)

# ---------------------------------------------------------------- stage 15

# (S, N) on which 15a runs the ring's causal schedule on zig-zag chunks: pieces of 2 tokens over
# 2 ranks, notebook 15's 32 tokens over 4 ranks, uneven pieces (37 tokens over 3 ranks: pieces
# of 7 and 6), and S < 2N (5 tokens over 4 ranks: empty pieces). RING_RUN: the ring itself.
RING_CASES = ((8, 2), (32, 4), (37, 3), (5, 4))
RING_RUN = (37, 3)


def schedule_coverage(module, seqlen, world, causal, zigzag):
    """How the ring schedule of `module` (ring.py, or an edited copy: its Chunks and step_work)
    covers the (query, key) pairs of a sequence of `seqlen` tokens over `world` ranks: (pairs
    the mask allows that no step computes, pairs computed at more than one step, pairs the mask
    forbids that some step computes). Rank r at step t holds the K/V chunk of rank (r - t) mod
    N; a causal block is square and computes its lower triangle."""
    import torch

    chunks = module.Chunks(seqlen, world, zigzag)
    seen = torch.zeros(seqlen, seqlen, dtype=torch.int64)  # (query position, key position)
    for rank in range(world):
        qpos = chunks.positions(rank)
        for step in range(world):
            src = (rank - step) % world
            work = module.step_work(chunks, rank, src, causal)
            if work is None:
                continue
            q_rows, kv_rows, step_causal = work
            qi, ki = qpos[q_rows], chunks.positions(src)[kv_rows]
            block = torch.ones(len(qi), len(ki), dtype=torch.int64)  # (rows, keys) of the call
            if step_causal:
                block = torch.tril(block)
            rows, cols = qi[:, None].expand_as(block), ki[None, :].expand_as(block)
            seen.index_put_((rows, cols), block, accumulate=True)
    allowed = torch.ones(seqlen, seqlen, dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed)
    missed = int(((seen == 0) & allowed).sum())
    repeated = int((seen > 1).sum())
    forbidden = int(((seen > 0) & ~allowed).sum())
    return missed, repeated, forbidden


def ring_error(module, seqlen, world, causal=True, zigzag=True, seed=15):
    """attention_cp of `module` on `world` thread ranks (its FakeRing), each rank's chunk cut by
    its chunk_of, an fp64 attention in place of the kernel, against one fp64 attention over the
    whole sequence: (max |O - O_ref|, max |LSE - LSE_ref|), the ranks' outputs put back in
    sequence order by the module's Chunks. (1, 2, S, 8) queries, keys and values."""
    import torch

    from common.tools.reference import attention_gqa_ref

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, seqlen, 8, generator=g, dtype=torch.float64) for _ in range(3))
    o_ref, lse_ref = attention_gqa_ref(q, k, v, causal)
    ring = module.FakeRing(world, timeout=60)
    results = ring.run(
        lambda r: module.attention_cp(
            *(module.chunk_of(t, r.rank, world, zigzag) for t in (q, k, v)),
            group=r,
            causal=causal,
            zigzag=zigzag,
            attention=attention_gqa_ref,
            return_lse=True,
            seqlen=seqlen,
        )
    )
    chunks = module.Chunks(seqlen, world, zigzag)
    o, lse = torch.zeros_like(o_ref), torch.full_like(lse_ref, float("nan"))
    for r, (o_r, lse_r) in enumerate(results):
        pos = chunks.positions(r)
        o[:, :, pos], lse[:, :, pos] = o_r.double(), lse_r.double()
    err_o = (o - o_ref).abs().max()
    err_lse = (lse - lse_ref).abs().nan_to_num(nan=float("inf")).max()  # a token no rank returns
    return float(err_o), float(err_lse)


def _check_15a(mod):
    # The edited ring.py's zig-zag cut against torch.tensor_split's pieces in both orders, its
    # causal schedule's coverage on RING_CASES, and its ring on RING_RUN against one attention.
    import torch

    kept = swapped = True
    seen, missed, repeated, forbidden = [], 0, 0, 0
    for seqlen, world in RING_CASES:
        count = 2 * world
        piece = [(int(p[0]), int(p[-1]) + 1) if len(p) else None for p in
                 torch.arange(seqlen).tensor_split(count)]  # fmt: skip
        got = [[(a, b) if b > a else None for a, b in pieces] for pieces in
               mod.Chunks(seqlen, world, True).pieces]  # fmt: skip
        kept &= got == [[piece[r], piece[count - 1 - r]] for r in range(world)]
        swapped &= got == [[piece[count - 1 - r], piece[r]] for r in range(world)]
        m, t, f = schedule_coverage(mod, seqlen, world, True, True)
        missed, repeated, forbidden = missed + m, repeated + t, forbidden + f
        seen.append(f"S = {seqlen} over {world}: {m} missed, {t} twice, {f} masked yet computed")
    err_o, err_lse = ring_error(mod, *RING_RUN)
    report = (
        "pairs of the causal schedule on zig-zag chunks: " + "; ".join(seen) + f". The ring of "
        f"{RING_RUN[1]} ranks over {RING_RUN[0]} tokens against one attention: max |O - O_ref| = "
        f"{err_o:.1e}, max |LSE - LSE_ref| = {err_lse:.1e}"
    )
    wrong = missed + repeated + forbidden > 0 or err_o > 1e-5 or err_lse > 1e-5
    if kept:
        return Result(
            False,
            "rank r holds pieces r and 2N - 1 - r, in that order; "
            + report
            + (
                ": the edit changed something other than the cut"
                if wrong
                else " (the exercise wants the two pieces of each chunk swapped)"
            ),
        )
    if not swapped:
        return Result(
            False,
            "the zig-zag pieces are neither in ring.py's order nor swapped (the exercise swaps "
            "the two pieces of each rank's chunk, nothing else); " + report,
        )
    if not wrong:
        return Result(
            True,
            "rank r holds pieces 2N - 1 - r, then r; " + report + ": the schedule follows the "
            "new order, so ring_step was changed to match it",
        )
    return Result(
        True,
        "rank r holds pieces 2N - 1 - r, then r; " + report + ": ring_step still reads a "
        "chunk's first piece as the earlier one",
    )


_ALL.append(
    Exercise(
        id="15a",
        stage=15,
        track=None,
        file="stages/stage15_context_parallel/ring.py",
        task=(
            "Swap the zig-zag pieces. In `Chunks.__init__` of "
            "`stages/stage15_context_parallel/ring.py` give rank r its two pieces in the other "
            "order, `[piece[count - 1 - r], piece[r]]`: every rank still holds the same tokens, "
            "only their order in its chunk changes, and `ring_step` is left as it is. Before you "
            "run the check: with 8 tokens over 2 ranks (pieces of 2 tokens), rank 0's chunk is "
            "then tokens 6, 7, 0, 1. Which (query, key) pairs does its step 0 - its own chunk, "
            "causal over the chunk as one block - compute, which does it miss, and which does "
            "it compute that the mask forbids? The check runs the edited file's own `Chunks` and "
            "`step_work` on integers and its `attention_cp` on threads (`FakeRing`) with an "
            "fp64 attention in place of the kernel, against one attention over the sequence."
        ),
        solution=(
            (
                "[piece[r], piece[count - 1 - r]] if zigzag else [piece[r]]",
                "[piece[count - 1 - r], piece[r]] if zigzag else [piece[r]]",
            ),
        ),
        check=_check_15a,
        hint="a causal block of Sq = Sk keys is the lower triangle of the chunk's own order",
    )
)

EXERCISES = {e.id: e for e in _ALL}


def exercise(id):
    try:
        return EXERCISES[id]
    except KeyError:
        raise ValueError(
            f"exercise {id!r} does not exist; exercises: "
            f"{sorted(EXERCISES, key=lambda e: (int(e[:-1]), e))}"
        ) from None


def check(id, edits=(), show=True, gpu=True):
    """Load the exercise's stage file as it is on disk now (plus `edits`), run its check, print
    and return the Result. A file that no longer imports or compiles is reported, not raised.
    Where a GPU of the exercise's track exists (and gpu=True), the edited kernel also runs and
    the Result says what its output did against the fp64 reference."""
    ex = exercise(id)
    try:
        mod = load_stage_file(ex.stage, ex.track, edits, path=ex.path)
        result = ex.check(mod)
    except Exception as e:  # the learner's edit broke the file: say so, in one line
        first = error_line(e)
        return _show(
            id,
            Result(False, f"the edited file does not compile: {type(e).__name__}: {first}"),
            show,
        )
    if ex.gpu_check is not None and gpu and gpu_track_available(ex.track):
        try:
            seen = ex.gpu_check(mod)
        except Exception as e:
            first = error_line(e)
            seen = f"the launch failed: {type(e).__name__}: {first}"
        result = Result(result.done, f"{result.message}. On this GPU: {seen}")
    return _show(id, result, show)


def _show(id, result, show):
    if show:
        print(f"exercise {id}: {result}")
    return result


def main(argv=None):
    """`python -m common.tools.exercises` lists the exercises; with an id it prints the task,
    with --hint the hint, with --check the check's verdict on the file as it is on disk."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m common.tools.exercises",
        description="The exercises that edit a kernel (the last section of notebooks 2-15).",
    )
    p.add_argument("id", nargs="?", help="an exercise, e.g. 4a; without it: the list")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--hint", action="store_true", help="print the exercise's hint")
    what.add_argument("--check", action="store_true", help="check the edited file")
    args = p.parse_args(argv)
    if args.id is None:
        if args.hint or args.check:
            p.error("--hint and --check need an exercise id, e.g. 4a")
        for ex in _ALL:
            where = os.path.relpath(ex.path, ROOT)
            task = ex.task.strip().replace("\n", " ")
            title = min(task.split(". ")[0], task.split(": ")[0], key=len)  # its first words
            print(f"{ex.id:4} {title} ({where})")
        print("python -m common.tools.exercises ID [--hint | --check]")
        return 0
    try:
        ex = exercise(args.id)
    except ValueError as e:
        p.error(str(e))
    if args.check:
        return 0 if check(ex.id).done else 1
    print(ex.hint if args.hint else f"exercise {ex.id}, edit {os.path.relpath(ex.path, ROOT)}:")
    if not args.hint:
        print(ex.task)
    return 0


if __name__ == "__main__":
    sys.exit(main())
