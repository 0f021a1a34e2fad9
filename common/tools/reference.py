"""PyTorch references in high precision (fp64 by default), computed from the very same low-precision
inputs the kernel reads, so the only error measured is the kernel's own."""

import torch


def gemm_ref(a, b, dtype=torch.float64):
    """C = A @ B^T."""
    return a.to(dtype) @ b.to(dtype).T


def qk_ref(q, k, scale=None, dtype=torch.float64):
    """S = scale * Q @ K^T, (B, H, Sq, Sk)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return scale * (q.to(dtype) @ k.to(dtype).transpose(-1, -2))


def attention_ref(q, k, v, scale=None, dtype=torch.float64, mask=None):
    """O = softmax(scale * Q K^T) V and LSE = logsumexp(scale * Q K^T) (natural log), per row.

    mask: an optional boolean (Sq, Sk) tensor (or one that broadcasts to (B, H, Sq, Sk)), True
    where a query sees a key (common.masks.visible). A row that sees no key gets O = 0 and
    LSE = -inf, the convention of the kernels (and FlashAttention's)."""
    s = qk_ref(q, k, scale, dtype)
    if mask is not None:
        s = s.masked_fill(~mask.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)[..., None]
    p = torch.where(finite, torch.exp(s - torch.where(finite, lse[..., None], 0.0)), 0.0)
    return p @ v.to(dtype), lse


def attention_lowp(q, k, v, scale=None, mask=None):
    """The same attention computed by PyTorch in the inputs' own precision (SDPA math backend):
    its error against the fp64 reference is the yardstick the kernels are held to. With a mask,
    rows that see no key are set to 0 (SDPA's math backend may give NaN there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        mask = mask.to(q.device)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return torch.where(
            mask.any(-1)[..., None], o, torch.zeros((), dtype=o.dtype, device=o.device)
        )


def attention_flops(B, H, Sq, Sk, D, causal=False):
    """4 * B * H * Sq * Sk * D (two GEMMs), halved when causal, as in the FlashAttention papers."""
    f = 4 * B * H * Sq * Sk * D
    return f // 2 if causal else f


def gemm_flops(M, N, K):
    return 2 * M * N * K


def attention_gqa_ref(q, k, v, causal=False, scale=None):
    """(O, LSE) in fp64 for K and V of Hkv heads (query head h reads KV head h // (H / Hkv)),
    causal bottom-right aligned: the stand-in for the kernel in stage 15's CPU runs and in
    make model's paged decode glue on the CPU."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    mask = None
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        keys, rows = torch.arange(Sk, device=q.device), torch.arange(Sq, device=q.device)
        mask = keys[None, :] - (Sk - Sq) <= rows[:, None]
    return attention_ref(q, k, v, scale=scale, mask=mask)
