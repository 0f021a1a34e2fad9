"""One 'case' per stage: how to make its inputs, run it, compute its reference and PyTorch's own
low-precision result, count its FLOPs and time its baselines. The tour, the benchmarks and the
notebooks all use these, so a stage is run the same way everywhere."""

import dataclasses

import torch

from common.tools import inputs, reference, stage_table, timing


@dataclasses.dataclass
class Case:
    stage: int
    shape: tuple
    dtype: torch.dtype
    args: tuple  # inputs of the entry
    run: callable  # run() -> output(s) of the kernel
    ref: callable  # ref() -> high-precision reference of the main output
    lowp: callable  # lowp() -> PyTorch in the inputs' precision (the error yardstick)
    flops: int
    baselines: dict  # name -> fn(*args) timed next to the kernel
    rtol: float
    fn: callable = None  # fn(*args): the kernel call that is timed (default: the entry itself)


def _entry(n, track):
    return getattr(stage_table.track_module(n, track), stage_table.stage(n).entry)


def make_case(n, track, shape, dtype=torch.bfloat16, seed=0, with_fa4=False, causal=False):
    """causal (stage 6 on): the kernel and every baseline run causal, FLOPs halved."""
    entry = _entry(n, track)
    if n == 1:
        M, N, K = shape
        a, b = inputs.gemm_inputs(M, N, K, dtype, seed)
        # fp32 accumulation over K terms then one rounding to bf16/fp16: ~2^-9 (bf16) relative.
        return Case(
            n,
            shape,
            dtype,
            (a, b),
            lambda: entry(a, b),
            lambda: reference.gemm_ref(a, b),
            lambda: a @ b.T,
            reference.gemm_flops(M, N, K),
            {"cuBLAS (torch.matmul)": lambda a, b: torch.matmul(a, b.T)},
            1e-2,
        )
    B, H, Sq, Sk, D = shape
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed)
    if n == 2:
        scale = D**-0.5
        # S is written in fp32 and every product of two bf16/fp16 numbers is exact in fp32: only
        # the fp32 summation order differs from the fp64 reference (about 1e-7 relative), so the
        # yardstick is PyTorch's fp32 product and the ceiling 1e-4.
        return Case(
            n,
            shape,
            dtype,
            (q, k),
            lambda: entry(q, k),
            lambda: reference.qk_ref(q, k),
            lambda: (q.float() @ k.float().transpose(-1, -2)) * scale,
            2 * B * H * Sq * Sk * D,
            {"cuBLAS (torch.matmul)": lambda q, k: torch.matmul(q, k.transpose(-1, -2))},
            1e-4,
        )
    base = {
        "SDPA flash": timing.sdpa_backend_fn("flash", causal),
        "SDPA cuDNN": timing.sdpa_backend_fn("cudnn", causal),
    }
    if with_fa4 and timing.fa4_fn() is not None:
        base["FA4"] = timing.fa4_fn(causal)
    mask = None
    if n >= 6:
        from common import masks

        fn = lambda q, k, v: entry(q, k, v, causal=causal)  # noqa: E731
        if causal:
            mask = masks.visible(Sq, Sk, *masks.resolve_window(True, None, Sq, Sk), q.device)
    else:
        if causal:
            raise ValueError(f"stage {n} has no causal mask (stage 6 adds it)")
        fn = entry
    # bf16 P and a bf16 output: about 1e-2 relative at most, and within a small multiple of
    # PyTorch's own bf16 attention error.
    return Case(
        n,
        shape,
        dtype,
        (q, k, v),
        lambda: fn(q, k, v),
        lambda: reference.attention_ref(q, k, v, mask=mask)[0],
        lambda: reference.attention_lowp(q, k, v, mask=mask),
        reference.attention_flops(B, H, Sq, Sk, D, causal),
        base,
        1e-2,
        fn,
    )
