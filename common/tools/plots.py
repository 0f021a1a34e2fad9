"""Pictures for the notebooks and the benchmarks (matplotlib only, no GPU needed).

Every picture is drawn from the same small functions the tests check against the hardware:
  - wgmma_c_coords / wgmma_a_coords: the register fragments of wgmma m64nNk16, evaluated from
    CuTe's own thread-value layouts (tests/test_notebooks.py compares them with cute's atoms);
  - swizzle: CuTe's Swizzle<B, M, S> on byte addresses (S<3,4,3> is TMA's 128-byte swizzle);
  - simulate_ring: a small model of a TMA producer and an MMA consumer sharing a ring of
    shared-memory slots through full/empty mbarriers (durations are illustrative, not measured).
Each plotting function returns its matplotlib Figure. Figures are at most FIG_WIDTH inches wide
and no label is smaller than MIN_FONT points, so that they stay readable at notebook size (a
notebook shows a figure about 8-10 inches wide).
"""

import math

import matplotlib

matplotlib.use("Agg") if matplotlib.get_backend().lower() in ("", "agg") else None
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle  # noqa: E402

FIG_WIDTH = 11.0
MIN_FONT = 9.0
MONO = "monospace"

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
    "desc": "#F2C14E",
}
WARP_COLORS = ("#FBE3D6", "#DCEAF7", "#E2F0D9", "#EDE1F5")
LANE_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")

# One colour per kernel across every notebook and benchmark plot: a baseline keeps its colour
# whichever stage it is timed against.
KERNEL_COLORS = {
    "stage 1": "#E377C2",
    "stage 2": "#BCBD22",
    "stage 3": "#17BECF",
    "stage 4": "#9467BD",
    "stage 5": "#D62728",
    "stage 6": "#B07AA1",
    "stage 7": "#EDC948",
    "stage 8": "#17344F",
    "stage 9": "#8C1D40",
    "stage 7 MHA": "#F5DE8A",
    "stage 7 unpacked": "#C9A227",
    "padded SDPA cuDNN": "#98DF8A",
    "SDPA": "#66C2A5",
    "cuBLAS (torch.matmul)": "#7F7F7F",
    "SDPA flash": "#1F77B4",
    "SDPA cuDNN": "#2CA02C",
    "FA4": "#FF7F0E",
}


def kernel_color(name):
    """The colour of a kernel in every bar chart and curve: its own, or its stage's for a variant
    ("stage 1 (ab_buffers=2)" is drawn in stage 1's colour, hatched)."""
    if name in KERNEL_COLORS:
        return KERNEL_COLORS[name]
    for key, col in KERNEL_COLORS.items():
        if name.startswith(key + " "):
            return col
    return "#8C564B"


def _fs(size):
    return max(MIN_FONT, size)


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
    fontsize=MIN_FONT,
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
        ax.text(
            x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=_fs(fontsize), color=tc
        )


def _finish(fig, path=None, rect=None):
    if rect is None:
        fig.tight_layout()
    else:
        fig.tight_layout(rect=rect)
    if path:
        fig.savefig(path, dpi=120)
    return fig


