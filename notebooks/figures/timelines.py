"""A small model of a TMA producer and an MMA consumer sharing a ring of shared-memory slots
through full/empty mbarriers, and the timeline figure drawn from it (notebooks 1, 4 and 5).
Durations are illustrative, not measured.
"""

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from common.tools.draw import FIG_WIDTH, C, box, finish


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
        box(ax, a, yp - h / 2, b - a, h, C["wait"], hatch="//", lw=0.3, alpha=0.6)
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
            box(
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
        box(ax, start, y[lane] - h / 2, end - start, h, fc, text=label, fontsize=9, tc="white")
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
            box(ax, start, top, end - start, sh, item_color(item), alpha=0.45, lw=0.5)
            box(
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
        box(ax, a, yy - h / 2, b - a, h, "none", ec=C["race"], lw=2.5, hatch="xx")
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


def timeline_figure(panels, notes=(), suptitle=None, path=None):
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
    return finish(fig, path, rect=(0, legend_h / fig_h, 1, 1))
