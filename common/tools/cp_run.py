"""`make cp GPUS=N`: stage 15's ring attention on N ranks, launched by torchrun, one process per
GPU (NCCL) - or, with --cpu, per CPU process (gloo) with an fp64 attention in place of the kernel.

    torchrun --nproc-per-node N -m common.tools.cp_run [--seqlen 32768] [--causal] [--cpu]

Each rank builds the same full sequence (one seed), takes its chunk (zig-zag when causal), runs
attention_cp, and reports: its time per call (CUDA events; wall clock on the CPU), the time of
its kernels alone and of its hops alone (the same schedule run without the other) - the ring's
time over its kernels' is what the hops and the merges add, 0 when the hops are hidden - and its output's error against one attention over the
whole sequence on rank 0's device (the kernel itself on a GPU; fp64 on the CPU)."""

import argparse
import os
import time

import torch
import torch.distributed as dist

from stages.stage15_context_parallel import TorchRing, attention_cp, chunk_of, ring_step


def timed(fn, cuda, reps):
    fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="gloo and an fp64 attention (no GPU)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    cuda = not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    ring = TorchRing()
    rank, world = ring.rank, ring.world
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float64
    g = torch.Generator(device=device).manual_seed(0)
    S, H, Hkv, D = args.seqlen, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, H, S, D, generator=g, device=device).to(dtype)
    k, v = (torch.randn(1, Hkv, S, D, generator=g, device=device).to(dtype) for _ in range(2))
    zigzag = args.causal
    qc, kc, vc = (chunk_of(t, rank, world, zigzag).contiguous() for t in (q, k, v))
    if cuda:
        from stages.stage15_context_parallel.ring import default_attention

        attention = default_attention()
    else:
        from common.tools.reference import attention_gqa_ref as attention

    def run():
        return attention_cp(qc, kc, vc, group=ring, causal=args.causal, attention=attention)

    o = run()
    t_ring = timed(run, cuda, args.reps)

    # The same kernels without the hops, and the hops without the kernels.
    half = qc.shape[2] // 2
    rows = {"all": slice(None), "first": slice(0, half), "second": slice(half, None)}

    def kernels_only():
        for step in range(world):
            w = ring_step(rank, world, (rank - step) % world, args.causal, zigzag)
            if w is not None:
                q_rows, kv_rows = rows[w[0]], rows[w[1]]
                attention(
                    qc[:, :, q_rows].contiguous(),
                    kc[:, :, kv_rows].contiguous(),
                    vc[:, :, kv_rows].contiguous(),
                    w[2],
                )

    kv = torch.stack([kc, vc])

    def hops_only():
        buf = kv
        for _ in range(world - 1):
            buf = ring.exchange(buf).wait()

    t_kernels = timed(kernels_only, cuda, args.reps)
    t_hops = timed(hops_only, cuda, args.reps)
    extra = t_ring - t_kernels  # what the hops and the merges add to the kernels

    # Rank 0: one attention over the whole sequence; every rank's chunk against it.
    outs = [torch.empty_like(o) for _ in range(world)]
    dist.all_gather(outs, o.contiguous())
    if rank == 0:
        o_ref = attention(q, k, v, args.causal)[0]
        err = max(
            (outs[r].double() - chunk_of(o_ref, r, world, zigzag).double()).abs().max().item()
            for r in range(world)
        )
    times = torch.tensor([t_ring, t_kernels, t_hops, extra], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(times) for _ in range(world)]
    dist.all_gather(gathered, times)
    if rank == 0:
        what = "GPU" if cuda else "CPU (gloo, fp64 attention)"
        mask = "causal, zig-zag" if args.causal else "full"
        print(f"ring attention, {world} ranks on {what}: S = {S}, H = {H}/{Hkv}, D = {D}, {mask}")
        for r, t in enumerate(gathered):
            print(
                f"  rank {r}: {t[0]:.3f} ms per call; its kernels alone {t[1]:.3f} ms, its hops "
                f"alone {t[2]:.3f} ms; the ring adds {t[3]:.3f} ms to the kernels"
            )
        print(f"  max |O - O of one attention over the sequence| = {err:.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
