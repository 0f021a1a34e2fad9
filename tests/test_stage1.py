"""Stage 1, both tracks: C = A @ B^T against an fp64 reference, and the argument checks.

Every test runs on each track (tests/tracks.py): the Hopper params carry the marker gpu_hopper,
the Blackwell ones gpu_blackwell. The PTX checks of each track are in
tests/test_stage1_hopper.py and tests/test_stage1_blackwell.py.

- GPU tests compare C with an fp64 reference on full tiles, M/N/K tails, tall, wide and deep-K
  shapes, M = 1 (dynamic layouts), in bf16 and fp16. The shapes common to both tracks come first;
  each track adds the ones that cross its own tile sizes (Hopper 128 x 256 x 64, Blackwell
  128 x 128 x 64). The output is poisoned with NaN before the launch
  (common.outputs.empty_output), so an element the kernel never writes fails. As of 2026-12-01 no
  sm_100 GPU was available: the Blackwell params have not run yet.
- Bad-input tests: every error names the argument. Those that fail before any CUDA call run on
  CPU tensors, so they run in CI too; the others need a CUDA device (any: they fail in the
  argument checks, before a kernel is compiled or launched).
"""

import pytest
import torch
from attention_cases import DTYPES, dtype_id, needs_cuda, shape_id
from tracks import module, on_cpu, on_gpu, per_track

from common.tools import inputs, reference, verify


def gemm(track):
    return module("stage1_gemm", track).gemm


# ---------------------------------------------------------------- numerics on the GPU


COMMON_SHAPES = [
    (512, 512, 512),
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (8192, 256, 512),  # tall: 64 M-tiles
    (256, 8192, 512),  # wide: 2 M-tiles, 32 (Hopper) / 64 (Blackwell) N-tiles
    (256, 256, 8192),  # deep K: 128 K tiles, each of the 4 buffers reused 32 times
    (1000, 1000, 1000),  # tails: 1000 = 7 x 128 + 104 rows (and columns), 15 x 64 + 40 of K
    (129, 264, 72),  # one row, 8 columns and 8 of K past a tile
    (1, 8, 8),  # the smallest shape allowed (M = 1: compiled with dynamic layouts)
    (1, 264, 200),  # M = 1 again: the same dynamic-layout kernel serves a second shape
]
SHAPES = {
    "hopper": COMMON_SHAPES
    + [
        (4096, 4096, 4096),
        (384, 512, 192),  # 3 K tiles: fewer than ab_buffers
    ],
    "blackwell": COMMON_SHAPES
    + [
        (128, 128, 64),  # one tile, one k-step
        (384, 512, 200),  # K tail: 200 = 3 x 64 + 8, TMA zero-fills the last 56 columns
        (256, 128, 128),  # 2 k-steps: fewer than ab_buffers
        (128, 256, 8),  # the smallest K allowed: one k-step of 8 real columns
        (200, 136, 64),  # the last tiles hold 72 rows and 8 columns of C
    ],
}


def run_gemm(track, a, b):
    # A deadlocked pipeline (a barrier phase that never completes) fails instead of hanging.
    return verify.run_with_deadline(
        lambda: gemm(track)(a, b), seconds=120, what=f"stage 1 {track} gemm"
    )


def check_gemm(a, b, c):
    # The kernel accumulates in fp32 (registers on Hopper, TMEM on Blackwell) and rounds once to
    # bf16/fp16, as cuBLAS does, so the error is about one rounding: ~2^-9 relative (bf16) or
    # ~2^-12 (fp16). Bound: 1e-2 and at most 3x PyTorch's own low-precision result against the
    # same fp64 reference.
    assert c.shape == (a.shape[0], b.shape[0]) and c.dtype == a.dtype
    return verify.check_close("C", c, reference.gemm_ref(a, b), rtol=1e-2, torch_lowp=a @ b.T)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("track, shape", per_track(SHAPES, shape_id))
def test_gemm_matches_fp64_reference(track, shape, dtype):
    M, N, K = shape
    a, b = inputs.gemm_inputs(M, N, K, dtype, seed=M + N + K)
    check_gemm(a, b, run_gemm(track, a, b))


# (rows of A, rows of B): the column slices below are (rows, 120) of K-contiguous matrices.
STRIDED_ROWS = {"hopper": [(300, 200)], "blackwell": [(256, 384)]}


@pytest.mark.parametrize("track, rows", per_track(STRIDED_ROWS, shape_id))
def test_gemm_reads_strided_rows(track, rows):
    # A and B as column slices of wider matrices: K contiguous, rows 320 and 136 elements apart.
    M, N = rows
    a_full, _ = inputs.gemm_inputs(M, 8, 320, torch.bfloat16, seed=7)
    _, b_full = inputs.gemm_inputs(8, N, 136, torch.bfloat16, seed=8)
    a, b = a_full[:, :120], b_full[:, :120]
    assert not a.is_contiguous() and not b.is_contiguous()
    check_gemm(a, b, run_gemm(track, a, b))


