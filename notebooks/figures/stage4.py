"""Figures of notebook 4 (K/V interleaving): the K/V ring schedule and its slot timelines (also drawn
by notebook 5).
"""

from common.tools.draw import C
from notebooks.figures.timelines import simulate_ring, timeline_figure


def kv_ring_schedule(
    kv_tiles=3, kv_slots=2, two_pass=True, v_waits_for_release=True, slot_per="tile"
):
    """(loads, ops, wait rule) of the K/V ring. two_pass=True is stage 4: pass 1 streams K_j only
    (row max m, row sum l), pass 2 streams K_j' (the same tiles again) and V_j. two_pass=False is
    stage 5: one pass, online softmax. slot_per="tile" is the Hopper track: step t of the ring
    uses slot t % kv_slots twice, V_j lands in the slot K_j just left. slot_per="entry" is the
    Blackwell track: every load (K_j or V_j) is the next ring entry, entry e in slot
    e % kv_slots. v_waits_for_release=False is a Blackwell ring that gets it wrong:
    V_j is loaded into K_j's slot without waiting for the QK^T MMA to release it."""
    if slot_per not in ("tile", "entry"):
        raise ValueError(f"slot_per = {slot_per!r}; allowed: 'tile', 'entry'")
    loads, ops = [], []
    t = 0
    if two_pass:
        for j in range(kv_tiles):
            loads.append((f"K{j}", t % kv_slots))
            ops.append(("MMA", f"QK{j}", 1.0, [f"K{j}"], [f"K{j}"]))
            ops.append(("softmax", "m,l", 0.7, [], []))
            t += 1
    # pass 2 (or the only pass): slot of tile j receives K_j then V_j
    sl = {}
    for j in range(kv_tiles):
        sl[j] = (t + j) % kv_slots
    kname = (lambda j: f"K{j}'") if two_pass else (lambda j: f"K{j}")
    order = []
    for j in range(min(kv_slots, kv_tiles)):
        order.append((kname(j), sl[j]))
    for j in range(kv_tiles):
        order.append((f"V{j}", sl[j]))
        if j + kv_slots < kv_tiles:
            order.append((kname(j + kv_slots), sl[j + kv_slots]))
    if slot_per == "entry":
        order = [(kname(j) if x == 0 else f"V{j}", None) for j in range(kv_tiles) for x in (0, 1)]
        loads = [
            (item, e % kv_slots)
            for e, (item, _) in enumerate([(it, None) for it, _ in loads] + order)
        ]
    else:
        loads.extend(order)
    for j in range(kv_tiles):
        ops.append(("MMA", "Q" + kname(j), 1.0, [kname(j)], [kname(j)]))
        ops.append(("softmax", "P" if two_pass else "P,a", 0.9, [], []))
        ops.append(("MMA", f"PV{j}", 1.0, [f"V{j}"], [f"V{j}"]))
    wait = None if v_waits_for_release else (lambda item: not item.startswith("V"))
    return loads, ops, wait


def _kv_color(item):
    return C["v"] if item.startswith("V") else C["k"]


def _kv_panel(kv_tiles, kv_slots, two_pass, v_waits_for_release, load_time, slot_per, label=None):
    loads, ops, wait = kv_ring_schedule(kv_tiles, kv_slots, two_pass, v_waits_for_release, slot_per)
    ev = simulate_ring(loads, ops, load_time=load_time, wait_for_release=wait)
    what = (
        "stage 4, two passes (pass 1: K only; pass 2: K' then V)"
        if two_pass
        else "stage 5, one pass (online softmax)"
    )
    ring = (
        "Hopper: V_j into K_j's slot"
        if slot_per == "tile"
        else "Blackwell: one ring entry per load"
    )
    title = label or f"{what}; {ring}; kv_slots = {kv_slots}, KV tiles 0..{kv_tiles - 1}"
    if not v_waits_for_release:
        title += "\nRACY VARIANT: V_j is loaded without waiting for the release of K_j's slot"
    span = max(e for _, _, _, e, _ in ev["ops"])
    return (
        ev,
        kv_slots,
        ("TMA producer", "MMA", "softmax"),
        title + f" - done at t = {span:.1f}",
        _kv_color,
    )


_KV_NOTES = (
    ("a K tile (K' = pass 2)", C["k"]),
    ("a V tile", C["v"]),
    ("softmax: m,l = row max / sum; P = probabilities; a = rescale", C["softmax"]),
)


def kv_slot_timeline(
    kv_tiles=3,
    kv_slots=2,
    two_pass=True,
    v_waits_for_release=True,
    load_time=2.0,
    slot_per="tile",
    path=None,
):
    """Stage 4 (two_pass=True) or stage 5 (two_pass=False): one ring of kv_slots shared-memory
    slots carries K and V. In pass 2 a slot receives K_j, the QK^T MMA reads it, the slot is
    released, V_j is loaded into the same slot, the PV MMA reads it, the slot is released again.
    With v_waits_for_release=False V_j's load overlaps QK_j: a race."""
    panel = _kv_panel(kv_tiles, kv_slots, two_pass, v_waits_for_release, load_time, slot_per)
    return timeline_figure([panel], notes=_KV_NOTES, path=path)


def kv_slot_timelines(variants, load_time=2.0, suptitle=None, path=None):
    """Several K/V ring schedules one above the other on one time axis, for comparison.
    variants: [dict(kv_tiles=..., kv_slots=..., two_pass=..., v_waits_for_release=...,
    slot_per=..., label=...)]."""
    panels = []
    for v in variants:
        v = dict(v)
        panels.append(
            _kv_panel(
                v.pop("kv_tiles", 3),
                v.pop("kv_slots", 2),
                v.pop("two_pass", True),
                v.pop("v_waits_for_release", True),
                v.pop("load_time", load_time),
                v.pop("slot_per", "tile"),
                v.pop("label", None),
            )
        )
        if v:
            raise TypeError(f"unknown keys {sorted(v)}")
    return timeline_figure(panels, notes=_KV_NOTES, suptitle=suptitle, path=path)
