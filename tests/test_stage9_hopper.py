"""Stage 9 (Hopper): overlap inside each consumer warpgroup - QK_j and PV_{j-1} issued as one
turn, softmax_j running while PV_{j-1} is on the tensor cores; stage 8's producer, ring and
ping-pong otherwise.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch and packed: stage 8's setmaxnreg
  split (24 / 240) at D = 128, three consumer warpgroups at D = 64 (512 threads, 24 / 160, a
  192-row tile; shared memory and slots to the byte); the loop body issues two GEMM groups and waits for them one at a time
  (wait_group 1, then 0), in this program order; the QK^T and PV wgmma are emitted twice (the
  prologue's QK, the loop's pair, the last PV) and so are the exponentials; no spills.
- CPU: the turn protocol of stage 9 (turns of (QK_j, PV_{j-1})) for 0-6 KV tiles under every
  interleaving of two and of three warpgroups: no deadlock, balanced barriers, the tensor cores
  see 1: QK0, 2: QK0, (3: QK0,) 1: QK1 PV0, ... ; and the model fails its near misses. Pack-GQA's
  group sizes against the tile rows (192 at D = 64) and the rows per pass of the O store.
- GPU tests (marker gpu_hopper), each launch under a 120 s deadline: stage 7's numerical tests
  (GQA / MQA, masks, packed sequences, NaN planted outside a sequence, empty sequences) on stage
  9; O and LSE equal to stage 8's bit for bit (the same operations on O in the same order),
  including shapes that wrap the ring many times and ranges of 1 and 2 tiles; the persistent
  grid capped at 7 CTAs (each walks 9-10 tiles), calls with and without the cap in a row, each
  launch's grid read back from the profiler.
- Compile-only also: no wgmma serialised for want of registers (ptxas C7512); at D = 128 the
  loop's wait for PV_{j-1} behind the always-true, warp-uniform test after the row max (P's
  exponentials after the wait), at D = 64 the PTX order.
"""

import re

import attention_cases
import cutlass
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from test_stage7_hopper import (
    BAD_PACKED,
    PACK_GQA_CASES,
    PACKS,
    SHARED,
    _packed,
    check_pack_gqa,
    check_pack_gqa_varlen,
    check_packed,
    gqa_reference_check,
    pack_case_id,
    packed_inputs,
)
from test_stage8_hopper import (
    PACK_GQA_192_CASES,
    SAME_AS_STAGE7,
    check_pack_gqa_groups_follow_the_tile_rows,
    check_short_masks_take_two_warpgroups_at_d64,
    check_turn_barriers_are_distinct_and_go_round,
    check_two_and_three_warpgroups_agree,
    explore,
    ptxas_log,
    statements,
)
from test_stage8_hopper import turn_kernel as stage8_turn_kernel

from common import attention_host, checker, inputs, stages
from common.pack_gqa import choose_pack
from stages.stage7_gqa_varlen import hopper as stage7
from stages.stage8_warp_specialized import hopper as stage8
from stages.stage9_overlap import hopper

# ---------------------------------------------------------------- compile-only


def compile_stage9(dtype, D, Sk=2048, **options):
    from common.compile import compile_for_arch, count_ptx, ptxas_resources

    kernel, args = hopper.compile_args(dtype, (2, 8, 512, Sk, D), **options)
    ptx, _ = compile_for_arch(kernel, args, "sm_90a")
    return kernel, ptx, count_ptx(ptx), ptxas_resources(ptx, "sm_90a")


SCHEDULE_LETTERS = [
    (r"(bar|barrier)\.sync\s+0;", "0"),  # the CTA-wide sync after the barriers' initialisation
    (r"setmaxnreg\.dec", "d"),
    (r"setmaxnreg\.inc", "i"),
    (r"cp\.async\.bulk\.tensor", "L"),  # a TMA load
    (r"bar\.sync\s+(%r\d+|3), 256;", "T"),  # wait_turn (3: two warpgroups, 2's turn 0, a constant)
    (r"bar\.arrive\s+(%r\d+|2), 256;", "P"),  # pass_turn (2: warpgroup 1's last pass)
    (r"bar\.sync\s+1, (256|384);", "B"),  # the consumers' own barrier (all their threads)
    (r"wgmma\.mma_async", "G"),
    (r"wgmma\.commit_group", "C"),
    (r"wgmma\.wait_group\.sync\.aligned\s+1;", "w"),
    (r"wgmma\.wait_group\.sync\.aligned\s+0;", "W"),
]


