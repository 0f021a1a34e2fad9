"""Stage 1 (Blackwell): C = A @ B^T with TMA, an mbarrier pipeline, tcgen05.mma and TMEM on sm_100a.

- Compile-only tests need no GPU: the sm_100a PTX must hold the instructions the stage teaches
  (tcgen05.alloc/mma/commit/ld/dealloc, TMA loads, mbarrier waits). They run in CI.
- Compile-only, shapes: M and N that are not multiples of the 128 x 128 tile (the predicated
  epilogue stores 16-byte vectors only), M = 1 (dynamic layouts), and the layouts gemm()
  launches with (to_cute of real tensors, here CPU ones: compiling needs no GPU), which must
  store C in the same 16-byte vectors as the fake tensors do.
- TMEM is freed only after tcgen05.fence::before_thread_sync and the barrier of the warps that
  read it (PTX order: the last tcgen05.ld, the fence, the barrier, tcgen05.dealloc).
- GPU tests (marker gpu_blackwell) compare C with an fp64 reference on one-tile, square, tall,
  wide, deep-K, K-tail shapes and M, N that are not tile multiples (M = 1 among them), in bf16
  and fp16. The output is poisoned with NaN before the launch (common.outputs.empty_output), so
  an element the kernel never writes fails, and it is allocated inside a larger NaN buffer in
  one test so that a store beyond M or N fails too. As of 2026-12-01 no sm_100 GPU was
  available: these tests have not run yet.
- Bad-input tests: every error names the argument. Those that fail before any CUDA call run on
  CPU tensors, so they run in CI too; the others need a CUDA device (any: they fail in the
  argument checks, before a kernel is compiled or launched).
"""

import re

import pytest
import torch

from common.compile import cached_compile
from common.cute_interop import current_stream, cute_dtype, fake_stream, to_cute
from common.tools import inputs, reference, verify
from common.tools.ptx import compile_for_arch, compile_only
from stages.stage1_gemm import blackwell

DTYPES = [torch.bfloat16, torch.float16]


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def shape_id(shape):
    return "x".join(map(str, shape))


def global_stores(ptx):
    """The st.global statements of the PTX, their opcode only (st.global.v4.b32, ...)."""
    return [ln.split()[0] for ln in ptx.splitlines() if ln.strip().startswith("st.global")]


def assert_tmem_freed_after_fence(ptx):
    """tcgen05.dealloc comes after tcgen05.fence::before_thread_sync and the softmax warps'
    named barrier (bar.sync 1, 128), and the fence after every tcgen05.ld and tcgen05.st."""
    lines = ptx.splitlines()

    def where(pattern):
        return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]

    (fence,) = where(r"tcgen05\.fence::before_thread_sync")
    (dealloc,) = where(r"tcgen05\.dealloc")
    assert max(where(r"tcgen05\.(ld|st)\.")) < fence < dealloc
    assert any(re.search(r"\bbar(rier)?\.sync\s+1,\s*128;", ln) for ln in lines[fence:dealloc])


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
    if report.resources and "spill_stores" in report.resources:
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


SHAPES = [
    (128, 128, 64),  # one tile, one k-step
    (512, 512, 512),
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (8192, 256, 512),  # tall: 64 M-tiles, 2 N-tiles
    (256, 8192, 512),  # wide: 2 M-tiles, 64 N-tiles
    (256, 256, 8192),  # deep K: 128 k-steps, each of the 4 buffers reused 32 times
    (384, 512, 200),  # K tail: 200 = 3 x 64 + 8, TMA zero-fills the last 56 columns
    (256, 128, 128),  # 2 k-steps: fewer than ab_buffers
    (128, 256, 8),  # the smallest K allowed: one k-step of 8 real columns
    (1000, 1000, 1000),  # tails: 1000 = 7 x 128 + 104 rows and columns, 15 x 64 + 40 of K
    (129, 264, 72),  # one row, 8 columns and 8 of K past a tile
    (200, 136, 64),  # the last tiles hold 72 rows and 8 columns of C
    (1, 8, 8),  # the smallest shape allowed (M = 1: compiled with dynamic layouts)
    (1, 264, 200),  # M = 1 again: the same dynamic-layout kernel serves a second shape
]


def run_gemm(a, b):
    # A deadlocked pipeline (a barrier phase that never completes) fails instead of hanging.
    return verify.run_with_deadline(
        lambda: blackwell.gemm(a, b), seconds=120, what="stage 1 blackwell gemm"
    )


def check_gemm(a, b, c):
    # fp32 accumulation in TMEM and one rounding to bf16/fp16, as cuBLAS does: the error is
    # about one rounding, ~2^-9 relative (bf16) or ~2^-12 (fp16). Bound: 1e-2 and at most 3x
    # PyTorch's own low-precision result against the same fp64 reference.
    assert c.shape == (a.shape[0], b.shape[0]) and c.dtype == a.dtype
    return verify.check_close("C", c, reference.gemm_ref(a, b), rtol=1e-2, torch_lowp=a @ b.T)


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_gemm_matches_fp64_reference(shape, dtype):
    M, N, K = shape
    a, b = inputs.gemm_inputs(M, N, K, dtype, seed=M + N + K)
    check_gemm(a, b, run_gemm(a, b))


