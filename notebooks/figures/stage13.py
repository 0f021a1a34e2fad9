"""Figures of notebook 13 (split-KV): which SMs a decode step keeps busy before and after the split,
how split_range cuts a work tile's KV tiles (the kernel's own method, run on ints by the
notebook), and the decode run as measured (GB/s of K and V read).
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from common.tools.draw import FIG_WIDTH, box, finish, kernel_color

# One colour per KV head (the work tiles of a decode step at B = 1 are one per KV head).
HEAD_COLORS = (
    "#4C72B0",
    "#DD8452",
    "#55A868",
    "#C44E52",
    "#8172B3",
    "#937860",
    "#DA8BC3",
    "#8C8C8C",
)
IDLE = "#F2F2F2"
# Kernels of the decode run that draw.KERNEL_COLORS does not name.
OWN_COLORS = {"stage 13": "#6A3D9A", "SDPA efficient": "#9EDAE5"}


def idle_sms(panels, sm_count=132, columns=12, title=None, path=None):
    """One panel per (label, work tiles, splits): the SMs as a grid of squares, CTA c on SM c
    (one wave, one CTA per SM), coloured by the KV head of its work tile and labelled with its
    split; SMs without a CTA pale. Work tile t of a split launch is split t % splits of tile
    t // splits, as the kernel's tile_coords numbers them."""
    rows = -(-sm_count // columns)
    fig, axes = plt.subplots(1, len(panels), figsize=(FIG_WIDTH, 0.4 * rows + 1.6), squeeze=False)
    for ax, (label, tiles, splits) in zip(axes[0], panels):
        ctas = tiles * splits
        for sm in range(sm_count):
            x, y = sm % columns, rows - 1 - sm // columns
            if sm < ctas:
                head, split = divmod(sm, splits)
                color = HEAD_COLORS[head % len(HEAD_COLORS)]
                text = str(split) if splits > 1 else f"h{head}"
                box(ax, x, y, 0.92, 0.92, color, lw=0.4, text=text, tc="white", fontsize=9)
            else:
                box(ax, x, y, 0.92, 0.92, IDLE, ec="#BBBBBB", lw=0.4)
        busy = min(ctas, sm_count)
        ax.set_title(
            f"{label}\n{ctas} CTAs: {busy} of {sm_count} SMs busy, {sm_count - busy} idle",
            fontsize=10,
        )
        ax.set_xlim(-0.2, columns + 0.1)
        ax.set_ylim(-0.2, rows + 0.1)
        ax.set_aspect("equal")
        ax.axis("off")
    handles = [Patch(facecolor=HEAD_COLORS[h], label=f"KV head {h}") for h in range(8)]
    handles.append(Patch(facecolor=IDLE, edgecolor="#BBBBBB", label="no CTA"))
    fig.legend(handles=handles, loc="lower center", ncol=9, fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path, rect=(0, 0.07, 1, 0.95 if title else 1))


def split_cuts(cases, title=None, path=None):
    """One row per (label, kv_tiles, [(lo, hi) of each split]): the work tile's KV tiles 0 ..
    kv_tiles - 1 as cells coloured by the split that reads them (split s's number on its first
    cell), and on the right the splits that read nothing."""
    longest = max(n for _, n, _ in cases)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 0.75 * len(cases) + 1.2))
    cmap = plt.get_cmap("tab20")
    for row, (label, n, ranges) in enumerate(cases):
        y = len(cases) - 1 - row
        scale = longest / max(n, 1)
        for s, (lo, hi) in enumerate(ranges):
            for t in range(lo, hi):
                text = str(s) if t == lo and (hi - lo) * scale >= 2.5 else None
                box(ax, t * scale, y, scale, 0.7, cmap(s % 20), lw=0.3, text=text, fontsize=9)
        empty = [s for s, (lo, hi) in enumerate(ranges) if hi <= lo]
        shown = (
            "none"
            if not empty
            else (f"{empty[0]}-{empty[-1]}" if len(empty) > 1 else str(empty[0]))
        )
        ax.text(-0.01 * longest, y + 0.35, label, ha="right", va="center", fontsize=9)
        ax.text(
            longest * 1.01,
            y + 0.35,
            f"empty: {shown}",
            ha="left",
            va="center",
            fontsize=9,
        )
    ax.set_xlim(-0.02 * longest, longest * 1.16)
    ax.set_ylim(-0.2, len(cases))
    ax.set_yticks([])
    ax.set_xticks([])
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel(
        "the work tile's KV tiles, lo to hi (each row scaled to the same width)", fontsize=10
    )
    if title:
        ax.set_title(title, fontsize=11)
    return finish(fig, path)


