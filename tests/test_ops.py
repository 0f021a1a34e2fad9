"""The custom ops of common/ops.py (torch.ops.flash_tutorial.attention / attention_varlen).

- CPU: importing common.ops loads no stage and no CuTe DSL; the wrappers call the stage directly
  only in eager mode on plain tensors (no fake, meta or subclass tensor, no dispatch or
  torch-function mode, no vmap), with the caller's arguments; which stage the ops run (the latest
  with stage 7's API; FLASH_TUTORIAL_STAGE and use_stage pin another); the schemas; the fake
  implementations under FakeTensorMode (CUDA fake tensors: shapes, dtypes, devices, contiguous
  outputs whatever the input strides) and on meta tensors, and their refusals; an input that
  requires grad under grad mode raises the kernels' own error, through the wrapper and through
  torch.ops directly; torch.compile(fullgraph=True) of TutorialAttention traces in one graph with
  the op as one node (backends that run the graph on meta tensors, so no kernel is needed).
- GPU (marker gpu_hopper): torch.library.opcheck on every sample of opcheck_samples(), for every
  stage with the ops' API; the ops and the wrappers' direct calls give bit-identical results to
  those stages' plain entries; a torch.compile(fullgraph=True)
  (inductor) function and module calling the op against eager and against SDPA; the grad
  refusal on real CUDA tensors.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from common import checks, masks, ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF, FP = torch.bfloat16, torch.float16


def grad_message():
    """The text the kernels raise for an input that requires grad."""
    t = torch.empty(1, requires_grad=True)
    with pytest.raises(RuntimeError) as e, torch.enable_grad():
        checks.check_inference_only(("q",), (t,), "this attention kernel")
    return str(e.value)


# ---------------------------------------------------------------- registration


class RecordOps(TorchDispatchMode):
    """A dispatch mode that records each op it sees (a mode must still see the custom op)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_eager_direct_only_for_plain_tensors_in_eager():
    """The wrappers skip the op only for plain tensors of the kernel's device, in eager mode with
    no mode or transform that must see the op."""
    from torch.overrides import TorchFunctionMode

    class PassDispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class PassFunction(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    t = torch.zeros(2, 3)
    assert ops.eager_direct((t, t), device_type="cpu")
    assert not ops.eager_direct((t, t))  # CPU tensors, the kernel's device is CUDA
    assert not ops.eager_direct((t, torch.zeros(2, 3, device="meta")), device_type="cpu")
    assert not ops.eager_direct((t, t.as_subclass(Sub)), device_type="cpu")
    with PassDispatch():
        assert not ops.eager_direct((t, t), device_type="cpu")
    with PassFunction():
        assert not ops.eager_direct((t, t), device_type="cpu")
    with FakeTensorMode() as mode:
        f = mode.from_tensor(t)
    assert not ops.eager_direct((f, f), device_type="cpu")
    seen = []
    torch.vmap(lambda x: seen.append(ops.eager_direct((x,), device_type="cpu")) or x)(t)
    assert seen == [False]
    assert ops.eager_direct((t, t), device_type="cpu")  # nothing left active


def test_autograd_key_falls_through_to_the_kernel_that_refuses_grad(monkeypatch):
    """The Autograd key is a fallthrough: under no_grad, inference_mode and grad mode (inputs
    that need no grad) the dispatcher reaches the op's kernel with no Python call on the way; a
    dispatch mode still sees the op; an input that requires grad under grad mode gets the
    kernels' error from the kernel itself, on any device (here CPU tensors and a stand-in
    stage)."""
    for op in (ops.attention_op, ops.attention_varlen_op):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd")
    calls = []

    class Stage(CheckingStage):
        def attention(self, *args, **kwargs):
            calls.append(args[0])
            return super().attention(*args, **kwargs)

    monkeypatch.setattr(ops, "_stage", lambda: Stage())
    q, k, v = small_qkv()
    want = Stage().attention(q, k, v, return_lse=True)
    calls.clear()
    runs = {"grad mode": ops.attention_op(q, k, v, None, True, None, None)}
    with torch.no_grad():
        runs["no_grad"] = ops.attention_op(q, k, v, None, True, None, None)
    with torch.inference_mode():
        runs["inference_mode"] = ops.attention_op(q, k, v, None, True, None, None)
    mode = RecordOps()
    with torch.no_grad(), mode:
        runs["dispatch mode"] = ops.attention_op(q, k, v, None, True, None, None)
    assert ops.attention_op in mode.seen, mode.seen
    assert len(calls) == 4
    for how, got in runs.items():
        for g, w in zip(got, want):
            assert torch.equal(g, w) and not g.requires_grad, how
    qg = q.clone().requires_grad_(True)
    calls.clear()
    with pytest.raises(RuntimeError) as e:
        ops.attention_op(qg, k, v, None, True, None, None)
    assert str(e.value) == grad_message() and not calls  # refused before the stage ran
    with torch.no_grad():
        assert ops.attention_op(qg, k, v, None, True, None, None)[0].requires_grad is False


def test_wrappers_call_the_stage_directly_with_the_same_arguments(monkeypatch):
    """In eager mode on plain tensors the wrappers call the stage's own functions with the
    caller's arguments (recorded here: CPU tensors stand in for CUDA ones)."""
    calls = []

    class Recorder:
        def attention(self, *args, **kwargs):
            calls.append(("attention", args, kwargs))
            return "o"

        def attention_varlen(self, *args, **kwargs):
            calls.append(("attention_varlen", args, kwargs))
            return "o"

    direct = ops.eager_direct
    monkeypatch.setattr(ops, "eager_direct", lambda ts: direct(ts, device_type="cpu"))
    monkeypatch.setattr(ops, "_stage", Recorder)
    q, k = torch.zeros(1, 2, 3, 64), torch.zeros(1, 1, 3, 64)
    assert ops.attention(q, k, k, 0.5, True, (8, None), return_lse=True) == "o"
    name, args, kwargs = calls.pop()
    assert name == "attention" and all(a is b for a, b in zip(args, (q, k, k)))
    assert kwargs == dict(scale=0.5, causal=True, window=(8, None), return_lse=True)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    assert ops.attention_varlen(q[0], k[0], k[0], cu, cu, 3, 3, causal=True) == "o"
    name, args, kwargs = calls.pop()
    assert name == "attention_varlen" and args[3] is cu and args[4] is cu
    assert kwargs["max_seqlen_q"] == 3 and kwargs["causal"] is True
    assert kwargs["return_lse"] is False and kwargs["window"] is None


def test_import_loads_no_stage_and_no_cute():
    code = (
        "import sys, common.ops, torch; "
        "assert hasattr(torch.ops.flash_tutorial, 'attention'); "
        "bad = [m for m in sys.modules if m.startswith(('stages', 'cutlass'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_stage_selection(monkeypatch):
    numbers = ops.stage_numbers()
    assert numbers[0] == 7 and numbers == sorted(numbers)
    monkeypatch.delenv(ops.STAGE_ENV, raising=False)
    assert ops.read_stage_env() is None
    assert ops.current_stage() == numbers[-1]
    with ops.use_stage(7):
        assert ops.current_stage() == 7
        assert ops.stage_module().__name__ == "stages.stage7_gqa_varlen"
    assert ops.current_stage() == numbers[-1]
    # The variable is read once per process (read_stage_env reads it again): a change is not
    # seen until then.
    monkeypatch.setenv(ops.STAGE_ENV, "7")
    assert ops.current_stage() == numbers[-1]
    assert ops.read_stage_env() == 7
    assert ops.current_stage() == 7
    with ops.use_stage(numbers[-1]):
        assert ops.current_stage() == numbers[-1]
    monkeypatch.setenv(ops.STAGE_ENV, "6")  # stage 6 has no GQA / packed entry
    with pytest.raises(ValueError, match="FLASH_TUTORIAL_STAGE=6"):
        ops.read_stage_env()
    with pytest.raises(ValueError, match="FLASH_TUTORIAL_STAGE=6"):
        ops.current_stage()  # not cached while invalid: every call says so
    monkeypatch.delenv(ops.STAGE_ENV)
    assert ops.read_stage_env() is None
    assert ops.current_stage() == numbers[-1]
    with pytest.raises(ValueError, match="stage 5"):
        with ops.use_stage(5):
            pass


def test_schemas():
    a = str(torch.ops.flash_tutorial.attention.default._schema)
    v = str(torch.ops.flash_tutorial.attention_varlen.default._schema)
    assert a.startswith("flash_tutorial::attention(Tensor q, Tensor k, Tensor v, float? scale")
    assert "bool causal" in a and "window_left" in a and a.endswith("-> (Tensor, Tensor)")
    assert "Tensor cu_seqlens_q, Tensor cu_seqlens_k" in v and v.endswith("-> (Tensor, Tensor)")
    # mutates_args=(): no argument is written (no "Tensor(a!)" alias annotation).
    assert "!" not in a and "!" not in v


# ---------------------------------------------------------------- fake implementations


BATCH_CASES = [
    # (B, H, Hkv, Sq, Sk, D, dtype)
    (2, 8, 2, 100, 300, 128, BF),
    (1, 32, 8, 2048, 2048, 128, BF),
    (3, 4, 1, 1, 77, 64, FP),
    (2, 4, 4, 257, 129, 64, BF),
]


@pytest.mark.parametrize("case", BATCH_CASES, ids=lambda c: "x".join(map(str, c[:6])))
@pytest.mark.parametrize("bshd", [False, True], ids=["bhsd", "bshd-memory"])
def test_fake_attention_shapes(case, bshd):
    B, H, Hkv, Sq, Sk, D, dtype = case
    with FakeTensorMode():
        if bshd:  # the layout a model produces: (B, S, H, D) memory seen as (B, H, S, D)
            q = torch.empty(B, Sq, H, D, device="cuda", dtype=dtype).transpose(1, 2)
            k = torch.empty(B, Sk, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2)
        else:
            q = torch.empty(B, H, Sq, D, device="cuda", dtype=dtype)
            k = torch.empty(B, Hkv, Sk, D, device="cuda", dtype=dtype)
        v = torch.empty_like(k)
        for causal, left, right in ((False, None, None), (True, None, None), (False, 64, 8)):
            o, lse = torch.ops.flash_tutorial.attention(q, k, v, None, causal, left, right)
            assert o.shape == (B, H, Sq, D) and o.dtype == dtype and o.device == q.device
            assert o.is_contiguous(), o.stride()  # the kernel allocates O contiguous
            assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32 and lse.is_contiguous()
            assert lse.device == q.device
        o2, lse2 = ops.attention(
            q, k, v, scale=0.1, causal=True, window=(32, None), return_lse=True
        )
        assert o2.shape == o.shape and lse2.shape == lse.shape
        assert ops.attention(q, k, v).shape == (B, H, Sq, D)


@pytest.mark.parametrize(
    "lens_q,lens_k,H,Hkv,D,dtype",
    [([100, 0, 257, 1], [100, 0, 257, 1], 8, 2, 128, BF), ([5], [300], 4, 1, 64, FP)],
)
def test_fake_varlen_shapes(lens_q, lens_k, H, Hkv, D, dtype):
    tq, tk = sum(lens_q), sum(lens_k)
    with FakeTensorMode():
        q = torch.empty(tq, H, D, device="cuda", dtype=dtype)
        k = torch.empty(tk, Hkv, D, device="cuda", dtype=dtype)
        cu_q = torch.empty(len(lens_q) + 1, device="cuda", dtype=torch.int32)
        cu_k = torch.empty(len(lens_k) + 1, device="cuda", dtype=torch.int32)
        o, lse = torch.ops.flash_tutorial.attention_varlen(
            q, k, k.clone(), cu_q, cu_k, None, None, None, True, None, None
        )
        assert o.shape == (tq, H, D) and o.dtype == dtype and o.is_contiguous()
        assert lse.shape == (H, tq) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert o.device == lse.device == q.device
        o2 = ops.attention_varlen(q, k, k, cu_q, cu_k, max_seqlen_q=max(lens_q), window=(8, 8))
        assert o2.shape == (tq, H, D)


def test_meta_tensors_run_the_fake_implementation():
    q = torch.empty(2, 8, 64, 128, device="meta", dtype=BF)
    k = torch.empty(2, 2, 64, 128, device="meta", dtype=BF)
    o, lse = torch.ops.flash_tutorial.attention(q, k, k, None, True, None, None)
    assert o.device.type == "meta" and o.shape == q.shape and lse.shape == (2, 8, 64)


def test_opcheck_on_meta_tensors():
    """opcheck's schema, autograd-registration, fake-tensor and dynamic-shape AOT checks, with
    meta tensors standing for the GPU (the op then runs its fake implementation: this checks the
    registration and the fake under dynamic shapes; the GPU test checks it against the kernel)."""
    q = torch.empty(2, 8, 64, 128, device="meta", dtype=BF)
    k = torch.empty(2, 2, 96, 128, device="meta", dtype=BF)
    res = torch.library.opcheck(ops.attention_op, (q, k, k, None, True, 32, None))
    assert all(v == "SUCCESS" for v in res.values()), res
    qv = torch.empty(10, 4, 64, device="meta", dtype=FP)
    kv = torch.empty(14, 2, 64, device="meta", dtype=FP)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    args = (qv, kv, kv, cu, cu, None, None, 0.2, False, None, None)
    res = torch.library.opcheck(ops.attention_varlen_op, args)
    assert all(v == "SUCCESS" for v in res.values()), res


@pytest.mark.parametrize(
    "shapes,dtype,error,match",
    [
        (((2, 8, 64, 128), (2, 3, 64, 128)), BF, ValueError, "multiple of Hkv"),
        (((2, 8, 64, 96), (2, 8, 64, 96)), BF, ValueError, "head dim D = 96"),
        (((2, 8, 64, 128), (2, 8, 64, 128)), torch.float32, TypeError, "float32"),
        (((2, 8, 64, 128), (3, 8, 64, 128)), BF, ValueError, "batch"),
        (((2, 8, 64, 128), (2, 8, 64, 64)), BF, ValueError, "head dim"),
        (((8, 64, 128), (8, 64, 128)), BF, ValueError, "rank-4"),
        (((0, 8, 64, 128), (0, 8, 64, 128)), BF, ValueError, r"B = q.shape\[0\] = 0"),
        (((2, 0, 64, 128), (2, 2, 64, 128)), BF, ValueError, r"H = q.shape\[1\] = 0"),
        (((2, 8, 0, 128), (2, 8, 64, 128)), BF, ValueError, r"Sq = q.shape\[2\] = 0"),
        (((2, 8, 64, 128), (2, 8, 0, 128)), BF, ValueError, r"Sk = k.shape\[2\] = 0"),
    ],
)
def test_fake_refuses_what_the_kernel_refuses(shapes, dtype, error, match):
    with FakeTensorMode():
        q = torch.empty(shapes[0], device="cuda", dtype=dtype)
        k = torch.empty(shapes[1], device="cuda", dtype=dtype)
        with pytest.raises(error, match=match):
            torch.ops.flash_tutorial.attention(q, k, k, None, False, None, None)


def test_fake_varlen_refuses_no_heads_and_takes_no_tokens():
    """Packed: zero heads is refused, as check_varlen_args refuses it; zero tokens is allowed
    (every sequence empty: the entry returns O = 0 and LSE = -inf without a launch)."""
    with FakeTensorMode():
        cu = torch.zeros(3, device="cuda", dtype=torch.int32)
        q = torch.empty(10, 0, 128, device="cuda", dtype=BF)
        k = torch.empty(10, 2, 128, device="cuda", dtype=BF)
        with pytest.raises(ValueError, match=r"H = q.shape\[1\] = 0"):
            torch.ops.flash_tutorial.attention_varlen(
                q, k, k, cu, cu, None, None, None, False, None, None
            )
        q = torch.empty(0, 4, 128, device="cuda", dtype=BF)
        o, lse = torch.ops.flash_tutorial.attention_varlen(
            q, q, q, cu, cu, None, None, None, False, None, None
        )
        assert o.shape == (0, 4, 128) and lse.shape == (4, 0)


def test_fake_varlen_refuses_bad_cu_seqlens():
    with FakeTensorMode():
        q = torch.empty(10, 4, 128, device="cuda", dtype=BF)
        cu = torch.empty(3, device="cuda", dtype=torch.int64)
        with pytest.raises(TypeError, match="int32"):
            torch.ops.flash_tutorial.attention_varlen(
                q, q, q, cu, cu, None, None, None, False, None, None
            )


def test_reload_keeps_the_ops():
    """The namespace can be defined once per process: a reload of common.ops (Jupyter's
    autoreload) keeps the ops of the first import, which still run its fake and refuse grad."""
    import importlib

    before = ops.attention_op
    module = importlib.reload(ops)
    assert module.attention_op is before is torch.ops.flash_tutorial.attention.default
    assert module.attention_varlen_op is torch.ops.flash_tutorial.attention_varlen.default
    q = torch.empty(2, 8, 64, 128, device="meta", dtype=BF)
    k = torch.empty(2, 2, 64, 128, device="meta", dtype=BF)
    o, lse = torch.ops.flash_tutorial.attention(q, k, k, None, True, None, None)
    assert o.shape == q.shape and lse.shape == (2, 8, 64)
    with pytest.raises(RuntimeError) as e:
        torch.ops.flash_tutorial.attention(q.requires_grad_(), k, k, None, True, None, None)
    assert str(e.value) == grad_message()


# ---------------------------------------------------------------- forward only


@pytest.mark.parametrize("which", ["op", "wrapper"])
def test_grad_refused_with_the_kernels_message(which):
    q = torch.empty(2, 8, 64, 128, device="meta", dtype=BF, requires_grad=True)
    k = torch.empty(2, 2, 64, 128, device="meta", dtype=BF)
    call = (
        (lambda: torch.ops.flash_tutorial.attention(q, k, k, None, True, None, None))
        if which == "op"
        else (lambda: ops.attention(q, k, k, causal=True))
    )
    with pytest.raises(RuntimeError) as e:
        call()
    assert str(e.value) == grad_message()
    with torch.no_grad():
        assert call() is not None
    with torch.inference_mode():
        assert call() is not None


def test_grad_refused_varlen():
    q = torch.empty(10, 4, 128, device="meta", dtype=BF)
    k = torch.empty(12, 2, 128, device="meta", dtype=BF, requires_grad=True)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    for call in (
        lambda: torch.ops.flash_tutorial.attention_varlen(
            q, k, k, cu, cu, None, None, None, False, None, None
        ),
        lambda: ops.attention_varlen(q, k, k, cu, cu),
    ):
        with pytest.raises(RuntimeError, match="argument 'k' requires grad"):
            call()


# ---------------------------------------------------------------- torch.compile on the CPU


def meta_block(heads=8, kv_heads=2, head_dim=128, hidden=512, **kw):
    m = ops.TutorialAttention(hidden, heads, kv_heads, head_dim, **kw)
    return m.to(device="meta", dtype=BF).requires_grad_(False)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_traces_the_op_as_one_node(dynamic):
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward  # runs the graph: on meta tensors, the op's fake implementation

    m = meta_block(causal=True, window=(64, None))
    compiled = torch.compile(m, fullgraph=True, backend=capture, dynamic=dynamic)
    for S in (64, 200):
        y = compiled(torch.empty(2, S, 512, device="meta", dtype=BF))
        assert y.shape == (2, S, 512) and y.dtype == BF
    ops_called = [
        n.target for g in graphs for n in g.graph.nodes if "flash_tutorial" in str(n.target)
    ]
    assert ops_called and all("flash_tutorial.attention" in str(t) for t in ops_called)
    assert len(ops_called) == len(graphs)  # one op node per graph, no graph break
    if dynamic:
        assert len(graphs) == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_backends_on_meta(backend):
    torch._dynamo.reset()
    m = meta_block(heads=4, kv_heads=1, head_dim=64, hidden=256, causal=False)
    y = torch.compile(m, fullgraph=True, backend=backend)(
        torch.empty(3, 50, 256, device="meta", dtype=BF)
    )
    assert y.shape == (3, 50, 256)


def test_compile_with_grad_inputs_raises_the_kernels_error():
    torch._dynamo.reset()
    m = meta_block()
    m.requires_grad_(True)  # projections' outputs require grad: the kernels must refuse
    with pytest.raises(Exception) as e:
        torch.compile(m, fullgraph=True, backend="aot_eager")(
            torch.empty(2, 64, 512, device="meta", dtype=BF)
        )
    assert "requires grad and autograd is on" in str(e.value)


# ---------------------------------------------------------------- GPU


def reference(q, k, v, scale, causal, window):
    """fp32 SDPA with the stage 6 mask (bottom-right aligned), K/V expanded to H heads."""
    from common import masks

    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).float() for t in (k, v))
    Sq, Sk = q.shape[2], k.shape[2]
    mask = masks.visible(Sq, Sk, *masks.resolve_window(causal, window, Sq, Sk), q.device)
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k, v, attn_mask=mask, scale=scale
    )


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("stage", ops.stage_numbers())
def test_opcheck_all(stage):
    results = ops.opcheck_all(stages=[stage], verbose=False)
    assert len(results) == len(ops.opcheck_samples())
    for label, res in results.items():
        assert all(v == "SUCCESS" for v in res.values()), (label, res)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("stage", ops.stage_numbers())
