"""Stage 15 on the CPU: the ring schedule and the merge of context parallelism, with the ranks
as threads of one process (FakeRing) and an fp64 attention in place of the kernel.

- The schedule (ring_step) covers every (query, key) pair the mask allows exactly once and no
  other, for world sizes 1-8, causal and not, contiguous and zig-zag chunks; zig-zag gives every
  rank the same work at every step after the first.
- attention_cp over 2, 3, 4 ranks equals one attention over the whole sequence (O and LSE,
  fp64 inputs: only the fp32 merge rounds), GQA included; a world of 1 returns the kernel's
  output itself.
- A rank that fails stops the others (no hang).
The multi-GPU run (NCCL, the kernel itself) is `make cp GPUS=N` (common/tools/cp_run.py)."""

import pytest
import torch

from common.tools.reference import attention_gqa_ref as fp64_attention
from stages.stage15_context_parallel import FakeRing, attention_cp, chunk_of, ring_step


def positions(S, rank, world, zigzag):
    return chunk_of(torch.arange(S), rank, world, zigzag, dim=0)


@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_schedule_covers_each_visible_pair_once(world, causal, zigzag):
    S = 4 * world * 3
    seen = torch.zeros(S, S, dtype=torch.int64)
    work = torch.zeros(world, world, dtype=torch.int64)  # (step, rank) -> pairs computed
    for rank in range(world):
        qpos = positions(S, rank, world, zigzag)
        for step in range(world):
            src = (rank - step) % world
            kpos = positions(S, src, world, zigzag)
            w = ring_step(rank, world, src, causal, zigzag)
            if w is None:
                continue
            q_rows, kv_rows, step_causal = w
            half = len(qpos) // 2
            sel = {"all": slice(None), "first": slice(0, half), "second": slice(half, None)}
            qi, ki = qpos[sel[q_rows]], kpos[sel[kv_rows]]
            vis = torch.ones(len(qi), len(ki), dtype=torch.bool)
            if step_causal:
                vis = torch.arange(len(ki))[None, :] <= torch.arange(len(qi))[:, None]
            for a, i in enumerate(qi.tolist()):
                for b, j in enumerate(ki.tolist()):
                    if vis[a, b]:
                        seen[i, j] += 1
                        work[step, rank] += 1
    want = torch.tril(torch.ones(S, S, dtype=torch.int64)) if causal else torch.ones(S, S)
    assert torch.equal(seen, want.to(torch.int64)), "a pair missed, computed twice or not allowed"
    if causal and zigzag:
        for step in range(1, world):
            assert len(set(work[step].tolist())) == 1, (step, work[step].tolist())


@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_equals_one_attention_over_the_sequence(world, causal, zigzag):
    g = torch.Generator().manual_seed(world)
    B, H, Hkv, S, D = 2, 4, 2, 24 * world, 16
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    o_ref, lse_ref = fp64_attention(q, k, v, causal)

    def rank_fn(ring):
        r = ring.rank
        chunks = [chunk_of(t, r, world, zigzag) for t in (q, k, v)]
        return attention_cp(
            *chunks, group=ring, causal=causal, zigzag=zigzag, attention=fp64_attention,
            return_lse=True,
        )  # fmt: skip

    results = FakeRing(world).run(rank_fn)
    for r, (o, lse) in enumerate(results):
        o_want, lse_want = (chunk_of(t, r, world, zigzag) for t in (o_ref, lse_ref))
        assert (o.double() - o_want).abs().max() < 1e-5, (r, (o.double() - o_want).abs().max())
        assert (lse.double() - lse_want).abs().max() < 1e-5, r


def test_world_of_one_returns_the_kernels_output():
    q, k, v = (torch.randn(1, 2, 32, 16, dtype=torch.float64) for _ in range(3))
    got = {}

    def kernel(q, k, v, causal):
        got["out"] = fp64_attention(q, k, v, causal)
        return got["out"]

    o, lse = FakeRing(1).run(
        lambda ring: attention_cp(
            q, k, v, group=ring, causal=True, attention=kernel, return_lse=True
        )
    )[0]
    assert o is got["out"][0] and lse is got["out"][1]


def test_a_failing_rank_stops_the_ring():
    def rank_fn(ring):
        if ring.rank == 1:
            raise RuntimeError("rank 1 failed")
        q = torch.randn(1, 1, 8, 8, dtype=torch.float64)
        return attention_cp(q, q, q, group=ring, attention=fp64_attention)

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        FakeRing(3).run(rank_fn)


def test_zigzag_chunk_must_split_evenly():
    q = torch.randn(1, 1, 7, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="zig-zag"):
        FakeRing(2).run(
            lambda ring: attention_cp(q, q, q, group=ring, causal=True, attention=fp64_attention)
        )


def test_torchrun_launcher_on_cpu_processes():
    # The torch.distributed path itself (TorchRing: batch_isend_irecv on gloo), 2 processes.
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "common.tools.cp_run", "--cpu", "--seqlen", "128", "--heads", "2"]
    cmd += ["--kv-heads", "1", "--head-dim", "16", "--causal", "--reps", "1"]
    env = {**os.environ, "PYTHONPATH": root, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    err = float(re.search(r"sequence\| = (\S+)", p.stdout).group(1))
    assert err < 1e-5, p.stdout
