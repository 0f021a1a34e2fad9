"""Stage 9 - ping-pong. Hopper: the two consumer warpgroups take turns on the tensor cores
(named barriers), one's softmax under the other's GEMMs. Blackwell: two Q tiles in TMEM, two
softmax warpgroups taking turns.
`attention(q, k, v, scale=None, causal=False, window=None, return_lse=False,
pack_gqa=None)` with k, v of Hkv heads, and `attention_varlen(q, k, v, cu_seqlens_q,
cu_seqlens_k, ...)` run the kernel of this machine's track: hopper.py on sm_90 (H100, H200),
blackwell.py on sm_100/sm_103 (compile-checked only: no Blackwell GPU has run it)."""

import importlib
import importlib.util

from common.arch import track


def attention(q, k, v, scale=None, causal=False, window=None, return_lse=False, pack_gqa=None):
    """O = softmax(scale * Q @ K^T + mask) @ V with K, V of Hkv heads (H % Hkv == 0); see
    hopper.py / blackwell.py."""
    return _track_module().attention(
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        window=window,
        return_lse=return_lse,
        pack_gqa=pack_gqa,
    )


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    scale=None,
    causal=False,
    window=None,
    return_lse=False,
    pack_gqa=None,
):
    """Packed sequences (flash_attn_varlen_func's layout); see hopper.py / blackwell.py."""
    return _track_module().attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        scale=scale,
        causal=causal,
        window=window,
        return_lse=return_lse,
        pack_gqa=pack_gqa,
    )


_TRACK_MODULES = {}  # track -> its module: the lookup is on every call's path


def _track_module():
    """This machine's track file (hopper.py or blackwell.py)."""
    t = track()
    mod = _TRACK_MODULES.get(t)
    if mod is None:
        if importlib.util.find_spec(f"{__name__}.{t}") is None:
            raise NotImplementedError(
                f"stage 9 has no {t} kernel; it exists on the hopper and blackwell tracks"
            )
        mod = _TRACK_MODULES[t] = importlib.import_module(f"{__name__}.{t}")
    return mod