def test_ops_match_the_plain_entries(stage):
    entry = ops.stage_module(stage)
    for label, op, args in ops.opcheck_samples(seed=3):
        if op is ops.attention_op:
            q, k, v, scale, causal, left, right = args
            window = None if left is None and right is None else (left, right)
            want = entry.attention(q, k, v, scale, causal, window, return_lse=True)
        else:
            q, k, v, cu_q, cu_k, mq, mk, scale, causal, left, right = args
            window = None if left is None and right is None else (left, right)
            want = entry.attention_varlen(
                q, k, v, cu_q, cu_k, mq, mk, scale, causal, window, return_lse=True
            )
        with ops.use_stage(stage):
            got = op(*args)
            # The wrappers, which in eager mode call the stage directly (eager_direct).
            assert ops.eager_direct(args[:3])
            if op is ops.attention_op:
                direct = ops.attention(q, k, v, scale, causal, window, return_lse=True)
            else:
                direct = ops.attention_varlen(
                    q, k, v, cu_q, cu_k, mq, mk, scale, causal, window, return_lse=True
                )
        for g, d, w, what in zip(got, direct, want, ("O", "LSE")):
            assert g.shape == w.shape and g.dtype == w.dtype, (label, what)
            assert torch.equal(g, w), (label, what)
            assert torch.equal(d, w), (label, what, "wrapper")