def _arrow(ax, a, b, text=None, style="->", color="black", lw=1.2, fontsize=MIN_FONT, dy=0.0, **kw):
    ax.add_patch(
        FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=13, lw=lw, color=color, **kw)
    )
    if text:
        ax.text(
            (a[0] + b[0]) / 2,
            (a[1] + b[1]) / 2 + dy,
            text,
            fontsize=_fs(fontsize),
            ha="center",
            va="center",
            color=color,
            bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85),
        )


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
            _box(
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
    _box(ax, ax0, 0, K, M, "#EAF0F8", lw=0.6)
    for k in range(kt):
        _box(
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
    _box(ax, 0, by0, N, K, "#FBEFE5", lw=0.6)
    for k in range(kt):
        _box(
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
    one bM-row band of S = Q K^T. Everything is numbered from 0."""
    qt = -(-Sq // block_m)
    hb, hh, hq = highlight
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(FIG_WIDTH, 4.8), gridspec_kw={"width_ratios": [1, 1.5]}
    )
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
                    fontsize=9,
                    tc="white" if hit else "black",
                )
    ax.set_xlim(-0.1, qt + 0.1)
    ax.set_ylim(B * H + 0.1, -0.1)
    ax.set_xticks([t + 0.5 for t in range(qt)], [str(t) for t in range(qt)], fontsize=9)
    ax.set_yticks(
        [y + 0.5 for y in range(B * H)], [f"b{y // H} h{y % H}" for y in range(B * H)], fontsize=9
    )
    ax.set_xlabel(f"Q tile ({block_m} rows each)", fontsize=10)
    ax.set_title(f"{qt * H * B} CTAs: {grid_label}\nlabel = (q tile, head, batch)", fontsize=10)
    ax.set_aspect("equal")
    # Right: the highlighted CTA's work. Units: rows/cols scaled to fit.
    kt = -(-Sk // block_n)
    shown = min(kt, 6)
    u = 1.0 / max(block_m, D)
    qh, qw = block_m * u, D * u
    _box(bx, 0, 0.6, qw, qh, C["q"], text=f"Q tile\n{block_m} x {D}\n(resident)", tc="white")
    x0 = qw + 0.4
    for j in range(shown):
        _box(
            bx,
            x0 + j * block_n * u,
            -0.05 - qw,
            block_n * u,
            qw,
            C["k"],
            alpha=0.5 + 0.5 * (j == 0),
            text=f"K{j}^T",
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
        )
    more = f" (first {shown} drawn)" if kt > shown else ""
    bx.text(
        0,
        0.6 + qh + 0.12,
        f"one CTA (b={hb}, h={hh}, q tile {hq}): S band {block_m} x {Sk} =\n"
        f"{kt} K tiles of {block_n}, numbered 0..{kt - 1}{more}",
        fontsize=10,
        va="top",
    )
    bx.text(
        x0 - 0.2,
        -0.05 - qw / 2,
        f"K tiles\n({block_n} x {D})\nstream in",
        ha="right",
        va="center",
        fontsize=9,
    )
    bx.set_xlim(-0.1, x0 + shown * block_n * u + 0.2)
    bx.set_ylim(0.6 + qh + 0.55, -0.25 - qw)
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
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH, 2.6 + 0.5 * rows))
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
        "the pattern repeats every 8 rows (1 KB). Cell label = logical chunk, column = where it is stored",
        fontsize=10,
    )
    return _finish(fig, path)


# --------------------------------------------------------------------------------------------
# CuTe DSL: from a global tensor to what the MMA reads (stage 1, section "Prepare")
# --------------------------------------------------------------------------------------------


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

    def box(col, i, title, lines, fc, names=(), extra=None):
        x = 0.1 if col == 0 else 11.4
        w = 10.5
        y = i * (bh + gap)
        _box(ax, x, y, w, bh, fc, lw=1.0)
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
        _arrow(ax, (x, y0 + 0.05), (x, y0 + gap - 0.05), lw=1.6)
        for n, ln in enumerate(code):
            ax.text(x + 0.35, y0 + 0.45 + 0.42 * n, ln, fontsize=9, family=MONO, va="center")

    def panel_strip(x, y, w):
        for k in range(min(k_tiles, 8)):
            _box(
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
            _box(
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
                _box(ax, x + w - 2.1 + 0.5 * kb, y + 0.75 + 0.42 * s, 0.44, 0.36, C["desc"], lw=0.4)
        ax.text(x + w - 1.1, y + 0.45, "k_block ->", fontsize=9, ha="center")

    box(
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
    box(
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
    box(
        0,
        2,
        "tAgA (TMA, k_tiles), tAsA (TMA, ab_buffers)",
        [
            f"TMA mode = one whole box of {bM} x {bK} = {bM * bK} elements",
            f"({a_kb} KB): one copy per K tile into one buffer",
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
    box(
        0,
        3,
        f"sA  (bM, bK, ab_buffers) = ({bM}, {bK}, {ab_buffers})",
        ["shared memory, 128-byte swizzle,", f"{ab_buffers} buffers x {a_kb} KB"],
        "#E2F0D9",
        ["sA"],
        slots,
    )

    box(
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
    box(
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
    box(
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
        f"per K tile: wait full[buffer] (tx_count = {a_kb} + {b_kb} KB\n"
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
    return _finish(fig, path)


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
        _box(
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
        _box(
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


def _t_end(ev):
    return max([e for _, _, _, e, _ in ev["ops"]] + [v[3] for v in ev["loads"].values()])


def _timeline_rows(slots, lanes, ev):
    rows = list(lanes) + [f"slot {s}" for s in range(slots)]
    if ev["races"]:
        rows.append("hazards")
    return rows


def _draw_timeline(ax, ev, slots, lanes, title, item_color=None, t_max=None):
    """Draw one schedule into `ax`: the producer lane (a tick and a label per load, hatched while
    it waits on an empty barrier), the consumer lanes, one lane per slot (light: TMA transfer in
    flight, dark: the tile resident until its release), and, for a racy schedule, a hazards lane
    naming each overwrite."""
    item_color = item_color or (lambda it: C["load"])
    rows = _timeline_rows(slots, lanes, ev)
    y = {name: i for i, name in enumerate(rows)}
    t_end = t_max if t_max is not None else _t_end(ev)
    h = 0.72
    # producer lane: a tick per load at the moment TMA starts it, labelled with the tile; labels
    # that would overlap go on further levels of the lane (up to 4)
    yp = y[lanes[0]]
    for a, b, prev in ev["producer_waits"]:
        _box(ax, a, yp - h / 2, b - a, h, C["wait"], hatch="//", lw=0.3, alpha=0.6)
    bbox = ax.get_window_extent()
    per_char = 0.62 * 9 / 72 * ax.figure.dpi * (t_end + 0.3) / max(bbox.width, 1.0)
    ends, placed = [], []
    for item, (slot, issue, start, end) in sorted(ev["loads"].items(), key=lambda kv: kv[1][2]):
        for lv, e in enumerate(ends):
            if e <= start:
                break
        else:
            lv = len(ends)
            ends.append(0.0)
        ends[lv] = start + per_char * (len(item) + 1)
        placed.append((item, start, lv))
    levels = min(4, max(1, len(ends)))
    for item, start, lv in placed:
        ax.plot([start, start], [yp - h / 2, yp + h / 2], color="black", lw=1.2)
        ax.text(
            start + 0.04,
            yp - h / 2 + (min(lv, levels - 1) + 0.5) * h / levels,
            item,
            fontsize=9,
            va="center",
            color=item_color(item) if item_color(item) != C["load"] else "black",
            fontweight="bold",
        )
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
        _box(ax, start, y[lane] - h / 2, end - start, h, fc, text=label, fontsize=9, tc="white")
    # slots: occupants may overlap only in a racy schedule; overlapping ones share the lane
    by_slot = {}
    for item, (slot, issue, start, end) in ev["loads"].items():
        rel = ev["releases"].get(item, t_end)
        by_slot.setdefault(slot, []).append((start, end, rel, item))
    for slot, occ in by_slot.items():
        occ.sort()
        sub_end, sub_of = [], {}
        for start, end, rel, item in occ:
            for i, e in enumerate(sub_end):
                if e <= start + 1e-9:
                    sub_end[i] = rel
                    sub_of[item] = i
                    break
            else:
                sub_of[item] = len(sub_end)
                sub_end.append(rel)
        n_sub = len(sub_end)
        sh = h / n_sub
        yy0 = y[f"slot {slot}"] - h / 2
        for start, end, rel, item in occ:
            top = yy0 + sub_of[item] * sh
            _box(ax, start, top, end - start, sh, item_color(item), alpha=0.45, lw=0.5)
            _box(
                ax,
                end,
                top,
                max(rel - end, 0.0),
                sh,
                item_color(item),
                alpha=0.95,
                lw=0.5,
                text=item,
                fontsize=9,
                tc="white",
            )
            ax.plot(end, yy0 - 0.06, marker="v", color="black", ms=6)
            if item in ev["releases"]:
                ax.plot(rel, yy0 + h + 0.06, marker="^", color="black", ms=6)
    for n, (item, prev, a, b) in enumerate(ev["races"]):
        yy = y[f"slot {ev['slot_of'][item]}"]
        _box(ax, a, yy - h / 2, b - a, h, "none", ec=C["race"], lw=2.5, hatch="xx")
        yh = y["hazards"]
        ax.plot([a, b], [yh, yh], color=C["race"], lw=4)
        ax.text(
            (a + b) / 2,
            yh - 0.12 + 0.3 * (n % 2),
            f"RACE: {item} lands in slot {ev['slot_of'][item]} while {prev} is still read",
            color=C["race"],
            fontsize=9,
            ha="center",
            va="bottom" if n % 2 == 0 else "top",
            fontweight="bold",
        )
    ax.set_yticks(range(len(rows)), rows, fontsize=10)
    ax.set_ylim(len(rows) - 0.4, -0.75)
    ax.set_xlim(0, t_end + 0.3)
    ax.grid(axis="x", alpha=0.2)
    ax.tick_params(axis="x", labelsize=9)
    ax.set_title(title, fontsize=10)
    return t_end


def _timeline_legend(fig, notes=(), ncol=3):
    handles = [
        Line2D(
            [],
            [],
            marker="v",
            color="black",
            ls="none",
            label="full barrier completes (bytes landed)",
        ),
        Line2D(
            [],
            [],
            marker="^",
            color="black",
            ls="none",
            label="release: arrive on the empty barrier",
        ),
        Patch(facecolor=C["wait"], hatch="//", label="waiting on a barrier"),
        Patch(facecolor="#BBBBBB", alpha=0.45, label="light: TMA transfer in flight"),
        Patch(facecolor="#777777", label="dark: tile resident in the slot"),
    ]
    handles += [Patch(facecolor=col, label=lab) for lab, col in notes]
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=9, frameon=False)


def _timeline_figure(panels, notes=(), suptitle=None, path=None):
    """panels: [(ev, slots, lanes, title, item_color)] drawn one above the other on ONE time axis,
    so that they can be compared by eye; one legend for all, attached below the last axis."""
    t_max = max(_t_end(p[0]) for p in panels)
    heights = [len(_timeline_rows(p[1], p[2], p[0])) + 0.8 for p in panels]
    legend_h = 0.65
    fig_h = 0.5 * sum(heights) + 1.0 + legend_h + (0.3 if suptitle else 0)
    width = min(FIG_WIDTH, 5.5 + t_max * 0.45)
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(width, fig_h),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (ev, slots, lanes, title, color) in zip(axes[:, 0], panels):
        _draw_timeline(ax, ev, slots, lanes, title, color, t_max=t_max)
    axes[-1, 0].set_xlabel(
        "time (model units: load = TMA latency + transfer, MMA = one tile's MMAs), one axis for all panels"
        if len(panels) > 1
        else "time (model units: load = TMA latency + transfer, MMA = one tile's MMAs)",
        fontsize=9,
    )
    _timeline_legend(fig, notes)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    return _finish(fig, path, rect=(0, legend_h / fig_h, 1, 1))


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
    return _timeline_figure(panels, suptitle="Stage 1 pipeline (model schedule)", path=path)


def kv_ring_schedule(
    kv_tiles=3, kv_slots=2, two_pass=True, v_waits_for_release=True, slot_per="tile"
):
    """(loads, ops, wait rule) of the K/V ring. two_pass=True is stage 4: pass 1 streams K_j only
    (row max m, row sum l), pass 2 streams K_j' (the same tiles again) and V_j. two_pass=False is
    stage 5: one pass, online softmax. slot_per="tile" is the Hopper track: step t of the ring
    uses slot t % kv_slots twice, V_j lands in the slot K_j just left. slot_per="entry" is the
    Blackwell track: every load (K_j or V_j) is the next ring entry, entry e in slot
    e % kv_slots. v_waits_for_release=False is the faulty first draft of the Blackwell kernel:
    V_j is loaded into K_j's slot without waiting for the QK^T MMA to release it."""
    if slot_per not in ("tile", "entry"):
        raise ValueError(f"slot_per = {slot_per!r}; allowed: 'tile', 'entry'")
    loads, ops = [], []
    t = 0
    if two_pass:
        for j in range(kv_tiles):
            loads.append((f"K{j}", t % kv_slots))
            ops.append(("MMA", f"QK{j}", 1.0, [f"K{j}"], [f"K{j}"]))
            ops.append(("softmax", "m,l", 0.7, [], []))
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
        ops.append(("MMA", "Q" + kname(j), 1.0, [kname(j)], [kname(j)]))
        ops.append(("softmax", "P" if two_pass else "P,a", 0.9, [], []))
        ops.append(("MMA", f"PV{j}", 1.0, [f"V{j}"], [f"V{j}"]))
    wait = None if v_waits_for_release else (lambda item: not item.startswith("V"))
    return loads, ops, wait


def _kv_color(item):
    return C["v"] if item.startswith("V") else C["k"]


def _kv_panel(kv_tiles, kv_slots, two_pass, v_waits_for_release, load_time, slot_per, label=None):
    loads, ops, wait = kv_ring_schedule(kv_tiles, kv_slots, two_pass, v_waits_for_release, slot_per)
    ev = simulate_ring(loads, ops, load_time=load_time, wait_for_release=wait)
    what = (
        "stage 4, two passes (pass 1: K only; pass 2: K' then V)"
        if two_pass
        else "stage 5, one pass (online softmax)"
    )
    ring = (
        "Hopper: V_j into K_j's slot"
        if slot_per == "tile"
        else "Blackwell: one ring entry per load"
    )
    title = label or f"{what}; {ring}; kv_slots = {kv_slots}, KV tiles 0..{kv_tiles - 1}"
    if not v_waits_for_release:
        title += "\nRACY VARIANT: V_j is loaded without waiting for the release of K_j's slot"
    span = max(e for _, _, _, e, _ in ev["ops"])
    return (
        ev,
        kv_slots,
        ("TMA producer", "MMA", "softmax"),
        title + f" - done at t = {span:.1f}",
        _kv_color,
    )


_KV_NOTES = (
    ("a K tile (K' = pass 2)", C["k"]),
    ("a V tile", C["v"]),
    ("softmax: m,l = row max / sum; P = probabilities; a = rescale", C["softmax"]),
)


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
    With v_waits_for_release=False (the faulty first draft) V_j's load overlaps QK_j: a race."""
    panel = _kv_panel(kv_tiles, kv_slots, two_pass, v_waits_for_release, load_time, slot_per)
    return _timeline_figure([panel], notes=_KV_NOTES, path=path)


def kv_slot_timelines(variants, load_time=2.0, suptitle=None, path=None):
    """Several K/V ring schedules one above the other on one time axis, for comparison.
    variants: [dict(kv_tiles=..., kv_slots=..., two_pass=..., v_waits_for_release=...,
    slot_per=..., label=...)]."""
    panels = []
    for v in variants:
        v = dict(v)
        panels.append(
            _kv_panel(
                v.pop("kv_tiles", 3),
                v.pop("kv_slots", 2),
                v.pop("two_pass", True),
                v.pop("v_waits_for_release", True),
                v.pop("load_time", load_time),
                v.pop("slot_per", "tile"),
                v.pop("label", None),
            )
        )
        if v:
            raise TypeError(f"unknown keys {sorted(v)}")
    return _timeline_figure(panels, notes=_KV_NOTES, suptitle=suptitle, path=path)


# --------------------------------------------------------------------------------------------
# Register fragments (Hopper)
# --------------------------------------------------------------------------------------------


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
        _box(
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
        _box(ax, c, r, 1, 1, LANE_COLORS[thread % 4], lw=0)
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
            _box(
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
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 3.7))
    w, h = 2.2, 0.7
    for ci, (title, texts) in enumerate(cols):
        x = ci * 3.0
        ax.text(x + w / 2, -0.55, title, ha="center", fontsize=10)
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
                fontsize=9.5,
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
                    mutation_scale=9,
                    lw=0.9,
                    color=LANE_COLORS[src],
                )
            )
    for lane in range(4):
        ax.add_patch(
            FancyArrowPatch(
                (w, lane + h / 2), (3.0, lane + h / 2), arrowstyle="->", mutation_scale=9, lw=0.9
            )
        )
    ax.set_xlim(-0.2, 3 * 3.0 + w + 0.2)
    ax.set_ylim(4.0, -1.1)
    ax.axis("off")
    ax.set_title(
        f"row {op} over a quad: 2 shuffles, every lane ends with the same {s2[0]:g}", fontsize=11
    )
    return _finish(fig, path)


def p_register_path(n=32, thread=5, path=None):
    """Why P never leaves the registers on Hopper: the accumulator fragment of S = Q K^T (m64nNk16,
    fp32) restricted to columns 16 j .. 16 j + 15 puts every thread's values at exactly the
    (row, k) positions the register-sourced A operand of the next wgmma (P @ V, k-block j of 16)
    expects. Converting fp32 -> bf16 and packing pairs into 32-bit registers is all it takes:
    d[8 j + 2 u], d[8 j + 2 u + 1] -> 32-bit register u of k-block j."""
    kb = n // 16
    fig, axes = plt.subplots(2, 1, figsize=(FIG_WIDTH, 6.8))
    cmap = plt.get_cmap("tab10")
    c_mine = wgmma_c_coords(thread, n)
    a_mine = wgmma_a_coords(thread)
    for ax, title in zip(
        axes,
        (
            f"S = Q K^T: wgmma accumulator (fp32), warp 0 rows 0-15, columns 0-{n - 1}: thread {thread}'s registers d<v>",
            f"P as the A operand of O += P V: k-blocks of 16 keys (bf16 in registers): thread {thread}'s values a<v>",
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
                f"k-block {j}" if title.startswith("P") else f"cols {16 * j}-{16 * j + 15}",
                ha="center",
                fontsize=10,
                color=cmap(j % 10),
            )
        ax.set_xlim(0, n)
        ax.set_ylim(16, -1.4)
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
                fontsize=9,
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
                    fontsize=9,
                    tc="white",
                )
    fig.suptitle(
        f"thread {thread}: the same positions in both fragments, so P = bf16(exp2(...)) is used in "
        f"place\n(accumulator d[8j .. 8j+7] -> a0 .. a7 of k-block j)",
        fontsize=11,
    )
    return _finish(fig, path)


def vt_operand(keys=8, dims=8, row_bytes=128, path=None):
    """The B operand of the second GEMM. O = P V: M = query rows, N = D, K = keys, so the B operand
    is V^T, an (N, K) = (D, keys) matrix. TMA brings a V tile exactly as it brings a K tile - rows
    = keys, D contiguous (left). sVt is the same bytes viewed with the two modes swapped:
    element (d, key) of sVt is element (key, d) of sV (right). Along its N mode (d) the bytes are
    contiguous: wgmma calls that "MN-major" and reads it transposed for free - no copy, no
    transpose instruction. Cells show the byte offset of each element within the slot's first
    1 KB swizzle atom (8 rows of 64 bf16 = 128 bytes; before the swizzle, which permutes 16-byte
    chunks the same way in both views)."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(FIG_WIDTH, 5.4))

    def cell(a, x, y, off, col):
        _box(a, x, y, 1, 1, col, lw=0.4, alpha=0.85, text=f"{off}", fontsize=9)

    cmap = plt.get_cmap("tab10")
    for key in range(keys):
        for d in range(dims):
            off = key * row_bytes + 2 * d
            cell(ax, d, key, off, cmap(key % 10))
            cell(bx, key, d, off, cmap(key % 10))
    for a, (xl, yl, t) in zip(
        (ax, bx),
        (
            (
                "d (contiguous: +2 bytes)",
                "key (+ one row)",
                "sV (as TMA wrote it) = sKV[:, :, slot]: (keys, D), D-major\nthe layout of a K tile: B operand of S = Q K^T, K-major",
            ),
            (
                "key",
                "d (contiguous: +2 bytes)",
                "sVt = the same bytes, modes swapped: (D, keys)\nthe B operand (N = D, K = keys) of O = P V: MN-major",
            ),
        ),
    ):
        a.set_xlim(0, dims if a is ax else keys)
        a.set_ylim(keys if a is ax else dims, 0)
        a.set_aspect("equal")
        a.set_xlabel(xl, fontsize=10)
        a.set_ylabel(yl, fontsize=10)
        a.set_xticks(
            [i + 0.5 for i in range(dims if a is ax else keys)],
            [str(i) for i in range(dims if a is ax else keys)],
            fontsize=9,
        )
        a.set_yticks(
            [i + 0.5 for i in range(keys if a is ax else dims)],
            [str(i) for i in range(keys if a is ax else dims)],
            fontsize=9,
        )
        a.set_title(t, fontsize=10)
    fig.suptitle(
        f"Byte offsets of a {keys} x {dims} corner of a V tile (bf16, {row_bytes}-byte rows): the same "
        "bytes in both views - V^T costs nothing",
        fontsize=11,
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
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 3.9))
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
            fontsize=9,
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
            fontsize=9.5,
            color="black",
            fontweight="bold",
        )
    ax.text(
        alloc_cols + (total_cols - alloc_cols) / 2,
        lanes / 2,
        f"not allocated\n(tcgen05.alloc takes a power\nof 2 >= 32 columns: {alloc_cols})",
        ha="center",
        va="center",
        fontsize=9,
        color="#555555",
    )
    ax.set_xlim(-80, total_cols + 5)
    ax.set_ylim(lanes + 5, -5)
    ax.set_xticks([0, 64, 128, 192, 256, 320, 384, 448, 512])
    ax.tick_params(labelsize=9)
    ax.set_xlabel("TMEM column (32 bits each)", fontsize=10)
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
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 4.4))
    _box(
        ax,
        0,
        0,
        3.6,
        3.2,
        "#EDE1F5",
        text=f"warps 0-3 (128 threads,\none row per thread)\n\n{soft}",
        fontsize=10,
    )
    _box(ax, 4.9, 0, 2.5, 1.4, "#F6E3E3", text="TMEM\n(accumulators)", fontsize=10)
    _box(ax, 4.9, 1.8, 2.5, 1.4, "#E2F0D9", text="shared memory\n(swizzled tiles)", fontsize=10)
    _box(ax, 8.7, 0, 3.3, 1.4, "#FBE3D6", text=f"warp 4 (one thread issues)\n{mma}", fontsize=9.5)
    _box(ax, 8.7, 1.8, 3.3, 1.4, "#DCEAF7", text=f"warp 5 (one thread issues)\n{tma}", fontsize=9.5)
    _arrow(ax, (8.7, 2.5), (7.4, 2.5), "TMA loads", dy=-0.22)
    _arrow(ax, (7.4, 2.0), (8.7, 1.2), "operands", dy=0.0)
    _arrow(ax, (8.7, 0.5), (7.4, 0.5), "MMA writes", dy=-0.22)
    _arrow(
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
    return _finish(fig, path)


def tmem_two_tiles(cfg, title=None, path=None):
    """TMEM of Blackwell stages 8-9 from the kernel's own offsets (cfg: nb.kernel_config or the
    kernel's attributes): S_0, S_1, O_0, O_1 and P_0, P_1, either over S_s (hatched) or in
    columns of their own. Every region spans all 128 lanes: lane r is row r of both Q tiles."""
    D = cfg["pv_mma_tiler"][1]
    bN = cfg["qk_mma_tiler"][1]
    p_cells = bN // 2  # 16-bit P: two values per 32-bit cell
    regions = []
    for s in range(cfg["q_tiles"]):
        regions.append((f"S{s}", cfg["tmem_s_offset"][s], bN, "fp32", C["s"], False))
    for s in range(cfg["q_tiles"]):
        regions.append((f"O{s}", cfg["tmem_o_offset"][s], D, "fp32", C["o"], False))
    for s in range(cfg["q_tiles"]):
        over = cfg["tmem_p_offset"][s] == cfg["tmem_s_offset"][s]
        regions.append((f"P{s}", cfg["tmem_p_offset"][s], p_cells, "16-bit x2", C["p"], over))
    total = cfg.get("num_tmem_alloc_cols", 512)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 3.2))
    _box(ax, 0, 0, total, 128, "#FAFAFA", lw=0.8)
    for name, start, width, what, color, over in regions:
        _box(
            ax,
            start,
            0,
            width,
            128,
            color,
            alpha=0.45 if over else 0.75,
            hatch="///" if over else None,
            lw=1.5 if over else 0.8,
        )
        ax.text(
            start + width / 2,
            128 * (0.28 if over else 0.62),
            f"{name}\n{start}-{start + width - 1}\n{what}",
            ha="center",
            va="center",
            fontsize=9,
            fontweight="bold",
        )
    ax.set_xlim(-5, 517)
    ax.set_ylim(133, -5)
    ax.set_xticks(range(0, 513, 64))
    ax.set_yticks([0, 32, 64, 96, 128])
    ax.set_ylabel("lane (row)", fontsize=10)
    ax.set_xlabel("TMEM column (32 bits each)", fontsize=10)
    ax.set_title(
        title or f"TMEM of a CTA with two Q tiles, D = {D}: {total} columns allocated", fontsize=10
    )
    return _finish(fig, path)


def blackwell_two_tile_roles(cfg, title=None, path=None):
    """The 512-thread CTA of Blackwell stages 8-9 from the kernel's settings (cfg: warp ids,
    registers per warpgroup): which warps do what, and the hand-offs between them."""
    sm0, sm1 = cfg["softmax_warp_ids"]
    corr = cfg["correction_warp_ids"]
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 4.6))

    def warps(ids):
        return f"warps {ids[0]}-{ids[-1]}"

    reg = cfg.get("softmax_registers"), cfg.get("correction_registers"), cfg.get("other_registers")
    _box(
        ax,
        0,
        0,
        3.3,
        1.5,
        WARP_COLORS[3],
        text=f"softmax 0: {warps(sm0)}\nrows of Q tile 0\n{reg[0]} registers",
        fontsize=9.5,
    )
    _box(
        ax,
        0,
        1.9,
        3.3,
        1.5,
        WARP_COLORS[3],
        text=f"softmax 1: {warps(sm1)}\nrows of Q tile 1\n{reg[0]} registers",
        fontsize=9.5,
    )
    _box(
        ax,
        4.6,
        0.75,
        2.6,
        1.9,
        "#F6E3E3",
        text="TMEM\nS0 S1 (P over S\nor its own)\nO0 O1",
        fontsize=9.5,
    )
    _box(
        ax,
        8.6,
        0,
        3.4,
        1.5,
        WARP_COLORS[0],
        text=f"MMA: warp {cfg['mma_warp_id']} (one thread)\nQK0 QK1 PV0 PV1 ...\n"
        f"{reg[2]} registers (warpgroup 3)",
        fontsize=9.5,
    )
    _box(
        ax,
        8.6,
        1.9,
        3.4,
        1.5,
        WARP_COLORS[1],
        text=f"TMA: warp {cfg['tma_warp_id']}\nQ0, Q1 once; K, V ring\n({cfg['kv_slots']} slots)",
        fontsize=9.5,
    )
    _box(
        ax,
        4.3,
        3.0,
        3.2,
        1.3,
        WARP_COLORS[2],
        text=f"correction: {warps(corr)}\nrescale O_s, normalise,\nstore O (TMA), LSE; "
        f"{reg[1]} regs",
        fontsize=9.2,
    )
    _arrow(ax, (8.6, 0.75), (7.2, 1.2), "S_s ready", dy=-0.2)
    _arrow(ax, (4.6, 1.2), (3.3, 0.75), "tcgen05.ld S0", dy=-0.2)
    _arrow(ax, (3.3, 2.65), (4.6, 2.2), "tcgen05.st P1", dy=0.2)
    _arrow(ax, (3.3, 3.3), (4.3, 3.6), "row factor,\nsum, max (smem)", dy=0.0)
    _arrow(ax, (7.2, 2.3), (8.6, 0.9), "P_s ready", dy=0.15)
    _arrow(ax, (5.9, 3.0), (5.9, 2.65), None, style="<->")
    ax.text(6.05, 2.82, "O_s", fontsize=9)
    ax.text(
        0,
        4.55,
        f"idle warps {cfg['idle_warp_ids'][0]}-{cfg['idle_warp_ids'][-1]} only complete "
        "warpgroup 3: setmaxnreg acts on whole warpgroups",
        fontsize=9,
        va="top",
    )
    ax.set_xlim(-0.2, 12.2)
    ax.set_ylim(4.8, -0.3)
    ax.axis("off")
    ax.set_title(title or "Blackwell CTA with two Q tiles: 16 warps, 5 roles", fontsize=11)
    return _finish(fig, path)


def mma_issue_orders(orders, steps, notes=None, title=None, path=None):
    """The MMA warp's tcgen05.mma in program order, read from each stage's PTX (orders: [(label,
    string of Q / P per instruction: a QK step, a PV step)], as tests' mma_order gives them):
    one strip per stage, one box per GEMM (steps: instructions per GEMM, {"Q": D / 16, "P": 8},
    or one such dict per strip),
    QK in S's colour, PV in P's. notes: a line under each strip (which boxes are a loop body)."""
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 0.9 + 0.95 * len(orders)))
    width = 0
    for row, (label, seq) in enumerate(orders):
        per = steps[row] if isinstance(steps, (list, tuple)) else steps
        gemms, i = [], 0
        while i < len(seq):
            ch = seq[i]
            gemms.append(ch)
            i += per[ch]
        for x, ch in enumerate(gemms):
            _box(
                ax,
                x,
                row,
                0.92,
                0.6,
                C["s"] if ch == "Q" else C["p"],
                alpha=0.85,
                text="QK" if ch == "Q" else "PV",
                fontsize=9.5,
                tc="white",
            )
        width = max(width, len(gemms))
        ax.text(-0.2, row + 0.3, label, ha="right", va="center", fontsize=10)
        if notes and notes[row]:
            ax.text(0, row + 0.78, notes[row], ha="left", va="center", fontsize=9, color="#444444")
    ax.set_xlim(-2.2, max(width, 8) + 0.2)
    ax.set_ylim(len(orders) + 0.1, -0.3)
    ax.axis("off")
    ax.set_title(
        title or "The MMA warp's GEMMs in program order (read from each stage's PTX)", fontsize=10
    )
    return _finish(fig, path)


def o_rescale_handoff(d_slices=4, path=None):
    """Blackwell stage 5, KV tile j: where the O rescale sits between PV_(j-1) and PV_j, and who
    waits for whom (a model: durations illustrative).

    MMA warp (one thread): QK_j may start only once PV_(j-1) has completed, because S_j is written
    over P_(j-1)'s columns; after QK_j it waits for the softmax warps' "P ready" before PV_j.
    Softmax warps: wait for S_j (tcgen05.commit after QK_j), tcgen05.ld S_j, compute row_max,
    row_scale = exp2((m_old - m_new) * scale_log2), P_j = exp2(...); acquire "P free" (the
    commit after PV_(j-1): O now holds sum_(i<j) P_i V_i and P's columns may be overwritten);
    then, d_slices times, tcgen05.ld 32 columns of O, multiply by row_scale, tcgen05.st them back;
    tcgen05.st P_j over S; tcgen05.wait::st (both stores have landed); arrive on "P ready".
    Then PV_j adds P_j V_j to the rescaled O."""
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 5.8))
    names = [
        "MMA warp\n(tcgen05.mma)",
        "softmax warps\n0-3",
        "TMEM: S / P\ncolumns",
        "TMEM: O\ncolumns",
    ]
    ys = [0.0, 1.45, 2.55, 3.6]
    mma, sm, sp, oc = ys
    h = 0.62
    red = "#B22222"
    pv_prev, qk = (0.0, 1.2), (1.2, 2.4)
    ld_s, math_ = (2.4, 3.0), (3.0, 4.4)
    resc = (4.4, 6.4)
    st_p, wst = (6.4, 7.0), (7.0, 7.45)
    pv, qk_next = (7.55, 8.75), (8.75, 9.95)

    def bar(span, yy, label, fc, tc="white", **kw):
        _box(ax, span[0], yy - h / 2, span[1] - span[0], h, fc, text=label, fontsize=9, tc=tc, **kw)

    bar(pv_prev, mma, "PV_(j-1)", C["mma"])
    bar(qk, mma, "QK_j", C["mma"])
    bar(
        (qk[1], pv[0]),
        mma,
        "waits for P ready",
        C["wait"],
        tc="black",
        hatch="//",
        lw=0.3,
        alpha=0.6,
    )
    bar(pv, mma, "PV_j", C["mma"])
    bar(qk_next, mma, "QK_(j+1)", C["mma"])
    bar(ld_s, sm, "ld S_j", C["softmax"])
    bar(math_, sm, "max, exp2\n-> P_j (regs)", C["softmax"])
    bar(resc, sm, f"O *= a_j: {d_slices} x (tcgen05.ld\n32 columns, mul, tcgen05.st)", "#5E4FA2")
    sw = (resc[1] - resc[0]) / d_slices
    for i in range(1, d_slices):
        ax.plot([resc[0] + i * sw] * 2, [sm - h / 2, sm - h / 2 + 0.12], color="white", lw=1.5)
    bar(st_p, sm, "st P_j", C["softmax"])
    bar(wst, sm, "wait\n::st", C["softmax"])
    bar(pv_prev, sp, "P_(j-1)", C["p"], alpha=0.85)
    bar((qk[0], ld_s[1]), sp, "S_j (fp32)", C["s"], alpha=0.85)
    bar((st_p[0], pv[1]), sp, "P_j (bf16, over S)", C["p"], alpha=0.85)
    bar((pv_prev[0], resc[0]), oc, "O = sum_(i<j) P_i V_i, relative to m_(j-1)", C["o"], alpha=0.8)
    bar(resc, oc, "being rescaled", C["o"], tc="black", alpha=0.4, hatch="//")
    bar((resc[1], pv[0]), oc, "a_j O", C["o"], alpha=0.8)
    bar(pv, oc, "+= P_j V_j", C["o"])

    def sync(p0, p1, text, tx, ty, ha="center"):
        ax.add_patch(
            FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=14, lw=1.7, color=red)
        )
        ax.text(tx, ty, text, fontsize=9, color=red, ha=ha, va="center")

    sync(
        (qk[1], mma + h / 2),
        (ld_s[0] + 0.08, sm - h / 2),
        "S full: commit\nafter QK_j",
        2.25,
        0.72,
        ha="right",
    )
    sync(
        (pv_prev[1] - 0.1, mma + h / 2),
        (resc[0] + 0.05, sm - h / 2),
        "P free: commit after PV_(j-1)\n(O complete, P's columns free)",
        4.25,
        0.62,
        ha="left",
    )
    sync(
        (wst[1], sm - h / 2),
        (pv[0] + 0.1, mma + h / 2),
        "P ready: 128\narrives",
        7.75,
        0.78,
        ha="left",
    )
    ax.annotate(
        "QK_j starts after PV_(j-1) completes: S_j is written over P_(j-1)'s columns",
        xy=(qk[0], mma - h / 2),
        xytext=(0.0, -0.78),
        fontsize=9,
        color=red,
        arrowprops=dict(arrowstyle="->", color=red, lw=1.0),
    )
    ax.set_yticks(ys, names, fontsize=10)
    ax.set_ylim(ys[-1] + 0.55, -1.05)
    ax.set_xlim(-0.1, qk_next[1] + 0.1)
    ax.set_xticks([])
    ax.set_xlabel(
        "time -> (a model of one KV tile j; red: mbarrier hand-offs, who waits for whom)",
        fontsize=10,
    )
    ax.set_title(
        "Blackwell stage 5: O is rescaled in TMEM by the softmax warps between PV_(j-1) and PV_j",
        fontsize=11,
    )
    return _finish(fig, path)


# --------------------------------------------------------------------------------------------
# Softmax
# --------------------------------------------------------------------------------------------


def online_softmax_trace(scores, tile=4, path=None):
    """One row of scores processed tile by tile (tiles numbered from 0, as in the table of the
    notebook): running max m (steps), the rescale factor alpha = exp(m_old - m_new) applied to l
    and O whenever a tile raises m, and the running sum l. `scores` are the already scaled logits
    of the row (a 1-D sequence of floats)."""
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
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(FIG_WIDTH, 4.0))
    ax.bar(range(n), s, color=[plt.get_cmap("tab10")(i // tile % 10) for i in range(n)], alpha=0.6)
    for j, ((a, b), mm, al) in enumerate(zip(edges, ms, alphas)):
        ax.plot([a - 0.4, b - 0.6], [mm, mm], color="black", lw=2)
        txt = f"tile {j}\nm={mm:.2f}\n" + ("alpha=0" if a == 0 else f"alpha={al:.3f}")
        ax.text(
            (a + b - 1) / 2,
            max([mm, 0.0] + s[a:b]) + 0.15,
            txt,
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_ylim(min(0.0, min(s)) - 0.3, max(s) + 0.45 * (max(s) - min(0.0, min(s))) + 0.6)
    ax.set_xlabel("column (key)", fontsize=10)
    ax.set_ylabel("score", fontsize=10)
    ax.tick_params(labelsize=9)
    ax.set_title("running max m after each tile, alpha = exp(m_old - m_new)", fontsize=10)
    bx.plot(range(len(ls)), ls, marker="o")
    for i, v in enumerate(ls):
        bx.text(i, v, f" {v:.3f}", fontsize=9)
    bx.set_xticks(range(len(ls)), [f"after tile {j}" for j in range(len(ls))], fontsize=9)
    bx.set_ylabel("l (running sum, relative to the current m)", fontsize=10)
    bx.tick_params(labelsize=9)
    bx.set_title(
        f"final l = {ls[-1]:.4f}; LSE = m + log(l) = {ms[-1] + math.log(ls[-1]):.4f}", fontsize=10
    )
    bx.grid(alpha=0.3)
    return _finish(fig, path)


# --------------------------------------------------------------------------------------------
# Errors and benchmarks
# --------------------------------------------------------------------------------------------


def error_heatmap(out, ref, title="|out - ref|", max_side=256, path=None):
    """|out - ref| over one 2-D slice (the last two dims), log colour scale, the worst element
    circled. For a batched output (B, H, rows, cols) the slice shown is the (b, h) that holds the
    worst element of the whole tensor, named in the title, so that the circle and the checker's
    'worst element' are the same element. Large slices are max-pooled down to max_side."""
    import torch

    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    full = (o - r).abs()
    full = torch.where(torch.isfinite(full), full, torch.full_like(full, float("inf")))
    worst = tuple(
        int(i) for i in torch.unravel_index(torch.argmax(full.nan_to_num(posinf=1e300)), full.shape)
    )
    lead = worst[:-2]
    where = ""
    if lead:
        names = ("b", "h")[: len(lead)] if len(lead) <= 2 else [f"d{i}" for i in range(len(lead))]
        where = (
            "slice "
            + ", ".join(f"{n} = {v}" for n, v in zip(names, lead))
            + f" of {' x '.join(str(s) for s in full.shape[:-2])} (the one holding the worst element)"
        )
    err = full[lead] if lead else full
    rows, cols = err.shape
    f = max(1, -(-max(rows, cols) // max_side))
    if f > 1:
        pooled = torch.nn.functional.max_pool2d(
            err[None, None].nan_to_num(posinf=1e30), f, ceil_mode=True
        )[0, 0]
    else:
        pooled = err
    fig, ax = plt.subplots(figsize=(7.5, min(7.5, max(3.6, 6.0 * rows / max(cols, 1)))))
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
    wr, wc = worst[-2], worst[-1]
    ax.plot(wc + 0.5, wr + 0.5, marker="o", mfc="none", mec="red", ms=14, mew=2)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("absolute error", fontsize=10)
    cb.ax.tick_params(labelsize=9)
    ax.set_xlabel("column", fontsize=10)
    ax.set_ylabel("row", fontsize=10)
    ax.tick_params(labelsize=9)
    pooled_note = f" (max-pooled {f}x{f})" if f > 1 else ""
    ax.set_title(
        f"{title}{pooled_note}\n"
        + (where + "\n" if where else "")
        + f"worst at {worst}: {float(full[worst]):.3e} (circled)",
        fontsize=10,
    )
    return _finish(fig, path)


def bench_bars(results, title, path=None):
    """results: {shape label: {name: TFLOP/s}} -> grouped bars, the stage's own bars first. Every
    kernel has the colour of KERNEL_COLORS in every notebook; a variant of a stage is hatched."""
    shapes = list(results)
    names = []
    for res in results.values():
        for k in res:
            if k not in names:
                names.append(k)
    names = [k for k in names if k.startswith("stage")] + [
        k for k in names if not k.startswith("stage")
    ]
    fig, ax = plt.subplots(
        figsize=(min(FIG_WIDTH, max(6.5, 1.1 * len(shapes) * len(names) + 2)), 4.3)
    )
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [si + i * width for si in range(len(shapes))]
        ys = [results[s].get(name, 0.0) for s in shapes]
        variant = name.startswith("stage") and name not in KERNEL_COLORS
        bars = ax.bar(
            xs,
            ys,
            width,
            label=name,
            color=kernel_color(name),
            hatch="//" if variant else None,
            edgecolor="white" if variant else None,
        )
        for x, v in zip(xs, ys):
            if v:
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
        if name.startswith("stage"):
            for b in bars:
                b.set_edgecolor("black")
                b.set_linewidth(1.5)
    ax.set_xticks([si + 0.4 - width / 2 for si in range(len(shapes))], shapes, fontsize=9)
    ax.set_ylabel("TFLOP/s", fontsize=10)
    ax.tick_params(axis="y", labelsize=9)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return _finish(fig, path)


def plot_attention_bench(curves, title, path=None):
    """curves: {(D, label): [(S, tflops), ...]} -> one panel per head dim, TFLOP/s against S, each
    kernel in its KERNEL_COLORS colour."""
    dims = sorted({d for d, _ in curves})
    fig, axes = plt.subplots(
        1, len(dims), figsize=(min(FIG_WIDTH * 1.2, 6 * len(dims)), 4), squeeze=False
    )
    for ax, D in zip(axes[0], dims):
        for (d, label), pts in sorted(curves.items(), key=lambda kv: kv[0][1]):
            if d != D:
                continue
            xs, ys = zip(*pts)
            ax.plot(
                xs,
                ys,
                marker="o",
                label=label,
                color=kernel_color(label),
                linewidth=2.5 if label.startswith("stage") else 1.2,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S", fontsize=10)
        ax.set_ylabel("TFLOP/s", fontsize=10)
        ax.set_title(f"D = {D}", fontsize=11)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def plot_ablation(rows, title, path=None):
    """The stage 5 -> 8 -> 9 ablation of `make bench` (rows of stage "ablation": shape (B, H, S,
    S, D, causal) and TFLOP/s per kernel; stage 7 where the run has it): one panel per (D,
    causal), TFLOP/s against S, the
    stages thick and the baselines (FA4, SDPA cuDNN) thin."""
    rows = [r for r in rows if r["stage"] == "ablation"]
    panels = sorted({(r["shape"][4], bool(r["shape"][5])) for r in rows})
    fig, axes = plt.subplots(
        1, len(panels), figsize=(min(FIG_WIDTH * 1.4, 4.2 * len(panels)), 3.8), squeeze=False
    )
    names = ("stage 5", "stage 7", "stage 8", "stage 9", "FA4", "SDPA cuDNN")
    for ax, (D, causal) in zip(axes[0], panels):
        mine = sorted(
            (r for r in rows if (r["shape"][4], bool(r["shape"][5])) == (D, causal)),
            key=lambda r: r["shape"][2],
        )
        for name in names:
            pts = [(r["shape"][2], r["tflops"][name]) for r in mine if name in r["tflops"]]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(
                xs,
                ys,
                marker="o",
                label=name,
                color=kernel_color(name),
                linewidth=2.5 if name.startswith("stage") else 1.2,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S", fontsize=10)
        ax.set_ylabel("TFLOP/s", fontsize=10)
        ax.set_title(f"D = {D}, {'causal' if causal else 'non-causal'}", fontsize=11)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def _tflops_against_s(panels, styles, title, path, panel_width=4.6, legend=None):
    """The figure the stage 9 measurements share: one panel per (panel title, rows), TFLOP/s
    (GPU time) against S on a log2 axis, one line per styles entry {row key: (label, colour,
    width)} where the rows have that key."""
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(min(FIG_WIDTH * 1.4, panel_width * len(panels)), 3.6),
        squeeze=False,
    )
    for ax, (panel_title, rows) in zip(axes[0], panels):
        rows = sorted(rows, key=lambda r: r["S"])
        for name, (label, color, width) in styles.items():
            pts = [(r["S"], r[name]) for r in rows if name in r]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=label, color=color, linewidth=width)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S (B x S = 16k)", fontsize=10)
        ax.set_ylabel("TFLOP/s (GPU time)", fontsize=10)
        ax.set_title(panel_title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(**(legend or dict(fontsize=8)))
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def persistent_ctas(rows, title=None, path=None):
    """Stage 9's persistent CTAs as measured (rows of docs/results/
    bench_h200_2026-12-01_persistent.json: D, S, causal and TFLOP/s per variant): one panel per
    (D, causal), TFLOP/s against S for the kernel before the tile loop ("before"), with it
    ("persistent": capped grid where tiles have equal work), the capped grid forced on causal
    ("forced persistent") and FA4."""
    keys = sorted({(r["D"], bool(r["causal"])) for r in rows}, key=lambda p: (-p[0], p[1]))
    panels = [
        (
            f"D = {D}, {'causal' if causal else 'non-causal'} "
            f"({'one CTA per tile' if causal else 'grid capped'})",
            [r for r in rows if (r["D"], bool(r["causal"])) == (D, causal)],
        )
        for D, causal in keys
    ]
    styles = {
        "before": ("one CTA per tile (before the loop)", "#8C8C8C", 2.0),
        "persistent": ("stage 9 with the tile loop", kernel_color("stage 9"), 2.5),
        "forced persistent": ("capped grid forced on", "#C44E52", 1.5),
        "FA4": ("FA4", kernel_color("FA4"), 1.2),
    }
    return _tflops_against_s(
        panels, styles, title or "Stage 9 with and without persistent CTAs", path, 4.2
    )


def stage8_persistent(rows, title=None, path=None):
    """Stage 8's persistent CTAs as measured (rows of docs/results/
    stage8_persistent_h200_2026-12-02.json: dtype, D, S, causal and TFLOP/s per variant): one
    panel per (D, causal) in bf16, TFLOP/s against S for stage 8 before (one CTA per tile),
    stage 8 persistent, the new tile order on one CTA per tile, stage 9 and FA4."""
    mine = [r for r in rows if r.get("dtype", "bf16") == "bf16"]
    keys = sorted({(r["D"], bool(r["causal"])) for r in mine}, key=lambda p: (p[0], not p[1]))
    panels = [
        (
            f"D = {D}, {'causal' if causal else 'non-causal'}",
            [r for r in mine if (r["D"], bool(r["causal"])) == (D, causal)],
        )
        for D, causal in keys
    ]
    styles = {
        "before": ("stage 8 before (one CTA per tile)", "#8C8C8C", 2.0),
        "one CTA per tile": ("new tile order, one CTA per tile", "#C44E52", 1.2),
        "persistent": ("stage 8 persistent (now)", kernel_color("stage 8"), 2.5),
        "stage 9": ("stage 9", kernel_color("stage 9"), 1.2),
        "FA4": ("FA4", kernel_color("FA4"), 1.2),
    }
    default = "Stage 8 with and without persistent CTAs"
    return _tflops_against_s(panels, styles, title or default, path, 3.6, legend=dict(fontsize=6))


def dynamic_tiles(rows, title=None, path=None):
    """Stage 9's dynamic tile scheduler as measured (rows of docs/results/
    dynamic_h200_2026-12-01.json: D, S, causal and TFLOP/s per variant): one panel per D, causal
    rows only, TFLOP/s against S for one CTA per tile, the dynamic scheduler and FA4."""
    mine = [r for r in rows if r["causal"]]
    panels = [
        (f"D = {D}, causal", [r for r in mine if r["D"] == D])
        for D in sorted({r["D"] for r in mine}, reverse=True)
    ]
    styles = {
        "one CTA per tile": ("one CTA per tile (before)", "#8C8C8C", 2.0),
        "dynamic": ("dynamic scheduler (stage 9 now)", kernel_color("stage 9"), 2.5),
        "FA4": ("FA4", kernel_color("FA4"), 1.2),
    }
    default = "Stage 9 causal: one CTA per tile against the dynamic tile scheduler"
    return _tflops_against_s(panels, styles, title or default, path)


def packed_tiles(rows, title=None, path=None):
    """Stage 9 on packed sequences, one CTA per tile against the persistent grid with tiles
    drawn at run time, as measured (rows of docs/results/varlen_dynamic_h200_2026-12-01.json:
    batch, causal and [GPU-time, event-timed] TFLOP/s per kernel): bars of GPU-time TFLOP/s per
    (batch, causal), stage 8 and FA4 beside them."""
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 3.8))
    styles = {
        "stage 8": ("stage 8", kernel_color("stage 8")),
        "stage 9 per tile": ("stage 9, one CTA per tile", "#8C8C8C"),
        "stage 9 dynamic": (
            "stage 9, persistent, tiles drawn at run time",
            kernel_color("stage 9"),
        ),
        "FA4": ("FA4 varlen", kernel_color("FA4")),
    }
    names = [n for n in styles if any(n in r["tflops_gpu_event"] for r in rows)]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(rows))]
        ys = [r["tflops_gpu_event"].get(name, [0.0])[0] for r in rows]
        label, color = styles[name]
        ax.bar(xs, ys, width, label=label, color=color)
    groups = [f"{r['batch']}\n{'causal' if r['causal'] else 'non-causal'}" for r in rows]
    ax.set_xticks(range(len(rows)), groups, fontsize=_fs(9))
    ax.set_ylabel("useful TFLOP/s (GPU time)", fontsize=_fs(10))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=_fs(8), loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    ax.set_title(title or "Stage 9 on packed sequences: one CTA per tile against persistent CTAs")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def consumer_warpgroups(rows, title=None, path=None):
    """Stage 9 at D = 64 with three consumer warpgroups (192-row Q tile) and two (128 rows), as
    measured (rows of docs/results/bench_h200_2026-12-01_3wg.json: D, S, causal, dtype and
    TFLOP/s per kernel, "3wg", "2wg", "stage8", "FA4"): one panel per causal setting, bf16 and
    D = 64 only, TFLOP/s against S."""
    mine = [r for r in rows if r["D"] == 64 and r.get("dtype", "bfloat16") == "bfloat16"]
    panels = [
        (
            f"D = 64, {'causal' if causal else 'non-causal'}",
            [r for r in mine if bool(r["causal"]) == causal],
        )
        for causal in sorted({bool(r["causal"]) for r in mine})
    ]
    styles = {
        "3wg": ("stage 9, three consumer warpgroups (192 rows)", kernel_color("stage 9"), 2.5),
        "2wg": ("stage 9, two (128 rows)", "#8C8C8C", 2.0),
        "stage8": ("stage 8", kernel_color("stage 8"), 1.2),
        "FA4": ("FA4", kernel_color("FA4"), 1.2),
    }
    default = "Stage 9 at D = 64: three consumer warpgroups against two"
    legend = dict(fontsize=7, loc="lower right")
    return _tflops_against_s(panels, styles, title or default, path, legend=legend)


# --------------------------------------------------------------------------------------------
# Stage 6: masks over (query tile, key tile)
# --------------------------------------------------------------------------------------------

# The three classes of common.masks.tile_map, one colour each in every picture.
TILE_CLASS_COLORS = {0: "#F2F2F2", 1: "#F2C14E", 2: "#4C72B0"}
TILE_CLASS_NAMES = {
    0: "skipped: neither loaded nor multiplied",
    1: "partial: loaded, element mask applied",
    2: "full: stage 5's loop body, no mask",
}


def mask_tile_maps(cases, bM=128, bN=128, path=None):
    """One panel per case (title, Sq, Sk, causal, window): the (Q tile, KV tile) grid as the
    kernel classifies it (common.masks.tile_map: skipped, partial, full), tiles numbered from 0,
    with the band's two edges drawn in element coordinates (dashed: the first key a row sees,
    j = i + band_lo; solid: one past the last, j = i + band_hi + 1) and the end of the keys
    (dotted, where Sk is not a tile multiple)."""
    from common import masks

    tallest = max(-(-Sq // bM) / -(-Sk // bN) for _, Sq, Sk, _, _ in cases)
    height = min(8.0, FIG_WIDTH / len(cases) * 0.62 * max(1.0, tallest) + 2.4)
    fig, axes = plt.subplots(1, len(cases), figsize=(FIG_WIDTH, height), squeeze=False)
    for ax, (title, Sq, Sk, causal, window) in zip(axes[0], cases):
        left, right = masks.resolve_window(causal, window, Sq, Sk)
        tiles = masks.tile_map(Sq, Sk, left, right, bM, bN)
        counts = masks.tile_counts(Sq, Sk, left, right, bM, bN)
        q_tiles, kv_tiles = tiles.shape
        for m in range(q_tiles):
            for n in range(kv_tiles):
                _box(ax, n, m, 1, 1, TILE_CLASS_COLORS[int(tiles[m, n])], lw=0.5)
        band_lo, band_hi = Sk - Sq - left, Sk - Sq + right
        for d, style in ((band_lo, "--"), (band_hi + 1, "-")):
            ax.plot([d / bN, (Sq + d) / bN], [0, Sq / bM], color="black", lw=1.4, ls=style)
        if Sk % bN:
            ax.plot([Sk / bN] * 2, [0, q_tiles], color="black", lw=1.2, ls=":")
        if Sq % bM:
            ax.plot([0, kv_tiles], [Sq / bM] * 2, color="black", lw=1.2, ls=":")
        ax.set_xlim(0, kv_tiles)
        ax.set_ylim(q_tiles, 0)
        ax.set_aspect("equal")
        step = max(1, kv_tiles // 8)
        ax.set_xticks(
            [n + 0.5 for n in range(0, kv_tiles, step)], [str(n) for n in range(0, kv_tiles, step)]
        )
        step = max(1, q_tiles // 8)
        ax.set_yticks(
            [m + 0.5 for m in range(0, q_tiles, step)], [str(m) for m in range(0, q_tiles, step)]
        )
        ax.tick_params(labelsize=9)
        ax.set_xlabel(f"KV tile ({bN} keys)", fontsize=9)
        ax.set_ylabel(f"Q tile ({bM} rows)", fontsize=9)
        ax.set_title(
            f"{title}\nSq = {Sq}, Sk = {Sk}\n{counts['full']} full, {counts['partial']} partial, "
            f"{counts['skipped']} skipped",
            fontsize=9.5,
        )
    handles = [
        Patch(facecolor=TILE_CLASS_COLORS[c], edgecolor="black", label=TILE_CLASS_NAMES[c])
        for c in (2, 1, 0)
    ]
    handles += [
        Line2D([], [], color="black", ls="--", label="first key a row sees (j = i + band_lo)"),
        Line2D([], [], color="black", ls="-", label="last key a row sees (j = i + band_hi)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False)
    return _finish(fig, path, rect=(0, 0.65 / height, 1, 1))


def mask_alignment(shapes=((4, 7), (7, 4)), path=None):
    """The two causal conventions element by element, for each (Sq, Sk) in `shapes`: top-left
    (SDPA's is_causal: row i sees keys j <= i) and bottom-right (FlashAttention's and this
    tutorial's: j <= i + Sk - Sq, so the last row sees every key). Rows that see no key are
    hatched: their O is 0 and their LSE -inf in the kernels."""
    fig, axes = plt.subplots(
        len(shapes),
        2,
        figsize=(min(FIG_WIDTH, 9.5), 0.42 * sum(sq for sq, _ in shapes) + 1.6 * len(shapes)),
        squeeze=False,
    )
    for r, (Sq, Sk) in enumerate(shapes):
        rules = (
            ("top-left (SDPA is_causal=True)", lambda i, j: j <= i, "j <= i"),
            (
                "bottom-right (FlashAttention, this tutorial)",
                lambda i, j: j <= i + Sk - Sq,
                f"j <= i + {Sk - Sq}" if Sk >= Sq else f"j <= i - {Sq - Sk}",
            ),
        )
        for c, (name, sees, rule) in enumerate(rules):
            ax = axes[r, c]
            for i in range(Sq):
                none = not any(sees(i, j) for j in range(Sk))
                for j in range(Sk):
                    _box(
                        ax,
                        j,
                        i,
                        1,
                        1,
                        C["q"] if sees(i, j) else C["free"],
                        lw=0.6,
                        hatch="//" if none else None,
                        ec=C["race"] if none else "black",
                    )
                if none:
                    ax.text(Sk + 0.15, i + 0.5, "no key", fontsize=9, va="center", color=C["race"])
            ax.set_xlim(0, Sk + 1.6)
            ax.set_ylim(Sq, 0)
            ax.set_aspect("equal")
            ax.set_xticks([j + 0.5 for j in range(Sk)], [str(j) for j in range(Sk)])
            ax.set_yticks([i + 0.5 for i in range(Sq)], [str(i) for i in range(Sq)])
            ax.tick_params(labelsize=9, length=0)
            for side in ("top", "right", "bottom", "left"):
                ax.spines[side].set_visible(False)
            ax.set_xlabel("key j", fontsize=9)
            ax.set_ylabel("query row i", fontsize=9)
            ax.set_title(f"{name}\nSq = {Sq}, Sk = {Sk}: {rule}", fontsize=9.5)
    return _finish(fig, path)


# --------------------------------------------------------------------------------------------
# Stage 7: GQA heads, packed sequences, the CTA grid of a ragged batch
# --------------------------------------------------------------------------------------------


def gqa_head_map(H=32, Hkv=8, path=None):
    """Which KV head each query head reads: h // (H / Hkv), as SDPA's enable_gqa. The group of
    H / Hkv query heads that share a KV head has one colour; their CTAs read the same K and V
    tiles (TMA coordinates, no copy), which L2 serves after the first read."""
    if H % Hkv:
        raise ValueError(f"H = {H} is not a multiple of Hkv = {Hkv}")
    group = H // Hkv
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 3.2))
    colors = ("#DCEAF7", "#FBE3D6", "#E2F0D9", "#EDE1F5")
    for h in range(H):
        _box(ax, h + 0.05, 0, 0.9, 0.8, colors[(h // group) % 4], lw=0.6, text=str(h), fontsize=9)
    for g in range(Hkv):
        x0 = g * group + 0.1
        _box(
            ax,
            x0,
            2.2,
            group - 0.2,
            0.8,
            colors[g % 4],
            lw=0.9,
            text=f"KV head {g}" if group >= 2 else str(g),
            fontsize=9,
        )
        for h in range(g * group, (g + 1) * group):
            ax.plot([h + 0.5, x0 + (group - 0.2) / 2], [0.8, 2.2], color=C["grid"], lw=0.7)
    ax.text(-0.3, 0.4, "query\nheads", ha="right", va="center", fontsize=9)
    ax.text(-0.3, 2.6, "K / V\nheads", ha="right", va="center", fontsize=9)
    ax.set_xlim(-2.2, H + 0.2)
    ax.set_ylim(3.4, -0.9)
    ax.axis("off")
    ax.set_title(
        f"GQA with H = {H} query heads and Hkv = {Hkv} KV heads: query head h reads KV head "
        f"h // {group}\n({'MQA: ' if Hkv == 1 else ''}each K/V tile is read by {group} CTAs, one "
        "per query head of its group; nothing is copied or expanded)",
        fontsize=10,
    )
    return _finish(fig, path)


def varlen_cta_map(
    lens_q, lens_k=None, heads=2, bM=128, bN=128, causal=False, window=None, path=None
):
    """The CTA grid of a packed batch: one CTA per (Q tile, head, sequence), as many Q tiles per
    sequence as the longest has (grid = (ceil(max_seqlen_q / bM), H, sequences)). Each cell gives
    the number of KV tiles that CTA computes (its kv_tile_range, per-sequence lengths and mask);
    hatched cells start past their sequence's end: an empty range, no K or V loaded, nothing
    stored (the CTA still loads its Q tile). Dotted
    cells are a sequence's last Q tile, whose rows past the end are not stored. `heads` of the
    H heads are drawn (every head has the same picture)."""
    from common import masks

    lens_k = list(lens_q) if lens_k is None else list(lens_k)
    n_seq = len(lens_q)
    q_tiles = max(1, -(-max(lens_q) // bM))
    rows = [(b, h) for b in range(n_seq) for h in range(heads)]
    fig, ax = plt.subplots(figsize=(min(FIG_WIDTH, 4.2 + 0.9 * q_tiles), 1.9 + 0.34 * len(rows)))
    cmap = plt.get_cmap("Blues")
    most = 1
    work = {}
    for b in range(n_seq):
        Sq, Sk = lens_q[b], lens_k[b]
        for m in range(q_tiles):
            if m * bM >= Sq:
                work[b, m] = None
                continue
            left, right = masks.resolve_window(causal, window, Sq, Sk)
            lo, hi = masks.kv_tile_range(m, Sq, Sk, left, right, bM, bN)
            work[b, m] = hi - lo
            most = max(most, hi - lo)
    busy = 0
    for y, (b, h) in enumerate(rows):
        for m in range(q_tiles):
            w = work[b, m]
            if w is None:
                _box(ax, m, y, 1, 1, "#EEEEEE", lw=0.5, hatch="//", text="-", fontsize=9)
                continue
            busy += 1
            last = (m + 1) * bM > lens_q[b]
            shade = 0.15 + 0.6 * w / most
            _box(
                ax,
                m,
                y,
                1,
                1,
                cmap(shade),
                lw=1.4 if last else 0.5,
                ls=":" if last else "-",
                text=str(w),
                fontsize=9,
                tc="white" if shade > 0.5 else "black",
            )
    ax.set_xlim(0, q_tiles)
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([m + 0.5 for m in range(q_tiles)], [str(m) for m in range(q_tiles)])
    ax.set_yticks(
        [y + 0.5 for y in range(len(rows))],
        [f"seq {b} (Sq={lens_q[b]}, Sk={lens_k[b]}) h{h}" for b, h in rows],
    )
    ax.tick_params(labelsize=9)
    ax.set_xlabel(f"Q tile ({bM} rows): blockIdx.x", fontsize=9)
    mask = "causal" if causal else ("window " + str(window) if window else "no mask")
    ax.set_title(
        f"grid = ({q_tiles}, H, {n_seq}); {mask}. Drawn: {heads} head(s) per sequence.\n"
        f"{busy} of {len(rows) * q_tiles} CTAs have work (number: KV tiles computed); "
        "hatched: empty range, no K/V, nothing stored",
        fontsize=9.5,
    )
    handles = [
        Patch(facecolor="#EEEEEE", hatch="//", edgecolor="black", label="past the sequence's end"),
        Patch(
            facecolor=cmap(0.4),
            edgecolor="black",
            ls=":",
            lw=1.4,
            label="last Q tile: rows past the end not stored",
        ),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig_h = fig.get_size_inches()[1]
    return _finish(fig, path, rect=(0, 0.45 / fig_h, 1, 1))


def packed_rows(lens, bM=128, path=None):
    """Packed sequences (FlashAttention's varlen layout) along the token axis, and the Q tiles of
    each sequence under it: tile m of sequence b covers packed rows cu_seqlens[b] + bM m onwards.
    TMA clips a tile only at the packed tensor's end (total rows), so the part of a last tile
    past its sequence reads the next sequence's rows (hatched): those Q rows are computed and
    never stored, those keys are masked to -inf and those V rows zeroed in shared memory."""
    lens = list(lens)
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    total = offs[-1]
    n_seq = len(lens)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 2.0 + 0.55 * n_seq))
    unit = max(total, 1) / 10.0
    colors = ("#DCEAF7", "#FBE3D6", "#E2F0D9", "#EDE1F5")
    for b, n in enumerate(lens):
        if n:
            _box(
                ax,
                offs[b],
                0,
                n,
                0.8,
                colors[b % 4],
                lw=0.8,
                text=f"seq {b}: {n}" if n > 0.6 * unit else str(b),
                fontsize=9,
            )
    ax.text(-0.02 * total, 0.4, "packed\nrows", ha="right", va="center", fontsize=9)
    for b, n in enumerate(lens):
        y = 1.3 + 0.65 * b
        tiles = -(-n // bM)
        for m in range(tiles):
            a = offs[b] + m * bM
            inside = min(a + bM, offs[b + 1]) - a
            _box(
                ax,
                a,
                y,
                inside,
                0.5,
                colors[b % 4],
                lw=0.6,
                text=f"tile {m}" if inside > 0.5 * unit else None,
                fontsize=9,
            )
            beyond = min(a + bM, total) - (a + inside)
            if beyond > 0:
                _box(ax, a + inside, y, beyond, 0.5, "#FFFFFF", ec=C["race"], lw=1.0, hatch="//")
            if a + bM > total:
                _box(
                    ax,
                    min(a + inside + beyond, total),
                    y,
                    a + bM - max(total, a + inside),
                    0.5,
                    "none",
                    ec=C["grid"],
                    lw=0.8,
                    ls=":",
                )
        ax.text(-0.02 * total, y + 0.25, f"seq {b}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-0.16 * total, total + bM + 0.02 * total)
    ax.set_ylim(1.3 + 0.65 * n_seq + 0.1, -0.3)
    ax.set_yticks([])
    ticks = [0]
    for o in offs[1:]:
        if o - ticks[-1] < 0.04 * max(total, 1) and o == total and len(ticks) > 1:
            ticks.pop()
        if o - ticks[-1] >= 0.04 * max(total, 1) or o == total:
            ticks.append(o)
    ax.set_xticks(ticks, [str(o) for o in ticks])
    ax.tick_params(labelsize=9)
    ax.set_xlabel("packed row (cu_seqlens marked)", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        f"{n_seq} packed sequences, {total} rows, Q tiles of {bM}: TMA clips only at row {total}",
        fontsize=10,
    )
    handles = [
        Patch(
            facecolor="white",
            edgecolor=C["race"],
            hatch="//",
            label="read by TMA, belongs to the next sequence",
        ),
        Patch(
            facecolor="none",
            edgecolor=C["grid"],
            ls=":",
            label="past the tensor: clipped by TMA (zeros)",
        ),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig_h = fig.get_size_inches()[1]
    return _finish(fig, path, rect=(0, 0.4 / fig_h, 1, 1))


# --------------------------------------------------------------------------------------------
# Stage 8: warp roles and the ping-pong schedule (Hopper)
# --------------------------------------------------------------------------------------------


def warp_specialized_roles(
    threads=384,
    load_registers=24,
    mma_registers=240,
    kv_slots=6,
    mma_warpgroups=2,
    cta_tile=(128, 128, 128),
    register_file=65536,
    path=None,
):
    """Stage 8's CTA (the arguments are the kernel's own settings, nb.kernel_config(8)):
    warpgroup 0 the TMA producer (its warp 0 issues every load; setmaxnreg.dec to
    load_registers), warpgroups 1 .. mma_warpgroups the consumers (64 query rows each;
    setmaxnreg.inc to mma_registers; two, or three at D = 64); the K/V ring of kv_slots slots,
    ring entry 2 t = K of step t, 2 t + 1 its V, entry e in slot e % kv_slots; the register file
    split below."""
    bM, bN, D = cta_tile
    rows = bM // mma_warpgroups
    at_entry = register_file // threads // 8 * 8
    # the consumer boxes: 1.7 apart (two) or 1.25 (three), the register file below the last
    step, height = (1.7, 1.4) if mma_warpgroups <= 2 else (1.25, 1.1)
    y_regs = 2.0 + step * (mma_warpgroups - 1) + height + 0.5
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 6.2 * (y_regs + 1.9) / 7.5))
    _box(
        ax,
        0,
        0,
        3.4,
        1.5,
        "#DCEAF7",
        text=f"warpgroup 0: producer (warps 0-3)\nwarp 0, one thread: TMA loads\nwarps 1-3: no work\nsetmaxnreg.dec -> {load_registers} registers",
        fontsize=9.5,
    )
    for w in range(mma_warpgroups):
        _box(
            ax,
            0,
            2.0 + step * w,
            3.4,
            height,
            "#EDE1F5",
            text=f"warpgroup {w + 1}: consumer (warps {4 * (w + 1)}-{4 * (w + 1) + 3})\n"
            f"query rows {rows * w}-{rows * (w + 1) - 1}: QK^T, softmax, PV\n"
            f"setmaxnreg.inc -> {mma_registers} registers",
            fontsize=9.5,
        )
    # shared memory: Q and the ring
    x0 = 4.5
    _box(ax, x0, 0, 1.2, 1.5, C["q"], text=f"Q\n{bM} x {D}", tc="white", fontsize=9.5)
    width = (11.0 - x0 - 1.35) / kv_slots
    for s in range(kv_slots):
        entries = [e for e in range(s, 2 * kv_slots + s, kv_slots)][:2]
        label = "\n".join(("K" if e % 2 == 0 else "V") + str(e // 2) for e in entries)
        _box(
            ax,
            x0 + 1.35 + s * width,
            0,
            width - 0.08,
            1.5,
            # an odd slot count lets a slot hold K and V tiles in turn
            C["k"]
            if s % 2 == 0 and kv_slots % 2 == 0
            else C["v"]
            if kv_slots % 2 == 0
            else "#E8D9C0",
            alpha=0.8,
            text=f"{'slot ' if kv_slots <= 8 else ''}{s}\n{label}",
            fontsize=9,
        )
    ax.text(
        x0,
        -0.25,
        f"shared memory: Q + {kv_slots} slots of {bN} x {D} (K or V); ring entry e -> slot "
        f"e % {kv_slots}",
        fontsize=9.5,
    )
    _arrow(ax, (3.4, 0.55), (x0, 0.55), "TMA: Q, K_j, V_j", dy=-0.22)
    _arrow(ax, (x0 + 3.0, 1.5), (3.4, 2.6), "full: data landed", dy=0.0)
    _arrow(
        ax,
        (3.4, 3.0),
        (x0 + 4.0, 1.5),
        f"empty: {4 * mma_warpgroups} consumer warps released",
        dy=0.25,
        color=C["grid"],
    )
    turn_barriers = ", ".join(str(1 + w) for w in range(1, mma_warpgroups + 1))
    ax.text(
        3.6,
        2.0 + step * (mma_warpgroups - 1) / 2 + height / 2 + 0.5,
        f"named barriers {turn_barriers}: the tensor-core turn\n(PV_j + QK_(j+1) of one warpgroup "
        "at a time" + (", going round 1 -> 2 -> 3)" if mma_warpgroups > 2 else ")"),
        fontsize=9.5,
        va="center",
    )
    for w in range(mma_warpgroups - 1):
        y0 = 2.0 + step * w + height
        _arrow(ax, (1.7, y0), (1.7, 2.0 + step * (w + 1)), style="<->", lw=1.6)
    # the register file
    y = y_regs
    total = register_file
    parts = [
        (128 * load_registers, "#DCEAF7", f"producer 128 x {load_registers}"),
        (
            128 * mma_warpgroups * mma_registers,
            "#EDE1F5",
            f"consumers {128 * mma_warpgroups} x {mma_registers}",
        ),
    ]
    used = sum(p for p, _, _ in parts)
    parts.append((total - used, "#FFFFFF", "unused"))
    x = 0.0
    scale = 11.0 / total
    for i, (n, col, lab) in enumerate(parts):
        _box(ax, x, y, n * scale, 0.55, col, lw=0.8)
        where, ha = [(x, "left"), (x + n * scale / 2, "center"), (x + n * scale, "right")][i]
        ax.text(where, y + 0.85, f"{lab} = {n:,}" if n else "", ha=ha, fontsize=9)
        x += n * scale
    ax.text(
        0,
        y - 0.3,
        f"register file of the SM: {total:,} x 32 bit; at entry {threads} threads x {at_entry} = "
        f"{threads * at_entry:,}; after setmaxnreg {used:,}",
        fontsize=9.5,
    )
    ax.set_xlim(-0.2, 11.2)
    ax.set_ylim(y + 1.3, -0.6)
    ax.axis("off")
    ax.set_title(
        f"Stage 8 CTA: {threads} threads in {threads // 128} warpgroups, one producer and "
        f"{mma_warpgroups} consumers",
        fontsize=11,
    )
    return _finish(fig, path)


def hopper_unit_times(head_dim=128, block_n=128, rows=64, tc_tflops=989.0, exp_tflops=3.9, sms=132):
    """(QK^T, softmax, PV) time in ns of one consumer warpgroup's `rows` query rows against one
    KV tile of block_n keys on one SM, from the FlashAttention-3 paper's H100 SXM5 throughputs:
    989 TFLOP/s of bf16/fp16 matrix multiply and 3.9 TFLOP/s of special functions (exp2), over
    132 SMs. The softmax time counts only the exponentials (one per score); the other softmax
    instructions (max, sum, scale, conversion, O rescale) are left out."""
    per_sm_tc = tc_tflops * 1e12 / sms
    per_sm_exp = exp_tflops * 1e12 / sms
    gemm = 2 * rows * block_n * head_dim / per_sm_tc * 1e9
    softmax = rows * block_n / per_sm_exp * 1e9
    return gemm, softmax, gemm


def attention_schedule(
    pingpong,
    steps=3,
    qk_time=1.0,
    softmax_time=1.0,
    pv_time=1.0,
    qk_instr=8,
    pv_instr=8,
    dt=None,
    final_pass=True,
    overlap=False,
    wait_for_pv=False,
    wait_latency=0.0,
):
    """A model of the two consumer warpgroups' loop over `steps` KV tiles (durations illustrative
    unless taken from hopper_unit_times). Shared units: the tensor cores serve wgmma instructions
    in the order they were issued (two warpgroups issuing at the same moment interleave theirs),
    and the exp units are shared equally between the warpgroups running a softmax.

    pingpong=False is stage 7: the two warpgroups issue QK_j together, run their softmax together
    and issue PV_j together (they meet at V_j, which the producer loads once both have released
    K_j). pingpong=True is stage 8: the turn of the tensor cores (named barriers 2 and 3) is PV_j
    with QK_(j+1), issued back to back; a warpgroup waits for its turn before PV_j (warpgroup 2
    also before QK_0), passes it right after issuing QK_(j+1) (warpgroup 1 also after its last
    PV), and then waits for both. (The model's waits cost no time, so it does not show what
    issuing the pair back to back saves: the gap while a warpgroup holding the turn sees PV_j
    complete before it issues QK_(j+1) - unless wait_latency is set.) wait_for_pv=True (with
    pingpong) is the order of FlashAttention-3's kernel without intra-warpgroup overlap, and of
    stage 8 before 2026-12-02: the warpgroup waits for PV_j before it issues QK_(j+1).
    wait_latency: the time from a warpgroup's last outstanding wgmma completing to its next
    instruction after a wait (seeing the completion, issuing again; illustrative - the kernel's
    cost is not measured directly). overlap=True
    (with pingpong) is stage 9: a turn is QK_j with PV_(j-1), issued together; the warpgroup
    waits for QK_j only (wait_group 1), runs softmax_j while PV_(j-1) is on the tensor cores, then
    waits for PV_(j-1).

    Returns {"tc": [(start, end, wg, label)], "softmax": {wg: [(start, end, label, shared)]},
    "waits": {wg: [(start, end, reason)]}, "end": t, "tc_busy": fraction, "turns": {barrier:
    completions}, "pending": {barrier: arrives never waited for}}. final_pass=False drops
    warpgroup 1's pass after its last PV (a lost arrive): the model then raises Deadlock, as the
    kernel would hang."""
    if dt is None:
        dt = min(qk_time, softmax_time, pv_time) / 60.0
    progs = {}
    for w in (1, 2):
        ops = []
        for j in range(steps if not overlap else 0):
            if pingpong:
                if j == 0 and w == 2:
                    ops.append(("wait_turn",))
                # The wait after QK_j also covers PV_(j-1), issued right before it in the turn.
                waited = "QK" if j == 0 or wait_for_pv else "PV and QK"
                ops += [("issue", f"QK{j}", qk_instr, qk_time), ("pass_turn",), ("wait", waited)]
                ops += [("softmax", f"softmax {j}", softmax_time), ("wait_turn",)]
                ops += [("issue", f"PV{j}", pv_instr, pv_time)]
                if wait_for_pv:
                    ops.append(("wait", "PV"))
            else:
                ops += [("sync", f"K{j}"), ("issue", f"QK{j}", qk_instr, qk_time), ("wait", "QK")]
                ops += [("softmax", f"softmax {j}", softmax_time), ("sync", f"V{j}")]
                ops += [("issue", f"PV{j}", pv_instr, pv_time), ("wait", "PV")]
        if overlap and steps > 0:
            if w == 2:
                ops.append(("wait_turn",))
            ops += [("issue", "QK0", qk_instr, qk_time), ("pass_turn",), ("wait", "QK")]
            ops.append(("softmax", "softmax 0", softmax_time))
            for j in range(1, steps):
                ops += [("wait_turn",), ("issue", f"QK{j}", qk_instr, qk_time)]
                ops += [("issue", f"PV{j - 1}", pv_instr, pv_time), ("pass_turn",)]
                ops += [("wait_for", f"QK{j}"), ("softmax", f"softmax {j}", softmax_time)]
                ops.append(("wait", "PV"))
            ops += [("wait_turn",), ("issue", f"PV{steps - 1}", pv_instr, pv_time)]
        if pingpong and steps > 0 and w == 1 and final_pass:
            ops.append(("pass_turn",))
        if pingpong and not overlap and not wait_for_pv and steps > 0:
            ops.append(("wait", "PV"))  # the last PV, after the last pass
        if overlap and steps > 0:
            ops.append(("wait", "PV"))
        progs[w] = ops
    pc = {1: 0, 2: 0}
    queue = []  # [wg, label, remaining] in the tensor cores' order
    outstanding = {1: 0, 2: 0}
    active = {}  # wg -> [label, remaining work]
    tokens = {1: 0, 2: 0}  # turns passed to warpgroup w and not yet taken
    turns = {2: 0, 3: 0}  # completions of named barrier 1 + w
    at_sync = {}
    woken = {}  # (wg, pc) of a wait whose wgmmas completed -> when the warpgroup goes on
    tc, soft, waits = [], {1: [], 2: []}, {1: [], 2: []}
    t = 0.0
    limit = 100000 * max(1, steps)
    for _ in range(limit):
        before = dict(pc)
        issued = {1: [], 2: []}
        passed = {1: 0, 2: 0}
        blocked = {}
        sleeping = False
        for w in (1, 2):
            while pc[w] < len(progs[w]):
                op = progs[w][pc[w]]
                kind = op[0]
                if kind == "issue":
                    _, label, n, work = op
                    issued[w] += [[w, label, work / n] for _ in range(n)]
                    outstanding[w] += n
                    pc[w] += 1
                elif kind == "pass_turn":
                    passed[3 - w] += 1
                    pc[w] += 1
                elif kind == "wait_turn":
                    if tokens[w] == 0:
                        blocked[w] = "waits for its turn"
                        break
                    tokens[w] -= 1
                    turns[1 + w] += 1
                    pc[w] += 1
                elif kind == "wait":
                    if outstanding[w]:
                        blocked[w] = f"waits for its {op[1]} wgmmas"
                        break
                    if wait_latency > 0:
                        go = woken.setdefault((w, pc[w]), t + wait_latency)
                        if t + 1e-12 < go:
                            blocked[w] = f"waits for its {op[1]} wgmmas"
                            sleeping = True
                            break
                    pc[w] += 1
                elif kind == "wait_for":  # wait_group 1: the group named, not the later one
                    if any(q[0] == w and q[1] == op[1] for q in queue + issued[w]):
                        blocked[w] = f"waits for its {op[1][:2]} wgmmas"
                        break
                    pc[w] += 1
                elif kind == "sync":
                    at_sync[w] = op[1]
                    if at_sync.get(3 - w) == op[1]:
                        # both arrived: both go on at the next moment, together
                        pc[1] += 1
                        pc[2] += 1
                        at_sync.clear()
                    else:
                        blocked[w] = "waits for the other warpgroup" + (
                            " (V_j)" if op[1].startswith("V") else ""
                        )
                    break
                elif kind == "softmax":
                    if w not in active:
                        active[w] = [op[1], op[2]]
                    break
        # instructions issued at the same moment by both warpgroups interleave
        for i in range(max(len(issued[1]), len(issued[2]))):
            for w in (1, 2):
                if i < len(issued[w]):
                    queue.append(issued[w][i])
        if pc[1] >= len(progs[1]) and pc[2] >= len(progs[2]) and not queue and not active:
            break
        if pc == before and not queue and not active and not any(passed.values()) and not sleeping:
            raise Deadlock(
                f"deadlock at t = {t:.0f}: "
                + "; ".join(f"warpgroup {w} {why}" for w, why in sorted(blocked.items()))
            )
        # the tensor cores: first come, first served
        budget = dt
        while budget > 1e-15 and queue:
            head = queue[0]
            use = min(budget, head[2])
            start = t + dt - budget
            if (
                tc
                and tc[-1][2] == head[0]
                and tc[-1][3] == head[1]
                and abs(tc[-1][1] - start) < 1e-9
            ):
                tc[-1] = (tc[-1][0], start + use, head[0], head[1])
            else:
                tc.append((start, start + use, head[0], head[1]))
            head[2] -= use
            budget -= use
            if head[2] <= 1e-12:
                queue.pop(0)
                outstanding[head[0]] -= 1
        # the exp units: shared equally
        for w in list(active):
            label, left = active[w]
            shared = len(active) > 1
            done = dt / len(active)
            runs = soft[w]
            if runs and runs[-1][2] == label and abs(runs[-1][1] - t) < 1e-9:
                runs[-1] = (runs[-1][0], t + dt, label, runs[-1][3] or shared)
            else:
                runs.append((t, t + dt, label, shared))
            active[w][1] = left - done
            if active[w][1] <= 1e-12:
                del active[w]
                pc[w] += 1
        for w, why in blocked.items():
            runs = waits[w]
            if runs and runs[-1][2] == why and abs(runs[-1][1] - t) < 1e-9:
                runs[-1] = (runs[-1][0], t + dt, why)
            else:
                runs.append((t, t + dt, why))
        for w in (1, 2):
            tokens[w] += passed[w]
        t += dt
    else:
        raise Deadlock(f"the schedule did not finish: pc = {pc}, tokens = {tokens}")
    busy = sum(e - s for s, e, _, _ in tc)
    return {
        "tc": tc,
        "softmax": soft,
        "waits": waits,
        "end": t,
        "tc_busy": busy / t if t else 0.0,
        "turns": turns,
        "pending": {1 + w: tokens[w] for w in (1, 2)},
    }


WG_COLORS = {1: "#4C72B0", 2: "#DD8452"}


def pingpong_timelines(
    head_dim=128,
    block_n=128,
    rows=64,
    steps=3,
    path=None,
    compare="stage 8",
    wait_latency=0.0,
    **rates,
):
    """Stage 7 (top: both consumer warpgroups in lock-step) and stage 8 (bottom: ping-pong) on
    one time axis, from attention_schedule with the durations of hopper_unit_times for this
    head_dim, block_n and rows per warpgroup (the kernel's configuration): which warpgroup's
    wgmma the tensor cores run, and when each warpgroup runs its softmax or waits. Loads are
    assumed to arrive in time (the model leaves memory out). compare="stage 9": stage 8 against
    stage 9; compare="wait for PV": stage 8 waiting for PV_j before QK_(j+1) (FlashAttention-3's
    warp-specialised order) against stage 8's back-to-back pair. wait_latency (ns) goes to
    attention_schedule: what a warpgroup takes from its wgmmas' completion to its next instruction."""
    qk, sm, pv = hopper_unit_times(head_dim, block_n, rows, **rates)
    n_qk, n_pv = head_dim // 16, block_n // 16
    stage8 = (
        attention_schedule(True, steps, qk, sm, pv, n_qk, n_pv, wait_latency=wait_latency),
        "stage 8: ping-pong (named barriers hand over the tensor cores)",
    )
    if compare == "wait for PV":
        runs = [
            (
                attention_schedule(
                    True, steps, qk, sm, pv, n_qk, n_pv, wait_for_pv=True, wait_latency=wait_latency
                ),
                "wait for PV_j, then QK_(j+1)",
            ),
            (stage8[0], "PV_j and QK_(j+1) back to back"),
        ]
    elif compare == "stage 9":  # stage 8 against stage 9 (compare="stage 9")
        runs = [
            stage8,
            (
                attention_schedule(True, steps, qk, sm, pv, n_qk, n_pv, overlap=True),
                "stage 9: + QK_j with PV_(j-1), softmax under the PV",
            ),
        ]
    else:
        runs = [
            (
                attention_schedule(False, steps, qk, sm, pv, n_qk, n_pv),
                "stage 7: the two consumer warpgroups in lock-step",
            ),
            stage8,
        ]
    t_max = max(r["end"] for r, _ in runs)
    fig, axes = plt.subplots(2, 1, figsize=(FIG_WIDTH, 6.4), sharex=True)
    lanes = ("tensor cores\n(wg 1 | wg 2)", "warpgroup 1", "warpgroup 2")
    h = 0.7
    for ax, (r, title) in zip(axes, runs):
        # The tensor-core lane in two halves, one per warpgroup: a GEMM is drawn from its first
        # instruction to its last; two GEMMs side by side in time share the tensor cores.
        spans = {}
        for s, e, w, label in r["tc"]:
            a, b = spans.get((w, label), (s, e))
            spans[w, label] = (min(a, s), max(b, e))
        for (w, label), (s, e) in spans.items():
            other = [
                (a, b)
                for (w2, _), (a, b) in spans.items()
                if w2 != w and a < e - 1e-6 and b > s + 1e-6
            ]
            _box(
                ax,
                s,
                -h / 2 + (w - 1) * h / 2,
                e - s,
                h / 2,
                WG_COLORS[w],
                lw=0.5,
                hatch="xx" if other else None,
                tc="white",
                text=label if e - s > 0.04 * t_max else None,
                fontsize=9,
            )
        for w in (1, 2):
            for s, e, why in r["waits"][w]:
                _box(ax, s, w - h / 2, e - s, h, C["wait"], lw=0.2, hatch="//", alpha=0.6)
            for s, e, label, shared in r["softmax"][w]:
                _box(
                    ax,
                    s,
                    w - h / 2,
                    e - s,
                    h,
                    C["softmax"],
                    lw=0.5,
                    hatch=".." if shared else None,
                    tc="white",
                    text=label.replace("softmax ", "S") if e - s > 0.04 * t_max else None,
                    fontsize=9,
                )
        per_tile = r["end"] / steps
        ax.set_yticks(range(3), lanes, fontsize=10)
        ax.set_ylim(2.6, -0.6)
        ax.set_xlim(0, t_max * 1.01)
        ax.grid(axis="x", alpha=0.25)
        ax.tick_params(axis="x", labelsize=9)
        ax.set_title(
            f"{title}: done at {r['end']:.0f} ns ({per_tile:.0f} ns per KV tile), tensor cores "
            f"busy {100 * r['tc_busy']:.0f}%",
            fontsize=10,
        )
    latency = (
        f"\n{wait_latency:g} ns from a warpgroup's wgmmas completing to its next instruction "
        "(illustrative)"
        if wait_latency
        else ""
    )
    axes[-1].set_xlabel(
        f"model time in ns on one SM, D = {head_dim}, {block_n}-key tiles, {rows} rows per "
        f"warpgroup (one GEMM {qk:.0f} ns, one softmax {sm:.0f} ns){latency}",
        fontsize=9,
    )
    handles = [
        Patch(facecolor=WG_COLORS[1], label="wgmma of warpgroup 1 (QK_j, PV_j)"),
        Patch(facecolor=WG_COLORS[2], label="wgmma of warpgroup 2"),
        Patch(facecolor="#999999", hatch="xx", label="both warpgroups' wgmma interleaved"),
        Patch(facecolor=C["softmax"], label="softmax (exp2 of a 64 x 128 S tile)"),
        Patch(facecolor=C["softmax"], hatch="..", label="softmax sharing the exp units"),
        Patch(facecolor=C["wait"], hatch="//", label="waiting (MMA, turn, V_j)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False)
    return _finish(fig, path, rect=(0, 0.1, 1, 1))


def plot_stage7_bench(rows, title, path=None):
    """Stage 7's rows of a `make bench` run (the json's "rows"; stages 8 and 9 beside stage 7
    where the run has them): GQA against MHA and the
    baselines (TFLOP/s), packed sequences against FA4's varlen and the padded batch (useful
    TFLOP/s), decode-like steps with and without pack-GQA (microseconds). One panel each."""
    gqa = [r for r in rows if r["stage"] == "7 gqa"]
    var = [r for r in rows if r["stage"] == "7 varlen"]
    dec = [r for r in rows if r["stage"] == "7 decode"]
    panels = [p for p in (gqa, var, dec) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)

    def bars(ax, groups, labels, values, ylabel, title_):
        width = 0.8 / len(labels)
        for i, lab in enumerate(labels):
            ys = [v.get(lab, 0.0) for v in values]
            xs = [g + (i - (len(labels) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, ys, width, label=lab, color=kernel_color(lab))
        ax.set_xticks(range(len(groups)), groups, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=10)
        ax.set_title(title_, fontsize=11)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)

    it = iter(axes[0])
    if gqa:
        groups = [f"S={r['shape'][3]}" + (" causal" if r["shape"][5] else "") for r in gqa]
        names = ("stage 7 GQA", "stage 8 GQA", "stage 9 GQA", "stage 7 MHA", "FA4", "SDPA cuDNN")
        labels = [n for n in names if n in gqa[0]["tflops"]]
        bars(next(it), groups, labels, [r["tflops"] for r in gqa], "TFLOP/s", "GQA 32/8, D = 128")
    if var:
        groups = ["causal" if r["shape"][4] else "non-causal" for r in var]
        names = {f"stage {n}": f"stage {n} varlen" for n in (7, 8, 9)}
        names |= {"FA4": "FA4 varlen", "padded": "padded SDPA cuDNN"}
        names = {k: n for k, n in names.items() if k in var[0]["tflops"]}
        vals = [{names[k]: v for k, v in r["tflops"].items() if k in names} for r in var]
        bars(next(it), groups, list(names.values()), vals, "useful TFLOP/s", "16 packed sequences")
    if dec:
        groups = [f"Sq={r['shape'][3]}" for r in dec]
        names = {
            "packed": "stage 7 pack-GQA",
            "unpacked": "stage 7 unpacked",
            "stage 9": "stage 9",
            "FA4": "FA4",
            "SDPA": "SDPA",
        }
        names = {k: n for k, n in names.items() if k in dec[0]["ms"]}
        vals = [{names[k]: v * 1e3 for k, v in r["ms"].items() if k in names} for r in dec]
        bars(
            next(it),
            groups,
            list(names.values()),
            vals,
            "microseconds (lower is better)",
            "decode-like, Sk = 8192",
        )
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
