"""Stage 11 (Hopper): persistent CTAs - one CTA per SM walking work tiles, a fixed share or
drawn from an atomic tile scheduler, longest first in L2-sized sections, O in its own buffer.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch and packed: the grid-independent
  facts of the kernel (two consumer warpgroups, setmaxnreg 24 / 240, the ring of 5 or 12 slots
  next to Q and O's own buffer, 225 KiB of shared memory, q_full / q_empty and two barriers per
  slot), no spills.
- CPU: the ring's position carried across work tiles; the tile order (every tile once, longest
  first, in L2 sections) and the L2 section rule's host twin against the kernel's source; the
  tickets of the dynamic scheduler walked to the end over 20 orders of the CTAs; every
  interleaving of the Q / tile-number hand-over (q_full, q_empty, tile_id) and the near misses
  the model must catch; the notebook's timeline model running every tile once; the tile counter
  zeroed wherever the kernel draws. The models are in common/tools/tile_scheduler.py.
- GPU tests (marker gpu_hopper), each launch under a 120 s deadline: grids capped at 7 CTAs so
  that each CTA walks many tiles (batch and packed, calls in a row), each grid read back from
  the profiler, O and LSE bit for bit against stage 10 (one CTA per tile). Stage 7's numerical
  tests run on this stage from tests/test_stage7.py, the chain of bit-for-bit equalities from
  tests/test_stage_chain.py.
"""

import re
import shutil
import subprocess
import tempfile

import cutlass
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from ptxas_checks import ptxas_ran
from test_stage7 import packed_inputs

from common import attention_host, masks
from common.pack_gqa import choose_pack
from common.tools import inputs, verify
from common.tools.tile_scheduler import explore_handover, handover_programs, ticket_walk
from stages.stage10_overlap import hopper as stage10
from stages.stage11_persistent import hopper

# ---------------------------------------------------------------- compile-only


