"""The compile cache's key, on the CPU (CI guards it): two argument sets that the compiled code
cannot tell apart share one key; two that it can get different keys. common/compile.py explains
each case. CuTe views of CPU tensors have the same types as views of CUDA tensors, so no GPU is
needed."""

import math

import pytest
import torch

from common import checks
from common.compile import compile_key, tensor_signature
from common.cute_interop import canonical_strides, cute_dtype, to_cute
from stages.stage1_gemm import hopper as gemm_hopper
from stages.stage5_online_softmax import blackwell as s5_blackwell
from stages.stage5_online_softmax import hopper as s5_hopper


def bhsd(B, H, S, D, dtype=torch.bfloat16):
    return torch.randn(B, H, S, D).to(dtype)


def bshd_view(B, H, S, D, dtype=torch.bfloat16):
    """A (B, H, S, D) view of a (B, S, H, D) tensor: strides (S H D, D, H D, 1)."""
    return torch.randn(B, S, H, D).to(dtype).transpose(1, 2)


def expanded(B, H, S, D, dtype=torch.bfloat16):
    """K or V shared by all heads: (B, 1, S, D).expand(B, H, S, D), head stride 0."""
    return torch.randn(B, 1, S, D).to(dtype).expand(B, H, S, D)


def stage5_key(q, k, v, *, D=None, dynamic=True, kernel=None, scale=0.125):
    D = D or q.shape[-1]
    B, H, Sq, _ = q.shape
    o = torch.empty(B, H, Sq, D, dtype=q.dtype)
    lse = torch.empty(B, H, Sq)
    kernel = kernel or s5_hopper.Sm90Kernel(cute_dtype(q.dtype), D)
    args = [to_cute(t, dynamic=dynamic) for t in (q, k, v, o, lse)] + [scale, None]
    return compile_key(kernel, args)


def test_layouts_that_share_a_kernel_share_a_key():
    base = stage5_key(bhsd(2, 8, 384, 64), bhsd(2, 8, 384, 64), bhsd(2, 8, 384, 64))
    # Run-time extents and strides: another shape, a (B, S, H, D) view, a ragged Sk, B = 1,
    # H = 1, Sq = 1, another scale: the same compiled kernel serves them all.
    same = {
        "other shape": stage5_key(bhsd(3, 5, 1000, 64), bhsd(3, 5, 77, 64), bhsd(3, 5, 77, 64)),
        "(B, S, H, D) view": stage5_key(
            bshd_view(2, 8, 384, 64), bshd_view(2, 8, 384, 64), bshd_view(2, 8, 384, 64)
        ),
        "B = 1": stage5_key(bhsd(1, 8, 384, 64), bhsd(1, 8, 384, 64), bhsd(1, 8, 384, 64)),
        "H = 1, Sq = 1": stage5_key(bhsd(2, 1, 1, 64), bhsd(2, 1, 384, 64), bhsd(2, 1, 384, 64)),
        "scale": stage5_key(
            bhsd(2, 8, 384, 64), bhsd(2, 8, 384, 64), bhsd(2, 8, 384, 64), scale=0.3
        ),
    }
    for what, key in same.items():
        assert key == base, f"{what}: a new key for a layout the compiled kernel already serves"


def test_layouts_the_kernel_cannot_serve_get_their_own_key():
    q, k, v = bhsd(2, 8, 384, 64), bhsd(2, 8, 384, 64), bhsd(2, 8, 384, 64)
    base = stage5_key(q, k, v)
    differ = {
        # A stride of 0 stays static: the head mode of K and V is folded into the TMA.
        "expanded K, V": stage5_key(q, expanded(2, 8, 384, 64), expanded(2, 8, 384, 64)),
        "expanded K only": stage5_key(q, expanded(2, 8, 384, 64), v),
        "fp16": stage5_key(q.half(), k.half(), v.half()),
        "D = 128": stage5_key(bhsd(2, 8, 384, 128), bhsd(2, 8, 384, 128), bhsd(2, 8, 384, 128)),
        "static layouts": stage5_key(q, k, v, dynamic=False),
    }
    for what, key in differ.items():
        assert key != base, f"{what}: shares a key with contiguous K, V"
    assert len(set(differ.values())) == len(differ)
    # The kernel's configuration is part of the key: a changed pipeline depth compiles anew.
    kernel = s5_hopper.Sm90Kernel(cute_dtype(torch.bfloat16), 64)
    kernel.kv_slots = 3
    assert stage5_key(q, k, v, kernel=kernel) != base
    # ... and so is its class: a reloaded module (a new class object) never reuses old code.
    Reloaded = type("Sm90Kernel", (s5_hopper.Sm90Kernel,), {})
    assert stage5_key(q, k, v, kernel=Reloaded(cute_dtype(torch.bfloat16), 64)) != base


