"""Stage 8 (Hopper): warp specialisation - a TMA producer warpgroup, two consumer warpgroups
(three at D = 64) taking turns on the tensor cores (ping-pong through named barriers), a deeper
K/V ring, persistent CTAs with a dynamic tile scheduler.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch and packed: setmaxnreg.dec (24)
  and setmaxnreg.inc (240; 160 with three consumer warpgroups) in the PTX and not ignored by
  ptxas (the kernel has a register cap at entry: .reqntid 384 or 512, .minnctapersm 1); stage
  7's loop body (the same wgmma and exp2 counts); the named barriers, all counting the
  consumer threads except the CTA-wide one that publishes the barrier initialisation, in the
  intended program order; no spills; kv_slots and the shared memory chosen. Three consumer
  warpgroups at D = 64, two under a short mask (launch_options), two at D = 128.
- CPU: a model of the turn protocol (named-barrier semantics, every interleaving of two and of
  three consumer warpgroups, the kernel's own barrier numbers) for 0-5 KV tiles: no deadlock,
  every barrier ends balanced, the tensor cores see 1: QK0, 2: QK0, (3: QK0,) 1: PV0 QK1, ...
  and nothing else; the model fails the protocol's near misses (a wait or a pass too many, a
  lost pass). Pack-GQA's group sizes against the tile rows (192 at D = 64) and the rows per
  pass of the O store. Stage 7's bad-input cases. The persistent loop (the check_* functions,
  which stage 9's tests call on stage 9): the ring's position across tiles, the tile order
  (longest first, L2 sections), the tickets of the dynamic scheduler walked to the end, every
  interleaving of the Q / tile-number hand-over (q_full, q_empty) and its near misses, the
  grids launched.
- GPU tests (marker gpu_hopper), each launch under a 120 s deadline so that a lost arrive fails
  instead of hanging: stage 7's numerical tests (GQA / MQA with causal and window masks against
  the fp64 reference, packed sequences per sequence, NaN planted outside a sequence, empty
  sequences, packed = batch mode) on stage 8; O and LSE equal to stage 7's bit for bit,
  including shapes long enough to wrap the ring many times, on both tiles of D = 64 (192 and
  128 rows); pack-GQA groups that only the 192-row tile packs; grids capped at a few CTAs so
  that each CTA walks many tiles (batch and packed, against the module with persistence off
  and stage 7), and the tile counter back at zero after each call.

The per-sequence references, packed inputs and bad-input cases are stage 7's
(tests/test_stage7_hopper.py).
"""

import re
import shutil
import subprocess
import tempfile

import attention_cases
import cutlass
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

from common import attention_host, masks
from common.pack_gqa import choose_pack
from common.tools import inputs, verify
from stages.stage7_gqa_varlen import hopper as stage7
from stages.stage8_warp_specialized import hopper

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


def compile_stage8(dtype, D, Sk=2048, **options):
    from common.tools.ptx import compile_for_arch, count_ptx, ptxas_resources

    kernel, args = hopper.compile_args(dtype, (2, 8, 512, Sk, D), **options)
    ptx, _ = compile_for_arch(kernel, args, "sm_90a")
    return kernel, ptx, count_ptx(ptx), ptxas_resources(ptx, "sm_90a")


def statements(ptx, pattern):
    return [s.strip() for s in ptx.splitlines() if re.match(pattern, s.strip())]


SCHEDULE_LETTERS = [
    (r"(bar|barrier)\.sync\s+0;", "0"),  # the CTA-wide sync after the barriers' initialisation
    (r"setmaxnreg\.dec", "d"),
    (r"setmaxnreg\.inc", "i"),
    (r"cp\.async\.bulk\.tensor", "L"),  # a TMA load
    (r"bar\.sync\s+%r\d+, 256;", "T"),  # wait_turn
    (r"bar\.arrive\s+%r\d+, 256;", "P"),  # pass_turn
    (r"bar\.sync\s+1, (256|384);", "B"),  # the consumers' own barrier (all their threads)
    (r"wgmma\.mma_async", "G"),
    (r"wgmma\.commit_group", "C"),
    (r"wgmma\.wait_group", "W"),
]