@pytest.mark.parametrize("track", on_gpu())
def test_gemm_repeated_launches_agree(track):
    # The compiled kernel is cached per layout: a second call with new values recomputes them.
    a, b = inputs.gemm_inputs(640, 768, 320, torch.bfloat16, seed=1)
    a2, b2 = inputs.gemm_inputs(640, 768, 320, torch.bfloat16, seed=2)
    check_gemm(a, b, run_gemm(track, a, b))
    check_gemm(a2, b2, run_gemm(track, a2, b2))


@pytest.mark.parametrize("track", on_gpu())
def test_stage_package_dispatches_to_the_track(track):
    from stages.stage1_gemm import gemm

    a, b = inputs.gemm_inputs(256, 256, 256, torch.bfloat16, seed=3)
    check_gemm(a, b, verify.run_with_deadline(lambda: gemm(a, b), seconds=120))


# ---------------------------------------------------------------- bad input

# M = N of the valid operands the bad inputs are built from: one tile of each track's kernel.
MN = {"hopper": 64, "blackwell": 128}


def cpu_pair(track, K=64, dtype=torch.bfloat16):
    return torch.zeros(MN[track], K, dtype=dtype), torch.zeros(MN[track], K, dtype=dtype)


@pytest.mark.parametrize("track", on_cpu())
def test_rejects_cpu_tensors(track):
    a, b = cpu_pair(track)
    with pytest.raises(ValueError, match="argument 'a': must be a CUDA tensor"):
        gemm(track)(a, b)


@pytest.mark.parametrize("track", on_cpu())
def test_rejects_unsupported_dtype(track):
    a, b = cpu_pair(track, dtype=torch.float32)
    with pytest.raises(TypeError, match="argument 'a': dtype float32 is not supported"):
        gemm(track)(a, b)


@pytest.mark.parametrize("track", on_cpu())
def test_rejects_wrong_rank(track):
    a, b = cpu_pair(track)
    with pytest.raises(ValueError, match="argument 'a': expected a rank-2 tensor"):
        gemm(track)(a[None], b)


@pytest.mark.parametrize("track", on_cpu())
def test_rejects_non_tensor(track):
    _, b = cpu_pair(track)
    with pytest.raises(TypeError, match="argument 'a': expected a torch.Tensor"):
        gemm(track)([[1.0]], b)


def gpu_pair(track, M=None, N=None, K=64, dtype=torch.bfloat16):
    M = MN[track] if M is None else M
    N = MN[track] if N is None else N
    return torch.ones(M, K, dtype=dtype, device="cuda"), torch.ones(
        N, K, dtype=dtype, device="cuda"
    )


@needs_cuda
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_mismatched_k(track):
    a, _ = gpu_pair(track, K=64)
    _, b = gpu_pair(track, K=128)
    with pytest.raises(
        ValueError,
        match=r"inner dimension K of C = A @ B\^T: 'a'\.shape\[1\] = 64 must equal 'b'\.shape\[1\] = 128",
    ):
        gemm(track)(a, b)


@needs_cuda
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_mixed_dtypes(track):
    a, _ = gpu_pair(track)
    _, b = gpu_pair(track, dtype=torch.float16)
    with pytest.raises(
        TypeError, match="arguments 'a', 'b' must share one dtype, got a: bfloat16, b: float16"
    ):
        gemm(track)(a, b)


@needs_cuda
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_b_that_is_not_k_major(track):
    a, _ = gpu_pair(track)
    b_kn = torch.ones(64, MN[track], dtype=torch.bfloat16, device="cuda")  # (K, N)
    with pytest.raises(ValueError, match="argument 'b': the last dimension must be contiguous"):
        gemm(track)(a, b_kn.T)


@needs_cuda
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_k_that_breaks_tma_alignment(track):
    a, b = gpu_pair(track, K=100)  # rows of 200 bytes: not 16-byte aligned
    with pytest.raises(ValueError, match="argument 'a'.*16 bytes"):
        gemm(track)(a, b)
    a, b = gpu_pair(
        track, M=1, N=1, K=100
    )  # single rows: the stride check does not apply, K's does
    with pytest.raises(ValueError, match=r"K = a.shape\[1\] = 100 must be a multiple of 8"):
        gemm(track)(a, b)


@needs_cuda
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_n_that_is_not_a_multiple_of_8(track):
    a, b = gpu_pair(track, N=12)
    with pytest.raises(ValueError, match=r"N = b.shape\[0\] = 12 must be a multiple of 8"):
        gemm(track)(a, b)


@needs_cuda
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_empty_problem(track):
    a, b = gpu_pair(track, M=0)
    with pytest.raises(ValueError, match=r"M = a.shape\[0\] = 0 must be positive"):
        gemm(track)(a, b)
