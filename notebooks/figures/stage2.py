"""Figures of notebook 2 (S = Q K^T): the attention grid of tiles."""

import matplotlib.pyplot as plt

from common.tools.draw import (
    FIG_WIDTH,
    WARP_COLORS,
    C,
    box,
    finish,
)


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
                box(
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
    box(bx, 0, 0.6, qw, qh, C["q"], text=f"Q tile\n{block_m} x {D}\n(resident)", tc="white")
    x0 = qw + 0.4
    for j in range(shown):
        box(
            bx,
            x0 + j * block_n * u,
            -0.05 - qw,
            block_n * u,
            qw,
            C["k"],
            alpha=0.5 + 0.5 * (j == 0),
            text=f"K{j}^T",
        )
        box(
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
    return finish(fig, path)
