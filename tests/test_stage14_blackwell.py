"""Stage 14 (Blackwell): a paged KV cache on stage 13's split-KV kernel, on sm_100a.

- Compile-only (no GPU), in the configurations of tests/test_stage14_hopper.py (page_size 16,
  32, 64, 128 and 256, split and not, MQA, causal + GQA, a window; unpaged with and without
  splits), bf16 and fp16, D = 64 and 128: stage 13's roles, setmaxnreg 176 / 112 / 48, MMA
  order and tcgen05 fences (every path fenced, tests/blackwell_ptx.py); the TMA loads of K and
  V are boxes of page_rows = min(page_size, 128) keys, as many copy instructions as stage 13's
  (the boxes of a tile are a loop); V's tail is zeroed (a paged cache always has seqused_k); O
  leaves as in stage 13; no spill (ptxas of CUDA 13.0, 2026-12-04), here and in a paged
  decode step.
- The unpaged kernel is stage 13's PTX, but for the kernel's name; stage 12's switches carry
  over (with_tunings(()): stage 11's register split, the paged kernel compiles).
- The launch passes the page table after num_splits; a decode step over pages of 16 keys
  (pack-GQA, 16 splits) compiles with its fences.
- GPU tests (marker gpu_blackwell): tests/test_stage14.py runs on this stage.
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
from test_stage13_blackwell import (
    assert_register_split,
    ptx_body,
    sixteen_byte_stores,
    stage12_ptx,
)
from test_stage14_hopper import CONFIGS, config_id

from common import attention_host
from common.tools.ptx import compile_for_arch, compile_only, tcgen05_mma_order
from stages.stage14_paged_kv import blackwell

SHAPE = (2, 8, 512, 1024)
TMA_LOAD = r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_compiles(config, D, dtype):
    report = compile_only(14, "blackwell", dtype=dtype, shape=(*SHAPE, D), **config)
    kernel, ptx = blackwell.compile_args(dtype, (*SHAPE, D), **config)[0], report.ptx
    page = config.get("page_size")
    split = config.get("num_splits", 1) > 1
    assert kernel.takes_pages and kernel.page_size == page and kernel.split_kv == split
    assert kernel.page_rows == (None if page is None else min(page, 128))
    # stage 13's roles, registers (176 / 112 / 48), MMA order and fences
    assert ".reqntid 512, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert_register_split(ptx)
    assert tcgen05_mma_order(ptx) == tcgen05_mma_order(stage12_ptx(D, dtype))
    assert_tcgen05_fences(ptx, before=11, after=16 if D == 64 else 12)
    # TMA loads: Q's two tiles, K's and V's box (a tile, or a loop over 128 / page_size boxes),
    # each D / 64 copies of 64 columns (128-byte rows of the 128-byte swizzle)
    assert len(statements(ptx, TMA_LOAD)) == 4 * D // 64
    # O as stage 13's: fp32 rows of O_partial, or a TMA store per Q tile
    tma_stores = statements(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")
    if split:
        assert len(sixteen_byte_stores(ptx)) == 2 * D * 4 // 16 and not tma_stores
    else:
        assert not sixteen_byte_stores(ptx) and len(tma_stores) == 2 * D // 64
    assert global_stores(ptx).count("st.global.b32") == 2
    # The shared-memory writes made visible to the async proxy: zero_keys' (V's tail; a paged
    # cache always has seqused_k) and the unsplit kernel's O staging (one per Q tile)
    fences = statements(ptx, r"fence\.proxy\.async\.shared::cta")
    assert len(fences) == int(page is not None) + (0 if split else 2)
    assert report.shared_memory_bytes <= 227 * 1024
    if ptxas_ran(report.resources, "sm_100a"):
        # ptxas of CUDA 13.0 (2026-12-06): no spill, as stage 13 (and with_tunings(()), stage
        # 11's register split)
        assert report.resources["registers"] == 128, report.summary()
        assert_no_spill(report)


@functools.lru_cache(maxsize=None)
def stage13_ptx(D, **options):
    return compile_only(13, "blackwell", shape=(*SHAPE, D), resources=False, **options).ptx


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_unpaged_kernel_is_stage_13s(D, num_splits):
    # page_size None: every paged branch folds away (page_table is None, not a parameter)
    options = dict(num_splits=num_splits, seqused_k=True)
    ptx = compile_only(14, "blackwell", shape=(*SHAPE, D), resources=False, **options).ptx
    assert ptx_body(ptx) == ptx_body(stage13_ptx(D, **options))


@pytest.mark.parametrize("D", [64, 128])
def test_paged_decode_step_compiles(D):
    # Sq = 1, H = 32, Hkv = 8: the 4 query heads of a group packed into one Q tile, 16 splits,
    # pages of 16 keys: 8 boxes per KV tile, V's tail zeroed
    report = compile_only(
        14, "blackwell", shape=(1, 32, 1, 4096, D), kv_heads=8, num_splits=16, page_size=16
    )
    ptx = report.ptx
    assert_tcgen05_fences(ptx, before=11, after=16 if D == 64 else 12)
    assert len(statements(ptx, TMA_LOAD)) == 4 * D // 64
    assert len(sixteen_byte_stores(ptx)) == 2 * D * 4 // 16
    assert len(statements(ptx, r"fence\.proxy\.async\.shared::cta")) == 1
    if ptxas_ran(report.resources, "sm_100a"):
        assert_no_spill(report)


def test_paged_kernel_without_tunings_compiles():
    # with_tunings(()) takes page_size as Sm100Kernel: stage 11's setmaxnreg 184 / 96 / 48
    kernel, args = attention_host.compile_args(
        blackwell.with_tunings(()),
        torch.bfloat16,
        (1, 32, 1, 4096, 64),
        kv_heads=8,
        num_splits=16,
        page_size=16,
    )
    assert kernel.page_rows == 16 and kernel.split_kv
    ptx, _ = compile_for_arch(kernel, args, "sm_100a")
    regs = r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);"
    assert sorted(map(int, re.findall(regs, ptx))) == [48, 48, 48, 96, 184, 184]
    assert len(statements(ptx, TMA_LOAD)) == 4


def test_launch_passes_the_page_table():
    kernel, args = blackwell.compile_args(
        torch.bfloat16, (1, 32, 1, 4096, 128), kv_heads=8, num_splits=16, page_size=16
    )
    assert kernel.split_kv and kernel.pack_gqa == 4 and kernel.page_rows == 16
    assert len(args) == 16  # stage 13's fifteen and page_table
    # seqused_k (B,), num_splits, page_table (B, max_pages): int32
    assert args[-4].element_type == cutlass.Int32 and len(args[-4].shape) == 1
    assert args[-3] == 16
    assert args[-2].element_type == cutlass.Int32 and len(args[-2].shape) == 2
