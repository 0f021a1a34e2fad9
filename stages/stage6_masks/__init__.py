"""Stage 6 - masks: causal and sliding window, with tile skipping.
`attention(q, k, v, scale=None, causal=False, window=None, return_lse=False)` runs the kernel of
this machine's track: hopper.py on sm_90 (H100, H200), blackwell.py on sm_100/sm_103. A track's
file is imported on first use, so neither track needs the other's file."""

import importlib

from common.arch import track


def attention(q, k, v, scale=None, causal=False, window=None, return_lse=False):
    """O = softmax(scale * Q @ K^T + mask) @ V, bottom-right aligned causal / window masks, and
    LSE (B, H, Sq) in fp32 when return_lse; see hopper.py / blackwell.py."""
    return importlib.import_module(f"{__name__}.{track()}").attention(
        q, k, v, scale=scale, causal=causal, window=window, return_lse=return_lse
    )
