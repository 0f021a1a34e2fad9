"""Figures of notebook 11 (persistent CTAs): which SM runs which work tile when, under one CTA per
tile, a fixed share and the tile counter; the order of the tiles against the K and V that the
tiles running together need in L2; stage 11 against stage 10 as measured. The timelines and the
orders come from common/tools/tile_scheduler.py, which runs the kernel's own tile_coords.
"""

import matplotlib.pyplot as plt
from matplotlib import cm
from matplotlib.colors import Normalize
from matplotlib.patches import Patch

from common.tools.draw import FIG_WIDTH, C, box, finish, kernel_color
from common.tools.tile_scheduler import pairs_in_flight

WORK_CMAP = "YlOrRd"


def cta_timelines(panels, title=None, path=None):
    """One panel per (label, Timeline) of tile_scheduler.walk, on one time axis: a row per SM,
    a grey hatched box for each CTA's set-up, a box per work tile coloured by its KV tiles
    (pale: short, dark: long) and labelled with its Q tile (and head, when it fits); a line
    where the last tile ends, with the share of the SMs' time spent on KV tiles."""
    longest = max(
        seg.tile.kv_tiles for _, tl in panels for row in tl.rows for seg in row if seg.tile
    )
    t_max = max(tl.end for _, tl in panels)
    norm = Normalize(vmin=0, vmax=longest)
    cmap = plt.get_cmap(WORK_CMAP)
    sms = max(len(tl.rows) for _, tl in panels)
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(FIG_WIDTH, 0.9 + 0.36 * sms * len(panels)),
        squeeze=False,
        layout="constrained",
    )
    for ax, (label, tl) in zip(axes[:, 0], panels):
        for s, row in enumerate(tl.rows):
            for seg in row:
                w = seg.end - seg.start
                if seg.tile is None:
                    box(ax, seg.start, s + 0.1, w, 0.8, "#DDDDDD", lw=0.4, hatch="///")
                    continue
                t = seg.tile
                text = None
                if w >= 2.2 * len(str(t.q_tile)) and w >= 3:
                    text = f"{t.q_tile}" if w < 6 else f"m{t.q_tile} h{t.head}"
                dark = norm(t.kv_tiles) > 0.6
                box(
                    ax,
                    seg.start,
                    s + 0.1,
                    w,
                    0.8,
                    cmap(norm(t.kv_tiles)),
                    lw=0.4,
                    text=text,
                    tc="white" if dark else "black",
                )
        ax.axvline(tl.end, color=C["s"], lw=1.5)
        ax.text(
            tl.end,
            len(tl.rows) / 2,
            f" ends at {tl.end:g}\n {tl.busy:.0%} busy",
            color=C["s"],
            fontsize=9,
            va="center",
        )
        ax.set_xlim(0, t_max * 1.15)
        ax.set_ylim(len(tl.rows), 0)
        ax.set_yticks([s + 0.5 for s in range(len(tl.rows))])
        ax.set_yticklabels([f"SM {s}" for s in range(len(tl.rows))], fontsize=9)
        ax.set_title(label, fontsize=10, loc="left")
        ax.tick_params(axis="x", labelsize=9)
    axes[-1, 0].set_xlabel(
        "time, in KV tiles (one KV tile's QK^T, softmax and PV = 1)", fontsize=10
    )
    sm = cm.ScalarMappable(norm=norm, cmap=cmap)
    bar = fig.colorbar(sm, ax=axes[:, 0].tolist(), fraction=0.025, pad=0.01)
    bar.set_label("KV tiles of the work tile", fontsize=9)
    bar.ax.tick_params(labelsize=9)
    handles = [Patch(facecolor="#DDDDDD", hatch="///", label="a CTA's set-up (assumed length)")]
    fig.legend(handles=handles, loc="outside lower left", fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    if path:
        fig.savefig(path, dpi=100)
    return fig


def l2_orders(panels, window, l2_bytes, title=None, path=None):
    """One column per (label, LaunchPlan) of tile_scheduler.launch_plan: on top the KV tiles of
    each work tile in the order the tiles are handed out; below, the K and V bytes of the
    (head, sequence) pairs among the `window` tiles from each tile on (the tiles that run at
    about the same time on `window` CTAs), against the L2 (`l2_bytes`)."""
    fig, axes = plt.subplots(2, len(panels), figsize=(FIG_WIDTH, 5.4), sharex="col", squeeze=False)
    mib = 1024 * 1024
    top = max(p.kv_bytes_per_pair * max(pairs_in_flight(p, window)) for _, p in panels) / mib
    for col, (label, plan) in enumerate(panels):
        ax, ax2 = axes[0, col], axes[1, col]
        n = len(plan.tiles)
        ax.plot(range(n), [t.kv_tiles for t in plan.tiles], color=C["mma"], lw=0.8)
        ax.set_title(f"{label}\n(l2_heads = {plan.l2_heads})", fontsize=10)
        ax.set_ylabel("KV tiles of tile t" if col == 0 else "", fontsize=10)
        in_flight = [k * plan.kv_bytes_per_pair / mib for k in pairs_in_flight(plan, window)]
        ax2.plot(range(n), in_flight, color=C["q"], lw=1.0)
        ax2.axhline(l2_bytes / mib, color=C["s"], lw=1.2, ls="--")
        ax2.text(n * 0.02, l2_bytes / mib, " L2", color=C["s"], fontsize=9, va="bottom")
        ax2.set_ylim(0, max(top, l2_bytes / mib) * 1.15)
        ax2.set_xlabel("tile number t (the order handed out)", fontsize=10)
        ax2.set_ylabel(
            f"MiB of K, V for tiles t .. t + {window - 1}" if col == 0 else "", fontsize=9
        )
        for a in (ax, ax2):
            a.tick_params(labelsize=9)
            a.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path)


def ablation_step(rows, title=None, path=None):
    """Stage 11 over stage 10 as measured (rows of docs/results/ablation_h200_2026-12-04.json,
    "ablation" and "ablation GPU time"): one panel per timing, the ratio against S, one line per
    (D, causal); above 1, stage 11 is faster."""
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH, 3.8), sharey=True)
    styles = {
        (128, True): ("D = 128, causal", kernel_color("stage 8"), "-"),
        (128, False): ("D = 128", kernel_color("stage 8"), "--"),
        (64, True): ("D = 64, causal", kernel_color("FA4"), "-"),
        (64, False): ("D = 64", kernel_color("FA4"), "--"),
    }
    for ax, (kind, name) in zip(
        axes, (("ablation", "event time"), ("ablation GPU time", "GPU time"))
    ):
        for (D, causal), (label, color, ls) in styles.items():
            pts = sorted(
                (r["shape"][2], r["tflops"]["stage 11"] / r["tflops"]["stage 10"])
                for r in rows
                if r["stage"] == kind and r["shape"][4] == D and bool(r["shape"][5]) == causal
            )
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", color=color, ls=ls, label=label, lw=1.6)
        ax.axhline(1.0, color=C["grid"], lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S (B x S = 16k, H x D = 2048)", fontsize=10)
        ax.set_title(f"stage 11 / stage 10, {name}", fontsize=10)
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s ratio (above 1: stage 11 faster)", fontsize=10)
    axes[1].legend(fontsize=9)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path)