def decode_bars(rows, names, title=None, path=None):
    """The decode run as measured (rows of docs/results/decode_h200_*.json: "stage" "13 decode"
    (CUDA events around calls back to back) or "13 decode GPU" (GPU time), "shape" (B, H, Hkv,
    Sq, Sk, D), "tflops" holding GB/s): one panel per timing, a group of bars per shape, one bar
    per kernel of `names` that the row has."""
    kinds = (("13 decode", "calls back to back (CUDA events)"), ("13 decode GPU", "GPU time alone"))
    fig, axes = plt.subplots(2, 1, figsize=(FIG_WIDTH, 7.6), sharex=True)
    for ax, (kind, label) in zip(axes, kinds):
        mine = [r for r in rows if r["stage"] == kind]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs = [
                j + (i - (len(names) - 1) / 2) * width
                for j, r in enumerate(mine)
                if name in r["tflops"]
            ]
            ys = [r["tflops"][name] for r in mine if name in r["tflops"]]
            ax.bar(xs, ys, width, label=name, color=OWN_COLORS.get(name) or kernel_color(name))
        ax.set_ylabel("GB/s of K and V", fontsize=10)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(labelsize=9)
    ticks = [
        f"B = {r['shape'][0]}, {r['shape'][1]}/{r['shape'][2]} heads\nSk = {r['shape'][4] // 1024}k"
        for r in rows
        if r["stage"] == kinds[0][0]
    ]
    axes[1].set_xticks(range(len(ticks)), ticks, fontsize=9)
    axes[0].legend(fontsize=9, ncol=3)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path)


def read_split_sweep(path):
    """The rows of a split-count sweep file (docs/results/split_count_sweep_*.txt): a list of
    {"B", "Sk", "kv_tiles", "chosen" (splits_for's count), "graph": {splits: us}, "b2b": {splits:
    us}} - microseconds per call in a replayed CUDA graph, and eagerly back to back."""
    import re

    rows = []
    with open(path) as f:
        for line in f:
            m = re.match(r"B=(\d+) Sk=\s*(\d+) kv_tiles=\s*(\d+) splits_for=\s*(\d+) \|(.*)", line)
            if not m:
                continue
            row = {"B": int(m[1]), "Sk": int(m[2]), "kv_tiles": int(m[3]), "chosen": int(m[4])}
            row["graph"], row["b2b"] = {}, {}
            for part in m[5].split("|"):
                n, rest = part.split(":", 1)
                times = dict(re.findall(r"(gpu|graph|b2b)\s+([\d.]+)", rest))
                row["graph"][int(n)] = float(times["graph"])
                row["b2b"][int(n)] = float(times["b2b"])
            rows.append(row)
    return rows


def split_sweep(rows, B=1, unsplit_tiles=4, title=None, path=None):
    """Microseconds per decode call against Sk for batch B (rows of read_split_sweep): unsplit,
    the fastest forced split count (labelled with it) and the launch's own count where it was
    timed; left in a replayed CUDA graph (no host work), right eagerly back to back. A dotted
    line marks the last length left unsplit (unsplit_tiles KV tiles of 128 keys)."""
    mine = [r for r in rows if r["B"] == B]
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH, 3.6))
    for ax, kind, label in (
        (axes[0], "graph", "in a CUDA graph (GPU only)"),
        (axes[1], "b2b", "eager, back to back (host included)"),
    ):
        sk = [r["Sk"] for r in mine]
        ax.plot(sk, [r[kind][1] for r in mine], "o-", color="#8C8C8C", label="unsplit")
        best = [min((t, n) for n, t in r[kind].items() if n > 1) for r in mine]
        ax.plot(sk, [t for t, _ in best], "s-", color="#6A3D9A", label="fastest split")
        for x, (t, n) in zip(sk, best):
            ax.annotate(str(n), (x, t), textcoords="offset points", xytext=(0, -12), fontsize=8,
                        ha="center", color="#6A3D9A")  # fmt: skip
        chosen = [(r["Sk"], r[kind][r["chosen"]]) for r in mine if r["chosen"] in r[kind]]
        ax.plot(*zip(*chosen), "x", color="black", markersize=8, label="the launch's count")
        ax.axvline(unsplit_tiles * 128, color="black", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sk, [str(s) for s in sk], fontsize=8, rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("Sk (keys)", fontsize=9)
        ax.set_ylabel("us per call", fontsize=9)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path)
