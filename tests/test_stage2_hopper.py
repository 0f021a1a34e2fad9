"""Stage 2 (Hopper): S = scale * Q K^T in fp32, batched over (batch, head) with rank-4 TMA, Q
resident in shared memory and K tiles streaming through the pipeline.

- Compile-only tests need no GPU: the sm_90a PTX must hold the m64n128k16 wgmma, the TMA loads
  of Q and K and the TMA store of S, the mbarrier waits.
- The numerics against the fp64 reference (marker gpu_hopper) and the bad-input tests run on
  both tracks in tests/test_stage2.py.
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
    report = compile_only(2, "hopper", dtype=dtype, shape=(2, 4, 512, 512, D))
    counts, ptx = report.counts, report.ptx
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    # One K tile: D / 16 m64n128k16 wgmma per warpgroup, both operands from shared memory.
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{ab}.{ab}" in ptx
    assert counts["wgmma.mma_async"] == D // 16, report.summary()
    # Rank-4 TMA: Q and K tiles addressed by (row, 0, head, batch); S stored by TMA.
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in ptx
    assert (
        counts["cp.async.bulk.tensor (load)"] >= 2 and counts["cp.async.bulk.tensor (store)"] >= 1
    )
    assert counts["mbarrier.try_wait"] >= 3 and "mbarrier.arrive.expect_tx" in ptx
    # Q (128 x D) + 2 K slots (128 x D each) x 2 bytes, the fp32 S staging tile (128 x 128 x 4),
    # plus 1 KiB: the mbarriers, padded to the 1 KiB alignment of the swizzled tiles.
    # D = 128: 32 + 64 + 64 + 1 = 161 KiB; D = 64: 16 + 32 + 64 + 1 = 113 KiB.
    assert report.shared_memory_bytes == 3 * 128 * D * 2 + 128 * 128 * 4 + 1024, report.summary()
    if ptxas_ran(report.resources, "sm_90a"):
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )
