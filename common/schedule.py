"""Schedule checker for the TMA -> MMA rings of the Blackwell kernels.

A ring has `slots` shared-memory slots, each guarded by a full barrier (TMA bytes landed) and
an empty barrier (the MMA that read the slot completed). The producer (TMA warp) takes ring
entries in order: entry e goes to slot e % slots; it waits on that slot's empty barrier, arms
the full barrier with a transaction byte count, and issues its TMA copies. The consumer (MMA
warp) waits on the full barriers in the same order, reads the operand, and releases the slot.
Every copy of an entry lands in that entry's slot: in the K/V ring a slot is one buffer viewed
as K or as V, so two copies under one entry write the same bytes.

The checker builds this model from a kernel object's own configuration (rings_of) and
explores every interleaving of the two warps for several KV tile counts. It reports:
- an overwrite: a TMA copy lands in a slot whose tile has not been released by its reader;
- a wrong read: the consumer finds a different tile than the one it expects (K instead of V,
  tile j instead of j');
- a count mismatch: producer entries and consumer waits per KV tile disagree (a hang, or a
  slot read twice);
- a byte mismatch: an entry arms a transaction count different from the bytes its copies
  move (the full barrier never completes: a hang; or completes before the data has landed);
- a hang: a reachable state where neither warp can move before the end.

Barrier waits follow the hardware's parity rule: a wait for parity P passes when the barrier
has completed a number of phases whose parity differs from P (producers start at parity 1,
consumers at 0, both flip when their slot index wraps).
"""

import dataclasses
import itertools
from collections import deque