def schedule_string(ptx):
    """The order of the kernel's synchronisation and wgmma statements in the PTX, one letter
    each (SCHEDULE_LETTERS), a run of wgmma.mma_async as one G."""
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
def test_compiles_warp_specialized(dtype, D, Sk, varlen):
    kernel, ptx, counts, res = compile_stage8(dtype, D, Sk, kv_heads=2, varlen=varlen, causal=True)
    # Two consumer warpgroups at D = 128, three at D = 64 (a 192-row tile), two there under a
    # causal mask over at most 1024 keys (launch_options: Sk = 1024 here).
    wgs, regs = {64: (3, 160), 128: (2, 240)}[D] if Sk > 1024 else (2, 240)
    assert (kernel.mma_warpgroups, kernel.cta_tile) == (wgs, (64 * wgs, 128, D))
    # 384 (512) threads with a register cap at entry (65,536 / 384 -> 168; / 512 -> 128), so
    # that setmaxnreg works: the producer warpgroup down to 24, the consumers up to 240 (160).
    assert f".reqntid {128 * (1 + wgs)}, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert 128 * kernel.load_registers + kernel.mma_threads * kernel.mma_registers <= 65536
    assert statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;") != []
    assert statements(ptx, rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{regs};") != []
    assert len(statements(ptx, r"setmaxnreg")) == 2
    log = ptxas_log(ptx)
    if log is not None:
        assert "C7508" not in log and "setmaxnreg' ignored" not in log, log
        # C7512: wgmma serialised for want of registers.
        assert "C7512" not in log and "serialized" not in log, log
    # Stage 7's loop body: the same wgmma and exp2 counts.
    assert counts["wgmma.mma_async"] == D // 16 + 8
    assert counts["ex2.approx"] == 64 + 2
    # Loads by TMA (Q, K, V; D = 128 splits each box in two 64-column halves); O by threads.
    assert counts["cp.async.bulk.tensor (load)"] == (3 if D == 64 else 6)
    assert counts["cp.async.bulk.tensor (store)"] == 0
    # Named barriers: 0 (all threads) only once, when the pipeline publishes its barriers; the
    # consumers' own syncs (epilogue x 2, zero_rows when packed) are barrier 1 over their 256
    # or 384 threads; the turns are barriers 2, 3 (and 4) (a register: 1 + warpgroup), 256 =
    # 128 waiting + 128 arriving: two waits (turn 0 of every warpgroup but 1, the turn before
    # each PV) and two passes (after each QK^T, after the last PV of all but the last warpgroup).
    assert len(statements(ptx, r"(bar|barrier)\.sync\s+0;")) == 1
    own = rf"bar\.sync\s+1, {kernel.mma_threads};"
    assert len(statements(ptx, own)) == (3 if varlen else 2)
    assert len(statements(ptx, r"bar\.sync\s+%r\d+, 256;")) == 2
    assert len(statements(ptx, r"bar\.arrive\s+%r\d+, 256;")) == 2
    assert counts["bar.sync"] == 1 + (3 if varlen else 2) + 2
    # In program order: producer (setmaxnreg.dec, Q, K and V loads), then the consumers
    # (setmaxnreg.inc; the turn-0 wait; QK^T issued, turn passed, waited - for PV_{j-1} too;
    # zero_rows when packed; turn wait, PV issued, not waited for: the next QK^T follows it;
    # the last pass, then the wait for the last PV; the epilogue's two barriers). The pass
    # follows the QK^T commit; the PV follows its turn wait; no wait stands between a PV and
    # the QK^T that shares its turn.
    expected = r"0dL+iTGCPW" + ("B" if varlen else "") + r"TGCPWBB"
    assert re.fullmatch(expected, schedule_string(ptx)), schedule_string(ptx)
    # The ring: as many K or V tiles as fit in 227 KB next to Q and O (bM x D each: O has a
    # buffer of its own, so that the next work tile's Q can land during this one's epilogue)
    # and 1 KB of barriers: 2 x 24 KB + 11 x 16 KB at D = 64 (192 rows; 2 x 16 KB + 12 x 16 KB
    # with 128), 2 x 32 KB + 5 x 32 KB at D = 128; 225 KB either way.
    tile_bytes, q_bytes = 128 * D * 2, 64 * wgs * D * 2
    assert kernel.kv_slots == {(64, 3): 11, (64, 2): 12, (128, 2): 5}[D, wgs]
    assert kernel.shared_memory_bytes == 1024 + 2 * q_bytes + kernel.kv_slots * tile_bytes
    assert kernel.shared_memory_bytes == 230400
    assert kernel.shared_memory_bytes <= 227 * 1024 < kernel.shared_memory_bytes + tile_bytes
    # kv_full and kv_empty per slot, q_full and q_empty (the hand-over of Q and the tile number)
    assert counts["mbarrier.init"] == 2 * kernel.kv_slots + 2
    if res and "spill_stores" in res:
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res
        assert res["registers"] <= 65536 // kernel.threads, res


# ---------------------------------------------------------------- the turn protocol (CPU)


def turn_kernel(n, module=hopper):
    """The kernel object of a stage's hopper module (stage 8's by default; stage 9's tests pass
    theirs) with n consumer warpgroups: its turn_barrier and next_warpgroup."""
    return module.Sm90Kernel(cutlass.BFloat16, {2: 128, 3: 64}[n])


def consumer_program(wg, steps, zero_rows, n=2):
    """What consumer warpgroup wg (1 .. n, n consumer warpgroups) does with named barriers and
    the tensor cores, in the kernel's order: ('sync', id) = bar.sync, ('arrive', id) =
    bar.arrive, ('gemm', name), with the kernel's own barrier numbers (wait_turn: sync on
    turn_barrier(wg); pass_turn: arrive on the next warpgroup's)."""
    kernel = turn_kernel(n)
    assert kernel.mma_warpgroups == n
    wait = ("sync", kernel.turn_barrier(wg))
    pass_to = ("arrive", kernel.turn_barrier(kernel.next_warpgroup(wg)))
    ops = []
    for t in range(steps):
        if t == 0 and wg > 1:
            ops.append(wait)  # wait_turn: turn 0 comes round from warpgroup 1
        ops += [("gemm", f"{wg}: QK{t}"), pass_to]  # pass_turn
        if zero_rows and t == steps - 1:
            ops.append(("sync", 1))  # zero_rows of the last V tile
        ops += [wait, ("gemm", f"{wg}: PV{t}")]  # wait_turn, then PV_t
    if steps > 0 and wg < n:
        ops.append(pass_to)  # the last turn goes round, the last warpgroup's to nobody
    return ops + [("sync", 1), ("sync", 1)]  # the epilogue


def expected_tensor_core_order(steps, n=2):
    order = []
    for t in range(steps + 1):
        for wg in range(1, n + 1):
            order += [f"{wg}: PV{t - 1}"] if t > 0 else []
            order += [f"{wg}: QK{t}"] if t < steps else []
    return order


def explore(programs, expected, sizes=None):
    """Every interleaving of the programs (one per consumer warpgroup) under named-barrier rules:
    a barrier completes when sizes.get(barrier, 2) warpgroups have arrived (2: 256 threads, a
    turn barrier; barrier 1 counts every consumer warpgroup) and releases those waiting in it.
    Returns the problems found: a deadlock, a barrier left with arrivals, a warpgroup arriving
    twice in one phase (the hardware would complete the barrier without its partner), a GEMM out
    of turn."""
    sizes = {1: len(programs)} if sizes is None else sizes
    problems = set()
    # program counters, (barrier, warpgroup) arrivals of the open phases, warpgroup -> the
    # barrier it is blocked in
    start = (tuple(0 for _ in programs), (), frozenset())
    seen, todo = {start}, [start]
    while todo:
        pcs, arrivals, blocked = todo.pop()
        done = all(pc == len(p) for pc, p in zip(pcs, programs))
        if done:
            if arrivals:
                problems.add(f"barrier arrivals left at the end: {arrivals}")
            continue
        moves = []
        for w, (pc, prog) in enumerate(zip(pcs, programs)):
            if pc == len(prog) or any(x == w for x, _ in blocked):
                continue
            kind, arg = prog[pc]
            nxt_pcs = tuple(pc + (i == w) for i, pc in enumerate(pcs))
            if kind == "gemm":
                issued = sum(op[0] == "gemm" for p, c in zip(programs, pcs) for op in p[:c])
                if issued >= len(expected) or expected[issued] != arg:
                    problems.add(f"{arg} issued out of turn")
                moves.append((nxt_pcs, arrivals, blocked))
                continue
            if (arg, w) in arrivals:
                problems.add(f"warpgroup {w + 1} arrives twice on barrier {arg} in one phase")
                continue
            arr = arrivals + ((arg, w),)
            blk = blocked | {(w, arg)} if kind == "sync" else blocked
            if sum(b == arg for b, _ in arr) == sizes.get(arg, 2):  # the barrier completes
                blk = frozenset(x for x in blk if x[1] != arg)
                arr = tuple(a for a in arr if a[0] != arg)
            moves.append((nxt_pcs, tuple(sorted(arr)), frozenset(blk)))
        if not moves:
            problems.add(f"deadlock at {pcs}, arrivals {arrivals}")
        for m in moves:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return problems


@pytest.mark.parametrize("n", [2, 3], ids=["2wg", "3wg"])
@pytest.mark.parametrize("zero_rows", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("steps", range(6))
def test_turn_protocol_has_no_deadlock_and_alternates(steps, zero_rows, n):
    programs = [consumer_program(wg, steps, zero_rows, n) for wg in range(1, n + 1)]
    assert explore(programs, expected_tensor_core_order(steps, n)) == set()


def check_turn_barriers_are_distinct_and_go_round(module):
    """The kernel's turn barriers: one per consumer warpgroup, none of them barrier 1 (all
    consumers') or 0 (the CTA's), and next_warpgroup a single cycle through all of them.
    (Stages 8 and 9.)"""
    for n in (2, 3):
        kernel = turn_kernel(n, module)
        barriers = [kernel.turn_barrier(w) for w in range(1, n + 1)]
        assert len(set(barriers)) == n and not {0, 1} & set(barriers) and max(barriers) < 16
        w, seen = 1, []
        for _ in range(n):
            seen.append(w)
            w = kernel.next_warpgroup(w)
        assert w == 1 and sorted(seen) == list(range(1, n + 1)), (n, seen)


def test_turn_barriers_are_distinct_and_go_round():
    check_turn_barriers_are_distinct_and_go_round(hopper)


@pytest.mark.parametrize("n,wg", [(2, 1), (2, 2), (3, 1), (3, 2), (3, 3)])
@pytest.mark.parametrize("change", ["extra_wait", "extra_pass", "lost_pass"])
def test_turn_protocol_model_catches_a_lost_turn(wg, change, n):
    # The model is not vacuous: warpgroup 1 also waiting before its turn 0 (as the others do)
    # deadlocks, the last warpgroup passing after its last turn leaves an arrival behind, and
    # so on for each warpgroup and each near miss.
    kernel = turn_kernel(n)
    programs = [consumer_program(w, 2, False, n) for w in range(1, n + 1)]
    ops = programs[wg - 1]
    if change == "extra_wait":
        ops.insert(0, ("sync", kernel.turn_barrier(wg)))
    elif change == "extra_pass":
        ops.insert(len(ops) - 2, ("arrive", kernel.turn_barrier(kernel.next_warpgroup(wg))))
    else:
        ops.remove(next(op for op in ops if op[0] == "arrive"))
    assert explore(programs, expected_tensor_core_order(2, n)) != set(), (wg, change)


# ---------------------------------------------------------------- GPU: numerics


def run(fn):
    return verify.run_with_deadline(fn, seconds=120, what="stage 8 hopper")


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
def test_gqa_d64_decode_like():
    # Sq = 1: warpgroup 2's 64 rows all lie past the sequence, yet it takes every turn.
    q, _, _ = inputs.attention_inputs(4, 32, 1, 1, 64, seed=3)
    _, k, v = inputs.attention_inputs(4, 8, 1, 4000, 64, seed=4)
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
    # what they are alone (zero_rows now runs between the two warpgroups' turns).
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


# (B, H, Hkv, Sq, Sk, D, dtype, causal, window): 4096 keys at D = 64 are 64 ring entries, five
# wraps of the 13 slots; 2048 at D = 128 are 32 entries over 6 slots.
SAME_AS_STAGE7 = [
    (2, 8, 2, 1000, 1000, 128, torch.bfloat16, True, None),
    (1, 4, 4, 4096, 4096, 64, torch.bfloat16, False, None),
    (1, 4, 1, 2048, 2048, 128, torch.float16, True, None),
    (2, 4, 2, 700, 1500, 64, torch.float16, False, (300, 0)),
    (1, 2, 2, 129, 3000, 128, torch.bfloat16, False, (None, 10)),
    # D = 64 on the 192-row tile under a mask (three consumer warpgroups: over 1024 keys)
    (1, 4, 2, 2000, 2000, 64, torch.bfloat16, True, None),
    (2, 2, 2, 1100, 1100, 64, torch.float16, True, None),
]


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("case", SAME_AS_STAGE7, ids=lambda c: "x".join(map(str, c[:6])))
def test_equals_stage7_bit_for_bit(case):
    # Each warpgroup runs stage 7's instructions on its rows: only the schedule differs.
    B, H, Hkv, Sq, Sk, D, dtype, causal, window = case
    q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=Sq + D)
    _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, D, dtype, seed=Sk + D)
    kw = dict(causal=causal, window=window, return_lse=True)
    o8, lse8 = run(lambda: hopper.attention(q, k, v, **kw))
    o7, lse7 = run(lambda: stage7.attention(q, k, v, **kw))
    assert torch.equal(o8, o7), f"max |O8 - O7| = {(o8.float() - o7.float()).abs().max()}"
    assert torch.equal(lse8, lse7), f"max |LSE8 - LSE7| = {(lse8 - lse7).abs().max()}"


