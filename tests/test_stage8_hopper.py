"""Stage 8 (Hopper): warp specialisation - a TMA producer warpgroup, two consumer warpgroups
taking turns on the tensor cores (ping-pong through named barriers), a deeper K/V ring.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch and packed: setmaxnreg.dec (24)
  and setmaxnreg.inc (240) in the PTX and not ignored by ptxas (the kernel has a register cap at
  entry: .reqntid 384, .minnctapersm 1); stage 7's loop body (the same wgmma and exp2 counts);
  the named barriers, all counting the 256 consumer threads except the CTA-wide one that
  publishes the barrier initialisation, in the intended program order; no spills; kv_slots and
  the shared memory chosen.
- CPU: a model of the turn protocol (named-barrier semantics, every interleaving of the two
  consumer warpgroups) for 0-5 KV tiles: no deadlock, every barrier ends balanced, the tensor
  cores see 1: QK0, 2: QK0, 1: PV0 QK1, 2: PV0 QK1, ... and nothing else; the model fails the
  protocol's near misses (a wait or a pass too many). Stage 7's bad-input cases.
- GPU tests (marker gpu_hopper), each launch under a 120 s deadline so that a lost arrive fails
  instead of hanging: stage 7's numerical tests (GQA / MQA with causal and window masks against
  the fp64 reference, packed sequences per sequence, NaN planted outside a sequence, empty
  sequences, packed = batch mode) on stage 8; O and LSE equal to stage 7's bit for bit,
  including shapes long enough to wrap the ring many times.

The per-sequence references, packed inputs and bad-input cases are stage 7's
(tests/test_stage7_hopper.py).
"""

import itertools
import re
import shutil
import subprocess
import tempfile

import attention_cases
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

from common import checker, inputs
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


