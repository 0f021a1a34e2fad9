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
import shutil
import sys
import tempfile
from typing import Callable

from common.tools import stage_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FRESH = itertools.count()


@dataclasses.dataclass(frozen=True)
class Result:
    done: bool
    message: str

    def __str__(self):
        return ("done: " if self.done else "not yet: ") + self.message


@dataclasses.dataclass(frozen=True)
class Exercise:
    id: str  # "4a": stage 4, first exercise
    stage: int
    track: str  # the track whose file the learner edits
    task: str  # what to change and what to watch, in the notebook's words
    solution: tuple  # ((old text, new text), ...): each old text occurs once in the file
    check: Callable  # check(module) -> Result, on the stage module as loaded from disk
    hint: str = ""

    @property
    def path(self):
        return stage_path(self.stage, self.track)


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


# ---------------------------------------------------------------- the exercises
# One section per stage; each exercise is a check function and its registration. Anchor a
# solution on code, not on a comment, so that a reworded comment does not break it.

_ALL = []

# ---------------------------------------------------------------- stage 2

# ---------------------------------------------------------------- stage 3

# ---------------------------------------------------------------- stage 4


def _check_4a(mod):
    # Q (128 x 128) + kv_slots K/V tiles (128 x 128), 2 bytes each, + 1 KiB of barriers.
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
        hint="96 KiB + 32 KiB + 1 KiB of barriers",
    )
)

# ---------------------------------------------------------------- stage 5

# ---------------------------------------------------------------- stage 6

# ---------------------------------------------------------------- stage 7

EXERCISES = {e.id: e for e in _ALL}


def exercise(id):
    try:
        return EXERCISES[id]
    except KeyError:
        raise ValueError(
            f"exercise {id!r} does not exist; exercises: {sorted(EXERCISES)}"
        ) from None


def check(id, edits=(), show=True):
    """Load the exercise's stage file as it is on disk now (plus `edits`), run its check, print
    and return the Result. A file that no longer imports or compiles is reported, not raised."""
    ex = exercise(id)
    try:
        mod = load_stage_file(ex.stage, ex.track, edits)
        result = ex.check(mod)
    except Exception as e:  # the learner's edit broke the file: say so, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        result = Result(False, f"the edited file does not compile: {type(e).__name__}: {first}")
    if show:
        print(f"exercise {id}: {result}")
    return result
