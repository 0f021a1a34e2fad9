"""One process, one entry point, a sequence of calls whose layouts alternate: every result must
match the fp64 reference. A compiled kernel reused on arguments it was not compiled for (a
stride of 0 from .expand, a (B, S, H, D) view, B = 1, another dtype) shows up here as a wrong
answer or an illegal memory access on a later call, never on the first; see common/compile.py.

Each entry point of stages 1-5 on both tracks (Blackwell ones skip without an sm_100 GPU) runs
the whole sequence in one test, so the cache is warm with every earlier layout when the next
one arrives. Outputs are poisoned with NaN before each launch (common.outputs.empty_output), so
an element a kernel fails to write fails the check."""

import importlib

import pytest
import torch
from attention_cases import check_packed, packed_inputs

from common import pack_gqa
from common.tools import inputs, reference, stage_table, verify

ENTRIES = {
    1: ("stage1_gemm", "gemm"),
    2: ("stage2_qk", "qk"),
    3: ("stage3_softmax", "attention"),
    4: ("stage4_kv_interleave", "attention"),
    5: ("stage5_online_softmax", "attention"),
    6: ("stage6_masks", "attention"),
    7: ("stage7_gqa_varlen", "attention"),
    8: ("stage8_warp_specialized", "attention"),
    9: ("stage9_pingpong", "attention"),
    10: ("stage10_overlap", "attention"),
    11: ("stage11_persistent", "attention"),
    12: ("stage12_last_percent", "attention"),
    13: ("stage13_split_kv", "attention"),
    14: ("stage14_paged_kv", "attention"),
}
# The tracks on which each stage exists (stage files land over time).
TRACKS = {
    n: tuple(t for t in ("hopper", "blackwell") if stage_table.available(n, t)) for n in ENTRIES
}
# Stage 6 cycles through these masks along the sequence, so that a kernel is also never reused
# across masks it was not compiled for: (causal, window).
MASKS = [(True, None), (False, (64, 0)), (False, None), (True, (100, None)), (False, (30, 30))]
TRACK_MARK = {"hopper": pytest.mark.gpu_hopper, "blackwell": pytest.mark.gpu_blackwell}
BF16, FP16 = torch.bfloat16, torch.float16


def entry(stage, track):
    package, name = ENTRIES[stage]
    return getattr(importlib.import_module(f"stages.{package}.{track}"), name)


def deadline(fn, what):
    return verify.run_with_deadline(fn, seconds=120, what=what)


# ---------------------------------------------------------------- layouts of (q, k, v)


def contiguous(B, H, Sq, Sk, D, dtype, seed):
    return inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=seed)


def bshd_view(B, H, Sq, Sk, D, dtype, seed):
    """(B, H, S, D) views of (B, S, H, D) tensors: strides (S H D, D, H D, 1)."""
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=seed)
    return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))


def expanded_kv(B, H, Sq, Sk, D, dtype, seed):
    """K and V shared by all heads: (B, 1, Sk, D).expand(B, H, Sk, D), head stride 0."""
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=seed)
    return q, k[:, :1].expand(B, H, Sk, D), v[:, :1].expand(B, H, Sk, D)


def expanded_kv_all(B, H, Sq, Sk, D, dtype, seed):
    """K and V shared by every (batch, head): strides (0, 0, D, 1)."""
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=seed)
    return q, k[:1, :1].expand(B, H, Sk, D), v[:1, :1].expand(B, H, Sk, D)


def stray_unit_strides(B, H, Sq, Sk, D, dtype, seed):
    """Size-1 modes with strides torch may hand over (0 for B = 1, 1 for Sq = 1)."""
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=seed)

    def stray(t):
        st = list(t.stride())
        for d in range(3):
            if t.shape[d] == 1:
                st[d] = 0 if d == 0 else 1
        return t.as_strided(t.shape, st)

    return stray(q), stray(k), stray(v)


def needs_grad_under_no_grad(B, H, Sq, Sk, D, dtype, seed):
    """Inputs that require grad, called under torch.no_grad() (inference): allowed."""
    return tuple(t.requires_grad_() for t in contiguous(B, H, Sq, Sk, D, dtype, seed))


# The sequence, in order: (label, layout, (B, H, Sq, Sk, D), dtype). It alternates the layouts
# that must not share a compiled kernel (expanded vs not, bf16 vs fp16, D = 64 vs 128) and
# revisits earlier ones after them.
def attention_sequence(max_sk=None, sk_multiple=1):
    def sk(n):
        n = min(n, max_sk) if max_sk else n
        return n - n % sk_multiple if n % sk_multiple else n

    ragged = sk(200) if not max_sk else sk(100)
    return [
        ("contiguous", contiguous, (2, 4, 256, sk(384), 64), BF16),
        ("expanded K, V over heads", expanded_kv, (2, 4, 256, sk(384), 64), BF16),
        ("contiguous again", contiguous, (2, 4, 256, sk(384), 64), BF16),
        ("(B, S, H, D) views", bshd_view, (2, 4, 200, sk(384), 64), FP16),
        ("expanded K, V, fp16", expanded_kv, (2, 4, 200, sk(384), 64), FP16),
        ("B = 1 with stray size-1 strides", stray_unit_strides, (1, 4, 256, sk(384), 64), BF16),
        ("H = 1", contiguous, (2, 1, 256, sk(256), 64), FP16),
        ("Sq = 1", stray_unit_strides, (2, 4, 1, sk(384), 64), BF16),
        (
            "Sk not a tile multiple, expanded over B and H",
            expanded_kv_all,
            (2, 4, 128, ragged, 64),
            FP16,
        ),
        ("D = 128", contiguous, (2, 2, 256, sk(384), 128), BF16),
        ("D = 128, expanded", expanded_kv, (2, 2, 256, sk(384), 128), BF16),
        (
            "requires_grad inputs under no_grad",
            needs_grad_under_no_grad,
            (1, 2, 130, sk(300), 64),
            FP16,
        ),
        ("contiguous, the first kernel once more", contiguous, (2, 4, 256, sk(384), 64), BF16),
    ]


# What each stage accepts (the same on both tracks): stage 3 is a single KV tile (Sk <= 128),
# stage 2 writes fp32 rows of S that TMA stores from 16-byte boundaries (Sk % 4 == 0).
LIMITS = {2: {"sk_multiple": 4}, 3: {"max_sk": 128}, **{n: {} for n in range(4, 15)}}


def check_output(stage, out, q, k, v, label, mask=None):
    name = f"stage {stage} [{label}]"
    if stage == 2:
        scale = q.shape[-1] ** -0.5
        torch_lowp = (q @ k.transpose(-1, -2)) * scale
        # S in fp32: only wgmma's fp32 accumulation order separates it from fp64 (~1e-6).
        verify.check_close(name, out, reference.qk_ref(q, k), rtol=1e-4, torch_lowp=torch_lowp)
    elif stage >= 5:
        o, lse = out
        verify.check_attention(name, o, q, k, v, lse=lse, mask=mask)
    else:
        verify.check_attention(name, out, q, k, v)


@pytest.mark.parametrize(
    "stage, track",
    [
        pytest.param(s, t, marks=TRACK_MARK[t], id=f"stage{s}-{t}")
        for s in range(2, 15)
        for t in TRACKS[s]
    ],
)
def test_attention_entry_alternating_layouts(stage, track):
    from common import masks

    fn = entry(stage, track)
    for i, (label, layout, shape, dtype) in enumerate(attention_sequence(**LIMITS[stage])):
        q, k, v = layout(*shape, dtype, seed=100 + i)
        mask = None
        with torch.no_grad():
            if stage == 2:
                out = deadline(lambda: fn(q, k), label)
            elif stage == 5:
                out = deadline(lambda: fn(q, k, v, return_lse=True), label)
            elif stage >= 6:
                causal, window = MASKS[i % len(MASKS)]
                label += f", causal={causal}, window={window}"
                out = deadline(
                    lambda: fn(q, k, v, causal=causal, window=window, return_lse=True), label
                )
                Sq, Sk = q.shape[2], k.shape[2]
                mask = masks.visible(Sq, Sk, *masks.resolve_window(causal, window, Sq, Sk), "cuda")
            else:
                out = deadline(lambda: fn(q, k, v), label)
        check_output(
            stage, out, q.detach(), k.detach(), v.detach() if stage > 2 else None, label, mask
        )