def schedule_string(ptx):
    out = []
    for line in ptx.splitlines():
        stmt = re.sub(r"^@!?%p\d+\s+", "", line.strip())
        out += [c for pat, c in SCHEDULE_LETTERS if re.match(pat, stmt)]
    return re.sub("G+", "G", "".join(out))


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize(
    "D, Sk", [(64, 2048), (128, 2048), (64, 1024)], ids=["64", "128", "64-short"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_compiles_overlapped(dtype, D, Sk, varlen):
    kernel, ptx, counts, res = compile_stage9(dtype, D, Sk, kv_heads=2, varlen=varlen, causal=True)
    # Stage 8's warp roles and register split at D = 128 (a producer and two consumer
    # warpgroups, 24 / 240 registers); at D = 64 three consumer warpgroups (24 / 160), two
    # under a causal mask over at most 1024 keys (launch_options: Sk = 1024 here).
    wgs, regs = {64: (3, 160), 128: (2, 240)}[D] if Sk > 1024 else (2, 240)
    assert (kernel.mma_warpgroups, kernel.cta_tile) == (wgs, (64 * wgs, 128, D))
    assert f".reqntid {128 * (1 + wgs)}, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert 128 * kernel.load_registers + kernel.mma_threads * kernel.mma_registers <= 65536
    assert statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;") != []
    assert statements(ptx, rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{regs};") != []
    log = ptxas_log(ptx)
    if log is not None:
        assert "C7508" not in log and "setmaxnreg' ignored" not in log, log
        # C7512: wgmma serialised for want of registers (the fill of acc_S before each tile).
        assert "C7512" not in log and "serialized" not in log, log
    # QK^T in the prologue and in the loop, PV in the loop and after it: each GEMM's wgmma
    # twice (D / 16 for QK^T, 128 / 16 = 8 for PV); the softmax (64 exponentials of P and 2 of
    # row_scale per thread) in the prologue and in the loop.
    assert counts["wgmma.mma_async"] == 2 * (D // 16 + 8)
    assert counts["ex2.approx"] == 2 * (64 + 2)
    assert counts["cp.async.bulk.tensor (load)"] == (3 if D == 64 else 6)
    assert counts["cp.async.bulk.tensor (store)"] == 0
    # Program order. Producer: setmaxnreg.dec, the loads. Consumers: setmaxnreg.inc; the
    # prologue (turn 0: warpgroup 2 waits, QK issued, passed, waited); the loop (turn wait, QK
    # and PV issued as two groups, passed, wait_group 1 = QK done, wait_group 0 = PV done);
    # zero_rows when packed; the last PV (turn wait, issued, warpgroup 1's pass, waited); the
    # epilogue's two barriers.
    expected = r"0dL+iTGCPW" + r"TGCGCPwW" + ("B" if varlen else "") + r"TGCPWBB"
    assert re.fullmatch(expected, schedule_string(ptx)), schedule_string(ptx)
    # Q and O (bM x D each) and the ring in 227 KB: 2 x 24 KB + 11 x 16 KB at D = 64 (192-row
    # tile; 2 x 16 KB + 12 x 16 KB with 128 rows), 2 x 32 KB + 5 x 32 KB at D = 128; 225 KB
    # with the barriers either way.
    assert kernel.kv_slots == {(64, 3): 11, (64, 2): 12, (128, 2): 5}[D, wgs]
    tile_bytes = 128 * D * 2
    assert kernel.shared_memory_bytes == 1024 + 2 * 64 * wgs * D * 2 + kernel.kv_slots * tile_bytes
    assert kernel.shared_memory_bytes == 230400
    if res and "spill_stores" in res:
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res


@pytest.mark.parametrize(
    "D, Sk", [(64, 2048), (128, 2048), (64, 1024)], ids=["64", "128", "64-short"]
)
def test_wait_for_pv_stands_after_the_row_max(D, Sk):
    """D = 128: in the loop, the wait for PV_{j-1} (wait_group 0) comes behind the warp-uniform
    always-true test after the row max (the vote.any of always_true_after), so that ptxas,
    which moves a wgmma wait to the top of its block, cannot put it ahead of the row max: between
    wait_group 1 and the vote only row_scale's 2 exponentials, P's 64 after the wait. D = 64
    keeps the PTX order: all 66 before the wait, no vote."""
    kernel, ptx, _, _ = compile_stage9(torch.bfloat16, D, Sk, kv_heads=2, causal=True)
    lines = [re.sub(r"^@!?%p\d+\s+", "", ln.strip()) for ln in ptx.splitlines()]

    def first(pattern, start=0):
        return next(i for i in range(start, len(lines)) if re.match(pattern, lines[i]))

    qk_done = first(r"wgmma\.wait_group\.sync\.aligned\s+1;")  # the loop's only wait_group 1
    pv_done = first(r"wgmma\.wait_group\.sync\.aligned\s+0;", qk_done)
    last_turn = first(r"bar\.sync\s+(%r\d+|3), 256;", pv_done)  # the last PV's, after the loop

    def ex2(a, b):
        return sum(ln.startswith("ex2.approx") for ln in lines[a:b])

    votes = [i for i, ln in enumerate(lines) if "vote.sync.any.pred" in ln]
    assert kernel.max_before_wait == (D == 128)
    if D == 128:
        assert len(votes) == 1 and qk_done < votes[0] < pv_done, (qk_done, votes, pv_done)
        assert (ex2(qk_done, votes[0]), ex2(votes[0], pv_done), ex2(pv_done, last_turn)) == (
            2,
            0,
            64,
        )
    else:
        assert votes == []
        assert (ex2(qk_done, pv_done), ex2(pv_done, last_turn)) == (66, 0)


# ---------------------------------------------------------------- the tile loop (CPU)


@pytest.mark.parametrize("D", [64, 128])
def test_ring_position_carries_across_work_tiles(D):
    """The persistent loop rebuilds each role's ring position from the entries walked so far
    (ring_state). It must be where one entry at a time would have brought it - make_pipeline_
    state's start (producer parity 1, consumers 0), the index + 1 per entry, the parity flipped
    at each wrap - for every sequence of work tiles, empty ones (no KV tile) included."""
    from cutlass.pipeline import PipelineUserType

    kernel = hopper.compile_args(torch.bfloat16, (1, 1, 128, 128, D))[0]
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


# ---------------------------------------------------------------- the turn protocol (CPU)


def turn_kernel(n):
    """The stage 9 kernel object with n consumer warpgroups (its turn_barrier, next_warpgroup)."""
    return stage8_turn_kernel(n, hopper)


def consumer_program(wg, steps, zero_rows, n=2):
    """Stage 9's consumer warpgroup wg (1 .. n, n consumer warpgroups): ('sync', id),
    ('arrive', id), ('gemm', name), in the kernel's order, with the kernel's own barrier numbers
    (wait_turn: sync on turn_barrier(wg); pass_turn: arrive on the next warpgroup's)."""
    kernel = turn_kernel(n)
    assert kernel.mma_warpgroups == n
    wait = ("sync", kernel.turn_barrier(wg))
    ops, pass_to = [], ("arrive", kernel.turn_barrier(kernel.next_warpgroup(wg)))
    if steps > 0:
        if wg > 1:
            ops.append(wait)  # turn 0 comes round from warpgroup 1
        ops += [("gemm", f"{wg}: QK0"), pass_to]
        for t in range(1, steps):
            ops += [wait, ("gemm", f"{wg}: QK{t}"), ("gemm", f"{wg}: PV{t - 1}")]
            ops.append(pass_to)
        if zero_rows:
            ops.append(("sync", 1))  # zero_rows of the last V tile, between turns
        ops += [wait, ("gemm", f"{wg}: PV{steps - 1}")]
        if wg < n:
            ops.append(pass_to)  # the last turn goes round, the last warpgroup's to nobody
    return ops + [("sync", 1), ("sync", 1)]  # the epilogue


def expected_tensor_core_order(steps, n=2):
    order = []
    for t in range(steps + 1 if steps else 0):
        for wg in range(1, n + 1):
            order += [f"{wg}: QK{t}"] if t < steps else []
            order += [f"{wg}: PV{t - 1}"] if t > 0 else []
    return order


@pytest.mark.parametrize("n", [2, 3], ids=["2wg", "3wg"])
@pytest.mark.parametrize("zero_rows", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("steps", range(7))
def test_turn_protocol_has_no_deadlock_and_alternates(steps, zero_rows, n):
    programs = [consumer_program(wg, steps, zero_rows, n) for wg in range(1, n + 1)]
    assert explore(programs, expected_tensor_core_order(steps, n)) == set()


def test_turn_barriers_are_distinct_and_go_round():
    check_turn_barriers_are_distinct_and_go_round(hopper)


@pytest.mark.parametrize(
    "tiles_m, heads, sequences, l2_heads",
    [(64, 16, 2, 8), (8, 16, 16, 64), (5, 6, 1, 2), (3, 12, 3, 4), (7, 5, 1, 1), (1, 4, 1, 4)],
)
def test_tile_order_covers_every_tile_once_longest_first_by_section(
    tiles_m, heads, sequences, l2_heads
):
    """tile_coords (a plain method: called here with ints) maps the work tiles 0 .. T - 1 onto
    every (Q tile, head, sequence) exactly once; inside a section of l2_heads (head, sequence)
    pairs the Q tiles come last first and the pairs fastest; l2_heads = 1 is head by head."""
    kernel = hopper.Sm90Kernel(cutlass.BFloat16, 128)
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


def ticket_walk(kernel, lens_q, heads, grid, rng):
    """A CPU model of the persistent grid on packed sequences: `grid` CTAs, each starting with
    tile c, taking the next tile as gridDim.x + a ticket drawn from one counter (next_tile) and
    skipping the empty ones as the producer does (live_tile: draw again while the tile is past
    its sequence's end), with the kernel's tile_coords and tile_is_empty; the CTAs run in an
    order drawn by `rng`. Returns (tiles handed to the consumers, in order; the final count of
    the counter)."""
    tiles_m = -(-max(lens_q) * kernel.pack_gqa // kernel.cta_tile[0])
    total = tiles_m * heads * len(lens_q)
    counter = [0]

    def draw():
        counter[0] += 1
        return grid + counter[0] - 1

    def live(tile):
        while tile < total:
            pid_m, _, seq = kernel.tile_coords(tile, tiles_m, heads, 1)
            if not kernel.tile_is_empty(pid_m, lens_q[seq]):
                break
            tile = draw()
        return tile

    # Each CTA's next tile before its skips (its first tile c, then a fresh draw); a CTA picked
    # by rng skips from there (its draws interleave with the other CTAs') and hands over what it
    # reaches, or ends.
    pending, running = list(range(grid)), set(range(grid))
    handed = []
    while running:
        c = rng.choice(sorted(running))
        tile = live(pending[c])
        if tile >= total:
            running.discard(c)
            continue
        handed.append(tile)
        pending[c] = draw()
    return handed, counter[0], tiles_m, total


@pytest.mark.parametrize("D, pack", [(128, 1), (64, 1), (128, 2), (64, 3)])
@pytest.mark.parametrize(
    "lens_q",
    [[700, 0, 1, 130, 64, 450], [2047, 64, 64, 1], [5], [0, 0, 300], [384, 128, 192, 576]],
    ids=str,
)
@pytest.mark.parametrize("grid", [1, 3, 7, 132])
def test_ticket_walk_hands_every_live_tile_out_once(D, pack, lens_q, grid):
    """On packed sequences the persistent grid hands every tile with rows of Q to exactly one
    CTA, never an empty one, and every CTA ends: over 20 orders of the CTAs, against the live
    tiles counted from the lengths (ceil(len * G / rows) per head). The counter ends at the
    number of tiles: tickets 0 .. total - 1 are drawn once each, the last draw of every CTA
    being the one that ends it (grid = min(tiles, SMs), as __call__ caps it)."""
    import random

    kernel = hopper.Sm90Kernel(cutlass.BFloat16, D, pack)
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

END = -1  # a tile number past the end


def handover_programs(kernel, tiles):
    """The producer's and each consumer warpgroup's operations on q_full, q_empty and the shared
    tile number (tile_id) for a CTA that walks `tiles` and then ends, in the kernel's order,
    with the kernel's parities (q_empty_parity, q_full_parity): per tile the producer waits for
    q_empty, writes the number, arrives on q_full (with Q's bytes); a consumer waits for q_full,
    reads the number, and arrives on q_empty once done with Q; at the end the producer hands
    over END with an arrive of its own."""
    producer, consumer = [], []
    for i, t in enumerate(list(tiles) + [END]):
        producer += [("wait", "q_empty", kernel.q_empty_parity(i)), ("write", t)]
        producer += [("arrive", "q_full")]
        consumer += [("wait", "q_full", kernel.q_full_parity(i)), ("read", t)]
        if t != END:
            consumer += [("arrive", "q_empty")]
    return [producer] + [list(consumer) for _ in range(kernel.mma_warpgroups)]


def explore_handover(programs, arrivals):
    """Every interleaving of `programs` over mbarriers with the hardware's parity rule (a wait
    for parity p passes once the barrier's completed phases have the other parity; a phase
    completes after `arrivals[bar]` arrives). Returns the set of outcomes: 'done', 'deadlock',
    or ('read', expected, got) where a consumer read another tile number than its own tile's."""
    outcomes, seen = set(), set()

    def step(pcs, bars, value):
        key = (pcs, bars, value)
        if key in seen:
            return
        seen.add(key)
        if all(pc == len(prog) for pc, prog in zip(pcs, programs)):
            outcomes.add("done")
            return
        moved = False
        for i, prog in enumerate(programs):
            if pcs[i] == len(prog):
                continue
            op = prog[pcs[i]]
            nbars, nvalue = dict(bars), value
            if op[0] == "wait":
                done, _ = nbars[op[1]]
                if done % 2 == op[2]:
                    continue  # that phase has not completed yet
            elif op[0] == "arrive":
                done, pending = nbars[op[1]]
                pending += 1
                nbars[op[1]] = (done + 1, 0) if pending == arrivals[op[1]] else (done, pending)
            elif op[0] == "write":
                nvalue = op[1]
            elif op[0] == "read" and value != op[1]:
                outcomes.add(("read", op[1], value))
            moved = True
            npcs = pcs[:i] + (pcs[i] + 1,) + pcs[i + 1 :]
            step(npcs, tuple(sorted(nbars.items())), nvalue)
        if not moved:
            outcomes.add("deadlock")

    step(tuple(0 for _ in programs), (("q_empty", (0, 0)), ("q_full", (0, 0))), None)
    return outcomes


HANDOVER_TILES = [[], [7], [7, 139], [7, 139, 271]]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("tiles", HANDOVER_TILES, ids=lambda t: f"{len(t)}tiles")
def test_tile_handover_delivers_every_number_and_ends(D, tiles):
    """The producer hands each tile's number to the 2 (D = 128) or 3 (D = 64) consumer
    warpgroups with q_full, and END after the last: in every interleaving each consumer reads
    exactly its tiles' numbers and then END, and every program finishes (q_full: 1 arrive a
    phase; q_empty: one per consumer warpgroup, the kernel's all consumer threads)."""
    kernel = hopper.Sm90Kernel(cutlass.BFloat16, D)
    programs = handover_programs(kernel, tiles)
    arrivals = {"q_full": 1, "q_empty": kernel.mma_warpgroups}
    assert explore_handover(programs, arrivals) == {"done"}


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
    """The model above must fail each near miss of the protocol: the producer writing END
    without waiting for the consumers to be done with the last tile, writing a number after
    its arrive, a consumer that never releases Q, no END at all, a q_empty parity off by one, a
    consumer that reads the second tile's number without waiting for q_full."""
    kernel = hopper.Sm90Kernel(cutlass.BFloat16, 128)
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


@pytest.mark.parametrize("n,wg", [(2, 1), (2, 2), (3, 1), (3, 2), (3, 3)])
@pytest.mark.parametrize("change", ["extra_wait", "extra_pass", "lost_pass", "pv_before_qk"])
def test_turn_protocol_model_catches_near_misses(wg, change, n):
    programs = [consumer_program(w, 3, False, n) for w in range(1, n + 1)]
    ops = programs[wg - 1]
    if change == "extra_wait":
        ops.insert(0, ("sync", 1 + wg))
    elif change == "extra_pass":
        kernel = turn_kernel(n)
        ops.insert(len(ops) - 2, ("arrive", kernel.turn_barrier(kernel.next_warpgroup(wg))))
    elif change == "lost_pass":
        ops.remove(next(op for op in ops if op[0] == "arrive"))
    else:  # the loop's pair issued PV first: the tensor-core order is not the intended one
        i = ops.index(("gemm", f"{wg}: QK1"))
        ops[i], ops[i + 1] = ops[i + 1], ops[i]
    assert explore(programs, expected_tensor_core_order(3, n)) != set()


# ---------------------------------------------------------------- GPU: numerics


def run(fn):
    return checker.run_with_deadline(fn, seconds=120, what="stage 9 hopper")


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H, Hkv", [(8, 8), (8, 2), (8, 1)], ids=["mha", "g4", "mqa"])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (100, 0))])
def test_gqa_matches_fp64_reference(H, Hkv, D, dtype, causal, window):
    q, _, _ = inputs.attention_inputs(2, H, 300, 300, D, dtype, seed=H + Hkv + D)
    _, k, v = inputs.attention_inputs(2, Hkv, 300, 700, D, dtype, seed=H * Hkv + D)
    o, lse = run(lambda: hopper.attention(q, k, v, causal=causal, window=window, return_lse=True))
    gqa_reference_check("O", o, lse, q, k, v, causal, window)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("Sk", [1, 128, 129, 256, 4000])
def test_short_and_decode_like_ranges(Sk):
    # Ranges of 1 tile (the prologue and the last PV only), 2 tiles (one loop step) and many;
    # Sq = 1: warpgroup 2's rows all lie past the sequence, yet it takes every turn.
    q, _, _ = inputs.attention_inputs(4, 32, 1, 1, 64, seed=3)
    _, k, v = inputs.attention_inputs(4, 8, 1, Sk, 64, seed=Sk)
    o, lse = run(lambda: hopper.attention(q, k, v, causal=True, return_lse=True))
    gqa_reference_check("O", o, lse, q, k, v, True, None)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (77, None))])
def test_packed_sequences_match_per_sequence_reference(pack, D, dtype, causal, window):
    lens_q, lens_k = PACKS[pack]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, D, dtype, seed=len(pack) + D)
    o, lse = run(
        lambda: hopper.attention_varlen(
            q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True
        )
    )
    assert o.shape == q.shape and lse.shape == (4, q.shape[0])
    check_packed(o, lse, q, k, v, cu_q, cu_k, causal, window)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_nan_outside_a_sequence_never_reaches_it(D):
    # Every row of Q, K and V outside sequence b is NaN: sequence b's O and LSE must be exactly
    # what they are alone (zero_rows runs before the last PV, between turns).
    lens_q, lens_k = [200, 77, 300, 1], [130, 190, 129, 260]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, D, torch.bfloat16, seed=9)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        qn, kn, vn = q.clone(), k.clone(), v.clone()
        for t, c in ((qn, cq), (kn, ck), (vn, ck)):
            t[: c[b]] = float("nan")
            t[c[b + 1] :] = float("nan")
        o, lse = run(lambda: hopper.attention_varlen(qn, kn, vn, cu_q, cu_k, return_lse=True))
        check_packed(o, lse, q, k, v, cu_q, cu_k, False, None, only=b)


# Stage 8's cases, and ranges of 1 and 2 KV tiles (no loop step; one).
SAME_AS_STAGE8 = SAME_AS_STAGE7 + [
    (2, 4, 2, 100, 100, 64, torch.bfloat16, False, None),
    (2, 4, 4, 200, 200, 128, torch.float16, True, None),
]


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("case", SAME_AS_STAGE8, ids=lambda c: "x".join(map(str, c[:6])))
def test_equals_stage8_bit_for_bit(case):
    B, H, Hkv, Sq, Sk, D, dtype, causal, window = case
    q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=Sq + D)
    _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, D, dtype, seed=Sk + D)
    kw = dict(causal=causal, window=window, return_lse=True)
    o9, lse9 = run(lambda: hopper.attention(q, k, v, **kw))
    o8, lse8 = run(lambda: stage8.attention(q, k, v, **kw))
    assert torch.equal(o9, o8), f"max |O9 - O8| = {(o9.float() - o8.float()).abs().max()}"
    assert torch.equal(lse9, lse8), f"max |LSE9 - LSE8| = {(lse9 - lse8).abs().max()}"


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


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_persistent_ctas_walk_many_tiles(D):
    """A persistent grid capped at 7 CTAs (not the SM count), so that each CTA walks 6-10 tiles
    and carries the ring's slots and phases and Q's two barriers from one tile to the next
    (Sk = 1000: 16 ring entries per tile, not a multiple of the 5 or 11 slots). One compiled
    kernel, calls in a row: non-causal (the tiles shared out in a fixed order), causal twice
    and a window (the same grid, the tiles handed out at run time from tile_counter, which
    must start from 0 at every call: a count left over from the call before would skip
    tiles), non-causal again; each bit for bit against stage 8 (poisoned outputs: a tile
    computed by nobody fails)."""

    class kernel_class(hopper.Sm90Kernel):  # the grid capped at 7 CTAs
        # One compiled kernel for every call: the default tile also under the short masks
        # below (launch_options would take two consumer warpgroups there at D = 64).
        launch_options = staticmethod(lambda *a: {})

        def __init__(self, dtype, d, pack, **options):
            super().__init__(dtype, d, pack, sm_count=7, **options)

    B, H, Sq, Sk = 2, 4, 1000, 1000
    # 8 Q tiles of 128 rows (D = 128) or 6 of 192 (D = 64) x 4 heads x 2: 64 or 48 tiles
    tiles = -(-Sq // hopper.Sm90Kernel(cutlass.BFloat16, D).tile_rows) * H * B
    assert tiles == {64: 48, 128: 64}[D]
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, torch.bfloat16, seed=D + 7)
    for causal, window, grid in [
        (False, None, (7, 1, 1)),
        (True, None, (7, 1, 1)),
        (True, None, (7, 1, 1)),
        (False, (200, 0), (7, 1, 1)),
        (False, None, (7, 1, 1)),
    ]:
        (o9, lse9), grids = launched_grids(
            lambda: run(
                lambda: attention_host.attention(
                    kernel_class, q, k, v, None, causal, window, True, None
                )
            )
        )
        assert grids == [grid], (causal, window, grids)
        o8, lse8 = run(
            lambda: stage8.attention(q, k, v, causal=causal, window=window, return_lse=True)
        )
        assert torch.equal(o9, o8), (causal, window, (o9.float() - o8.float()).abs().max())
        assert torch.equal(lse9, lse8), (causal, window)


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


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_persistent_ctas_walk_packed_sequences(D, monkeypatch):
    """Packed sequences on a persistent grid capped at 7 CTAs: the tiles drawn from tile_counter
    at run time, and the empty ones skipped by the producer (live_tile: the grid counts the
    longest sequence's Q tiles for every sequence, so a 1-token sequence has one live tile and
    the rest empty). The first batch starts with a 1-token and an empty sequence, so that most
    CTAs start on an empty tile; then a long one, queries without any key (O = 0, LSE = -inf),
    equal lengths and another long one. The second has fewer live tiles (6; 4 at D = 64, where
    the launch packs its 2 query heads per KV head) than CTAs (7), so some CTA computes nothing. One compiled kernel, calls in a row: non-causal, causal, a
    window, causal with pack-GQA (G = 2 rows per position: the empty test on packed rows),
    causal again (a count left over from the call before would skip tiles), non-causal, the
    second batch causal and not. Each call: bit for bit against stage 8 (pack-GQA gives the
    unpacked bits; poisoned outputs: a tile computed by nobody fails), and the counter ends at
    the number of tiles - each of tickets 0 .. total - 1 drawn once (a fixed share would leave it
    at 0, a lost or repeated draw elsewhere)."""

    class kernel_class(hopper.Sm90Kernel):  # the grid capped at 7 CTAs
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
    rows = hopper.Sm90Kernel(cutlass.BFloat16, D).tile_rows

    def groups(lens_q, H, Hkv, pack):  # G as the launch picks it (pack=None: by max_seqlen_q)
        return choose_pack(H, Hkv, max(lens_q), rows, pack)

    first = ([1, 0, 700, 130, 64, 450], [300, 20, 900, 0, 64, 450], 4, 2)
    second = ([1, 0, 0, 200], [50, 10, 0, 200], 2, 1)  # D = 64 packs it: G = 2 (200 < 192 x 2)
    live = {}
    for name, (lens_q, _, H, Hkv) in (("first", first), ("second", second)):
        G = groups(lens_q, H, Hkv, None)
        live[name] = sum(-(-n * G // rows) for n in lens_q) * (H // G)
    assert live == {"first": {64: 40, 128: 56}[D], "second": {64: 4, 128: 6}[D]}, live
    calls = [(first, c, w, p) for c, w, p in [(False, None, None), (True, None, None)]]
    calls += [(first, False, (100, 30), None), (first, True, None, True)]
    calls += [(first, True, None, None), (first, False, None, None)]
    calls += [(second, True, None, None), (second, False, None, None)]
    for (lens_q, lens_k, H, Hkv), causal, window, pack in calls:
        q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, H, Hkv, D, torch.bfloat16, seed=D)
        G = groups(lens_q, H, Hkv, pack)
        total = -(-max(lens_q) * G // rows) * (H // G) * len(lens_q)
        (o9, lse9), grids = launched_grids(
            lambda: run(
                lambda: attention_host.attention_varlen(
                    kernel_class, q, k, v, cu_q, cu_k, None, None, None, causal, window, True, pack
                )
            )
        )
        what = (lens_q, causal, window, pack)
        assert grids == [(7, 1, 1)], (what, grids)
        assert counters[-1].item() == total, (what, counters[-1].item(), total)
        o8, lse8 = run(
            lambda: stage8.attention_varlen(
                q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True
            )
        )
        assert torch.equal(o9, o8), (what, (o9.float() - o8.float()).abs().max())
        assert torch.equal(lse9, lse8), what


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("stage", [7, 8, 9])
def test_launches_on_the_current_stream(stage):
    """Stages 7-9 launch through TVM-FFI, which takes the stream from the caller's context. On a
    side stream: a 50 ms sleep, then the inputs are written (they are NaN before), then the call;
    a kernel launched on any other stream would run before the inputs exist and read NaN."""
    mod = stages.track_module(stage, "hopper")
    B, H, S, D = 2, 4, 512, 128
    q_ref, k_ref, v_ref = inputs.attention_inputs(B, H, S, S, D, torch.bfloat16, seed=3)
    q, k, v = (torch.full_like(t, float("nan")) for t in (q_ref, k_ref, v_ref))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # about 50 ms of GPU cycles at ~1 GHz
        for t, ref in ((q, q_ref), (k, k_ref), (v, v_ref)):
            t.copy_(ref)
        o = mod.attention(q, k, v)
    side.synchronize()
    o_ref = stage8.attention(q_ref, k_ref, v_ref)
    torch.cuda.synchronize()
    assert not o.isnan().any(), "the kernel read its inputs before the side stream wrote them"
    # Stages 7, 8 and 9 give the same O bit for bit (their own tests).
    assert torch.equal(o, o_ref), (o.float() - o_ref.float()).abs().max()


@pytest.mark.gpu_hopper
def test_packed_equals_stage8_bit_for_bit():
    lens_q, lens_k = PACKS["long-and-short"]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 128, torch.bfloat16, seed=21)
    kw = dict(causal=True, return_lse=True)
    o9, lse9 = run(lambda: hopper.attention_varlen(q, k, v, cu_q, cu_k, **kw))
    o8, lse8 = run(lambda: stage8.attention_varlen(q, k, v, cu_q, cu_k, **kw))
    assert torch.equal(o9, o8) and torch.equal(lse9, lse8)


@pytest.mark.gpu_hopper
def test_stage_package_dispatches_to_hopper():
    from stages.stage9_overlap import attention, attention_varlen

    q, k, v = inputs.attention_inputs(1, 4, 200, 200, 64, seed=8)
    o = run(lambda: attention(q, k[:, :2], v[:, :2], causal=True))
    gqa_reference_check("O", o, None, q, k[:, :2], v[:, :2], True, None)
    q, k, v, cu_q, cu_k = packed_inputs([10, 20], [10, 20], 4, 2, 64, torch.bfloat16, seed=3)
    o, lse = run(lambda: attention_varlen(q, k, v, cu_q, cu_k, return_lse=True))
    check_packed(o, lse, q, k, v, cu_q, cu_k, False, None)


@pytest.mark.gpu_hopper
def test_all_empty_and_given_max_seqlen():
    q, k, v, cu_q, cu_k = packed_inputs([0, 0], [5, 0], 4, 4, 64, torch.bfloat16, seed=1)
    o, lse = run(lambda: hopper.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True))
    assert o.shape == (0, 4, 64) and lse.shape == (4, 0)
    q, k, v, cu_q, cu_k = packed_inputs([100, 30], [40, 260], 4, 4, 64, torch.bfloat16, seed=2)
    o, lse = run(
        lambda: hopper.attention_varlen(
            q, k, v, cu_q, cu_k, max_seqlen_q=512, max_seqlen_k=300, return_lse=True
        )
    )
    check_packed(o, lse, q, k, v, cu_q, cu_k, False, None)