@dataclasses.dataclass(frozen=True)
class Load:
    """One TMA copy: which operand's tile it moves and how many bytes."""

    operand: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Entry:
    """One producer acquire of a slot: the copies issued under it and the bytes it arms."""

    loads: tuple
    tx_bytes: int


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What one repetition produces and consumes; repeated once per KV tile, or once."""

    producer: tuple  # Entry per producer acquire, in order
    consumer: tuple  # operand name per consumer wait, in order
    per_kv_tile: bool = True


@dataclasses.dataclass(frozen=True)
class Ring:
    name: str
    slots: int
    slot_bytes: int
    sweeps: tuple


def rings_of(kernel):
    """The Q buffer and the K/V ring of a traced Blackwell Sm100Kernel (stages 2-5), from its own
    attributes: q_buffers, q_tma_bytes, kv_slots, kv_slot_bytes, kv_producer_entries,
    kv_consumer_entries, kv_tma_bytes (what each entry arms) and copy_bytes (what each operand's
    TMA copy moves). The byte counts are set when the kernel is traced (cute.compile), from the
    shared-memory layouts its TMA atoms are built with."""
    missing = [
        a
        for a in ("q_tma_bytes", "kv_tma_bytes", "copy_bytes", "kv_slot_bytes")
        if not hasattr(kernel, a)
    ]
    if missing:
        raise ValueError(
            f"{type(kernel).__name__} has no {', '.join(missing)} yet: compile it first (cute.compile traces "
            "__call__, which derives the byte counts from the shared-memory layouts)"
        )
    nbytes = kernel.copy_bytes
    q_ring = Ring(
        "Q",
        kernel.q_buffers,
        nbytes["Q"],
        (
            Sweep(
                (Entry((Load("Q", nbytes["Q"]),), kernel.q_tma_bytes),), ("Q",), per_kv_tile=False
            ),
        ),
    )
    sweeps = []
    for produced, consumed in itertools.zip_longest(
        kernel.kv_producer_entries, kernel.kv_consumer_entries, fillvalue=()
    ):
        entries = tuple(Entry((Load(op, nbytes[op]),), kernel.kv_tma_bytes[op]) for op in produced)
        sweeps.append(Sweep(entries, tuple(consumed)))
    kv_ring = Ring("K/V", kernel.kv_slots, kernel.kv_slot_bytes, tuple(sweeps))
    return [q_ring, kv_ring]


def _expand(ring, n_kv_tiles):
    """Producer steps [(Entry, [(tag, nbytes)...])] and consumer steps [tag], where a tag
    (operand, sweep, tile) names one tile of one operand in one sweep."""
    producer, consumer = [], []
    for s, sweep in enumerate(ring.sweeps):
        for t in range(n_kv_tiles if sweep.per_kv_tile else 1):
            for entry in sweep.producer:
                producer.append((entry, [((ld.operand, s, t), ld.nbytes) for ld in entry.loads]))
            for op in sweep.consumer:
                consumer.append((op, s, t))
    return producer, consumer


def _tag(tag):
    op, s, t = tag
    return f"{op}_{t} (sweep {s + 1})"


def static_violations(ring):
    """Checks that need no simulation: counts per repetition, bytes per entry, slot size."""
    out = []
    if ring.slots < 1:
        out.append(f"{ring.name}: {ring.slots} slots")
    for s, sweep in enumerate(ring.sweeps):
        unit = "per KV tile" if sweep.per_kv_tile else "in total"
        if len(sweep.producer) != len(sweep.consumer):
            out.append(
                f"{ring.name} sweep {s + 1}: the producer makes {len(sweep.producer)} ring entries {unit}, "
                f"the consumer waits for {len(sweep.consumer)}"
            )
        for entry in sweep.producer:
            moved = sum(ld.nbytes for ld in entry.loads)
            names = "+".join(ld.operand for ld in entry.loads)
            if moved != entry.tx_bytes:
                out.append(
                    f"{ring.name} sweep {s + 1}: an entry loading {names} arms {entry.tx_bytes} transaction bytes "
                    f"but its TMA copies move {moved}"
                )
            if len(entry.loads) > 1:
                out.append(
                    f"{ring.name} sweep {s + 1}: one entry carries {len(entry.loads)} copies ({names}) into the same "
                    "slot under one barrier: each overwrites the one before"
                )
            for ld in entry.loads:
                if ld.nbytes > ring.slot_bytes:
                    out.append(
                        f"{ring.name}: a {ld.operand} tile ({ld.nbytes} B) does not fit a slot ({ring.slot_bytes} B)"
                    )
    return out


def _producer_effects(ring, producer):
    """After p producer entries: what each slot holds, and how many full phases each slot's
    barrier has completed. Also, per entry, the (previous tag, new tag) of each copy."""
    S = ring.slots
    contents = [[None] * S]  # contents[p][slot]: the tag whose bytes the slot holds
    full_done = [[0] * S]
    writes_of = []
    for p, (entry, writes) in enumerate(producer):
        slot = p % S
        mem = list(contents[-1])
        steps = []
        for tag, _ in writes:
            steps.append((mem[slot], tag))
            mem[slot] = tag
        writes_of.append(steps)
        done = list(full_done[-1])
        if (
            sum(n for _, n in writes) >= entry.tx_bytes
        ):  # completes (early, if more bytes than armed)
            done[slot] += 1
        contents.append(mem)
        full_done.append(done)
    return contents, full_done, writes_of


def _empty_done(c, S):
    done = [0] * S
    for i in range(c):
        done[i % S] += 1
    return done


def _parity(step, initial, S):
    # PipelineState: the index advances every step, the phase flips when the index wraps
    return initial ^ ((step // S) & 1)


def simulate(ring, n_kv_tiles):
    """Explore every interleaving of producer and consumer for n_kv_tiles; return the list of
    violations (empty when the ring is safe). The state is (p, c): producer entries issued,
    consumer waits completed; barriers and slot contents follow from it."""
    producer, consumer = _expand(ring, n_kv_tiles)
    P, C, S = len(producer), len(consumer), ring.slots
    contents, full_done, writes_of = _producer_effects(ring, producer)
    violations = []

    def report(msg):
        if msg not in violations:
            violations.append(msg)

    seen = {(0, 0)}
    queue = deque([(0, 0)])
    while queue:
        p, c = queue.popleft()
        moves = []
        # Producer: acquire slot p % S (wait on its empty barrier), arm tx, issue the copies
        if p < P and _empty_done(c, S)[p % S] % 2 != _parity(p, 1, S):
            consumed = set(consumer[:c])
            for old, new in writes_of[p]:
                if old is not None and old in consumer and old not in consumed:
                    report(
                        f"{ring.name}: {_tag(new)} is written into slot {p % S} while {_tag(old)} is still "
                        "there, unreleased by its reader"
                    )
            moves.append((p + 1, c))
        # Consumer: wait on slot c % S's full barrier, read the operand, release the slot
        if c < C and full_done[p][c % S] % 2 != _parity(c, 0, S):
            want, have = consumer[c], contents[p][c % S]
            if have != want:
                report(
                    f"{ring.name}: the consumer's wait {c + 1} expects {_tag(want)} in slot {c % S} but finds "
                    + (_tag(have) if have else "nothing loaded")
                )
            moves.append((p, c + 1))
        if not moves and (p, c) != (P, C):
            if c < C and c < P and p > c:
                entry, writes = producer[c]
                report(
                    f"{ring.name}: hang: the full barrier of slot {c % S} never completes for entry {c + 1}: it arms "
                    f"{entry.tx_bytes} bytes, its copies move {sum(n for _, n in writes)}"
                )
            elif c < C and p == P:
                report(
                    f"{ring.name}: hang: the consumer's wait {c + 1} (for {_tag(consumer[c])}) has no entry: "
                    f"the producer makes {P} entries, the consumer waits {C} times"
                )
            elif p < P and c == C:
                report(
                    f"{ring.name}: hang: the producer's entry {p + 1} waits for slot {p % S} to be released, but the "
                    f"consumer has finished after {C} waits (the producer makes {P} entries)"
                )
            else:
                report(f"{ring.name}: hang after {p} entries produced and {c} consumed")
        for m in moves:
            if m not in seen:
                seen.add(m)
                queue.append(m)
    return violations


def check_ring(ring, kv_tile_counts=(1, 2, 3, 4, 7)):
    """Static checks plus simulation for each KV tile count; violations with the count."""
    out = list(static_violations(ring))
    for n in kv_tile_counts:
        for v in simulate(ring, n):
            out.append(f"[{n} KV tiles] {v}")
    return out


def check_kernel(kernel, kv_tile_counts=(1, 2, 3, 4, 7)):
    """All violations of a kernel's rings (empty list: safe for these tile counts)."""
    out = []
    for ring in rings_of(kernel):
        out += check_ring(ring, kv_tile_counts)
    return out


