"""torch <-> CuTe: wrapping real tensors for a launch, and fake tensors for compile-only."""

import cutlass
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
}


def cute_dtype(torch_dtype):
    try:
        return _CUTE_DTYPE[torch_dtype]
    except KeyError:
        raise TypeError(f"no CuTe element type for {torch_dtype}") from None


def to_cute(t, assumed_align=16):
    """A CuTe view of a torch CUDA tensor (same memory, static shape and strides).
    The kernels are compiled per shape, so static layouts let the compiler fold index math."""
    return from_dlpack(t.detach(), assumed_align=assumed_align)


def fake_tensor(torch_dtype, shape, assumed_align=16, dynamic=False):
    """A fake row-major tensor (last dim contiguous) for cute.compile without a GPU.

    dynamic=True stands for `to_cute(t).mark_layout_dynamic(leading_dim=-1)`: every extent and
    every stride but the last is a run-time value (strides keep 16-byte divisibility, as TMA
    needs), so compile-only compiles the same code that a dynamic-layout launch runs."""
    if dynamic:
        esize = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}[torch_dtype]
        n = len(shape)
        extents = tuple(sym_int() for _ in range(n))
        strides = tuple(sym_int(64, divisibility=16 // esize) for _ in range(n - 1)) + (1,)
        return make_fake_tensor(
            cute_dtype(torch_dtype), extents, strides, assumed_align=assumed_align
        )
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(
        cute_dtype(torch_dtype), tuple(shape), stride_order=order, assumed_align=assumed_align
    )


def fake_stream():
    return make_fake_stream()


def current_stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
