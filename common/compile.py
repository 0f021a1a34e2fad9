"""Compiling stages: a cache for real launches keyed by what the compiled code assumes, and compile-only reports that need no
GPU (fake tensors, any target arch), with counts of the instructions each stage is about."""

import dataclasses
import inspect
import os
import re
import shutil
import subprocess
import tempfile
import time

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import _Tensor as CuteRuntimeTensor

from . import stages
from .arch import ARCH_OF_TRACK

_CACHE = {}

# What a compiled kernel assumes, and how the cache keeps every launch inside it.
#
# cute.compile(kernel, *args) traces the kernel against the *types* of its arguments: for a CuTe
# tensor that is its element type, its assumed pointer alignment and its layout, in which every
# extent and stride is either a run-time value ("?") or a constant folded into the code. A
# compiled kernel is therefore valid exactly for arguments whose types are the same. The cache
# key is built from those types, never from a hand-written tuple, case by case:
#
# | what the code assumes                         | how it is kept                              |
# | --------------------------------------------- | ------------------------------------------- |
# | element type, assumed alignment (16 bytes)    | in the key (arg_signature); the alignment   |
# |                                               | is also checked on every call (check_tensor)|
# | static extents and strides (Hopper stage 1's  | in the key: the layout type as the DSL      |
# | static GEMM layouts, Blackwell's static ones) | prints it, "?" for run-time values          |
# | a stride of 0 (K, V from .expand over heads   | in the key: 0 stays a static 0 even in a    |
# | or batch): the mode is folded, TMA reads one  | "dynamic" layout, so an expanded K/V gets   |
# | head for all                                  | its own kernel (needed again by GQA)        |
# | a stride of 0 anywhere else (q, o, or along   | refused by check_tensor with the argument's |
# | S or D): a broadcast TMA tile is not taught   | name: call .contiguous()                    |
# | the stride of a size-1 mode (B = 1, H = 1,    | normalised by to_cute: the index there is   |
# | Sq = 1): any value addresses the same bytes,  | always 0, so the stride is replaced by a    |
# | but torch leaves arbitrary ones (0, 1, ...)   | canonical non-zero multiple of 16 bytes and |
# |                                               | B = 1 shares the kernel of B = 2            |
# | the kernel's configuration (tile sizes, slots,| in the key: the class object itself and     |
# | warp roles; causal / window of later stages)  | every attribute its __init__ set, by value  |
# |                                               | (a reloaded module compiles anew)           |
# | Python constants among the arguments          | in the key, by value                        |
# | run-time scalars (annotated cutlass.Float32,  | not in the key: passed at every launch      |
# | Int32 ...: the softmax scale) and the stream  |                                             |
# | the device the module was loaded on           | in the key (torch.cuda.current_device())    |


def kernel_config(kernel):
    """The configuration a kernel object was built with: its class and every attribute, by value."""
    return (type(kernel), tuple(sorted((k, repr(v)) for k, v in vars(kernel).items())))


_PARAMS = {}


def _call_params(kernel):
    """(parameter names of kernel.__call__ without self, names annotated with a cutlass numeric
    type: values passed at run time, which the compiled code does not depend on). Read once per
    class (inspect.signature costs ~40 us, more than a small kernel's launch)."""
    cls = type(kernel)
    got = _PARAMS.get(cls)
    if got is None:
        params = inspect.signature(cls.__call__).parameters
        names = [n for n in params if n != "self"]
        runtime = {
            n
            for n, p in params.items()
            if isinstance(p.annotation, type) and issubclass(p.annotation, cutlass.Numeric)
        }
        got = _PARAMS[cls] = (names, runtime)
    return got


def tensor_signature(t):
    """The type of a CuTe runtime tensor as the compiled code sees it: element type, assumed
    alignment and layout, e.g. ('BFloat16', 16, '(?,?,?,?):(?{i64},0,?{i64},1)') for an expanded
    K. The pointer value is not part of it."""
    text = re.sub(r"^Tensor<0x[0-9a-fA-F]+@", "Tensor<@", str(t))
    return (str(t.element_type), getattr(t, "_assumed_align", None), text)


def arg_signature(kernel, args):
    """One entry per argument of kernel.__call__: the tensor signature, 'runtime <type>' for
    run-time scalars and the stream, the value itself for anything else (a Python constant)."""
    names, runtime = _call_params(kernel)
    sig = []
    for i, a in enumerate(args):
        name = names[i] if i < len(names) else f"arg{i}"
        if isinstance(a, CuteRuntimeTensor):
            sig.append((name, "tensor", *tensor_signature(a)))
        elif name in runtime or type(a).__name__ == "CUstream":
            sig.append((name, "runtime", type(a).__name__))
        else:
            sig.append((name, "constant", type(a).__name__, repr(a)))
    return tuple(sig)


def compile_key(kernel, args):
    """Everything the code compiled for (kernel, args) depends on; see the table above."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return (kernel_config(kernel), arg_signature(kernel, args), device)


def cached_compile(kernel, *args):
    """cute.compile(kernel, *args), once per compile_key(kernel, args): a compiled kernel only
    ever runs on arguments of the types it was compiled for."""
    key = compile_key(kernel, args)
    fn = _CACHE.get(key)
    if fn is None:
        fn = cute.compile(kernel, *args)
        _CACHE[key] = fn
    return fn


# The TVM-FFI launch (stages 7-9). cute.compile(..., options="--enable-tvm-ffi") against fake
# tensors gives a function that takes the torch tensors themselves and launches on the caller's
# current stream: no CuTe views, no argument conversion in Python at each call (host work per
# call on the H200, 2026-12-01: 385 us with views, 163 us this way; docs/results/h200.md). The
# key is the same as compile_key's for the views the old path built (to_cute(t, dynamic=True) of
# canonical_strides(t)):
# the element type, the rank and the static parts of the layout, which for a dynamic layout are
# exactly its strides of 0 and its last stride (tests/test_compile_cache.py compares the two keys
# on a set of layouts). The alignment assumed is 16 bytes, as check_tensor makes sure.


def ffi_tensor_signature(t):
    """What a dynamic-layout kernel compiled through TVM-FFI assumes of torch tensor t: element
    type, rank, and its strides with every non-zero one but the last a run-time value."""
    stride = t.stride()
    strides = tuple([0 if s == 0 else "?" for s in stride[:-1]]) + stride[-1:]
    return (str(t.dtype), len(stride), strides)


def ffi_compile_key(kernel, args):
    """cached_compile_ffi's key: the kernel's configuration, one entry per argument (tensor
    signature, 'runtime <type>', or a constant's value) and the device."""
    names, runtime = _call_params(kernel)
    sig = []
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            sig.append((name, "tensor", *ffi_tensor_signature(a)))
        elif name in runtime:
            sig.append((name, "runtime", type(a).__name__))
        else:
            sig.append((name, "constant", type(a).__name__, repr(a)))
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return ("tvm-ffi", kernel_config(kernel), tuple(sig), device)


def cached_compile_ffi(kernel, *args):
    """cute.compile(kernel, ...) through TVM-FFI, once per key: `args` are kernel.__call__'s
    arguments without the stream, torch tensors (canonical strides, common.cute_interop), None,
    run-time scalars and constants; the returned function is called with the same `args`."""
    from .cute_interop import fake_like, fake_stream

    key = ffi_compile_key(kernel, args)
    fn = _CACHE.get(key)
    if fn is None:
        fakes = [fake_like(a) if isinstance(a, torch.Tensor) else a for a in args]
        try:
            import tvm_ffi  # noqa: F401
        except ImportError:
            raise ImportError(
                "stages 7-9 launch through TVM-FFI: pip install apache-tvm-ffi "
                "(requirements.txt lists it)"
            ) from None
        fn = cute.compile(kernel, *fakes, fake_stream(env=True), options="--enable-tvm-ffi")
        _CACHE[key] = fn
    return fn


def compile_ffi_for_arch(kernel, args, arch):
    """What cached_compile_ffi compiles, for `arch` and without a GPU (args: CPU torch tensors
    with the layouts of a launch, None and scalars): the TVM-FFI function object. The compile-only
    check of the launch path on both tracks (tests/test_compile_cache.py)."""
    from .cute_interop import fake_like, fake_stream

    fakes = [fake_like(a) if isinstance(a, torch.Tensor) else a for a in args]
    with _ArchOverride(arch):
        return cute.compile(
            kernel, *fakes, fake_stream(env=True), options=f"--enable-tvm-ffi --gpu-arch {arch}"
        )


def clear_cache():
    """Forget every compiled kernel (the next launch of each compiles again)."""
    _CACHE.clear()


def cache_size():
    return len(_CACHE)


# Instruction families counted in the PTX; the regex matches at the start of a statement.
PTX_PATTERNS = {
    "wgmma.mma_async": r"wgmma\.mma_async",
    "wgmma.fence": r"wgmma\.fence",
    "wgmma.commit_group": r"wgmma\.commit_group",
    "wgmma.wait_group": r"wgmma\.wait_group",
    "tcgen05.mma": r"tcgen05\.mma",
    "tcgen05.ld": r"tcgen05\.ld",
    "tcgen05.st": r"tcgen05\.st",
    "tcgen05.alloc": r"tcgen05\.alloc",
    "tcgen05.dealloc": r"tcgen05\.dealloc",
    "tcgen05.commit": r"tcgen05\.commit",
    "cp.async.bulk.tensor (load)": r"cp\.async\.bulk\.tensor\.\dd\.shared::(?:cta|cluster)\.global",
    "cp.async.bulk.tensor (store)": r"cp\.async\.bulk\.tensor\.\dd\.global\.shared",
    "mbarrier.init": r"mbarrier\.init",
    "mbarrier.arrive": r"mbarrier\.arrive",
    "mbarrier.try_wait": r"mbarrier\.try_wait",
    "shfl.sync": r"shfl\.sync",
    "ex2.approx": r"ex2\.approx",
    "bar.sync": r"(?:bar|barrier)\.sync",
}


def count_ptx(ptx):
    """{family: number of statements} over the PTX text."""
    stmts = [ln.strip() for ln in ptx.splitlines()]
    stmts = [re.sub(r"^@!?%p\d+\s+", "", s) for s in stmts if s and not s.startswith("//")]
    counts = {}
    for name, pat in PTX_PATTERNS.items():
        rx = re.compile(pat)
        counts[name] = sum(1 for s in stmts if rx.match(s))
    return counts


def expect_tx_immediates(ptx):
    """The byte count armed by each mbarrier.arrive.expect_tx, in PTX order. The PTX moves the
    count into a register first (`mov.b32 %r7, 32768;`); a count that is not such an immediate
    is None."""
    out = []
    for reg in re.findall(
        r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+\S+,\s*\[[^\]]+\],\s*(%r\d+);", ptx
    ):
        m = re.search(r"mov\.[bus]32\s+" + re.escape(reg) + r",\s*(\d+);", ptx)
        out.append(int(m.group(1)) if m else None)
    return out


