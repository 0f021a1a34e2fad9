"""Schedule checker for the TMA -> MMA rings of the Blackwell kernels.

A ring has `slots` shared-memory slots, each guarded by a full barrier (TMA bytes landed) and
an empty barrier (the MMA that read the slot completed). The producer (TMA warp) takes ring
entries in order: entry e goes to slot e % slots; it waits on that slot's empty barrier, arms
the full barrier with a transaction byte count, and issues its TMA copies. The consumer (MMA
warp) waits on the full barriers in the same order, reads the operand, and releases the slot.
Every copy of an entry lands in that entry's slot: in the K/V ring a slot is one buffer viewed
as K or as V, so two copies under one entry write the same bytes.

The checker builds this model from a kernel object's own configuration (rings_of) and
explores every interleaving of the two warps for several KV tile counts, or for KV tile ranges
[lo, hi) as the masks of stage 6 on give them (a range that starts past tile 0; an empty one, in
which no K or V tile is loaded at all). It reports:
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

The second half models the whole CTA of the one-pass Blackwell kernels (stages 5-7): every
hand-off between the three roles (TMA warp, MMA warp, softmax warps) - the Q buffer, the K/V
ring, S (MMA -> softmax), P (softmax -> MMA), O (MMA -> epilogue) - and the TMEM allocation
barrier, with each role's barrier operations in the order its code performs them, for one KV
tile range (cta_schedule, simulate_cta). Since a Q tile's range may be empty, what each role
does once per CTA and what it does once per KV tile must match on both sides of every
hand-off for every range; the replay reports:
- a hang: a reachable state where some role waits forever (a lost arrive: say the MMA warp's
  commit of O only on a non-empty range, so an empty one leaves the epilogue waiting);
- an unbalanced hand-off at the end: a phase completed that nobody waited for, or a wait
  without a matching release (a skipped wait: say the epilogue not waiting for O when the
  range is empty while the MMA warp still commits it);
- a release or commit that comes before the role's own wait or acquire of that entry (a role
  reading what it has not waited for);
- an S written over P's TMEM columns (its commit marked "over P") before the MMA warp has
  waited for the completion of every P @ V issued before it: no hang and no imbalance, a race
  on TMEM that only this count shows (PTX orders two tcgen05.mma only when they share the
  accumulator).

The Blackwell kernels with a correction warpgroup (stages 8-10) have their own model,
cta_schedule_correction: the TMA warp, the MMA warp, a softmax warpgroup per Q tile and the
correction warpgroup, with 2 + 4 x q_tiles hand-offs (stage 8: one Q tile, stages 9-10: two),
replayed the same way. Its pipes also carry the arrivals each barrier phase expects (the count
mbarrier.init gives it) and the arrivals one commit or release brings (the threads that run
it): a count that does not match the arriving threads leaves a phase incomplete (a hang) or
completes two at once; mbarrier_init_counts reads the counts the kernel's PTX initialises.

Stage 11 (persistent CTAs) runs those programs once per work tile with every pipeline state
running on (cta_schedule_persistent adds the tile-number hand-over); simulate_cta then takes a
list of KV ranges, one per work tile, and also reports a wait that passes on parity before its
phase has completed (a state whose count is off by one phase), which the single-tile replays
cannot show.
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


def kv_tiles_of(tiles):
    """The KV tiles a loop runs over: n (an int) means tiles 0 .. n - 1, a pair (lo, hi) the
    range [lo, hi) of a mask (empty when hi == lo)."""
    if isinstance(tiles, int):
        return range(tiles)
    lo, hi = tiles
    return range(lo, max(hi, lo))


def tiles_label(tiles):
    if isinstance(tiles, int):
        return f"{tiles} KV tiles"
    lo, hi = tiles
    return f"KV tiles [{lo}, {hi})"


def _expand(ring, tiles, consumer_tiles=None):
    """Producer steps [(Entry, [(tag, nbytes)...])] and consumer steps [tag], where a tag
    (operand, sweep, tile) names one tile of one operand in one sweep. tiles: the producer's KV
    tiles (see kv_tiles_of); consumer_tiles: the consumer's, if it runs over others (a fault)."""
    consumer_tiles = tiles if consumer_tiles is None else consumer_tiles
    producer, consumer = [], []
    for s, sweep in enumerate(ring.sweeps):
        for t in kv_tiles_of(tiles) if sweep.per_kv_tile else (0,):
            for entry in sweep.producer:
                producer.append((entry, [((ld.operand, s, t), ld.nbytes) for ld in entry.loads]))
        for t in kv_tiles_of(consumer_tiles) if sweep.per_kv_tile else (0,):
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


