"""Stage 8 - warp specialisation. Hopper: a TMA producer warpgroup that gives its registers away
(setmaxnreg) and two consumer warpgroups, each on its own 64 query rows. Blackwell: a load warp,
an MMA warp, one softmax warpgroup and a correction warpgroup on one Q tile.
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
                f"stage 8 has no {t} kernel; it exists on the hopper and blackwell tracks"
            )
        mod = _TRACK_MODULES[t] = importlib.import_module(f"{__name__}.{t}")
    return mod