def compile_stage8(dtype, D, **options):
    from common.compile import compile_for_arch, count_ptx, ptxas_resources

    kernel, args = hopper.compile_args(dtype, (2, 8, 512, 1024, D), **options)
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
    (r"bar\.sync\s+1, 256;", "B"),  # the consumers' own barrier
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
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_compiles_warp_specialized(dtype, D, varlen):
    kernel, ptx, counts, res = compile_stage8(dtype, D, kv_heads=2, varlen=varlen, causal=True)
    # 384 threads with a register cap at entry (65,536 / 384 -> 168), so that setmaxnreg works:
    # the producer warpgroup down to 24, the two consumer warpgroups up to 240.
    assert ".reqntid 384, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;") != []
    assert statements(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;") != []
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
    # Named barriers: 0 (all 384 threads) only once, when the pipeline publishes its barriers;
    # the consumers' own syncs (epilogue x 2, zero_rows when packed) are barrier 1 over 256;
    # the turns are barriers 2 and 3 (a register: 1 + warpgroup), 256 = 128 waiting + 128
    # arriving: two waits (turn 0 of warpgroup 2, the turn before each PV) and two passes
    # (after each QK^T, after warpgroup 1's last PV).
    assert len(statements(ptx, r"(bar|barrier)\.sync\s+0;")) == 1
    assert len(statements(ptx, r"bar\.sync\s+1, 256;")) == (3 if varlen else 2)
    assert len(statements(ptx, r"bar\.sync\s+%r\d+, 256;")) == 2
    assert len(statements(ptx, r"bar\.arrive\s+%r\d+, 256;")) == 2
    assert counts["bar.sync"] == 1 + (3 if varlen else 2) + 2
    # In program order: producer (setmaxnreg.dec, Q, K and V loads), then the consumers
    # (setmaxnreg.inc; warpgroup 2's turn-0 wait; QK^T issued, turn passed, waited; zero_rows
    # when packed; turn wait, PV issued and waited; warpgroup 1's last pass; the epilogue's two
    # barriers). The pass follows the QK^T commit; the PV follows its turn wait.
    expected = r"0dL+iTGCPW" + ("B" if varlen else "") + r"TGCWPBB"
    assert re.fullmatch(expected, schedule_string(ptx)), schedule_string(ptx)
    # The ring: as many K or V tiles as fit in 227 KB next to Q and 1 KB of barriers.
    assert kernel.kv_slots == {64: 13, 128: 6}[D]
    assert kernel.shared_memory_bytes == 1024 + (1 + kernel.kv_slots) * 128 * D * 2 == 230400
    assert kernel.shared_memory_bytes <= 227 * 1024
    # kv_full and kv_empty per slot, and q_full
    assert counts["mbarrier.init"] == 2 * kernel.kv_slots + 1
    if res and "spill_stores" in res:
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res
        assert res["registers"] <= 168, res


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("D", [64, 128])
def test_q_tiles_longest_first_at_d128_only(D, varlen):
    """Longest first (the docstring's measurements): at D = 128 the kernel takes Q tile
    gridDim.x - 1 - blockIdx.x, so its PTX reads %nctaid.x, which nothing else in stage 8 reads;
    at D = 64, where the reversed order measured 2-3% slower, it keeps stage 7's order and its
    PTX reads no %nctaid.x. The order cannot be seen in the outputs (the same bits either way),
    so this is where a lost reversal shows."""
    kernel, ptx, _, _ = compile_stage8(torch.bfloat16, D, kv_heads=2, varlen=varlen, causal=True)
    assert kernel.longest_first == (D == 128)
    reads_grid = "%nctaid.x" in ptx
    assert reads_grid == (D == 128), f"D = {D}: %nctaid.x read: {reads_grid}"
    assert "%ctaid.x" in ptx  # the tile index itself is read either way


# ---------------------------------------------------------------- the turn protocol (CPU)


def consumer_program(wg, steps, zero_rows):
    """What consumer warpgroup wg (1 or 2) does with named barriers and the tensor cores, in the
    kernel's order: ('sync', id) = bar.sync, ('arrive', id) = bar.arrive, ('gemm', name)."""
    ops = []
    for t in range(steps):
        if t == 0 and wg == 2:
            ops.append(("sync", 1 + wg))  # wait_turn: warpgroup 2's turn 0
        ops += [("gemm", f"{wg}: QK{t}"), ("arrive", 4 - wg)]  # pass_turn
        if zero_rows and t == steps - 1:
            ops.append(("sync", 1))  # zero_rows of the last V tile
        ops += [("sync", 1 + wg), ("gemm", f"{wg}: PV{t}")]  # wait_turn, then PV_t
    if steps > 0 and wg == 1:
        ops.append(("arrive", 4 - wg))  # warpgroup 1's last turn
    return ops + [("sync", 1), ("sync", 1)]  # the epilogue


def expected_tensor_core_order(steps):
    order = []
    for t in range(steps + 1):
        for wg in (1, 2):
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


@pytest.mark.parametrize("zero_rows", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("steps", range(6))
def test_turn_protocol_has_no_deadlock_and_alternates(steps, zero_rows):
    programs = [consumer_program(wg, steps, zero_rows) for wg in (1, 2)]
    assert explore(programs, expected_tensor_core_order(steps)) == set()


def test_turn_protocol_model_catches_a_lost_turn():
    # The model is not vacuous: warpgroup 1 also waiting before its turn 0 (as warpgroup 2
    # does) deadlocks, and warpgroup 2 passing after its last turn leaves an arrival behind.
    for wg, change in itertools.product((1, 2), ("extra_wait", "extra_pass")):
        programs = [consumer_program(w, 2, False) for w in (1, 2)]
        ops = programs[wg - 1]
        if change == "extra_wait":
            ops.insert(0, ("sync", 1 + wg))
        else:
            ops.insert(len(ops) - 2, ("arrive", 4 - wg))
        assert explore(programs, expected_tensor_core_order(2)) != set(), (wg, change)


# ---------------------------------------------------------------- GPU: numerics


def run(fn):
    return checker.run_with_deadline(fn, seconds=120, what="stage 8 hopper")


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