def ptx_lines(ptx, pattern, limit=8):
    """Up to `limit` PTX statements matching `pattern` (for notebooks and test messages)."""
    rx = re.compile(pattern)
    return [ln.strip() for ln in ptx.splitlines() if rx.search(ln)][:limit]


# A tcgen05.mma with A from shared memory (a descriptor: QK) or from TMEM (an address: PV).
TCGEN05_QK = re.compile(
    r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*%rd\d+,\s*%rd\d+,"
)
TCGEN05_PV = re.compile(
    r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*\[%r\d+\],\s*%rd\d+,"
)


def tcgen05_mma_order(ptx):
    """The tcgen05.mma of a Blackwell attention kernel in program order: "Q" for an instruction
    of S = Q K^T (A from shared memory), "P" for one of O += P V (A = P from TMEM)."""
    out = []
    for ln in ptx.splitlines():
        if TCGEN05_QK.search(ln):
            out.append("Q")
        elif TCGEN05_PV.search(ln):
            out.append("P")
    return "".join(out)


def ptxas_resources(ptx, arch):
    """Registers, spills and static shared memory per kernel from `ptxas -v`, or None when ptxas
    is not installed. Dynamic shared memory (what the CuTe kernels use) is reported separately
    by the kernel object."""
    exe = shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run(
            [exe, f"-arch={arch}", "-v", "-o", os.path.join(d, "k.cubin"), src],
            capture_output=True,
            text=True,
            timeout=300,
        )
    text = p.stdout + p.stderr
    if p.returncode != 0:
        lines = text.strip().splitlines()
        too_old = next((ln for ln in lines if "Unsupported .version" in ln), None)
        if too_old:
            # A ptxas older than the PTX ISA the DSL writes (the H200 machine's CUDA 13.0 ptxas
            # and the DSL's cu13 build): not an error of the kernel.
            return {
                "error": f"{exe} cannot assemble this PTX ({too_old.split(':', 2)[-1].strip()})",
                "ptxas_too_old": True,
            }
        return {"error": lines[-1] if lines else f"ptxas exit {p.returncode}"}
    res = {}
    m = re.search(r"Used (\d+) registers", text)
    if m:
        res["registers"] = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        res["spill_stores"], res["spill_loads"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"(\d+) bytes stack frame", text)
    if m:
        res["stack_frame"] = int(m.group(1))
    return res