def test_expanded_over_batch_differs_from_expanded_over_heads():
    q = bhsd(2, 8, 384, 64)
    over_heads = expanded(2, 8, 384, 64)
    over_both = torch.randn(1, 1, 384, 64).bfloat16().expand(2, 8, 384, 64)
    assert stage5_key(q, over_heads, over_heads) != stage5_key(q, over_both, over_both)


def test_static_layouts_key_on_every_extent_and_stride():
    # Blackwell-style static views: each shape and stride is folded into the code.
    def key(q, k, v):
        kernel = s5_blackwell.Sm100Kernel(cute_dtype(q.dtype), q.shape[-1])
        B, H, Sq, D = q.shape
        o, lse = torch.empty(B, H, Sq, D, dtype=q.dtype), torch.empty(B, H, Sq)
        args = [to_cute(t) for t in (q, k, v, o, lse)] + [0.1, None]
        return compile_key(kernel, args)

    a = key(bhsd(2, 4, 256, 64), bhsd(2, 4, 384, 64), bhsd(2, 4, 384, 64))
    assert a == key(bhsd(2, 4, 256, 64), bhsd(2, 4, 384, 64), bhsd(2, 4, 384, 64))
    assert a != key(bhsd(2, 4, 256, 64), bhsd(2, 4, 512, 64), bhsd(2, 4, 512, 64))
    assert a != key(bshd_view(2, 4, 256, 64), bhsd(2, 4, 384, 64), bhsd(2, 4, 384, 64))


def test_gemm_static_and_dynamic_keys():
    def key(a, b, dynamic):
        c = torch.empty(a.shape[0], b.shape[0], dtype=a.dtype)
        args = [to_cute(t, dynamic=dynamic) for t in (a, b, c)] + [None]
        return compile_key(gemm_hopper.Sm90Kernel(cute_dtype(a.dtype)), args)

    a, b = torch.randn(256, 128).bfloat16(), torch.randn(384, 128).bfloat16()
    assert key(a, b, False) != key(torch.randn(512, 128).bfloat16(), b, False)
    assert key(a, b, True) == key(torch.randn(512, 128).bfloat16(), b, True)
    wide = torch.randn(256, 192).bfloat16()[:, :128]  # rows of 192 elements: another stride
    assert key(wide, b, False) != key(a, b, False)


def test_size_one_modes_get_one_canonical_stride():
    t = torch.randn(1, 8, 1, 64).bfloat16()
    for strides in [(0, 64, 0, 1), (1, 64, 1, 1), (12345, 64, 7, 1)]:
        u = canonical_strides(t.as_strided(t.shape, strides))
        assert u.stride() == (512, 64, 512, 1), strides
        assert torch.equal(u, t)
    # Strides of modes longer than 1 are never touched; a tensor with none of size 1 is returned as is.
    e = expanded(2, 8, 16, 64)
    assert canonical_strides(e) is e and e.stride()[1] == 0


def test_signature_names_the_static_parts():
    k = expanded(2, 8, 384, 64)
    dtype, align, text = tensor_signature(to_cute(k, dynamic=True))
    assert dtype == "BFloat16" and align == 16
    assert ":(?{i64},0,?{i64},1)" in text, text  # the 0 stride is static, the others run-time
    assert "0x" not in text  # the pointer is not part of it


def test_runtime_scalars_are_not_in_the_key_but_constants_are():
    q = bhsd(1, 1, 128, 64)
    assert stage5_key(q, q, q, scale=0.1) == stage5_key(q, q, q, scale=math.pi)
    # A Python constant in a parameter without a run-time annotation is keyed by value.
    kernel = s5_hopper.Sm90Kernel(cute_dtype(torch.bfloat16), 64)
    args = [to_cute(t, dynamic=True) for t in (q, q, q, q, torch.empty(1, 1, 128))]
    assert compile_key(kernel, args + [0.1, None]) == compile_key(kernel, args + [0.2, None])
    assert compile_key(kernel, args + [0.1, 1]) != compile_key(kernel, args + [0.1, 2])


