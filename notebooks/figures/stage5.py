"""Figures of notebook 5 (online softmax): a traced online softmax, the O rescale hand-off; the K/V
slot timelines of notebook 4.
"""

import math

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch

from common.tools.draw import (
    FIG_WIDTH,
    C,
    box,
    finish,
)
from notebooks.figures.stage4 import kv_slot_timeline as kv_slot_timeline
from notebooks.figures.stage4 import kv_slot_timelines as kv_slot_timelines


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
    return finish(fig, path)


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
        box(ax, span[0], yy - h / 2, span[1] - span[0], h, fc, text=label, fontsize=9, tc=tc, **kw)

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
    return finish(fig, path)
