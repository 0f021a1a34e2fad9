"""Stage 11 (Blackwell): persistent CTAs - one CTA per SM walking work tiles, a fixed share or
drawn from an atomic tile scheduler, the tile number handed from the TMA warp to the other roles
through shared memory, on sm_100a.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch mode and packed: stage 10's roles,
  setmaxnreg counts and MMA order; the tile scheduler's atomic add; the tile hand-over's
  barriers (32 and 416 arrivals); the ring next to Q (8 slots at D = 64, 4 at D = 128) within
  227 KiB; the tcgen05 fences at the TMEM hand-offs counted, every path fenced
  (tests/blackwell_ptx.py); no spill (ptxas of CUDA 13.0, 2026-12-06), here and in stage 9's
  other configurations.
- CPU: the schedule checker replays the five roles over several work tiles with every pipeline
  state running on (common/tools/schedule.py): no hang, every hand-off balanced, no wait passing
  on a phase not yet completed; a state made anew per work tile (a phase off by one) is caught.
  The tile order covers every tile once, longest first in L2 sections.
- GPU tests (marker gpu_blackwell): stage 7's numerical tests run on this stage from
  tests/test_stage7.py. Not run: no sm_100 GPU was available (2026-12-04).
"""

import re

import cutlass
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from blackwell_ptx import (
    SPILL_CONFIGS,
    assert_no_spill,
    assert_no_spill_in,
    assert_tcgen05_fences,
)
from ptxas_checks import ptxas_ran

from common.tools import schedule
from common.tools.ptx import compile_for_arch, compile_only, tcgen05_mma_order
from stages.stage11_persistent import blackwell

SHAPE = (2, 8, 512, 1024, 128)


def statements(ptx, pattern):
    return [s.strip() for s in ptx.splitlines() if re.match(pattern, s.strip())]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_compiles_persistent(varlen, D, dtype):
    report = compile_only(
        11, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), kv_heads=2, varlen=varlen, causal=True
    )
    ten = compile_only(10, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), resources=False)
    ptx = report.ptx
    # stage 10's roles, registers and MMA order, now inside each role's loop over work tiles
    assert ".reqntid 512, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert len(statements(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+184;")) == 2
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+96;")) == 1
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+48;")) == 3
    assert tcgen05_mma_order(ptx) == tcgen05_mma_order(ten.ptx)
    # the tile scheduler's draw (one atomic add) and the hand-over's barriers: 32 arrivals
    # (the TMA warp) on full, 416 (13 warps) on empty
    assert len(statements(ptx, r"atom\.global\.add")) == 1
    counts = [c for _, c in schedule.mbarrier_init_counts(ptx)]
    assert counts.count(416) == 1 and 32 in counts
    # stage 10's fences: the per-tile hand-offs are the same code, now in loops
    assert_tcgen05_fences(ptx, before=11, after=16 if D == 64 else 12)
    # Q and the ring, within the 227 KiB an SM gives one CTA; O by threads' rows, as stage 10
    kernel = blackwell.compile_args(dtype, (*SHAPE[:4], D))[0]
    assert kernel.kv_slots == {64: 8, 128: 4}[D]
    assert report.shared_memory_bytes <= 227 * 1024
    assert not statements(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")
    if ptxas_ran(report.resources, "sm_100a"):
        # ptxas of CUDA 13.0 (2026-12-06): no spill
        assert_no_spill(report, registers=128)


@pytest.mark.parametrize("config", list(SPILL_CONFIGS))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_no_spill_in_any_configuration(dtype, D, config):
    """At 184 / 80 / 64 (the correction warpgroup at 80) this stage spilled 36-100 bytes here:
    the work-tile loop keeps more of its values live (ptxas of CUDA 13.0, 2026-12-06)."""
    assert_no_spill_in(11, dtype, D, config)


# ---------------------------------------------------------------- the schedule, on the CPU


def traced_kernel(D):
    kernel, args = blackwell.compile_args(torch.bfloat16, (1, 2, 512, 1024, D))
    compile_for_arch(kernel, args, "sm_100a")
    return kernel


WORK = (
    [(0, 1)],
    [(0, 3), (2, 5), (0, 1)],
    [(0, 2), (0, 0), (1, 3)],
    [(0, 0), (0, 0)],
    [(0, 1)] * 5,
    [(0, 4), (0, 3), (3, 3), (1, 2)],
)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("work", WORK, ids=str)
def test_phases_run_on_across_work_tiles(D, work):
    kernel = traced_kernel(D)
    pipes, programs = schedule.cta_schedule(kernel)
    assert "tile" in {p.name for p in pipes}
    assert schedule.simulate_cta(pipes, programs, list(work)) == []


def _restart(programs, role, pipe):
    """The programs with `role`'s state of `pipe` made anew at each work tile."""
    program = list(programs[role])
    i = next(i for i, x in enumerate(program) if isinstance(x, schedule.PerWorkTile))
    program[i] = schedule.PerWorkTile((schedule.Restart(pipe), *program[i].ops))
    return {**programs, role: tuple(program)}


@pytest.mark.parametrize(
    "role, pipe", [("softmax0", "S0"), ("MMA", "S1"), ("correction", "O0"), ("MMA", "K/V")]
)
def test_model_catches_a_state_made_per_work_tile(role, pipe):
    # A pipeline state created inside the loop over work tiles starts each tile at count 0:
    # with an odd number of entries per tile its parity is one phase off on the next tile.
    kernel = traced_kernel(64)
    pipes, programs = schedule.cta_schedule(kernel)
    faulty = _restart(programs, role, pipe)
    found = schedule.simulate_cta(pipes, faulty, [(0, 1), (0, 3), (0, 2)])
    assert any("off by" in v or "hang" in v for v in found), found
    # the same over a single work tile is no fault: the restart is at the state's start
    assert schedule.simulate_cta(pipes, faulty, [(0, 3)]) == []


@pytest.mark.parametrize(
    "tiles_m, heads, sequences, l2_heads", [(4, 6, 1, 2), (3, 4, 3, 4), (5, 3, 2, 1), (1, 8, 1, 8)]
)
def test_tile_order_covers_every_tile_once_longest_first(tiles_m, heads, sequences, l2_heads):
    kernel = blackwell.Sm100Kernel(cutlass.BFloat16, 128, sm_count=7)
    total = tiles_m * heads * sequences
    coords = [kernel.tile_coords(t, tiles_m, heads, l2_heads) for t in range(total)]
    assert sorted(coords) == sorted(
        (m, h, b) for m in range(tiles_m) for h in range(heads) for b in range(sequences)
    )
    for t, (m, _, _) in enumerate(coords):
        assert m == tiles_m - 1 - (t % (l2_heads * tiles_m)) // l2_heads, (t, m)


def test_launch_passes_the_tile_counter():
    kernel, args = blackwell.compile_args(torch.bfloat16, (1, 2, 300, 300, 64), causal=True)
    assert kernel.uses_tile_counter and kernel.sm_count >= 1
    assert len(args) == 13  # stage 10's twelve and tile_counter
