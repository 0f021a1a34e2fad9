"""Figures of notebook 1 (the GEMM): tiling, the views from a global tensor to what the MMA reads,
the 128-byte swizzle, barrier phases, the TMA -> MMA pipeline, the wgmma accumulator, the
Blackwell warp roles.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from common.tools.draw import FIG_WIDTH, LANE_COLORS, MONO, WARP_COLORS, C, arrow, box, finish
from notebooks.figures.layouts import layout_str as layout_str
from notebooks.figures.layouts import swizzle as swizzle
from notebooks.figures.layouts import swizzle_128b_chunk, wgmma_c_coords
from notebooks.figures.layouts import wgmma_c_tv as wgmma_c_tv
from notebooks.figures.timelines import simulate_ring, timeline_figure


def gemm_tiling(M=1024, N=1024, K=512, tile=(128, 256, 64), highlight=(2, 1), path=None):
    """C = A @ B^T tiled over CTAs: one CTA per bM x bN tile of C (grid = (M / bM, N / bN)); the
    highlighted CTA streams its row panel of A and its row panel of B through shared memory one
    bK-wide K tile at a time. Tiles and K tiles are numbered from 0, as in the code."""
    bM, bN, bK = tile
    gm, gn = -(-M // bM), -(-N // bN)
    hm, hn = highlight
    gap = 0.08 * max(M, N)
    width = 9.5
    fig, ax = plt.subplots(figsize=(width, width * (M + K + 2 * gap) / (N + K + 3.4 * gap)))
    # C, bottom right: x = column n, y = row m (y grows downwards)
    for i in range(gm):
        for j in range(gn):
            hit = (i, j) == (hm, hn)
            box(
                ax,
                j * bN,
                i * bM,
                bN,
                bM,
                C["c"] if hit else "#F6E3E3",
                lw=0.6,
                text=f"({i},{j})" if gm * gn <= 64 else None,
                fontsize=10,
                alpha=0.9 if hit else 1.0,
                tc="white" if hit else "black",
            )
    ax.text(
        N / 2,
        M + gap * 0.55,
        f"C (M={M}, N={N}): {gm} x {gn} CTAs, label = (m tile, n tile)",
        ha="center",
        va="center",
        fontsize=11,
    )
    kt = -(-K // bK)
    # A, left: rows m, columns k
    ax0 = -gap - K
    box(ax, ax0, 0, K, M, "#EAF0F8", lw=0.6)
    for k in range(kt):
        box(
            ax,
            ax0 + k * bK,
            hm * bM,
            min(bK, K - k * bK),
            bM,
            C["a"],
            lw=0.5,
            alpha=0.35 + 0.65 * (k == 0),
            text=str(k) if kt <= 12 else None,
            fontsize=10,
        )
    ax.text(ax0 + K / 2, M + gap * 0.55, f"A (M x K = {K})", ha="center", fontsize=11)
    # B^T, top: rows k, columns n (B is stored N x K, K-major; drawn transposed)
    by0 = -gap - K
    box(ax, 0, by0, N, K, "#FBEFE5", lw=0.6)
    for k in range(kt):
        box(
            ax,
            hn * bN,
            by0 + k * bK,
            bN,
            min(bK, K - k * bK),
            C["b"],
            lw=0.5,
            alpha=0.35 + 0.65 * (k == 0),
            text=str(k) if kt <= 12 else None,
            fontsize=10,
        )
    ax.text(
        N + gap * 0.3,
        by0 + K / 2,
        "B^T (K x N)\nB is stored\n(N, K),\nK-major",
        ha="left",
        va="center",
        fontsize=11,
    )
    ax.text(
        ax0 + K / 2,
        by0 + K / 2,
        f"CTA ({hm},{hn}):\nK tiles {0}..{kt - 1}\nof {bK} flow\nthrough the\nab_buffers ring",
        ha="center",
        va="center",
        fontsize=11,
    )
    ax.set_xlim(ax0 - gap * 0.2, N + gap * 3.2)
    ax.set_ylim(M + gap, by0 - gap * 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"GEMM tiling: CTA tile {bM} x {bN}, K tile {bK}", fontsize=12)
    return finish(fig, path)


def swizzle_128b(rows=8, path=None):
    """A K-major bf16 shared-memory tile, 64 elements (128 bytes = eight 16-byte chunks) per row.
    Each cell is one 16-byte chunk (8 bf16), labelled with its logical chunk index and coloured by
    it. Left: plain row-major placement - the chunk 0 of every row sits in banks 0-3, so reading
    one chunk from each of 8 rows (what one 8 x 16-byte matrix read does) hits the same 4 banks
    8 times. Right: the 128-byte swizzle (Swizzle<3,4,3> on byte addresses), logical chunk c of
    row r stored at chunk c ^ (r % 8): the 8 reads spread over all 32 banks."""
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH, 2.6 + 0.5 * rows))
    for ax, swz in zip(axes, (False, True)):
        for r in range(rows):
            for c in range(8):
                p = swizzle_128b_chunk(r, c) if swz else c
                hot = c == 0
                box(
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
                    fontsize=10,
                    tc="white" if hot else "black",
                )
        ax.set_xlim(0, 8)
        ax.set_ylim(rows, 0)
        ax.set_xticks(
            [p + 0.5 for p in range(8)],
            [f"B {16 * p}-\n{16 * p + 15}\nbanks\n{4 * p}-{4 * p + 3}" for p in range(8)],
            fontsize=9,
        )
        ax.set_yticks([r + 0.5 for r in range(rows)], [f"row {r}" for r in range(rows)], fontsize=9)
        ax.set_aspect("equal")
        banks = sorted({4 * (swizzle_128b_chunk(r, 0) if swz else 0) for r in range(min(rows, 8))})
        ax.set_title(
            ("128B swizzle: chunk c of row r at c ^ (r % 8)" if swz else "no swizzle: chunk c at c")
            + f"\nchunk 0 of rows 0-7 -> {len(banks) * 4} distinct banks "
            + ("(conflict-free)" if len(banks) == 8 else "(8-way conflict)"),
            fontsize=10,
        )
    fig.suptitle(
        "One 128-byte row = 64 bf16 = eight 16-byte chunks (chunk c holds k = 8c .. 8c + 7);\n"
        "the pattern repeats every 8 rows (1 KiB). Cell label = logical chunk, column = where it is stored",
        fontsize=10,
    )
    return finish(fig, path)


def prepare_views(
    cta_tile=(128, 256, 64),
    ab_buffers=4,
    mma_warpgroups=2,
    shape=(1024, 1024, 1024),
    layouts=None,
    path=None,
):
    """The '# 1. Prepare' section of the Hopper GEMM as a picture: how operand A goes from a
    global tensor to the tensor cores (B takes the same path).

    Left (global -> shared memory, TMA): mA (M, K) -> local_tile -> gA (bM, bK, k_tiles), this
    CTA's row panel cut into K tiles -> tma_partition -> tAgA (TMA, k_tiles) and tAsA (TMA,
    ab_buffers): one TMA box per K tile and per buffer -> cute.copy(...) with the buffer's full
    barrier -> sA (bM, bK, ab_buffers), 128B-swizzled.
    Right (shared memory -> wgmma): partition_A gives each warpgroup its 64 rows of sA,
    make_fragment_A turns them into wgmma *descriptors* tCrA (MMA, MMA_M, MMA_K, ab_buffers) -
    64-bit shared-memory addresses with the swizzle mode, one per 64 x 16 block, not registers
    holding data - and cute.gemm(tiled_mma, acc, tCrA[...], tCrB[...], acc) issues one wgmma per
    k_block, accumulating into acc, the only operand held in registers.

    layouts: {name: layout string as CuTe prints it at trace time} (from
    common.tools.notebook.trace_layouts), printed in each box; without it the shapes are computed
    from the configuration."""
    bM, bN, bK = cta_tile
    M, N, K = shape
    k_tiles = -(-K // bK)
    k_blocks = bK // 16
    rows_per_wg = bM // mma_warpgroups
    lay = dict(layouts or {})
    a_kb = bM * bK * 2 // 1024
    b_kb = bN * bK * 2 // 1024
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 8.6))
    ax.set_xlim(0, 22)
    ax.set_ylim(16.6, -0.9)
    ax.axis("off")
    bh, gap = 2.95, 1.25

    def panel(col, i, title, lines, fc, names=(), extra=None):
        x = 0.1 if col == 0 else 11.4
        w = 10.5
        y = i * (bh + gap)
        box(ax, x, y, w, bh, fc, lw=1.0)
        ax.text(x + 0.2, y + 0.4, title, fontsize=10.5, fontweight="bold", va="center", family=MONO)
        for n, ln in enumerate(lines):
            ax.text(x + 0.2, y + 0.9 + 0.42 * n, ln, fontsize=9.5, va="center")
        traced = [f"{n} = {lay[n]}" for n in names if n in lay]
        for n, ln in enumerate(traced):
            ax.text(
                x + 0.2,
                y + 0.95 + 0.42 * (len(lines) + n),
                ln if len(ln) <= 58 else ln[:57] + "...",
                fontsize=9,
                family=MONO,
                va="center",
                color="#1F4E79",
            )
        if extra:
            extra(x, y, w)

    def step(col, i, code):
        x = 0.1 + 0.6 if col == 0 else 11.4 + 0.6
        y0 = i * (bh + gap) + bh
        arrow(ax, (x, y0 + 0.05), (x, y0 + gap - 0.05), lw=1.6)
        for n, ln in enumerate(code):
            ax.text(x + 0.35, y0 + 0.45 + 0.42 * n, ln, fontsize=9, family=MONO, va="center")

    def panel_strip(x, y, w):
        for k in range(min(k_tiles, 8)):
            box(
                ax,
                x + w - 3.0 + 0.34 * k,
                y + 0.55,
                0.3,
                1.2,
                C["a"],
                alpha=0.3 + 0.7 * (k == 0),
                lw=0.4,
            )
        ax.text(x + w - 1.6, y + 2.3, "K tiles 0, 1, ...", fontsize=9, ha="center")

    def slots(x, y, w):
        for s in range(ab_buffers):
            box(
                ax,
                x + w - 2.5 + 0.6 * s,
                y + 0.6,
                0.5,
                0.9,
                C["a"],
                alpha=0.85,
                lw=0.5,
                text=str(s),
            )

    def descs(x, y, w):
        for s in range(ab_buffers):
            for kb in range(k_blocks):
                box(ax, x + w - 2.1 + 0.5 * kb, y + 0.75 + 0.42 * s, 0.44, 0.36, C["desc"], lw=0.4)
        ax.text(x + w - 1.1, y + 0.45, "k_block ->", fontsize=9, ha="center")

    panel(
        0,
        0,
        f"mA  (M, K) = ({M}, {K})",
        [
            "global A as the TMA atom sees it: a tensor of",
            "coordinates (the descriptor holds address and strides)",
        ],
        "#EAF0F8",
        ["mA"],
    )
    step(
        0,
        0,
        [
            "gA = cute.local_tile(mA, cta_tile, (pid_m, pid_n, None),",
            "                     proj=(1, None, 1))  # keep M, K",
        ],
    )
    panel(
        0,
        1,
        f"gA  (bM, bK, k_tiles) = ({bM}, {bK}, {k_tiles})",
        ["this CTA's row panel of A cut into K tiles;", "None = keep every tile of that mode"],
        "#EAF0F8",
        ["gA"],
        panel_strip,
    )
    step(
        0,
        1,
        [
            "tAsA, tAgA = cpasync.tma_partition(tma_atom_a, 0,",
            "    make_layout(1), group_modes(sA, 0, 2), group_modes(gA, 0, 2))",
        ],
    )
    panel(
        0,
        2,
        "tAgA (TMA, k_tiles), tAsA (TMA, ab_buffers)",
        [
            f"TMA mode = one whole box of {bM} x {bK} = {bM * bK} elements",
            f"({a_kb} KiB): one copy per K tile into one buffer",
        ],
        "#FFF4E0",
        ["tAgA", "tAsA"],
    )
    step(
        0,
        2,
        [
            "cute.copy(tma_atom_a, tAgA[None, k_tile], tAsA[None, buffer],",
            "          tma_bar_ptr=full[buffer])  # bytes count down tx_count",
        ],
    )
    panel(
        0,
        3,
        f"sA  (bM, bK, ab_buffers) = ({bM}, {bK}, {ab_buffers})",
        ["shared memory, 128-byte swizzle,", f"{ab_buffers} buffers x {a_kb} KiB"],
        "#E2F0D9",
        ["sA"],
        slots,
    )

    panel(
        1,
        0,
        "thr_mma.partition_A(sA)",
        [
            "thr_mma = tiled_mma.get_slice(warpgroup_idx * 128):",
            f"warpgroup w takes rows {rows_per_wg} w .. {rows_per_wg} w + {rows_per_wg - 1} of every",
            "buffer of sA (left, bottom), in 64 x 16 blocks",
        ],
        "#E2F0D9",
    )
    step(1, 0, ["tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))"])
    panel(
        1,
        1,
        "tCrA  (MMA, MMA_M, MMA_K, ab_buffers)",
        [
            f"= (1, 1, {k_blocks}, {ab_buffers}): wgmma DESCRIPTORS (a 64-bit",
            "smem address + swizzle mode per 64 x 16",
            "block), NOT registers holding A",
        ],
        "#FFF7D6",
        ["tCrA", "tCrB"],
        descs,
    )
    step(
        1,
        1,
        [
            "cute.gemm(tiled_mma, acc, tCrA[None, None, k_block, buffer],",
            "          tCrB[None, None, k_block, buffer], acc)",
        ],
    )
    panel(
        1,
        2,
        "acc  (MMA, MMA_M, MMA_N)",
        [
            "REGISTERS: the only operand in registers,",
            f"{bM} x {bN} fp32 / {128 * mma_warpgroups} threads = {bM * bN // (128 * mma_warpgroups)} per thread",
        ],
        "#F6E3E3",
        ["acc"],
    )
    ax.text(
        11.4,
        3 * (bh + gap) + 0.3,
        f"per K tile: wait full[buffer] (tx_count = {a_kb} + {b_kb} KiB\n"
        f"landed) -> {k_blocks} x wgmma m64n{bN}k16, one per k_block,\n"
        "each reading a descriptor of A and of B -> wait_group\n"
        "-> release empty[buffer] (one arrive per consumer warp)",
        fontsize=9.5,
        va="top",
    )
    ax.text(
        0.1,
        -0.45,
        "global -> shared memory (TMA, one elected thread)",
        fontsize=11,
        fontweight="bold",
    )
    ax.text(
        11.4,
        -0.45,
        "shared memory -> tensor cores (wgmma, a warpgroup)",
        fontsize=11,
        fontweight="bold",
    )
    return finish(fig, path)


def barrier_phases(uses=3, path=None):
    """One buffer's two mbarriers over its first `uses` uses. An mbarrier starts in phase 0; a
    phase completes when its pending arrivals (and, for a full barrier, the expected TMA bytes)
    reach zero, and the next phase begins. `try_wait.parity p` returns once the most recent phase
    with parity p has completed. On a fresh barrier nothing has completed, but the phase before
    phase 0 - parity 1 - counts as complete, so a wait for parity 1 returns at once: that is why
    the producer's first wait on every empty barrier uses parity 1 (the buffer starts empty) and
    the consumer's first wait on the full barrier uses parity 0 (it must wait for TMA)."""
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 4.4))
    fill, mma = 2.0, 1.4
    # use r: producer acquires at a_r (waits empty parity (r+1)%2), TMA lands at l_r, consumer
    # waits full parity r%2 then runs MMA until e_r, releases (empty phase r completes).
    t = 0.0
    events = []
    for r in range(uses):
        a = t
        land = a + fill
        end = land + mma
        events.append((r, a, land, end))
        t = end + 0.3
    rows = {"empty barrier": 0, "full barrier": 1}
    for name, y in rows.items():
        ax.plot([0, t + 0.5], [y, y], color="#999999", lw=0.8)
    for r, a, land, end in events:
        # full barrier: phase r runs from the previous completion to `land`
        prev_full = events[r - 1][2] if r else 0.0
        box(
            ax,
            prev_full,
            1 - 0.28,
            land - prev_full,
            0.56,
            WARP_COLORS[r % 4],
            lw=0.6,
            text=f"phase {r} (parity {r % 2})",
        )
        prev_empty = events[r - 1][3] if r else 0.0
        box(
            ax,
            prev_empty,
            -0.28,
            end - prev_empty,
            0.56,
            WARP_COLORS[(r + 1) % 4],
            lw=0.6,
            text=f"phase {r} (parity {r % 2})",
        )
        ax.plot(land, 1.36, marker="v", color="black", ms=7)
        ax.plot(end, 0.36, marker="^", color="black", ms=7)
        wait_p = (r + 1) % 2
        passes = "returns at once: fresh barrier" if r == 0 else f"waits for empty phase {r - 1}"
        ax.annotate(
            f"producer use {r}:\nwait empty parity {wait_p}\n({passes})",
            xy=(a, -0.3),
            xytext=(a + 0.05, -0.75),
            fontsize=9,
            va="bottom",
            arrowprops=dict(arrowstyle="->", lw=0.8),
        )
        ax.annotate(
            f"consumer use {r}: wait full\nparity {r % 2} (phase {r} completes\nwhen TMA's bytes land)",
            xy=(land, 1.3),
            xytext=(land - 1.2, 1.75),
            fontsize=9,
            va="top",
            arrowprops=dict(arrowstyle="->", lw=0.8),
        )
    ax.set_yticks(
        [0, 1], ["empty[i]\n(consumers arrive)", "full[i]\n(expect_tx + TMA bytes)"], fontsize=10
    )
    ax.set_ylim(3.05, -2.35)
    ax.set_xlim(-0.2, t + 0.5)
    ax.set_xticks([])
    ax.set_xlabel(
        "time ->   (one buffer i of the ring; ▼ full phase completes, ▲ empty phase completes)",
        fontsize=10,
    )
    ax.set_title(
        "Phases and parities: use r of a buffer waits full with parity r % 2 and empty with parity (r + 1) % 2",
        fontsize=11,
    )
    return finish(fig, path)


