"""Figures of notebook 10 (overlap inside the loop): the registers live during the softmax, the
schedule model's timelines of stage 9 against stage 10, measured ratios against S; the
Blackwell TMEM map and MMA issue orders of notebook 8, drawn again.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from common.tools.draw import FIG_WIDTH, C, box, finish
from notebooks.figures.stage8 import Deadlock as Deadlock
from notebooks.figures.stage8 import attention_schedule as attention_schedule
from notebooks.figures.stage8 import hopper_unit_times as hopper_unit_times
from notebooks.figures.stage8 import mma_issue_orders as mma_issue_orders
from notebooks.figures.stage8 import tmem_two_tiles as tmem_two_tiles

WG_COLORS = {1: "#4C72B0", 2: "#DD8452"}
# The sequence lengths of the paper shapes (B x S = 16k): the ticks of the figures against S.
S_TICKS = (512, 1024, 2048, 4096, 8192, 16384)


def register_sets(rows, title=None, path=None):
    """Registers per consumer thread live while the softmax runs, one bar per (label, S, P, O,
    budget) row: S (fp32 scores of one 64 x 128 tile), P (bf16 pairs), O (fp32, D / 2), stacked,
    against the budget setmaxnreg gives a consumer thread (a dashed mark). The rest of the budget
    holds addresses, loop counters and the softmax statistics."""
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 0.9 + 0.75 * len(rows)))
    parts = (("S", C["s"]), ("P", C["p"]), ("O", C["o"]))
    for i, (label, s, p, o, budget) in enumerate(rows):
        x = 0
        for (name, color), n in zip(parts, (s, p, o)):
            if n:
                box(ax, x, i - 0.3, n, 0.6, color, alpha=0.85, text=f"{name} {n}", tc="white")
                x += n
        ax.text(x + 3, i, f"{x} live", va="center", fontsize=10)
        ax.plot([budget, budget], [i - 0.4, i + 0.4], color="black", linestyle="--", lw=1.2)
        ax.text(budget + 2, i - 0.3, f"{budget}", va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=10)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_xlim(0, max(r[4] for r in rows) + 30)
    ax.set_xlabel("32-bit registers per consumer thread (dashed: what setmaxnreg gives)")
    ax.set_title(title or "Registers live while a warpgroup's softmax runs", fontsize=11)
    ax.grid(axis="x", alpha=0.25)
    return finish(fig, path)


def _draw_schedule(ax, r, title, t_max, h=0.7):
    """One run of attention_schedule on a time axis: the tensor cores' lane split in one half per
    warpgroup (a GEMM from its first instruction to its last; hatched where both warpgroups'
    instructions interleave), then each warpgroup's softmax and waits."""
    spans = {}
    for s, e, w, label in r["tc"]:
        a, b = spans.get((w, label), (s, e))
        spans[w, label] = (min(a, s), max(b, e))
    for (w, label), (s, e) in spans.items():
        shared = any(w2 != w and a < e - 1e-6 and b > s + 1e-6 for (w2, _), (a, b) in spans.items())
        box(
            ax,
            s,
            -h / 2 + (w - 1) * h / 2,
            e - s,
            h / 2,
            WG_COLORS[w],
            lw=0.5,
            hatch="xx" if shared else None,
            tc="white",
            text=label if e - s > 0.045 * t_max else None,
            fontsize=9,
        )
    for w in (1, 2):
        for s, e, _ in r["waits"][w]:
            box(ax, s, w - h / 2, e - s, h, C["wait"], lw=0.2, hatch="//", alpha=0.6)
        for s, e, label, shared in r["softmax"][w]:
            box(
                ax,
                s,
                w - h / 2,
                e - s,
                h,
                C["softmax"],
                lw=0.5,
                hatch=".." if shared else None,
                tc="white",
                text=label.replace("softmax ", "sm") if e - s > 0.04 * t_max else None,
                fontsize=9,
            )
    ax.set_yticks(range(3), ("tensor cores\n(wg 1 | wg 2)", "warpgroup 1", "warpgroup 2"))
    ax.set_ylim(2.6, -0.6)
    ax.set_xlim(0, t_max * 1.01)
    ax.grid(axis="x", alpha=0.25)
    ax.set_title(
        f"{title}: done at {r['end']:.0f} ns, tensor cores busy {100 * r['tc_busy']:.0f}%",
        fontsize=10,
    )


