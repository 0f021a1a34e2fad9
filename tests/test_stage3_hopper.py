"""Stage 3 (Hopper): O = softmax(scale * Q K^T) V for Sk <= one KV tile, softmax in registers.

- Compile-only tests need no GPU: the sm_90a PTX must hold both wgmma shapes (the second with P
  from registers), the TMA loads, the mbarrier waits, the quad shuffles and one ex2 per score.
- The numerics against the fp64 reference (marker gpu_hopper) and the bad-input tests run on
  both tracks in tests/test_stage3.py.
"""

import pytest
import torch
from attention_cases import DTYPES, dtype_id
from ptxas_checks import ptxas_ran

from common.tools.ptx import compile_only

# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_compiles_for_sm90a(dtype, D):
    report = compile_only(3, "hopper", dtype=dtype, shape=(2, 4, 512, 128, D))
    counts, ptx = report.counts, report.ptx
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    # S = Q K^T: D / 16 m64n128k16 wgmma with both operands in shared memory (two descriptors).
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{ab}.{ab}" in ptx
    # O = P V: 128 / 16 = 8 m64nDk16 wgmma whose A operand is 4 registers of P.
    pv = [
        ln
        for ln in ptx.splitlines()
        if f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}" in ln
    ]
    assert sum("}, {%r" in ln for ln in pv) == 8, report.summary()
    assert counts["wgmma.mma_async"] == D // 16 + 8, report.summary()
    # Q, K and V by TMA, O stored by TMA; consumers wait on mbarriers.
    assert (
        counts["cp.async.bulk.tensor (load)"] >= 3 and counts["cp.async.bulk.tensor (store)"] >= 1
    )
    assert counts["mbarrier.try_wait"] >= 3 and "mbarrier.arrive.expect_tx" in ptx
    # One exp2 per score: 64 per thread (2 rows x 32 columns); max and sum over the quad.
    assert counts["ex2.approx"] == 64, report.summary()
    assert counts["shfl.sync"] >= 8
    # Q + 2 KV slots, 128 x D x 2 bytes each, plus 1 KiB: the mbarriers, padded to the 1 KiB
    # alignment of the swizzled tiles. D = 128: 97 KiB; D = 64: 49 KiB.
    assert report.shared_memory_bytes == 3 * 128 * D * 2 + 1024, report.summary()
    if ptxas_ran(report.resources, "sm_90a"):
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )
