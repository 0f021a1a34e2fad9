"""Stage 1 (Hopper): C = A @ B^T with TMA, an mbarrier pipeline and wgmma on sm_90a.

- Compile-only tests need no GPU: the sm_90a PTX must hold the instructions the stage teaches.
- GPU tests (marker gpu_hopper) compare C with an fp64 reference on full tiles, M/N/K tails,
  tall, wide and deep-K shapes, in bf16 and fp16. The output is poisoned with NaN before the
  launch (common.outputs.empty_output), so an element the kernel never writes fails.
- Bad-input tests: every error names the argument. Those that fail before any CUDA call run on
  CPU tensors, so they run in CI too; the others need a CUDA device (any: they fail in the
  argument checks, before a kernel is compiled or launched).
"""

import pytest
import torch

from common.tools import inputs, reference, verify
from common.tools.ptx import compile_only
from stages.stage1_gemm import hopper

DTYPES = [torch.bfloat16, torch.float16]


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape", [(1024, 1024, 1024), (1000, 264, 200)], ids=lambda s: "x".join(map(str, s))
)
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
    if report.resources and "spill_stores" in report.resources:
        # 128 fp32 accumulators per thread must stay in registers.
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )


# ---------------------------------------------------------------- numerics on the H200


SHAPES = [
    (512, 512, 512),
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (4096, 4096, 4096),
    (8192, 256, 512),  # tall: 64 M-tiles, one N-tile
    (256, 8192, 512),  # wide: 2 M-tiles, 32 N-tiles
    (256, 256, 8192),  # deep K: 128 K tiles, each of the 4 buffers reused 32 times
    (1000, 1000, 1000),  # tails: 1000 = 7 x 128 + 104 = 3 x 256 + 232 = 15 x 64 + 40
    (129, 264, 72),  # one row, 8 columns and 8 of K past a tile
    (384, 512, 192),  # 3 K tiles: fewer than ab_buffers
    (1, 8, 8),  # the smallest shape allowed (M = 1: compiled with dynamic layouts)
    (1, 264, 200),  # M = 1 again: the same dynamic-layout kernel serves a second shape
]


def run_gemm(a, b):
    # A deadlocked pipeline (a barrier phase that never completes) fails instead of hanging.
    return verify.run_with_deadline(
        lambda: hopper.gemm(a, b), seconds=120, what="stage 1 hopper gemm"
    )


def check_gemm(a, b, c):
    # The kernel accumulates in fp32 and rounds once to bf16/fp16, as cuBLAS does, so the error
    # is about one rounding: ~2^-9 relative (bf16) or ~2^-12 (fp16). Bound: 1e-2 and at most 3x
    # PyTorch's own low-precision result against the same fp64 reference.
    assert c.shape == (a.shape[0], b.shape[0]) and c.dtype == a.dtype
    return verify.check_close("C", c, reference.gemm_ref(a, b), rtol=1e-2, torch_lowp=a @ b.T)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_matches_fp64_reference(shape, dtype):
    M, N, K = shape
    a, b = inputs.gemm_inputs(M, N, K, dtype, seed=M + N + K)
    check_gemm(a, b, run_gemm(a, b))


@pytest.mark.gpu_hopper
def test_gemm_reads_strided_rows():
    # A and B as column slices of wider matrices: K contiguous, rows 320 and 136 elements apart.
    a_full, _ = inputs.gemm_inputs(300, 8, 320, torch.bfloat16, seed=7)
    _, b_full = inputs.gemm_inputs(8, 200, 136, torch.bfloat16, seed=8)
    a, b = a_full[:, :120], b_full[:, :120]
    assert not a.is_contiguous() and not b.is_contiguous()
    check_gemm(a, b, run_gemm(a, b))


@pytest.mark.gpu_hopper
def test_gemm_repeated_launches_agree():
    # The compiled kernel is cached per shape: a second call with new values recomputes them.
    a, b = inputs.gemm_inputs(640, 768, 320, torch.bfloat16, seed=1)
    a2, b2 = inputs.gemm_inputs(640, 768, 320, torch.bfloat16, seed=2)
    check_gemm(a, b, run_gemm(a, b))
    check_gemm(a2, b2, run_gemm(a2, b2))


@pytest.mark.gpu_hopper
def test_stage_package_dispatches_to_hopper():
    from stages.stage1_gemm import gemm

    a, b = inputs.gemm_inputs(256, 256, 256, torch.bfloat16, seed=3)
    c = verify.run_with_deadline(lambda: gemm(a, b), seconds=120)
    check_gemm(a, b, c)


# ---------------------------------------------------------------- bad input


def cpu_pair(M=64, N=64, K=64, dtype=torch.bfloat16):
    return torch.zeros(M, K, dtype=dtype), torch.zeros(N, K, dtype=dtype)


def test_rejects_cpu_tensors():
    a, b = cpu_pair()
    with pytest.raises(ValueError, match="argument 'a': must be a CUDA tensor"):
        hopper.gemm(a, b)


def test_rejects_unsupported_dtype():
    a, b = cpu_pair(dtype=torch.float32)
    with pytest.raises(TypeError, match="argument 'a': dtype float32 is not supported"):
        hopper.gemm(a, b)


def test_rejects_wrong_rank():
    a, b = cpu_pair()
    with pytest.raises(ValueError, match="argument 'a': expected a rank-2 tensor"):
        hopper.gemm(a[None], b)


def test_rejects_non_tensor():
    _, b = cpu_pair()
    with pytest.raises(TypeError, match="argument 'a': expected a torch.Tensor"):
        hopper.gemm([[1.0]], b)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (any)")


def gpu_pair(M=64, N=64, K=64, dtype=torch.bfloat16):
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
        hopper.gemm(a, b)


@needs_cuda
def test_rejects_mixed_dtypes():
    a, _ = gpu_pair()
    _, b = gpu_pair(dtype=torch.float16)
    with pytest.raises(
        TypeError, match="arguments 'a', 'b' must share one dtype, got a: bfloat16, b: float16"
    ):
        hopper.gemm(a, b)


@needs_cuda
def test_rejects_b_that_is_not_k_major():
    a, _ = gpu_pair()
    b_kn = torch.ones(64, 64, dtype=torch.bfloat16, device="cuda")  # (K, N)
    with pytest.raises(ValueError, match="argument 'b': the last dimension must be contiguous"):
        hopper.gemm(a, b_kn.T)


@needs_cuda
def test_rejects_k_that_breaks_tma_alignment():
    a, b = gpu_pair(K=100)  # rows of 200 bytes: not 16-byte aligned
    with pytest.raises(ValueError, match="argument 'a'.*16 bytes"):
        hopper.gemm(a, b)
    a, b = gpu_pair(M=1, N=1, K=100)  # single rows: the stride check does not apply, K's does
    with pytest.raises(ValueError, match=r"K = a.shape\[1\] = 100 must be a multiple of 8"):
        hopper.gemm(a, b)


@needs_cuda
def test_rejects_n_that_breaks_tma_alignment():
    a, b = gpu_pair(N=12)
    with pytest.raises(ValueError, match=r"N = b.shape\[0\] = 12 must be a multiple of 8"):
        hopper.gemm(a, b)


@needs_cuda
def test_rejects_empty_problem():
    a, b = gpu_pair(M=0)
    with pytest.raises(ValueError, match=r"M = a.shape\[0\] = 0 must be positive"):
        hopper.gemm(a, b)