def gemm_pipeline_timeline(ab_buffers=4, k_tiles=10, load_time=3.0, mma_time=1.0, path=None):
    """Stage 1's mainloop as a model schedule: TMA fills ab_buffers slots ahead, the wgmma of K tile
    k waits on full[k % ab_buffers], and the slot is released (empty barrier) once the MMAs that read
    it are done, which lets TMA refill it with K tile k + ab_buffers: while K tile k is multiplied,
    TMA can be loading up to ab_buffers - 1 tiles ahead of it. With
    load_time > (ab_buffers - 1) * mma_time the MMAs stall. ab_buffers may be a tuple, e.g.
    (2, 4): one panel per depth, on one time axis."""
    depths = ab_buffers if isinstance(ab_buffers, (tuple, list)) else (ab_buffers,)
    panels = []
    for n in depths:
        loads = [(f"AB{k}", k % n) for k in range(k_tiles)]
        ops = [("wgmma", f"k={k}", mma_time, [f"AB{k}"], [f"AB{k}"]) for k in range(k_tiles)]
        ev = simulate_ring(loads, ops, load_time=load_time)
        busy = sum(e - s for _, _, s, e, _ in ev["ops"])
        span = max(e for _, _, _, e, _ in ev["ops"])
        title = (
            f"ab_buffers = {n}, K tiles 0..{k_tiles - 1}: tensor cores busy {100 * busy / span:.0f}% "
            f"of the time (model: load {load_time:g}, MMA {mma_time:g}; the MMAs never wait if load <= "
            f"{n - 1} x MMA)"
        )
        panels.append((ev, n, ("TMA producer", "wgmma"), title, None))
    return timeline_figure(panels, suptitle="Stage 1 pipeline (model schedule)", path=path)


