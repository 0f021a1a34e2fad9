"""Stage 6 (Hopper): causal and sliding-window masks with tile skipping.

- Compile-only (no GPU): the loop body is stage 5's (the same wgmma, exp2 and shuffle counts),
  one kernel for every mask (the bounds are run-time values), no spills.
- The numerics against the fp64 reference (marker gpu_hopper) and the bad-input tests run on
  both tracks, with the same cases, in tests/test_stage6.py.
"""

import pytest
import torch
from attention_cases import DTYPES, dtype_id
from ptxas_checks import ptxas_ran

from common.tools.ptx import compile_only
from stages.stage6_masks import hopper


def compile_stage6(dtype, D, **options):
    from common.tools.ptx import compile_for_arch, count_ptx, ptxas_resources

    kernel, args = hopper.compile_args(dtype, (2, 4, 512, 1024, D), **options)
    ptx, _ = compile_for_arch(kernel, args, "sm_90a")
    return ptx, count_ptx(ptx), ptxas_resources(ptx, "sm_90a"), kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_compiles_with_stage5_loop_body(dtype, D):
    ptx, counts, res, kernel = compile_stage6(dtype, D, causal=True)
    five = compile_only(5, "hopper", dtype=dtype, shape=(2, 4, 512, 1024, D), resources=False)
    # The mask adds integer compares and selects, not tensor-core or exponential work: per KV
    # tile D / 16 + 8 wgmma, 64 + 2 ex2 per thread, as in stage 5.
    for family in ("wgmma.mma_async", "ex2.approx", "wgmma.wait_group", "shfl.sync"):
        assert counts[family] == five.counts[family], (family, counts[family], five.counts[family])
    assert counts["cp.async.bulk.tensor (load)"] == five.counts["cp.async.bulk.tensor (load)"]
    # Shared memory as in stage 5: Q + 2 KV slots + 1 KiB of barriers.
    assert kernel.shared_memory_bytes == 3 * 128 * D * 2 + 1024
    if ptxas_ran(res, "sm_90a"):
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res


def test_one_kernel_for_every_mask():
    # causal and window are run-time bounds: the compiled code is the same for all of them.
    a, *_ = compile_stage6(torch.bfloat16, 64)
    b, *_ = compile_stage6(torch.bfloat16, 64, causal=True, window=(256, None))
    assert a == b