@pytest.mark.parametrize(
    "name, build, match",
    [
        (
            "q",
            lambda d: torch.randn(2, 1, 128, 64, device=d).bfloat16().expand(2, 4, 128, 64),
            "argument 'q': dimension 1",
        ),
        (
            "k",
            lambda d: torch.randn(2, 4, 1, 64, device=d).bfloat16().expand(2, 4, 128, 64),
            "argument 'k': dimension 2",
        ),
    ],
)
def test_stride_zero_refused_outside_kv_batch_and_heads(name, build, match):
    # Built on the device: .cuda() of an expanded tensor would copy it into a contiguous one.
    t = build("cuda" if torch.cuda.is_available() else "cpu")
    assert 0 in t.stride()
    with pytest.raises(ValueError, match=match + " has stride 0"):
        checks.check_tensor(
            name,
            t if t.is_cuda else _FakeCuda(t),
            rank=4,
            broadcast_dims=() if name == "q" else checks.KV_BROADCAST_DIMS,
        )


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports is_cuda, to reach the stride checks without a GPU."""

    @staticmethod
    def __new__(cls, t):
        return torch.Tensor._make_subclass(cls, t)

    @property
    def is_cuda(self):
        return True


def test_tvm_ffi_key_partitions_layouts_as_the_view_key_does():
    """Stages 7-12 launch through TVM-FFI with the torch tensors themselves, keyed on their torch
    layout (common.compile.ffi_compile_key). For every pair of argument sets below, the two keys
    must agree on whether one compiled kernel serves both: the same partition into kernels as the
    CuTe-view key (compile_key), case by case."""
    from common.compile import ffi_compile_key
    from stages.stage12_last_percent import hopper as s12_hopper

    def tensors(q, k, v):
        B, H, Sq, D = q.shape
        o = torch.empty(B, H, Sq, D, dtype=q.dtype)
        lse = torch.empty(B, H, Sq)
        return [canonical_strides(t) for t in (q, k, v, o, lse)]

    cases = {
        "base": (bhsd(2, 8, 384, 64), bhsd(2, 8, 384, 64), bhsd(2, 8, 384, 64)),
        "other shape": (bhsd(3, 5, 1000, 64), bhsd(3, 5, 77, 64), bhsd(3, 5, 77, 64)),
        "(B, S, H, D) views": tuple(bshd_view(2, 8, 384, 64) for _ in range(3)),
        "B = 1": tuple(bhsd(1, 8, 384, 64) for _ in range(3)),
        "H = 1, Sq = 1": (bhsd(2, 1, 1, 64), bhsd(2, 1, 384, 64), bhsd(2, 1, 384, 64)),
        "B = 1 from a slice": tuple(bhsd(3, 8, 384, 64)[1:2] for _ in range(3)),
        "expanded K, V over heads": (bhsd(2, 8, 384, 64), *[expanded(2, 8, 384, 64)] * 2),
        "expanded K only": (bhsd(2, 8, 384, 64), expanded(2, 8, 384, 64), bhsd(2, 8, 384, 64)),
        "expanded over batch and heads": (
            bhsd(2, 8, 384, 64),
            *[torch.randn(1, 1, 384, 64).bfloat16().expand(2, 8, 384, 64)] * 2,
        ),
        "fp16": tuple(bhsd(2, 8, 384, 64, torch.float16) for _ in range(3)),
        "D = 128": tuple(bhsd(2, 8, 384, 128) for _ in range(3)),
        "GQA 8/2": (bhsd(2, 8, 384, 64), bhsd(2, 2, 384, 64), bhsd(2, 2, 384, 64)),
    }
    kernels = {
        D: s12_hopper.Sm90Kernel(cute_dtype(dt), D, 1)
        for D, dt in ((64, torch.bfloat16), (128, torch.bfloat16))
    }
    kernels_fp16 = s12_hopper.Sm90Kernel(cute_dtype(torch.float16), 64, 1)
    old, new = {}, {}
    for name, (q, k, v) in cases.items():
        kernel = kernels_fp16 if q.dtype == torch.float16 else kernels[q.shape[-1]]
        ts = tensors(q, k, v)
        scalars = [q.shape[2], 0.125 * math.log2(math.e), k.shape[2], q.shape[2]]
        views = [to_cute(t, dynamic=True) for t in ts]
        old[name] = compile_key(kernel, views + [None, None] + scalars + [None])
        new[name] = ffi_compile_key(kernel, ts + [None, None] + scalars)
    names = list(cases)
    for a in names:
        for b in names:
            assert (old[a] == old[b]) == (new[a] == new[b]), (
                f"{a} / {b}: the CuTe-view key says {'same' if old[a] == old[b] else 'different'}"
                f" kernels, the TVM-FFI key does not"
            )
    # Not a key that cannot fail: the cases fall into several kernels.
    assert 4 <= len(set(new.values())) < len(names)


@pytest.mark.parametrize(
    "stage, track, varlen",
    [
        (7, "hopper", False),
        (8, "hopper", False),
        (9, "hopper", False),
        (9, "hopper", True),
        (7, "blackwell", False),
        (8, "blackwell", False),
        (9, "blackwell", False),
        (9, "blackwell", True),
        (12, "blackwell", False),
        (12, "blackwell", True),
    ],
    ids=lambda x: str(x),
)
def test_tvm_ffi_launch_compiles_on_both_tracks(stage, track, varlen):
    """Stages 7-12 launch through TVM-FFI (common/attention_host.py); on the CPU the launch's
    compile is checked for both tracks, with the argument layouts a launch builds (the Blackwell
    kernels are never run here: this is what shows their launch path builds)."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    from common.arch import ARCH_OF_TRACK
    from common.tools import stage_table
    from common.tools.ptx import compile_ffi_for_arch

    del tvm_ffi
    mod = stage_table.track_module(stage, track)
    kernel_class = type(mod.compile_args(torch.bfloat16, (1, 1, 128, 128, 128))[0])
    H, Hkv, D = 8, 2, 128
    if varlen:
        total = 700
        q, o = (torch.randn(total, H, D).bfloat16() for _ in range(2))
        k, v = (torch.randn(total, Hkv, D).bfloat16() for _ in range(2))
        as_bhsd = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
        q, k, v, o = map(as_bhsd, (q, k, v, o))
        lse = torch.empty(1, H, total)
        cu = torch.tensor([0, 300, 700], dtype=torch.int32)
        cu_q = cu_k = cu
    else:
        q, o = (torch.randn(2, H, 384, D).bfloat16() for _ in range(2))
        k, v = (torch.randn(2, Hkv, 512, D).bfloat16() for _ in range(2))
        lse = torch.empty(2, H, 384)
        cu_q = cu_k = None
    tensors = [canonical_strides(t) for t in (q, k, v, o, lse)]
    args = tensors + [cu_q, cu_k, 384, 0.125 * math.log2(math.e), 512, 0]
    kernel = kernel_class(cute_dtype(torch.bfloat16), D, 1)
    if getattr(kernel, "uses_tile_counter", False):  # stages 11-12, as the launch adds it
        from common import attention_host

        args.append(attention_host.tile_counter(not varlen, 512, 0, 384, 512, "cpu"))
    fn = compile_ffi_for_arch(kernel, args, ARCH_OF_TRACK[track])
    assert "TVMFFI" in type(fn).__name__, type(fn)


