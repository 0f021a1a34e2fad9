"""Clock and power under sustained load: does a kernel lose to another because it does less work
per cycle, or because it runs at a lower clock?

The H200 caps its power at 700 W and lowers the SM clock to stay under it, so a kernel that
draws more power per FLOP (more instructions issued for the same tensor-core work, say) runs at
a lower clock than one that draws less, even when both are timed in the same interleaved rounds.
This probe runs each kernel back to back for a window of seconds while `nvidia-smi` samples the
SM clock and the power draw every 20 ms, and reports per window the TFLOP/s, the median clock
and power, and TFLOP/s per GHz (the work per cycle, the clock taken out).

    python -m common.tools.clock_probe [--window 2.0] [--out results/clock_probe_{gpu}_{date}.json]

Stage 12 (Hopper), FA4 where importable and SDPA cuDNN, bf16, the paper shapes at S = 8k and
16k, D = 128 and 64, non-causal, two rounds each. GPU only; nothing here changes the GPU's
settings (no clock locking).
"""

import argparse
import json
import os
import subprocess
import time
from datetime import datetime

SHAPES = [
    (2, 16, 8192, 8192, 128),
    (1, 16, 16384, 16384, 128),
    (2, 32, 8192, 8192, 64),
    (1, 32, 16384, 16384, 64),
]
SMI_QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def parse_samples(lines):
    """nvidia-smi's CSV lines (SMI_QUERY, noheader, nounits) -> [(unix time, MHz, W, C, reasons)];
    lines that do not parse (a header, a cut-off last line) are skipped. nvidia-smi prints local
    time, which strptime(...).timestamp() reads as local time too."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except (ValueError, IndexError):
            continue
    return out


def window_stats(t0, t1, samples, settle_s=0.3):
    """Median SM clock (MHz) and power (W) of the samples inside [t0 + settle_s, t1], their
    count and the set of clock-event reasons seen; (None, None, 0, []) if none fell inside."""
    inside = [s for s in samples if t0 + settle_s <= s[0] <= t1]
    if not inside:
        return None, None, 0, []
    clk = sorted(s[1] for s in inside)
    pw = sorted(s[2] for s in inside)
    return clk[len(clk) // 2], pw[len(pw) // 2], len(inside), sorted({s[4] for s in inside})


def _window(fn, sets, seconds):
    """Calls of fn for `seconds`, 4 at a time (a pinned SDPA call inside its backend's context,
    entered once: timing.pinned): (start, end, calls, ms a call between CUDA events)."""
    import torch

    from common.tools import timing

    fn, context = timing._unpinned(fn)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with context:
        torch.cuda.synchronize()
        t0 = time.time()
        start.record()
        calls = 0
        while time.time() - t0 < seconds:
            for _ in range(4):
                fn(*sets[calls % len(sets)])
                calls += 1
            torch.cuda.synchronize()
        stop.record()
        torch.cuda.synchronize()
    return t0, time.time(), calls, start.elapsed_time(stop) / calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=2.0, help="seconds per kernel and round")
    ap.add_argument(
        "--out",
        default="results/clock_probe_{gpu}_{date}.json",
        help="the JSON file; {gpu} and {date} are filled in (default results/clock_probe_{gpu}_{date}.json)",
    )
    args = ap.parse_args(argv)

    import torch

    from common.outputs import no_poison
    from common.tools import timing
    from common.tools.bench import _rotated_sets
    from common.tools.workloads import make_case

    if not torch.cuda.is_available():
        raise SystemExit("clock_probe: needs a CUDA GPU (it times kernels under sustained load)")
    log_path = "/tmp/clock_probe_smi.csv"
    with open(log_path, "w") as log:
        smi = subprocess.Popen(
            [
                "nvidia-smi",
                f"--query-gpu={SMI_QUERY}",
                "--format=csv,noheader,nounits",
                "-lms",
                "20",
            ],
            stdout=log,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1)
        rows = []
        try:
            with no_poison():
                for shape in SHAPES:
                    case = make_case(12, "hopper", shape, with_fa4=True)
                    sets = _rotated_sets(case)
                    fa_sets = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in sets]
                    fns = {"stage 12": (case.fn, sets)}
                    if "FA4" in case.baselines:
                        fns["FA4"] = (case.baselines["FA4"], fa_sets)
                    fns["SDPA cuDNN"] = (case.baselines["SDPA cuDNN"], sets)
                    for fn, s in fns.values():
                        fn(*s[0])  # compile outside the windows
                    for rnd in range(2):
                        for name, (fn, s) in fns.items():
                            t0, t1, calls, ms = _window(fn, s, args.window)
                            tf = timing.tflops(case.flops, ms)
                            rows.append(
                                dict(
                                    shape=shape,
                                    kernel=name,
                                    round=rnd,
                                    t0=t0,
                                    t1=t1,
                                    calls=calls,
                                    ms=ms,
                                    tflops=tf,
                                )
                            )
                            print(
                                f"{shape} {name:10s} round {rnd}: {ms:.3f} ms, {tf:.0f} TFLOP/s",
                                flush=True,
                            )
        finally:
            smi.terminate()
            smi.wait()
    with open(log_path) as f:
        samples = parse_samples(f)
    print(f"{len(samples)} nvidia-smi samples")
    for r in rows:
        clk, pw, n, reasons = window_stats(r["t0"], r["t1"], samples)
        r.update(clock_mhz=clk, power_w=pw, n_samples=n, reasons=reasons)
        r["tflops_per_ghz"] = r["tflops"] / (clk / 1000) if clk else None
    print(
        "| shape | kernel | round | TFLOP/s | SM clock MHz (median) | power W (median) | TFLOP/s per GHz | samples |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        per_ghz = f"{r['tflops_per_ghz']:.0f}" if r["tflops_per_ghz"] else "-"
        print(
            f"| {r['shape']} | {r['kernel']} | {r['round']} | {r['tflops']:.0f} | {r['clock_mhz']} "
            f"| {r['power_w']} | {per_ghz} | {r['n_samples']} |"
        )
    name, date = timing.gpu_and_date()
    out = args.out.format(gpu=timing.file_tag(name), date=date)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(gpu=name, date=date, window_s=args.window, rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