@pytest.mark.gpu_hopper
def test_packed_equals_stage7_bit_for_bit():
    lens_q, lens_k = PACKS["long-and-short"]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 128, torch.bfloat16, seed=21)
    kw = dict(causal=True, return_lse=True)
    o8, lse8 = run(lambda: hopper.attention_varlen(q, k, v, cu_q, cu_k, **kw))
    o7, lse7 = run(lambda: stage7.attention_varlen(q, k, v, cu_q, cu_k, **kw))
    assert torch.equal(o8, o7) and torch.equal(lse8, lse7)


@pytest.mark.gpu_hopper
def test_stage_package_dispatches_to_hopper():
    from stages.stage8_warp_specialized import attention, attention_varlen

    q, k, v = inputs.attention_inputs(1, 4, 200, 200, 64, seed=8)
    o = run(lambda: attention(q, k[:, :2], v[:, :2], causal=True))
    gqa_reference_check("O", o, None, q, k[:, :2], v[:, :2], True, None)
    q, k, v, cu_q, cu_k = packed_inputs([10, 20], [10, 20], 4, 2, 64, torch.bfloat16, seed=3)
    o, lse = run(lambda: attention_varlen(q, k, v, cu_q, cu_k, return_lse=True))
    check_packed(o, lse, q, k, v, cu_q, cu_k, False, None)


