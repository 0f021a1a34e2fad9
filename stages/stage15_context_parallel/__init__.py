"""Stage 15 - context parallelism: one sequence over several GPUs, K and V passed around a ring
of ranks with torch.distributed, the partial results merged by their LSE weights (ring.py).
`attention_cp(q, k, v, group=None, causal=False, zigzag=None, attention=None,
return_lse=False, seqlen=None)` runs on each rank with that rank's chunk (chunk_of: any seqlen,
chunks that differ by at most one token); the kernel is stage 14's, called as it is. Launch:
`make cp GPUS=N` (common/tools/cp_run.py; `--virtual-ranks N` runs N ranks on one GPU)."""

from stages.stage15_context_parallel.ring import (  # noqa: F401
    Chunks,
    FakeRing,
    Ring,
    TorchRing,
    attend_step,
    attention_cp,
    chunk_of,
    default_attention,
    merge,
    ring_step,
    step_work,
)
