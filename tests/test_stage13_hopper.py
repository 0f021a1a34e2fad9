"""Stage 13 (Hopper), compile-only checks on the CPU: the split-KV kernel and the unsplit one
compile for sm_90a in every mode (batch and packed, with and without seqused_k, masks, GQA,
pack-GQA, both dtypes and head dims) without a spill and with setmaxnreg kept; the split kernel
stores O in fp32 from registers (no stmatrix, no shared-memory O) and reads seqused_k; the
combine kernel compiles for sm_90a and sm_100a."""

import pytest
import torch
from test_stage11_hopper import check_no_spills, compile_stage, statements

from common.tools import stage_table

h13 = stage_table.track_module(13, "hopper")

CONFIGS = [
    dict(num_splits=16),
    dict(num_splits=16, kv_heads=1),
    dict(num_splits=4, causal=True, kv_heads=2),
    dict(num_splits=4, varlen=True, seqused_k=True),
    dict(num_splits=3, window=(64, 0)),
    dict(num_splits=1, seqused_k=True),
    dict(),
]


def config_id(c):
    return "-".join(f"{k}={v}" for k, v in c.items()) or "default"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_compiles_without_spills(config, D, dtype):
    kernel, ptx, counts, res = compile_stage(h13, dtype, D, **config)
    check_no_spills(kernel, ptx, res)
    assert kernel.split_kv == (config.get("num_splits", 1) > 1)
    stmatrix = statements(ptx, r"stmatrix")
    f32_stores = statements(ptx, r"st\.global(\.v\d)?\.(f32|b32)")
    if kernel.split_kv:
        # O_partial from registers: fp32 global stores, no stmatrix into a shared O tile.
        assert f32_stores and not stmatrix
    else:
        assert stmatrix


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("D", [64, 128])
def test_combine_compiles(arch, D):
    from common.combine import Combine
    from common.cute_interop import cute_dtype, fake_stream, fake_tensor
    from common.tools.ptx import compile_for_arch

    kernel = Combine(cute_dtype(torch.bfloat16), D, Combine.lanes_for(16, D))
    args = (
        fake_tensor(torch.float32, (16, 2, 8, 1, D), dynamic=True),
        fake_tensor(torch.float32, (16, 2, 8, 1), dynamic=True),
        fake_tensor(torch.bfloat16, (2, 8, 1, D), dynamic=True),
        fake_tensor(torch.float32, (2, 8, 1), dynamic=True),
        fake_stream(),
    )
    ptx, cubin = compile_for_arch(kernel, args, arch)
    assert cubin and "ex2.approx" in ptx and "lg2.approx" in ptx
    # A decode row's combine is bound by its loads' latency: one LSE load a thread, and
    # loads_in_flight 16-byte loads of O_s issued before the first barrier (and as many again
    # in the loop for splits past lanes x loads_in_flight); rolled, the kernel would have 2.
    loads = [ln.strip() for ln in ptx.splitlines() if ln.strip().startswith("ld.global")]
    vector = ("ld.global.v4.f32", "ld.global.v4.b32", "ld.global.v2.b64")
    assert len(loads) == 1 + 2 * kernel.loads_in_flight, loads
    assert sum(ln.startswith(vector) for ln in loads) == 2 * kernel.loads_in_flight, loads
    # The 4 columns of O go out in one 8-byte store; two barriers (LSEs, then the lanes' sums).
    stores = [ln.strip() for ln in ptx.splitlines() if ln.strip().startswith("st.global")]
    assert any(
        ln.startswith(("st.global.v4.b16", "st.global.v2.b32", "st.global.b64")) for ln in stores
    ), stores
    assert len([ln for ln in ptx.splitlines() if ln.strip().startswith("bar.sync")]) == 2


def test_combine_lanes():
    from common.combine import Combine

    # splits read at once: the power of two at or above the split count, 2 ... 256 / (D / 4)
    assert [Combine.lanes_for(n, 128) for n in (2, 3, 5, 8, 9, 16, 64, 256)] == [
        2,
        4,
        8,
        8,
        8,
        8,
        8,
        8,
    ]
    assert [Combine.lanes_for(n, 64) for n in (2, 4, 16, 17, 256)] == [2, 4, 16, 16, 16]
    for D in (64, 128):
        for n in range(2, 257):
            k = Combine(None, D, Combine.lanes_for(n, D))
            # every split's LSE has a thread of its row, and a warp belongs to one row
            assert k.row_threads >= n and k.row_threads % 32 == 0 and k.rows_per_cta >= 1


@pytest.mark.parametrize("stage", [13, 14])
def test_decode_tile_takes_one_warpgroup_and_no_turns(stage):
    """The decode tile (launch_options): query rows that fit in 64 (G x Sq = 4 here) get one
    consumer warpgroup on a 64-row tile, one row more than 64 (G x Sq = 68) keeps two. The
    compiled kernel has no turn barriers (only the CTA's barrier 0 and the consumers' barrier
    1), initialises its mbarriers with one warpgroup's arrival counts, and the CPU model of its
    mbarrier protocol with those counts has no hang or race, over ring wraps."""
    import re

    import cutlass

    from common.tools.barrier_protocol import (
        arrival_counts,
        counts_from_ptx,
        cta_programs,
        explore_cta,
    )
    from common.tools.ptx import compile_for_arch

    module = stage_table.track_module(stage, "hopper")
    kernel, args = module.compile_args(
        torch.bfloat16, (1, 32, 1, 8192, 128), kv_heads=8, num_splits=16
    )
    assert (kernel.mma_warpgroups, kernel.cta_tile[0], kernel.threads) == (1, 64, 256)
    assert kernel.kv_slots == 6  # Q and O of 16 KiB each leave room for a sixth K/V slot
    wider, _ = module.compile_args(torch.bfloat16, (1, 32, 17, 8192, 128), kv_heads=8)
    assert (wider.mma_warpgroups, wider.cta_tile[0]) == (2, 128)
    ptx, _ = compile_for_arch(kernel, args, "sm_90a")
    named = statements(ptx, r"bar(rier)?\.(sync|arrive)")
    assert named and all(re.match(r"bar(rier)?\.sync\s+(0;|1, 128;)", s) for s in named), named
    assert counts_from_ptx(ptx, kernel.kv_slots) == arrival_counts(kernel)
    assert explore_cta(cta_programs(kernel, [4]), arrival_counts(kernel)) == set()
    small = module.Sm90Kernel(cutlass.BFloat16, 128, mma_warpgroups=1)
    small.kv_slots = 2
    for tiles in ([3], [1, 3], [2, 0, 1]):
        assert explore_cta(cta_programs(small, tiles), arrival_counts(small)) == set(), tiles
