"""The check of the tcgen05 fences at the TMEM hand-offs (tests/blackwell_ptx.py,
tcgen05_fence_gaps, which every Blackwell stage's compile test runs) catches a missing fence.

- On small PTX programs: a fence on one side of a branch only, and a loop whose back edge
  carries a wait to the MMA at its head, are gaps; a fence on every path is none.
- In the PTX of every Blackwell stage (bf16, the stage's compile shape, batch mode; stages 10-14
  also at D = 64, their other MMA order; stage 13's split kernel, its unsplit one being
  stage 12's PTX; stage 14's split kernel over pages of 16 keys, its unpaged one being stage
  13's PTX): deleting any one tcgen05 fence from the PTX text leaves a gap,
  but for the fences right before the named barriers that free TMEM (one per warp role that
  touched TMEM). The per-tile fences before them cover those barriers on every path already;
  where they sit is checked by assert_tmem_freed_after_fence (stages 1-7) and the TMEM tests of
  stages 8 and 9.
- In the source: stages 5 and 8 compiled from a copy of their file with one fence call deleted,
  each per-tile fence in turn, fail the check. No GPU needed.
"""

import importlib.util
import pathlib
import re

import pytest
import torch
from blackwell_ptx import fence_deletions_not_caught, tcgen05_fence_gaps, tcgen05_fences

from common.tools import stage_table
from common.tools.ptx import compile_for_arch, compile_only

# ---------------------------------------------------------------- small programs

WAIT = "mbarrier.try_wait.parity.shared.b64 P1, [%r1], %r2, 10000000;"
MMA = "tcgen05.mma.cta_group::1.kind::f16 [%r3], %rd1, %rd2, %r4, {%r5, %r6, %r7, %r8}, %p1;"
AFTER = "tcgen05.fence::after_thread_sync;"
BEFORE = "tcgen05.fence::before_thread_sync;"


def program(*statements):
    return "\n".join(f"\t{s}" if not s.endswith(":") else s for s in statements)


@pytest.mark.parametrize(
    "ptx, gaps",
    [
        (program(WAIT, AFTER, MMA, "ret;"), 0),
        (program(WAIT, MMA, "ret;"), 1),
        # the fence on the branch's taken side only
        (program(WAIT, "@%p2 bra $L__BB0_2;", AFTER, "$L__BB0_2:", MMA, "ret;"), 1),
        (program(WAIT, "@%p2 bra $L__BB0_2;", MMA, "$L__BB0_2:", "ret;"), 1),
        (program(WAIT, AFTER, "@%p2 bra $L__BB0_2;", MMA, "$L__BB0_2:", "ret;"), 0),
        # a loop: fenced before it, but the wait at its end reaches the MMA at its head
        (program(WAIT, AFTER, "$L__BB0_1:", MMA, WAIT, "@%p2 bra $L__BB0_1;", "ret;"), 1),
        (program("$L__BB0_1:", WAIT, AFTER, MMA, "@%p2 bra $L__BB0_1;", "ret;"), 0),
        # a read of TMEM, its wait, then an arrive: fenced or not
        (
            program(
                "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%r1}, [%r2];",
                "tcgen05.wait::ld.sync.aligned;",
                "mbarrier.arrive.shared.b64 %rd1, [%r3], %r4;",
                "ret;",
            ),
            1,
        ),
        (
            program(
                "tcgen05.st.sync.aligned.32x32b.x32.b32 [%r2], {%r1};",
                "tcgen05.wait::st.sync.aligned;",
                BEFORE,
                "mbarrier.arrive.shared.b64 %rd1, [%r3], %r4;",
                "bar.sync 1, 128;",
                "ret;",
            ),
            0,
        ),
        (
            program(
                "tcgen05.wait::st.sync.aligned;",
                "@%p2 bra $L__BB0_2;",
                BEFORE,
                "$L__BB0_2:",
                "bar.arrive 3, 256;",
                "ret;",
            ),
            1,
        ),
    ],
)
def test_gaps_along_every_path(ptx, gaps):
    assert len(tcgen05_fence_gaps(ptx)) == gaps, tcgen05_fence_gaps(ptx)