@pytest.mark.parametrize(
    "stage, track",
    [
        pytest.param(s, t, marks=TRACK_MARK[t], id=f"stage{s}-{t}")
        for s in range(2, 15)
        for t in TRACKS[s]
    ],
)
def test_attention_entry_refuses_then_recovers(stage, track):
    # A layout the kernels do not take is refused with the argument's name, and a later valid
    # call in the same process is still correct (nothing was compiled or launched for it).
    fn = entry(stage, track)
    q, k, v = contiguous(2, 4, 128, 128, 64, BF16, seed=7)
    args = (
        (q[:, :1].expand(2, 4, 128, 64), k)
        if stage == 2
        else (q[:, :1].expand(2, 4, 128, 64), k, v)
    )
    with pytest.raises(ValueError, match="argument 'q': dimension 1 has stride 0"):
        fn(*args)
    with pytest.raises(RuntimeError, match="argument 'k' requires grad"):
        fn(*((q, k.requires_grad_()) if stage == 2 else (q, k.requires_grad_(), v)))
    k = k.detach()
    if stage == 2:
        out = deadline(lambda: fn(q, k), "after refusals")
    elif stage >= 5:
        out = deadline(lambda: fn(q, k, v, return_lse=True), "after refusals")
    else:
        out = deadline(lambda: fn(q, k, v), "after refusals")
    check_output(stage, out, q, k, v, "after refusals")


# ---------------------------------------------------------------- stage 1: the GEMM


def gemm_sequence():
    """(label, a, b builder) for C = A @ B^T: contiguous, rows of a wider tensor (leading stride
    larger than K), M = 1, M and N not tile multiples, both dtypes, K = 8."""

    def plain(M, N, K, dtype, seed):
        return inputs.gemm_inputs(M, N, K, dtype, seed=seed)

    def wide_rows(M, N, K, dtype, seed):
        a, b = inputs.gemm_inputs(M, N, K + 64, dtype, seed=seed)
        return a[:, :K], b[:, :K]

    return [
        ("contiguous", plain, (256, 384, 256), BF16),
        ("rows of a wider tensor", wide_rows, (256, 384, 256), BF16),
        ("contiguous again", plain, (256, 384, 256), BF16),
        ("fp16, M and N not tile multiples", plain, (200, 264, 192), FP16),
        ("M = 1", plain, (1, 256, 128), BF16),
        ("fp16 rows of a wider tensor, M = 1", wide_rows, (1, 136, 128), FP16),
        ("K = 8", plain, (128, 128, 8), BF16),
        ("contiguous, the first kernel once more", plain, (256, 384, 256), BF16),
    ]


@pytest.mark.parametrize(
    "track", [pytest.param(t, marks=TRACK_MARK[t]) for t in ("hopper", "blackwell")]
)
def test_gemm_alternating_layouts(track):
    fn = entry(1, track)
    for i, (label, build, shape, dtype) in enumerate(gemm_sequence()):
        a, b = build(*shape, dtype, seed=200 + i)
        c = deadline(lambda: fn(a, b), label)
        # fp32 accumulation of exact products; the bound is 3x PyTorch's own bf16/fp16 GEMM error.
        verify.check_close(
            f"stage 1 [{label}]", c, reference.gemm_ref(a, b), rtol=1e-2, torch_lowp=a @ b.T
        )
    a, b = inputs.gemm_inputs(128, 128, 64, BF16, seed=1)
    with pytest.raises(ValueError, match="argument 'a': dimension 0 has stride 0"):
        fn(a[:1].expand(128, 64), b)
    with pytest.raises(RuntimeError, match="argument 'b' requires grad"):
        fn(a, b.clone().requires_grad_())


# ---------------------------------------------------------------- the reported sequences

# The three sequences that went wrong before the cache keyed on argument types (stage 5 Hopper,
# bf16, D = 64), each in a fresh process as first reported: expanded then contiguous K, V;
# contiguous then expanded; expanded, then (B, S, H, D) views, then B = 1.
_SEQUENCE_SCRIPT = r"""
import sys, torch
sys.path.insert(0, {root!r})
from common.tools import verify
from stages.stage5_online_softmax import hopper

def make(kind, seed):
    g = torch.Generator(device="cuda"); g.manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").bfloat16()
    if kind == "expanded":
        return r(2, 8, 384, 64), r(2, 1, 384, 64).expand(2, 8, 384, 64), r(2, 1, 384, 64).expand(2, 8, 384, 64)
    if kind == "contiguous":
        return r(2, 8, 384, 64), r(2, 8, 384, 64), r(2, 8, 384, 64)
    if kind == "bshd":
        return tuple(r(2, 384, 8, 64).transpose(1, 2) for _ in range(3))
    if kind == "b1":
        return r(1, 8, 384, 64), r(1, 8, 384, 64), r(1, 8, 384, 64)

for i, kind in enumerate({kinds!r}):
    q, k, v = make(kind, i)
    o = verify.run_with_deadline(lambda: hopper.attention(q, k, v), 60)
    r, _ = verify.check_attention(kind, o, q, k, v)
    print(kind, f"{{r.rel_err:.2e}}")
"""