def wgmma_accumulator_layout(n=32, thread=5, show_n=16, path=None):
    """The 64 x n fp32 accumulator of one warpgroup's wgmma m64nNk16 (the PTX ISA's "D" fragment).
    Left: which warp owns which rows (warp w: rows 16 w .. 16 w + 15) and the registers of one
    thread. Right: warp 0's 16 rows, columns 0 .. show_n - 1, each cell labelled T<lane>/d<register>:
    thread t holds rows t/4 and t/4 + 8, columns 2 (t % 4) + 8 i + {0, 1}; one row is spread over
    the 4 threads of a quad (lanes 4 r .. 4 r + 3)."""
    show_n = min(n, show_n)
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(FIG_WIDTH, 6.0), gridspec_kw={"width_ratios": [1, 2.2]}
    )
    for w in range(4):
        box(
            ax,
            0,
            16 * w,
            n,
            16,
            WARP_COLORS[w],
            lw=0.6,
            text=f"warp {w}\nrows {16 * w}-{16 * w + 15}",
            fontsize=10,
        )
    mine = wgmma_c_coords(thread, n)
    for v, r, c in mine:
        box(ax, c, r, 1, 1, LANE_COLORS[thread % 4], lw=0)
    ax.set_xlim(0, n)
    ax.set_ylim(64, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("column", fontsize=10)
    ax.set_ylabel("row", fontsize=10)
    ax.tick_params(labelsize=9)
    ax.set_title(
        f"64 x {n} accumulator; thread {thread}:\n{len(mine)} fp32 registers, "
        f"rows {mine[0][1]} and {mine[0][1] + 8}",
        fontsize=10,
    )
    for t in range(32):
        for v, r, c in wgmma_c_coords(t, n):
            if c >= show_n:
                continue
            box(
                bx,
                c,
                r,
                1,
                1,
                LANE_COLORS[t % 4],
                alpha=0.9 if t == thread else 0.25,
                lw=0.3,
                text=f"T{t}\nd{v}",
                fontsize=9,
                tc="white" if t == thread else "black",
            )
    r0 = thread // 4
    for rr in (r0, r0 + 8):
        bx.add_patch(Rectangle((0, rr), show_n, 1, fill=False, edgecolor="black", lw=2.2))
    bx.set_xlim(0, show_n)
    bx.set_ylim(16, 0)
    bx.set_xticks([c + 0.5 for c in range(show_n)], [str(c) for c in range(show_n)], fontsize=9)
    bx.set_yticks([r + 0.5 for r in range(16)], [str(r) for r in range(16)], fontsize=9)
    bx.set_title(
        f"warp 0, columns 0-{show_n - 1} (cell = thread T / register d; colour = lane % 4).\n"
        f"Rows {r0} and {r0 + 8} (boxed) live in lanes {4 * r0}-{4 * r0 + 3}: one quad",
        fontsize=10,
    )
    return finish(fig, path)


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
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 4.4))
    box(
        ax,
        0,
        0,
        3.6,
        3.2,
        "#EDE1F5",
        text=f"warps 0-3 (128 threads,\none row per thread)\n\n{soft}",
        fontsize=10,
    )
    box(ax, 4.9, 0, 2.5, 1.4, "#F6E3E3", text="TMEM\n(accumulators)", fontsize=10)
    box(ax, 4.9, 1.8, 2.5, 1.4, "#E2F0D9", text="shared memory\n(swizzled tiles)", fontsize=10)
    box(ax, 8.7, 0, 3.3, 1.4, "#FBE3D6", text=f"warp 4 (one thread issues)\n{mma}", fontsize=9.5)
    box(ax, 8.7, 1.8, 3.3, 1.4, "#DCEAF7", text=f"warp 5 (one thread issues)\n{tma}", fontsize=9.5)
    arrow(ax, (8.7, 2.5), (7.4, 2.5), "TMA loads", dy=-0.22)
    arrow(ax, (7.4, 2.0), (8.7, 1.2), "operands", dy=0.0)
    arrow(ax, (8.7, 0.5), (7.4, 0.5), "MMA writes", dy=-0.22)
    arrow(
        ax,
        (4.9, 0.6),
        (3.6, 0.6),
        "tcgen05.ld" + (" / .st" if stage >= 3 else ""),
        style="<->",
        dy=-0.25,
    )
    ax.text(
        0.0,
        3.75,
        "mbarriers order every hand-over: full (TMA -> MMA), empty (MMA -> TMA), accumulator\n"
        "ready (MMA -> warps 0-3)" + ("; P ready (warps 0-3 -> MMA)" if stage >= 3 else ""),
        fontsize=9.5,
        va="top",
    )
    ax.set_xlim(-0.2, 12.2)
    ax.set_ylim(4.5, -0.3)
    ax.axis("off")
    ax.set_title(f"Blackwell CTA, stage {stage}: 6 warps, 3 roles (192 threads)", fontsize=11)
    return finish(fig, path)
