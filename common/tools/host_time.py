"""Host work per call: how long an entry point keeps the CPU busy at a tiny shape.

    python -m common.tools.host_time [--calls 2000] [--rounds 5] [--profile]

The shape is a decode step at batch 1, small enough that the host's work, not the GPU's, sets
the pace: Q (1, 32, 1, 128), K and V (1, 8, 256, 128), bf16, causal. Every call runs under
torch.inference_mode(), except where an entry says otherwise. The entries:

- stages 12 and 13, and stage 13 made to split the keys in two (num_splits=2: the split
  launch, its partials' buffer and the combine, which a long context takes);
- stage 14 on a paged cache of 64 keys a page, three ways: its page_table and seqused_k made
  outside inference mode (their values read to the host once and remembered), made inside it
  (read at every call), and made inside it with check_values=False (never read);
- common/ops.py's wrapper ops.attention, which calls the stage directly in eager mode, and the
  custom op called through torch.ops, under inference_mode and under no_grad (where the
  dispatcher passes the Autograd key, a fallthrough, which inference_mode skips);
- SDPA, and FA4 where it can be imported.

Four numbers per entry, in microseconds per call, after warm-up calls (which compile):

- back to back: --calls calls between two CUDA events. Whichever is slower sets it: the host's
  work per call, or the GPU's (its kernels, and the gaps between them).
- host: time.perf_counter around a burst of 100 calls, the median of 3 bursts. A burst launches
  fewer calls than the GPU's queue holds, so no call waits for the GPU unless it synchronises
  itself: this is the CPU's own time per call.
- GPU: the durations of the kernels (and copies) one call launches, as torch's profiler (CUPTI)
  records them.
- host, profiler run: the host time measured again after the GPU column. Once the profiler has
  run in a process, a later call there may cost the host more.

The first two are taken in --rounds rounds, every entry once a round, in an order rotated from
round to round, and reported as the median of the rounds with their range. The GPU column is
measured after all rounds, so the profiler cannot slow the first two.

--profile also prints cProfile's top functions (by own time) over --calls calls of each entry
except SDPA and FA4."""

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time

import torch

from common.tools import stage_table, timing
from common.tools.bench import paged_copy


def per_call_us(fn, calls):
    """Microseconds per call of fn() over `calls` calls back to back (CUDA events)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def host_us(fn, calls=100, bursts=7):
    """Microseconds of host time per call: the median over `bursts` bursts of `calls` calls
    timed by time.perf_counter, the GPU synchronised before each burst (so its queue has room
    for every launch of the burst)."""
    times = []
    for _ in range(bursts):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


NO_GRAD_OP = "torch.ops.flash_tutorial.attention, no_grad"


def grad_mode(label):
    """The grad mode an entry is timed under (inside main's inference_mode)."""
    if label == NO_GRAD_OP:
        return _no_grad()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _no_grad():
    with torch.inference_mode(False), torch.no_grad():
        yield


def entries(q, k, v):
    """{label: callable} of the entries that exist here."""
    from common import arch

    out = {}
    for n in (12, 13):
        if stage_table.available(n, arch.track()):
            mod = stage_table.track_module(n, arch.track())
            out[f"stage {n}"] = lambda mod=mod: mod.attention(q, k, v, causal=True)
            if n == 13:
                out["stage 13, split in 2 (num_splits=2)"] = lambda mod=mod: mod.attention(
                    q, k, v, causal=True, num_splits=2
                )
    if stage_table.available(14, arch.track()):
        mod = stage_table.track_module(14, arch.track())
        # page_table and seqused_k made outside inference mode carry a version counter: their
        # values are read to the host once and remembered (common/checks.py); made inside it,
        # they are read at every call; check_values=False reads them never.
        with torch.inference_mode(False):
            kc, vc, table, used = paged_copy(k, v, 64)
        out["stage 14, paged (64 keys a page)"] = lambda: mod.attention_paged(
            q, kc, vc, table, used, causal=True
        )
        table_i, used_i = table.clone(), used.clone()  # inference tensors (called inside it)
        out["stage 14, paged, table from inference mode"] = lambda: mod.attention_paged(
            q, kc, vc, table_i, used_i, causal=True
        )
        out["stage 14, paged, check_values=False"] = lambda: mod.attention_paged(
            q, kc, vc, table_i, used_i, causal=True, check_values=False
        )
    try:
        from common import ops

        out["ops.attention (eager: direct)"] = lambda: ops.attention(q, k, v, causal=True)
        op = torch.ops.flash_tutorial.attention
        out["torch.ops.flash_tutorial.attention"] = lambda: op(q, k, v, None, True, None, None)
        out[NO_GRAD_OP] = out["torch.ops.flash_tutorial.attention"]
    except Exception as e:  # reported, not fatal
        print(f"custom op: not available ({type(e).__name__}: {e})")
    out["SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    try:
        from flash_attn.cute import flash_attn_func

        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out["FA4"] = lambda: flash_attn_func(qt, kt, vt, causal=True)
    except Exception:
        pass
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(1, 8, 256, 128, generator=g, device="cuda").bfloat16() for _ in range(2))
    gpu_name = torch.cuda.get_device_name()
    print(
        f"host work per call on {gpu_name}: Q (1, 32, 1, 128), K, V (1, 8, 256, 128), bf16, causal"
    )
    with torch.inference_mode():
        fns = entries(q, k, v)
        names = list(fns)
        events, host = {n: [] for n in names}, {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                with grad_mode(n):
                    events[n].append(per_call_us(fns[n], args.calls))
                    host[n].append(host_us(fns[n], bursts=3))
            print(f"  round {r + 1} of {args.rounds} done", flush=True)
        gpu, after = {}, {}
        for n in names:
            with grad_mode(n):
                gpu[n] = timing.gpu_ms(fns[n], [()], reps=50) * 1e3
        # The host time again, now that the profiler has run in this process.
        for n in names:
            with grad_mode(n):
                after[n] = host_us(fns[n], bursts=3)
        print(
            f"\n  {'us per call (median of the rounds, range)':44s} {'back to back':>18s}", end=""
        )
        print(f" {'host':>18s} {'GPU':>7s} {'host, profiler run':>19s}")
        for n in names:
            cells = [
                f"{statistics.median(x):6.1f} ({min(x):.1f}-{max(x):.1f})"
                for x in (events[n], host[n])
            ]
            print(
                f"  {n:44s} {cells[0]:>18s} {cells[1]:>18s} {gpu[n]:7.1f} {after[n]:19.1f}",
                flush=True,
            )
        for label in [
            name for name in fns if args.profile and not name.startswith(("SDPA", "FA4"))
        ]:
            print(f"\ncProfile of {args.calls} calls: {label}")
            prof = cProfile.Profile()
            with grad_mode(label):
                prof.enable()
                for _ in range(args.calls):
                    fns[label]()
                prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