@pytest.mark.gpu_hopper
@pytest.mark.parametrize(
    "kinds",
    [("expanded", "contiguous"), ("contiguous", "expanded"), ("expanded", "bshd", "b1")],
    ids="-then-".join,
)
def test_reported_sequences_in_fresh_processes(kinds):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _SEQUENCE_SCRIPT.format(root=root, kinds=kinds)
    # The child process does not run tests/conftest.py: POISON_OUTPUTS=1 fills its outputs with
    # NaN before each launch too (common/outputs.py), so that an element never written fails.
    env = {**os.environ, "POISON_OUTPUTS": "1"}
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.split("\n")
    assert [ln.split()[0] for ln in lines if ln.strip()] == list(kinds), p.stdout
    print(p.stdout)


# ---------------------------------------------------------------- stage 7: both entry points


@pytest.mark.parametrize(
    "stage, track",
    [
        pytest.param(s, t, marks=TRACK_MARK[t], id=f"stage{s}-{t}")
        for s in (7, 8, 9)
        for t in TRACKS[s]
    ],
)
def test_stage7_alternating_entries_heads_and_packing(stage, track):
    # attention (batch mode) and attention_varlen (packed) share one kernel class; their compiled
    # forms differ (cu_seqlens or none), as do GQA groups only by run-time values.
    from common import masks

    mod = importlib.import_module(f"stages.{ENTRIES[stage][0]}.{track}")
    steps = [
        ("batch, GQA 8/2, causal", "batch", (2, 8, 2, 300, 300, 64, BF16), (True, None)),
        (
            "packed, GQA 8/2",
            "packed",
            ([100, 0, 257, 1], [90, 40, 300, 1], 8, 2, 64, BF16),
            (False, None),
        ),
        ("batch, MQA, window", "batch", (1, 8, 1, 200, 700, 64, BF16), (False, (64, 0))),
        ("packed fp16, causal", "packed", ([300, 5], [300, 600], 4, 4, 64, FP16), (True, None)),
        ("batch, expanded K/V over heads", "expanded", (2, 4, 4, 256, 256, 64, BF16), (True, None)),
        (
            "packed D = 128, MQA",
            "packed",
            ([129, 64], [200, 64], 4, 1, 128, BF16),
            (True, (50, None)),
        ),
        ("batch fp16 D = 128, GQA 4/2", "batch", (2, 4, 2, 128, 384, 128, FP16), (False, None)),
        # Sq = 1 with 32/8 heads: packed by the pack-GQA rule (4 heads per tile), a kernel
        # compiled for G = 4; then the same D and dtype unpacked (Sq = 256
        # fills two whole tiles, so the rule does not pack).
        ("batch decode, GQA 32/8, packed", "batch", (2, 32, 8, 1, 500, 64, BF16), (True, None)),
        ("batch, GQA 32/8, unpacked", "batch", (1, 32, 8, 256, 300, 64, BF16), (True, None)),
        (
            "packed again, GQA 8/2",
            "packed",
            ([100, 0, 257, 1], [90, 40, 300, 1], 8, 2, 64, BF16),
            (True, None),
        ),
    ]
    # The decode step is packed (a kernel compiled for 4 heads per tile), the next one is not.
    assert pack_gqa.choose_pack(32, 8, 1) == 4 and pack_gqa.choose_pack(32, 8, 256) == 1
    for i, (label, kind, shape, (causal, window)) in enumerate(steps):
        if kind == "packed":
            q, k, v, cu_q, cu_k = packed_inputs(*shape, seed=300 + i)
            o, lse = deadline(
                lambda: mod.attention_varlen(
                    q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True
                ),
                label,
            )
            check_packed(
                o, lse, q, k, v, cu_q, cu_k, causal, window, label=f"stage {stage} [{label}] "
            )
            continue
        B, H, Hkv, Sq, Sk, D, dtype = shape
        q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=400 + i)
        _, k, v = inputs.attention_inputs(B, Hkv, Sk, Sk, D, dtype, seed=500 + i)
        if kind == "expanded":
            k, v = k[:, :1].expand(B, H, Sk, D), v[:, :1].expand(B, H, Sk, D)
        o, lse = deadline(
            lambda: mod.attention(q, k, v, causal=causal, window=window, return_lse=True), label
        )
        group = H // k.shape[1]
        kf, vf = (t.repeat_interleave(group, 1) for t in (k, v))
        mask = masks.visible(Sq, Sk, *masks.resolve_window(causal, window, Sq, Sk), "cuda")
        verify.check_attention(f"stage {stage} [{label}]", o, q, kf, vf, lse=lse, mask=mask)
