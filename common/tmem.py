"""Device helpers shared by the Blackwell stages: the tcgen05 fences that order tensor-memory (TMEM)
accesses across threads, per tile and before TMEM is freed. (The layout fact the epilogues need to
store rows in 16-byte vectors, rows_of_16_bytes, is in common/cute_interop.py: both tracks use it.)

The ordering rules, from the PTX ISA's memory consistency model for tcgen05:
- tcgen05.mma, tcgen05.ld and tcgen05.st are asynchronous: not ordered even with the same thread's
  other tcgen05 operations, except in a pipeline (two tcgen05.mma with the same accumulator and
  shape; tcgen05.mma -> tcgen05.commit; tcgen05.ld -> tcgen05.wait::ld; tcgen05.st ->
  tcgen05.wait::st).
- tcgen05.wait::ld (::st) blocks until this thread's own loads (stores) have completed.
  tcgen05.commit arrives on an mbarrier once this thread's earlier MMAs have completed, and does
  the work of a tcgen05.fence::before_thread_sync itself.
- Across threads, tcgen05 operations are ordered by a thread synchronisation (mbarrier arrive and
  wait, a named barrier) together with tcgen05.fence::before_thread_sync before it on the side that
  signals and tcgen05.fence::after_thread_sync after it on the side that waits. The barrier alone
  does not do it: a release or acquire reaches only operations in program order, and an
  asynchronous tcgen05 operation is not ordered even within its own thread.

Per KV tile of a FlashAttention-4-style kernel this gives (the ISA's "non-pipelined instructions,
different thread" pattern; "wait" is the mbarrier wait):
(a) S read, its columns then rewritten by the next QK MMA. Softmax: tcgen05.ld, tcgen05.wait::ld,
    fence before, arrive. MMA warp: wait, fence after, tcgen05.mma. The tcgen05.wait::ld makes the
    load complete; the two fences order it before the MMA.
(b) P written (over S, or in columns of its own), read by the PV MMA. Softmax: tcgen05.st,
    tcgen05.wait::st, fence before, arrive. MMA warp: wait, fence after, tcgen05.mma.
(c) O rescaled (by the softmax warps in stages 5-7, by the correction warps from stage 8): as
    (b). tcgen05.ld, tcgen05.st, tcgen05.wait::st, fence before, arrive; the MMA warp waits,
    fences after, and issues the PV MMA into O.
(d) An MMA's result read: tcgen05.commit to an mbarrier; the reader waits, fences after, then
    tcgen05.ld (S for the softmax, O for the rescale and the epilogue). The same holds for any
    tcgen05 operation that waits on a commit: softmax's tcgen05.st of P over columns the previous
    PV MMA read, the MMA warp's QK MMA over them. No fence before: tcgen05.commit is one.
A fence covers all of its thread's tcgen05 operations on its side of the barrier: one after a
group of waits, one before a group of arrives.

CUTLASS's pipeline classes (PipelineTmaUmma, PipelineAsyncUmma, PipelineUmmaAsync; CuTe DSL
4.8.1) emit none of these fences (their signals are mbarrier arrives or tcgen05.commit, their
waits plain mbarrier waits), and FA4 (4.0.0b36's flash_fwd_sm100.py) and CUTLASS's Blackwell
attention examples place only tcgen05.wait::ld and ::st at these hand-offs. The same FA4 release
does place tcgen05.fence::after_thread_sync in its MLA kernel (flash_fwd_mla_1cta_kb64_sm100.py:
after each mbarrier wait that precedes a tcgen05.cp into TMEM). A kernel that follows the ISA's
rules adds the fences itself, with the two helpers below."""

from cutlass import dsl_user_op
from cutlass._mlir.dialects import nvvm


@dsl_user_op
def fence_before_thread_sync(*, loc=None, ip=None):
    """`tcgen05.fence::before_thread_sync`: orders this thread's earlier tcgen05 operations before
    the thread synchronisation that follows it (an mbarrier arrive, a named barrier).

    Per tile: after tcgen05.wait::ld or tcgen05.wait::st, before the arrive that tells the MMA warp
    S, P or O is free or written ((a) to (c) above). Not after tcgen05.commit: the commit is one.

    Before `tcgen05.dealloc`: the warp that frees the tensor memory must not do so while another
    warp's tcgen05.ld or tcgen05.st of it may still be in flight. tcgen05.wait::ld and ::st only
    wait for the waiting thread's own operations; the barrier orders them for the other warps only
    with this fence before it. So every warp that ran tcgen05.ld or tcgen05.st issues this fence,
    then the barrier, and only then does the allocating warp run tcgen05.dealloc (the order
    CUTLASS's low-level tcgen05 examples use: fence, barrier, dealloc). tcgen05.dealloc is a
    synchronous tcgen05 instruction, and the fence after a barrier is for asynchronous ones, so the
    freeing warp needs none."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def fence_after_thread_sync(*, loc=None, ip=None):
    """`tcgen05.fence::after_thread_sync`: orders this thread's later tcgen05 operations after the
    thread synchronisation before it (an mbarrier wait, a named barrier).

    Per tile: after the mbarrier wait, before the first tcgen05 operation that relies on it. The
    MMA warp, before the QK MMA that overwrites S (or P) and before the PV MMA that reads P and
    accumulates into O ((a) to (c) above); softmax, correction and epilogue threads, before the
    tcgen05.ld of an MMA result, or the tcgen05.st over columns an MMA read, once its
    tcgen05.commit has arrived ((d))."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)