@pytest.mark.gpu_hopper
def test_gqa_needs_no_expanded_copy():
    # The same answer as K, V expanded to H heads by stride-0 views (a kernel of its own).
    q, _, _ = inputs.attention_inputs(2, 8, 256, 256, 64, seed=5)
    _, k, v = inputs.attention_inputs(2, 2, 256, 512, 64, seed=6)
    o = run(lambda: hopper.attention(q, k, v, causal=True))
    ke, ve = (t[:, :, None].expand(2, 2, 4, 512, 64).reshape(2, 8, 512, 64) for t in (k, v))
    assert torch.equal(o, run(lambda: hopper.attention(q, ke, ve, causal=True)))


@pytest.mark.gpu_hopper
def test_packed_equals_batch_mode_on_equal_lengths():
    B, H, S, D = 3, 4, 300, 64
    q, k, v = inputs.attention_inputs(B, H, S, S, D, seed=12)
    o = run(lambda: hopper.attention(q, k, v, causal=True))
    pack = lambda t: t.transpose(1, 2).reshape(B * S, H, D)  # noqa: E731
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
    op = run(lambda: hopper.attention_varlen(pack(q), pack(k), pack(v), cu, cu, causal=True))
    assert torch.equal(op, pack(o))


@pytest.mark.gpu_hopper
def test_all_empty_and_given_max_seqlen():
    q, k, v, cu_q, cu_k = packed_inputs([0, 0], [5, 0], 4, 4, 64, torch.bfloat16, seed=1)
    o, lse = run(lambda: hopper.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True))
    assert o.shape == (0, 4, 64) and lse.shape == (4, 0)
    # max_seqlen_q = 512: CTAs past both sequences' ends run empty tile ranges (no turn taken).
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
@pytest.mark.parametrize("case", PACK_GQA_CASES, ids=pack_case_id)
def test_pack_gqa_matches_reference_and_unpacked(case):
    check_pack_gqa(hopper, case)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_pack_gqa_packed_sequences_with_nan_around(D):
    check_pack_gqa_varlen(hopper, D)


