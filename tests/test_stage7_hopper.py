"""Stage 7 (Hopper): GQA / MQA and packed variable-length sequences.

- Compile-only (no GPU): the batch-mode and packed kernels keep stage 6's loop body (the same
  wgmma and exp2 counts), no spills.
- Pack-GQA (the G query heads of a KV head in one Q tile's rows): a kernel of its own, with the
  same loop body.
- The numerics against the fp64 references (marker gpu_hopper), pack-GQA on the GPU and the
  bad-input tests run on both tracks, with the same cases, in tests/test_stage7.py.
"""

import pytest
import torch
from ptxas_checks import ptxas_ran

from stages.stage7_gqa_varlen import hopper


def compile_stage7(dtype, D, **options):
    from common.tools.ptx import compile_for_arch, count_ptx, ptxas_resources

    kernel, args = hopper.compile_args(dtype, (2, 8, 512, 1024, D), **options)
    ptx, _ = compile_for_arch(kernel, args, "sm_90a")
    return count_ptx(ptx), ptxas_resources(ptx, "sm_90a")


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("D", [64, 128])
def test_compiles_with_stage6_loop_body(varlen, D):
    counts, res = compile_stage7(torch.bfloat16, D, kv_heads=2, varlen=varlen, causal=True)
    assert counts["wgmma.mma_async"] == D // 16 + 8
    assert counts["ex2.approx"] == 64 + 2
    # Loads by TMA; O is stored by threads (16-byte chunks, only the sequence's rows).
    assert counts["cp.async.bulk.tensor (load)"] >= 3
    assert counts["cp.async.bulk.tensor (store)"] == 0
    if ptxas_ran(res, "sm_90a"):
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res


# ---------------------------------------------------------------- pack-GQA


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("D", [64, 128])
def test_compiles_with_pack_gqa(varlen, D):
    from common.tools.ptx import compile_for_arch

    counts, res = compile_stage7(
        torch.bfloat16, D, kv_heads=2, varlen=varlen, causal=True, pack_gqa=True
    )
    # A kernel of its own (4 query heads per tile), not the unpacked one under another name.
    ptx = {}
    for pack in (True, False):
        kernel, args = hopper.compile_args(
            torch.bfloat16, (2, 8, 512, 1024, D), kv_heads=2, varlen=varlen, pack_gqa=pack
        )
        assert kernel.pack_gqa == (4 if pack else 1)
        ptx[pack] = compile_for_arch(kernel, args, "sm_90a")[0].split("\n", 30)[-1]
    assert ptx[True] != ptx[False]
    # The loop body is the same; only Q's and O's addressing and the row -> position map change.
    assert counts["wgmma.mma_async"] == D // 16 + 8
    assert counts["ex2.approx"] == 64 + 2
    if ptxas_ran(res, "sm_90a"):
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res
