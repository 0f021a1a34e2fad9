"""The latest stage's attention entry points as PyTorch custom ops, so that a model can call them
inside `torch.compile(fullgraph=True)` and PyTorch knows their output shapes without running them.

    torch.ops.flash_tutorial.attention(q, k, v, scale, causal, window_left, window_right)
        -> (o, lse)    q (B, H, Sq, D), k and v (B, Hkv, Sk, D); o (B, H, Sq, D), lse (B, H, Sq) fp32
    torch.ops.flash_tutorial.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, scale, causal, window_left, window_right)
        -> (o, lse)    q (total_q, H, D), k and v (total_k, Hkv, D); o (total_q, H, D), lse (H, total_q)

Which stage runs: the latest one with stage 7's API (`attention(..., causal, window, return_lse)`
with K/V of Hkv heads, and `attention_varlen`), which is stage 14 (the paged KV cache, whose
unpaged entries are stage 13's split-KV launch); the environment variable FLASH_TUTORIAL_STAGE=7
or `with use_stage(7):` pins another of stages 7-14. use_stage is read at each call, so also
inside a compiled graph; the variable is read at the first call in a process (a read of the
environment costs 0.18-0.50 us on a CPU-only machine, 2026-12-07,
docs/results/os_environ_get_cpu_2026-12-07.md, which every layer of a decode step would pay),
and again by `read_stage_env()` after a running process changes it. The stage's package is imported on the
first real call, so importing this module needs neither a GPU nor the CuTe DSL. Each op has a
fake implementation (`register_fake`: shapes, dtypes and devices from the inputs' metadata alone)
which FakeTensorMode, meta tensors and torch.compile's tracing use instead of the kernel.
`window_left` / `window_right` are the two sides of the stages' `window=(left, right)` (None:
unbounded on that side); causal and window follow stage 6 (bottom-right aligned).

Forward only: there is no autograd formula. Calling an op with an input that requires grad while
grad mode is on raises the kernels' own error (common.checks.check_inference_only) before
anything is launched, through the Python wrappers below and through the op's kernels when
torch.ops is called directly. Use them under torch.no_grad() / torch.inference_mode().

The ops are defined with torch.library.Library (schema, a CompositeExplicitAutograd kernel that
refuses grad and calls the stage, a fallthrough at the Autograd key, the fake implementation),
not with the torch.library.custom_op decorator: the decorator's layers (a wrapper that turns
Dynamo off around each call, an output-aliasing check, an autograd.Function) cost a call through
torch.ops several microseconds of host time, which a decode step pays per layer. The
fallthrough (torch.library.fallthrough_kernel) lets the dispatcher go on past the Autograd key
in C++, under torch.no_grad() as under torch.inference_mode(), instead of calling Python there:
a Python Autograd kernel cost each call under no_grad about 1.4 us more (NVIDIA H100 80GB HBM3,
2026-12-06). With no autograd formula, grad is refused below it, by the kernels and the fake
implementations, which still see grad mode and requires_grad. The namespace can be defined once per
process, so a second import of this file (importlib.reload, Jupyter's autoreload) keeps the ops
the first one defined.

The wrappers `attention` and `attention_varlen` (what a model should call) take the op while
torch.compile traces, and call the stage directly in eager mode on plain CUDA tensors
(`eager_direct`), where the op's dispatch would only add host time.

`TutorialAttention` is a GQA self-attention block (projections, the op, the output projection)
that torch.compile(fullgraph=True) traces without a graph break; `opcheck_all()` runs
torch.library.opcheck on representative GPU inputs (GQA, causal, window, packed sequences)."""

import contextlib
import functools
import importlib
import os

import torch
from torch import nn

from common import checks, masks

NAMESPACE = "flash_tutorial"
STAGE_ENV = "FLASH_TUTORIAL_STAGE"
FIRST_STAGE = 7  # the first stage with GQA, masks and packed sequences (the ops' API)
HEAD_DIMS = (64, 128)
_pinned = []  # use_stage's stack


@functools.lru_cache(maxsize=None)
def _stage_numbers():
    """Every stage with the ops' API (attention with Hkv heads, attention_varlen), in order."""
    from common.tools import stage_table as table

    out = []
    for st in table.STAGES:
        if st.number >= FIRST_STAGE:
            mod = importlib.import_module(f"stages.{st.package}")
            if hasattr(mod, "attention") and hasattr(mod, "attention_varlen"):
                out.append(st.number)
    return tuple(out)