def simulate(ring, tiles, consumer_tiles=None):
    """Explore every interleaving of producer and consumer over the KV tiles `tiles` (a count or
    a range, see kv_tiles_of); return the list of violations (empty when the ring is safe). The
    state is (p, c): producer entries issued, consumer waits completed; barriers and slot
    contents follow from it. consumer_tiles: a consumer that runs over other tiles (a fault)."""
    producer, consumer = _expand(ring, tiles, consumer_tiles)
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
    """Static checks plus simulation for each KV tile count or range; violations with it."""
    out = list(static_violations(ring))
    for n in kv_tile_counts:
        for v in simulate(ring, n):
            out.append(f"[{tiles_label(n)}] {v}")
    return out


def check_kernel(kernel, kv_tile_counts=(1, 2, 3, 4, 7)):
    """All violations of a kernel's rings (empty list: safe for these tile counts or ranges)."""
    out = []
    for ring in rings_of(kernel):
        out += check_ring(ring, kv_tile_counts)
    return out


def timeline(ring, tiles):
    """One interleaving as text, the producer running ahead as far as the barriers let it:
    which tile lands in which slot, what the consumer finds there, and where it stops."""
    producer, consumer = _expand(ring, tiles)
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


# ---------------------------------------------------------------- every hand-off of the CTA


@dataclasses.dataclass(frozen=True)
class Pipe:
    """One hand-off: `stages` entries, each with a full barrier (arrived on by the producer's
    commit: TMA bytes landed, tcgen05.commit, or the 128 softmax threads' arrive, taken as one)
    and an empty barrier (arrived on by the consumer's release).

    full_count / empty_count: the arrivals a phase of the full / empty barrier expects (its
    mbarrier.init count); producer_threads / consumer_threads: the arrivals one commit / release
    brings (1 for tcgen05.commit and an elected thread's arrive, 128 for a warpgroup's). A phase
    completes with every full_count arrivals. All 1 (the default) is the taken-as-one model."""

    name: str
    stages: int
    producer: str
    consumer: str
    full_count: int = 1
    empty_count: int = 1
    producer_threads: int = 1
    consumer_threads: int = 1
    # (role, threads) pairs: the arrivals one commit or release of that role brings, where
    # several roles arrive on one barrier (stage 11's tile hand-over: 32 and 128 threads).
    role_threads: tuple = ()


@dataclasses.dataclass(frozen=True)
class Restart:
    """A fault to plant (tests): the role's state of `pipe` made anew here, its entry count
    (and so its parity) back to 0, as a state created per work tile would be."""

    pipe: str


@dataclasses.dataclass(frozen=True)
class Op:
    """One barrier operation of a role on a pipe. acquire: wait on the empty barrier of the
    next entry (the producer's PipelineState); commit: arrive on that entry's full barrier;
    wait: wait on the full barrier of the next entry (the consumer's state); release: arrive on
    its empty barrier; peek_empty: wait on the empty barrier with a state of its own and no
    arrive (the MMA warp's wait until the PV MMAs have freed P's columns)."""

    pipe: str
    action: str
    what: str = ""

    def __str__(self):
        return f"{self.pipe}.{self.action}" + (f" ({self.what})" if self.what else "")


@dataclasses.dataclass(frozen=True)
class PerTile:
    """Operations repeated once per KV tile of the role's range, in order."""

    ops: tuple


@dataclasses.dataclass(frozen=True)
class IfNonEmpty:
    """Operations that run only when the range holds a KV tile (stage 8's correction warpgroup
    waits for the last O only then; in stages 5-7 the tests use it to model the faults an empty
    range exposes)."""

    ops: tuple


@dataclasses.dataclass(frozen=True)
class NotFirst:
    """Inside PerTile: operations for every KV tile of the range but its first (stage 8's
    correction warpgroup rescales O from the second tile on)."""

    ops: tuple


