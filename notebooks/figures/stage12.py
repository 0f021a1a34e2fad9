"""Figures of notebook 12 (the last percent): stage 12's tunings switched on one by one as
measured, and stage 12 against FA4 and cuDNN (notebook 10's ratio figure, drawn again).
"""

import matplotlib.pyplot as plt

from common.tools.draw import FIG_WIDTH, finish, kernel_color
from notebooks.figures.stage10 import S_TICKS
from notebooks.figures.stage10 import measured_ratios as measured_ratios

S_COLORS = {2048: "#7FB3D5", 8192: "#2471A3", 16384: "#0B2E4F"}


def tunings_cumulative(rows, steps, title, path=None):
    """Stage 12's tunings switched on one by one, as measured (rows of a `make bench --tunings`
    json: "shape" (B, H, S, S, D, causal), "tflops" {"stage 12 none": ..., "stage 12 +1": ...,
    "FA4": ...}): one panel per (D, causal), TFLOP/s against the step (`steps`: the column
    names none, +1, +1-2, ...), one line per S, and FA4 at that S as a dashed line of the same
    colour."""
    panels = sorted({(r["shape"][4], bool(r["shape"][5])) for r in rows})
    fig, axes = plt.subplots(2, 2, figsize=(FIG_WIDTH, 7.4), squeeze=False)
    for ax, (D, causal) in zip(axes.flat, panels):
        mine = sorted(
            (r for r in rows if (r["shape"][4], bool(r["shape"][5])) == (D, causal)),
            key=lambda r: r["shape"][2],
        )
        for r in mine:
            S = r["shape"][2]
            color = S_COLORS.get(S, "#555555")
            ys = [r["tflops"][f"stage 12 {s}"] for s in steps]
            ax.plot(range(len(steps)), ys, marker="o", color=color, lw=2, label=f"S = {S}")
            if "FA4" in r["tflops"]:
                ax.axhline(r["tflops"]["FA4"], color=color, lw=1.2, linestyle="--")
        ax.set_xticks(range(len(steps)), steps, fontsize=9, rotation=30)
        ax.set_ylabel("TFLOP/s", fontsize=10)
        ax.set_title(
            f"D = {D}, {'causal' if causal else 'non-causal'} (dashed: FA4, same run)",
            fontsize=10,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="lower right")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    return finish(fig, path)


def against_s(rows, names, title, path=None):
    """TFLOP/s against S of the kernels `names` as measured (rows of the "ablation" stage of a
    `make bench` json): one panel per (D, causal), stage 12 thick, the others thin."""
    mine = [r for r in rows if r["stage"] == "ablation"]
    panels = sorted({(r["shape"][4], bool(r["shape"][5])) for r in mine})
    fig, axes = plt.subplots(2, 2, figsize=(FIG_WIDTH, 7.0), squeeze=False)
    own = {"stage 10": "#2E86C1", "stage 11": "#28B463", "stage 12": "#B9770E"}
    for ax, (D, causal) in zip(axes.flat, panels):
        these = sorted(
            (r for r in mine if (r["shape"][4], bool(r["shape"][5])) == (D, causal)),
            key=lambda r: r["shape"][2],
        )
        for name in names:
            pts = [(r["shape"][2], r["tflops"][name]) for r in these if name in r["tflops"]]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(
                    xs,
                    ys,
                    marker="o",
                    label=name,
                    color=own.get(name) or kernel_color(name),
                    lw=2.5 if name == "stage 12" else 1.3,
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(S_TICKS, [f"{s // 1024}k" if s >= 1024 else str(s) for s in S_TICKS])
        ax.set_xlabel("sequence length S", fontsize=10)
        ax.set_ylabel("TFLOP/s", fontsize=10)
        ax.set_title(f"D = {D}, {'causal' if causal else 'non-causal'}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(title, fontsize=11)
    return finish(fig, path)
