"""Device helpers shared by the Blackwell stages: freeing tensor memory safely. (The layout fact the
epilogues need to store rows in 16-byte vectors, rows_of_16_bytes, is in common/cute_interop.py:
both tracks use it.)"""

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
