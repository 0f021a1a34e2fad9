"""Stage 13 (Blackwell): split-KV (FlashDecoding) on stage 12's tuned kernel, on sm_100a.

- Compile-only (no GPU), in the configurations of tests/test_stage13_hopper.py (16 splits, MQA,
  causal + GQA with splits, packed + seqused_k, a window, one split + seqused_k, the default),
  bf16 and fp16, D = 64 and 128: stage 12's roles, setmaxnreg 176 / 112 / 48, MMA order (each
  GEMM's k-blocks in a loop) and tcgen05 fences (every path fenced, tests/blackwell_ptx.py);
  the split kernel stores O_partial in fp32 from registers (twice the 16-byte stores of the
  input dtype's rows) and no TMA store of O; the unsplit kernel keeps stage 12's TMA store; V's
  tail is zeroed where keys can end early (packed, seqused_k) and only there; no spill (ptxas
  of CUDA 13.0, 2026-12-04), here and in a pack-GQA decode step.
- The unsplit kernel without seqused_k is stage 12's PTX, but for the kernel's name and its
  unused num_splits parameter; without the tunings (with_tunings(())) it is stage 11's.
- CPU: tile_coords covers every (row block, head, sequence, split) once, the split fastest;
  the kernel's split_range (run on ints) reads every KV tile of a range once and none past it;
  the schedule checker replays the five roles over split ranges, empty ones among them.
- GPU tests (marker gpu_blackwell): tests/test_stage13.py and stage 7's set run on this stage.
  Not run: no sm_100 GPU was available (2026-12-04).
"""

import functools
import re

import cutlass
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from blackwell_ptx import assert_no_spill, assert_tcgen05_fences, global_stores
from ptxas_checks import ptxas_ran
from test_stage11_blackwell import statements
from test_stage13_hopper import CONFIGS, config_id

from common import attention_host
from common.tools import exercises, schedule
from common.tools.ptx import compile_for_arch, compile_only, tcgen05_mma_order
from stages.stage13_split_kv import blackwell

SHAPE = (2, 8, 512, 1024)


@functools.lru_cache(maxsize=None)
def stage12_ptx(D, dtype):
    return compile_only(12, "blackwell", dtype=dtype, shape=(*SHAPE, D), resources=False).ptx


