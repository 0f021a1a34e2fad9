"""The ring schedule of the Blackwell kernels of stages 2-5, checked from each kernel object's
own configuration (common/schedule.py), and the check shown to fail on a faulty ring.

- Each kernel is traced for sm_100a (cute.compile with fake tensors, no GPU): that sets the byte
  counts it derives from its shared-memory layouts. The checker then replays the Q buffer and the
  K/V ring for several KV tile counts and kv_slots = 1, 2, 3: no slot overwritten before its
  reader released it, producer and consumer agree on the entries per KV tile, every entry arms
  the bytes its TMA copy moves, no hang.
- The same PTX shows the byte counts the kernel declares: every mbarrier.arrive.expect_tx arms
  one of them.
- A model of the faulty ring that stage 4's docstring describes (one ring entry per KV tile
  carrying K and V, so that V_j lands in K_j's slot under the same barrier before the QK MMA
  has read K_j; a consumer that waits twice per tile for one entry produced; Q + K bytes armed
  on the K/V ring and the Q buffer) must be rejected, for each of its defects; so must single
  mutations of a correct kernel's configuration.
"""

import copy

import pytest
import torch

from common import schedule, stages
from common.compile import compile_for_arch, expect_tx_immediates

# (stage, compile shape, KV tile counts the stage runs): stage 3 takes exactly one KV tile.
KERNELS = [
    (2, (1, 2, 256, 512, 128), (1, 2, 3, 4, 7)),
    (3, (1, 2, 256, 128, 128), (1,)),
    (4, (1, 2, 256, 512, 128), (1, 2, 3, 4, 7)),
    (5, (1, 2, 256, 512, 128), (1, 2, 3, 4, 7)),
]
SHAPES = {stage: shape for stage, shape, _ in KERNELS}
_TRACED = {}


def traced(stage, shape, kv_slots=None, dtype=torch.bfloat16):
    """(kernel, ptx): the stage's Sm100Kernel after cute.compile for sm_100a, with an optional
    kv_slots override (set before tracing, so the layouts and barriers follow it)."""
    key = (stage, shape, kv_slots, dtype)
    if key not in _TRACED:
        kernel, args = stages.track_module(stage, "blackwell").compile_args(dtype, shape)
        if kv_slots is not None:
            kernel.kv_slots = kv_slots
        ptx, _ = compile_for_arch(kernel, args, "sm_100a")
        _TRACED[key] = (kernel, ptx)
    return _TRACED[key]


def stage_id(entry):
    return f"stage{entry[0]}"


# ---------------------------------------------------------------- the kernels pass


@pytest.mark.parametrize("kv_slots", [None, 1, 3], ids=lambda s: f"kv_slots={s or 'default'}")
@pytest.mark.parametrize("entry", KERNELS, ids=stage_id)
def test_kernel_ring_schedule_is_safe(entry, kv_slots):
    stage, shape, tile_counts = entry
    kernel, _ = traced(stage, shape, kv_slots)
    violations = schedule.check_kernel(kernel, tile_counts)
    assert violations == [], "\n".join(violations)


@pytest.mark.parametrize("entry", KERNELS, ids=stage_id)
def test_producer_and_consumer_agree_per_tile(entry):
    stage, shape, _ = entry
    kernel, _ = traced(stage, shape)
    produced = [len(sweep) for sweep in kernel.kv_producer_entries]
    consumed = [len(sweep) for sweep in kernel.kv_consumer_entries]
    assert produced == consumed
    # one operand's tile per entry, and every entry arms what that tile's copy moves
    for sweep in kernel.kv_producer_entries:
        for operand in sweep:
            assert kernel.kv_tma_bytes[operand] == kernel.copy_bytes[operand]
            assert kernel.copy_bytes[operand] <= kernel.kv_slot_bytes
    assert kernel.q_tma_bytes == kernel.copy_bytes["Q"]


@pytest.mark.parametrize("entry", KERNELS, ids=stage_id)
def test_ptx_arms_exactly_the_declared_byte_counts(entry):
    stage, shape, _ = entry
    kernel, ptx = traced(stage, shape)
    armed = expect_tx_immediates(ptx)
    assert None not in armed, f"an expect_tx count is not an immediate in the PTX: {armed}"
    declared = {kernel.q_tma_bytes, *kernel.kv_tma_bytes.values()}
    # one expect_tx per load site: Q, then one per operand per sweep (stage 4: K | K, V)
    assert len(armed) == 1 + sum(len(sweep) for sweep in kernel.kv_producer_entries)
    assert set(armed) <= declared, f"armed {armed}, declared {declared}"
    # the faulty ring's count (Q + K bytes) appears nowhere
    assert kernel.copy_bytes["Q"] + kernel.copy_bytes["K"] not in armed


# ---------------------------------------------------------------- the faulty ring fails