# ---------------------------------------------------------------- bad input (stage 7's cases)


@pytest.mark.parametrize("case", SHARED)
def test_rejects_bad_input(case):
    case.check(hopper.attention)


@attention_cases.needs_cuda
@pytest.mark.parametrize("name, change, error, match", BAD_PACKED, ids=[c[0] for c in BAD_PACKED])
def test_rejects_bad_packed_input(name, change, error, match):
    q, k, v, cu_q, cu_k = _packed()
    args = change(dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    with pytest.raises(error, match=match):
        hopper.attention_varlen(**args)


# ---------------------------------------------------------------- pack-GQA (stage 7's checks)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("case", PACK_GQA_CASES + PACK_GQA_192_CASES, ids=pack_case_id)
def test_pack_gqa_matches_reference_and_unpacked(case):
    check_pack_gqa(hopper, case)


def test_pack_gqa_groups_follow_the_tile_rows():
    check_pack_gqa_groups_follow_the_tile_rows(hopper)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_pack_gqa_packed_sequences_with_nan_around(D):
    check_pack_gqa_varlen(hopper, D)


def test_packed_tiles_figure_draws_the_stored_run():
    """The packed-sequence figure (plots.packed_tiles, notebook 9 and docs/results) draws one bar
    per (batch, kernel), its height the stored GPU-time TFLOP/s, and every stored row has stage
    9's two variants equal to stage 8 bit for bit."""
    import json
    import os

    import matplotlib

    matplotlib.use("Agg")
    from common import plots

    path = os.path.join(
        os.path.dirname(__file__), "..", "docs", "results", "varlen_dynamic_h200_2026-12-01.json"
    )
    rows = json.load(open(path))["rows"]
    assert rows and all(r["same_bits"] for r in rows)
    fig = plots.packed_tiles(rows)
    heights = sorted(p.get_height() for p in fig.axes[0].patches)
    want = sorted(v[0] for r in rows for v in r["tflops_gpu_event"].values())
    assert heights == pytest.approx(want)


# ---------------------------------------------------------------- two warpgroups for short masks
# (stage 8's launch_options; the checks are stage 8's tests, run here on stage 9)


def test_short_masks_take_two_warpgroups_at_d64():
    check_short_masks_take_two_warpgroups_at_d64(hopper)


def test_launch_builds_what_launch_options_ask_for(monkeypatch):
    """The launch itself, not only compile_args, builds the kernel with launch_options' choice: a
    spy in place of the compile cache records the kernel object of each launch (CPU tensors;
    nothing is compiled or run). Batch and packed, with and without pack-GQA, both sides of the
    1024-key cut, and a class without the hook (stage 7) built as before."""
    import contextlib

    built = []

    def spy(kernel, *args):
        built.append(kernel)
        return lambda *a: None

    monkeypatch.setattr(attention_host, "cached_compile_ffi", spy)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    cases = [  # (varlen, H, Hkv, Sq, Sk, causal, window, D) -> (warpgroups, pack)
        ((False, 4, 4, 700, 700, True, None, 64), (2, 1)),
        ((False, 4, 4, 1100, 1100, True, None, 64), (3, 1)),
        ((False, 4, 4, 700, 700, False, None, 64), (3, 1)),
        ((False, 4, 4, 4000, 4000, False, (200, 0), 64), (2, 1)),
        ((False, 8, 2, 1, 900, True, None, 64), (2, 4)),  # decode-like: pack-GQA, 128 rows
        ((False, 8, 2, 1, 2000, True, None, 64), (3, 4)),
        ((False, 4, 4, 700, 700, True, None, 128), (2, 1)),
        ((True, 4, 2, 600, 1000, True, None, 64), (2, 1)),  # packed: the longest sequence
        ((True, 4, 2, 600, 1300, True, None, 64), (3, None)),  # 192 rows: pack-GQA packs 2
    ]
    for (varlen, H, Hkv, Sq, Sk, causal, window, D), (wgs, pack) in cases:
        B = 1 if varlen else 2
        q, o = (torch.randn(B, H, Sq, D).bfloat16() for _ in range(2))
        k, v = (torch.randn(B, Hkv, Sk, D).bfloat16() for _ in range(2))
        lse = torch.empty(B, H, Sq)
        cu_q = torch.tensor([0, Sq], dtype=torch.int32) if varlen else None
        cu_k = torch.tensor([0, Sk], dtype=torch.int32) if varlen else None
        attention_host.launch(
            hopper.Sm90Kernel, q, k, v, o, lse, cu_q, cu_k, Sq, 0.125, causal, window, Sk
        )
        # pack: as choose_pack decides for the tile's rows (None: not asserted beyond that)
        pack = pack if pack is not None else choose_pack(H, Hkv, Sq, 64 * wgs)
        got = (built[-1].mma_warpgroups, built[-1].pack_gqa)
        assert got == (wgs, pack), ((varlen, H, Hkv, Sq, Sk, causal, window, D), got)
    q = torch.randn(2, 4, 700, 64).bfloat16()
    attention_host.launch(
        stage7.Sm90Kernel, q, q, q, q.clone(), torch.empty(2, 4, 700), None, None, 700, 0.125,
        True, None, 700,
    )  # fmt: skip
    assert type(built[-1]) is stage7.Sm90Kernel and built[-1].cta_tile[0] == 128


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_short_masks_at_d64_two_and_three_warpgroups_agree(dtype):
    check_two_and_three_warpgroups_agree(hopper, dtype)