@pytest.mark.parametrize("track", ["hopper", "blackwell"])
def test_split_launch_compiles_through_tvm_ffi_on_both_tracks(track, monkeypatch):
    """A split launch's plan (make_plan, then a call that returns no LSE) compiles the split
    kernel and the combine as one TVM-FFI function per LSE variant: the one for a call that
    returns its LSE at once, the one that keeps it in the partials' buffer at the first such
    call. Compiled for each track's arch on the CPU, with the layouts the launch builds."""
    pytest.importorskip("tvm_ffi")
    from common import attention_host as AH
    from common.arch import ARCH_OF_TRACK
    from common.tools import stage_table
    from common.tools.ptx import compile_ffi_for_arch

    compiled = []

    def compile_ffi(kernel, *args):
        compiled.append((kernel, args, compile_ffi_for_arch(kernel, args, ARCH_OF_TRACK[track])))
        return lambda *call_args: None

    monkeypatch.setattr(AH, "cached_compile_ffi", compile_ffi)
    mod = stage_table.track_module(13, track)
    kernel_class = type(mod.compile_args(torch.bfloat16, (1, 1, 128, 128, 128))[0])
    q = torch.randn(1, 32, 1, 128).bfloat16()
    k = v = torch.randn(1, 8, 8192, 128).bfloat16()
    o, lse = torch.empty_like(q), torch.empty(1, 32, 1)
    plan = AH.make_plan(
        kernel_class, q, k, v, o, lse, None, None, 1, 8192, True, None, None, None, 16
    )
    o, lse, buffer = plan.outputs(torch.bfloat16, "cpu", False)
    assert lse is None and buffer.numel() == AH.partials_layout(16, (1, 32, 1, 128), (1, 32, 1))[0]
    plan.run(q, k, v, o, lse, None, None, 1, 0.1, None, buffer=buffer)
    assert len(compiled) == 2
    for kernel, args, fn in compiled:
        assert type(kernel).__name__ == "SplitLaunch" and kernel.kernel.split_kv
        assert "TVMFFI" in type(fn).__name__, type(fn)
    assert compiled[0][1][4] is not None and compiled[1][1][4] is None  # LSE, then in the buffer
