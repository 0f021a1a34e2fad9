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
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from test_stage7 import (
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
    HANDOVER_TILES,
    PACK_GQA_192_CASES,
    SAME_AS_STAGE7,
    check_kernels_with_and_without_mask_code_agree,
    check_mask_code_only_where_something_is_masked,
    check_pack_gqa_groups_follow_the_tile_rows,
    check_persistent_ctas_walk_many_tiles,
    check_persistent_ctas_walk_packed_sequences,
    check_ring_position_carries_across_work_tiles,
    check_short_masks_take_two_warpgroups_at_d64,
    check_ticket_walk_hands_every_live_tile_out_once,
    check_tile_handover_delivers_every_number_and_ends,
    check_tile_handover_model_catches_near_misses,
    check_tile_order_covers_every_tile_once_longest_first_by_section,
    check_turn_barriers_are_distinct_and_go_round,
    check_two_and_three_warpgroups_agree,
    explore,
    ptxas_log,
    statements,
)
from test_stage8_hopper import turn_kernel as stage8_turn_kernel

from common import attention_host
from common.pack_gqa import choose_pack
from common.tools import inputs, stage_table, verify
from stages.stage7_gqa_varlen import hopper as stage7
from stages.stage8_warp_specialized import hopper as stage8
from stages.stage9_overlap import hopper

# ---------------------------------------------------------------- compile-only


def compile_stage9(dtype, D, Sk=2048, **options):
    from common.tools.ptx import compile_for_arch, count_ptx, ptxas_resources

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


# ---------------------------------------------------------------- persistent CTAs, the tile scheduler
# (stage 8's checks, tests/test_stage8_hopper.py, on stage 9 against stage 8)


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


@pytest.mark.parametrize("D, pack", [(128, 1), (64, 1), (128, 2), (64, 3)])
@pytest.mark.parametrize(
    "lens_q",
    [[700, 0, 1, 130, 64, 450], [2047, 64, 64, 1], [5], [0, 0, 300], [384, 128, 192, 576]],
    ids=str,
)
@pytest.mark.parametrize("grid", [1, 3, 7, 132])
def test_ticket_walk_hands_every_live_tile_out_once(D, pack, lens_q, grid):
    check_ticket_walk_hands_every_live_tile_out_once(hopper, D, pack, lens_q, grid)


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
    check_persistent_ctas_walk_many_tiles(hopper, stage8, D)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_persistent_ctas_walk_packed_sequences(D, monkeypatch):
    check_persistent_ctas_walk_packed_sequences(hopper, stage8, D, monkeypatch)


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
    return verify.run_with_deadline(fn, seconds=120, what="stage 9 hopper")


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


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("stage", [7, 8, 9])
def test_launches_on_the_current_stream(stage):
    """Stages 7-9 launch through TVM-FFI, which takes the stream from the caller's context. On a
    side stream: a 50 ms sleep, then the inputs are written (they are NaN before), then the call;
    a kernel launched on any other stream would run before the inputs exist and read NaN."""
    mod = stage_table.track_module(stage, "hopper")
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


def test_stored_packed_run_matches_stage8_bit_for_bit():
    """The stored packed-sequence run (docs/results/varlen_dynamic_h200_2026-12-01.json, quoted
    by notebook 9) has a TFLOP/s figure per (batch, kernel), and in every row stage 9's two
    variants equal stage 8 bit for bit."""
    import json
    import os

    path = os.path.join(
        os.path.dirname(__file__), "..", "docs", "results", "varlen_dynamic_h200_2026-12-01.json"
    )
    rows = json.load(open(path))["rows"]
    assert rows and all(r["same_bits"] for r in rows)
    assert all(v[0] > 0 for r in rows for v in r["tflops_gpu_event"].values())


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


# ---------------------------------------------------------------- kernels without the mask code
# (stage 8's launch_options rule and checks, run here on stage 9)


def test_mask_code_only_where_something_is_masked():
    check_mask_code_only_where_something_is_masked(hopper, head_dims=(64,))


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_kernels_with_and_without_mask_code_agree(dtype, D):
    check_kernels_with_and_without_mask_code_agree(hopper, dtype, D, head_dims=(64,))
