"""Pictures for the notebooks and the benchmarks (matplotlib only, no GPU needed).

Every picture is drawn from the same small functions the tests check against the hardware:
  - wgmma_c_coords / wgmma_a_coords: the register fragments of wgmma m64nNk16, evaluated from
    CuTe's own thread-value layouts (tests/test_notebooks.py compares them with cute's atoms);
  - swizzle: CuTe's Swizzle<B, M, S> on byte addresses (S<3,4,3> is TMA's 128-byte swizzle);
  - simulate_ring: a small model of a TMA producer and an MMA consumer sharing a ring of
    shared-memory slots through full/empty mbarriers (durations are illustrative, not measured).
Each plotting function returns its matplotlib Figure.
"""

import math

import matplotlib

matplotlib.use("Agg") if matplotlib.get_backend().lower() in ("", "agg") else None
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

# One palette for all pictures: the same thing has the same colour everywhere.
C = {
    "q": "#4C72B0",
    "k": "#DD8452",
    "v": "#55A868",
    "s": "#C44E52",
    "p": "#8172B3",
    "o": "#937860",
    "a": "#4C72B0",
    "b": "#DD8452",
    "c": "#C44E52",
    "load": "#64B5CD",
    "resident": "#D6EAF8",
    "mma": "#DD8452",
    "softmax": "#8172B3",
    "wait": "#BBBBBB",
    "race": "#E41A1C",
    "free": "#FFFFFF",
    "grid": "#444444",
}
WARP_COLORS = ("#FBE3D6", "#DCEAF7", "#E2F0D9", "#EDE1F5")
LANE_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")


def _box(
    ax,
    x,
    y,
    w,
    h,
    fc,
    ec="black",
    lw=0.8,
    text=None,
    fontsize=8,
    alpha=1.0,
    hatch=None,
    tc="black",
    **kw,
):
    ax.add_patch(
        Rectangle(
            (x, y), w, h, facecolor=fc, edgecolor=ec, linewidth=lw, alpha=alpha, hatch=hatch, **kw
        )
    )
    if text is not None:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=tc)


def _finish(fig, path=None):
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


# --------------------------------------------------------------------------------------------
# CuTe layouts, evaluated in plain Python
# --------------------------------------------------------------------------------------------


def _flat(t):
    if isinstance(t, (tuple, list)):
        out = []
        for x in t:
            out.extend(_flat(x))
        return out
    return [t]


def layout_eval(shape, stride, index):
    """Offset of a 1-D index under a (nested) CuTe layout shape:stride, column-major
    (colexicographic: the leftmost mode varies fastest), as cute evaluates it."""
    off = 0
    for size, st in zip(_flat(shape), _flat(stride)):
        off += (index % size) * st
        index //= size
    return off


def layout_str(shape, stride):
    """The layout printed the way cute prints it, e.g. '((4,8,4),(2,2,16)):((128,1,16),(64,8,512))'."""

    def f(t):
        return "(" + ",".join(f(x) for x in t) + ")" if isinstance(t, (tuple, list)) else str(t)

    return f"{f(shape)}:{f(stride)}"


