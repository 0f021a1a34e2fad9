"""What the attention tests of stages 2-5 share, on both tracks (a helper module: pytest collects no
tests here; each tests/test_stageN_<track>.py runs these against its own entry).

- Bad input: every entry starts with common.checks.check_attention_args and check_scale, so the
  same bad arguments must raise the same error, naming the argument, in every stage. Each case
  builds its bad arguments from valid small inputs (B, H, Sq, Sk, D) = (1, 2, 128, 128, 64),
  valid for every stage of both tracks (stage 3: Sk <= 128; stage 2: Sk % 4 == 0; the two
  tracks take the same shapes), so that only the broken argument can fail. "cpu" cases fail
  before any CUDA call and run in CI; "cuda" cases need a CUDA device (any: they fail in the
  argument checks, before a kernel is compiled or launched).
- Adversarial numerics: builders of inputs that stress the softmax. Each asserts the property its
  test relies on (the row max where it should be, the fp64 reference equal to the closed-form
  answer) before any kernel runs.
"""

import dataclasses
from typing import Callable

import pytest
import torch

from common import masks
from common.tools import inputs, reference, verify

DTYPES = [torch.bfloat16, torch.float16]

needs_cuda = pytest.mark.gpu_any  # skipped without CUDA (conftest.py)


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def shape_id(shape):
    return "x".join(map(str, shape))


def qkv(device="cuda", B=1, H=2, Sq=128, Sk=128, D=64, dtype=torch.bfloat16):
    """Small seeded (q, k, v) on `device`: q (B, H, Sq, D), k and v (B, H, Sk, D)."""
    return inputs.attention_inputs(B, H, Sq, Sk, D, dtype, device=device)


def bshd_views(B, H, Sq, Sk, D, dtype=torch.bfloat16, *, seed):
    """(q, k, v) of qkv's shapes as (B, H, S, D) views of (B, S, H, D) tensors (the layout of many
    models): D contiguous, the other strides arbitrary."""
    q4, k4, v4 = (
        t.transpose(1, 2).contiguous()
        for t in inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=seed)
    )
    q, k, v = (t.transpose(1, 2) for t in (q4, k4, v4))
    assert not q.is_contiguous() and q.stride(-1) == 1
    return q, k, v


# ---------------------------------------------------------------- bad input


@dataclasses.dataclass(frozen=True)
class BadInput:
    id: str
    device: str  # where the valid (q, k, v) live: "cpu" or "cuda"
    build: Callable  # build(q, k, v) -> the positional arguments of the entry
    error: type
    match: str  # regex searched in the message; it names the argument
    kwargs: dict = dataclasses.field(default_factory=dict)

    def __str__(self):
        return self.id

    def check(self, entry):
        args = self.build(*qkv(self.device))
        with pytest.raises(self.error, match=self.match):
            entry(*args, **self.kwargs)

    def without_v(self):
        """The same case for an entry that takes (q, k) only (stage 2's qk)."""
        return dataclasses.replace(self, build=lambda q, k, v: self.build(q, k, v)[:2])


def _head_dim(D):
    return lambda q, k, v: tuple(t.new_ones(*t.shape[:-1], D) for t in (q, k, v))


