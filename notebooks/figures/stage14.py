"""Figures of notebook 14 (a paged KV cache): a page table drawn (sequences, their page_table
rows, the physical pages in random order, what holds NaN), one KV tile loaded as TMA boxes onto
one full barrier (drawn from the kernel's own load_tiles, run on ints by the notebook), and the
decode run as measured (stage 14 on pages against stage 13, by page size).
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from common.tools.draw import FIG_WIDTH, box, finish

# One colour per sequence (as notebook 13 colours KV heads).
SEQ_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")
NAN_FILL = "#EEEEEE"  # memory that may hold anything, NaN included
NAN_EDGE = "#999999"
# Page sizes of the decode run, light to dark.
PAGE_COLORS = {16: "#C6DBEF", 64: "#6BAED6", 128: "#2171B5", 256: "#08306B"}


def page_table_map(used, page_size, table, num_pages, title=None, path=None):
    """The page table of len(used) sequences: above, row b of page_table (entry i: the page
    holding sequence b's keys i P .. i P + P - 1, P = page_size; -1 past its ceil(used[b] / P)
    pages, never read); below, the cache's num_pages pages in physical order, each coloured by
    the sequence that owns it, its rows past used[b] (the last page's tail) and the pages nobody
    owns grey and marked NaN; a line from each entry to its page."""
    max_pages = len(table[0])
    width = max(max_pages, num_pages)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 1.1 * len(used) + 3.6))
    pool_h = 2.0
    top = pool_h + 1.6  # the lowest table row
    x0 = (width - max_pages) / 2  # the table, centred over the pool
    owner = {}
    for b, (n, row) in enumerate(zip(used, table)):
        y = top + (len(used) - 1 - b) * 1.1
        pages = -(-n // page_size)
        ax.text(x0 - 0.15, y + 0.4, f"sequence {b}: {n} keys", ha="right", va="center", fontsize=9)
        for i, page in enumerate(row):
            if i < pages:
                color = SEQ_COLORS[b % len(SEQ_COLORS)]
                box(ax, x0 + i, y, 0.92, 0.8, color, lw=0.5, text=f"p{page}", tc="white")
                ax.plot(
                    [x0 + i + 0.46, page + 0.46],
                    [y, pool_h],
                    color=color,
                    lw=0.8,
                    alpha=0.4,
                    zorder=0,
                )
                owner[page] = (b, i, min(page_size, n - i * page_size))
            else:
                box(ax, x0 + i, y, 0.92, 0.8, NAN_FILL, ec=NAN_EDGE, lw=0.5, text=str(page))
    for i in range(max_pages):
        ax.text(x0 + i + 0.46, top + len(used) * 1.1 - 0.1, f"[{i}]", ha="center", fontsize=9)
    ax.text(
        x0 + max_pages / 2,
        top + len(used) * 1.1 + 0.35,
        f"page_table ({len(used)}, {max_pages}): entry i of row b = the page of keys "
        f"{page_size} i .. {page_size} i + {page_size - 1}",
        ha="center",
        fontsize=10,
    )
    for page in range(num_pages):
        if page in owner:
            b, entry, rows = owner[page]
            keys_h = pool_h * rows / page_size
            color = SEQ_COLORS[b % len(SEQ_COLORS)]
            box(ax, page, pool_h - keys_h, 0.92, keys_h, color, lw=0.5)
            if rows < page_size:  # the last page's tail: rows past seqused_k
                box(ax, page, 0, 0.92, pool_h - keys_h, NAN_FILL, ec=NAN_EDGE, lw=0.5, hatch="//")
                if pool_h - keys_h > 0.45:
                    ax.text(page + 0.46, (pool_h - keys_h) / 2, "NaN", ha="center", fontsize=9)
            ax.text(page + 0.46, -0.8, f"s{b} [{entry}]", ha="center", fontsize=9)
        else:
            box(ax, page, 0, 0.92, pool_h, NAN_FILL, ec=NAN_EDGE, lw=0.5, hatch="//")
            ax.text(page + 0.46, pool_h / 2, "NaN", ha="center", va="center", fontsize=9)
        ax.text(page + 0.46, -0.35, str(page), ha="center", fontsize=9)
    ax.text(
        width / 2,
        -1.45,
        f"k_cache / v_cache: {num_pages} pages of {page_size} rows in physical order, rows top to "
        "bottom; under each page: its number, the sequence and the entry that name it",
        ha="center",
        fontsize=10,
    )
    ax.set_xlim(-0.3 - 3.0, width + 0.3)
    ax.set_ylim(-1.8, top + len(used) * 1.1 + 0.8)
    ax.axis("off")
    handles = [
        Patch(facecolor=SEQ_COLORS[b % len(SEQ_COLORS)], label=f"sequence {b}")
        for b in range(len(used))
    ]
    handles.append(
        Patch(
            facecolor=NAN_FILL,
            edgecolor=NAN_EDGE,
            hatch="//",
            label="never reaches O (may hold NaN; -1 entries never read)",
        )
    )
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    if title:
        ax.set_title(title, fontsize=11)
    return finish(fig, path, rect=(0, 0.06, 1, 1))


def tile_boxes(panels, bN=128, title=None, path=None):
    """One panel per (label, page_size, seqused_k, boxes, own_pages): one KV tile of bN rows in
    its ring slot (rows left to right) as the TMA boxes of `boxes` [(kv_tile, box c, page_table
    entry, page, first row of the box in its page)] - what the kernel's load_tiles issues - each
    labelled with the entry it read and the page; rows at or past seqused_k hatched (masked in S,
    V zeroed); a box that read past the sequence's own_pages entries in red. Below, the slot's
    one full barrier that every box completes its bytes on."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(FIG_WIDTH, 2.25 * len(panels)))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (label, page_size, seqused_k, boxes, own_pages) in zip(axes, panels):
        r = min(page_size, bN)
        tile = boxes[0][0]
        box_kb = r * 128 * 2 // 1024  # D = 128, 2-byte elements
        for _, c, entry, page, row in boxes:
            x = c * r
            past = entry >= own_pages
            color = "#C44E52" if past else "#4C72B0"
            box(ax, x, 1.0, r, 1.0, color, lw=0.8)
            first_key = tile * bN + c * r
            masked = min(r, max(0, first_key + r - max(seqused_k, first_key)))
            if masked:
                box(ax, x + r - masked, 1.0, masked, 1.0, "white", lw=0.0, alpha=0.55, hatch="//")
            if r < 32:  # a narrow box: its entry and page
                text = f"[{entry}]\np{page}"
            else:
                text = f"entry [{entry}]: page {page}\nrows {row}-{row + r - 1}"
            ax.text(
                x + r / 2,
                1.5,
                text,
                ha="center",
                va="center",
                fontsize=9,
                color="black" if masked else "white",
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8)
                if masked
                else None,
            )
            # every box's bytes complete the slot's one full barrier
            ax.plot([x + r / 2, bN / 2], [1.0, 0.45], color="#777777", lw=0.7)
        box(
            ax,
            bN / 2 - 30,
            0.0,
            60,
            0.45,
            "#F2C14E",
            lw=0.8,
            text=f"full barrier: expect_tx {bN * 128 * 2 // 1024} KiB once, "
            f"{len(boxes)} box{'es' if len(boxes) > 1 else ''} x {box_kb} KiB complete it",
        )
        for k in range(0, bN + 1, 32):
            ax.text(k, 2.12, str(tile * bN + k) if k < bN else "", ha="center", fontsize=9)
        ax.set_title(label, fontsize=10, loc="left")
        ax.set_xlim(-2, bN + 2)
        ax.set_ylim(-0.1, 2.45)
        ax.axis("off")
    handles = [
        Patch(facecolor="#4C72B0", label="box from one of the sequence's pages"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="keys >= seqused_k (masked)"),
    ]
    if any(entry >= own for _, _, _, boxes, own in panels for _, _, entry, _, _ in boxes):
        handles.append(Patch(facecolor="#C44E52", label="box whose entry lies past the pages"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path, rect=(0, 0.05, 1, 0.96 if title else 1))


def paged_ratios(rows, page_sizes, title=None, path=None):
    """The decode run as measured (rows of docs/results/decode_h200_*.json: "stage" "13 decode"
    (CUDA events around calls back to back) or "13 decode GPU" (GPU time), "shape" (B, H, Hkv,
    Sq, Sk, D), "tflops" holding GB/s, "14 pN" stage 14 on pages of N keys): one panel per timing,
    a group of bars per shape, one bar per page size, the height stage 14's GB/s over stage 13's
    (1.0: as fast as the contiguous cache)."""
    kinds = (("13 decode GPU", "GPU time alone"), ("13 decode", "calls back to back (CUDA events)"))
    fig, axes = plt.subplots(2, 1, figsize=(FIG_WIDTH, 7.8), sharex=True)
    for ax, (kind, label) in zip(axes, kinds):
        mine = [r for r in rows if r["stage"] == kind and "14 p16" in r["tflops"]]
        width = 0.8 / len(page_sizes)
        for i, p in enumerate(page_sizes):
            xs = [j + (i - (len(page_sizes) - 1) / 2) * width for j in range(len(mine))]
            ys = [r["tflops"][f"14 p{p}"] / r["tflops"]["stage 13"] for r in mine]
            ax.bar(xs, ys, width, label=f"pages of {p}", color=PAGE_COLORS.get(p, "#8C564B"))
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(0.95, color="black", lw=0.7, ls="--", label="0.95: the goal, pages >= 64")
        ax.axhline(0.8, color="black", lw=0.7, ls=":", label="0.8: the goal, pages of 16")
        ax.set_ylabel("stage 14 / stage 13", fontsize=10)
        ax.set_ylim(0, 1.12)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(labelsize=9)
    mine = [r for r in rows if r["stage"] == kinds[0][0] and "14 p16" in r["tflops"]]
    ticks = [
        f"B = {r['shape'][0]}, {r['shape'][1]}/{r['shape'][2]} heads\nSk = {r['shape'][4] // 1024}k"
        for r in mine
    ]
    axes[1].set_xticks(range(len(ticks)), ticks, fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path, rect=(0, 0.07, 1, 1))
