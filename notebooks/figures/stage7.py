"""Figures of notebook 7 (GQA and packed sequences): the head map, the CTA grid of a ragged batch,
packed rows.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from common.tools.draw import FIG_WIDTH, C, box, finish


def gqa_head_map(H=32, Hkv=8, path=None):
    """Which KV head each query head reads: h // (H / Hkv), as SDPA's enable_gqa. The group of
    H / Hkv query heads that share a KV head has one colour; their CTAs read the same K and V
    tiles (TMA coordinates, no copy), which L2 serves after the first read."""
    if H % Hkv:
        raise ValueError(f"H = {H} is not a multiple of Hkv = {Hkv}")
    group = H // Hkv
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 3.2))
    colors = ("#DCEAF7", "#FBE3D6", "#E2F0D9", "#EDE1F5")
    for h in range(H):
        box(ax, h + 0.05, 0, 0.9, 0.8, colors[(h // group) % 4], lw=0.6, text=str(h), fontsize=9)
    for g in range(Hkv):
        x0 = g * group + 0.1
        box(
            ax,
            x0,
            2.2,
            group - 0.2,
            0.8,
            colors[g % 4],
            lw=0.9,
            text=f"KV head {g}" if group >= 2 else str(g),
            fontsize=9,
        )
        for h in range(g * group, (g + 1) * group):
            ax.plot([h + 0.5, x0 + (group - 0.2) / 2], [0.8, 2.2], color=C["grid"], lw=0.7)
    ax.text(-0.3, 0.4, "query\nheads", ha="right", va="center", fontsize=9)
    ax.text(-0.3, 2.6, "K / V\nheads", ha="right", va="center", fontsize=9)
    ax.set_xlim(-2.2, H + 0.2)
    ax.set_ylim(3.4, -0.9)
    ax.axis("off")
    ax.set_title(
        f"GQA with H = {H} query heads and Hkv = {Hkv} KV heads: query head h reads KV head "
        f"h // {group}\n({'MQA: ' if Hkv == 1 else ''}each K/V tile is read by {group} CTAs, one "
        "per query head of its group; nothing is copied or expanded)",
        fontsize=10,
    )
    return finish(fig, path)


def varlen_cta_map(
    lens_q, lens_k=None, heads=2, bM=128, bN=128, causal=False, window=None, path=None
):
    """The CTA grid of a packed batch: one CTA per (Q tile, head, sequence), as many Q tiles per
    sequence as the longest has (grid = (ceil(max_seqlen_q / bM), H, sequences)). Each cell gives
    the number of KV tiles that CTA computes (its kv_tile_range, per-sequence lengths and mask);
    hatched cells start past their sequence's end: an empty range, no K or V loaded, nothing
    stored (the CTA still loads its Q tile). Dotted
    cells are a sequence's last Q tile, whose rows past the end are not stored. `heads` of the
    H heads are drawn (every head has the same picture)."""
    from common import masks

    lens_k = list(lens_q) if lens_k is None else list(lens_k)
    n_seq = len(lens_q)
    q_tiles = max(1, -(-max(lens_q) // bM))
    rows = [(b, h) for b in range(n_seq) for h in range(heads)]
    fig, ax = plt.subplots(figsize=(min(FIG_WIDTH, 4.2 + 0.9 * q_tiles), 1.9 + 0.34 * len(rows)))
    cmap = plt.get_cmap("Blues")
    most = 1
    work = {}
    for b in range(n_seq):
        Sq, Sk = lens_q[b], lens_k[b]
        for m in range(q_tiles):
            if m * bM >= Sq:
                work[b, m] = None
                continue
            left, right = masks.resolve_window(causal, window, Sq, Sk)
            lo, hi = masks.kv_tile_range(m, Sq, Sk, left, right, bM, bN)
            work[b, m] = hi - lo
            most = max(most, hi - lo)
    busy = 0
    for y, (b, h) in enumerate(rows):
        for m in range(q_tiles):
            w = work[b, m]
            if w is None:
                box(ax, m, y, 1, 1, "#EEEEEE", lw=0.5, hatch="//", text="-", fontsize=9)
                continue
            busy += 1
            last = (m + 1) * bM > lens_q[b]
            shade = 0.15 + 0.6 * w / most
            box(
                ax,
                m,
                y,
                1,
                1,
                cmap(shade),
                lw=1.4 if last else 0.5,
                ls=":" if last else "-",
                text=str(w),
                fontsize=9,
                tc="white" if shade > 0.5 else "black",
            )
    ax.set_xlim(0, q_tiles)
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([m + 0.5 for m in range(q_tiles)], [str(m) for m in range(q_tiles)])
    ax.set_yticks(
        [y + 0.5 for y in range(len(rows))],
        [f"seq {b} (Sq={lens_q[b]}, Sk={lens_k[b]}) h{h}" for b, h in rows],
    )
    ax.tick_params(labelsize=9)
    ax.set_xlabel(f"Q tile ({bM} rows): blockIdx.x", fontsize=9)
    mask = "causal" if causal else ("window " + str(window) if window else "no mask")
    ax.set_title(
        f"grid = ({q_tiles}, H, {n_seq}); {mask}. Drawn: {heads} head(s) per sequence.\n"
        f"{busy} of {len(rows) * q_tiles} CTAs have work (number: KV tiles computed); "
        "hatched: empty range, no K/V, nothing stored",
        fontsize=9.5,
    )
    handles = [
        Patch(facecolor="#EEEEEE", hatch="//", edgecolor="black", label="past the sequence's end"),
        Patch(
            facecolor=cmap(0.4),
            edgecolor="black",
            ls=":",
            lw=1.4,
            label="last Q tile: rows past the end not stored",
        ),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig_h = fig.get_size_inches()[1]
    return finish(fig, path, rect=(0, 0.45 / fig_h, 1, 1))


def packed_rows(lens, bM=128, path=None):
    """Packed sequences (FlashAttention's varlen layout) along the token axis, and the Q tiles of
    each sequence under it: tile m of sequence b covers packed rows cu_seqlens[b] + bM m onwards.
    TMA clips a tile only at the packed tensor's end (total rows), so the part of a last tile
    past its sequence reads the next sequence's rows (hatched): those Q rows are computed and
    never stored, those keys are masked to -inf and those V rows zeroed in shared memory."""
    lens = list(lens)
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    total = offs[-1]
    n_seq = len(lens)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 2.0 + 0.55 * n_seq))
    unit = max(total, 1) / 10.0
    colors = ("#DCEAF7", "#FBE3D6", "#E2F0D9", "#EDE1F5")
    for b, n in enumerate(lens):
        if n:
            box(
                ax,
                offs[b],
                0,
                n,
                0.8,
                colors[b % 4],
                lw=0.8,
                text=f"seq {b}: {n}" if n > 0.6 * unit else str(b),
                fontsize=9,
            )
    ax.text(-0.02 * total, 0.4, "packed\nrows", ha="right", va="center", fontsize=9)
    for b, n in enumerate(lens):
        y = 1.3 + 0.65 * b
        tiles = -(-n // bM)
        for m in range(tiles):
            a = offs[b] + m * bM
            inside = min(a + bM, offs[b + 1]) - a
            box(
                ax,
                a,
                y,
                inside,
                0.5,
                colors[b % 4],
                lw=0.6,
                text=f"tile {m}" if inside > 0.5 * unit else None,
                fontsize=9,
            )
            beyond = min(a + bM, total) - (a + inside)
            if beyond > 0:
                box(ax, a + inside, y, beyond, 0.5, "#FFFFFF", ec=C["race"], lw=1.0, hatch="//")
            if a + bM > total:
                box(
                    ax,
                    min(a + inside + beyond, total),
                    y,
                    a + bM - max(total, a + inside),
                    0.5,
                    "none",
                    ec=C["grid"],
                    lw=0.8,
                    ls=":",
                )
        ax.text(-0.02 * total, y + 0.25, f"seq {b}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-0.16 * total, total + bM + 0.02 * total)
    ax.set_ylim(1.3 + 0.65 * n_seq + 0.1, -0.3)
    ax.set_yticks([])
    ticks = [0]
    for o in offs[1:]:
        if o - ticks[-1] < 0.04 * max(total, 1) and o == total and len(ticks) > 1:
            ticks.pop()
        if o - ticks[-1] >= 0.04 * max(total, 1) or o == total:
            ticks.append(o)
    ax.set_xticks(ticks, [str(o) for o in ticks])
    ax.tick_params(labelsize=9)
    ax.set_xlabel("packed row (cu_seqlens marked)", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        f"{n_seq} packed sequences, {total} rows, Q tiles of {bM}: TMA clips only at row {total}",
        fontsize=10,
    )
    handles = [
        Patch(
            facecolor="white",
            edgecolor=C["race"],
            hatch="//",
            label="read by TMA, belongs to the next sequence",
        ),
        Patch(
            facecolor="none",
            edgecolor=C["grid"],
            ls=":",
            label="past the tensor: clipped by TMA (zeros)",
        ),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig_h = fig.get_size_inches()[1]
    return finish(fig, path, rect=(0, 0.4 / fig_h, 1, 1))