@dataclasses.dataclass(frozen=True)
class Tail:
    """The producer's tail(): one acquire of every entry of the pipe, so that it exits only
    once the consumer has released all it was given."""

    pipe: str


@dataclasses.dataclass(frozen=True)
class Sync:
    """A named barrier (bar.sync) all `roles` meet at."""

    name: str
    roles: tuple


ROLES = ("TMA", "MMA", "softmax")


def cta_schedule(kernel):
    """(pipes, programs) of a Blackwell kernel: cta_schedule_correction for the kernels with a
    correction warpgroup (stages 8-10: kernel.correction_warp_ids; one or two Q tiles),
    cta_schedule_one_tile for the one-pass kernels of stages 5-7."""
    if getattr(kernel, "uses_tile_counter", False):
        return cta_schedule_persistent(kernel)
    if getattr(kernel, "q_tiles", 1) == 2 or hasattr(kernel, "correction_warp_ids"):
        return cta_schedule_correction(kernel)
    return cta_schedule_one_tile(kernel)


def cta_schedule_one_tile(kernel):
    """(pipes, programs) of a one-pass Blackwell kernel (stages 5-7): its hand-offs, with the
    depths from the kernel's own attributes (q_buffers, kv_slots, s_buffers; P and O have one
    entry each in these kernels), and each role's barrier operations in the order its code
    performs them. The TMA warp's K/V entries per tile come from kv_producer_entries; the MMA
    warp waits for them in the order of kv_consumer_entries, which must be one sweep of (K, V)."""
    if (
        tuple(map(tuple, kernel.kv_consumer_entries)) != (("K", "V"),)
        or len(kernel.kv_producer_entries) != 1
    ):
        raise ValueError(
            f"{type(kernel).__name__}: the CTA model is the one-pass schedule of stages 5-7 "
            f"(one sweep of K, V per tile), got {kernel.kv_consumer_entries}"
        )
    pipes = (
        Pipe("Q", kernel.q_buffers, "TMA", "MMA"),
        Pipe("K/V", kernel.kv_slots, "TMA", "MMA"),
        Pipe("S", kernel.s_buffers, "MMA", "softmax"),
        Pipe("P", 1, "softmax", "MMA"),
        Pipe("O", 1, "MMA", "softmax"),
    )
    tmem = Sync("TMEM allocated", ("MMA", "softmax"))
    loads = tuple(
        op
        for name in kernel.kv_producer_entries[0]
        for op in (Op("K/V", "acquire", name), Op("K/V", "commit", name))
    )
    programs = {
        # Q once; K_j and V_j per tile, each its own ring entry; then wait for every release.
        "TMA": (
            Op("Q", "acquire"),
            Op("Q", "commit", "Q"),
            PerTile(loads),
            Tail("K/V"),
            Tail("Q"),
        ),
        # S_j = Q K_j^T once S and P's columns are free; O += P_j V_j once P_j is written.
        "MMA": (
            tmem,
            Op("Q", "wait"),
            Op("O", "acquire"),
            PerTile(
                (
                    Op("K/V", "wait", "K"),
                    Op("S", "acquire"),
                    Op("P", "peek_empty", "P's columns free"),
                    Op("S", "commit", "over P"),
                    Op("K/V", "release", "K"),
                    Op("P", "wait"),
                    Op("K/V", "wait", "V"),
                    Op("P", "release"),
                    Op("K/V", "release", "V"),
                )
            ),
            Op("Q", "release"),
            Op("O", "commit"),
        ),
        # read S_j, write P_j (and rescale O); then the epilogue reads O.
        "softmax": (
            tmem,
            PerTile((Op("S", "wait"), Op("S", "release"), Op("P", "acquire"), Op("P", "commit"))),
            Op("O", "wait"),
            Op("O", "release"),
        ),
    }
    return pipes, programs


def cta_schedule_two_tiles(kernel):
    """cta_schedule_correction of a kernel with two Q tiles (stages 9-10 on Blackwell)."""
    return cta_schedule_correction(kernel)