def ptxas_log(ptx):
    """ptxas -v's report of one PTX module for sm_90a (warnings included), or None without
    ptxas."""
    exe = shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(ptx)
        p = subprocess.run(
            [exe, "-arch=sm_90a", "-v", "-o", f"{d}/k.cubin", f"{d}/k.ptx"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    if "Unsupported .version" in p.stdout + p.stderr:
        return None  # a ptxas older than the PTX the DSL writes (the H200 machine's CUDA 13.0)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def compile_stage(module, dtype, D, Sk=2048, **options):
    from common.tools.ptx import compile_for_arch, count_ptx, ptxas_resources

    kernel, args = module.compile_args(dtype, (2, 8, 512, Sk, D), **options)
    ptx, _ = compile_for_arch(kernel, args, "sm_90a")
    return kernel, ptx, count_ptx(ptx), ptxas_resources(ptx, "sm_90a")


def statements(ptx, pattern):
    return [s.strip() for s in ptx.splitlines() if re.match(pattern, s.strip())]


def check_no_spills(kernel, ptx, res):
    """ptxas (where installed) reports no spill and no wgmma serialised for want of registers,
    keeps setmaxnreg, and the kernel's registers fit its threads."""
    log = ptxas_log(ptx)
    if log is not None:
        assert "C7508" not in log and "setmaxnreg' ignored" not in log, log
        assert "C7512" not in log and "serialized" not in log, log
    if ptxas_ran(res, "sm_90a"):
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res
        assert res["registers"] <= 65536 // kernel.threads, res


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_compiles_persistent(dtype, D, varlen):
    kernel, ptx, counts, res = compile_stage(
        hopper, dtype, D, kv_heads=2, varlen=varlen, causal=True
    )
    assert (kernel.mma_warpgroups, kernel.cta_tile) == (2, (128, 128, D))
    assert ".reqntid 384, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;") != []
    assert statements(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;") != []
    # The ring: as many K or V tiles as fit in 227 KiB next to Q and O's own buffer (bM x D each)
    # and 1 KiB of barriers: 5 x 32 KiB at D = 128, 12 x 16 KiB at D = 64; 225 KiB either way.
    tile_bytes = q_bytes = 128 * D * 2
    assert kernel.kv_slots == {64: 12, 128: 5}[D]
    assert kernel.shared_memory_bytes == 1024 + 2 * q_bytes + kernel.kv_slots * tile_bytes
    assert kernel.shared_memory_bytes == 230400
    # kv_full and kv_empty per slot, q_full and q_empty
    assert counts["mbarrier.init"] == 2 * kernel.kv_slots + 2
    # The tile scheduler's atomic add (one per draw) and the tile number's hand-over.
    assert statements(ptx, r"atom(\.global)?\.add")
    check_no_spills(kernel, ptx, res)


# ---------------------------------------------------------------- GPU: numerics


def run(fn):
    return verify.run_with_deadline(fn, seconds=120, what="stage 11 hopper")


# ---------------------------------------------------------------- persistent CTAs, the tile scheduler
# (stage 12 runs the same checks on its kernel, against stage 11)


def check_ring_position_carries_across_work_tiles(module, D):
    """The persistent loop rebuilds each role's ring position from the entries walked so far
    (ring_state). It must be where one entry at a time would have brought it - make_pipeline_
    state's start (producer parity 1, consumers 0), the index + 1 per entry, the parity flipped
    at each wrap - for every sequence of work tiles, empty ones (no KV tile) included."""
    from cutlass.pipeline import PipelineUserType

    kernel = module.compile_args(torch.bfloat16, (1, 1, 128, 128, D))[0]
    S = kernel.kv_slots
    for steps_per_tile in ([3, 0, 1, 5], [S, S, 0, 2 * S + 1], [1] * (4 * S + 3), [7, 0, 0, 9]):
        for user, parity in ((PipelineUserType.Producer, 1), (PipelineUserType.Consumer, 0)):
            index, entries = 0, 0
            for steps in steps_per_tile:
                state = kernel.ring_state(entries, user)
                assert (state.index, state.phase, state.count) == (index, parity, entries), (
                    user,
                    steps_per_tile,
                    entries,
                )
                for _ in range(2 * steps):  # K and V of each KV tile, one entry each
                    index += 1
                    if index == S:
                        index, parity = 0, parity ^ 1
                entries += 2 * steps


def check_tile_order_covers_every_tile_once_longest_first_by_section(
    module, tiles_m, heads, sequences, l2_heads
):
    """tile_coords (a plain method: called here with ints) maps the work tiles 0 .. T - 1 onto
    every (Q tile, head, sequence) exactly once; inside a section of l2_heads (head, sequence)
    pairs the Q tiles come last first and the pairs fastest; l2_heads = 1 is head by head."""
    kernel = module.Sm90Kernel(cutlass.BFloat16, 128)
    pairs = heads * sequences
    assert pairs % l2_heads == 0  # what l2_section_heads guarantees (pairs & -pairs)
    coords = [kernel.tile_coords(t, tiles_m, heads, l2_heads) for t in range(tiles_m * pairs)]
    assert sorted(coords) == sorted(
        (m, h, b) for m in range(tiles_m) for h in range(heads) for b in range(sequences)
    )
    section_tiles = l2_heads * tiles_m
    for t, (m, h, b) in enumerate(coords):
        section, i = divmod(t, section_tiles)
        # Tile t runs Q tile tiles_m - 1 - i // l2_heads of pair section * l2_heads + i % l2_heads.
        assert m == tiles_m - 1 - i // l2_heads, (t, m)
        assert h + heads * b == section * l2_heads + i % l2_heads, (t, h, b)
    if l2_heads == 1:  # head by head: the Q tile fastest (last first), then head, sequence
        assert coords == [
            (tiles_m - 1 - t % tiles_m, t // tiles_m % heads, t // (tiles_m * heads))
            for t in range(tiles_m * pairs)
        ]


def check_ticket_walk_hands_every_nonempty_tile_out_once(module, D, pack, lens_q, grid):
    """On packed sequences the persistent grid hands every tile with rows of Q to exactly one
    CTA, never an empty one, and every CTA ends: over 20 orders of the CTAs, against the live
    tiles counted from the lengths (ceil(len * G / rows) per head). The counter ends at the
    number of tiles: tickets 0 .. total - 1 are drawn once each, the last draw of every CTA
    being the one that ends it (grid = min(tiles, SMs), as __call__ caps it)."""
    import random

    kernel = module.Sm90Kernel(cutlass.BFloat16, D, pack)
    heads, rows = 2, kernel.cta_tile[0]
    tiles_m = -(-max(lens_q) * pack // rows)
    grid = min(grid, tiles_m * heads * len(lens_q))
    live = {
        (m, h, b)
        for b, n in enumerate(lens_q)
        for h in range(heads)
        for m in range(-(-n * pack // rows))
    }
    for seed in range(20):
        handed, drawn, tiles_m, total = ticket_walk(
            kernel, lens_q, heads, grid, random.Random(seed)
        )
        coords = [kernel.tile_coords(t, tiles_m, heads, 1) for t in handed]
        assert sorted(coords) == sorted(live), seed
        assert drawn == total, (seed, drawn, total)


# ---------------------------------------------------------------- the tile hand-over (CPU)
# (the models, handover_programs and explore_handover, are in common/tools/tile_scheduler.py)

HANDOVER_TILES = [[], [7], [7, 139], [7, 139, 271]]


def check_tile_handover_delivers_every_number_and_ends(module, D, tiles):
    """The producer hands each tile's number to the 2 (D = 128) or 3 (D = 64) consumer
    warpgroups with q_full, and END after the last: in every interleaving each consumer reads
    exactly its tiles' numbers and then END, and every program finishes (q_full: 1 arrive a
    phase; q_empty: one per consumer warpgroup, the kernel's all consumer threads)."""
    kernel = module.Sm90Kernel(cutlass.BFloat16, D)
    programs = handover_programs(kernel, tiles)
    arrivals = {"q_full": 1, "q_empty": kernel.mma_warpgroups}
    assert explore_handover(programs, arrivals) == {"done"}


def check_tile_handover_model_catches_near_misses(module, change):
    """The hand-over model must fail each near miss of the protocol: the producer writing END
    without waiting for the consumers to be done with the last tile, writing a number after
    its arrive, a consumer that never releases Q, no END at all, a q_empty parity off by one, a
    consumer that reads the second tile's number without waiting for q_full."""
    kernel = module.Sm90Kernel(cutlass.BFloat16, 128)
    tiles = [7, 139]
    programs = handover_programs(kernel, tiles)
    producer, consumer = programs[0], programs[1]
    if change == "no_wait_before_end":
        assert producer[-3] == ("wait", "q_empty", kernel.q_empty_parity(len(tiles)))
        del producer[-3]
    elif change == "write_after_arrive":
        i = producer.index(("write", 139))
        producer[i], producer[i + 1] = producer[i + 1], producer[i]
    elif change == "lost_release":
        consumer.remove(("arrive", "q_empty"))
    elif change == "no_end":
        del producer[-1]
    elif change == "parity":
        producer[3] = ("wait", "q_empty", 1 - producer[3][2])
    elif change == "consumer_skips_wait":
        assert consumer[3] == ("wait", "q_full", kernel.q_full_parity(1))
        del consumer[3]
    outcomes = explore_handover(programs, {"q_full": 1, "q_empty": kernel.mma_warpgroups})
    assert outcomes != {"done"}, change
    if change in ("lost_release", "no_end", "parity"):
        assert "deadlock" in outcomes, (change, outcomes)
    else:
        assert any(isinstance(o, tuple) for o in outcomes), (change, outcomes)


def launched_grids(fn):
    """fn() run under torch.profiler: the grid of every CuTe DSL kernel it launched."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    grids = [
        tuple(e["args"]["grid"])
        for e in events
        if e.get("cat") == "kernel" and "cutlass" in e.get("name", "")
    ]
    return out, grids


def check_persistent_ctas_walk_many_tiles(module, ref, D):
    """A persistent grid capped at 7 CTAs (not the SM count), so that each CTA walks 6-10 tiles
    and carries the ring's slots and phases and Q's two barriers from one tile to the next
    (Sk = 1000: 16 ring entries per tile, not a multiple of the 5 or 11 slots). One compiled
    kernel, calls in a row: non-causal (the tiles shared out in a fixed order), causal twice
    and a window (the same grid, the tiles handed out at run time from tile_counter, which
    must start from 0 at every call: a count left over from the call before would skip
    tiles), non-causal again; each bit for bit against `ref` (poisoned outputs: a tile
    computed by nobody fails)."""

    class kernel_class(module.Sm90Kernel):  # the grid capped at 7 CTAs
        # One compiled kernel for every call: the default tile also under the short masks
        # below (launch_options would take two consumer warpgroups there at D = 64).
        launch_options = staticmethod(lambda *a: {})

        def __init__(self, dtype, d, pack, **options):
            super().__init__(dtype, d, pack, sm_count=7, **options)

    B, H, Sq, Sk = 2, 4, 1000, 1000
    # 8 Q tiles of 128 rows (D = 128) or 6 of 192 (D = 64) x 4 heads x 2: 64 or 48 tiles
    rows = module.Sm90Kernel(cutlass.BFloat16, D).tile_rows
    tiles = -(-Sq // rows) * H * B
    assert tiles == {192: 48, 128: 64}[rows]
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, torch.bfloat16, seed=D + 7)
    for causal, window, grid in [
        (False, None, (7, 1, 1)),
        (True, None, (7, 1, 1)),
        (True, None, (7, 1, 1)),
        (False, (200, 0), (7, 1, 1)),
        (False, None, (7, 1, 1)),
    ]:
        (o_got, lse_got), grids = launched_grids(
            lambda: run(
                lambda: attention_host.attention(
                    kernel_class, q, k, v, None, causal, window, True, None
                )
            )
        )
        assert grids == [grid], (causal, window, grids)
        o_ref, lse_ref = run(
            lambda: ref.attention(q, k, v, causal=causal, window=window, return_lse=True)
        )
        assert torch.equal(o_got, o_ref), (
            causal,
            window,
            (o_got.float() - o_ref.float()).abs().max(),
        )
        assert torch.equal(lse_got, lse_ref), (causal, window)


def test_tile_counter_is_zero_wherever_the_kernel_draws_from_it(monkeypatch):
    """The kernel draws tickets (dynamic = 1) for packed sequences, and in batch mode under a
    causal or window cut (left < Sk or right < Sq); the host must hand it a zero counter in
    every such call (a count left over would skip tiles)."""
    Sq, Sk = 384, 512
    # torch.empty may hand back zeroed memory: make it -1, so that only a zeroed counter passes.
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-1))
    for batch_mode, left, right in [
        (False, Sk, Sq),  # packed sequences, no mask
        (False, Sk, 0),  # packed, causal
        (True, Sk, 0),  # causal
        (True, 100, Sq),  # a left window alone
        (True, Sk, Sq - 1),  # a right cut of one key
    ]:
        c = attention_host.tile_counter(batch_mode, left, right, Sq, Sk, "cpu")
        assert c.shape == (1,) and c.dtype == torch.int32 and c.item() == 0, (batch_mode, left)


def check_persistent_ctas_walk_packed_sequences(module, ref, D, monkeypatch):
    """Packed sequences on a persistent grid capped at 7 CTAs: the tiles drawn from tile_counter
    at run time, and the empty ones skipped by the producer (first_nonempty_tile: the grid counts
    the longest sequence's Q tiles for every sequence, so a 1-token sequence has one live tile and
    the rest empty). The first batch starts with a 1-token and an empty sequence, so that most
    CTAs start on an empty tile; then a long one, queries without any key (O = 0, LSE = -inf),
    equal lengths and another long one. The second has fewer live tiles (6; 4 at D = 64, where
    the launch packs its 2 query heads per KV head) than CTAs (7), so some CTA computes nothing. One compiled kernel, calls in a row: non-causal, causal, a
    window, causal with pack-GQA (G = 2 rows per position: the empty test on packed rows),
    causal again (a count left over from the call before would skip tiles), non-causal, the
    second batch causal and not. Each call: bit for bit against `ref` (pack-GQA gives the
    unpacked bits; poisoned outputs: a tile computed by nobody fails), and the counter ends at
    the number of tiles - each of tickets 0 .. total - 1 drawn once (a fixed share would leave it
    at 0, a lost or repeated draw elsewhere)."""

    class kernel_class(module.Sm90Kernel):  # the grid capped at 7 CTAs
        # One compiled kernel for every call: the default tile also under the short masks
        # below (launch_options would take two consumer warpgroups there at D = 64).
        launch_options = staticmethod(lambda *a: {})

        def __init__(self, dtype, d, pack, **options):
            super().__init__(dtype, d, pack, sm_count=7, **options)

    counters = []
    keep = attention_host.tile_counter
    monkeypatch.setattr(
        attention_host, "tile_counter", lambda *a: counters.append(keep(*a)) or counters[-1]
    )
    rows = module.Sm90Kernel(cutlass.BFloat16, D).tile_rows

    def groups(lens_q, H, Hkv, pack):  # G as the launch picks it (pack=None: by max_seqlen_q)
        return choose_pack(H, Hkv, max(lens_q), rows, pack)

    first = ([1, 0, 700, 130, 64, 450], [300, 20, 900, 0, 64, 450], 4, 2)
    second = ([1, 0, 0, 200], [50, 10, 0, 200], 2, 1)  # D = 64 packs it: G = 2 (200 < 192 x 2)
    live = {}
    for name, (lens_q, _, H, Hkv) in (("first", first), ("second", second)):
        G = groups(lens_q, H, Hkv, None)
        live[name] = sum(-(-n * G // rows) for n in lens_q) * (H // G)
    assert live == {"first": {192: 40, 128: 56}[rows], "second": {192: 4, 128: 6}[rows]}, live
    calls = [(first, c, w, p) for c, w, p in [(False, None, None), (True, None, None)]]
    calls += [(first, False, (100, 30), None), (first, True, None, True)]
    calls += [(first, True, None, None), (first, False, None, None)]
    calls += [(second, True, None, None), (second, False, None, None)]
    for (lens_q, lens_k, H, Hkv), causal, window, pack in calls:
        q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, H, Hkv, D, torch.bfloat16, seed=D)
        G = groups(lens_q, H, Hkv, pack)
        total = -(-max(lens_q) * G // rows) * (H // G) * len(lens_q)
        (o_got, lse_got), grids = launched_grids(
            lambda: run(
                lambda: attention_host.attention_varlen(
                    kernel_class, q, k, v, cu_q, cu_k, None, None, None, causal, window, True, pack
                )
            )
        )
        what = (lens_q, causal, window, pack)
        assert grids == [(7, 1, 1)], (what, grids)
        assert counters[-1].item() == total, (what, counters[-1].item(), total)
        o_ref, lse_ref = run(
            lambda: ref.attention_varlen(
                q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True
            )
        )
        assert torch.equal(o_got, o_ref), (what, (o_got.float() - o_ref.float()).abs().max())
        assert torch.equal(lse_got, lse_ref), what


@pytest.mark.parametrize("D", [64, 128])
def test_ring_position_carries_across_work_tiles(D):
    check_ring_position_carries_across_work_tiles(hopper, D)


@pytest.mark.parametrize(
    "tiles_m, heads, sequences, l2_heads",
    [(64, 16, 2, 8), (8, 16, 16, 64), (5, 6, 1, 2), (3, 12, 3, 4), (7, 5, 1, 1), (1, 4, 1, 4)],
)
def test_tile_order_covers_every_tile_once_longest_first_by_section(
    tiles_m, heads, sequences, l2_heads
):
    check_tile_order_covers_every_tile_once_longest_first_by_section(
        hopper, tiles_m, heads, sequences, l2_heads
    )


def kernel_method_on_ints(method):
    """A @cute.jit method of the kernel run on Python ints: its own source, with the DSL's
    scalar helpers (Int32, min, max, range_constexpr, const_expr) bound to Python's."""
    import inspect
    import textwrap
    import types

    src = textwrap.dedent(inspect.getsource(method))
    src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("@"))
    ints = types.SimpleNamespace(
        Int32=int, min=min, max=max, range_constexpr=range, const_expr=lambda x: x
    )
    namespace = {"cutlass": ints}
    exec(src, namespace)
    return namespace[method.__name__]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [cutlass.BFloat16, cutlass.Float16], ids=["bf16", "fp16"])
def test_l2_section_heads_twin_is_the_kernels_rule(dtype, D):
    """common/tools/tile_scheduler.l2_section_heads (what the notebook draws with) computes what
    the kernel's l2_section_heads computes - its own source run on ints - over lengths from
    one key to 256k and pair counts with every power of two as their largest factor, at the
    kernel's 50 MB and at a changed l2_bytes; and the rule's three clauses each decide some
    case (a power of two, the cap at pairs & -pairs, the floor of 1)."""
    from common.tools.tile_scheduler import l2_section_heads

    rule = kernel_method_on_ints(hopper.Sm90Kernel.l2_section_heads)
    seen = set()
    for l2_bytes in (50 * 1024 * 1024, 6 * 1024 * 1024):
        kernel = hopper.Sm90Kernel(dtype, D)
        kernel.l2_bytes = l2_bytes
        for Sk in (1, 100, 1000, 2048, 8191, 8192, 65536, 262144):
            for pairs in (1, 3, 6, 32, 48, 96, 256, 1024):
                got = l2_section_heads(kernel, Sk, pairs)
                assert got == rule(kernel, Sk, pairs), (l2_bytes, Sk, pairs)
                assert got & (got - 1) == 0 and pairs % got == 0, (Sk, pairs, got)
                fit = kernel.l2_bytes // (Sk * 2 * D * 2)
                seen.add("cap" if got == pairs & -pairs < fit else "fit" if got > 1 else "one")
    assert seen == {"cap", "fit", "one"}, seen
    # The paper shape at S = 8k, D = 128: 4 MB of K and V per head, 8 of the 32 pairs in 50 MB.
    assert l2_section_heads(hopper.Sm90Kernel(cutlass.BFloat16, 128), 8192, 32) == 8


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (300, 0))])
@pytest.mark.parametrize("persistent", [True, False])
def test_walk_runs_every_tile_once(causal, window, persistent):
    """The notebook's timeline model (common/tools/tile_scheduler.walk) on stage 11's plan - a
    fixed share without a mask, tickets under one, and one CTA per tile with persistent off -
    runs every work tile exactly once, with its KV tiles from the kernel's range, no SM running
    two things at once, each CTA's set-up once (persistent: grid = min(tiles, SMs) set-ups),
    and ends no earlier than the work allows (work / SMs, the longest tile). With tickets the
    draws follow tile-number order: the i-th tile a CTA takes after its first is a later number
    than the one before it."""
    from common.tools import tile_scheduler

    kernel = hopper.Sm90Kernel(cutlass.BFloat16, 128, sm_count=7)
    kernel.persistent = persistent
    B, H, S = 2, 3, 1000
    plan = tile_scheduler.launch_plan(kernel, B, H, S, S, causal, window)
    left, right = masks.resolve_window(causal, window, S, S)
    assert len(plan.tiles) == 8 * H * B
    assert plan.dynamic == (persistent and (causal or window is not None))
    assert plan.grid == (7 if persistent else len(plan.tiles))
    for tile in plan.tiles:
        lo, hi = masks.kv_tile_range(tile.q_tile, S, S, left, right)
        assert tile.kv_tiles == hi - lo
    timeline = tile_scheduler.walk(plan, 7, setup=1.5, lead=kernel.kv_slots / 2)
    ran = [seg.tile.number for row in timeline.rows for seg in row if seg.tile is not None]
    assert sorted(ran) == list(range(len(plan.tiles)))
    setups = sum(seg.tile is None for row in timeline.rows for seg in row)
    assert setups == timeline.setups == (7 if persistent else len(plan.tiles))
    for row in timeline.rows:
        for a, b in zip(row, row[1:]):
            assert a.end <= b.start + 1e-9 and a.start <= a.end
        numbers = [seg.tile.number for seg in row if seg.tile is not None]
        assert numbers == sorted(numbers)
    longest = max(t.kv_tiles for t in plan.tiles)
    assert timeline.end >= max(timeline.work / 7, longest)
    assert 0 < timeline.busy <= 1


@pytest.mark.parametrize("D, pack", [(128, 1), (64, 1), (128, 2), (64, 3)])
@pytest.mark.parametrize(
    "lens_q",
    [[700, 0, 1, 130, 64, 450], [2047, 64, 64, 1], [5], [0, 0, 300], [384, 128, 192, 576]],
    ids=str,
)
@pytest.mark.parametrize("grid", [1, 3, 7, 132])
def test_ticket_walk_hands_every_nonempty_tile_out_once(D, pack, lens_q, grid):
    check_ticket_walk_hands_every_nonempty_tile_out_once(hopper, D, pack, lens_q, grid)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("tiles", HANDOVER_TILES, ids=lambda t: f"{len(t)}tiles")
def test_tile_handover_delivers_every_number_and_ends(D, tiles):
    check_tile_handover_delivers_every_number_and_ends(hopper, D, tiles)


@pytest.mark.parametrize(
    "change",
    [
        "no_wait_before_end",
        "write_after_arrive",
        "lost_release",
        "no_end",
        "parity",
        "consumer_skips_wait",
    ],
)
def test_tile_handover_model_catches_near_misses(change):
    check_tile_handover_model_catches_near_misses(hopper, change)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_persistent_ctas_walk_many_tiles(D):
    check_persistent_ctas_walk_many_tiles(hopper, stage10, D)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_persistent_ctas_walk_packed_sequences(D, monkeypatch):
    check_persistent_ctas_walk_packed_sequences(hopper, stage10, D, monkeypatch)


@pytest.mark.parametrize("D", [64, 128])
def test_persistent_longest_first_by_section_at_both_head_dims(D):
    """The configuration the docstring measured: persistent CTAs, O in its own buffer, the Q
    tiles longest first in L2 sections, at both head dims (stage 12 keeps all four); the launch
    passes tile_counter. The order itself cannot be seen in the outputs (the same bits in any
    order): test_tile_order_covers_every_tile_once_longest_first_by_section checks it."""
    kernel = hopper.Sm90Kernel(cutlass.BFloat16, D)
    assert (kernel.persistent, kernel.o_buffer, kernel.longest_first, kernel.l2_sections) == (
        True,
        True,
        True,
        True,
    )
    assert kernel.uses_tile_counter and kernel.l2_bytes == 50 * 1024 * 1024
