"""Seeded random inputs in the layouts the stages take. Fresh values for every seed; never zeros
(zeros hide unwritten outputs and wrong indexing)."""

import torch


def _gen(seed, device):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def gemm_inputs(M, N, K, dtype=torch.bfloat16, seed=0, device="cuda"):
    """a: (M, K), b: (N, K), both K-major, entries ~ N(0, 1)."""
    g = _gen(seed, device)
    a = torch.randn(M, K, generator=g, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(N, K, generator=g, device=device, dtype=torch.float32).to(dtype)
    return a, b


def attention_inputs(B, H, Sq, Sk, D, dtype=torch.bfloat16, seed=0, device="cuda", logit_scale=1.0):
    """q: (B, H, Sq, D), k and v: (B, H, Sk, D), layout of torch SDPA.

    With unit-variance entries, scale * q.k has standard deviation about 1; `logit_scale`
    multiplies q so the scaled logits reach |S| of order `logit_scale` (tens for the
    large-magnitude tests)."""
    g = _gen(seed, device)
    q = (torch.randn(B, H, Sq, D, generator=g, device=device) * logit_scale).to(dtype)
    k = torch.randn(B, H, Sk, D, generator=g, device=device).to(dtype)
    v = torch.randn(B, H, Sk, D, generator=g, device=device).to(dtype)
    return q, k, v