def stage_numbers():
    """Every stage with the ops' API (attention with Hkv heads, attention_varlen), in order."""
    return list(_stage_numbers())


_env_stage = []  # FLASH_TUTORIAL_STAGE as read_stage_env found it: [stage number or None]


def read_stage_env():
    """Read FLASH_TUTORIAL_STAGE (again) and return the stage it names, or None when it is unset.
    current_stage() calls this once per process; call it after changing the variable in a
    running process."""
    _env_stage.clear()
    env = os.environ.get(STAGE_ENV)
    n = None
    if env:
        n = int(env)
        if n not in _stage_numbers():
            raise ValueError(f"{STAGE_ENV}={env}: stages with the ops' API are {stage_numbers()}")
    _env_stage.append(n)
    return n


def current_stage():
    """The stage number the ops run now: use_stage's, else FLASH_TUTORIAL_STAGE, else the latest."""
    if _pinned:
        return _pinned[-1]
    n = _env_stage[0] if _env_stage else read_stage_env()
    return n or _stage_numbers()[-1]


@contextlib.contextmanager
def use_stage(n):
    """Run the ops on stage n inside the block (e.g. to compare stages in one model)."""
    if n not in stage_numbers():
        raise ValueError(f"stage {n}: stages with the ops' API are {stage_numbers()}")
    _pinned.append(n)
    try:
        yield
    finally:
        _pinned.pop()


_STAGE_MODULES = {}  # stage number -> its package: the lookup is on every call's path


def stage_module(n=None):
    """The package stages.<stage n> (default: current_stage()), which dispatches to the track."""
    n = n or current_stage()
    mod = _STAGE_MODULES.get(n)
    if mod is None:
        from common.tools import stage_table as table

        mod = _STAGE_MODULES[n] = importlib.import_module(f"stages.{table.stage(n).package}")
    return mod


_TRACK_FILES = {}  # stage number -> its track file, for _stage


def _stage():
    """The current stage's track file (hopper.py or blackwell.py), whose entries the wrappers and
    the ops call: the package's own entries only forward to it, a call more on every call's path."""
    n = current_stage()
    mod = _TRACK_FILES.get(n)
    if mod is None:
        mod = _TRACK_FILES[n] = stage_module(n)._track_module()
    return mod


def _window(window_left, window_right):
    return None if window_left is None and window_right is None else (window_left, window_right)


# ------------------------------------------------------------------ metadata checks (fake impls)


def _check_meta(q, k, v, rank):
    """What the fake implementations can check without data: ranks, dtypes, one device, the head
    grouping and the head dim. The real kernels check all of this and more (strides, alignment,
    CUDA, cu_seqlens); the fake ones keep a trace from accepting a call the kernel refuses."""
    refuse_grad(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(
                f"argument '{name}': expected a rank-{rank} tensor, got shape {tuple(t.shape)}"
            )
        if t.dtype not in checks.HALF_DTYPES:
            raise TypeError(
                f"argument '{name}': dtype {str(t.dtype).replace('torch.', '')} is not supported; "
                "allowed: bfloat16, float16"
            )
    checks.check_same_dtype(("q", "k", "v"), (q, k, v))
    checks.check_same_device(("q", "k", "v"), (q, k, v))
    # Heads are dimension 1 in both layouts: (B, H, S, D) and (total, H, D).
    checks.check_head_groups(q.shape[1], k.shape[1])
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(
            f"arguments 'k' and 'v' must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"head dim: q.shape[-1] = {q.shape[-1]} must equal k.shape[-1] = {k.shape[-1]}"
        )
    checks.check_choice(
        "head dim D", q.shape[-1], HEAD_DIMS, "the tile configuration is specialised per head dim"
    )
    # Empty dimensions, refused by the kernels' checks (TMA cannot describe an empty tensor);
    # packed sequences may be empty, their heads may not.
    sizes = (("B = q.shape[0]", q.shape[0]),) if rank == 4 else ()
    sizes += (("H = q.shape[1]", q.shape[1]),)
    if rank == 4:
        sizes += (("Sq = q.shape[2]", q.shape[2]), ("Sk = k.shape[2]", k.shape[2]))
    for name, size in sizes:
        checks.check_positive(name, size)


# The Library that defines the ops, kept alive (the ops live as long as it does). A second run
# of this file in the same module (importlib.reload, Jupyter's autoreload) finds it here.
_lib = globals().get("_lib")


def _define(schema, kernel, fake):
    """Define op `schema` with `kernel` for every device (CompositeExplicitAutograd), its fake
    implementation, and a fallthrough at the Autograd key: the dispatcher goes on to the fake
    (fake or meta tensors), to a subclass's or a dispatch mode's handler, or to `kernel`, with
    no Python call on the way. Both `kernel` and `fake` refuse inputs that require grad under
    grad mode (refuse_grad). Returns the op's OpOverload
    (torch.ops.flash_tutorial.<name>.default)."""
    global _lib
    name = schema.split("(")[0]
    namespace = getattr(torch.ops, NAMESPACE)
    if hasattr(namespace, name):
        # Defined by an earlier import of this file in this process (a reload, or the file
        # imported under a second name): the namespace can be defined only once, so that op
        # stays, and its kernels read this module's names when they run.
        return getattr(namespace, name).default
    if _lib is None:
        _lib = torch.library.Library(NAMESPACE, "DEF")
    _lib.define(schema)
    _lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_lib)
    _lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
    return getattr(namespace, name).default