@dataclasses.dataclass
class CompileReport:
    stage: int
    track: str
    arch: str
    dtype: str
    shape: tuple
    seconds: float
    ptx: str
    cubin: bytes
    counts: dict
    resources: dict | None
    shared_memory_bytes: int | None

    def summary(self):
        keys = [k for k, v in self.counts.items() if v]
        parts = [f"{k} x{self.counts[k]}" for k in keys]
        res = ""
        if self.resources and "registers" in self.resources:
            r = self.resources
            res = f"; {r['registers']} regs, spills {r.get('spill_stores', 0)}/{r.get('spill_loads', 0)} B"
        smem = f"; smem {self.shared_memory_bytes} B" if self.shared_memory_bytes else ""
        return (
            f"stage {self.stage} {self.track} ({self.arch}, {self.seconds:.1f} s){smem}{res}: "
            + ", ".join(parts)
        )


class _ArchOverride:
    """Point CuTe DSL at a target arch for one compile, then restore what it had."""

    def __init__(self, arch):
        from cutlass.cutlass_dsl import CuTeDSL

        self.envar = CuTeDSL._get_dsl().envar
        self.arch = arch

    def __enter__(self):
        self.old = self.envar._arch
        self.envar.arch = self.arch

    def __exit__(self, *exc):
        self.envar._arch = self.old


def compile_for_arch(kernel, args, arch):
    """cute.compile(kernel, *args) for `arch` ('sm_90a' or 'sm_100a'), no GPU needed when args are
    fake tensors; returns (ptx text, cubin bytes). The kernel object keeps what tracing set on it."""
    with tempfile.TemporaryDirectory() as dump, _ArchOverride(arch):
        compiled = cute.compile(
            kernel, *args, options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump}"
        )
        return compiled.artifacts.PTX, compiled.artifacts.CUBIN


def compile_only(
    stage, track, dtype=torch.bfloat16, shape=None, scale=None, resources=True, **options
):
    """Compile stage `stage` of `track` for its arch (sm_90a / sm_100a) with fake tensors: no GPU
    needed. Returns a CompileReport with PTX, CUBIN and instruction counts. `options` go to the
    stage's compile_args by keyword (a later stage's causal=..., window=..., head counts)."""
    if track not in ARCH_OF_TRACK:
        raise ValueError(f"track = {track!r}; allowed: {', '.join(ARCH_OF_TRACK)}")
    arch = ARCH_OF_TRACK[track]
    st = stages.stage(stage)
    shape = tuple(shape or st.compile_shape)
    mod = stages.track_module(stage, track)
    kernel, args = mod.compile_args(dtype, shape, scale, **options)
    t0 = time.perf_counter()
    ptx, cubin = compile_for_arch(kernel, args, arch)
    seconds = time.perf_counter() - t0
    return CompileReport(
        stage,
        track,
        arch,
        str(dtype).replace("torch.", ""),
        shape,
        seconds,
        ptx,
        cubin,
        count_ptx(ptx),
        ptxas_resources(ptx, arch) if resources else None,
        getattr(kernel, "shared_memory_bytes", None),
    )
