"""Stage 15 - context parallelism: one sequence over several GPUs, K and V passed around a ring
of ranks with torch.distributed, the partial results merged by their LSE weights (ring.py).
`attention_cp(q, k, v, group=None, causal=False, zigzag=None, attention=None,
return_lse=False)` runs on each rank with that rank's chunk; the kernel is stage 14's, called as
it is. Launch: `make cp GPUS=N` (common/tools/cp_run.py)."""

from stages.stage15_context_parallel.ring import (  # noqa: F401
    FakeRing,
    Ring,
    TorchRing,
    attention_cp,
    chunk_of,
    merge,
    ring_step,
)