def refuse_grad(q, k, v):
    """The kernels' error for an input that requires grad while grad mode is on (their output
    would come back detached): the ops' kernels and fakes run it first, below the Autograd key's
    fallthrough, where grad mode and requires_grad are what the caller set."""
    if torch.is_grad_enabled():
        checks.check_inference_only(("q", "k", "v"), (q, k, v), "this attention kernel")


# ------------------------------------------------------------------ batch layout


def _attention_kernel(q, k, v, scale, causal, window_left, window_right):
    """(O, LSE) of the current stage's attention: q (B, H, Sq, D), k and v (B, Hkv, Sk, D),
    H % Hkv == 0, bf16/fp16, D in {64, 128}. O (B, H, Sq, D) contiguous, LSE (B, H, Sq) fp32.
    Forward only."""
    refuse_grad(q, k, v)
    return _stage().attention(
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        window=_window(window_left, window_right),
        return_lse=True,
    )


def _attention_fake(q, k, v, scale, causal, window_left, window_right):
    _check_meta(q, k, v, rank=4)
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"batch: 'q'.shape[0] = {q.shape[0]} must equal 'k'.shape[0] = {k.shape[0]}"
        )
    B, H, Sq, D = q.shape
    # The kernel allocates both outputs contiguous, whatever the strides of q.
    return q.new_empty((B, H, Sq, D)), q.new_empty((B, H, Sq), dtype=torch.float32)


attention_op = _define(
    "attention(Tensor q, Tensor k, Tensor v, float? scale, bool causal, SymInt? window_left, "
    "SymInt? window_right) -> (Tensor, Tensor)",
    _attention_kernel,
    _attention_fake,
)


# ------------------------------------------------------------------ packed sequences


def _attention_varlen_kernel(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    causal,
    window_left,
    window_right,
):
    """(O, LSE) of the current stage's packed-sequence attention: q (total_q, H, D), k and v (total_k, Hkv,
    D), int32 cu_seqlens of batch + 1 offsets. O (total_q, H, D), LSE (H, total_q) fp32. Forward
    only. The kernel reads cu_seqlens to the host to check them (one small copy per call)."""
    refuse_grad(q, k, v)
    return _stage().attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        scale=scale,
        causal=causal,
        window=_window(window_left, window_right),
        return_lse=True,
    )


def _attention_varlen_fake(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    causal,
    window_left,
    window_right,
):
    _check_meta(q, k, v, rank=3)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise TypeError(
                f"argument '{name}': expected a rank-1 int32 tensor, got "
                f"{str(cu.dtype).replace('torch.', '')} of shape {tuple(cu.shape)}"
            )
    total_q, H, D = q.shape
    return q.new_empty((total_q, H, D)), q.new_empty((H, total_q), dtype=torch.float32)


attention_varlen_op = _define(
    "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "SymInt? max_seqlen_q, SymInt? max_seqlen_k, float? scale, bool causal, SymInt? window_left, "
    "SymInt? window_right) -> (Tensor, Tensor)",
    _attention_varlen_kernel,
    _attention_varlen_fake,
)


# ------------------------------------------------------------------ Python wrappers


