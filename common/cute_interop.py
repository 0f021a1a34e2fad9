"""torch <-> CuTe: wrapping real tensors for a launch, and fake tensors for compile-only."""
import torch
import cutlass
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream

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


def fake_tensor(torch_dtype, shape, assumed_align=16):
    """A fake row-major tensor (last dim contiguous) for cute.compile without a GPU."""
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(cute_dtype(torch_dtype), tuple(shape), stride_order=order,
                                    assumed_align=assumed_align)


def fake_stream():
    return make_fake_stream()


def current_stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
