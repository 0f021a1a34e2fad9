"""Figures of notebook 6 (masks): the mask alignment convention and the (query tile, key tile) maps."""

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from common.tools.draw import FIG_WIDTH, C, box, finish

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
                box(ax, n, m, 1, 1, TILE_CLASS_COLORS[int(tiles[m, n])], lw=0.5)
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
    return finish(fig, path, rect=(0, 0.65 / height, 1, 1))


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
                    box(
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
    return finish(fig, path)
