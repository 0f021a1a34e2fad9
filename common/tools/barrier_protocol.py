"""The mbarrier protocol of the warp-specialised Hopper kernels (stage 8 on) on the CPU, built
from a kernel object's own settings and methods, and the reader of the arrival counts a compiled
kernel initialises its barriers with. tests/test_stage8_hopper.py runs it on stage 8's kernel,
notebook 8 shows it, common/tools/exercises.py runs it on a kernel file a learner has edited.

The producer warpgroup and each consumer warpgroup are programs of mbarrier waits and arrives
(cta_programs), in the kernel's order and with its own parities (ring_state, q_full_parity,
q_empty_parity) and arrival counts (arrival_counts, or counts_from_ptx). A barrier completes a
phase when its count of arrivals is reached (a TMA fill counts as the producer's arrive with the
bytes); a wait for parity P passes once the barrier has completed a number of phases whose parity
differs from P (the hardware's rule: a fresh barrier passes a wait for parity 1). The ring slots'
contents are tracked, and explore_cta runs every interleaving of the programs: a hang, a wrong
read, a fill over a slot still being read and an arrive left over at the end are reported. No GPU
needed.
"""

import re

from cutlass.pipeline import PipelineUserType


def cta_programs(kernel, tiles):
    """The producer's and each consumer warpgroup's mbarrier operations for a CTA that walks work
    tiles with `tiles` KV tiles each (tiles = [4]: one work tile of 4 KV tiles), in the kernel's
    order and with its own parities (ring_state, q_full_parity, q_empty_parity):
      ("wait", barrier, parity)      mbarrier wait: passes once the barrier's completed phases
                                     have the other parity
      ("fill", slot, what)           a TMA load landing in `slot` (Q or a ring slot), which
                                     completes the full barrier's phase (arrive + bytes)
      ("read", slot, what)           a GEMM reading the slot: must find `what`
      ("done", slot)                 the reads of the slot are over (its GEMM waited for)
      ("arrive", barrier, count)     `count` arrivals (a consumer warpgroup: 4 warps on a
                                     kv_empty, one lane each; 128 threads on q_empty)
    The producer walks the tiles and ends with producer_tail (a wait on each slot's empty
    barrier), each consumer warpgroup its copy of the same tiles (stage 8's step: K_j waited,
    read, released; V_j waited, read, released)."""
    producer, consumer = [], []
    entries = 0
    for i, steps in enumerate(tiles):
        producer += [("wait", "q_empty", kernel.q_empty_parity(i)), ("fill", "Q", f"Q{i}")]
        consumer += [("wait", "q_full", kernel.q_full_parity(i)), ("read", "Q", f"Q{i}")]
        for t in range(steps):
            for operand in ("K", "V"):
                what = f"{operand}{i}.{t}"
                ps = kernel.ring_state(entries, PipelineUserType.Producer)
                cs = kernel.ring_state(entries, PipelineUserType.Consumer)
                producer += [("wait", f"empty{ps.index}", ps.phase), ("fill", ps.index, what)]
                consumer += [("wait", f"full{cs.index}", cs.phase), ("read", cs.index, what)]
                consumer += [("done", cs.index), ("arrive", f"empty{cs.index}", 4)]
                entries += 1
        consumer += [("done", "Q"), ("arrive", "q_empty", 128)]  # after the epilogue's store
    for k in range(kernel.kv_slots):  # producer_tail
        ps = kernel.ring_state(entries + k, PipelineUserType.Producer)
        producer.append(("wait", f"empty{ps.index}", ps.phase))
    return [producer] + [list(consumer) for _ in range(kernel.mma_warpgroups)]


def arrival_counts(kernel):
    """What the kernel initialises its barriers with: q_full 1 (the producer's expect_tx; the
    bytes are the fill), q_empty every consumer thread, kv_full[i] 1, kv_empty[i] one per
    consumer warp (consumer_release arrives from one lane of each warp)."""
    counts = {"q_full": 1, "q_empty": kernel.mma_threads}
    for i in range(kernel.kv_slots):
        counts[f"full{i}"], counts[f"empty{i}"] = 1, kernel.mma_threads // 32
    return counts


def full_barrier(slot):
    """The barrier a TMA fill of `slot` completes: q_full for Q, kv_full[slot] for a ring slot."""
    return "q_full" if slot == "Q" else f"full{slot}"


def barrier_name(barrier):
    """The kernel's name of a model barrier: full3 -> kv_full[3], empty3 -> kv_empty[3]."""
    m = re.fullmatch(r"(full|empty)(\d+)", str(barrier))
    return f"kv_{m.group(1)}[{m.group(2)}]" if m else str(barrier)


def _role(w):
    return "the producer" if w == 0 else f"consumer warpgroup {w}"


def _mbarrier_op(op):
    if op[0] == "wait":
        return f"waits on {barrier_name(op[1])} for parity {op[2]}"
    if op[0] == "fill":
        return f"loads {op[2]} into slot {op[1]}"
    if op[0] == "read":
        return f"reads {op[2]} in slot {op[1]}"
    if op[0] == "arrive":
        return f"arrives on {barrier_name(op[1])}"
    return f"is done reading slot {op[1]}"


