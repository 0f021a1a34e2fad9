"""Stage 4 - KV-tile interleaving, V overwrites K. `attention(q, k, v, scale=None)` for any Sk
runs the kernel of this machine's track: hopper.py on sm_90 (H100, H200), blackwell.py on
sm_100/sm_103. A track's file is imported on first use, so neither track needs the other's file."""

import importlib

from common.arch import track


def attention(q, k, v, scale=None):
    """O = softmax(scale * Q @ K^T) @ V, exact two-pass softmax; see hopper.py / blackwell.py."""
    return importlib.import_module(f"{__name__}.{track()}").attention(q, k, v, scale=scale)
