"""Stage 6 (Blackwell): causal and sliding-window masks with tile skipping, on sm_100a.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, with and without masks: the tcgen05
  roles of stage 5 (the QK and PV tcgen05.mma, tcgen05.ld / st of S, P and O, the commits, TMA
  loads of Q, K and V each arming its own bytes) and the same counts of the loop body's
  instruction families as stage 5 (the unmasked tiles run its body). The element mask is one
  block of selects of -inf behind a branch (crosses_mask_edge()): 2 per score, against stage 5's
  1 (the row's interval has two ends now), none outside the block but LSE's -inf, and no exp2
  or tcgen05 operation inside it. The epilogue's tcgen05.ld of O each sit behind a branch (an
  empty range reads no TMEM and writes O = 0); stage 5's do not. tcgen05.dealloc after the
  fence and the softmax warps' barrier; stage 5's tcgen05 fences at the TMEM hand-offs, every
  path fenced (tests/blackwell_ptx.py). One kernel for every mask and shape (run-time bounds),
  no spills, within 224 registers.
- The range on the host: the docstring's tile counts (causal, 8k) from common.masks.
- The numerics against the fp64 reference (marker gpu_blackwell) and the bad-input tests run on
  both tracks, with the same cases, in tests/test_stage6.py.
"""

import re

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from blackwell_ptx import (
    PV_MMA,
    QK_MMA,
    assert_tcgen05_fences,
    assert_tmem_freed_after_fence,
    global_stores,
)
from ptxas_checks import ptxas_ran

from common import masks
from common.cute_interop import cute_dtype, fake_stream, to_cute
from common.tools.ptx import compile_for_arch, compile_only, expect_tx_immediates
from stages.stage6_masks import blackwell