def sixteen_byte_stores(ptx):
    return [s for s in global_stores(ptx) if re.fullmatch(r"st\.global\.(v2\.b64|v4\.b32)", s)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_compiles(config, D, dtype):
    report = compile_only(13, "blackwell", dtype=dtype, shape=(*SHAPE, D), **config)
    kernel, ptx = blackwell.compile_args(dtype, (*SHAPE, D), **config)[0], report.ptx
    split = config.get("num_splits", 1) > 1
    keys_end_early = config.get("varlen", False) or config.get("seqused_k", False)
    assert kernel.split_kv == split and kernel.takes_splits
    # stage 12's roles, registers (176 / 112 / 48), MMA order and fences
    assert ".reqntid 512, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert_register_split(ptx)
    assert tcgen05_mma_order(ptx) == tcgen05_mma_order(stage12_ptx(D, dtype))
    assert_tcgen05_fences(ptx, before=11, after=16 if D == 64 else 12)
    # O: the split kernel's rows of O_partial in fp32, 2 Q tiles x D x 4 bytes in 16-byte
    # stores, no TMA store; the unsplit kernel (batch mode here) stages O for a TMA store per
    # Q tile. LSE: one 4-byte store per Q tile either way.
    tma_stores = statements(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")
    if split:
        assert len(sixteen_byte_stores(ptx)) == 2 * D * 4 // 16 and not tma_stores
    else:
        assert not sixteen_byte_stores(ptx) and len(tma_stores) == 2 * D // 64
    assert global_stores(ptx).count("st.global.b32") == 2
    # The shared-memory writes made visible to the async proxy: zero_keys' (V's tail), only
    # where keys can end early, and the unsplit kernel's O staging (one per Q tile)
    fences = statements(ptx, r"fence\.proxy\.async\.shared::cta")
    assert len(fences) == int(keys_end_early) + (0 if split else 2)
    assert report.shared_memory_bytes <= 227 * 1024
    if ptxas_ran(report.resources, "sm_100a"):
        # ptxas of CUDA 13.0 (2026-12-06): no spill, as stage 12 (and with_tunings(()), the
        # split on stage 11's kernel)
        assert report.resources["registers"] == 128, report.summary()
        assert_no_spill(report)


def assert_register_split(ptx):
    """setmaxnreg as stage 12's: 176 for each softmax warpgroup, 112 for the correction
    warpgroup, 48 for the MMA, TMA and idle warps."""
    assert len(statements(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+176;")) == 2
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+112;")) == 1
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+48;")) == 3


def ptx_body(ptx):
    """The PTX after the kernel's parameter list, the kernel's name replaced."""
    ptx = re.sub(r"kernel_cutlass_kernel_stages\w+", "KERNEL", ptx)
    return ptx[ptx.index("\n)\n") :]


@pytest.mark.parametrize("D", [64, 128])
def test_unsplit_kernel_is_stage_12s(D):
    # num_splits = 1 is folded into the kernel (split_kv False): the same instructions
    ptx = compile_only(13, "blackwell", shape=(*SHAPE, D), resources=False).ptx
    assert ptx_body(ptx) == ptx_body(stage12_ptx(D, torch.bfloat16))


@pytest.mark.parametrize("D", [64, 128])
def test_unsplit_kernel_without_tunings_is_stage_11s(D):
    # stage 12's switches carry over: with_tunings(()) is stage 11's PTX when unsplit
    kernel, args = attention_host.compile_args(
        blackwell.with_tunings(()), torch.bfloat16, (*SHAPE, D)
    )
    ptx, _ = compile_for_arch(kernel, args, "sm_100a")
    eleven = compile_only(11, "blackwell", shape=(*SHAPE, D), resources=False).ptx
    assert ptx_body(ptx) == ptx_body(eleven)


@pytest.mark.parametrize("D", [64, 128])
def test_decode_step_compiles(D):
    # Sq = 1, H = 32, Hkv = 8: the 4 query heads of a group packed into one Q tile, 16 splits,
    # seqused_k: O_partial's rows of (head, position) pairs, V's tail zeroed
    report = compile_only(
        13, "blackwell", shape=(1, 32, 1, 4096, D), kv_heads=8, num_splits=16, seqused_k=True
    )
    ptx = report.ptx
    assert_tcgen05_fences(ptx, before=11, after=16 if D == 64 else 12)
    assert len(sixteen_byte_stores(ptx)) == 2 * D * 4 // 16
    assert len(statements(ptx, r"fence\.proxy\.async\.shared::cta")) == 1
    if ptxas_ran(report.resources, "sm_100a"):
        assert_no_spill(report)


def test_launch_passes_seqused_k_and_num_splits():
    kernel, args = blackwell.compile_args(
        torch.bfloat16, (1, 32, 1, 4096, 128), kv_heads=8, num_splits=16, seqused_k=True
    )
    assert kernel.split_kv and kernel.pack_gqa == 4
    assert len(args) == 15  # stage 12's thirteen, seqused_k and num_splits
    assert args[-2] == 16 and args[3].element_type == cutlass.Float32


# ---------------------------------------------------------------- on the CPU


@pytest.mark.parametrize(
    "tiles_m, heads, sequences, l2_heads, num_splits",
    [(4, 6, 1, 2, 3), (3, 4, 3, 4, 1), (1, 8, 1, 1, 16), (2, 3, 2, 1, 5)],
)
def test_tile_order_covers_every_split_once(tiles_m, heads, sequences, l2_heads, num_splits):
    kernel = blackwell.Sm100Kernel(cutlass.BFloat16, 128, sm_count=7, split_kv=num_splits > 1)
    total = tiles_m * heads * sequences * num_splits
    coords = [kernel.tile_coords(t, tiles_m, heads, l2_heads, num_splits) for t in range(total)]
    assert sorted(coords) == sorted(
        (m, h, b, s)
        for m in range(tiles_m)
        for h in range(heads)
        for b in range(sequences)
        for s in range(num_splits)
    )
    # the splits of one tile are consecutive work tiles, split t % num_splits
    for t, (m, h, b, s) in enumerate(coords):
        assert s == t % num_splits and coords[t - s][:3] == (m, h, b)


@functools.lru_cache(maxsize=None)
def split_kernel(D=128):
    kernel, args = blackwell.compile_args(
        torch.bfloat16, (1, 32, 1, 4096, D), kv_heads=8, num_splits=16
    )
    compile_for_arch(kernel, args, "sm_100a")
    return kernel


def split_ranges(kernel, lo, hi, num_splits):
    """[(lo, hi)] of the splits of KV tiles [lo, hi), by the kernel's split_range (on ints)."""
    split_range = type(kernel).split_range.__wrapped__
    return exercises.split_reads(split_range, kernel, hi - lo, num_splits, lo)


# (KV tiles, splits, splits that get none): 65 cut 16 ways is 5 tiles each, 13 splits
@pytest.mark.parametrize(
    "tiles, num_splits, empty", [(65, 16, 3), (8, 16, 8), (1, 3, 2), (32, 16, 0), (7, 1, 0)]
)
def test_split_range_reads_every_tile_once(tiles, num_splits, empty):
    kernel = split_kernel()
    for lo in (0, 5):
        ranges, outside, not_once, got_empty = split_ranges(kernel, lo, lo + tiles, num_splits)
        assert (outside, not_once, got_empty) == (0, 0, empty), ranges
        assert ranges[0][0] == lo and max(b for _, b in ranges) == lo + tiles


# Work tiles' KV ranges, each cut into its splits (empty splits among them: a split whose
# range is empty takes no Q, K or V and writes O = 0, LSE = -inf)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize(
    "ranges, num_splits", [([(0, 5)], 3), ([(0, 3), (2, 9)], 4), ([(0, 2), (0, 0)], 16)], ids=str
)
def test_phases_run_on_across_splits(D, ranges, num_splits):
    kernel = split_kernel(D)
    pipes, programs = schedule.cta_schedule(kernel)
    work = [r for lo, hi in ranges for r in split_ranges(kernel, lo, hi, num_splits)[0]]
    assert len(work) == len(ranges) * num_splits
    assert schedule.simulate_cta(pipes, programs, work) == []
