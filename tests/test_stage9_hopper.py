"""Stage 9 (Hopper): ping-pong - the two consumer warpgroups take turns on the tensor cores
through named barriers; a turn is PV_j and QK_{j+1}, issued back to back.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch and packed: the named barriers in
  program order (the turn waits and passes over 256 threads, the consumers' own barrier 1, the
  CTA-wide barrier 0 once), one wait after each turn's pair, setmaxnreg 24 / 240, no spills.
- CPU: a model of the turn protocol (common/tools/turns.py: named-barrier semantics, every
  interleaving of the two consumer warpgroups, the kernel's own barrier numbers) for 0-5 KV
  tiles: no deadlock, every barrier ends balanced, the tensor cores see 1: QK0, 2: QK0, 1: PV0
  QK1, 2: PV0 QK1, ... and nothing else, no GEMM's result read before its wait; the model fails
  the protocol's near misses (a wait or a pass too many, a lost pass, any one of the four turn
  operations missing). The turn barriers are distinct and go round.
- GPU: stage 7's numerical tests run here from tests/test_stage7.py, O and LSE bit for bit
  against stage 8 from tests/test_stage_chain.py.
"""

import re

import cutlass
import pytest
from attention_cases import DTYPES, dtype_id
from test_stage11_hopper import check_no_spills, compile_stage, statements

from common.tools.turns import (
    TURN_OPS,
    explore,
    in_flight_reads,
    pingpong_program,
    pingpong_turn_ops,
    schedule_string,
    without_waits,
)
from common.tools.turns import pingpong_order as expected_tensor_core_order
from stages.stage9_pingpong import hopper

# ---------------------------------------------------------------- compile-only


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_compiles_pingpong(dtype, D, varlen):
    kernel, ptx, counts, res = compile_stage(
        hopper, dtype, D, kv_heads=2, varlen=varlen, causal=True
    )
    assert (kernel.mma_warpgroups, kernel.cta_tile) == (2, (128, 128, D))
    # Stage 8's loop body: QK^T (D / 16 wgmma) and PV (128 / 16) once each, 64 + 2 exponentials.
    assert counts["wgmma.mma_async"] == D // 16 + 8
    assert counts["ex2.approx"] == 64 + 2
    # Program order: producer (setmaxnreg.dec, loads); consumers (setmaxnreg.inc; the turn-0
    # wait; QK^T issued, turn passed, waited - for PV_{j-1} too; zero_rows when packed; turn
    # wait, PV issued, not waited for: the next QK^T follows it; the last pass, then the wait
    # for the last PV; the epilogue's two barriers).
    expected = r"0dL+iTGCPW" + ("B" if varlen else "") + r"TGCPWBB"
    assert re.fullmatch(expected, schedule_string(ptx)), schedule_string(ptx)
    # The reader the notebook's exercise uses finds every turn operation of the model.
    assert pingpong_turn_ops(ptx) == TURN_OPS
    # Two waits and two passes on the turn barriers (256 threads), barrier 0 once.
    assert len(statements(ptx, r"bar\.sync\s+%r\d+, 256;")) == 2
    assert len(statements(ptx, r"bar\.arrive\s+%r\d+, 256;")) == 2
    assert len(statements(ptx, r"(bar|barrier)\.sync\s+0;")) == 1
    check_no_spills(kernel, ptx, res)


# ---------------------------------------------------------------- the turn protocol (CPU)


def turn_kernel(n, module=hopper):
    """The kernel object of a stage's hopper module (stage 9's by default; later stages' tests
    pass theirs) with n consumer warpgroups: its turn_barrier and next_warpgroup. n = 3 exists
    from stage 12 on (D = 64)."""
    return module.Sm90Kernel(cutlass.BFloat16, {2: 128, 3: 64}[n])


def consumer_program(wg, steps, zero_rows, n=2, **kw):
    """What consumer warpgroup wg (1 .. n, n consumer warpgroups) does with named barriers and
    the tensor cores, in stage 9's order, with the kernel's own barrier numbers
    (common/tools/turns.py: pingpong_program)."""
    kernel = turn_kernel(n)
    assert kernel.mma_warpgroups == n
    return pingpong_program(kernel, wg, steps, zero_rows, **kw)


@pytest.mark.parametrize("n", [2])
@pytest.mark.parametrize("zero_rows", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("steps", range(6))
def test_turn_protocol_has_no_deadlock_and_alternates(steps, zero_rows, n):
    programs = [consumer_program(wg, steps, zero_rows, n) for wg in range(1, n + 1)]
    assert explore(programs, expected_tensor_core_order(steps, n)) == set()
    # One wait after each turn's pair covers both GEMMs before their results are read.
    for wg in range(1, n + 1):
        with_waits = consumer_program(wg, steps, zero_rows, n, waits=True)
        assert without_waits(with_waits) == programs[wg - 1]
        assert in_flight_reads(with_waits) == []


def check_turn_barriers_are_distinct_and_go_round(module, ns=(2,)):
    """The kernel's turn barriers: one per consumer warpgroup, none of them barrier 1 (all
    consumers') or 0 (the CTA's), and next_warpgroup a single cycle through all of them.
    (Stages 9-12; n: the consumer warpgroup counts the stage has.)"""
    for n in ns:
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


@pytest.mark.parametrize("n,wg", [(2, 1), (2, 2)])
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


@pytest.mark.parametrize("lost", TURN_OPS)
def test_turn_protocol_model_reports_each_lost_turn_operation(lost):
    # What exercise 9a relies on: a kernel that lost any one of its four turn operations is
    # reported (a deadlock, an arrival left over, or a GEMM out of turn).
    kept = tuple(op for op in TURN_OPS if op != lost)
    programs = [consumer_program(wg, 3, False, turn_ops=kept) for wg in (1, 2)]
    assert explore(programs, expected_tensor_core_order(3)) != set(), lost


def test_a_turn_operation_lost_in_the_ptx_is_read_as_lost():
    # pingpong_turn_ops on the PTX of stage 9 with the last pass_turn deleted.
    from common.tools import exercises

    ex = exercises.EXERCISES["9a"]
    _, ptx, _ = exercises.compile_module(
        exercises.load_stage_file(9, "hopper", ex.solution), "hopper"
    )
    assert pingpong_turn_ops(ptx) == TURN_OPS[:3]
