"""Figures of notebook 15 (context parallelism): the ring's (query, key) pairs at each step for
contiguous and zig-zag chunks and the work of each rank per step, drawn from ring.py's own
Chunks and step_work; one rank's timeline, the kernel on the chunk it holds while the next hop
is sent and received; the cut of a sequence whose length is not a multiple of N, with empty
pieces and the padded hop buffer.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from common.tools.draw import FIG_WIDTH, box, finish
from stages.stage15_context_parallel import ring

# One colour per rank (up to 8 ranks).
RANK_COLORS = (
    "#4C72B0",
    "#DD8452",
    "#55A868",
    "#C44E52",
    "#8172B3",
    "#937860",
    "#DA8BC3",
    "#8C8C8C",
)
DONE_ELSEWHERE = "#E4E4E4"  # a pair the mask allows, computed at another step
MASKED = "#FFFFFF"  # a pair the mask forbids, computed at no step
MISSED = "#FF2A2A"  # a pair the mask allows that no step computes
TWICE = "#7A0010"  # a pair computed at more than one step
FORBIDDEN = "#000000"  # a pair the mask forbids that some step computes
PAD = "#EEEEEE"


def step_pairs(chunks, step, causal, schedule=ring):
    """{rank: [(query position, key position)]} computed at ring step `step`: rank r holds the
    K/V chunk of rank (r - step) mod N and computes the rows schedule.step_work gives (a causal
    block is square, its lower triangle)."""
    world, out = chunks.world, {}
    for rank in range(world):
        src = (rank - step) % world
        work = schedule.step_work(chunks, rank, src, causal)
        if work is None:
            out[rank] = []
            continue
        q_rows, kv_rows, step_causal = work
        qpos = chunks.positions(rank)[q_rows].tolist()
        kpos = chunks.positions(src)[kv_rows].tolist()
        out[rank] = [
            (i, j)
            for a, i in enumerate(qpos)
            for b, j in enumerate(kpos)
            if not step_causal or b <= a
        ]
    return out


def coverage(seqlen, world, causal, zigzag, schedule=ring):
    """(count, pairs): count[i, j] = the steps and ranks that compute query i against key j over
    the whole ring, and pairs[step][rank] = that step's pairs (step_pairs)."""
    chunks = schedule.Chunks(seqlen, world, zigzag)
    count = np.zeros((seqlen, seqlen), dtype=int)
    pairs = []
    for step in range(world):
        got = step_pairs(chunks, step, causal, schedule)
        pairs.append(got)
        for rank_pairs in got.values():
            for i, j in rank_pairs:
                count[i, j] += 1
    return count, pairs


def _pair_image(seqlen, causal, count, this_step):
    """An RGB image (query rows, key columns): this step's pairs in their rank's colour, the rest
    by what the whole ring does with them."""
    img = np.ones((seqlen, seqlen, 3))
    allowed = (
        np.tril(np.ones((seqlen, seqlen), bool)) if causal else np.ones((seqlen, seqlen), bool)
    )
    for i in range(seqlen):
        for j in range(seqlen):
            if count[i, j] == 0:
                c = MISSED if allowed[i, j] else MASKED
            elif not allowed[i, j]:
                c = FORBIDDEN
            elif count[i, j] > 1:
                c = TWICE
            else:
                c = DONE_ELSEWHERE
            img[i, j] = to_rgb(c)
    if this_step is not None:
        for rank, rank_pairs in this_step.items():
            for i, j in rank_pairs:
                if allowed[i, j] and count[i, j] == 1:
                    img[i, j] = to_rgb(RANK_COLORS[rank % len(RANK_COLORS)])
    return img


def _bounds(ax, chunks):
    """Thin lines at the pieces' boundaries, in both directions."""
    edges = sorted(
        {a for p in chunks.pieces for a, _ in p} | {b for p in chunks.pieces for _, b in p}
    )
    for e in edges:
        if 0 < e < chunks.seqlen:
            ax.axhline(e - 0.5, color="#666666", lw=0.4)
            ax.axvline(e - 0.5, color="#666666", lw=0.4)