# ---------------------------------------------------------------- fences deleted from the PTX

# Per stage: how many fences sit right before a barrier that frees TMEM (bar 1: the softmax
# warps' in stages 1-7; each softmax warpgroup's and the correction warpgroup's in stages 8-14)
TMEM_FREE_FENCES = {s: 1 for s in range(1, 8)} | {8: 2, 9: 3, 10: 3, 11: 3, 12: 3, 13: 3, 14: 3}
# Compile options per stage: stage 13's split kernel; stage 14's split kernel over pages of 16
STAGE_OPTIONS = {13: {"num_splits": 4}, 14: {"num_splits": 4, "page_size": 16}}
TMEM_FREE_BARRIER = re.compile(r"^bar(rier)?\.(sync|arrive)\s+1,\s*\d+;")


@pytest.mark.parametrize(
    "stage, D",
    [(s, 128) for s in range(1, 13)]
    + [(10, 64), (11, 64), (12, 64), (13, 128), (13, 64), (14, 128), (14, 64)],
    ids=lambda x: str(x),
)
def test_every_per_tile_fence_deleted_from_the_ptx_is_caught(stage, D):
    shape = stage_table.stage(stage).compile_shape
    if stage > 1:
        shape = (*shape[:4], D)
    options = STAGE_OPTIONS.get(stage, {})
    ptx = compile_only(stage, "blackwell", shape=shape, resources=False, **options).ptx
    missed = fence_deletions_not_caught(ptx)
    assert len(missed) == TMEM_FREE_FENCES[stage], missed
    assert all(TMEM_FREE_BARRIER.match(after) for _, after in missed), missed


# ---------------------------------------------------------------- fences deleted from the source

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The stage files, and the tcgen05 fences (before + after) of their PTX at the compile shape
STAGE_FILES = {
    5: ("stages/stage5_online_softmax/blackwell.py", 4 + 5),
    8: ("stages/stage8_warp_specialized/blackwell.py", 6 + 6),
}
FENCE_CALL = re.compile(r"^\s*fence_(before|after)_thread_sync\(\)\s*$")


def per_tile_fence_lines(path):
    """The 0-based lines of the stage file's fence calls, but for those right before a barrier
    that frees TMEM (epilog_sync_bar, tmem_free_bar)."""
    lines = path.read_text().splitlines()
    out = []
    for i, ln in enumerate(lines):
        if FENCE_CALL.match(ln):
            nxt = next(s.strip() for s in lines[i + 1 :] if s.strip())
            if not nxt.startswith(("epilog_sync_bar.", "tmem_free_bar.")):
                out.append(i)
    return out


DELETIONS = [
    pytest.param(stage, i, id=f"stage{stage}-line{i + 1}")
    for stage, (path, _) in STAGE_FILES.items()
    for i in per_tile_fence_lines(ROOT / path)
]


def test_the_deletions_cover_every_per_tile_fence():
    # stage 5: QK, PV, S's load and release, P's store and hand-over, O's load and release;
    # stage 8: issue_qk, issue_pv, S's load and release, P's store and hand-over, rescale_o's
    # two, O's load and release in the epilogue
    assert [p.values[0] for p in DELETIONS].count(5) == 8
    assert [p.values[0] for p in DELETIONS].count(8) == 10


@pytest.mark.parametrize("stage, line", DELETIONS)
def test_stage_without_one_fence_fails_the_check(stage, line, tmp_path):
    path, fences = STAGE_FILES[stage]
    lines = (ROOT / path).read_text().splitlines(keepends=True)
    copy = tmp_path / f"stage{stage}_without_line{line + 1}.py"
    copy.write_text("".join(lines[:line] + lines[line + 1 :]))
    spec = importlib.util.spec_from_file_location(copy.stem, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel, args = module.compile_args(torch.bfloat16, stage_table.stage(stage).compile_shape)
    ptx, _ = compile_for_arch(kernel, args, "sm_100a")
    assert sum(tcgen05_fences(ptx)) == fences - 1
    assert tcgen05_fence_gaps(ptx) != []