def wgmma_c_tv(n):
    """Thread-value layout of the fp32 accumulator of wgmma m64nNk16 over a 64 x N tile stored
    column-major (offset = row + 64 * col). Thread t = t0 + 4 t1 + 32 w (t0 = lane % 4,
    t1 = lane // 4, w = warp of the warpgroup); value v = v0 + 2 v1 + 4 i.
    Row = 16 w + t1 + 8 v1, col = 2 t0 + v0 + 8 i: each row is spread over the 4 threads of a quad."""
    return ((4, 8, 4), (2, 2, n // 8)), ((128, 1, 16), (64, 8, 512))


def wgmma_a_rs_tv():
    """Thread-value layout of a register-sourced A operand (bf16/fp16) of wgmma m64nNk16 over a
    64 x 16 tile (offset = row + 64 * k): the same pattern as the accumulator's first 16 columns."""
    return ((4, 8, 4), (2, 2, 2)), ((128, 1, 16), (64, 8, 512))


def _tv_coords(tv, thread, m=64):
    (ts, vs), (tst, vst) = tv
    base = layout_eval(ts, tst, thread)
    nv = math.prod(_flat(vs))
    out = []
    for v in range(nv):
        off = base + layout_eval(vs, vst, v)
        out.append((v, off % m, off // m))
    return out


def wgmma_c_coords(thread, n):
    """[(register index, row, col)] of the 64 x n accumulator held by `thread` (0..127) of the
    warpgroup. Register v is d{v} in the PTX ISA's wgmma fragment figures."""
    return _tv_coords(wgmma_c_tv(n), thread)


def wgmma_a_coords(thread):
    """[(value index, row, k)] of a 64 x 16 register A operand held by `thread` (0..127)."""
    return _tv_coords(wgmma_a_rs_tv(), thread)


def swizzle(offset, bits=3, base=4, shift=3):
    """CuTe's Swizzle<B, M, S>: XOR the B bits at [M + S, M + S + B) into the bits at [M, M + B).
    Applied to byte addresses, Swizzle<3,4,3> is TMA's and wgmma's 128-byte swizzle: the 16-byte
    chunk index (address bits 4-6) is XORed with the row index mod 8 (bits 7-9)."""
    mask = ((1 << bits) - 1) << (base + shift)
    return offset ^ ((offset & mask) >> shift)


def swizzle_128b_chunk(row, chunk):
    """Where logical 16-byte chunk `chunk` (0..7) of 128-byte row `row` lands: chunk ^ (row % 8)."""
    return (swizzle(row * 128 + chunk * 16) % 128) // 16


# --------------------------------------------------------------------------------------------
# Tiles and grids
# --------------------------------------------------------------------------------------------


def gemm_tiling(M=1024, N=1024, K=512, tile=(128, 256, 64), highlight=(2, 1), path=None):
    """C = A @ B^T tiled over CTAs: one CTA per bM x bN tile of C (grid = (M / bM, N / bN)); the
    highlighted CTA streams its row panel of A and its row panel of B through shared memory one
    bK-wide K tile at a time."""
    bM, bN, bK = tile
    gm, gn = -(-M // bM), -(-N // bN)
    hm, hn = highlight
    gap = 0.08 * max(M, N)
    fig, ax = plt.subplots(figsize=(8, 8 * (M + K + gap) / (N + K + gap)))
    # C, bottom right: x = column n, y = row m (y grows downwards)
    for i in range(gm):
        for j in range(gn):
            hit = (i, j) == (hm, hn)
            _box(
                ax,
                j * bN,
                i * bM,
                bN,
                bM,
                C["c"] if hit else "#F6E3E3",
                lw=0.6,
                text=f"({i},{j})",
                fontsize=7 if gm * gn > 40 else 8,
                alpha=0.9 if hit else 1.0,
                tc="white" if hit else "black",
            )
    ax.text(
        N / 2,
        M + gap * 0.6,
        f"C  (M={M}, N={N}): {gm} x {gn} CTAs, block_idx = (m tile, n tile)",
        ha="center",
        va="center",
        fontsize=9,
    )
    # A, left: rows m, columns k
    ax0 = -gap - K
    _box(ax, ax0, 0, K, M, "#EAF0F8", lw=0.6)
    for k in range(-(-K // bK)):
        _box(
            ax,
            ax0 + k * bK,
            hm * bM,
            min(bK, K - k * bK),
            bM,
            C["a"],
            lw=0.5,
            alpha=0.35 + 0.65 * (k == 0),
            text=str(k) if bK / K > 0.05 else None,
            fontsize=7,
        )
    ax.text(ax0 + K / 2, M + gap * 0.6, f"A  (M x K={K})", ha="center", fontsize=9)
    # B^T, top: rows k, columns n (B is stored N x K, K-major; drawn transposed)
    by0 = -gap - K
    _box(ax, 0, by0, N, K, "#FBEFE5", lw=0.6)
    for k in range(-(-K // bK)):
        _box(
            ax,
            hn * bN,
            by0 + k * bK,
            bN,
            min(bK, K - k * bK),
            C["b"],
            lw=0.5,
            alpha=0.35 + 0.65 * (k == 0),
            text=str(k) if bK / K > 0.05 else None,
            fontsize=7,
        )
    ax.text(
        N + gap * 0.3,
        by0 + K / 2,
        "B^T  (K x N)\nB is stored\n(N, K), K-major",
        ha="left",
        va="center",
        fontsize=9,
    )
    ax.text(
        ax0 + K / 2,
        by0 + K / 2,
        f"CTA ({hm},{hn}):\nK tiles of {bK}\n(numbered) flow\nthrough the\nab_buffers ring",
        ha="center",
        va="center",
        fontsize=9,
    )
    ax.set_xlim(ax0 - gap * 0.2, N + gap * 2.2)
    ax.set_ylim(M + gap, by0 - gap * 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"GEMM tiling: CTA tile {bM} x {bN}, K tile {bK}")
    return _finish(fig, path)


def attention_grid(
    B=2,
    H=4,
    Sq=512,
    Sk=1024,
    D=128,
    block_m=128,
    block_n=128,
    highlight=(1, 2, 1),
    grid_label="grid = (Sq / bM, H, B)",
    path=None,
):
    """Left: one CTA per (Q tile, head, batch); right: what the highlighted CTA does - its Q tile
    (bM x D) stays resident, the K tiles (bN x D) of the same (b, h) stream past it, producing
    one bM-row band of S = Q K^T."""
    qt = -(-Sq // block_m)
    hb, hh, hq = highlight
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.5]})
    for b in range(B):
        for h in range(H):
            y = b * H + h
            for t in range(qt):
                hit = (b, h, t) == (hb, hh, hq)
                _box(
                    ax,
                    t,
                    y,
                    1,
                    1,
                    C["q"] if hit else WARP_COLORS[b % 4],
                    lw=0.6,
                    text=f"{t},{h},{b}",
                    fontsize=7,
                    tc="white" if hit else "black",
                )
    ax.set_xlim(-0.1, qt + 0.1)
    ax.set_ylim(B * H + 0.1, -0.1)
    ax.set_xticks([t + 0.5 for t in range(qt)], [str(t) for t in range(qt)])
    ax.set_yticks([y + 0.5 for y in range(B * H)], [f"b{y // H} h{y % H}" for y in range(B * H)])
    ax.set_xlabel(f"Q tile ({block_m} rows each)")
    ax.set_title(f"{qt * H * B} CTAs: {grid_label}\nlabel = (q tile, head, batch)", fontsize=10)
    ax.set_aspect("equal")
    # Right: the highlighted CTA's work. Units: rows/cols scaled to fit.
    kt = -(-Sk // block_n)
    u = 1.0 / max(block_m, D)
    qh, qw = block_m * u, D * u
    _box(
        bx,
        0,
        0.6,
        qw,
        qh,
        C["q"],
        text=f"Q tile\n{block_m} x {D}\n(resident)",
        tc="white",
        fontsize=8,
    )
    x0 = qw + 0.4
    for j in range(min(kt, 8)):
        _box(
            bx,
            x0 + j * block_n * u,
            -0.05 - qw,
            block_n * u,
            qw,
            C["k"],
            alpha=0.5 + 0.5 * (j == 0),
            text=f"K{j}^T",
            fontsize=7,
        )
        _box(
            bx,
            x0 + j * block_n * u,
            0.6,
            block_n * u,
            qh,
            C["s"],
            alpha=0.25 + 0.5 * (j == 0),
            text=f"S[:, {j}]",
            fontsize=7,
        )
    more = " ..." if kt > 8 else ""
    bx.text(
        x0,
        0.6 + qh + 0.12,
        f"one CTA (b={hb}, h={hh}, q tile {hq}): S band {block_m} x {Sk} = "
        f"{kt} K tiles of {block_n}{more}",
        fontsize=9,
        va="top",
    )
    bx.text(
        x0 - 0.2,
        -0.05 - qw / 2,
        f"K tiles ({block_n} x {D})\nstream in",
        ha="right",
        va="center",
        fontsize=8,
    )
    bx.set_xlim(-0.1, x0 + min(kt, 8) * block_n * u + 0.2)
    bx.set_ylim(0.6 + qh + 0.3, -0.25 - qw)
    bx.set_aspect("equal")
    bx.axis("off")
    return _finish(fig, path)


def swizzle_128b(rows=8, path=None):
    """A K-major bf16 shared-memory tile, 64 elements (128 bytes = eight 16-byte chunks) per row.
    Each cell is one 16-byte chunk (8 bf16), labelled with its logical chunk index and coloured by
    it. Left: plain row-major placement - the chunk 0 of every row sits in banks 0-3, so reading
    one chunk from each of 8 rows (what one 8 x 16-byte matrix read does) hits the same 4 banks
    8 times. Right: the 128-byte swizzle (Swizzle<3,4,3> on byte addresses), logical chunk c of
    row r stored at chunk c ^ (r % 8): the 8 reads spread over all 32 banks."""
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 2, figsize=(13, 2.0 + 0.55 * rows))
    for ax, swz in zip(axes, (False, True)):
        for r in range(rows):
            for c in range(8):
                p = swizzle_128b_chunk(r, c) if swz else c
                hot = c == 0
                _box(
                    ax,
                    p,
                    r,
                    1,
                    1,
                    cmap(c),
                    alpha=0.95 if hot else 0.35,
                    lw=2.0 if hot else 0.5,
                    ec="black",
                    text=f"{c}",
                    fontsize=9,
                    tc="white" if hot else "black",
                )
        ax.set_xlim(0, 8)
        ax.set_ylim(rows, 0)
        ax.set_xticks(
            [p + 0.5 for p in range(8)],
            [f"bytes\n{16 * p}-{16 * p + 15}\nbanks\n{4 * p}-{4 * p + 3}" for p in range(8)],
            fontsize=7,
        )
        ax.set_yticks([r + 0.5 for r in range(rows)], [f"row {r}" for r in range(rows)], fontsize=8)
        ax.set_aspect("equal")
        banks = sorted({4 * (swizzle_128b_chunk(r, 0) if swz else 0) for r in range(min(rows, 8))})
        ax.set_title(
            ("128B swizzle: chunk c of row r at c ^ (r % 8)" if swz else "no swizzle: chunk c at c")
            + f"\nchunk 0 of rows 0-7 -> {len(banks) * 4} distinct banks "
            + ("(conflict-free)" if len(banks) == 8 else "(8-way bank conflict)"),
            fontsize=10,
        )
    fig.suptitle(
        "One 128-byte row = 64 bf16 = eight 16-byte chunks (chunk c holds k = 8c .. 8c + 7); "
        "the pattern repeats every 8 rows (1 KB)",
        fontsize=10,
    )
    return _finish(fig, path)


# --------------------------------------------------------------------------------------------
# Pipelines: a model of a TMA producer and an MMA consumer sharing a ring of slots
# --------------------------------------------------------------------------------------------


class Deadlock(RuntimeError):
    """Producer and consumer both wait: the schedule would hang on the GPU."""


def simulate_ring(loads, ops, load_time=3.0, issue_time=0.15, wait_for_release=None):
    """Run a producer/consumer schedule through full/empty barriers.

    loads: [(item, slot)] in the producer's program order. A load into a slot waits for the slot's
           previous occupant to be released (the "empty" barrier) unless
           wait_for_release(item) is False (the racy variant), then takes load_time (TMA).
    ops:   [(lane, label, duration, reads, releases)] in the consumer's program order. An op waits
           until every item in `reads` has landed (the "full" barrier); the items in `releases` are
           released (an arrive on their slot's "empty" barrier) when the op ends.
    Returns a dict of events: loads {item: (slot, issue, start, end)}, ops [(lane, label, start,
    end, wait_from)], releases {item: time}, races [(item, start, end)] (a load that overwrote a
    slot still being read)."""
    prev_in_slot, last = {}, {}
    for item, slot in loads:
        prev_in_slot[item] = last.get(slot)
        last[slot] = item
    slot_of = dict(loads)
    loaded, released, readers = {}, {}, {}
    ev = {"loads": {}, "ops": [], "releases": released, "races": [], "producer_waits": []}
    pi = ci = 0
    p_free = c_free = 0.0
    while pi < len(loads) or ci < len(ops):
        progressed = False
        if pi < len(loads):
            item, slot = loads[pi]
            prev = prev_in_slot[item]
            must_wait = wait_for_release is None or wait_for_release(item)
            if prev is None or not must_wait or prev in released:
                ready = released[prev] if (prev is not None and must_wait) else 0.0
                start = max(p_free, ready)
                if start > p_free + 1e-9:
                    ev["producer_waits"].append((p_free, start, prev))
                loaded[item] = start + load_time
                ev["loads"][item] = (slot, p_free, start, start + load_time)
                p_free = start + issue_time
                pi += 1
                progressed = True
        if ci < len(ops):
            lane, label, dur, reads, rel = ops[ci]
            if all(r in loaded for r in reads):
                start = max([c_free] + [loaded[r] for r in reads])
                end = start + dur
                ev["ops"].append((lane, label, start, end, c_free))
                for r in reads:
                    readers.setdefault(r, []).append((start, end))
                for r in rel:
                    released[r] = end
                c_free = end
                ci += 1
                progressed = True
        if not progressed:
            waiting_p = (
                f"the producer waits to load {loads[pi][0]}"
                if pi < len(loads)
                else "the producer is done"
            )
            waiting_c = (
                f"the consumer waits for {ops[ci][3]}" if ci < len(ops) else "the consumer is done"
            )
            raise Deadlock(f"deadlock: {waiting_p}, {waiting_c}")
    # A load that lands in a slot while an earlier occupant is still being read is a race.
    for item, (slot, _, start, end) in ev["loads"].items():
        prev = prev_in_slot[item]
        for s, e in readers.get(prev, []):
            if start < e - 1e-9:
                ev["races"].append((item, prev, start, min(e, end)))
    ev["slot_of"] = slot_of
    return ev


def _draw_timeline(ev, slots, lanes, title, path=None, notes=(), item_color=None):
    item_color = item_color or (lambda it: C["load"])
    rows = list(lanes) + [f"slot {s}" for s in range(slots)]
    y = {name: i for i, name in enumerate(rows)}
    t_end = max([e for _, _, _, e, _ in ev["ops"]] + [v[3] for v in ev["loads"].values()])
    fig, ax = plt.subplots(figsize=(min(18, 5 + t_end * 0.6), 2.0 + 0.6 * len(rows)))
    h = 0.7
    # producer lane: issue ticks and empty-barrier waits
    last_label = -1e9
    for item, (slot, issue, start, end) in ev["loads"].items():
        ax.plot(
            [start, start],
            [y["TMA producer"] - h / 2, y["TMA producer"] + h / 2],
            color="black",
            lw=1,
        )
        if start - last_label > 0.6:
            ax.text(start + 0.05, y["TMA producer"] - h / 2 - 0.05, item, fontsize=7, va="bottom")
            last_label = start
    for a, b, prev in ev["producer_waits"]:
        _box(ax, a, y["TMA producer"] - h / 2, b - a, h, C["wait"], hatch="//", lw=0.3, alpha=0.6)
    # consumer lanes
    for lane, label, start, end, wait_from in ev["ops"]:
        if start > wait_from + 1e-9 and lane == lanes[1]:
            _box(
                ax,
                wait_from,
                y[lane] - h / 2,
                start - wait_from,
                h,
                C["wait"],
                hatch="//",
                lw=0.3,
                alpha=0.6,
            )
        fc = C["softmax"] if lane != lanes[1] else C["mma"]
        _box(ax, start, y[lane] - h / 2, end - start, h, fc, text=label, fontsize=7, tc="white")
    # slots: loading, resident, released
    for item, (slot, issue, start, end) in ev["loads"].items():
        yy = y[f"slot {slot}"]
        rel = ev["releases"].get(item, t_end)
        _box(ax, start, yy - h / 2, end - start, h, item_color(item), alpha=0.55, lw=0.5)
        _box(
            ax,
            end,
            yy - h / 2,
            max(rel - end, 0.0),
            h,
            item_color(item),
            alpha=0.95,
            lw=0.5,
            text=item,
            fontsize=8,
            tc="white",
        )
        ax.plot(end, yy - h / 2 - 0.05, marker="v", color="black", ms=5)
        if item in ev["releases"]:
            ax.plot(rel, yy + h / 2 + 0.05, marker="^", color="black", ms=5)
    for item, prev, a, b in ev["races"]:
        yy = y[f"slot {ev['slot_of'][item]}"]
        _box(ax, a, yy - h / 2, b - a, h, "none", ec=C["race"], lw=2.5, hatch="xx")
        ax.text(
            (a + b) / 2,
            yy + h / 2 + 0.18,
            f"RACE: {item} overwrites {prev} while it is read",
            color=C["race"],
            fontsize=8,
            ha="center",
            fontweight="bold",
        )
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.4, -0.8)
    ax.set_xlim(0, t_end + 0.3)
    ax.set_xlabel("time (model units: load = TMA latency + transfer, MMA = one tile's MMAs)")
    ax.grid(axis="x", alpha=0.2)
    ax.set_title(title, fontsize=10)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Line2D(
            [],
            [],
            marker="v",
            color="black",
            ls="none",
            label="full barrier completes (TMA bytes landed)",
        ),
        Line2D(
            [],
            [],
            marker="^",
            color="black",
            ls="none",
            label="release: arrive on the slot's empty barrier",
        ),
        Patch(facecolor=C["wait"], hatch="//", label="waiting on a barrier"),
        Patch(
            facecolor="#BBBBBB",
            alpha=0.55,
            label="light: TMA transfer in flight; dark: tile in the slot",
        ),
    ]
    handles += [Patch(facecolor=col, label=lab) for lab, col in notes]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22),
        ncol=3,
        fontsize=7,
        frameon=False,
    )
    return _finish(fig, path)


def gemm_pipeline_timeline(ab_buffers=4, k_tiles=10, load_time=3.0, mma_time=1.0, path=None):
    """Stage 1's mainloop as a model schedule: TMA fills ab_buffers slots ahead, the wgmma of K tile
    k waits on full[k % ab_buffers], and the slot is released (empty barrier) once the MMAs that read
    it are done, which lets TMA refill it with K tile k + ab_buffers. With
    load_time > (ab_buffers - 1) * mma_time the MMAs stall (try ab_buffers=2)."""
    loads = [(f"AB{k}", k % ab_buffers) for k in range(k_tiles)]
    ops = [("wgmma", f"k={k}", mma_time, [f"AB{k}"], [f"AB{k}"]) for k in range(k_tiles)]
    ev = simulate_ring(loads, ops, load_time=load_time)
    busy = sum(e - s for _, _, s, e, _ in ev["ops"])
    span = max(e for _, _, _, e, _ in ev["ops"])
    title = (
        f"Stage 1 pipeline, ab_buffers = {ab_buffers}, {k_tiles} K tiles: tensor cores busy "
        f"{100 * busy / span:.0f}% of the time (model: load {load_time}, MMA {mma_time})"
    )
    return _draw_timeline(ev, ab_buffers, ("TMA producer", "wgmma"), title, path)


def kv_ring_schedule(
    kv_tiles=3, kv_slots=2, two_pass=True, v_waits_for_release=True, slot_per="tile"
):
    """(loads, ops, wait rule) of the K/V ring. two_pass=True is stage 4: pass 1 streams K_j only
    (row max m, row sum l), pass 2 streams K_j and V_j. two_pass=False is stage 5: one pass,
    online softmax. slot_per="tile" is the Hopper track: step t of the ring uses slot
    t % kv_slots twice, V_j lands in the slot K_j just left. slot_per="entry" is the Blackwell
    track: every load (K_j or V_j) is the next ring entry, entry e in slot e % kv_slots.
    v_waits_for_release=False is the seed draft's bug: V_j is loaded into K_j's slot without
    waiting for the QK^T MMA to release it."""
    if slot_per not in ("tile", "entry"):
        raise ValueError(f"slot_per = {slot_per!r}; allowed: 'tile', 'entry'")
    loads, ops = [], []
    t = 0
    if two_pass:
        for j in range(kv_tiles):
            loads.append((f"K{j}", t % kv_slots))
            ops.append(("MMA", f"QK{j}", 1.0, [f"K{j}"], [f"K{j}"]))
            ops.append(("softmax", f"m,l {j}", 0.7, [], []))
            t += 1
    # pass 2 (or the only pass): slot of tile j receives K_j then V_j
    sl = {}
    for j in range(kv_tiles):
        sl[j] = (t + j) % kv_slots
    kname = (lambda j: f"K{j}'") if two_pass else (lambda j: f"K{j}")
    order = []
    for j in range(min(kv_slots, kv_tiles)):
        order.append((kname(j), sl[j]))
    for j in range(kv_tiles):
        order.append((f"V{j}", sl[j]))
        if j + kv_slots < kv_tiles:
            order.append((kname(j + kv_slots), sl[j + kv_slots]))
    if slot_per == "entry":
        order = [(kname(j) if x == 0 else f"V{j}", None) for j in range(kv_tiles) for x in (0, 1)]
        loads = [
            (item, e % kv_slots)
            for e, (item, _) in enumerate([(it, None) for it, _ in loads] + order)
        ]
    else:
        loads.extend(order)
    for j in range(kv_tiles):
        ops.append(("MMA", f"QK{j}", 1.0, [kname(j)], [kname(j)]))
        ops.append(("softmax", "P=exp(S-m)/l" if two_pass else "online", 0.9, [], []))
        ops.append(("MMA", f"PV{j}", 1.0, [f"V{j}"], [f"V{j}"]))
    wait = None if v_waits_for_release else (lambda item: not item.startswith("V"))
    return loads, ops, wait


def kv_slot_timeline(
    kv_tiles=3,
    kv_slots=2,
    two_pass=True,
    v_waits_for_release=True,
    load_time=2.0,
    slot_per="tile",
    path=None,
):
    """Stage 4 (two_pass=True) or stage 5 (two_pass=False): one ring of kv_slots shared-memory
    slots carries K and V. In pass 2 a slot receives K_j, the QK^T MMA reads it, the slot is
    released, V_j is loaded into the same slot, the PV MMA reads it, the slot is released again.
    With v_waits_for_release=False (the seed draft) V_j's load overlaps QK_j: a race."""
    loads, ops, wait = kv_ring_schedule(kv_tiles, kv_slots, two_pass, v_waits_for_release, slot_per)
    ev = simulate_ring(loads, ops, load_time=load_time, wait_for_release=wait)

    def color(item):
        return C["v"] if item.startswith("V") else C["k"]

    what = (
        "stage 4, exact two-pass softmax (pass 1: K only; pass 2: K' then V)"
        if two_pass
        else "stage 5, one pass with online softmax"
    )
    ring = (
        "V_j into K_j's slot (Hopper)"
        if slot_per == "tile"
        else "one ring entry per load (Blackwell)"
    )
    title = f"K/V ring, kv_slots = {kv_slots}, {kv_tiles} KV tiles, {ring} - {what}"
    notes = [("a K tile in the slot", C["k"]), ("a V tile in the slot", C["v"])]
    if not v_waits_for_release:
        title += "\nRACY VARIANT: V_j is loaded without waiting for the QK_j release"
    return _draw_timeline(
        ev, kv_slots, ("TMA producer", "MMA", "softmax"), title, path, notes, color
    )


# --------------------------------------------------------------------------------------------
# Register fragments (Hopper)
# --------------------------------------------------------------------------------------------


def wgmma_accumulator_layout(n=32, thread=5, path=None):
    """The 64 x n fp32 accumulator of one warpgroup's wgmma m64nNk16 (the PTX ISA's "D" fragment).
    Left: which warp owns which rows (warp w: rows 16 w .. 16 w + 15) and the registers of one
    thread. Right: warp 0's 16 rows, each cell labelled T<lane>/d<register>: thread t holds rows
    t/4 and t/4 + 8, columns 2 (t % 4) + 8 i + {0, 1}; one row is spread over the 4 threads of a
    quad (lanes 4 r .. 4 r + 3)."""
    show_n = min(n, 32)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(16, 6.2), gridspec_kw={"width_ratios": [1, 2.6]})
    for w in range(4):
        _box(
            ax,
            0,
            16 * w,
            n,
            16,
            WARP_COLORS[w],
            lw=0.6,
            text=f"warp {w}\nrows {16 * w}-{16 * w + 15}",
            fontsize=9,
        )
    mine = wgmma_c_coords(thread, n)
    for v, r, c in mine:
        _box(ax, c, r, 1, 1, LANE_COLORS[thread % 4], lw=0)
    ax.set_xlim(0, n)
    ax.set_ylim(64, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("column")
    ax.set_ylabel("row")
    ax.set_title(
        f"64 x {n} accumulator, thread {thread}: {len(mine)} fp32 registers\n"
        f"rows {mine[0][1]} and {mine[0][1] + 8}",
        fontsize=10,
    )
    for t in range(32):
        for v, r, c in wgmma_c_coords(t, n):
            if c >= show_n:
                continue
            _box(
                bx,
                c,
                r,
                1,
                1,
                LANE_COLORS[t % 4],
                alpha=0.9 if t == thread else 0.28,
                lw=0.3,
                text=f"T{t}\nd{v}",
                fontsize=5.5,
                tc="white" if t == thread else "black",
            )
    r0 = thread // 4
    for rr in (r0, r0 + 8):
        bx.add_patch(Rectangle((0, rr), show_n, 1, fill=False, edgecolor="black", lw=2))
    bx.set_xlim(0, show_n)
    bx.set_ylim(16, 0)
    bx.set_xticks([c + 0.5 for c in range(show_n)], [str(c) for c in range(show_n)], fontsize=6)
    bx.set_yticks([r + 0.5 for r in range(16)], [str(r) for r in range(16)], fontsize=7)
    bx.set_title(
        f"warp 0, columns 0-{show_n - 1}: colour = lane % 4 (position in the quad). Rows {r0} and "
        f"{r0 + 8} (boxed) live in lanes {4 * r0}-{4 * r0 + 3}",
        fontsize=10,
    )
    return _finish(fig, path)


def quad_reduction(
    values=((1.5, -0.3, 2.0), (0.7, 3.1, -1.0), (2.2, 0.1, 0.4), (-0.5, 1.9, 2.6)),
    op="max",
    path=None,
):
    """Row max (or sum) of a row spread over a quad: each lane first reduces its own registers of
    the row, then two butterfly shuffles (shfl.sync.bfly with lane mask 2, then 1, the order of
    cute.arch.warp_reduction) combine the 4 partial results, after which all 4 lanes hold the
    row's value. No shared memory, no barrier."""
    f = max if op == "max" else (lambda a, b: a + b)
    part = [v[0] for v in values]
    for i, vs in enumerate(values):
        acc = vs[0]
        for x in vs[1:]:
            acc = f(acc, x)
        part[i] = acc
    s1 = [f(part[i], part[i ^ 2]) for i in range(4)]
    s2 = [f(s1[i], s1[i ^ 1]) for i in range(4)]
    cols = [
        ("registers of the row\n(per lane)", [", ".join(f"{x:g}" for x in vs) for vs in values]),
        (f"lane-local {op}", [f"{x:g}" for x in part]),
        ("after shfl xor 2", [f"{x:g}" for x in s1]),
        ("after shfl xor 1", [f"{x:g}" for x in s2]),
    ]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    w, h = 2.2, 0.7
    for ci, (title, texts) in enumerate(cols):
        x = ci * 3.0
        ax.text(x + w / 2, -0.7, title, ha="center", fontsize=9)
        for lane, t in enumerate(texts):
            _box(
                ax,
                x,
                lane,
                w,
                h,
                LANE_COLORS[lane],
                alpha=0.35 if ci < 3 else 0.85,
                text=f"lane {lane}: {t}",
                fontsize=8,
            )
    for ci, mask in ((1, 2), (2, 1)):
        x0 = ci * 3.0 + w
        for lane in range(4):
            src = lane ^ mask
            ax.add_patch(
                FancyArrowPatch(
                    (x0, src + h / 2),
                    (x0 + 0.8, lane + h / 2),
                    arrowstyle="->",
                    mutation_scale=8,
                    lw=0.8,
                    color=LANE_COLORS[src],
                )
            )
    for lane in range(4):
        ax.add_patch(
            FancyArrowPatch(
                (w, lane + h / 2), (3.0, lane + h / 2), arrowstyle="->", mutation_scale=8, lw=0.8
            )
        )
    ax.set_xlim(-0.2, 3 * 3.0 + w + 0.2)
    ax.set_ylim(4.0, -1.1)
    ax.axis("off")
    ax.set_title(
        f"row {op} over a quad: 2 shuffles, every lane ends with the same {s2[0]:g}", fontsize=10
    )
    return _finish(fig, path)


def p_register_path(n=64, thread=5, path=None):
    """Why P never leaves the registers on Hopper: the accumulator fragment of S = Q K^T (m64nNk16,
    fp32) restricted to columns 16 j .. 16 j + 15 puts every thread's values at exactly the
    (row, k) positions the register-sourced A operand of the next wgmma (P @ V, k-block j of 16)
    expects. Converting fp32 -> bf16 and packing pairs into 32-bit registers is all it takes:
    d[8 j + 2 u], d[8 j + 2 u + 1] -> 32-bit register u of k-block j."""
    kb = n // 16
    fig, axes = plt.subplots(2, 1, figsize=(min(18, 3 + n * 0.22), 7.2))
    cmap = plt.get_cmap("tab10")
    c_mine = wgmma_c_coords(thread, n)
    a_mine = wgmma_a_coords(thread)
    for ax, title in zip(
        axes,
        (
            "S = Q K^T: wgmma accumulator (fp32), warp 0 rows 0-15",
            "P as the A operand of O += P V: k-blocks of 16 columns (bf16 in registers)",
        ),
    ):
        for r in range(16):
            for c in range(n):
                _box(ax, c, r, 1, 1, "#F4F4F4", lw=0.2)
        for j in range(kb):
            ax.add_patch(Rectangle((16 * j, 0), 16, 16, fill=False, edgecolor=cmap(j % 10), lw=2))
            ax.text(
                16 * j + 8,
                -0.6,
                f"k-block {j}" if "P" in title[:2] else f"cols {16 * j}-{16 * j + 15}",
                ha="center",
                fontsize=8,
                color=cmap(j % 10),
            )
        ax.set_xlim(0, n)
        ax.set_ylim(16, -1.3)
        ax.set_aspect("equal")
        ax.set_title(title, fontsize=10)
        ax.set_yticks([])
        ax.set_xticks([])
    for v, r, c in c_mine:
        if r < 16:
            _box(
                axes[0],
                c,
                r,
                1,
                1,
                cmap((c // 16) % 10),
                lw=0.3,
                text=f"d{v}",
                fontsize=6,
                tc="white",
            )
    for j in range(kb):
        for v, r, k in a_mine:
            if r < 16:
                _box(
                    axes[1],
                    16 * j + k,
                    r,
                    1,
                    1,
                    cmap(j % 10),
                    lw=0.3,
                    text=f"a{v}",
                    fontsize=6,
                    tc="white",
                )
    fig.suptitle(
        f"thread {thread}: identical positions in both fragments, so P = bf16(exp2(...)) is used "
        f"in place (d[8j..8j+7] -> a0..a7 of k-block j)",
        fontsize=10,
    )
    return _finish(fig, path)


# --------------------------------------------------------------------------------------------
# Blackwell
# --------------------------------------------------------------------------------------------


def tmem_columns(
    regions=(("S", 0, 128, "fp32"), ("P", 32, 64, "bf16 x2"), ("O", 128, 128, "fp32")),
    alloc_cols=256,
    total_cols=512,
    lanes=128,
    title=None,
    path=None,
):
    """Tensor memory of one SM: 128 lanes x 512 columns of 32 bits. A row of a 128-row tile lives
    in one lane; warp w (w % 4 within its warpgroup) may access lanes 32 (w % 4) .. 32 (w % 4) + 31
    only, so softmax warps 0-3 own rows 0-31, ..., 96-127, one row per thread. An fp32 tile of N
    columns uses N columns; bf16 P packs two values per column (N/2 columns) and is written over
    S, which it replaces. regions: (name, first column, number of columns, what)."""
    colors = {"S": C["s"], "P": C["p"], "O": C["o"], "C": C["c"], "acc": C["c"]}
    fig, ax = plt.subplots(figsize=(13, 4.2))
    _box(ax, 0, 0, total_cols, lanes, "#FAFAFA", lw=0.8)
    _box(ax, 0, 0, alloc_cols, lanes, "#F0F0F0", lw=0.8)
    for w in range(4):
        ax.plot([0, total_cols], [32 * w, 32 * w], color="#999999", lw=0.5)
        ax.text(
            -4,
            32 * w + 16,
            f"warp {w}\nlanes {32 * w}-{32 * w + 31}",
            ha="right",
            va="center",
            fontsize=8,
        )
    overlays = [(s, s + w) for n, s, w, _ in regions if n == "P"]
    for name, start, width, what in regions:
        overlay = name == "P"
        _box(
            ax,
            start,
            0,
            width,
            lanes,
            colors.get(name, "#999999"),
            alpha=0.45 if overlay else 0.75,
            hatch="///" if overlay else None,
            lw=1.5 if overlay else 0.8,
        )
        # the label goes over the widest part of the region that P does not cover
        a, b = start, start + width
        if not overlay:
            for pa, pb in overlays:
                if pa <= a < pb:
                    a = min(pb, b)
                elif a < pa < b and pa - a < b - pb:
                    a = min(pb, b)
                elif a < pa < b:
                    b = pa
        ax.text(
            (a + b) / 2,
            lanes * (0.3 if overlay else 0.7),
            f"{name}\ncols {start}-{start + width - 1}\n{what}",
            ha="center",
            va="center",
            fontsize=9,
            color="black",
            fontweight="bold",
        )
    ax.text(
        alloc_cols + (total_cols - alloc_cols) / 2,
        lanes / 2,
        f"not allocated\n(tcgen05.alloc takes a power of 2 >= 32 columns: {alloc_cols})",
        ha="center",
        va="center",
        fontsize=8,
        color="#777777",
    )
    ax.set_xlim(-70, total_cols + 5)
    ax.set_ylim(lanes + 5, -5)
    ax.set_xticks([0, 64, 128, 192, 256, 320, 384, 448, 512])
    ax.set_xlabel("TMEM column (32 bits each)")
    ax.set_yticks([])
    ax.set_title(
        title or "Tensor memory (TMEM): 128 lanes x 512 columns x 32 bit = 256 KB per SM",
        fontsize=10,
    )
    return _finish(fig, path)


def blackwell_warp_roles(stage=3, path=None):
    """The 192-thread CTA of the Blackwell track: warps 0-3 softmax and epilogue (one row of the
    128-row tile per thread, read from TMEM with tcgen05.ld), warp 4 issues tcgen05.mma (one
    thread), warp 5 issues the TMA loads. Arrows: data through shared memory and TMEM, and the
    mbarriers that order them."""
    soft = {
        1: "epilogue: tcgen05.ld C\n-> registers -> global",
        2: "epilogue: tcgen05.ld S\n(scaled) -> global",
    }.get(
        stage,
        "softmax: tcgen05.ld S, row max/sum,\nexp2, tcgen05.st P over S;\nepilogue: O / l -> global",
    )
    mma = {1: "tcgen05.mma: C += A B^T\n(A, B from smem)", 2: "tcgen05.mma: S = Q K^T"}.get(
        stage, "tcgen05.mma: S = Q K^T (smem, smem)\n O += P V (P from TMEM)"
    )
    tma = {1: "TMA: A, B tiles\n-> ab_buffers ring"}.get(
        stage, "TMA: Q once,\nK (and V) -> kv_slots ring"
    )
    fig, ax = plt.subplots(figsize=(13, 4.6))
    _box(
        ax,
        0,
        0,
        3.6,
        3.2,
        "#EDE1F5",
        text=f"warps 0-3 (128 threads,\none row per thread)\n\n{soft}",
        fontsize=9,
    )
    _box(ax, 4.9, 0, 2.5, 1.4, "#F6E3E3", text="TMEM\n(accumulators)", fontsize=9)
    _box(ax, 4.9, 1.8, 2.5, 1.4, "#E2F0D9", text="shared memory\n(swizzled tiles)", fontsize=9)
    _box(ax, 8.7, 0, 3.2, 1.4, "#FBE3D6", text=f"warp 4 (one thread issues)\n{mma}", fontsize=9)
    _box(ax, 8.7, 1.8, 3.2, 1.4, "#DCEAF7", text=f"warp 5 (one thread issues)\n{tma}", fontsize=9)

    def arrow(a, b, text, style="->", dy=-0.12):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=12, lw=1.2))
        ax.text(
            (a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + dy, text, fontsize=7.5, ha="center", va="bottom"
        )

    arrow((8.7, 2.5), (7.4, 2.5), "TMA loads")
    arrow((7.4, 2.0), (8.7, 1.2), "operands", dy=0.05)
    arrow((8.7, 0.5), (7.4, 0.5), "MMA writes")
    arrow((4.9, 0.6), (3.6, 0.6), "tcgen05.ld" + (" / .st" if stage >= 3 else ""), style="<->")
    ax.text(
        0.0,
        3.75,
        "mbarriers order every hand-over: full (TMA -> MMA), empty (MMA -> TMA), accumulator "
        "ready (MMA -> warps 0-3)" + ("; P ready (warps 0-3 -> MMA)" if stage >= 3 else ""),
        fontsize=8.5,
    )
    ax.set_xlim(-0.2, 12.1)
    ax.set_ylim(4.1, -0.3)
    ax.axis("off")
    ax.set_title("Blackwell CTA: 6 warps, 3 roles (192 threads)", fontsize=10)
    return _finish(fig, path)


# --------------------------------------------------------------------------------------------
# Softmax
# --------------------------------------------------------------------------------------------


def online_softmax_trace(scores, tile=4, path=None):
    """One row of scores processed tile by tile: running max m (steps), the rescale factor
    alpha = exp(m_old - m_new) applied to l and O whenever a tile raises m, and the running sum l.
    `scores` are the already scaled logits of the row (a 1-D sequence of floats)."""
    s = [float(x) for x in scores]
    n = len(s)
    m, l = float("-inf"), 0.0
    ms, ls, alphas, edges = [], [], [], []
    for t0 in range(0, n, tile):
        blk = s[t0 : t0 + tile]
        m_new = max(m, max(blk))
        alpha = math.exp(m - m_new) if m != float("-inf") else 0.0
        l = l * alpha + sum(math.exp(x - m_new) for x in blk)
        ms.append(m_new)
        ls.append(l)
        alphas.append(alpha)
        edges.append((t0, t0 + len(blk)))
        m = m_new
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 3.8))
    ax.bar(range(n), s, color=[plt.get_cmap("tab10")(i // tile % 10) for i in range(n)], alpha=0.6)
    for (a, b), mm, al in zip(edges, ms, alphas):
        ax.plot([a - 0.4, b - 0.6], [mm, mm], color="black", lw=2)
        txt = f"m={mm:.2f}\n" + ("first tile" if a == 0 else f"alpha={al:.3f}")
        ax.text(
            (a + b - 1) / 2,
            max([mm, 0.0] + s[a:b]) + 0.15,
            txt,
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(min(0.0, min(s)) - 0.3, max(s) + 0.25 * (max(s) - min(0.0, min(s))) + 0.5)
    ax.set_xlabel("column (key)")
    ax.set_ylabel("score")
    ax.set_title("running max m after each tile, and alpha = exp(m_old - m_new)", fontsize=10)
    bx.plot(range(1, len(ls) + 1), ls, marker="o")
    for i, v in enumerate(ls):
        bx.text(i + 1, v, f" {v:.3f}", fontsize=8)
    bx.set_xticks(range(1, len(ls) + 1))
    bx.set_xlabel("tiles seen")
    bx.set_ylabel("l (running sum, relative to the current m)")
    bx.set_title(
        f"final l = {ls[-1]:.4f}; LSE = m + log(l) = {ms[-1] + math.log(ls[-1]):.4f}", fontsize=10
    )
    bx.grid(alpha=0.3)
    return _finish(fig, path)


# --------------------------------------------------------------------------------------------
# Errors and benchmarks
# --------------------------------------------------------------------------------------------


def error_heatmap(out, ref, title="|out - ref|", max_side=512, path=None):
    """|out - ref| over a 2-D tile (the last two dims of the first batch/head), log colour scale,
    the worst element circled. Large tiles are max-pooled down to max_side x max_side."""
    import torch

    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    while o.dim() > 2:
        o, r = o[0], r[0]
    err = (o - r).abs()
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
    rows, cols = err.shape
    f = max(1, -(-max(rows, cols) // max_side))
    if f > 1:
        pooled = torch.nn.functional.max_pool2d(
            err[None, None].nan_to_num(posinf=1e30), f, ceil_mode=True
        )[0, 0]
    else:
        pooled = err
    fig, ax = plt.subplots(figsize=(7.5, min(8.0, max(3.0, 6.5 * rows / max(cols, 1)))))
    finite = pooled[torch.isfinite(pooled) & (pooled > 0)]
    hi = float(finite.max()) if finite.numel() else 1.0
    lo = max(float(finite.min()), hi * 1e-4) if finite.numel() else hi * 1e-4
    im = ax.imshow(
        pooled.clamp(min=lo).numpy(),
        norm=LogNorm(vmin=lo, vmax=max(hi, lo * 10)),
        cmap="viridis",
        aspect="auto",
        extent=(0, cols, rows, 0),
        interpolation="nearest",
    )
    flat = int(torch.argmax(err.nan_to_num(posinf=1e300)))
    wr, wc = divmod(flat, cols)
    ax.plot(wc + 0.5, wr + 0.5, marker="o", mfc="none", mec="red", ms=14, mew=2)
    fig.colorbar(im, ax=ax, label="absolute error")
    ax.set_xlabel("column")
    ax.set_ylabel("row")
    pooled_note = f" (max-pooled {f}x{f})" if f > 1 else ""
    ax.set_title(
        f"{title}{pooled_note}\nworst at ({wr}, {wc}): {float(err[wr, wc]):.3e}", fontsize=10
    )
    return _finish(fig, path)


def bench_bars(results, title, path=None):
    """results: {shape label: {name: TFLOP/s}} -> grouped bars, the stage's own bar first."""
    shapes = list(results)
    names = []
    for res in results.values():
        for k in res:
            if k not in names:
                names.append(k)
    names = [k for k in names if k.startswith("stage")] + [
        k for k in names if not k.startswith("stage")
    ]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(shapes) * len(names) / 2 + 2), 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [si + i * width for si in range(len(shapes))]
        ys = [results[s].get(name, 0.0) for s in shapes]
        bars = ax.bar(xs, ys, width, label=name)
        for x, v in zip(xs, ys):
            if v:
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        if name.startswith("stage"):
            for b in bars:
                b.set_edgecolor("black")
                b.set_linewidth(1.5)
    ax.set_xticks([si + 0.4 - width / 2 for si in range(len(shapes))], shapes, fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _finish(fig, path)


def plot_attention_bench(curves, title, path=None):
    """curves: {(D, label): [(S, tflops), ...]} -> one panel per head dim, TFLOP/s against S."""
    dims = sorted({d for d, _ in curves})
    fig, axes = plt.subplots(1, len(dims), figsize=(6 * len(dims), 4), squeeze=False)
    for ax, D in zip(axes[0], dims):
        for (d, label), pts in sorted(curves.items(), key=lambda kv: kv[0][1]):
            if d != D:
                continue
            xs, ys = zip(*pts)
            ax.plot(
                xs, ys, marker="o", label=label, linewidth=2.5 if label.startswith("stage") else 1.2
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"D = {D}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