SHAPE = (2, 4, 512, 1024, 128)
# S = -inf by a select: `selp.f32 %r, 0fFF800000, %s, %p` (either operand order)
NEG_INF_SELECT = re.compile(r"^\s*selp\.f32\s+[^;]*0fFF800000")
BRANCH = re.compile(r"^\s*@!?%p\d+\s+bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def skipped_by_branch(lines, first, last):
    """Whether PTX statements first..last lie in code that a conditional branch jumps over: a
    `@%p bra $L` before them, no label between it and them (nothing else enters), and `$L:`
    after them."""
    for j in range(first - 1, -1, -1):
        stmt = lines[j].strip()
        m = BRANCH.match(lines[j])
        if m:
            label = m.group(1) + ":"
            return any(ln.strip() == label for ln in lines[last + 1 :])
        if stmt.startswith("$L"):
            return False
    return False


def mask_selects(ptx):
    """[(first, last, count)]: the runs of -inf selects in the PTX, a run ending where a label,
    a branch, an exp2 or a tcgen05 operation comes between two selects."""
    lines = ptx.splitlines()
    runs = []
    for i, ln in enumerate(lines):
        if not NEG_INF_SELECT.match(ln):
            continue
        between = lines[runs[-1][1] + 1 : i] if runs else None
        if between is not None and not any(
            s.strip().startswith(("$L", "@", "bra", "ex2", "tcgen05")) for s in between
        ):
            runs[-1] = (runs[-1][0], i, runs[-1][2] + 1)
        else:
            runs.append((i, i, 1))
    return runs


def assert_mask_behind_the_edge_branch(ptx, selects_per_score):
    """One run of 128 x selects_per_score selects of -inf (the mask of the thread's row of S),
    skipped by a branch, with no exp2 or tcgen05 operation from the branch to its label; any
    other -inf select is single (LSE of a row that sees no key)."""
    lines = ptx.splitlines()
    runs = mask_selects(ptx)
    masks_ = [r for r in runs if r[2] > 1]
    assert [r[2] for r in masks_] == [128 * selects_per_score], runs
    first, last, _ = masks_[0]
    assert skipped_by_branch(lines, first, last), (first, last)
    assert all(r[2] == 1 for r in runs if r not in masks_), runs
    # the block holds the mask and nothing of the loop body (exp2, MMAs, TMEM traffic)
    start = max(j for j in range(first) if BRANCH.match(lines[j]))
    label = BRANCH.match(lines[start]).group(1) + ":"
    end = next(k for k in range(last, len(lines)) if lines[k].strip() == label)
    body = [ln.strip() for ln in lines[start:end]]
    assert not any(s.startswith(("ex2", "tcgen05")) for s in body)


def epilogue_o_loads(ptx, D):
    """Line numbers of the epilogue's tcgen05.ld of O: the last D / 32 tcgen05.ld of the PTX."""
    lines = ptx.splitlines()
    loads = [i for i, ln in enumerate(lines) if ln.strip().startswith("tcgen05.ld")]
    return lines, loads[-(D // 32) :]


LOOP_FAMILIES = (
    "tcgen05.mma",
    "tcgen05.ld",
    "tcgen05.st",
    "tcgen05.commit",
    "ex2.approx",
    "cp.async.bulk.tensor (load)",
    "mbarrier.arrive",
    "shfl.sync",
)


# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"window": (200, 0)}, {"causal": True, "window": (64, None)}],
    ids=["full", "causal", "window", "causal-window"],
)
def test_compiles_for_sm100a(dtype, D, options):
    shape = (*SHAPE[:4], D)
    report = compile_only(6, "blackwell", dtype=dtype, shape=shape, **options)
    five = compile_only(5, "blackwell", dtype=dtype, shape=shape, resources=False)
    counts, ptx = report.counts, report.ptx
    assert ".target sm_100a" in ptx
    # The tcgen05 roles of stage 5: S = Q @ K^T (D / 16 MMAs, A and B from shared memory), then
    # O += P @ V (8 MMAs, A = P from TMEM); TMEM allocated and freed once.
    assert len(QK_MMA.findall(ptx)) == D // 16, report.summary()
    assert len(PV_MMA.findall(ptx)) == 128 // 16, report.summary()
    assert counts["tcgen05.alloc"] == 1 and counts["tcgen05.dealloc"] == 1, report.summary()
    assert_tmem_freed_after_fence(ptx)
    # tcgen05 fences (common/tmem.py): stage 5's, 4 before and 5 after
    assert_tcgen05_fences(ptx, before=4, after=5)
    # The loop body of stage 5: the same MMAs, TMEM loads and stores (S: 4, rescale and epilogue
    # of O: D / 32 each; P: 2, O: D / 32), commits (S full, K free, P free, V free; Q free; O
    # full), TMA loads, arrives, exp2 of every score and row_scale.
    for family in LOOP_FAMILIES:
        assert counts[family] == five.counts[family], (family, counts[family], five.counts[family])
    assert expect_tx_immediates(ptx) == [128 * D * 2] * 3
    # The element mask: behind the edge test, two selects per score (stage 5: one).
    assert_mask_behind_the_edge_branch(ptx, selects_per_score=2)
    assert_mask_behind_the_edge_branch(five.ptx, selects_per_score=1)
    # The epilogue reads O from TMEM only if an MMA wrote it (a non-empty range).
    lines, loads = epilogue_o_loads(ptx, D)
    assert all(skipped_by_branch(lines, i, i) for i in loads), loads
    lines5, loads5 = epilogue_o_loads(five.ptx, D)
    assert not any(skipped_by_branch(lines5, i, i) for i in loads5)
    # O in predicated 16-byte stores, LSE one 32-bit store per row; shared memory as in stage 5.
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8) + ["st.global.b32"]
    assert report.shared_memory_bytes == five.shared_memory_bytes == 3 * 128 * D * 2 + 1024
    if ptxas_ran(report.resources, "sm_100a"):
        # 168 (bf16) and 209 (fp16) at D = 64 and 128 (ptxas of CUDA 13.0, 2026-12-01; stage 5:
        # 163 and 192); 224 leaves margin for another ptxas.
        assert report.resources["registers"] <= 224, report.summary()
        assert report.resources["spill_stores"] == 0, report.summary()
        assert report.resources["spill_loads"] == 0, report.summary()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_one_kernel_for_every_mask_and_shape(dtype):
    # causal and window are run-time bounds, B, H, Sq, Sk run-time extents: one compiled kernel.
    a = compile_only(6, "blackwell", dtype=dtype, shape=SHAPE, resources=False)
    b = compile_only(
        6,
        "blackwell",
        dtype=dtype,
        shape=(3, 5, 200, 300, 128),
        resources=False,
        causal=True,
        window=(256, None),
    )
    assert a.ptx == b.ptx


def test_launch_layouts_store_o_in_16_byte_vectors():
    # attention() wraps real tensors (here CPU ones) with to_cute(dynamic=True); the kernel must
    # store O in the same 16-byte vectors as with the fake tensors.
    B, H, Sq, Sk, D = 2, 3, 200, 300, 64
    q, k, v = attention_cases.qkv("cpu", B=B, H=H, Sq=Sq, Sk=Sk, D=D)
    o, lse = torch.empty_like(q), torch.empty(B, H, Sq)
    left, right = masks.resolve_window(True, None, Sq, Sk)
    args = [to_cute(t, dynamic=True) for t in (q, k, v, o, lse)]
    args += [0.18, left, right, fake_stream()]
    kernel = blackwell.Sm100Kernel(cute_dtype(q.dtype), D)
    ptx, _ = compile_for_arch(kernel, args, "sm_100a")
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8) + ["st.global.b32"]


def test_docstring_tile_counts():
    # Causal, 128 x 128 tiles, Sq = Sk = 8k: the counts the docstring gives.
    counts = masks.tile_counts(8192, 8192, *masks.resolve_window(True, None, 8192, 8192))
    assert counts == {"skipped": 2016, "partial": 64, "full": 2016, "all": 4096}
    assert "2016 are skipped, 2016 are" in " ".join(blackwell.__doc__.split())