# ---------------------------------------------------------------- the 192-row tile of D = 64


# Groups that only the 192-row tile of D = 64 packs (G = 3, 6, 12: 128 % G != 0) or whose store
# takes 32-row passes instead of 48 (G = 64; G = 32 is in stage 7's cases), and a G = 3 group
# of 2 KV heads with a window. (Stage 9 runs them too.)
PACK_GQA_192_CASES = [
    (2, 12, 4, 5, 700, 64, torch.bfloat16, True, None),
    (1, 6, 1, 50, 333, 64, torch.float16, True, None),
    (2, 24, 2, 1, 257, 64, torch.bfloat16, True, None),
    (1, 64, 1, 2, 200, 64, torch.bfloat16, False, None),
    (2, 6, 2, 40, 300, 64, torch.bfloat16, False, (60, 0)),
]


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("case", PACK_GQA_192_CASES, ids=pack_case_id)
def test_pack_gqa_on_the_192_row_tile(case):
    check_pack_gqa(hopper, case)


def check_pack_gqa_groups_follow_the_tile_rows(module):
    """Pack-GQA needs G to divide the Q tile's rows: 192 at D = 64 (G = 3 packs, G = 128 does
    not), 128 at D = 128 (G = 3 does not). attention() takes the rows from the kernel object.
    (Stages 8 and 9: `module` is the stage's hopper module.)"""
    kernel_class = module.Sm90Kernel
    rows = {d: attention_host.tile_rows(kernel_class, torch.bfloat16, d) for d in (64, 128)}
    assert rows == {64: 192, 128: 128}
    assert choose_pack(12, 4, 1, rows[64]) == 3 and choose_pack(12, 4, 1, rows[128]) == 1
    assert choose_pack(128, 1, 1, rows[64]) == 1 and choose_pack(128, 1, 1, rows[128]) == 128
    for G in (3, 6, 12, 24, 32, 48, 64, 96):
        kernel = kernel_class(cutlass.BFloat16, 64, G)
        r = kernel.store_rows_per_pass()
        assert 192 % r == 0 and (r % G == 0 or G % r == 0), (G, r)
        assert r * 8 <= kernel.mma_threads
    with pytest.raises(ValueError, match="pack_gqa"):
        choose_pack(12, 4, 1, rows[128], pack_gqa=True)


