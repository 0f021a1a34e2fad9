"""Host work per call: how long an entry point keeps the CPU busy at a tiny shape.

    python -m common.tools.host_time [--calls 2000] [--profile]

For each entry (stages 12 and 13; stage 14 on a paged cache, its page_table and seqused_k made
outside inference mode (their values read once), inside it (read at every call) and with
check_values=False (never read); common/ops.py's wrapper, which calls the stage directly in eager
mode, and its custom op through torch.ops; SDPA, FA4 where importable), three numbers per call,
after warm-up (compiles). A decode step at batch 1: Q (1, 32, 1, 128), K and V (1, 8, 256, 128),
bf16, causal.

- back to back: N calls between two CUDA events. Whichever is slower sets it: the host's work
  per call, or the GPU's (its kernels, and the gaps between them).
- host: time.perf_counter around bursts of 100 calls that the GPU may lag behind (fewer launches
  than its queue holds, so no call waits for the GPU unless it synchronises itself), the median
  of 7 bursts. The CPU's own time per call.
- GPU: the durations of the kernels (and copies) one call launches, as the profiler records them.

--profile adds cProfile's top functions (by own time) for the calls of stages 12-14 and of the
ops."""

import argparse
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


def entries(q, k, v):
    """{label: callable} of the entries that exist here."""
    from common import arch

    out = {}
    for n in (12, 13):
        if stage_table.available(n, arch.track()):
            mod = stage_table.track_module(n, arch.track())
            out[f"stage {n}"] = lambda mod=mod: mod.attention(q, k, v, causal=True)
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
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(1, 8, 256, 128, generator=g, device="cuda").bfloat16() for _ in range(2))
    gpu = torch.cuda.get_device_name()
    print(f"host work per call on {gpu}: Q (1, 32, 1, 128), K, V (1, 8, 256, 128), bf16, causal")
    with torch.inference_mode():
        fns = entries(q, k, v)
        print(f"  {'us per call':44s} {'back to back':>12s} {'host':>7s} {'GPU':>7s}")
        for label, fn in fns.items():
            events = per_call_us(fn, args.calls)
            host = host_us(fn)
            gpu = timing.gpu_ms(fn, [()], reps=50) * 1e3
            print(f"  {label:44s} {events:12.1f} {host:7.1f} {gpu:7.1f}", flush=True)
        for label in [
            name for name in fns if args.profile and not name.startswith(("SDPA", "FA4"))
        ]:
            print(f"\ncProfile of {args.calls} calls: {label}")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fns[label]()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