def _split_window(window):
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(
            f"argument 'window': expected None or a pair (left, right) of ints or None, got "
            f"{window!r}"
        )
    return window[0], window[1]


def eager_direct(tensors, device_type="cuda"):
    """Whether a wrapper call may go straight to the stage's function instead of through the
    custom op. The op's eager path (the dispatcher and the op's Python kernel) adds host time
    per call (24.4 us back to back through torch.ops against 20.6 for the wrapper's direct
    call, NVIDIA H100 80GB HBM3, 2026-12-07: docs/results/README.md, host work per call) and nothing else to an eager call on plain CUDA tensors. So the wrappers skip it only then: not while torch.compile or
    torch.jit.trace traces (the op is what the graph must hold; a trace would record the
    output's allocation and not the launch, which does not go through the dispatcher), not under a dispatch mode, a torch-function mode or a
    functorch transform (FakeTensorMode, FlopCounterMode, vmap: they must see the op), and only
    for tensors of type torch.Tensor on `device_type` (fake, meta and subclass tensors take the
    op). Both ways run the same kernel on the same arguments."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    # (is_cuda is a flag read; t.device builds a device object, a measurable part of a call)
    cuda = device_type == "cuda"
    for t in tensors:
        if type(t) is not torch.Tensor:
            return False
        if not (t.is_cuda if cuda else t.device.type == device_type):
            return False
    return True


def _check_options(causal, window, return_lse, scale, max_seqlen_q=None, max_seqlen_k=None):
    """The options' types, checked before either path: the op's schema would turn causal=1 into
    True, window=(True, None) into (1, None), scale=True into 1.0 and max_seqlen_k=True or
    numpy.int64(3) into an int, where the stages refuse each."""
    masks.check_mask_args(causal, window)
    if not isinstance(return_lse, bool):
        raise TypeError(f"argument 'return_lse': expected a bool, got {type(return_lse).__name__}")
    checks.check_scale_type(scale)
    checks.check_optional_int("max_seqlen_q", max_seqlen_q)
    checks.check_optional_int("max_seqlen_k", max_seqlen_k)


def attention(q, k, v, scale=None, causal=False, window=None, return_lse=False):
    """The stages' `attention` signature through the custom op (what a model should call). Refuses
    inputs that require grad under grad mode before launching anything. An eager call on plain
    CUDA tensors calls the stage directly (eager_direct): the same kernel, without the op's host
    time."""
    checks.check_inference_only(("q", "k", "v"), (q, k, v), "this attention kernel")
    _check_options(causal, window, return_lse, scale)
    if eager_direct((q, k, v)):
        return _stage().attention(
            q, k, v, scale=scale, causal=causal, window=window, return_lse=return_lse
        )
    left, right = _split_window(window)
    o, lse = attention_op(q, k, v, scale, causal, left, right)
    return (o, lse) if return_lse else o


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
):
    """The stages' `attention_varlen` signature through the custom op (eager calls on plain CUDA
    tensors: directly, as attention's)."""
    checks.check_inference_only(("q", "k", "v"), (q, k, v), "this attention kernel")
    _check_options(causal, window, return_lse, scale, max_seqlen_q, max_seqlen_k)
    if eager_direct((q, k, v, cu_seqlens_q, cu_seqlens_k)):
        return _stage().attention_varlen(
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
        )
    left, right = _split_window(window)
    o, lse = attention_varlen_op(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, left, right
    )
    return (o, lse) if return_lse else o


# ------------------------------------------------------------------ a module to compile