def faulty_rings(kernel):
    """The faulty ring, as data. Its TMA warp acquires one ring entry per KV tile and issues both
    the K and the V copy under it (V viewed over K's slot); its MMA warp waits twice per tile (K
    for QK, then V for PV); both the Q pipeline and the K/V ring are created with tx_count = Q + K
    bytes. Tile sizes are those of the real kernel (128 x D)."""
    q_bytes, k_bytes, v_bytes = (kernel.copy_bytes[x] for x in ("Q", "K", "V"))
    faulty_tx = q_bytes + k_bytes
    q_ring = schedule.Ring(
        "Q",
        1,
        q_bytes,
        (
            schedule.Sweep(
                (schedule.Entry((schedule.Load("Q", q_bytes),), faulty_tx),),
                ("Q",),
                per_kv_tile=False,
            ),
        ),
    )
    kv_ring = schedule.Ring(
        "K/V",
        2,
        k_bytes,
        (
            schedule.Sweep(
                (
                    schedule.Entry(
                        (schedule.Load("K", k_bytes), schedule.Load("V", v_bytes)), faulty_tx
                    ),
                ),
                ("K", "V"),
            ),
        ),
    )
    return q_ring, kv_ring


def test_checker_rejects_the_faulty_ring():
    kernel, _ = traced(4, SHAPES[4])
    q_ring, kv_ring = faulty_rings(kernel)
    q_violations = schedule.check_ring(q_ring, (1, 3))
    kv_violations = schedule.check_ring(kv_ring, (1, 3))
    report = "\n".join(q_violations + kv_violations)
    # Defect 1: V_j lands on K_j, in the same slot, before the QK MMA read K_j ...
    assert (
        "V_0 (sweep 1) is written into slot 0 while K_0 (sweep 1) is still there, unreleased by its reader"
        in report
    )
    # ... so QK reads V_j where it expects K_j.
    assert "expects K_0 (sweep 1) in slot 0 but finds V_0 (sweep 1)" in report
    # Defect 2: 1 entry per tile produced, 2 waited for: the consumer hangs.
    assert "the producer makes 1 ring entries per KV tile, the consumer waits for 2" in report
    assert "hang: the consumer's wait 2 (for V_0 (sweep 1)) has no entry" in report
    # Defect 3: the Q buffer arms Q + K bytes but its copy moves Q bytes: its barrier never completes.
    q_bytes = kernel.copy_bytes["Q"]
    assert (
        f"arms {q_bytes + kernel.copy_bytes['K']} transaction bytes but its TMA copies move {q_bytes}"
        in report
    )
    assert "Q: hang: the full barrier of slot 0 never completes" in report


def test_faulty_ring_timeline_shows_the_race_and_the_hang():
    kernel, _ = traced(4, SHAPES[4])
    _, kv_ring = faulty_rings(kernel)
    lines = schedule.timeline(kv_ring, 2)
    assert lines[0].startswith("TMA  slot 0 <- K_0 (sweep 1) + V_0 (sweep 1)")
    assert any("expects K_0 (sweep 1), finds V_0 (sweep 1)" in ln for ln in lines)
    assert lines[-1].startswith("HANG")


def test_correct_timeline_alternates_slots_and_never_stalls():
    kernel, _ = traced(4, SHAPES[4])
    kv_ring = schedule.rings_of(kernel)[1]
    lines = schedule.timeline(kv_ring, 3)
    # 3 K tiles (pass 1) + 3 x (K, V) (pass 2) = 9 entries, each loaded once and read once
    assert sum(ln.startswith("TMA") for ln in lines) == 9
    assert sum(ln.startswith("MMA") for ln in lines) == 9
    assert not any("finds" in ln or "HANG" in ln for ln in lines)


# ---------------------------------------------------------------- each check can fail alone


def mutated(**changes):
    """A copy of the traced stage-4 kernel with some configuration attributes replaced."""
    kernel = copy.copy(traced(4, SHAPES[4])[0])
    for name, value in changes.items():
        setattr(kernel, name, value)
    return kernel


def test_checker_rejects_wrong_transaction_bytes():
    kernel = traced(4, SHAPES[4])[0]
    bad = mutated(
        kv_tma_bytes={
            "K": kernel.copy_bytes["Q"] + kernel.copy_bytes["K"],
            "V": kernel.kv_tma_bytes["V"],
        }
    )
    report = "\n".join(schedule.check_kernel(bad, (2,)))
    assert "an entry loading K arms" in report and "never completes" in report


def test_checker_rejects_a_consumer_that_skips_v():
    bad = mutated(kv_consumer_entries=(("K",), ("K",)))
    report = "\n".join(schedule.check_kernel(bad, (2,)))
    assert "the producer makes 2 ring entries per KV tile, the consumer waits for 1" in report
    assert "expects K_1 (sweep 2)" in report  # it reads V_0 where it expects K_1


def test_checker_rejects_v_loaded_before_k():
    bad = mutated(kv_producer_entries=(("K",), ("V", "K")))
    report = "\n".join(schedule.check_kernel(bad, (1,)))
    assert "expects K_0 (sweep 2) in slot 1 but finds V_0 (sweep 2)" in report


def test_checker_rejects_a_tile_larger_than_a_slot():
    kernel = traced(4, SHAPES[4])[0]
    bad = mutated(kv_slot_bytes=kernel.copy_bytes["V"] // 2)
    assert any("does not fit a slot" in v for v in schedule.check_kernel(bad, (1,)))


def test_checker_needs_a_traced_kernel():
    kernel, _ = stages.track_module(4, "blackwell").compile_args(torch.bfloat16, SHAPES[4])
    with pytest.raises(ValueError, match="compile it first"):
        schedule.rings_of(kernel)