def timeline(ring, n_kv_tiles):
    """One interleaving as text, the producer running ahead as far as the barriers let it:
    which tile lands in which slot, what the consumer finds there, and where it stops."""
    producer, consumer = _expand(ring, n_kv_tiles)
    P, C, S = len(producer), len(consumer), ring.slots
    contents, full_done, _ = _producer_effects(ring, producer)
    lines, p, c = [], 0, 0
    while (p, c) != (P, C):
        if p < P and _empty_done(c, S)[p % S] % 2 != _parity(p, 1, S):
            entry, writes = producer[p]
            lines.append(
                f"TMA  slot {p % S} <- "
                + " + ".join(_tag(t) for t, _ in writes)
                + f"  (arms {entry.tx_bytes} B)"
            )
            p += 1
        elif c < C and full_done[p][c % S] % 2 != _parity(c, 0, S):
            have = contents[p][c % S]
            if have == consumer[c]:
                got = "reads " + _tag(have)
            else:
                got = f"expects {_tag(consumer[c])}, finds {_tag(have) if have else 'nothing'}"
            lines.append(f"MMA  slot {c % S}: {got}; commit releases slot {c % S}")
            c += 1
        else:
            prod = (
                f"producer blocked at entry {p + 1} of {P}"
                if p < P
                else f"producer done after {P} entries"
            )
            lines.append(f"HANG: {prod}, consumer blocked at wait {c + 1} of {C}")
            break
    return lines