def overlap_timelines(head_dim=128, block_n=128, rows=64, steps=3, path=None, **rates):
    """Stage 9 (top: ping-pong, a turn is PV_j with QK_(j+1), one wait after both) and stage 10
    (bottom: a turn is QK_j with PV_(j-1); wait_group 1 for QK_j, softmax_j while PV_(j-1) runs,
    wait_group 0) on one time axis, from attention_schedule with the durations of
    hopper_unit_times for this head_dim, block_n and rows per warpgroup. Loads are assumed to
    arrive in time; a wait costs no time; the softmax is its exponentials only."""
    qk, sm, pv = hopper_unit_times(head_dim, block_n, rows, **rates)
    n_qk, n_pv = head_dim // 16, block_n // 16
    runs = [
        (
            attention_schedule(True, steps, qk, sm, pv, n_qk, n_pv),
            "stage 9: turns of (PV_j, QK_j+1), wait for both",
        ),
        (
            attention_schedule(True, steps, qk, sm, pv, n_qk, n_pv, overlap=True),
            "stage 10: turns of (QK_j, PV_j-1), softmax_j under PV_j-1",
        ),
    ]
    t_max = max(r["end"] for r, _ in runs)
    fig, axes = plt.subplots(2, 1, figsize=(FIG_WIDTH, 6.4), sharex=True)
    for ax, (r, title) in zip(axes, runs):
        _draw_schedule(ax, r, title, t_max)
    axes[-1].set_xlabel(
        f"model time in ns on one SM, D = {head_dim}, {block_n}-key tiles, {rows} rows per "
        f"warpgroup (one GEMM {qk:.0f} ns, one softmax {sm:.0f} ns)",
        fontsize=9,
    )
    handles = [
        Patch(facecolor=WG_COLORS[1], label="wgmma of warpgroup 1"),
        Patch(facecolor=WG_COLORS[2], label="wgmma of warpgroup 2"),
        Patch(facecolor="#999999", hatch="xx", label="both warpgroups' wgmma interleaved"),
        Patch(facecolor=C["softmax"], label="softmax (exp2 of a 64 x 128 S tile)"),
        Patch(facecolor=C["softmax"], hatch="..", label="softmax sharing the exp units"),
        Patch(facecolor=C["wait"], hatch="//", label="waiting (wgmma, turn)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False)
    return finish(fig, path, rect=(0, 0.1, 1, 1))


def measured_ratios(rows, pairs, title, path=None):
    """Ratios of two kernels' TFLOP/s against S, as measured (rows of a `make bench` json:
    "stage" "ablation" (event-timed) or "ablation GPU time" (CUPTI kernel durations), "shape"
    (B, H, S, S, D, causal), "tflops" {kernel: TFLOP/s}): one panel per D, one line per
    (numerator, denominator) pair in `pairs` and causal setting, solid for event time and dotted
    for GPU time; the grey line is 1 (as fast)."""
    timed = {"ablation": ("event", "-"), "ablation GPU time": ("GPU", ":")}
    mine = [r for r in rows if r["stage"] in timed]
    dims = sorted({r["shape"][4] for r in mine})
    fig, axes = plt.subplots(1, len(dims), figsize=(FIG_WIDTH, 4.0), squeeze=False, sharey=True)
    shades = ("#1B4F72", "#C0392B", "#117A65", "#7D3C98")
    for ax, D in zip(axes[0], dims):
        for k, (num, den) in enumerate(pairs):
            for causal in (False, True):
                for stage, (what, style) in timed.items():
                    pts = sorted(
                        (r["shape"][2], r["tflops"][num] / r["tflops"][den])
                        for r in mine
                        if r["stage"] == stage
                        and r["shape"][4] == D
                        and bool(r["shape"][5]) == causal
                        and num in r["tflops"]
                        and den in r["tflops"]
                    )
                    if not pts:
                        continue
                    xs, ys = zip(*pts)
                    ax.plot(
                        xs,
                        ys,
                        style,
                        marker="o" if causal else "s",
                        markersize=4,
                        color=shades[(2 * k + causal) % len(shades)],
                        label=f"{num} / {den}, {'causal' if causal else 'non-causal'}, {what}",
                    )
        ax.axhline(1.0, color="#888888", lw=1.0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(S_TICKS, [f"{s // 1024}k" if s >= 1024 else str(s) for s in S_TICKS])
        ax.set_xlabel("sequence length S (B x S = 16k, H x D = 2048)", fontsize=10)
        ax.set_title(f"D = {D}", fontsize=11)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("ratio of TFLOP/s", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=11)
    return finish(fig, path, rect=(0, 0.05 + 0.045 * ((len(labels) + 1) // 2), 1, 1))
