"""torch <-> CuTe: wrapping real tensors for a launch, and fake tensors for compile-only."""

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import (
    from_dlpack,
    make_fake_compact_tensor,
    make_fake_stream,
    make_fake_tensor,
)
from cutlass.cute.typing import sym_int

_CUTE_DTYPE = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
}


def cute_dtype(torch_dtype):
    try:
        return _CUTE_DTYPE[torch_dtype]
    except KeyError:
        raise TypeError(f"no CuTe element type for {torch_dtype}") from None


def canonical_strides(t):
    """The same tensor with every size-1 mode (other than the last) given one canonical stride:
    the index into such a mode is always 0, so its stride never moves an address, but torch
    leaves whatever the tensor came from (a B = 1 batch may have stride 0, 1 or anything). The
    canonical stride is the tensor's span over its other modes (a non-zero multiple of 16 bytes
    whenever the other strides are), so that B = 1, H = 1 or Sq = 1 share the compiled kernel of
    a larger extent instead of compiling one per stray stride (see common/compile.py)."""
    shape = tuple(t.shape)
    if 1 not in shape[:-1]:
        return t  # nothing to change (the common case: this check is on every launch's path)
    stride = canonical_stride(shape, t.stride())
    return t if stride == t.stride() else t.as_strided(shape, stride)


def canonical_stride(shape, stride):
    """The strides canonical_strides gives a tensor of this shape and these strides."""
    stride = list(stride)
    span = max([n * s for n, s in zip(shape, stride) if n > 1 and s > 0] + [shape[-1]])
    for d in range(len(shape) - 1):
        if shape[d] == 1:
            stride[d] = span
    return tuple(stride)


def output_layout(shape):
    """(shape, stride) of an output the entries allocate: row-major, its size-1 modes given
    canonical_strides' stride from the start, so that the launch passes it as it is (no view
    per call). torch calls such a tensor contiguous: a size-1 mode's stride moves no address."""
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= n
    return tuple(shape), canonical_stride(shape, reversed(stride))


def to_cute(t, dynamic=False, assumed_align=16):
    """A CuTe view of a torch CUDA tensor (same memory) with canonical size-1 strides.

    dynamic=False: static shape and strides, folded into the code (one compile per layout).
    dynamic=True: every extent and every stride but the last (D, contiguous) is a run-time value,
    except a stride of 0 (an expanded tensor), which stays a static 0. Either way the cache key
    of common.compile.cached_compile holds exactly what is static."""
    c = from_dlpack(canonical_strides(t.detach()), assumed_align=assumed_align)
    return c.mark_layout_dynamic(leading_dim=t.dim() - 1) if dynamic else c


def fake_tensor(torch_dtype, shape, assumed_align=16, dynamic=False):
    """A fake row-major tensor (last dim contiguous) for cute.compile without a GPU.

    dynamic=True stands for `to_cute(t, dynamic=True)`: every extent and every stride but the
    last is a run-time value, with the types mark_layout_dynamic gives them (32-bit extents,
    64-bit strides, no divisibility known to the compiler), so that compile-only compiles the
    same code that a launch runs. (A kernel that needs aligned strides, for 16-byte stores,
    asserts them itself with cute.assume; check_tensor guarantees them at run time.)"""
    if dynamic:
        n = len(shape)
        extents = tuple(sym_int() for _ in range(n))
        strides = tuple(sym_int(64) for _ in range(n - 1)) + (1,)
        return make_fake_tensor(
            cute_dtype(torch_dtype), extents, strides, assumed_align=assumed_align
        )
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(
        cute_dtype(torch_dtype), tuple(shape), stride_order=order, assumed_align=assumed_align
    )


def fake_like(t, assumed_align=16):
    """The fake tensor that `to_cute(t, dynamic=True)` would stand for, built from a torch tensor's
    layout without touching its memory: every extent and every stride run-time values, except a
    stride of 0 (a static 0) and the last stride (a static 1). What the TVM-FFI launch compiles
    against (common.compile.cached_compile_ffi); the real tensor is passed at each call."""
    n = t.dim()
    extents = tuple(sym_int() for _ in range(n))
    strides = tuple(0 if s == 0 else sym_int(64) for s in t.stride()[:-1]) + (1,)
    return make_fake_tensor(cute_dtype(t.dtype), extents, strides, assumed_align=assumed_align)


def fake_stream(env=False):
    """A stream placeholder for cute.compile. env=True (TVM-FFI): the compiled function takes no
    stream argument and launches on the caller's current stream (torch.cuda.current_stream())."""
    return make_fake_stream(use_tvm_ffi_env_stream=env)


def current_stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


@cute.jit
def rows_of_16_bytes(t: cute.Tensor):
    """t with every stride but the last (contiguous) one declared a multiple of 16 bytes.

    The entries allocate their outputs (C, S, O) contiguous with rows of 16-byte multiples (N % 8,
    Sk % 4, D in {64, 128}), but a dynamic stride carries no divisibility: without this, the
    compiler cannot prove a row's address 16-byte aligned and splits each thread's store of its
    row into 2- or 4-byte pieces. A static stride is checked here instead (cute.assume raises)."""
    n = 128 // t.element_type.width
    stride = (*(cute.assume(s, divby=n) for s in t.stride[:-1]), t.stride[-1])
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=stride))
