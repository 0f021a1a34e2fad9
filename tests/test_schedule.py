"""The ring schedule of the Blackwell kernels of stages 2-7, checked from each kernel object's
own configuration (common/tools/schedule.py), and the check shown to fail on a faulty ring.

- Each kernel is traced for sm_100a (cute.compile with fake tensors, no GPU): that sets the byte
  counts it derives from its shared-memory layouts. The checker then replays the Q buffer and the
  K/V ring for several KV tile counts and kv_slots = 1, 2, 3: no slot overwritten before its
  reader released it, producer and consumer agree on the entries per KV tile, every entry arms
  the bytes its TMA copy moves, no hang.
- The same PTX shows the byte counts the kernel declares: every mbarrier.arrive.expect_tx arms
  one of them.
- Stages 6 and 7 run each Q tile over a KV tile range [kv_tile_lo, kv_tile_hi) of its mask: the
  ring is replayed for ranges that start past tile 0 and for empty ones (taken from
  common.masks.kv_tile_range for real masks, and explicit ones), and so is the whole CTA of the
  one-pass kernels (stages 5-7): Q, K/V, S, P and O hand-offs and the TMEM barrier, each role's
  operations in its code's order; the model's operations are the PTX's barrier sites
  (tcgen05.commit for the MMA warp's arrives, mbarrier.arrive for the others', one
  mbarrier.try_wait per wait). Faults an empty range or a shifted range exposes - the MMA
  warp committing O or releasing Q only when it ran an MMA, the epilogue skipping O's wait, a
  role starting its loop at tile 0 - must each be reported.
- A model of the faulty ring that stage 4's docstring describes (one ring entry per KV tile
  carrying K and V, so that V_j lands in K_j's slot under the same barrier before the QK MMA
  has read K_j; a consumer that waits twice per tile for one entry produced; Q + K bytes armed
  on the K/V ring and the Q buffer) must be rejected, for each of its defects; so must single
  mutations of a correct kernel's configuration.
"""

import copy

import pytest
import torch

from common import masks
from common.tools import schedule, stage_table
from common.tools.ptx import compile_for_arch, count_ptx, expect_tx_immediates

# KV tile ranges [lo, hi) of stages 6 and 7: starting past tile 0, and empty (no K or V at all).
RANGES = ((2, 5), (1, 2), (5, 12), (0, 0), (3, 3))
# (stage, compile shape, KV tile counts or ranges the stage runs): stage 3 takes exactly one
# KV tile.
KERNELS = [
    (2, (1, 2, 256, 512, 128), (1, 2, 3, 4, 7)),
    (3, (1, 2, 256, 128, 128), (1,)),
    (4, (1, 2, 256, 512, 128), (1, 2, 3, 4, 7)),
    (5, (1, 2, 256, 512, 128), (1, 2, 3, 4, 7)),
    (6, (1, 2, 256, 512, 128), (1, 2, 3, 4, 7, *RANGES)),
    (7, (1, 2, 256, 512, 128), (1, 2, 3, 4, 7, *RANGES)),
]
ONE_PASS = [entry for entry in KERNELS if entry[0] >= 5]
SHAPES = {stage: shape for stage, shape, _ in KERNELS}
_TRACED = {}


def traced(stage, shape, kv_slots=None, dtype=torch.bfloat16):
    """(kernel, ptx): the stage's Sm100Kernel after cute.compile for sm_100a, with an optional
    kv_slots override (set before tracing, so the layouts and barriers follow it)."""
    key = (stage, shape, kv_slots, dtype)
    if key not in _TRACED:
        kernel, args = stage_table.track_module(stage, "blackwell").compile_args(dtype, shape)
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
    assert len(armed) == 1 + sum(len(sweep) for sweep in kernel.kv_producer_entries), armed
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
    kernel, _ = stage_table.track_module(4, "blackwell").compile_args(torch.bfloat16, SHAPES[4])
    with pytest.raises(ValueError, match="compile it first"):
        schedule.rings_of(kernel)


# ---------------------------------------------------------------- KV tile ranges (stages 6, 7)