def schedule_grids(seqlen=32, world=4, causal=True, schedule=ring, title=None, path=None):
    """Two rows, contiguous and zig-zag chunks: one panel per ring step, the (query, key) pairs
    of the whole sequence (queries down, keys across, both in sequence order), each pair
    computed at that step in the colour of the rank that computes it; the last panel, the whole
    ring: each pair the mask allows computed once (grey), missed (red), twice (dark red), or a
    forbidden pair computed (black). Below, the pairs each rank computes at each step, and the
    ring's time counted in pairs: the sum over steps of the busiest rank's pairs (a step lasts
    as long as its slowest rank). `schedule`: the module whose Chunks and step_work are drawn
    (ring.py; an edited copy of it for exercise 15a)."""
    layouts = ((False, "contiguous"), (True, "zig-zag"))
    fig = plt.figure(figsize=(FIG_WIDTH, 7.6))
    grid = fig.add_gridspec(3, world + 1, height_ratios=(1, 1, 0.95), hspace=0.45, wspace=0.12)
    work = {}
    for row, (zigzag, label) in enumerate(layouts):
        chunks = schedule.Chunks(seqlen, world, zigzag)
        count, pairs = coverage(seqlen, world, causal, zigzag, schedule)
        work[label] = [[len(pairs[s][r]) for r in range(world)] for s in range(world)]
        for col in range(world + 1):
            ax = fig.add_subplot(grid[row, col])
            this = pairs[col] if col < world else None
            ax.imshow(_pair_image(seqlen, causal, count, this), interpolation="nearest")
            _bounds(ax, chunks)
            ax.set_xticks([])
            ax.set_yticks([])
            if col < world:
                ax.set_title(f"{label}, step {col}", fontsize=9)
            else:
                want = _want(seqlen, causal)
                once = int(((count == 1) & (want == 1)).sum())
                ax.set_title(f"all steps: {once} of {int(want.sum())} once", fontsize=9)
            if col == 0:
                ax.set_ylabel("query position", fontsize=9)
            if row == 1:
                ax.set_xlabel("key position", fontsize=9)
    bottom = grid[2, :].subgridspec(1, 2, wspace=0.25)
    for i, (_, label) in enumerate(layouts):
        ax = fig.add_subplot(bottom[0, i])
        w = work[label]
        width = 0.8 / world
        for r in range(world):
            xs = [s + (r - (world - 1) / 2) * width for s in range(world)]
            ax.bar(xs, [w[s][r] for s in range(world)], width, color=RANK_COLORS[r % 8])
        ring_time = sum(max(w[s]) for s in range(world))
        ideal = sum(map(sum, w)) / world
        ax.set_xticks(range(world), [f"step {s}" for s in range(world)], fontsize=9)
        ax.tick_params(labelsize=9)
        ax.set_ylabel("pairs computed", fontsize=9)
        ax.set_title(
            f"{label}: ring time {ring_time} pairs (sum of each step's busiest rank), "
            f"ideal {ideal:g}",
            fontsize=9,
        )
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, 1.1 * max(max(map(max, v)) for v in work.values()))
    handles = [Patch(facecolor=RANK_COLORS[r % 8], label=f"rank {r}") for r in range(world)]
    handles += [
        Patch(facecolor=DONE_ELSEWHERE, edgecolor="#999999", label="computed at another step"),
        Patch(facecolor=MASKED, edgecolor="#999999", label="masked"),
    ]
    if any(
        (coverage(seqlen, world, causal, z, schedule)[0] != _want(seqlen, causal)).any()
        for z, _ in layouts
    ):
        handles += [
            Patch(facecolor=MISSED, label="missed"),
            Patch(facecolor=TWICE, label="twice"),
            Patch(facecolor=FORBIDDEN, label="masked, yet computed"),
        ]
    fig.legend(
        handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=9, frameon=False
    )
    if title:
        fig.suptitle(title, fontsize=11)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.91 if title else 0.95, bottom=0.12)
    if path:
        fig.savefig(path, dpi=100)
    return fig


def _want(seqlen, causal):
    return np.tril(np.ones((seqlen, seqlen), int)) if causal else np.ones((seqlen, seqlen), int)


def ring_timeline(kernel_times, hop_times):
    """One rank's steps as attention_cp runs them: step s starts the hop that brings the next
    chunk (s < N - 1), then runs its kernel on the chunk it holds; step s + 1 starts once both
    are done. kernel_times: N durations; hop_times: N - 1. Returns ([(start, kernel end, hop end
    or None)], end)."""
    t, steps = 0.0, []
    for s, k in enumerate(kernel_times):
        hop_end = t + hop_times[s] if s < len(hop_times) else None
        steps.append((t, t + k, hop_end))
        t = max(t + k, hop_end if hop_end is not None else 0.0)
    return steps, t