def test_pack_gqa_groups_follow_the_tile_rows():
    check_pack_gqa_groups_follow_the_tile_rows(hopper)


# ---------------------------------------------------------------- two warpgroups for short masks


def check_short_masks_take_two_warpgroups_at_d64(module):
    """launch_options: at D = 64 a causal or window mask that leaves no query row more than
    1024 keys gets the 128-row tile (two consumer warpgroups), everything else the default (three
    at D = 64, two at D = 128). The boundary both ways, and the compile_args of CI's checks
    building the same object as a launch. (Stages 8 and 9.)"""

    def wgs(D, Sq, Sk, causal=False, window=None, H=8, Hkv=8):
        left, right = masks.resolve_window(causal, window, Sq, Sk)
        opts = attention_host.kernel_options(
            module.Sm90Kernel, D, left, right, Sq, Sk, H // Hkv, False
        )
        kernel, _ = module.compile_args(
            torch.bfloat16, (2, H, Sq, Sk, D), causal=causal, window=window, kv_heads=Hkv
        )
        assert kernel.mma_warpgroups == opts.get("mma_warpgroups", kernel.warpgroups_for(D))
        return kernel.mma_warpgroups

    assert wgs(64, 1024, 1024, causal=True) == 2  # every row sees at most 1024 keys
    assert wgs(64, 1025, 1025, causal=True) == 3
    assert wgs(64, 1, 1024, causal=True) == 2 and wgs(64, 1, 1025, causal=True) == 3
    assert wgs(64, 4096, 4096, window=(256, 0)) == 2  # 257 keys per row
    assert (
        wgs(64, 4096, 4096, window=(511, 512)) == 2 and wgs(64, 4096, 4096, window=(512, 512)) == 3
    )
    assert wgs(64, 4096, 4096, window=(None, 0)) == 3  # causal-like, 4096 keys
    assert wgs(64, 512, 512) == 3  # no mask: the 192-row tile at every length
    assert wgs(64, 512, 2000, window=(3000, 3000)) == 3  # a window wider than the keys: no mask
    assert wgs(128, 512, 512, causal=True) == 2  # D = 128: two in any case
    # G = H / Hkv must divide 64, so that pack-GQA's choices do not change with the tile.
    assert wgs(64, 512, 512, causal=True, H=8, Hkv=2) == 2
    assert wgs(64, 512, 512, causal=True, H=6, Hkv=2) == 3  # G = 3
    assert wgs(64, 512, 512, causal=True, H=128, Hkv=1) == 3  # G = 128


def test_short_masks_take_two_warpgroups_at_d64():
    check_short_masks_take_two_warpgroups_at_d64(hopper)


