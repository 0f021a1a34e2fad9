"""Figures of notebook 8 (warp specialisation): the CTA's warp roles and its register file before
and after setmaxnreg, the K/V ring of stage 7 against the ring that runs ahead, and (from
notebooks/figures/stage9.py) the schedule model of the two consumer warpgroups and one step of the
measured ablation against S.

The schedule model, its Deadlock and the Blackwell figures live in stage9.py (ping-pong); the names
below are imported from there so that the figures of later notebooks keep importing them from
here.
"""

import matplotlib.pyplot as plt

from common.tools.draw import FIG_WIDTH, C, arrow, box, finish
from notebooks.figures.stage4 import kv_slot_timelines
from notebooks.figures.stage9 import Deadlock as Deadlock
from notebooks.figures.stage9 import attention_schedule as attention_schedule
from notebooks.figures.stage9 import blackwell_two_tile_roles as blackwell_two_tile_roles
from notebooks.figures.stage9 import hopper_unit_times as hopper_unit_times
from notebooks.figures.stage9 import mma_issue_orders as mma_issue_orders
from notebooks.figures.stage9 import pingpong_timelines as pingpong_timelines
from notebooks.figures.stage9 import step_against_s as step_against_s
from notebooks.figures.stage9 import tmem_two_tiles as tmem_two_tiles


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
    load_registers), warpgroups 1 .. mma_warpgroups the consumers (bM / mma_warpgroups query rows
    each; setmaxnreg.inc to mma_registers); the K/V ring of kv_slots slots, ring entry 2 t = K of
    step t, 2 t + 1 its V, entry e in slot e % kv_slots, with the barriers between the roles; the
    register file below: what the CTA holds at launch (threads x the cap ptxas gives at entry)
    and how setmaxnreg splits it."""
    bM, bN, D = cta_tile
    rows = bM // mma_warpgroups
    at_entry = register_file // threads // 8 * 8
    pool = threads * at_entry
    step, height = (1.7, 1.4) if mma_warpgroups <= 2 else (1.25, 1.1)
    y_regs = 2.0 + step * (mma_warpgroups - 1) + height + 0.6
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 6.2 * (y_regs + 2.0) / 7.5))
    box(
        ax,
        0,
        0,
        3.4,
        1.5,
        "#DCEAF7",
        text=f"warpgroup 0: producer (warps 0-3)\nwarp 0, one thread: TMA loads\nwarps 1-3: no work\n"
        f"setmaxnreg.dec -> {load_registers} registers",
        fontsize=9.5,
    )
    for w in range(mma_warpgroups):
        box(
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
    box(ax, x0, 0, 1.2, 1.5, C["q"], text=f"Q\n{bM} x {D}", tc="white", fontsize=9.5)
    width = (11.0 - x0 - 1.35) / kv_slots
    for s in range(kv_slots):
        entries = [e for e in range(s, 2 * kv_slots + s, kv_slots)][:2]
        label = "\n".join(("K" if e % 2 == 0 else "V") + str(e // 2) for e in entries)
        box(
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
    consumer_warps = 4 * mma_warpgroups
    arrow(ax, (3.4, 0.55), (x0, 0.55), "TMA: Q, K_j, V_j", dy=-0.22)
    arrow(ax, (x0 + 3.0, 1.5), (3.4, 2.6), "kv_full[s]: 1 arrive + the bytes", dy=0.0)
    arrow(
        ax,
        (3.4, 3.0),
        (x0 + 4.0, 1.5),
        f"kv_empty[s]: {consumer_warps} arrives, one per consumer warp",
        dy=0.25,
        color=C["grid"],
    )
    ax.text(
        3.6,
        2.0 + step * (mma_warpgroups - 1) / 2 + height / 2 + 0.6,
        f"q_full: 1 arrive + Q's bytes; q_empty: {128 * mma_warpgroups} arrives\n(every consumer "
        "thread, once O is stored); named barrier 1: the consumers' own sync",
        fontsize=9.5,
        va="center",
    )
    # the register file
    y = y_regs
    parts = [
        (128 * load_registers, "#DCEAF7", f"producer 128 x {load_registers}"),
        (
            128 * mma_warpgroups * mma_registers,
            "#EDE1F5",
            f"consumers {128 * mma_warpgroups} x {mma_registers}",
        ),
    ]
    used = sum(p for p, _, _ in parts)
    parts.append((register_file - used, "#FFFFFF", "not the CTA's"))
    x = 0.0
    scale = 11.0 / register_file
    for i, (n, col, lab) in enumerate(parts):
        box(ax, x, y, n * scale, 0.55, col, lw=0.8)
        where, ha = [(x, "left"), (x + n * scale / 2, "center"), (x + n * scale, "right")][i]
        ax.text(where, y + 0.85, f"{lab} = {n:,}" if n else "", ha=ha, fontsize=9)
        x += n * scale
    ax.plot([pool * scale] * 2, [y - 0.1, y + 0.65], color="black", lw=1.5, linestyle="--")
    ax.text(
        0,
        y - 0.3,
        f"register file of the SM: {register_file:,} x 32 bit; the CTA's pool at launch: "
        f"{threads} threads x {at_entry} = {pool:,} (dashed); after setmaxnreg {used:,}",
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
    return finish(fig, path)


def ring_timelines(kv_tiles=5, slots_before=2, slots_after=6, load_time=2.0, path=None):
    """The K/V ring of stage 7 against stage 8's on one time axis (the ring model of notebook 4,
    notebooks/figures/stage4.py): stage 7 loads V_j into K_j's slot once QK_j has released it
    (slots_before slots, one per KV tile); stage 8 gives every load a ring entry of its own
    (slots_after slots), so the producer runs up to slots_after entries ahead of the consumers
    and waits only for the release of the entry slots_after before. One consumer lane stands for
    both consumer warpgroups (a slot is free once both have released it). Durations are
    illustrative."""
    variants = [
        dict(
            kv_tiles=kv_tiles,
            kv_slots=slots_before,
            two_pass=False,
            slot_per="tile",
            label=f"stage 7: {slots_before} slots, V_j into K_j's slot once QK_j has released it",
        ),
        dict(
            kv_tiles=kv_tiles,
            kv_slots=slots_after,
            two_pass=False,
            slot_per="entry",
            label=f"stage 8: {slots_after} slots, one ring entry per load (entry e in slot "
            f"e % {slots_after})",
        ),
    ]
    return kv_slot_timelines(
        variants,
        load_time=load_time,
        suptitle="The K/V ring: the producer waits (hatched) for a slot, or runs ahead",
        path=path,
    )
