"""Stage 1 (Blackwell): C = A @ B^T with TMA, an mbarrier pipeline, tcgen05.mma and TMEM on sm_100a.

- Compile-only tests need no GPU: the sm_100a PTX must hold the instructions the stage teaches
  (tcgen05.alloc/mma/commit/ld/dealloc, TMA loads, mbarrier waits). They run in CI.
- Compile-only, shapes: M and N that are not multiples of the 128 x 128 tile (the predicated
  epilogue stores 16-byte vectors only), M = 1 (dynamic layouts), and the layouts gemm()
  launches with (to_cute of real tensors, here CPU ones: compiling needs no GPU), which must
  store C in the same 16-byte vectors as the fake tensors do.
- TMEM is freed only after tcgen05.fence::before_thread_sync and the barrier of the warps that
  read it (PTX order: the last tcgen05.ld, the fence, the barrier, tcgen05.dealloc).
- tcgen05 fences at the TMEM hand-offs (common/tmem.py): their exact count, and every path from
  an mbarrier wait to a tcgen05 op, or from tcgen05.wait::ld to an arrive, fenced
  (tests/blackwell_ptx.py), but for the k-step MMAs' waits for TMA.
- GPU test (marker gpu_blackwell): C launched as the corner of a larger NaN buffer, through the
  kernel class itself, so that a store beyond M or N fails. As of 2026-12-01 no sm_100 GPU was
  available: it has not run yet.
- The numerics against the fp64 reference and the bad-input tests run on both tracks in
  tests/test_stage1.py.
"""

import pytest
import torch
from attention_cases import DTYPES, dtype_id, shape_id
from blackwell_ptx import (
    assert_tmem_freed_after_fence,
    global_stores,
    tcgen05_fence_gaps,
    tcgen05_fences,
)
from ptxas_checks import ptxas_ran
from test_stage1 import check_gemm

from common.compile import cached_compile
from common.cute_interop import current_stream, cute_dtype, fake_stream, to_cute
from common.tools import inputs, verify
from common.tools.ptx import compile_for_arch, compile_only
from stages.stage1_gemm import blackwell

# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape", [(1024, 1024, 1024), (256, 384, 200), (200, 136, 64), (1, 8, 8)], ids=shape_id
)
def test_compiles_for_sm100a(dtype, shape):
    report = compile_only(1, "blackwell", dtype=dtype, shape=shape)
    counts, ptx = report.counts, report.ptx
    assert ".target sm_100a" in ptx
    # One k-step = bK / 16 = 4 tcgen05.mma 128 x 128 x 16, issued in the (not unrolled) main
    # loop; bf16 and fp16 both run as kind::f16 with fp32 accumulation.
    assert counts["tcgen05.mma"] == 4, report.summary()
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx
    assert counts["wgmma.mma_async"] == 0
    # TMEM: allocated once, freed once, after the allocating warp gave up its permit.
    assert counts["tcgen05.alloc"] == 1 and counts["tcgen05.dealloc"] == 1, report.summary()
    assert "tcgen05.relinquish_alloc_permit" in ptx
    assert_tmem_freed_after_fence(ptx)
    # tcgen05 fences (common/tmem.py): after the wait for the accumulator's tcgen05.commit,
    # before the epilogue's loads ((d)); before the accumulator's release ((a)) and before the
    # barrier that frees TMEM.
    assert tcgen05_fences(ptx) == (2, 1)
    # Every path is fenced but the MMAs of a k-step: they wait only for TMA (A and B in shared
    # memory), no TMEM hand-off, so no fence (as in CUTLASS's GEMMs).
    gaps = tcgen05_fence_gaps(ptx)
    assert len(gaps) == counts["tcgen05.mma"] and len({g.since for g in gaps}) == 1, gaps
    assert all(g.statement.startswith("tcgen05.mma") for g in gaps), gaps
    # tcgen05.commit frees an A/B buffer, and marks S complete.
    assert counts["tcgen05.commit"] == 2, report.summary()
    # Epilogue: 4 loads of 32 fp32 columns per thread, each waited for before its registers are read.
    assert counts["tcgen05.ld"] == 4 and "tcgen05.ld.sync.aligned.32x32b.x32.b32" in ptx, (
        report.summary()
    )
    assert ptx.count("tcgen05.wait::ld") == 4
    # Each load's 32 values (64 bytes of C) leave in 4 predicated 16-byte stores, none narrower:
    # 4 loads x 4 = 16, whatever M and N are.
    assert global_stores(ptx) == ["st.global.v4.b32"] * 16, report.summary()
    # TMA loads of A and B (2D boxes), counted against a 32 KiB transaction per buffer.
    assert counts["cp.async.bulk.tensor (load)"] == 2 and "cp.async.bulk.tensor.2d" in ptx, (
        report.summary()
    )
    assert "mbarrier.arrive.expect_tx" in ptx
    # Barriers: full + empty per buffer (ab_buffers = 4) and per S tile (1).
    assert counts["mbarrier.init"] == 2 * 4 + 2, report.summary()
    assert counts["mbarrier.try_wait"] >= 3 and "mbarrier.try_wait" in ptx
    # 4 buffers of 32 KiB plus 1 KiB for the barriers (the tiles are 1 KiB aligned).
    assert report.shared_memory_bytes == 4 * 32 * 1024 + 1024, report.summary()
    if ptxas_ran(report.resources, "sm_100a"):
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )
    # The tutorial promises a compile of a few seconds (a backstop against a blow-up).
    assert report.seconds < 60, report.summary()


@pytest.mark.parametrize("shape", [(200, 136, 64), (1, 264, 200)], ids=shape_id)
def test_launch_layouts_store_c_in_16_byte_vectors(shape):
    # gemm() wraps real tensors with to_cute: static layouts, or dynamic ones (M = 1) whose strides
    # carry no divisibility. CPU tensors have the same layouts, and compiling needs no GPU.
    M, N, K = shape
    a, b, c = torch.zeros(M, K), torch.zeros(N, K), torch.zeros(M, N)
    dynamic = 1 in shape
    args = [to_cute(t.bfloat16(), dynamic=dynamic) for t in (a, b, c)] + [fake_stream()]
    ptx, _ = compile_for_arch(blackwell.Sm100Kernel(cute_dtype(torch.bfloat16)), args, "sm_100a")
    assert global_stores(ptx) == ["st.global.v4.b32"] * 16


# ---------------------------------------------------------------- numerics on an sm_100 GPU


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("shape", [(200, 136, 64), (1, 264, 200)], ids=shape_id)
def test_gemm_writes_nothing_outside_c(shape):
    # The last tiles stick out of C. Launched on C as the top-left corner of a NaN buffer 128
    # rows and 8 columns larger (row stride N + 8), the kernel must leave the rest of it NaN.
    M, N, K = shape
    a, b = inputs.gemm_inputs(M, N, K, torch.bfloat16, seed=4)
    big = torch.full((M + 128, N + 8), float("nan"), dtype=a.dtype, device=a.device)
    args = [to_cute(t, dynamic=1 in shape) for t in (a, b, big[:M, :N])] + [current_stream()]
    kernel = blackwell.Sm100Kernel(cute_dtype(a.dtype))
    verify.run_with_deadline(lambda: cached_compile(kernel, *args)(*args), seconds=120)
    check_gemm(a, b, big[:M, :N])
    assert torch.isnan(big[M:]).all() and torch.isnan(big[:M, N:]).all()