def check_two_and_three_warpgroups_agree(module, dtype):
    """The short-mask launches at D = 64 (two consumer warpgroups, a 128-row tile) against the
    fp64 reference, and bit for bit against the same launches pinned to three warpgroups (the
    same arithmetic per row in either tile): causal, a window, GQA, a ragged Sq, and packed
    sequences causal; calls of both kernels interleaved in one process. (Stages 8 and 9.)"""

    class three(module.Sm90Kernel):  # the default tile at every length
        launch_options = staticmethod(lambda *a: {})

    for B, H, Hkv, Sq, Sk, causal, window in [
        (2, 4, 4, 700, 700, True, None),
        (2, 8, 2, 300, 1000, False, (100, 0)),
        (1, 4, 1, 1000, 1024, True, None),
        (3, 2, 2, 129, 513, False, (60, 40)),
    ]:
        left, right = masks.resolve_window(causal, window, Sq, Sk)
        opts = attention_host.kernel_options(
            module.Sm90Kernel, 64, left, right, Sq, Sk, H // Hkv, False
        )
        assert opts == {"mma_warpgroups": 2}, (Sq, Sk, causal, window)
        q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, 64, dtype, seed=Sq + Sk)
        _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, 64, dtype, seed=Sk)
        o2, lse2 = run(
            lambda: module.attention(q, k, v, causal=causal, window=window, return_lse=True)
        )
        gqa_reference_check("O", o2, lse2, q, k, v, causal, window)
        o3, lse3 = run(
            lambda: attention_host.attention(three, q, k, v, None, causal, window, True, None)
        )
        assert torch.equal(o2, o3), (Sq, Sk, (o2.float() - o3.float()).abs().max())
        assert torch.equal(lse2, lse3), (Sq, Sk)
    lens_q, lens_k = [700, 1, 0, 300], [700, 64, 10, 1000]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 64, dtype, seed=11)
    o2, lse2 = run(
        lambda: module.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    )
    check_packed(o2, lse2, q, k, v, cu_q, cu_k, True, None)
    o3, lse3 = run(
        lambda: attention_host.attention_varlen(
            three, q, k, v, cu_q, cu_k, None, None, None, True, None, True, None
        )
    )
    assert torch.equal(o2, o3) and torch.equal(lse2, lse3)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_short_masks_at_d64_two_and_three_warpgroups_agree(dtype):
    check_two_and_three_warpgroups_agree(hopper, dtype)


# ---------------------------------------------------------------- kernels without the mask code


def check_mask_code_only_where_something_is_masked(module, head_dims):
    """launch_options: at the head dims `head_dims`, a launch that masks no element - no causal
    or window cut, batch mode, Sk a multiple of the 128-key tile - gets the kernel compiled
    without the element-mask code (edge_masks=False); a cut, a ragged Sk or packed sequences (a
    sequence's last tile may end inside it) keep it, and so does every launch at the other head
    dims. The compile_args of CI's checks build the same object as a launch. (Stages 8 and 9:
    stage 9 drops it at D = 64 only.)"""

    def edge_masks(D, Sq, Sk, causal=False, window=None, varlen=False):
        left, right = masks.resolve_window(causal, window, Sq, Sk)
        opts = attention_host.kernel_options(module.Sm90Kernel, D, left, right, Sq, Sk, 1, varlen)
        kernel, _ = module.compile_args(
            torch.bfloat16, (2, 4, Sq, Sk, D), causal=causal, window=window, varlen=varlen
        )
        assert kernel.edge_masks == opts.get("edge_masks", True), (D, Sq, Sk, causal, window)
        return kernel.edge_masks

    for D in (64, 128):
        free = D in head_dims
        assert edge_masks(D, 1024, 1024) != free
        assert edge_masks(D, 1000, 2048) != free  # a ragged Sq masks no key
        assert edge_masks(D, 1, 128) != free
        assert edge_masks(D, 1024, 1000)  # the last KV tile reaches past Sk
        assert edge_masks(D, 1024, 1152 + 1)
        assert edge_masks(D, 1024, 1024, causal=True)
        assert edge_masks(D, 1024, 1024, window=(100, 100))
        assert edge_masks(D, 1024, 1024, window=(1023, None))  # left < Sk counts as a cut
        assert edge_masks(D, 512, 2048, window=(3000, 3000)) != free  # wider than the keys
        assert edge_masks(D, 1024, 1024, varlen=True)


