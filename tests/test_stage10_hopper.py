"""Stage 10 (Hopper): overlap inside each consumer warpgroup - QK_j and PV_{j-1} issued as one
turn, softmax_j running while PV_{j-1} is on the tensor cores; stage 9's producer, ring and
ping-pong otherwise.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch and packed: the loop issues two
  GEMM groups per turn and waits for them one at a time (wait_group 1, then 0), in this program
  order; the QK^T and PV wgmma are emitted twice (the prologue's QK, the loop's pair, the last
  PV) and so are the exponentials; setmaxnreg 24 / 240; no spills and no wgmma serialised for
  want of registers.
- CPU: the turn protocol of (QK_j, PV_{j-1}) turns for 0-6 KV tiles under every interleaving of
  the two consumer warpgroups: no deadlock, balanced barriers, the tensor cores see 1: QK0,
  2: QK0, 1: QK1 PV0, 2: QK1 PV0, ...; the model fails its near misses (a wait or a pass too
  many, a lost pass, the pair issued PV first).
- GPU: stage 7's numerical tests run here from tests/test_stage7.py, O and LSE bit for bit
  against stage 9 from tests/test_stage_chain.py.
"""

import re

import pytest
from attention_cases import DTYPES, dtype_id
from test_stage9_hopper import check_turn_barriers_are_distinct_and_go_round, turn_kernel
from test_stage11_hopper import check_no_spills, compile_stage

from common.tools.turns import explore, overlap_order, overlap_program, schedule_string
from stages.stage10_overlap import hopper

# ---------------------------------------------------------------- compile-only


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_compiles_overlapped(dtype, D, varlen):
    kernel, ptx, counts, res = compile_stage(
        hopper, dtype, D, kv_heads=2, varlen=varlen, causal=True
    )
    assert (kernel.mma_warpgroups, kernel.cta_tile) == (2, (128, 128, D))
    # QK^T in the prologue and in the loop, PV in the loop and after it: each GEMM's wgmma
    # twice (D / 16 for QK^T, 128 / 16 = 8 for PV); the softmax (64 exponentials of P and 2 of
    # row_scale per thread) in the prologue and in the loop.
    assert counts["wgmma.mma_async"] == 2 * (D // 16 + 8)
    assert counts["ex2.approx"] == 2 * (64 + 2)
    # Program order. Producer: setmaxnreg.dec, the loads. Consumers: setmaxnreg.inc; the
    # prologue (turn 0: warpgroup 2 waits, QK issued, passed, waited); the loop (turn wait, QK
    # and PV issued as two groups, passed, wait_group 1 = QK done, wait_group 0 = PV done);
    # zero_rows when packed; the last PV (turn wait, issued, warpgroup 1's pass, waited); the
    # epilogue's two barriers.
    expected = r"0dL+iTGCPW" + r"TGCGCPwW" + ("B" if varlen else "") + r"TGCPWBB"
    assert re.fullmatch(expected, schedule_string(ptx)), schedule_string(ptx)
    # One CTA per tile: Q and the ring in 227 KiB, 6 x 32 KiB next to 32 KiB (D = 128), 13 x 16 KiB
    # next to 16 KiB (D = 64); 225 KiB with the barriers.
    assert kernel.kv_slots == {64: 13, 128: 6}[D]
    assert kernel.shared_memory_bytes == 1024 + 128 * D * 2 * (1 + kernel.kv_slots) == 230400
    check_no_spills(kernel, ptx, res)


# ---------------------------------------------------------------- the turn protocol (CPU)


def check_overlap_protocol(kernel, steps, zero_rows):
    n = kernel.mma_warpgroups
    programs = [overlap_program(kernel, wg, steps, zero_rows) for wg in range(1, n + 1)]
    assert explore(programs, overlap_order(steps, n)) == set()


def check_overlap_model_catches_near_misses(kernel, wg, change):
    n = kernel.mma_warpgroups
    programs = [overlap_program(kernel, w, 3, False) for w in range(1, n + 1)]
    ops = programs[wg - 1]
    if change == "extra_wait":
        ops.insert(0, ("sync", kernel.turn_barrier(wg)))
    elif change == "extra_pass":
        ops.insert(len(ops) - 2, ("arrive", kernel.turn_barrier(kernel.next_warpgroup(wg))))
    elif change == "lost_pass":
        ops.remove(next(op for op in ops if op[0] == "arrive"))
    else:  # the loop's pair issued PV first: the tensor-core order is not the intended one
        i = ops.index(("gemm", f"{wg}: QK1"))
        ops[i], ops[i + 1] = ops[i + 1], ops[i]
    assert explore(programs, overlap_order(3, n)) != set(), (wg, change)


@pytest.mark.parametrize("zero_rows", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("steps", range(7))
def test_turn_protocol_has_no_deadlock_and_alternates(steps, zero_rows):
    check_overlap_protocol(turn_kernel(2, hopper), steps, zero_rows)


def test_turn_barriers_are_distinct_and_go_round():
    check_turn_barriers_are_distinct_and_go_round(hopper)


@pytest.mark.parametrize("wg", [1, 2])
@pytest.mark.parametrize("change", ["extra_wait", "extra_pass", "lost_pass", "pv_before_qk"])
def test_turn_protocol_model_catches_near_misses(wg, change):
    check_overlap_model_catches_near_misses(turn_kernel(2, hopper), wg, change)