# Cases that hold for qk(q, k) and attention(q, k, v) alike: they break q, or k and v together.
_SHARED = [
    BadInput(
        "q_on_cpu",
        "cpu",
        lambda q, k, v: (q, k, v),
        ValueError,
        "argument 'q': must be a CUDA tensor",
    ),
    BadInput(
        "float32",
        "cpu",
        lambda q, k, v: (q.float(), k.float(), v.float()),
        TypeError,
        "argument 'q': dtype float32 is not supported",
    ),
    BadInput(
        "q_rank_3",
        "cpu",
        lambda q, k, v: (q[0], k, v),
        ValueError,
        "argument 'q': expected a rank-4 tensor",
    ),
    BadInput(
        "batch_mismatch",
        "cuda",
        lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])),
        ValueError,
        r"batch: 'q'\.shape\[0\] = 1 must equal 'k'\.shape\[0\] = 2",
    ),
    BadInput(
        "heads_mismatch",
        "cuda",
        lambda q, k, v: (q, torch.cat([k, k], 1), torch.cat([v, v], 1)),
        ValueError,
        r"heads: 'q'\.shape\[1\] = 2 must equal 'k'\.shape\[1\] = 4",
    ),
    BadInput(
        "head_dim_mismatch",
        "cuda",
        lambda q, k, v: (q, k[..., :32].contiguous(), v),
        ValueError,
        r"head dim: 'q'\.shape\[3\] = 64 must equal 'k'\.shape\[3\] = 32",
    ),
    BadInput(
        "head_dim_32",
        "cuda",
        _head_dim(32),
        ValueError,
        "head dim D = 32 is not supported; allowed: 64, 128",
    ),
    BadInput(
        "head_dim_96",
        "cuda",
        _head_dim(96),
        ValueError,
        "head dim D = 96 is not supported; allowed: 64, 128",
    ),
    BadInput(
        "q_head_dim_strided",
        "cuda",
        lambda q, k, v: (q.transpose(2, 3), k, v),
        ValueError,
        "argument 'q': the last dimension must be contiguous",
    ),
    BadInput(
        "empty_keys",
        "cuda",
        lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]),
        ValueError,
        r"Sk = k\.shape\[2\] = 0 must be positive",
    ),
    BadInput(
        "q_requires_grad",
        "cuda",
        lambda q, k, v: (q.requires_grad_(), k, v),
        RuntimeError,
        r"argument 'q' requires grad and autograd is on, .* is forward-only.*torch\.no_grad\(\)",
    ),
    BadInput(
        "q_broadcast",
        "cuda",
        lambda q, k, v: (q[:, :1].expand_as(q), k, v),
        ValueError,
        r"argument 'q': dimension 1 has stride 0 .*this argument may not be broadcast",
    ),
    BadInput(
        "k_broadcast_over_keys",
        "cuda",
        lambda q, k, v: (q, k[:, :, :1].expand_as(k), v[:, :, :1].expand_as(v)),
        ValueError,
        r"argument 'k': dimension 2 has stride 0 .*only dimension\(s\) 0, 1 may be broadcast",
    ),
    BadInput(
        "scale_negative",
        "cuda",
        lambda q, k, v: (q, k, v),
        ValueError,
        "argument 'scale'",
        {"scale": -1.0},
    ),
    BadInput(
        "scale_zero",
        "cuda",
        lambda q, k, v: (q, k, v),
        ValueError,
        "argument 'scale'",
        {"scale": 0.0},
    ),
]

_ATTENTION_ONLY = [
    BadInput(
        "key_value_length_mismatch",
        "cuda",
        lambda q, k, v: (q, k, v[:, :, :64]),
        ValueError,
        r"key length: 'k'\.shape\[2\] = 128 must equal 'v'\.shape\[2\] = 64",
    ),
    BadInput(
        "mixed_dtypes",
        "cuda",
        lambda q, k, v: (q, k, v.half()),
        TypeError,
        "arguments 'q', 'k', 'v' must share one dtype, got q: bfloat16, k: bfloat16, v: float16",
    ),
]

_QK_ONLY = [
    BadInput(
        "mixed_dtypes",
        "cuda",
        lambda q, k, v: (q, k.half()),
        TypeError,
        "arguments 'q', 'k' must share one dtype, got q: bfloat16, k: float16",
    ),
]


def _params(cases):
    return [
        pytest.param(c, id=c.id, marks=[needs_cuda] if c.device == "cuda" else []) for c in cases
    ]


# pytest parameters (cases on "cuda" carry needs_cuda): parametrize("case", ...) and case.check(entry).
BAD_ATTENTION_INPUTS = _params(_SHARED + _ATTENTION_ONLY)
BAD_QK_INPUTS = _params([c.without_v() for c in _SHARED] + _QK_ONLY)


# ---------------------------------------------------------------- adversarial numerics


def large_logits(B, H, Sq, Sk, D, dtype, *, seed, logit_scale, min_abs_logit=None):
    """Q scaled by `logit_scale`: scale * Q K^T has standard deviation ~logit_scale, so exp(S)
    without the row max would overflow fp32. With `min_abs_logit`, asserts that the largest
    |scale * Q K^T| exceeds it."""
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=seed, logit_scale=logit_scale)
    if min_abs_logit is not None:
        assert reference.qk_ref(q, k).abs().max() > min_abs_logit
    return q, k, v