def check_kernels_with_and_without_mask_code_agree(module, dtype, D, head_dims):
    """Launches alternating, in one process, between shapes that take the kernel without the
    mask code (Sk a multiple of 128, no cut) and shapes that need the one with it (a ragged Sk,
    causal, GQA): each against the fp64 reference, and the mask-free ones bit for bit against
    the same launches pinned to the kernel with the mask code (the same arithmetic: no tile
    crosses an edge there). A kernel reused on a launch it was not compiled for fails here:
    without the mask, the keys TMA fills with zeros past a ragged Sk would count as S = 0.
    head_dims: where the stage drops the mask code (elsewhere every launch keeps it). (Stages
    8 and 9.)"""

    class with_mask_code(module.Sm90Kernel):
        launch_options = staticmethod(lambda *a: {"edge_masks": True})

    sequence = [  # (B, H, Hkv, Sq, Sk, causal): mask code needed?
        ((2, 4, 4, 1024, 1024, False), False),
        ((2, 4, 4, 1024, 1000, False), True),
        ((1, 8, 2, 333, 1024, False), False),
        ((2, 4, 4, 1024, 1024, True), True),
        ((2, 4, 4, 700, 1025, False), True),
        ((2, 4, 4, 1024, 1024, False), False),
    ]
    for (B, H, Hkv, Sq, Sk, causal), needed in sequence:
        left, right = masks.resolve_window(causal, None, Sq, Sk)
        opts = attention_host.kernel_options(
            module.Sm90Kernel, D, left, right, Sq, Sk, H // Hkv, False
        )
        needed = needed or D not in head_dims
        assert opts.get("edge_masks", True) == needed, (Sq, Sk, causal)
        q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=Sq + Sk + D)
        _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, D, dtype, seed=Sk + D)
        o, lse = run(lambda: module.attention(q, k, v, causal=causal, return_lse=True))
        gqa_reference_check("O", o, lse, q, k, v, causal, None)
        if not needed:
            o_m, lse_m = run(
                lambda: attention_host.attention(
                    with_mask_code, q, k, v, None, causal, None, True, None
                )
            )
            assert torch.equal(o, o_m), (Sq, Sk, (o.float() - o_m.float()).abs().max())
            assert torch.equal(lse, lse_m), (Sq, Sk)


def test_mask_code_only_where_something_is_masked():
    check_mask_code_only_where_something_is_masked(hopper, head_dims=(64, 128))


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_kernels_with_and_without_mask_code_agree(dtype, D):
    check_kernels_with_and_without_mask_code_agree(hopper, dtype, D, head_dims=(64, 128))


# ---------------------------------------------------------------- persistent CTAs, the tile scheduler
# (stage 9 runs the same checks on its kernel, against stage 8)


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


def check_ticket_walk_hands_every_live_tile_out_once(module, D, pack, lens_q, grid):
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
    """The model above must fail each near miss of the protocol: the producer writing END
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
    tiles), non-causal again; each bit for bit against stage 8 (poisoned outputs: a tile
    computed by nobody fails)."""

    class kernel_class(module.Sm90Kernel):  # the grid capped at 7 CTAs
        # One compiled kernel for every call: the default tile also under the short masks
        # below (launch_options would take two consumer warpgroups there at D = 64).
        launch_options = staticmethod(lambda *a: {})

        def __init__(self, dtype, d, pack, **options):
            super().__init__(dtype, d, pack, sm_count=7, **options)

    B, H, Sq, Sk = 2, 4, 1000, 1000
    # 8 Q tiles of 128 rows (D = 128) or 6 of 192 (D = 64) x 4 heads x 2: 64 or 48 tiles
    tiles = -(-Sq // module.Sm90Kernel(cutlass.BFloat16, D).tile_rows) * H * B
    assert tiles == {64: 48, 128: 64}[D]
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
    assert live == {"first": {64: 40, 128: 56}[D], "second": {64: 4, 128: 6}[D]}, live
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
    check_persistent_ctas_walk_many_tiles(hopper, stage7, D)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_persistent_ctas_walk_packed_sequences(D, monkeypatch):
    check_persistent_ctas_walk_packed_sequences(hopper, stage7, D, monkeypatch)


@pytest.mark.parametrize("D", [64, 128])
def test_persistent_longest_first_by_section_at_both_head_dims(D):
    """The configuration the docstring measured: persistent CTAs, O in its own buffer, the Q
    tiles longest first in L2 sections, at both head dims (stage 9 keeps all four); the launch
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
