"""Figures of notebook 3 (softmax): the quad reduction of a row max, P's path from the accumulator
to a register A operand, the V^T operand; the Blackwell warp roles of notebook 1.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

from common.tools.draw import FIG_WIDTH, LANE_COLORS, box, finish
from notebooks.figures.layouts import wgmma_a_coords, wgmma_c_coords
from notebooks.figures.stage1 import blackwell_warp_roles as blackwell_warp_roles


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
            box(
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
    return finish(fig, path)


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
                box(ax, c, r, 1, 1, "#F4F4F4", lw=0.2)
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
            box(
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
                box(
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
    return finish(fig, path)


def vt_operand(keys=8, dims=8, row_bytes=128, path=None):
    """The B operand of the second GEMM. O = P V: M = query rows, N = D, K = keys, so the B operand
    is V^T, an (N, K) = (D, keys) matrix. TMA brings a V tile exactly as it brings a K tile - rows
    = keys, D contiguous (left). sVt is the same bytes viewed with the two modes swapped:
    element (d, key) of sVt is element (key, d) of sV (right). Along its N mode (d) the bytes are
    contiguous: wgmma calls that "MN-major" and reads it transposed for free - no copy, no
    transpose instruction. Cells show the byte offset of each element within the slot's first
    1 KiB swizzle atom (8 rows of 64 bf16 = 128 bytes; before the swizzle, which permutes 16-byte
    chunks the same way in both views)."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(FIG_WIDTH, 5.4))

    def cell(a, x, y, off, col):
        box(a, x, y, 1, 1, col, lw=0.4, alpha=0.85, text=f"{off}", fontsize=9)

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
    return finish(fig, path)
