"""Device helpers shared by the Blackwell stages: freeing tensor memory safely, and the layout fact
the epilogue needs to store a row of TMEM in 16-byte vectors."""

import cutlass.cute as cute
from cutlass import dsl_user_op
from cutlass._mlir.dialects import nvvm


@dsl_user_op
def fence_before_thread_sync(*, loc=None, ip=None):
    """`tcgen05.fence::before_thread_sync`: orders this thread's earlier tcgen05 operations before
    the thread synchronisation that follows it (a named barrier, an mbarrier arrive).

    Why, before `tcgen05.dealloc`: in the PTX memory model tcgen05.ld and tcgen05.st are
    asynchronous, and a barrier alone does not order them with the operations of other threads.
    tcgen05.wait::ld only makes the loaded registers readable by this thread. The warp that frees
    the tensor memory must not do so while another warp's tcgen05.ld or tcgen05.st of it may still
    be in flight, so every warp that read or wrote TMEM issues this fence, then the barrier, and
    only then does the allocating warp run tcgen05.dealloc (the order CUTLASS's tcgen05 examples
    use: fence, barrier, dealloc)."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


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
