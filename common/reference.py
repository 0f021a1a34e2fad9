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


def attention_ref(q, k, v, scale=None, dtype=torch.float64):
    """O = softmax(scale * Q K^T) V and LSE = logsumexp(scale * Q K^T) (natural log), per row."""
    s = qk_ref(q, k, scale, dtype)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return p @ v.to(dtype), lse


def attention_lowp(q, k, v, scale=None):
    """The same attention computed by PyTorch in the inputs' own precision (SDPA math backend):
    its error against the fp64 reference is the yardstick the kernels are held to."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)


def attention_flops(B, H, Sq, Sk, D, causal=False):
    """4 * B * H * Sq * Sk * D (two GEMMs), halved when causal, as in the FlashAttention papers."""
    f = 4 * B * H * Sq * Sk * D
    return f // 2 if causal else f


def gemm_flops(M, N, K):
    return 2 * M * N * K