@pytest.mark.gpu_hopper
def test_op_through_the_autograd_fallthrough_on_cuda():
    """Grad mode (inputs that need no grad), no_grad and a dispatch mode (which must see the op)
    reach the kernel through the Autograd key's fallthrough and give the plain entry's answer."""
    label, op, args = next(s for s in ops.opcheck_samples(seed=5) if s[1] is ops.attention_op)
    q, k, v, scale, causal, left, right = args
    window = None if left is None and right is None else (left, right)
    want = ops._stage().attention(q, k, v, scale, causal, window, return_lse=True)
    runs = {"grad mode": op(*args)}
    with torch.no_grad():
        runs["no_grad"] = op(*args)
    mode = RecordOps()
    with torch.no_grad(), mode:
        runs["dispatch mode"] = op(*args)
    assert op in mode.seen, mode.seen
    for how, got in runs.items():
        for g, w, what in zip(got, want, ("O", "LSE")):
            assert torch.equal(g, w), (label, how, what)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_function_matches_eager(dynamic):
    torch._dynamo.reset()

    def f(q, k, v):
        o, lse = torch.ops.flash_tutorial.attention(q, k, v, None, True, None, None)
        return o * 2, lse + 1  # something around the op for inductor to fuse

    cf = torch.compile(f, fullgraph=True, dynamic=dynamic)
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    # (B, H, Hkv, Sq, Sk, D); the last a decode step that stages 13 on split (the op returns its
    # LSE, a tensor of its own)
    shapes = ((2, 32, 8, 512, 512, 128), (1, 8, 2, 300, 300, 64), (1, 32, 8, 1, 1000, 128))
    for B, H, Hkv, Sq, Sk, D in shapes:
        q = torch.randn(B, H, Sq, D, generator=g, device="cuda").to(BF)
        k, v = (torch.randn(B, Hkv, Sk, D, generator=g, device="cuda").to(BF) for _ in range(2))
        with torch.no_grad():
            want, got = f(q, k, v), cf(q, k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu_hopper
def test_compiled_module_matches_eager_and_sdpa():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = ops.TutorialAttention(1024, 8, 2, 128, causal=True).to("cuda", BF).requires_grad_(False)
    cm = torch.compile(m, fullgraph=True)
    x = torch.randn(2, 512, 1024, device="cuda").to(BF)
    with torch.no_grad():
        eager, compiled = m(x), cm(x)
        B, S, _ = x.shape
        q = m.q_proj(x).view(B, S, 8, 128).transpose(1, 2)
        k = m.k_proj(x).view(B, S, 2, 128).transpose(1, 2)
        v = m.v_proj(x).view(B, S, 2, 128).transpose(1, 2)
        o = reference(q, k, v, 128**-0.5, True, None).to(BF)
        ref = m.o_proj(o.transpose(1, 2).reshape(B, S, 1024)).float()
    for name, y in (("eager", eager), ("compiled", compiled)):
        rel = ((y.float() - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, (name, rel)
    rel = ((compiled.float() - eager.float()).norm() / eager.float().norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.gpu_hopper
def test_grad_refused_on_cuda_before_and_after_launch():
    q = torch.randn(1, 4, 128, 128, device="cuda", dtype=BF, requires_grad=True)
    k = torch.randn(1, 2, 128, 128, device="cuda", dtype=BF)
    for call in (
        lambda: ops.attention(q, k, k),
        lambda: torch.ops.flash_tutorial.attention(q, k, k, None, False, None, None),
    ):
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value) == grad_message()


# ---------------------------------------------------------------- the two paths agree


class CheckingStage:
    """A stand-in for the stage's entries that checks its arguments as attention_host does
    (masks.check_mask_args, return_lse a bool) and computes with traced torch ops."""

    def attention(self, q, k, v, scale=None, causal=False, window=None, return_lse=False):
        if not isinstance(return_lse, bool):
            raise TypeError(
                f"argument 'return_lse': expected a bool, got {type(return_lse).__name__}"
            )
        masks.check_mask_args(causal, window)
        o = q * 1.0
        lse = q.float().sum(-1)
        return (o, lse) if return_lse else o


def small_qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 64, generator=g).bfloat16()
    k = torch.randn(1, 1, 3, 64, generator=g).bfloat16()
    return q, k, k.clone()


def test_jit_trace_records_the_op_not_the_direct_call(monkeypatch):
    """Inside torch.jit.trace the wrappers take the op: the tracer records only dispatcher ops,
    and the direct path's launch goes through TVM-FFI, which it never sees (the trace would hold
    the output's allocation and not the kernel)."""
    direct = ops.eager_direct
    monkeypatch.setattr(ops, "eager_direct", lambda ts: direct(ts, device_type="cpu"))
    monkeypatch.setattr(ops, "_stage", CheckingStage)
    q, k, v = small_qkv()
    seen = []

    def probe(q, k, v):
        seen.append(ops.eager_direct((q, k, v)))
        return q

    torch.jit.trace(probe, (q, k, v), check_trace=False)
    assert seen == [False], "eager_direct takes the direct path inside torch.jit.trace"
    traced = torch.jit.trace(lambda q, k, v: ops.attention(q, k, v), (q, k, v), check_trace=False)
    assert "flash_tutorial::attention" in str(traced.graph)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(causal=1), "causal"),
        (dict(window=(True, None)), "window"),
        (dict(return_lse=1), "return_lse"),
    ],
)
def test_op_path_refuses_what_the_direct_path_refuses(monkeypatch, kwargs, name):
    """The wrappers check causal, window and return_lse before choosing a path: the op's schema
    would turn causal=1 into True and window=(True, None) into (1, None), which the stages
    refuse, so the same call would fail in eager mode and run under torch.compile."""
    monkeypatch.setattr(ops, "_stage", CheckingStage)
    q, k, v = small_qkv()
    direct = ops.eager_direct
    # The direct path (CPU tensors standing in for CUDA ones): the stage's own TypeError.
    monkeypatch.setattr(ops, "eager_direct", lambda ts: direct(ts, device_type="cpu"))
    with pytest.raises(TypeError, match=name):
        ops.attention(q, k, v, **kwargs)
    # The op path (what torch.compile and tensor subclasses get): the same call must fail alike.
    monkeypatch.setattr(ops, "eager_direct", lambda ts: False)
    with pytest.raises(TypeError, match=name):
        ops.attention(q, k, v, **kwargs)
