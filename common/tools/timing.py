"""Benchmarking: event-timed medians after warm-up, inputs rotated past L2, TFLOP/s, and the
baselines timed in the same run (cuBLAS via torch.matmul; torch SDPA flash and cuDNN backends;
FA4 when importable)."""

import contextlib
import statistics
import time
import warnings

import torch

# FA4's forward hands the CuTe DSL an argument it cannot convert (flash_attn.cute.utils.AuxData)
# and the DSL says so on FA4's first call of each shape; it concerns FA4's code, not what is
# timed here, so the baselines run without it.
warnings.filterwarnings(
    "ignore",
    message=r"Argument aux_data .* cannot be converted to a JitArgument",
    category=UserWarning,
)

L2_BYTES = 60 * 1024 * 1024  # H100/H200: 50/60 MB; rotating > 2x this many bytes defeats it


def rotation_count(bytes_per_set, l2_bytes=L2_BYTES):
    """How many distinct input sets to cycle through so a set is evicted from L2 before reuse."""
    return max(1, min(16, -(-3 * l2_bytes // max(1, bytes_per_set))))


def pinned(backend, call):
    """`call` run inside SDPA's sdpa_kernel(backend), which picks the backend SDPA runs. Called
    directly it enters that context at each call; time_ms and gpu_ms enter it once around all
    their launches and time `call` alone, so that a call timed back to back does not include the
    context's own Python work, which a model pays once, not per call."""
    from torch.nn.attention import sdpa_kernel

    def run(*args):
        with sdpa_kernel(backend):
            return call(*args)

    run.timed = call
    run.outer_context = lambda: sdpa_kernel(backend)
    return run


def _unpinned(fn):
    """(what to time, the context to time it in) for fn: pinned's call and its context, or fn
    and no context."""
    if hasattr(fn, "timed"):
        return fn.timed, fn.outer_context()
    return fn, contextlib.nullcontext()


def time_ms(fn, arg_sets, warmup=5, reps=30):
    """Median milliseconds of fn(*args), cycling over arg_sets (rotation past L2), each launch
    timed with its own pair of CUDA events after `warmup` untimed launches (a pinned SDPA call
    inside its backend's context, entered once)."""
    fn, context = _unpinned(fn)
    with context:
        for i in range(warmup):
            fn(*arg_sets[i % len(arg_sets)])
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            args = arg_sets[i % len(arg_sets)]
            starts[i].record()
            fn(*args)
            ends[i].record()
        torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def elapsed_ms(fn):
    """Milliseconds from before fn() is issued to when the GPU finishes what it issued (one
    CUDA-event pair around the call; for a loop that runs once, as a decode run is). Without
    CUDA, the wall time of the call."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def gpu_ms(fn, arg_sets, reps=10):
    """Milliseconds of GPU work per call of fn(*args): the durations of every CUDA kernel the calls
    launched, as CUPTI records them (torch.profiler), summed and divided by reps. Unlike
    time_ms it leaves out the host work between kernels, so the two differ where a call's host
    work (checks, views, the launch) is longer than its kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn, context = _unpinned(fn)
    with context:
        fn(*arg_sets[0])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(reps):
                fn(*arg_sets[i % len(arg_sets)])
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return float("nan")
    return sum(e.device_time for e in kernels) / reps / 1e3  # device_time is in us


def interleaved(fns, rounds=5, reps=6, gpu=False):
    """Time several callables against each other: {name: ms} for fns = {name: (fn, arg_sets)},
    or ({name: ms}, {name: GPU ms}) with gpu=True. Each round times every fn once (time_ms with
    `reps` launches; gpu_ms with as many), the order rotated from round to round, and a fn's
    result is the median of its rounds. The event rounds all come before the GPU-time rounds
    (the profiler is not running while the events are timed).

    Why rounds: the H200's clocks move with heat and power over seconds of sustained load, in
    steps of 5-10% (measured on the H200, 2026-12-02: FA4 at D = 128, causal, S = 8k took
    785 us per call from events and 872-882 us a moment later under the profiler; six kernels
    timed again right after their profiler runs took 3-11% longer than the first time), so
    timing one kernel's reps after another's biases the ratio towards whichever ran first.
    Rotating rounds give every fn the same mix of clocks."""
    names = list(fns)
    ev = {n: [] for n in names}
    gp = {n: [] for n in names}
    for series, timer in ((ev, lambda f, s: time_ms(f, s, warmup=2, reps=reps)),) + (
        ((gp, lambda f, s: gpu_ms(f, s, reps=reps)),) if gpu else ()
    ):
        for r in range(rounds):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                fn, sets = fns[n]
                series[n].append(timer(fn, sets))
    ev = {n: statistics.median(v) for n, v in ev.items()}
    if not gpu:
        return ev
    return ev, {n: statistics.median(v) for n, v in gp.items()}


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def sdpa_backend_fn(backend_name, causal=False):
    """torch SDPA pinned to one backend ('flash' or 'cudnn'), or None if it cannot run here.
    causal=True is SDPA's is_causal (top-left aligned: the same mask as this tutorial's only
    when Sq == Sk, which every benchmark shape has)."""
    from torch.nn.attention import SDPBackend

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[
        backend_name
    ]
    return pinned(
        backend,
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
    )


def fa4_fn(causal=False):
    """FA4's CuTe DSL forward (flash_attn.cute), which takes (B, S, H, D); None if not importable."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        return None

    def run(q, k, v):
        # q, k, v arrive as (B, H, S, D); FA4 wants (B, S, H, D): a transposed view costs nothing
        # only if the memory is already (B, S, H, D), so the caller passes pre-transposed copies.
        return flash_attn_func(q, k, v, causal=causal)

    return run


def gpu_state():
    """The GPU's SM clock, power draw, temperature and the active clock-event reasons as
    nvidia-smi reports them (one line), or None where nvidia-smi is absent or fails."""
    import subprocess

    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        query = f"clocks.sm,power.draw,temperature.gpu,{reasons}"
        try:
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode == 0 and out.stdout.strip():
            sm, power, temp, why = (x.strip() for x in out.stdout.strip().split(","))
            return f"SM clock {sm}, {power}, {temp} C, clock-event reasons {why}"
    return None


def file_tag(gpu):
    """The GPU's name as the results files carry it: 'NVIDIA H200' -> 'h200'."""
    return gpu.replace("NVIDIA ", "").replace(" ", "_").lower()


def gpu_and_date():
    import datetime

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return name, datetime.date.today().isoformat()