def cta_schedule_correction(kernel):
    """(pipes, programs) of the Blackwell kernels with a correction warpgroup: stage 8 (one Q
    tile per CTA, four roles) and stages 9-10 (two Q tiles, five roles). Per Q tile s the
    hand-offs S_s (MMA -> softmax warpgroup s), P_s (softmax s -> MMA), O_s (MMA -> correction:
    O_s holds a tile; the correction warpgroup releases it rescaled, or read at the end) and
    stats_s (softmax s -> correction: the row factor per KV tile, then the final row sum and
    max), one entry each; Q has q_buffers entries, K/V kv_slots. The pipes in the order of the
    kernel's barriers in shared memory, with the arrivals each expects: 1 for the TMA warp's
    and the MMA warp's (tcgen05.commit), one per thread of a warpgroup (softmax_warp_ids[s],
    correction_warp_ids) for theirs. Each role's barrier operations in the order its code
    performs them. From stage 10 on (kernel.qk_behind_pv set) an empty range loads no Q and the
    MMA warp waits for none; stages 8-9 load and wait for Q on every range, as stages 5-7."""
    if (
        tuple(map(tuple, kernel.kv_consumer_entries)) != (("K", "V"),)
        or len(kernel.kv_producer_entries) != 1
    ):
        raise ValueError(
            f"{type(kernel).__name__}: the two-tile model takes one sweep of K, V per tile, "
            f"got {kernel.kv_consumer_entries}"
        )
    tiles = range(kernel.q_tiles)
    # With P over S, the QK that writes S_s overwrites P_s: its commit says so ("over P<s>"),
    # and simulate_cta checks that a wait for the last P_s @ V's completion came before it.
    p_over_s = tuple(kernel.tmem_p_offset) == tuple(kernel.tmem_s_offset)
    softmax = [32 * len(kernel.softmax_warp_ids[s]) for s in tiles]  # threads, one per row
    correction = 32 * len(kernel.correction_warp_ids)

    def handoff(name, stages, producer, consumer, n_producer, n_consumer):
        # each barrier expects as many arrivals as the role that arrives on it has threads
        return Pipe(
            name, stages, producer, consumer, n_producer, n_consumer, n_producer, n_consumer
        )

    pipes = (
        Pipe("Q", kernel.q_buffers, "TMA", "MMA"),
        Pipe("K/V", kernel.kv_slots, "TMA", "MMA"),
        *(handoff(f"S{s}", kernel.s_buffers, "MMA", f"softmax{s}", 1, softmax[s]) for s in tiles),
        *(handoff(f"P{s}", 1, f"softmax{s}", "MMA", softmax[s], 1) for s in tiles),
        *(handoff(f"O{s}", 1, "MMA", "correction", 1, correction) for s in tiles),
        *(
            handoff(f"stats{s}", 1, f"softmax{s}", "correction", softmax[s], correction)
            for s in tiles
        ),
    )
    softmax_roles = tuple(f"softmax{s}" for s in tiles)
    tmem = Sync("TMEM allocated", ("MMA", *softmax_roles, "correction"))
    tmem_free = Sync("TMEM freed", (*softmax_roles, "correction"))
    loads = tuple(
        op
        for name in kernel.kv_producer_entries[0]
        for op in (Op("K/V", "acquire", name), Op("K/V", "commit", name))
    )

    def qk_of(s, peek=p_over_s):
        return (
            Op(f"S{s}", "acquire"),
            *((Op(f"P{s}", "peek_empty", f"P{s}'s columns free"),) if peek else ()),
            Op(f"S{s}", "commit", f"over P{s}" if p_over_s else ""),
        )

    def pv_of(s):
        return (
            Op(f"O{s}", "acquire"),
            Op(f"P{s}", "wait"),
            Op(f"P{s}", "release"),
            Op(f"O{s}", "commit"),
        )

    qk = tuple(op for s in tiles for op in qk_of(s))
    pv = tuple(op for s in tiles for op in pv_of(s))
    if getattr(kernel, "qk_behind_pv", False):
        # Stage 10: S_0, S_1 of the first tile; then per later tile j, for each Q tile, P_s,j-1
        # V_j-1 and S_s,j; then the last tile's PVs.
        mma_loop = (
            IfNonEmpty((Op("K/V", "wait", "K"), *qk, Op("K/V", "release", "K"))),
            PerTile(
                (
                    NotFirst(
                        (
                            Op("K/V", "wait", "V"),
                            Op("K/V", "wait", "K"),
                            *(op for s in tiles for op in (*pv_of(s), *qk_of(s))),
                            Op("K/V", "release", "V"),
                            Op("K/V", "release", "K"),
                        )
                    ),
                )
            ),
            IfNonEmpty((Op("K/V", "wait", "V"), *pv, Op("K/V", "release", "V"))),
        )
    else:
        # Stages 8-9, per KV tile: S_s of each Q tile (K_j), then O_s += P_s V_j of each.
        mma_loop = (
            PerTile(
                (
                    Op("K/V", "wait", "K"),
                    *qk,
                    Op("K/V", "release", "K"),
                    Op("K/V", "wait", "V"),
                    *pv,
                    Op("K/V", "release", "V"),
                )
            ),
        )

    # Q's operations: for every range (stages 8-9), or only for a non-empty one (stage 10 on)
    def q_ops(ops):
        return (IfNonEmpty(ops),) if hasattr(kernel, "qk_behind_pv") else ops

    programs = {
        # each Q tile once; K_j and V_j per tile; then wait for every release.
        "TMA": (
            *q_ops(
                tuple(op for s in tiles for op in (Op("Q", "acquire"), Op("Q", "commit", f"Q{s}")))
            ),
            PerTile(loads),
            Tail("K/V"),
            Tail("Q"),
        ),
        "MMA": (
            tmem,
            *q_ops(tuple(Op("Q", "wait") for s in tiles)),
            *mma_loop,
            *q_ops(tuple(Op("Q", "release") for s in tiles)),
        ),
        "correction": (
            tmem,
            PerTile(
                tuple(
                    op
                    for s in tiles
                    for op in (
                        Op(f"stats{s}", "wait", "row factor"),
                        Op(f"stats{s}", "release"),
                        NotFirst((Op(f"O{s}", "wait"), Op(f"O{s}", "release", "rescaled"))),
                    )
                )
            ),
            *(
                op
                for s in tiles
                for op in (
                    Op(f"stats{s}", "wait", "row sum and max"),
                    Op(f"stats{s}", "release"),
                    IfNonEmpty((Op(f"O{s}", "wait", "last tile"), Op(f"O{s}", "release"))),
                )
            ),
            tmem_free,
        ),
    }
    for s in tiles:
        # read S_j, hand over the row factor, write P_j; after the loop the row sum and max.
        programs[f"softmax{s}"] = (
            tmem,
            PerTile(
                (
                    Op(f"S{s}", "wait"),
                    Op(f"S{s}", "release"),
                    Op(f"stats{s}", "acquire"),
                    Op(f"stats{s}", "commit", "row factor"),
                    Op(f"P{s}", "acquire"),
                    Op(f"P{s}", "commit"),
                )
            ),
            Op(f"stats{s}", "acquire"),
            Op(f"stats{s}", "commit", "row sum and max"),
            tmem_free,
        )
    return pipes, programs


