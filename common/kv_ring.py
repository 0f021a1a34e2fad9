"""Device-side helper of the K/V ring of the warp-specialised Hopper stages (stage 12, tuning 3)."""

import cutlass.cute as cute


@cute.jit
def release_slot(kv_pipeline, state):
    """A consumer warp is done with ring slot state.index: one elected lane arrives on the slot's
    empty barrier (its count is one per consumer warp, 8 or 12). The pipeline's consumer_release
    does the same from lane 0, a predicate made from tidx % 32 once, which ptxas does not keep in
    a predicate register across the loop: it re-reads %tid.x and rebuilds it at every KV tile
    (S2R + LOP3 in the loop's SASS, from the cubin the DSL built for sm_90a, 2026-12-03).
    elect.sync picks a lane in one instruction, from nothing live (measured: docs/notes/stage12.md)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive(kv_pipeline.sync_object_empty.get_barrier(state.index))
