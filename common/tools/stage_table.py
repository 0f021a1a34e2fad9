"""The stage table: one row per stage, shared by the tour, the compile checks, the notebooks and
the benchmarks."""

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Stage:
    number: int
    package: str  # stages.<package>
    entry: str  # entry function name
    title: str
    concept: str
    compile_shape: tuple  # shape used for compile-only checks
    tour_shape: tuple  # shape used for the correctness/speed line of `make tour`


STAGES = (
    Stage(
        1,
        "stage1_gemm",
        "gemm",
        "GEMM",
        "TMA, swizzled smem, mbarrier pipeline, the matrix instruction, the epilogue",
        (1024, 1024, 1024),
        (8192, 8192, 8192),
    ),
    Stage(
        2,
        "stage2_qk",
        "qk",
        "QK^T only",
        "batching over (B, H) with rank-4 TMA, Q resident, K streaming",
        (2, 4, 512, 512, 128),
        (4, 16, 1024, 1024, 128),
    ),
    Stage(
        3,
        "stage3_softmax",
        "attention",
        "single-KV-tile softmax",
        "row max/sum, exp2, P as the A operand of the second GEMM",
        (2, 4, 512, 128, 128),
        (16, 16, 1024, 128, 128),
    ),
    Stage(
        4,
        "stage4_kv_interleave",
        "attention",
        "KV interleave, V overwrites K",
        "one smem ring for K and V, the K->V slot hazard, exact two-pass softmax",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        5,
        "stage5_online_softmax",
        "attention",
        "online softmax",
        "running max and sum, O rescaled, one pass, LSE",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        6,
        "stage6_masks",
        "attention",
        "causal and window masks",
        "the KV-tile range of a Q tile, skipped tiles, element masks only on edge tiles",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        7,
        "stage7_gqa_varlen",
        "attention",
        "GQA/MQA and packed sequences",
        "KV heads shared through TMA coordinates, per-sequence offsets and bounds",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        8,
        "stage8_warp_specialized",
        "attention",
        "warp specialisation",
        "a TMA producer (setmaxnreg gives its registers away) and consumers on their own rows",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        9,
        "stage9_pingpong",
        "attention",
        "ping-pong",
        "two softmax / consumer warpgroups take turns on the tensor cores",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        10,
        "stage10_overlap",
        "attention",
        "overlap inside the loop",
        "QK^T of one KV tile issued with PV of the last, softmax under the PV",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        11,
        "stage11_persistent",
        "attention",
        "persistent CTAs",
        "one CTA per SM walks work tiles: a fixed share or an atomic scheduler, longest first",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        12,
        "stage12_last_percent",
        "attention",
        "the last percent",
        "each tuning as its own switchable change (Blackwell: FA4's, compile-checked)",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        13,
        "stage13_split_kv",
        "attention",
        "split-KV (FlashDecoding)",
        "a work tile's KV range cut into splits, fp32 partial O and LSE, the combine kernel",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
    Stage(
        14,
        "stage14_paged_kv",
        "attention",
        "a paged KV cache",
        "K and V in pages listed by a page table, loaded by TMA a page or a tile at a time",
        (2, 4, 512, 1024, 128),
        (2, 16, 8192, 8192, 128),
    ),
)

BY_NUMBER = {s.number: s for s in STAGES}


def stage(n):
    try:
        return BY_NUMBER[n]
    except KeyError:
        raise ValueError(f"stage {n} does not exist; stages are {sorted(BY_NUMBER)}") from None


def module_path(n, track):
    return f"stages.{stage(n).package}.{track}"


def track_module(n, track):
    """The kernel module of stage n on `track` ('hopper' or 'blackwell')."""
    return importlib.import_module(module_path(n, track))


def available(n, track):
    """Whether the stage file exists (later stages land over time)."""
    import importlib.util

    return importlib.util.find_spec(module_path(n, track)) is not None