def explore_cta(programs, counts, fill_barrier=full_barrier, stats=None):
    """Every interleaving of the programs (cta_programs). Returns the set of problems found: a
    hang (a reachable state where no program can move before all are done; each blocked program
    named with the operation it waits at), a wrong read, a fill over a slot that a consumer has
    read and not yet released, arrivals left on a barrier at the end (a phase that never
    completed). stats (a dict) receives the number of states explored."""
    problems, seen = set(), set()
    n = len(programs)
    start = (tuple(0 for _ in programs), (), (), ())
    todo = [start]
    while todo:
        state = todo.pop()
        if state in seen:
            continue
        seen.add(state)
        pcs, bars, slots, reading = state
        bars_d, slots_d = dict(bars), dict(slots)
        if all(pc == len(p) for pc, p in zip(pcs, programs)):
            left = {b: pending for b, (_, pending) in bars_d.items() if pending}
            if left:
                problems.add(
                    "arrivals left at the end on "
                    + ", ".join(f"{barrier_name(b)} ({k})" for b, k in sorted(left.items()))
                )
            continue
        moved = False
        for w in range(n):
            if pcs[w] == len(programs[w]):
                continue
            op = programs[w][pcs[w]]
            nbars, nslots, nreading = dict(bars_d), dict(slots_d), set(reading)
            if op[0] == "wait":
                phases, _ = nbars.get(op[1], (0, 0))
                if phases % 2 == op[2]:
                    continue
            elif op[0] == "fill":
                if any(s == op[1] for _, s in reading):
                    problems.add(f"{op[2]} overwrites slot {op[1]} while it is read")
                nslots[op[1]] = op[2]
                bar = fill_barrier(op[1])
                phases, pending = nbars.get(bar, (0, 0))
                pending += 1
                nbars[bar] = (phases + 1, 0) if pending == counts[bar] else (phases, pending)
            elif op[0] == "read":
                if nslots.get(op[1]) != op[2]:
                    problems.add(f"read {nslots.get(op[1])} in slot {op[1]}, expected {op[2]}")
                nreading.add((w, op[1]))
            elif op[0] == "done":
                nreading.discard((w, op[1]))
            elif op[0] == "arrive":
                phases, pending = nbars.get(op[1], (0, 0))
                pending += op[2]
                if pending > counts[op[1]]:
                    problems.add(
                        f"{barrier_name(op[1])} gets {pending} arrivals for a count of "
                        f"{counts[op[1]]}"
                    )
                    pending = counts[op[1]]
                nbars[op[1]] = (phases + 1, 0) if pending == counts[op[1]] else (phases, pending)
            moved = True
            npcs = pcs[:w] + (pcs[w] + 1,) + pcs[w + 1 :]
            todo.append(
                (
                    npcs,
                    tuple(sorted(nbars.items())),
                    tuple(sorted(nslots.items(), key=str)),
                    tuple(sorted(nreading, key=str)),
                )
            )
        if not moved:
            blocked = [
                f"{_role(w)} {_mbarrier_op(programs[w][pc])}"
                for w, pc in enumerate(pcs)
                if pc < len(programs[w])
            ]
            done = [str(w) for w, pc in enumerate(pcs) if pc == len(programs[w]) and w]
            finished = (
                f" (consumer warpgroup{'s' if len(done) > 1 else ''} {' and '.join(done)} finished)"
                if done
                else ""
            )
            problems.add("hang: " + "; ".join(blocked) + finished)
    if stats is not None:
        stats["states"] = len(seen)
    return problems


# The near misses the model must catch (tests/test_stage8_hopper.py; notebook 8 shows them).
NEAR_MISSES = {
    "lost_arrive": "consumer warpgroup 2 never releases K of step 1",
    "skipped_wait": "consumer warpgroup 2 reads V of step 1 without waiting for it",
    "arrival_count": "kv_empty counts one warpgroup's 4 warps, not both warpgroups' 8",
    "wrong_barrier": "the TMA load of a ring slot completes the next slot's full barrier",
    "no_q_wait": "consumer warpgroup 2 reads Q without waiting for q_full",
}


def plant_near_miss(kernel, change, tiles=(3,)):
    """(programs, counts, fill_barrier) of the kernel's protocol with one near miss of
    NEAR_MISSES planted, for explore_cta. The kernel's ring should have 2 slots (the programs
    name slots 0 and 1)."""
    if change not in NEAR_MISSES:
        raise ValueError(f"change = {change!r}; allowed: {', '.join(NEAR_MISSES)}")
    programs = cta_programs(kernel, list(tiles))
    counts = arrival_counts(kernel)
    fill_barrier = full_barrier
    consumer = programs[2]
    if change == "lost_arrive":  # the release of the third ring entry: K of step 1
        i = [k for k, op in enumerate(consumer) if op[0] == "arrive" and op[1].startswith("empty")]
        del consumer[i[2]]
    elif change == "skipped_wait":
        i = next(k for k, op in enumerate(consumer) if op == ("read", 1, "V0.1"))
        del consumer[i - 1]
    elif change == "arrival_count":
        for s in range(kernel.kv_slots):
            counts[f"empty{s}"] = 4
    elif change == "wrong_barrier":
        slots = kernel.kv_slots
        fill_barrier = lambda slot: "q_full" if slot == "Q" else f"full{(slot + 1) % slots}"  # noqa: E731
    else:
        del consumer[0]
    return programs, counts, fill_barrier


def counts_from_ptx(ptx, kv_slots):
    """The model's arrival counts (arrival_counts' keys) as the compiled kernel initialises its
    barriers, read from the PTX's mbarrier.init statements in the order of their shared-memory
    offsets (common/tools/schedule.mbarrier_init_counts), which is the order of the kernel's
    SharedStorage: q_full, q_empty, kv_full[0 .. kv_slots - 1], kv_empty[0 .. kv_slots - 1].
    None when the PTX initialises another number of barriers."""
    from common.tools.schedule import mbarrier_init_counts

    inits = [count for _, count in mbarrier_init_counts(ptx)]
    if len(inits) != 2 + 2 * kv_slots:
        return None
    counts = {"q_full": inits[0], "q_empty": inits[1]}
    for i in range(kv_slots):
        counts[f"full{i}"] = inits[2 + i]
        counts[f"empty{i}"] = inits[2 + kv_slots + i]
    return counts
