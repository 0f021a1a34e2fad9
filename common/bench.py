"""Benchmarking: event-timed medians after warm-up, inputs rotated past L2, TFLOP/s, and the
baselines timed in the same run (cuBLAS via torch.matmul; torch SDPA flash and cuDNN backends;
FA4 when importable)."""

import statistics

import torch

L2_BYTES = 60 * 1024 * 1024  # H100/H200: 50/60 MB; rotating > 2x this many bytes defeats it


def rotation_count(bytes_per_set, l2_bytes=L2_BYTES):
    """How many distinct input sets to cycle through so a set is evicted from L2 before reuse."""
    return max(1, min(16, -(-3 * l2_bytes // max(1, bytes_per_set))))


def time_ms(fn, arg_sets, warmup=5, reps=30):
    """Median milliseconds of fn(*args), cycling over arg_sets (rotation past L2), each launch
    timed with its own pair of CUDA events after `warmup` untimed launches."""
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


def gpu_ms(fn, arg_sets, reps=10):
    """Milliseconds of GPU work per call of fn(*args): the durations of every CUDA kernel the calls
    launched, as CUPTI records them (torch.profiler), summed and divided by reps. Unlike
    time_ms it leaves out the host work between kernels, so the two differ where a call's host
    work (checks, views, the launch) is longer than its kernels."""
    from torch.profiler import ProfilerActivity, profile

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


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def sdpa_backend_fn(backend_name, causal=False):
    """torch SDPA pinned to one backend ('flash' or 'cudnn'), or None if it cannot run here.
    causal=True is SDPA's is_causal (top-left aligned: the same mask as this tutorial's only
    when Sq == Sk, which every benchmark shape has)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[
        backend_name
    ]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


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


def gpu_and_date():
    import datetime

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return name, datetime.date.today().isoformat()
