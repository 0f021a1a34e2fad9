"""`make cp GPUS=N`: stage 15's ring attention on N ranks, launched by torchrun, one process per
GPU (NCCL) - or, with --cpu, per CPU process (gloo) with an fp64 attention in place of the kernel.

    torchrun --nproc-per-node N -m common.tools.cp_run [--seqlen S] [--causal] [--cpu]

S is 32768 on GPUs and 1024 with --cpu, where the fp64 stand-in for the kernel holds a chunk's
whole score matrix (64 GiB a rank over 2 ranks at S = 32768 and 32 heads).

Each rank builds the same full sequence (one seed), takes its chunk (zig-zag when causal; any
seqlen, the chunks then differ by a token), runs attention_cp, and reports: its time per call
(CUDA events; wall clock on the CPU), the time of its kernels alone and of its hops alone (the
same schedule run without the other) - the ring's time over its kernels' is what the hops and
the merges add (the merges and the K/V buffer's set-up alone when every hop is hidden) - and its
output's error against one attention over the whole sequence on rank 0's device (the kernel
itself on a GPU; fp64 on the CPU). Without a GPU pass --cpu (make cp: CP_ARGS=--cpu): the GPU
path starts with torch.cuda.set_device and fails there.

One GPU, N virtual ranks (no torchrun, no NCCL: the kernel path on a machine with one GPU):

    python -m common.tools.cp_run --virtual-ranks 4 [--seqlen S] [--causal] [--cpu]
    (or make cp GPUS=1 CP_ARGS="--virtual-ranks 4 --causal")

1. attention_cp with the ranks as threads of this process (FakeRing: every hop a copy on the
   device), each rank's O and LSE against one kernel call over the whole sequence;
2. each rank's step (its kernel and its merge) timed alone, step by step, one rank after the
   other: on N GPUs a step lasts as long as its slowest rank, so the ring's compute time is the
   sum over steps of the slowest rank's, set against one kernel call over the whole sequence
   (ideal: N times faster). The hops are not timed (one GPU has no link to measure); printed
   instead is the bandwidth a link needs to hide each hop under the step it overlaps."""

import argparse
import os
import sys
import time

import torch

from stages.stage15_context_parallel import (
    Chunks,
    FakeRing,
    attend_step,
    attention_cp,
    chunk_of,
    step_work,
)


def say(text):
    print(text, flush=True)


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


def sequence(args, device, dtype):
    """The whole sequence's q (1, H, S, D) and k, v (1, Hkv, S, D), one seed on every rank."""
    g = torch.Generator(device=device).manual_seed(0)
    S, H, Hkv, D = args.seqlen, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, H, S, D, generator=g, device=device).to(dtype)
    k, v = (torch.randn(1, Hkv, S, D, generator=g, device=device).to(dtype) for _ in range(2))
    return q, k, v


def kernel(cuda):
    """The per-chunk attention: stage 14's kernel on a GPU, the fp64 reference on the CPU."""
    if cuda:
        from stages.stage15_context_parallel.ring import default_attention

        return default_attention()
    from common.tools.reference import attention_gqa_ref

    return attention_gqa_ref


def kv_buffer(k, v, rows):
    """K and V of one chunk as one hop's buffer (2, B, Hkv, rows, D), as attention_cp sends it."""
    kv = torch.stack([k, v])
    return torch.nn.functional.pad(kv, (0, 0, 0, rows - k.shape[2]))


def describe(args, world, where):
    S, H, Hkv, D = args.seqlen, args.heads, args.kv_heads, args.head_dim
    mask = "causal, zig-zag chunks" if args.causal else "full, contiguous chunks"
    return f"ring attention, {world} {where}: S = {S}, H = {H}/{Hkv}, D = {D}, {mask}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--seqlen", type=int, default=None, help="tokens of the sequence (32768; 1024 with --cpu)"
    )
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="gloo and an fp64 attention (no GPU)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--virtual-ranks",
        type=int,
        default=0,
        metavar="N",
        help="N ranks in this one process on one device (no torchrun, no NCCL)",
    )
    args = ap.parse_args(argv)
    if args.seqlen is None:
        args.seqlen = 1024 if args.cpu else 32768
    if not args.cpu and not torch.cuda.is_available():
        sys.exit(
            "no CUDA GPU here: pass --cpu to run the ranks on CPU processes (make cp CP_ARGS=--cpu)"
        )
    if args.virtual_ranks:
        return run_virtual(args)
    return run_distributed(args)


def run_distributed(args):
    import torch.distributed as dist

    from stages.stage15_context_parallel import TorchRing

    cuda = not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    ring = TorchRing()
    rank, world = ring.rank, ring.world
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float64
    S = args.seqlen
    q, k, v = sequence(args, device, dtype)
    zigzag = args.causal
    chunks = Chunks(S, world, zigzag)
    rows = max(chunks.length(r) for r in range(world))
    qc, kc, vc = (chunk_of(t, rank, world, zigzag).contiguous() for t in (q, k, v))
    attention = kernel(cuda)

    def run():
        return attention_cp(
            qc, kc, vc, group=ring, causal=args.causal, attention=attention, seqlen=S
        )  # fmt: skip

    o = run()
    t_ring = timed(run, cuda, args.reps)

    # The same kernels without the hops, and the hops without the kernels.
    def kernels_only():
        for step in range(world):
            work = step_work(chunks, rank, (rank - step) % world, args.causal)
            if work is not None:
                q_rows, kv_rows, step_causal = work
                attention(
                    qc[:, :, q_rows].contiguous(),
                    kc[:, :, kv_rows].contiguous(),
                    vc[:, :, kv_rows].contiguous(),
                    step_causal,
                )

    kv = kv_buffer(kc, vc, rows)

    def hops_only():
        buf = kv
        for _ in range(world - 1):
            buf = ring.exchange(buf).wait()

    t_kernels = timed(kernels_only, cuda, args.reps)
    t_hops = timed(hops_only, cuda, args.reps)
    extra = t_ring - t_kernels  # what the hops and the merges add to the kernels

    # Rank 0: one attention over the whole sequence; every rank's chunk against it. The chunks
    # differ by a row where S does not split evenly: all_gather takes them padded to one shape.
    padded = torch.nn.functional.pad(o, (0, 0, 0, rows - o.shape[2]))
    outs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(outs, padded.contiguous())
    if rank == 0:
        o_ref = attention(q, k, v, args.causal)[0]
        err = max(
            (
                outs[r][:, :, : chunks.length(r)].double()
                - chunk_of(o_ref.double(), r, world, zigzag)
            )
            .abs()
            .max()
            .item()
            for r in range(world)
            if chunks.length(r)
        )
    times = torch.tensor([t_ring, t_kernels, t_hops, extra], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(times) for _ in range(world)]
    dist.all_gather(gathered, times)
    if rank == 0:
        say(describe(args, world, "ranks on " + ("GPUs" if cuda else "CPUs (gloo, fp64)")))
        for r, t in enumerate(gathered):
            say(
                f"  rank {r}: {t[0]:.3f} ms per call; its kernels alone {t[1]:.3f} ms, its hops "
                f"alone {t[2]:.3f} ms; the ring adds {t[3]:.3f} ms to the kernels"
            )
        say(f"  max |O - O of one attention over the sequence| = {err:.3g}")
    dist.destroy_process_group()


