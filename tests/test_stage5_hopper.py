"""Stage 5 (Hopper): one-pass attention with the online softmax (running max and sum, O rescaled
in registers), and the log-sum-exp of each row.

- Compile-only tests need no GPU: the sm_90a PTX must hold the two wgmma shapes (the second with
  P from registers), the TMA loads, the mbarrier waits, the quad shuffles, one ex2 per score
  plus one per row for the rescaling factor, and a single pass (2 wgmma batches per KV tile).
- The numerics against the fp64 reference (marker gpu_hopper) and the bad-input tests run on
  both tracks in tests/test_stage5.py.
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
    report = compile_only(5, "hopper", dtype=dtype, shape=(2, 4, 512, 1024, D))
    counts, ptx = report.counts, report.ptx
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    # One pass: per KV tile D / 16 wgmma for S = Q K^T (operands in shared memory) and
    # 128 / 16 = 8 for O += P V (A operand: 4 registers of P), each written once in the loop.
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{ab}.{ab}" in ptx
    pv = [
        ln
        for ln in ptx.splitlines()
        if f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}" in ln
    ]
    assert sum("}, {%r" in ln for ln in pv) == 8, report.summary()
    assert counts["wgmma.mma_async"] == D // 16 + 8, report.summary()
    assert counts["wgmma.wait_group"] == 2, report.summary()
    # Q, K and V by TMA, O stored by TMA; consumers wait on the ring's full barriers, the
    # producer on its empty barriers.
    assert (
        counts["cp.async.bulk.tensor (load)"] >= 3 and counts["cp.async.bulk.tensor (store)"] >= 1
    )
    assert counts["mbarrier.try_wait"] >= 4 and "mbarrier.arrive.expect_tx" in ptx
    # 64 exp2 per thread per tile (2 rows x 32 columns) + 2 for the rows' rescaling factors.
    assert counts["ex2.approx"] == 64 + 2, report.summary()
    assert counts["shfl.sync"] >= 8
    # The LSE: one log2 per row.
    assert "lg2.approx" in ptx
    # Q + 2 KV slots, 128 x D x 2 bytes each, plus 1 KiB: the mbarriers, padded to the 1 KiB
    # alignment of the swizzled tiles. D = 128: 97 KiB; D = 64: 49 KiB.
    assert report.shared_memory_bytes == 3 * 128 * D * 2 + 1024, report.summary()
    if ptxas_ran(report.resources, "sm_90a"):
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )
