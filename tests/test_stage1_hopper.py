"""Stage 1 (Hopper): C = A @ B^T with TMA, an mbarrier pipeline and wgmma on sm_90a.

Compile-only tests need no GPU: the sm_90a PTX must hold the instructions the stage teaches. The
numerics (marker gpu_hopper) and the bad-input tests run on both tracks in tests/test_stage1.py.
"""

import pytest
import torch
from attention_cases import DTYPES, dtype_id, shape_id
from ptxas_checks import ptxas_ran

from common.tools.ptx import compile_only

# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1024, 1024, 1024), (1000, 264, 200)], ids=shape_id)
def test_compiles_for_sm90a(dtype, shape):
    report = compile_only(1, "hopper", dtype=dtype, shape=shape)
    counts, ptx = report.counts, report.ptx
    # One K tile = bK / 16 = 4 m64n256k16 wgmma per warpgroup, unrolled once in the main loop.
    assert counts["wgmma.mma_async"] == 4, report.summary()
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    assert f"wgmma.mma_async.sync.aligned.m64n256k16.f32.{ab}.{ab}" in ptx
    assert counts["wgmma.commit_group"] >= 1 and counts["wgmma.wait_group"] >= 1
    # TMA loads of A and B (prologue and main loop) and the TMA store of C.
    assert "cp.async.bulk.tensor" in ptx
    assert (
        counts["cp.async.bulk.tensor (load)"] >= 2 and counts["cp.async.bulk.tensor (store)"] >= 1
    )
    # Consumers wait on the full barriers, the producer on the empty ones.
    assert counts["mbarrier.try_wait"] >= 2 and "mbarrier.try_wait" in ptx
    assert "mbarrier.arrive.expect_tx" in ptx
    # 4 buffers of A (128 x 64) + B (256 x 64) x 2 bytes = 48 KiB, plus 1 KiB: the mbarriers,
    # padded to the 1 KiB alignment of the swizzled tiles. 193 KiB of the 227 KiB a CTA may use.
    assert report.shared_memory_bytes == 4 * 48 * 1024 + 1024, report.summary()
    if ptxas_ran(report.resources, "sm_90a"):
        # 128 fp32 accumulators per thread must stay in registers.
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )
