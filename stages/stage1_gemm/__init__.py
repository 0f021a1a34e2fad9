"""Stage 1 - GEMM. `gemm(a, b)` = A @ B^T runs the kernel of this machine's track: hopper.py on
sm_90 (H100, H200), blackwell.py on sm_100/sm_103. A track's file is imported on first use, so
neither track needs the other's file."""

import importlib

from common.arch import track


def gemm(a, b):
    """C = A @ B^T for A (M, K) and B (N, K), bf16 or fp16, K contiguous; see hopper.py / blackwell.py."""
    return importlib.import_module(f"{__name__}.{track()}").gemm(a, b)
