"""Stage 2 - QK^T only. `qk(q, k, scale=None)` = scale * Q @ K^T (fp32) runs the kernel of this
machine's track: hopper.py on sm_90 (H100, H200), blackwell.py on sm_100/sm_103. A track's file
is imported on first use, so neither track needs the other's file."""

import importlib

from common.arch import track


def qk(q, k, scale=None):
    """S = scale * Q @ K^T for Q (B, H, Sq, D), K (B, H, Sk, D); see hopper.py / blackwell.py."""
    return importlib.import_module(f"{__name__}.{track()}").qk(q, k, scale=scale)