class TutorialAttention(nn.Module):
    """GQA self-attention, x (B, S, hidden) -> (B, S, hidden): q/k/v projections to H query and
    Hkv KV heads of head_dim, the tutorial kernel through the custom op (no repeat of K/V), the
    output projection. `torch.compile(module, fullgraph=True)` traces it in one graph: the op is
    one opaque node whose output shapes come from its fake implementation."""

    def __init__(self, hidden, heads, kv_heads, head_dim=128, causal=True, window=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.causal = causal
        self.window_left, self.window_right = _split_window(window)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def attend(self, q, k, v):
        """(B, H, S, D) q and (B, Hkv, S, D) k, v -> (B, H, S, D): the op alone (traced as the
        op; eager, the wrapper's direct call)."""
        window = _window(self.window_left, self.window_right)
        return attention(q, k, v, causal=self.causal, window=window)

    def forward(self, x):
        B, S, _ = x.shape
        # (B, S, H*D) -> (B, H, S, D) views: D contiguous, as the kernel needs.
        q = self.q_proj(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        o = self.attend(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.heads * self.head_dim))


# ------------------------------------------------------------------ opcheck on the GPU


def _randn(shape, dtype, g):
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def opcheck_samples(seed=0):
    """[(label, op, args)]: representative GPU inputs for opcheck: GQA 4:1 and MQA, causal with
    Sq != Sk, a sliding window, D = 64 fp16, decode steps (split from stage 13 on), a (B, S, H,
    D) memory layout seen as (B, H, S, D), and packed sequences (a zero-length and a one-token
    sequence, lengths not tile multiples)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    bf, fp = torch.bfloat16, torch.float16
    out = []

    def batch(label, B, H, Hkv, Sq, Sk, D, dtype, scale, causal, left, right):
        q = _randn((B, H, Sq, D), dtype, g)
        k, v = (_randn((B, Hkv, Sk, D), dtype, g) for _ in range(2))
        out.append((label, attention_op, (q, k, v, scale, causal, left, right)))

    batch("GQA 8/2 non-causal", 2, 8, 2, 256, 256, 128, bf, None, False, None, None)
    batch("GQA 8/2 causal Sq<Sk", 2, 8, 2, 200, 333, 128, bf, None, True, None, None)
    batch("MQA window (64, 16)", 1, 4, 1, 300, 300, 128, bf, 0.1, False, 64, 16)
    batch("GQA 4/2 causal window left 96, D=64 fp16", 2, 4, 2, 257, 257, 64, fp, None, True, 96, 0)
    # A decode step the launch splits (stage 13 on: 8 KV tiles, 8 work tiles): its LSE lies in
    # the partials' buffer, and must still look like the fake implementation's fresh tensor.
    batch("decode step, split KV", 1, 32, 8, 1, 1000, 128, bf, None, True, None, None)
    # The layout a model produces: (B, S, H, D) memory, transposed to (B, H, S, D).
    q = _randn((2, 256, 8, 128), bf, g).transpose(1, 2)
    k, v = (_randn((2, 256, 2, 128), bf, g).transpose(1, 2) for _ in range(2))
    out.append(("GQA causal, (B, S, H, D) memory", attention_op, (q, k, v, None, True, None, None)))

    def packed(label, lens_q, lens_k, H, Hkv, D, dtype, causal, left, right):
        q = _randn((sum(lens_q), H, D), dtype, g)
        k, v = (_randn((sum(lens_k), Hkv, D), dtype, g) for _ in range(2))
        cu = lambda lens: torch.tensor(  # noqa: E731
            [0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda"
        )
        args = (q, k, v, cu(lens_q), cu(lens_k), None, None, None, causal, left, right)
        out.append((label, attention_varlen_op, args))

    packed(
        "varlen GQA 8/2 causal", [100, 0, 257, 1], [100, 0, 257, 1], 8, 2, 128, bf, True, None, None
    )
    packed("varlen GQA 4/1 Sq!=Sk", [64, 130, 7], [200, 130, 300], 4, 1, 128, bf, False, None, None)
    packed("varlen window D=64 fp16", [150, 90], [150, 90], 4, 2, 64, fp, False, 32, 32)
    packed("varlen decode, split KV", [1, 1], [700, 1500], 32, 8, 128, bf, True, None, None)
    return out


def opcheck_all(stages=None, verbose=True):
    """torch.library.opcheck on every sample of opcheck_samples(), for each stage in `stages`
    (default: every stage with the ops' API, stage_numbers()); needs a GPU of the Hopper track.
    Raises on the first failure; returns {(stage, label): opcheck's result dict}."""
    results = {}
    for n in stage_numbers() if stages is None else stages:
        with use_stage(n):
            for label, op, args in opcheck_samples():
                if verbose:
                    print(f"opcheck stage {n}: {label} ...", flush=True)
                res = torch.library.opcheck(op, args)
                bad = {k: v for k, v in res.items() if v != "SUCCESS"}
                if bad:
                    raise AssertionError(f"opcheck stage {n}, {label}: {bad}")
                results[(n, label)] = res
                if verbose:
                    print(f"  {res}", flush=True)
    if verbose:
        print(f"opcheck: all {len(results)} (stage, sample) pairs pass", flush=True)
    return results
