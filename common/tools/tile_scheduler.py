"""CPU models of the persistent tile scheduler of Hopper stage 11 (stage 12 keeps it), for its
tests and its notebook. They call the kernel object's own plain methods on Python ints -
tile_coords, tile_is_empty, q_full_parity, q_empty_parity - and write out only what is device
code in the kernel: next_tile's atomic add (a counter here) and l2_section_heads (a loop of
cutlass.range_constexpr; its twin below is tested against the kernel's source run on ints).

- launch_plan: the work tiles of a batch-mode launch in the order the scheduler hands them
  out, each with its KV tiles (common.masks.kv_tile_range, the kernel's tile range on the
  host), and what __call__ decides: the grid, fixed share or tickets, the L2 section size.
- walk: a timeline of that plan, which CTA runs which tile when, in units of one KV tile.
- ticket_walk: the tickets of packed sequences drawn to the end, empty tiles skipped.
- handover_programs / explore_handover: the hand-over of the tile number with Q (q_full,
  q_empty, tile_id) and every interleaving of it under the hardware's parity rule.
"""

import dataclasses
import heapq

from common import masks

END = -1  # a tile number past the end, in the hand-over model


# ---------------------------------------------------------------- the order and the grid


def l2_section_heads(kernel, seqlen_k, pairs):
    """How many (head, sequence) pairs' K and V fit in L2 together, as the kernel's
    l2_section_heads computes it: l2_bytes over Sk x 2 D x (bytes per element) of K and V per
    pair, rounded down to a power of two, at least 1, at most pairs & -pairs (the largest power
    of two dividing the number of pairs: every section whole)."""
    per_key = 2 * kernel.cta_tile[2] * kernel.dtype.width // 8  # bytes of K and V per key
    fit = (kernel.l2_bytes // per_key) // seqlen_k
    heads = 1
    while heads * 2 <= fit:
        heads *= 2
    return min(heads, pairs & -pairs)


@dataclasses.dataclass(frozen=True)
class WorkTile:
    number: int  # the tile number: the order in which the scheduler hands tiles out
    q_tile: int  # pid_m: rows q_tile * bM .. q_tile * bM + bM - 1 of the sequence
    head: int
    sequence: int
    kv_tiles: int  # the KV tiles of its range: its work


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    tiles: list  # [WorkTile], by tile number
    grid: int  # CTAs launched
    persistent: bool  # CTAs walk tiles (stage 11) or run one each (stage 10)
    dynamic: bool  # tiles drawn from tile_counter (True) or a fixed share / one CTA per tile
    l2_heads: int  # (head, sequence) pairs per L2 section (1: head by head)
    kv_bytes_per_pair: int  # K and V of one (head, sequence): Sk x 2 D x bytes per element


def launch_plan(kernel, B, H, Sq, Sk, causal=False, window=None):
    """The work tiles of a batch-mode launch (B sequences of Sq queries and Sk keys, H heads,
    no pack-GQA) as the kernel's __call__ lays them out. A kernel with `l2_sections` (stage 11
    on) numbers them with its tile_coords(tile, tiles_m, heads, l2_heads): under a causal or
    window cut in sections of l2_section_heads pairs, drawn from tile_counter when persistent;
    without a cut head by head, a fixed share (CTA c: c, c + grid, ...). A kernel without it
    (stage 10) runs one CTA per tile, numbered by its tile_coords(tile, tiles_m, heads)."""
    bM, bN, D = kernel.cta_tile
    left, right = masks.resolve_window(causal, window, Sq, Sk)
    masked = left < Sk or right < Sq  # the kernel's own test
    tiles_m = -(-Sq // bM)
    total = tiles_m * H * B
    persistent = getattr(kernel, "persistent", False)
    sectioned = hasattr(kernel, "l2_sections")
    l2_heads = 1
    if sectioned and masked and kernel.l2_sections:
        l2_heads = l2_section_heads(kernel, Sk, H * B)
    tiles = []
    for t in range(total):
        if sectioned:
            pid_m, head, seq = kernel.tile_coords(t, tiles_m, H, l2_heads)
        else:
            pid_m, head, seq = kernel.tile_coords(t, tiles_m, H)
        lo, hi = masks.kv_tile_range(pid_m, Sq, Sk, left, right, bM, bN)
        tiles.append(WorkTile(t, pid_m, head, seq, hi - lo))
    grid = min(total, kernel.sm_count) if persistent else total
    per_pair = Sk * 2 * D * kernel.dtype.width // 8
    return LaunchPlan(tiles, grid, persistent, persistent and masked, l2_heads, per_pair)


@dataclasses.dataclass(frozen=True)
class Segment:
    start: float
    end: float
    tile: WorkTile | None  # None: the CTA's set-up


@dataclasses.dataclass(frozen=True)
class Timeline:
    rows: list  # one [Segment] per SM, in time order
    end: float  # when the last tile ends
    work: int  # KV tiles in all
    setups: int  # set-ups paid (CTAs started)

    @property
    def busy(self):
        """The share of the SMs' time spent on KV tiles: work / (SMs x end)."""
        return self.work / (len(self.rows) * self.end) if self.end else 0.0


def walk(plan, sms, setup=1.0, lead=0.0):
    """Which SM runs which tile when, time in KV tiles (one KV tile's QK^T, softmax and PV = 1;
    a tile of k KV tiles takes k). Every CTA first pays `setup` (barriers, descriptors,
    setmaxnreg, the first loads: a figure the caller assumes). One CTA per tile (grid = tiles,
    one CTA per SM): the CTAs start in tile-number order on the next SM that is free. Persistent,
    fixed share: CTA c runs tiles c, c + grid, ... back to back. Persistent, tickets: CTA c starts
    with tile c; its producer draws the next tile, grid + the next ticket, `lead` KV tiles before
    the current tile ends (when it has issued the tile's last load: the ring's depth,
    kv_slots / 2 KV tiles, or at the tile's start for a shorter tile), and the draws are served
    in time order (ties: the lower CTA first), as the atomic add serves them."""
    tiles, grid = plan.tiles, plan.grid
    rows = [[] for _ in range(sms)]
    if not plan.persistent:
        free = [(0.0, s) for s in range(sms)]  # (time the SM is free, SM)
        heapq.heapify(free)
        for tile in tiles:
            t, s = heapq.heappop(free)
            rows[s].append(Segment(t, t + setup, None))
            rows[s].append(Segment(t + setup, t + setup + tile.kv_tiles, tile))
            heapq.heappush(free, (t + setup + tile.kv_tiles, s))
        setups = len(tiles)
    elif not plan.dynamic:
        for c in range(grid):
            t = setup
            rows[c].append(Segment(0.0, setup, None))
            for tile in tiles[c::grid]:
                rows[c].append(Segment(t, t + tile.kv_tiles, tile))
                t += tile.kv_tiles
        setups = grid
    else:
        draws = []  # (time of the draw, CTA)
        for c in range(grid):
            rows[c].append(Segment(0.0, setup, None))
            rows[c].append(Segment(setup, setup + tiles[c].kv_tiles, tiles[c]))
            draws.append((_draw_time(rows[c][-1], lead), c))
        heapq.heapify(draws)
        ticket = 0
        while draws:
            _, c = heapq.heappop(draws)
            nxt = grid + ticket  # next_tile: gridDim.x + the ticket
            ticket += 1
            if nxt >= len(tiles):
                continue  # a number past the end: this CTA is done
            t = rows[c][-1].end
            rows[c].append(Segment(t, t + tiles[nxt].kv_tiles, tiles[nxt]))
            heapq.heappush(draws, (_draw_time(rows[c][-1], lead), c))
        setups = grid
    end = max((r[-1].end for r in rows if r), default=0.0)
    return Timeline(rows, end, sum(t.kv_tiles for t in tiles), setups)


def _draw_time(segment, lead):
    """When the producer draws the tile after `segment`: `lead` KV tiles before its end, not
    before its start."""
    return max(segment.start, segment.end - lead)


def pairs_in_flight(plan, window):
    """For each tile number t: the distinct (head, sequence) pairs among tiles t .. t + window - 1,
    the tiles that run at about the same time when `window` CTAs take them in order. Their K and
    V (kv_bytes_per_pair each) are what L2 must hold for the tiles to share them."""
    coords = [(tile.head, tile.sequence) for tile in plan.tiles]
    return [len(set(coords[t : t + window])) for t in range(len(coords))]


# ---------------------------------------------------------------- packed sequences: tickets


def ticket_walk(kernel, lens_q, heads, grid, rng):
    """A CPU model of the persistent grid on packed sequences: `grid` CTAs, each starting with
    tile c, taking the next tile as gridDim.x + a ticket drawn from one counter (next_tile) and
    skipping the empty ones as the producer does (first_nonempty_tile: draw again while the
    tile is past its sequence's end), with the kernel's tile_coords and tile_is_empty; the CTAs
    run in an order drawn by `rng`. Returns (tiles handed to the consumers, in order; the final
    count of the counter; tiles_m; the number of tiles)."""
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


# ---------------------------------------------------------------- the tile hand-over


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
    for parity p passes once the count of the barrier's completed phases has the other parity,
    so a fresh barrier passes p = 1; a phase completes after `arrivals[bar]` arrives). Returns
    the set of outcomes: 'done', 'deadlock', or ('read', expected, got) where a consumer read
    another tile number than its own tile's."""
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
