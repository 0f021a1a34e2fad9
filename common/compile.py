"""The compile cache of every launch: a kernel is compiled once per set of argument types it
assumes (the table below), and every later call with the same types reuses it. What inspects the
compiled code (PTX counts, ptxas registers, compile-only reports) is in common/tools/ptx.py."""

import copy
import inspect
import re

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import _Tensor as CuteRuntimeTensor

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
    """The configuration a kernel object was built with: its class and every attribute, by value
    (a kernel object held by another, as common/combine.py's SplitLaunch holds the split kernel
    and the combine, by its own configuration)."""
    return (type(kernel), tuple(sorted((k, _config_value(v)) for k, v in vars(kernel).items())))


def _config_value(v):
    if callable(getattr(v, "kernel", None)):
        return kernel_config(v)
    if isinstance(v, (set, frozenset)):  # a set's repr follows its order of insertion and hashing
        return repr(sorted(v, key=repr))
    return repr(v)


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


# The TVM-FFI launch (stages 7-14). cute.compile(..., options="--enable-tvm-ffi") against fake
# tensors gives a function that takes the torch tensors themselves and launches on the caller's
# current stream: no CuTe views, no argument conversion in Python at each call (host work per
# call on the H200, 2026-12-01: 385 us with views, 163 us this way; docs/notes/stage7.md). The
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
    from common.cute_interop import fake_like, fake_stream

    key = ffi_compile_key(kernel, args)
    fn = _CACHE.get(key)
    if fn is None:
        fakes = [fake_like(a) if isinstance(a, torch.Tensor) else a for a in args]
        try:
            import tvm_ffi  # noqa: F401
        except ImportError:
            raise ImportError(
                "stages 7-14 launch through TVM-FFI: pip install apache-tvm-ffi "
                "(requirements.txt lists it)"
            ) from None
        # Traced on a copy: tracing sets attributes on the object it traces (Hopper's
        # shared_storage, whose repr holds an address, and shared_memory_bytes), which
        # kernel_config reads, so the caller's object would no longer have the key it was
        # compiled under (a LaunchPlan compiles its SplitLaunch again, for the calls that return
        # no LSE: that compile would miss the cache and compile the same code once more).
        fn = cute.compile(
            copy.deepcopy(kernel), *fakes, fake_stream(env=True), options="--enable-tvm-ffi"
        )
        _CACHE[key] = fn
    return fn


# Caches that hold compiled functions too (common/attention_host.py's launch plans and
# remembered calls): emptied with this one. They are keyed by the kernel class, not by the
# settings of the kernel object the plan compiled (those are read once, when the plan is made).
CLEAR_WITH_CACHE = []


def clear_launch_plans():
    """Forget the launch plans and remembered calls; the compiled kernels stay, so the next
    call of each shape builds its plan again from a new kernel object (and compiles only if
    that object's settings are new). Needed whenever a kernel class starts or stops building
    objects with other settings (common/tools/notebook.py's kernel_settings)."""
    for clear in CLEAR_WITH_CACHE:
        clear()


def clear_cache():
    """Forget every compiled kernel (the next launch of each compiles again)."""
    _CACHE.clear()
    clear_launch_plans()


def cache_size():
    return len(_CACHE)