def cta_schedule_persistent(kernel):
    """(pipes, programs) of Blackwell stage 11: stage 10's (cta_schedule_correction) run per
    work tile, plus the tile number's hand-over: per tile the TMA warp acquires the one-entry
    tile pipe and commits (32 threads), every other role waits and releases (the MMA warp's 32
    threads, each warpgroup's 128: 416 arrivals); after the last tile one more hand-over (the
    number past the end). The TMEM syncs and the tails stay once per CTA."""
    pipes, programs = cta_schedule_correction(kernel)
    others = [r for r in programs if r != "TMA"]
    threads = {"MMA": 32, "correction": 32 * len(kernel.correction_warp_ids)}
    threads.update({f"softmax{s}": 32 * len(w) for s, w in enumerate(kernel.softmax_warp_ids)})
    tile = Pipe(
        "tile", 1, "TMA", "others", 32, kernel.tile_threads, 32, 1,
        tuple((r, threads[r]) for r in others),
    )  # fmt: skip
    out = {}
    for role, program in programs.items():
        items = list(program)
        head = [items.pop(0)] if isinstance(items[0], Sync) else []
        end = [items.pop()] if isinstance(items[-1], Sync) else []
        tails = [op for op in items if isinstance(op, Tail)]
        body = tuple(op for op in items if not isinstance(op, Tail))
        if role == "TMA":
            hand = (Op("tile", "acquire"), Op("tile", "commit"))
            tails.append(Tail("tile"))
        else:
            hand = (Op("tile", "wait"), Op("tile", "release"))
        out[role] = (*head, PerWorkTile((*hand, *body)), *hand, *tails, *end)
    return (*pipes, tile), out