@pytest.mark.gpu_blackwell
def test_gemm_reads_strided_rows():
    # A and B as column slices of wider matrices: K contiguous, rows 320 and 136 elements apart.
    a_full, _ = inputs.gemm_inputs(256, 8, 320, torch.bfloat16, seed=7)
    _, b_full = inputs.gemm_inputs(8, 384, 136, torch.bfloat16, seed=8)
    a, b = a_full[:, :120], b_full[:, :120]
    assert not a.is_contiguous() and not b.is_contiguous()
    check_gemm(a, b, run_gemm(a, b))


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


@pytest.mark.gpu_blackwell
def test_gemm_repeated_launches_agree():
    # The compiled kernel is cached per layout: a second call with new values recomputes them.
    a, b = inputs.gemm_inputs(640, 768, 320, torch.bfloat16, seed=1)
    a2, b2 = inputs.gemm_inputs(640, 768, 320, torch.bfloat16, seed=2)
    check_gemm(a, b, run_gemm(a, b))
    check_gemm(a2, b2, run_gemm(a2, b2))


@pytest.mark.gpu_blackwell
def test_stage_package_dispatches_to_blackwell():
    from stages.stage1_gemm import gemm

    a, b = inputs.gemm_inputs(256, 256, 256, torch.bfloat16, seed=3)
    check_gemm(a, b, verify.run_with_deadline(lambda: gemm(a, b), seconds=120))


# ---------------------------------------------------------------- bad input


def cpu_pair(M=128, N=128, K=64, dtype=torch.bfloat16):
    return torch.zeros(M, K, dtype=dtype), torch.zeros(N, K, dtype=dtype)


def test_rejects_cpu_tensors():
    a, b = cpu_pair()
    with pytest.raises(ValueError, match="argument 'a': must be a CUDA tensor"):
        blackwell.gemm(a, b)


def test_rejects_unsupported_dtype():
    a, b = cpu_pair(dtype=torch.float32)
    with pytest.raises(TypeError, match="argument 'a': dtype float32 is not supported"):
        blackwell.gemm(a, b)


def test_rejects_wrong_rank():
    a, b = cpu_pair()
    with pytest.raises(ValueError, match="argument 'a': expected a rank-2 tensor"):
        blackwell.gemm(a[None], b)


def test_rejects_non_tensor():
    _, b = cpu_pair()
    with pytest.raises(TypeError, match="argument 'a': expected a torch.Tensor"):
        blackwell.gemm([[1.0]], b)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (any)")


def gpu_pair(M=128, N=128, K=64, dtype=torch.bfloat16):
    return torch.ones(M, K, dtype=dtype, device="cuda"), torch.ones(
        N, K, dtype=dtype, device="cuda"
    )


@needs_cuda
def test_rejects_mismatched_k():
    a, _ = gpu_pair(K=64)
    _, b = gpu_pair(K=128)
    with pytest.raises(
        ValueError,
        match=r"inner dimension K of C = A @ B\^T: 'a'\.shape\[1\] = 64 must equal 'b'\.shape\[1\] = 128",
    ):
        blackwell.gemm(a, b)


@needs_cuda
def test_rejects_mixed_dtypes():
    a, _ = gpu_pair()
    _, b = gpu_pair(dtype=torch.float16)
    with pytest.raises(
        TypeError, match="arguments 'a', 'b' must share one dtype, got a: bfloat16, b: float16"
    ):
        blackwell.gemm(a, b)


@needs_cuda
def test_rejects_b_that_is_not_k_major():
    a, _ = gpu_pair()
    b_kn = torch.ones(64, 128, dtype=torch.bfloat16, device="cuda")  # (K, N)
    with pytest.raises(ValueError, match="argument 'b': the last dimension must be contiguous"):
        blackwell.gemm(a, b_kn.T)


@needs_cuda
def test_rejects_k_that_breaks_tma_alignment():
    a, b = gpu_pair(K=100)  # rows of 200 bytes: not 16-byte aligned
    with pytest.raises(ValueError, match="argument 'a'.*16 bytes"):
        blackwell.gemm(a, b)


@needs_cuda
def test_rejects_n_that_breaks_16_byte_rows():
    a, b = gpu_pair(N=12)
    with pytest.raises(ValueError, match=r"N = b.shape\[0\] = 12 must be a multiple of 8"):
        blackwell.gemm(a, b)


@needs_cuda
def test_rejects_empty_problem():
    a, b = gpu_pair(M=0)
    with pytest.raises(ValueError, match=r"M = a.shape\[0\] = 0 must be positive"):
        blackwell.gemm(a, b)