def hop_timelines(cases, unit="us", title=None, path=None):
    """One panel per (label, kernel times, hop times): one rank's timeline (ring_timeline), the
    kernel of each step on one lane and the hop that runs beside it (send to the next rank,
    receive from the previous) on the other; where the hop outlasts the kernel the next step
    waits (hatched)."""
    fig, axes = plt.subplots(len(cases), 1, figsize=(FIG_WIDTH, 1.9 * len(cases) + 0.6))
    axes = [axes] if len(cases) == 1 else list(axes)
    for ax, (label, kernel_times, hop_times) in zip(axes, cases):
        steps, end = ring_timeline(kernel_times, hop_times)
        span = end  # each panel on its own scale
        busy = sum(kernel_times)
        for s, (start, k_end, h_end) in enumerate(steps):
            box(ax, start, 1.0, k_end - start, 0.7, "#4C72B0", lw=0.6)
            if (k_end - start) > 0.06 * span:
                ax.text(
                    (start + k_end) / 2,
                    1.35,
                    f"kernel {s}",
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="white",
                )
            if h_end is not None:
                box(ax, start, 0.0, h_end - start, 0.7, "#DD8452", lw=0.6)
                if (h_end - start) > 0.06 * span:
                    ax.text(
                        (start + h_end) / 2, 0.35, f"hop {s}", ha="center", va="center", fontsize=9
                    )
                if h_end > k_end:  # the kernel lane waits for the hop
                    box(
                        ax,
                        k_end,
                        1.0,
                        h_end - k_end,
                        0.7,
                        "white",
                        ec="#C44E52",
                        lw=0.6,
                        hatch="//",
                    )
        ax.set_yticks([0.35, 1.35], ["hop (NCCL)", "kernel"], fontsize=9)
        ax.set_xlim(0, span * 1.02)
        ax.set_ylim(-0.15, 1.85)
        ax.tick_params(axis="x", labelsize=9)
        ax.set_xlabel(unit, fontsize=9)
        ax.set_title(
            f"{label}: {end:,.1f} {unit} for {busy:,.1f} {unit} of kernels "
            f"({'every hop hidden' if end <= busy * (1 + 1e-9) else f'{end - busy:,.1f} {unit} waiting for hops'})",
            fontsize=9,
            loc="left",
        )
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    handles = [
        Patch(facecolor="#4C72B0", label="the kernel on the chunk this rank holds"),
        Patch(facecolor="#DD8452", label="the next chunk's hop: send and receive"),
        Patch(facecolor="white", edgecolor="#C44E52", hatch="//", label="the kernel lane waits"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path, rect=(0, 0.07, 1, 0.96 if title else 1))


def uneven_chunks(cases, causal=True, columns=2, title=None, path=None):
    """One panel per (seqlen, world, zigzag): the sequence's tokens in order, each coloured by the
    rank whose chunk holds it (ring.Chunks, torch.tensor_split's sizes); below, each rank's hop
    buffer of the longest chunk's rows, its tokens in the chunk's order and the rows it leaves
    unused hatched; beside it, its length and at how many of the N steps it computes (step_work:
    an empty chunk or piece computes nothing, yet the rank still passes K/V on)."""
    height = sum(
        max(1.1 + 0.36 * c[1] for c in cases[i : i + columns])
        for i in range(0, len(cases), columns)
    )
    fig, axes = plt.subplots(
        -(-len(cases) // columns), columns, figsize=(FIG_WIDTH, height + 0.6), squeeze=False
    )
    width = max(max(s, 4) for s, _, _ in cases)
    for ax, (seqlen, world, zigzag) in zip(axes.flat, cases):
        chunks = ring.Chunks(seqlen, world, zigzag)
        rows = max(chunks.length(r) for r in range(world))
        owner = {p: r for r in range(world) for p in chunks.positions(r).tolist()}
        top = world + 0.5
        for p in range(seqlen):
            box(ax, p, top, 0.92, 0.8, RANK_COLORS[owner[p] % 8], lw=0.5, text=str(p), tc="white")
        ax.text(-0.3, top + 0.4, "tokens", ha="right", va="center", fontsize=9)
        for r in range(world):
            y = world - 1 - r
            pos = chunks.positions(r).tolist()
            for i in range(rows):
                if i < len(pos):
                    box(
                        ax,
                        i,
                        y,
                        0.92,
                        0.8,
                        RANK_COLORS[r % 8],
                        lw=0.5,
                        text=str(pos[i]),
                        tc="white",
                    )
                else:
                    box(ax, i, y, 0.92, 0.8, PAD, ec="#999999", lw=0.5, hatch="//")
            steps = sum(
                ring.step_work(chunks, r, (r - s) % world, causal) is not None for s in range(world)
            )
            n = chunks.length(r)
            ax.text(-0.3, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
            ax.text(
                rows + 0.3,
                y + 0.4,
                f"{n} token{'' if n == 1 else 's'}, work at {steps} of {world} steps",
                ha="left",
                va="center",
                fontsize=9,
            )
        kind = "zig-zag" if zigzag else "contiguous"
        ax.set_title(
            f"S = {seqlen}, N = {world}, {kind}: buffers of {rows} row{'' if rows == 1 else 's'}",
            fontsize=10,
        )
        ax.set_xlim(-2.6, width + 6.5)
        ax.set_ylim(-0.2, top + 0.9)
        ax.axis("off")
    for ax in list(axes.flat)[len(cases) :]:
        ax.axis("off")
    handles = [
        Patch(
            facecolor=PAD,
            edgecolor="#999999",
            hatch="//",
            label="a buffer row no token fills (sent with the hop, never read)",
        )
    ]
    fig.legend(handles=handles, loc="lower center", fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path, rect=(0, 0.05, 1, 0.95 if title else 1))