@dataclasses.dataclass(frozen=True)
class PerWorkTile:
    """Operations repeated once per work tile of a persistent CTA, each with its own KV range
    (simulate_cta given a list of ranges); once, with the range, otherwise."""

    ops: tuple


def barrier_sites(pipes, programs, role, actions):
    """The operations of `role` with one of `actions`, each site in the code once, whatever the
    trip count: the bodies of PerTile, NotFirst and IfNonEmpty once, a Tail one acquire per
    entry of its pipe. The tests compare these counts with the kernel's PTX (tcgen05.commit,
    mbarrier.arrive, mbarrier.try_wait)."""
    stages = {p.name: p.stages for p in pipes}
    ops = []

    def walk(items):
        for item in items:
            if isinstance(item, (PerTile, NotFirst, IfNonEmpty, PerWorkTile)):
                walk(item.ops)
            elif isinstance(item, Tail):
                ops.extend([Op(item.pipe, "acquire", "tail")] * stages[item.pipe])
            else:
                ops.append(item)

    walk(programs[role])
    return [op for op in ops if isinstance(op, Op) and op.action in actions]


def _flatten(program, tiles, pipes):
    """The role's operations for its KV tiles, in order: [(Op or Sync, tile or None)]."""
    stages = {p.name: p.stages for p in pipes}
    out = []
    for item in program:
        if isinstance(item, PerWorkTile):
            for work in tiles if isinstance(tiles, list) else [tiles]:
                out += _flatten(item.ops, work, pipes)
        elif isinstance(item, Restart):
            out.append((item, None))
        elif isinstance(item, PerTile):
            for i, t in enumerate(kv_tiles_of(tiles)):
                for op in item.ops:
                    if isinstance(op, NotFirst):
                        out += [(o, t) for o in op.ops] if i > 0 else []
                    else:
                        out.append((op, t))
        elif isinstance(item, IfNonEmpty):
            if len(kv_tiles_of(tiles)):
                out += _flatten(item.ops, tiles, pipes)
        elif isinstance(item, Tail):
            out += [(Op(item.pipe, "acquire", "tail"), None)] * stages[item.pipe]
        else:
            out.append((item, None))
    return out


_WAITS = {"acquire": ("empty", 1), "peek_empty": ("empty", 1), "wait": ("full", 0)}
_ARRIVES = {"commit": ("full", "acquire"), "release": ("empty", "wait")}
_ROLE_NAMES = {
    "TMA": "the TMA warp",
    "MMA": "the MMA warp",
    "softmax": "the softmax warps",
    "softmax0": "softmax warpgroup 0",
    "softmax1": "softmax warpgroup 1",
    "correction": "the correction warpgroup",
}