def mask_ranges():
    """The distinct KV tile ranges of every Q tile under a few masks (common.masks, the host twin
    of the kernels' kv_tile_range): causal with Sq > Sk (Q tiles that see no key), sliding
    windows (ranges that start past tile 0), causal with Sq = Sk."""
    cases = [
        (1024, 1024, True, None),
        (1024, 1024, False, (200, 0)),
        (512, 128, True, None),
        (1000, 300, True, None),
        (128, 1024, True, (200, None)),
        (1024, 256, False, (10, 10)),
    ]
    ranges = set()
    for Sq, Sk, causal, window in cases:
        left, right = masks.resolve_window(causal, window, Sq, Sk)
        for q_tile in range(-(-Sq // 128)):
            ranges.add(masks.kv_tile_range(q_tile, Sq, Sk, left, right))
    return sorted(ranges)


def test_mask_ranges_start_past_zero_and_can_be_empty():
    ranges = mask_ranges()
    assert any(lo > 0 and hi > lo for lo, hi in ranges), ranges
    assert any(hi == lo for lo, hi in ranges), ranges


@pytest.mark.parametrize("stage", [6, 7])
def test_ring_schedule_is_safe_over_mask_ranges(stage):
    kernel, _ = traced(stage, SHAPES[stage])
    violations = schedule.check_kernel(kernel, mask_ranges())
    assert violations == [], "\n".join(violations)


def test_ring_timeline_of_a_range_names_its_tiles():
    kernel, _ = traced(6, SHAPES[6])
    kv_ring = schedule.rings_of(kernel)[1]
    lines = schedule.timeline(kv_ring, (2, 4))
    assert lines[0].startswith("TMA  slot 0 <- K_2 (sweep 1)")
    assert sum(ln.startswith("TMA") for ln in lines) == 4  # K_2, V_2, K_3, V_3
    assert not any("finds" in ln or "HANG" in ln for ln in lines)
    assert schedule.timeline(kv_ring, (3, 3)) == []


def test_ring_checker_rejects_a_producer_that_starts_at_tile_0():
    # The TMA warp loads [0, hi) while the MMA warp consumes [lo, hi): it reads the wrong tiles,
    # then waits for entries that never come.
    kernel, _ = traced(6, SHAPES[6])
    kv_ring = schedule.rings_of(kernel)[1]
    report = "\n".join(schedule.simulate(kv_ring, (0, 5), consumer_tiles=(2, 5)))
    assert "expects K_2 (sweep 1) in slot 0 but finds K_0 (sweep 1)" in report
    assert "hang: the producer's entry" in report


# ---------------------------------------------------------------- the whole CTA (stages 5-7)


@pytest.mark.parametrize("kv_slots", [None, 1, 3], ids=lambda s: f"kv_slots={s or 'default'}")
@pytest.mark.parametrize("entry", ONE_PASS, ids=stage_id)
def test_cta_schedule_is_safe(entry, kv_slots):
    stage, shape, tile_counts = entry
    kernel, _ = traced(stage, shape, kv_slots)
    ranges = tile_counts if stage == 5 else (*tile_counts, *mask_ranges())
    violations = schedule.check_cta(kernel, ranges)
    assert violations == [], "\n".join(violations)


@pytest.mark.parametrize("entry", ONE_PASS, ids=stage_id)
def test_cta_model_has_the_barrier_sites_of_the_ptx(entry):
    # Each operation of the model is one site in the code, whatever the trip count. Arrives: the
    # MMA warp's are tcgen05.commit (S full, K free, P free, V free; Q free; O full), the TMA
    # warp's the expect_tx arrives of its copies (Q, K, V), the softmax warps' plain mbarrier
    # arrives (S read, P written, O read). Waits: one mbarrier.try_wait each, a tail one per
    # entry of its pipe (TMA 1 + 2 + 2 + 1, MMA 7, softmax 3: 16 at kv_slots = 2).
    stage, shape, _ = entry
    kernel, ptx = traced(stage, shape)
    pipes, programs = schedule.cta_schedule(kernel)

    def sites(role, actions):
        return schedule.barrier_sites(pipes, programs, role, actions)

    arrives, waits = ("commit", "release"), ("acquire", "peek_empty", "wait")
    counts = count_ptx(ptx)
    assert len(sites("MMA", arrives)) == counts["tcgen05.commit"], counts
    assert len(sites("TMA", arrives)) + len(sites("softmax", arrives)) == counts["mbarrier.arrive"]
    assert sum(len(sites(r, waits)) for r in schedule.ROLES) == counts["mbarrier.try_wait"]


def faulty(kernel, role, change):
    """The kernel's programs with one role's program changed by change(list of items)."""
    _, programs = schedule.cta_schedule(kernel)
    items = list(programs[role])
    change(items)
    return {**programs, role: tuple(items)}


def _only_if_nonempty(index):
    def change(items):
        items[index] = schedule.IfNonEmpty((items[index],))

    return change


def test_cta_checker_catches_o_committed_only_after_an_mma():
    # tcgen05.commit of O placed inside the loop (after the last PV MMA): an empty range never
    # commits it, and the epilogue waits forever.
    kernel, _ = traced(6, SHAPES[6])
    programs = faulty(kernel, "MMA", _only_if_nonempty(-1))
    assert schedule.check_cta(kernel, ((2, 5),), programs) == []
    report = "\n".join(schedule.check_cta(kernel, ((3, 3),), programs))
    assert "[KV tiles [3, 3)] hang:" in report
    assert "the softmax warps waiting at O.wait" in report


def test_cta_checker_catches_q_released_only_after_an_mma():
    # Q's buffer released only by the commit after the last QK MMA: with no KV tile the TMA
    # warp's tail waits for it forever.
    kernel, _ = traced(6, SHAPES[6])
    report = "\n".join(
        schedule.check_cta(kernel, ((0, 0),), faulty(kernel, "MMA", _only_if_nonempty(-2)))
    )
    assert "the TMA warp waiting at Q.acquire (tail)" in report


def test_cta_checker_catches_an_epilogue_that_skips_o_when_empty():
    # The epilogue neither waits for nor releases O on an empty range (nothing to read), yet
    # the MMA warp commits it: a phase nobody waits for.
    kernel, _ = traced(7, SHAPES[7])

    def skip_o(items):
        items[-2:] = [schedule.IfNonEmpty(tuple(items[-2:]))]

    report = "\n".join(schedule.check_cta(kernel, ((3, 3),), faulty(kernel, "softmax", skip_o)))
    assert "O: unbalanced hand-off: 1 commit(s), 0 wait(s)" in report


def test_cta_checker_catches_a_release_without_its_wait():
    # The epilogue skips only the wait for O when the range is empty, but still releases it.
    kernel, _ = traced(7, SHAPES[7])
    report = "\n".join(
        schedule.check_cta(kernel, ((0, 0),), faulty(kernel, "softmax", _only_if_nonempty(-2)))
    )
    assert "the softmax warps: the release of O entry 1 comes before its wait" in report


def test_cta_checker_catches_s_written_over_p_without_waiting_for_pv():
    # S_j is written over P_(j-1)'s columns: without the MMA warp's wait for the commit after
    # P_(j-1) @ V (peek_empty), the QK may overwrite P while the PV still reads it - no hang,
    # no unbalanced barrier, only this check sees it, from the second tile on.
    kernel, _ = traced(7, SHAPES[7])
    _, programs = schedule.cta_schedule(kernel)

    def drop_peek(items):
        i = next(n for n, x in enumerate(items) if isinstance(x, schedule.PerTile))
        items[i] = schedule.PerTile(tuple(o for o in items[i].ops if o.action != "peek_empty"))

    report = "\n".join(
        schedule.check_cta(kernel, ((0, 1), (0, 3)), faulty(kernel, "MMA", drop_peek))
    )
    assert "S of KV tile 1 overwrites P while a P @ V issued before may still read it" in report
    assert "[KV tiles [0, 1)]" not in report, report


@pytest.mark.parametrize("role", schedule.ROLES)
def test_cta_checker_catches_a_role_that_starts_at_tile_0(role):
    # One role runs over [0, hi) instead of [lo, hi): two more tiles than the others.
    kernel, _ = traced(6, SHAPES[6])
    pipes, programs = schedule.cta_schedule(kernel)
    report = "\n".join(schedule.simulate_cta(pipes, programs, (2, 5), role_tiles={role: (0, 5)}))
    assert "hang:" in report or "unbalanced" in report, report


def test_cta_schedule_is_the_one_pass_schedule():
    kernel, _ = traced(4, SHAPES[4])
    with pytest.raises(ValueError, match="one-pass schedule"):
        schedule.cta_schedule(kernel)