def run_virtual(args):
    from common.arch import gpu_description

    world, cuda = args.virtual_ranks, not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float64
    S, causal, zigzag = args.seqlen, args.causal, args.causal
    where = gpu_description() if cuda else "CPU (fp64 attention)"
    say(describe(args, world, f"virtual ranks on one device, {where}"))
    q, k, v = sequence(args, device, dtype)
    chunks = Chunks(S, world, zigzag)
    rows = max(chunks.length(r) for r in range(world))
    say(f"  chunks of {', '.join(str(chunks.length(r)) for r in range(world))} tokens")

    # 1. The ring itself: attention_cp on every rank, the ranks as threads of this process.
    ring = FakeRing(world, timeout=1800)
    attention = kernel(cuda)
    say("1. the ring (attention_cp, one thread per rank) against one call over the sequence")
    if cuda:
        say("   (the first calls compile the kernel's variants these chunk shapes need)")
    t0 = time.perf_counter()
    o_ref, lse_ref = attention(q, k, v, causal)
    results = ring.run(
        lambda r: attention_cp(
            *(chunk_of(t, r.rank, world, zigzag) for t in (q, k, v)),
            group=r,
            causal=causal,
            zigzag=zigzag,
            attention=ring.one_at_a_time(attention),
            return_lse=True,
            seqlen=S,
        )  # fmt: skip
    )
    if cuda:
        torch.cuda.synchronize()
    err_o = err_lse = 0.0
    for r, (o, lse) in enumerate(results):
        if not chunks.length(r):
            continue
        o_want, lse_want = (chunk_of(t, r, world, zigzag) for t in (o_ref, lse_ref))
        err_o = max(err_o, (o.double() - o_want.double()).abs().max().item())
        err_lse = max(err_lse, (lse.double() - lse_want.double()).abs().max().item())
    say(f"   done in {time.perf_counter() - t0:.1f} s")
    say(f"   max |O - O of one call over the sequence| = {err_o:.3g}")
    say(f"   max |LSE - LSE of one call over the sequence| = {err_lse:.3g}")

    # 2. Each rank's step alone (kernel and merge into a scratch O and LSE), step by step.
    say(f"2. time per step ({args.reps} reps each, one rank at a time)")
    qcs = [chunk_of(q, r, world, zigzag).contiguous() for r in range(world)]
    kvs = [
        kv_buffer(chunk_of(k, r, world, zigzag), chunk_of(v, r, world, zigzag), rows)
        for r in range(world)
    ]
    B, H, D = q.shape[0], q.shape[1], q.shape[3]
    slowest, total = [], 0.0
    for step in range(world):
        times = []
        for rank in range(world):
            src = (rank - step) % world
            if step_work(chunks, rank, src, causal) is None:
                times.append(0.0)
                continue
            n = chunks.length(rank)
            out = torch.zeros(B, H, n, D, dtype=torch.float32, device=device)
            lse = torch.full((B, H, n), float("-inf"), dtype=torch.float32, device=device)
            times.append(
                timed(
                    lambda: attend_step(
                        qcs[rank], kvs[src], out, lse, chunks, rank, src, causal, attention
                    ),
                    cuda,
                    args.reps,
                )
            )
        slowest.append(max(times))
        total += sum(times)
        per_rank = ", ".join(f"{t:.3f}" for t in times)
        say(f"   step {step + 1}/{world}: ranks {per_rank} ms; the slowest {slowest[-1]:.3f} ms")
    t_full = timed(lambda: attention(q, k, v, causal), cuda, args.reps)
    t_ring = sum(slowest)
    say(f"   one call over the whole sequence: {t_full:.3f} ms")
    if cuda:
        say(
            f"   the ring's compute on {world} devices (sum of the slowest per step): "
            f"{t_ring:.3f} ms, {t_full / t_ring:.2f}x one call (ideal {world}x, "
            f"{t_full / t_ring / world:.0%} of it)"
        )
    else:  # the fp64 stand-in's time grows faster than the chunk: no speed-up to read here
        say(
            f"   the ring's compute on {world} devices (sum of the slowest per step): "
            f"{t_ring:.3f} ms (the CPU stand-in's times are no measure of the kernel's speed-up)"
        )
    say(
        f"   all ranks' steps together: {total:.3f} ms, {total / t_full:.2f}x one call (what"
        " cutting the sequence costs: shorter kernels, the merges)"
    )
    overlapped = [t for t in slowest[:-1] if t > 0]  # the hop of step s overlaps step s
    if overlapped:
        hop = 2 * B * args.kv_heads * rows * D * q.element_size()
        say(
            f"   a hop carries {hop / 2**20:.2f} MiB; hidden under the shortest step it overlaps"
            f" ({min(overlapped):.3f} ms) at {hop / min(overlapped) / 1e6:.1f} GB/s or more"
        )


if __name__ == "__main__":
    main()