def simulate_cta(pipes, programs, tiles, role_tiles=None):
    """Replay the roles' programs over the KV tiles `tiles` (a count or a range, see
    kv_tiles_of) in every interleaving; role_tiles maps a role to other tiles (a fault). Returns
    the violations (empty: every role reaches its end, every hand-off balanced)."""
    role_tiles = role_tiles or {}
    roles = list(programs)
    pipe_of = {p.name: p for p in pipes}
    flat = {r: _flatten(programs[r], role_tiles.get(r, tiles), pipes) for r in roles}
    violations = []

    def report(msg):
        if msg not in violations:
            violations.append(msg)

    # Per role and position: how many operations of each (pipe, action) came before it.
    counts, bases = {}, {}
    for r in roles:
        acc, seq, base, bseq = {}, [{}], {}, [{}]
        for op, _ in flat[r]:
            if isinstance(op, Op):
                acc[(op.pipe, op.action)] = acc.get((op.pipe, op.action), 0) + 1
            elif isinstance(op, Restart):
                base = {**base, **{k: v for k, v in acc.items() if k[0] == op.pipe}}
            seq.append(dict(acc))
            bseq.append(base)
        counts[r], bases[r] = seq, bseq
        # A role arrives only on entries it holds: no commit before its acquire, no release
        # before its wait.
        for i, (op, t) in enumerate(flat[r]):
            if isinstance(op, Op) and op.action in _ARRIVES:
                held = counts[r][i].get((op.pipe, _ARRIVES[op.action][1]), 0)
                done = counts[r][i].get((op.pipe, op.action), 0)
                if done >= held:
                    before = "acquire" if op.action == "commit" else "wait"
                    report(
                        f"{_ROLE_NAMES.get(r, r)}: the {op.action} of {op.pipe} entry {done + 1}"
                        + (f" (KV tile {t})" if t is not None else "")
                        + f" comes before its {before} of that entry"
                    )
        # A commit that says it overwrites P ("over P<s>": a QK writing S over P's columns)
        # must come after a wait that covers the completion of every P @ V issued so far: the
        # k-th wait on P's empty barrier (0-based) passes once k - stages + 1 of its releases
        # (tcgen05.commits after the PV MMAs) have completed, so n waits cover n - stages.
        for i, (op, t) in enumerate(flat[r]):
            if isinstance(op, Op) and op.action == "commit" and op.what.startswith("over "):
                p = op.what[len("over ") :]
                peeks = counts[r][i].get((p, "peek_empty"), 0)
                released = counts[r][i].get((p, "release"), 0)
                covered = max(peeks - pipe_of[p].stages, 0)  # releases the waits covered
                if covered < released:
                    report(
                        f"{_ROLE_NAMES.get(r, r)}: {op.pipe}"
                        + (f" of KV tile {t}" if t is not None else "")
                        + f" overwrites {p} while a {p} @ V issued before may still read it "
                        f"(no wait for its completion)"
                    )
    syncs = {r: [i for i, (op, _) in enumerate(flat[r]) if isinstance(op, Sync)] for r in roles}

    def completed(pcs, pipe, barrier):
        """Phases each slot's `barrier` has completed: the arrivals so far, in slot order, one
        phase per `count` of them."""
        p = pipe_of[pipe]
        S = p.stages
        arrived = [0] * S
        action = "commit" if barrier == "full" else "release"
        threads = p.producer_threads if barrier == "full" else p.consumer_threads
        count = p.full_count if barrier == "full" else p.empty_count
        for r in roles:
            n = counts[r][pcs[r]].get((pipe, action), 0)
            n_threads = dict(p.role_threads).get(r, threads)
            for s in range(S):
                arrived[s] += (n // S + (1 if s < n % S else 0)) * n_threads
        return [a // count for a in arrived]

    def can_move(pcs, r):
        op, _ = flat[r][pcs[r]]
        if isinstance(op, Sync):
            k = syncs[r].index(pcs[r])
            return all(len(syncs[o]) > k and pcs[o] >= syncs[o][k] for o in op.roles if o in roles)
        if isinstance(op, Restart):
            return True
        if op.action in _WAITS:
            barrier, initial = _WAITS[op.action]
            n = counts[r][pcs[r]].get((op.pipe, op.action), 0)
            k = n - bases[r][pcs[r]].get((op.pipe, op.action), 0)  # what the state counts
            S = pipe_of[op.pipe].stages
            parity = initial ^ ((k // S) & 1)
            done = completed(pcs, op.pipe, barrier)[n % S]
            passes = done % 2 != parity
            # The phase this wait is for: the (n // S + 1)-th completion of a full barrier, the
            # (n // S)-th of an empty one (a fresh barrier counts as completed for producers).
            need = n // S + (1 if barrier == "full" else 0)
            if passes and done != need:
                report(
                    f"{_ROLE_NAMES.get(r, r)}: {op} entry {n + 1} passes with {done} phase(s) "
                    f"of its barrier completed, not {need}: its parity is off by "
                    f"{need - done} phase(s)"
                )
            return passes
        return True

    start = tuple(0 for _ in roles)
    end = tuple(len(flat[r]) for r in roles)
    seen, queue = {start}, deque([start])
    while queue:
        state = queue.popleft()
        pcs = dict(zip(roles, state))
        moved = False
        for i, r in enumerate(roles):
            if pcs[r] < len(flat[r]) and can_move(pcs, r):
                moved = True
                nxt = state[:i] + (state[i] + 1,) + state[i + 1 :]
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        if not moved and state != end:
            where = []
            for r in roles:
                if pcs[r] == len(flat[r]):
                    where.append(f"{_ROLE_NAMES.get(r, r)} done")
                else:
                    op, t = flat[r][pcs[r]]
                    at = f" of KV tile {t}" if t is not None else ""
                    where.append(f"{_ROLE_NAMES.get(r, r)} waiting at {op}{at}")
            report("hang: " + ", ".join(where))
    if end in seen:
        final = dict(zip(roles, end))
        for p in pipes:
            n = {
                a: sum(counts[r][final[r]].get((p.name, a), 0) for r in roles)
                for a in ("acquire", "commit", "wait", "release")
            }
            tails = sum(
                1 for r in roles for op, _ in flat[r] if op == Op(p.name, "acquire", "tail")
            )
            made, used = n["commit"], n["wait"]
            waiters = {r for r in roles for op, _ in flat[r] if op == Op(p.name, "wait")}
            if len(waiters) > 1:  # each role that waits takes every entry once
                used //= len(waiters)
                n["release"] //= len(waiters)
            if made != used or n["release"] != used or n["acquire"] - tails != made:
                report(
                    f"{p.name}: unbalanced hand-off: {made} commit(s), {used} wait(s), "
                    f"{n['release']} release(s), {n['acquire'] - tails} acquire(s) (besides the "
                    f"tail) - a phase nobody waits for, or a wait nobody matches"
                )
    return violations


def check_cta(kernel, ranges=((0, 1), (0, 3), (2, 5), (0, 0), (3, 3)), programs=None):
    """simulate_cta for each KV tile range (or count) of `ranges`; violations with the range.
    programs: the roles' programs to replay instead of the kernel's (a faulty variant)."""
    pipes, own = cta_schedule(kernel)
    out = []
    for tiles in ranges:
        for v in simulate_cta(pipes, programs or own, tiles):
            out.append(f"[{tiles_label(tiles)}] {v}")
    return out


def barrier_counts(pipes):
    """The arrival count of every barrier of the pipes, in the order the kernels lay their
    barriers out in shared memory: per pipe its full barriers (one per entry), then its empty
    ones."""
    return [c for p in pipes for c in [p.full_count] * p.stages + [p.empty_count] * p.stages]


def mbarrier_init_counts(ptx):
    """[(byte offset, count)] of the PTX's mbarrier.init statements, offsets from the lowest, in
    order of offset. Each address is a register the PTX has set as base + offset (add.s32), or
    [base+offset]; each count an immediate or a register set by mov.b32 before it. Raises
    ValueError for a form it cannot resolve."""
    import re

    value, offset, out, bases = {}, {}, [], set()
    for ln in ptx.splitlines():
        s = ln.strip()
        m = re.match(r"mov\.b32\s+(%r\d+),\s*(-?\d+);", s)
        if m:
            value[m.group(1)] = int(m.group(2))
            continue
        m = re.match(r"add\.s32\s+(%r\d+),\s*(%r\d+),\s*(-?\d+);", s)
        if m:
            base, off = offset.get(m.group(2), (m.group(2), 0))
            offset[m.group(1)] = (base, off + int(m.group(3)))
            continue
        if not s.startswith("mbarrier.init"):
            continue
        m = re.match(r"mbarrier\.init\.\S+\s+\[(%r\d+)(?:\+(\d+))?\],\s*(%r\d+|\d+);", s)
        if not m:
            raise ValueError(f"cannot read {s!r}")
        base, off = offset.get(m.group(1), (m.group(1), 0))
        count = m.group(3)
        if count.startswith("%"):
            if count not in value:
                raise ValueError(f"no mov.b32 sets {count} before {s!r}")
            count = value[count]
        bases.add(base)
        out.append((off + int(m.group(2) or 0), int(count)))
    if len(bases) > 1:
        raise ValueError(f"mbarrier.init from several base registers: {sorted(bases)}")
    low = min((o for o, _ in out), default=0)
    return sorted((o - low, c) for o, c in out)