def one_dominant_key(B, H, Sq, Sk, D, dtype, *, hot, seed):
    """Every query row meets one key (index `hot`) whose logit is ~4 sqrt(D) (32 for D = 64,
    45 for D = 128) while the others stay within a few units: the row max sits at `hot`."""
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, torch.float32, seed)
    u = torch.where(torch.arange(D, device=q.device) % 3 == 0, -1.0, 1.0)  # a +-1 direction
    q, k = 0.5 * q + u, 0.5 * k
    k[:, :, hot] = 4 * u
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    assert (
        reference.qk_ref(q, k).argmax(-1) == hot
    ).all()  # the row max is in column `hot` for every row
    # P is ~1 at `hot` and < e^-25 elsewhere: the answer is V's row `hot`, to within
    # Sk x e^-25 x max|V| < 1e-7, and the standard check holds O to it.
    o_ref, _ = reference.attention_ref(q, k, v)
    torch.testing.assert_close(
        o_ref, v[:, :, hot : hot + 1].double().expand_as(o_ref), rtol=0, atol=1e-6
    )
    return q, k, v


def constant_rows(B, H, Sq, Sk, D, dtype, *, seed):
    """All keys equal: every row of S is constant, P = 1 / Sk, O = the mean of V's rows. The fp64
    reference is exactly that mean, so the standard check holds O to it."""
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=seed)
    k = k[:, :, :1].expand_as(k).contiguous()
    o_ref, _ = reference.attention_ref(q, k, v)
    torch.testing.assert_close(o_ref, v.double().mean(2, keepdim=True).expand_as(o_ref))
    return q, k, v


def growing_logits(B, H, Sq, Sk, D, dtype, *, seed, logit_scale):
    """Keys scaled up along the sequence (x 0.1 for the first, x 2 for the last): most rows find a
    larger max in each later KV tile, so the running row_max changes at almost every tile."""
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=seed, logit_scale=logit_scale)
    k = (k.float() * torch.linspace(0.1, 2.0, Sk, device=k.device)[:, None]).to(k.dtype)
    return q, k, v


# ---------------------------------------------------------------- GQA and packed sequences (stages 7-9)


def gqa_reference_check(name, o, lse, q, k, v, causal, window):
    """Expand K and V to H heads (query head h reads KV head h // group) for the fp64 reference."""
    group = q.shape[1] // k.shape[1]
    k_full, v_full = (t.repeat_interleave(group, dim=1) for t in (k, v))
    Sq, Sk = q.shape[2], k.shape[2]
    mask = masks.visible(Sq, Sk, *masks.resolve_window(causal, window, Sq, Sk), q.device)
    verify.check_attention(name, o, q, k_full, v_full, lse=lse, mask=mask)


def packed_inputs(lens_q, lens_k, H, Hkv, D, dtype, seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, H, D, generator=g, device="cuda").to(dtype)
    k = torch.randn(tk, Hkv, D, generator=g, device="cuda").to(dtype)
    v = torch.randn(tk, Hkv, D, generator=g, device="cuda").to(dtype)

    def cu(lens):
        return torch.tensor(
            [0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda"
        )

    return q, k, v, cu(lens_q), cu(lens_k)


def check_packed(o, lse, q, k, v, cu_q, cu_k, causal, window, only=None, label=""):
    """Sequence by sequence against the batch-mode reference of that sequence alone (a sequence
    without keys: O = 0, LSE = -inf). label prefixes the name in failure messages."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1) if only is None else [only]:
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        qb = q[q0:q1].transpose(0, 1).unsqueeze(0)
        ob = o[q0:q1].transpose(0, 1).unsqueeze(0)
        lb = lse[:, q0:q1].unsqueeze(0)
        if k1 == k0:  # no key at all: every row sees nothing
            assert (ob == 0).all() and (lb == float("-inf")).all(), f"{label}sequence {b}"
            continue
        kb, vb = (t[k0:k1].transpose(0, 1).unsqueeze(0) for t in (k, v))
        gqa_reference_check(f"{label}sequence {b}", ob, lb, qb, kb, vb, causal, window)
