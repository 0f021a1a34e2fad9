# ---
# jupyter:
#   jupytext:
#     formats: ipynb,source//py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 14 - a paged KV cache: K and V in pages, a KV tile in TMA boxes
#
# This notebook walks through `stages/stage14_paged_kv/hopper.py`: stage 13's kernel (split-KV on
# stage 12's persistent ping-pong kernel) reading K and V from a paged cache. A serving stack keeps
# one pool of pages of `page_size` keys - `k_cache` and `v_cache` of shape (num_pages, page_size,
# Hkv, D) - and per sequence a row of `page_table` that lists its pages in order, with
# `seqused_k[b]` (stage 13) the number of keys sequence b holds: FlashAttention's and vLLM's layout.
# A sequence grows a page at a time, and pages are shared and freed without copying. The kernel
# changes in its producer (and in `seq_info`, which every role calls): a KV tile of 128 keys, one
# TMA load in stage 13, becomes 128 / r TMA boxes of r = min(page_size, 128) rows, each from the
# page that holds its keys, all counted on the ring slot's one full barrier. The notebook imports
# the stage file and displays it; it never pastes kernel code. Every number measured here is
# Hopper's; the Blackwell track is section 5.7.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage14_paged_kv.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; everything else
# (a paged cache built and read back on the CPU, the producer's box loop run on integers from
# the kernel's own source, the compile summaries, the measured tables read from
# `docs/results/`) runs in both modes. Source: `notebooks/source/stage14_paged_kv.py`.

# %%
import json
import os
import sys

import torch

# The repository root (it holds `common` and `stages`): the first folder upwards that has `common`.
ROOT = os.getcwd()
while not os.path.isdir(os.path.join(ROOT, "common")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from common import attention_host, checks  # noqa: E402
from common.tools import exercises, stage_table  # noqa: E402
from common.tools import notebook as nb  # noqa: E402
from notebooks.figures import stage14 as figures  # noqa: E402

nb.start(14)
stage14 = stage_table.track_module(14, "hopper")
PAGE_SIZES = (16, 32, 64, 128, 256)  # every size the kernel takes up to 256


def paged_kernel(page_size, B=1, H=32, Hkv=8, D=128):
    """Stage 14's kernel object for a paged decode step (Sq = 1, bf16) with pages of page_size
    keys, built as the launch builds it (common.attention_host.compile_args; building it
    compiles nothing). The cells below run its methods' source on Python ints."""
    return stage14.compile_args(
        torch.bfloat16, (B, H, 1, 64 * page_size, D), kv_heads=Hkv, page_size=page_size
    )[0]


def paged_cache(k, v, used, page_size, spare_pages=3, seed=14):
    """k, v (B, Hkv, Sk, D) as a paged cache of sequences of used[b] keys: (k_cache, v_cache)
    (num_pages, page_size, Hkv, D) and page_table int32 (B, max_pages), on k's device. Each
    sequence's pages are drawn in random order from a pool with spare_pages pages nobody owns;
    NaN in those pages and in the rows past used[b] of each last page, -1 in page_table past a
    sequence's pages (one spare column, so that every row has such an entry)."""
    B, Hkv, _, D = k.shape
    pages_of = [-(-n // page_size) for n in used]
    num_pages = sum(pages_of) + spare_pages
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    k_cache = torch.full(
        (num_pages, page_size, Hkv, D), float("nan"), dtype=k.dtype, device=k.device
    )
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.full((B, max(pages_of) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(used):
        for i in range(pages_of[b]):
            page = order.pop()
            table[b, i] = page
            rows = min(page_size, n - i * page_size)  # keys i P .. i P + rows - 1
            # (Hkv, rows, D) -> (rows, Hkv, D)
            k_cache[page, :rows] = k[b, :, i * page_size : i * page_size + rows].transpose(0, 1)
            v_cache[page, :rows] = v[b, :, i * page_size : i * page_size + rows].transpose(0, 1)
    return k_cache, v_cache, table.to(k.device)


# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - find a key in a paged cache - key $t$ of sequence $b$ is row $t \bmod P$ of page
#   `page_table[b, t // P]` - and say how many pages a sequence owns and how much of its last
#   page it leaves unused;
# - say why the kernel takes page sizes 16, 32, 64 or multiples of 128, and how many TMA boxes
#   of how many bytes one KV tile becomes at each;
# - explain why a KV tile of 8 boxes still has one full barrier and one `expect_tx` of 32 KiB;
# - follow the clamp to the last page: which `page_table` entries the producer reads, and why
#   none past $\lceil \text{seqused\_k} / P \rceil$ may be read;
# - name the three kinds of memory that may hold NaN, and why none reaches O;
# - read the measured decode table (H100 80GB HBM3, 2026-12-06): what pages cost against stage
#   13's contiguous cache in GPU time, and where the host's work per call sets the pace.
#
# ## 2. Previous stage recap
#
# Stage 13 cuts each work tile's KV range into splits, each its own work tile, and merges the
# splits' fp32 partial O and LSE in a combine kernel; `seqused_k` lets sequence $b$ use only
# the first `seqused_k[b]` keys of a cache allocated longer, the keys past it masked and their
# V rows zeroed in shared memory. On a decode step at batch 1 with 32 query and 8 KV heads and
# 32k keys it read K and V at 1,732 GB/s with calls back to back and 3,063 GB/s in GPU time
# alone (H200, 2026-12-04, `docs/results/decode_h200_2026-12-04.md`, the kernel as it was then;
# notebook 13's section 7.1 gives the kernel as it is, on an H100). Its K and V are contiguous
# tensors (B, Hkv, Sk, D): a server would allocate every sequence's longest length up front, or
# copy its cache as it grows.
#
# ## 3. The math
#
# ### 3.1 The address of a key
#
# With pages of $P$ keys, sequence $b$ of $n_b$ = `seqused_k[b]` keys owns the pages named by
# the first $\lceil n_b / P \rceil$ entries of its `page_table` row, in the order of its keys:
#
# $$K_b[t] = \texttt{k\_cache}\big[\,\texttt{page\_table}[b, \lfloor t / P \rfloor],\;
# t \bmod P\,\big], \qquad 0 \le t < n_b ,$$
#
# and the same for V. Its last page holds $n_b - (\lceil n_b / P \rceil - 1) P$ keys; the rest
# of that page, fewer than $P$ rows, is unused, and so is every entry of the row after its
# pages. A contiguous cache gives every sequence the longest length $\max_b n_b$ (or a length
# fixed in advance); a paged one gives it $\lceil n_b / P \rceil P$ keys.
#
# The cell builds a paged cache on the CPU (`paged_cache`, defined in the first cell: pages in
# random order, NaN in the pages nobody owns and in the unused tail of each last page, -1 in the
# table past a sequence's pages), reads every key back by the formula and compares it with the
# contiguous K; then it counts the keys each layout allocates for `make bench`'s packed batch
# of 16 sequences (lengths drawn from 64 to 2,047 keys, `nb.varlen_lengths()`).

# %%
used = [40, 75, 18]  # keys of three sequences
P = 16
g = torch.Generator().manual_seed(14)
k = torch.randn(len(used), 2, max(used), 8, generator=g)  # (B, Hkv, Sk, D), small
v = torch.randn(len(used), 2, max(used), 8, generator=g)
k_cache, v_cache, table = paged_cache(k, v, used, P)
for b, n in enumerate(used):
    t = torch.arange(n)
    # K_b[t] = k_cache[page_table[b, t // P], t % P]: (n, Hkv, D) -> (Hkv, n, D)
    gathered = k_cache[table[b, t // P].long(), t % P].transpose(0, 1)
    print(
        f"sequence {b}: {n} keys, entries 0-{-(-n // P) - 1} of its row "
        f"{table[b].tolist()}, read back exactly: {torch.equal(gathered, k[b, :, :n])}"
    )
nan_rows = int(torch.isnan(k_cache[:, :, 0, 0]).sum())
print(
    f"k_cache {tuple(k_cache.shape)}: {nan_rows} of {k_cache.shape[0] * P} rows hold NaN "
    "(pages nobody owns, the tails of last pages); no key of any sequence lies there"
)

lengths = nb.varlen_lengths()
rows = [("contiguous, longest length", f"{len(lengths) * max(lengths):,}", "-")]
for p in PAGE_SIZES:
    paged = sum(-(-n // p) * p for n in lengths)
    rows.append((f"pages of {p}", f"{paged:,}", f"{paged - sum(lengths):,}"))
nb.table(("16 sequences, " + f"{sum(lengths):,} keys", "keys allocated", "unused keys"), rows)

# %% [markdown]
# Pages waste at most $P - 1$ keys per sequence, where one contiguous tensor wastes the gap to
# the longest sequence. What a kernel pays for this is the indirection: before it loads a key
# it must read the page's number from `page_table`.
#
# ### 3.2 A KV tile as boxes
#
# The kernel keeps stage 13's KV tile of $b_N = 128$ keys in one ring slot. A TMA box must lie
# in one page (a sequence's pages lie anywhere in the pool, so keys of two pages are not
# neighbours in memory), so the tile is loaded as $128 / r$ boxes of $r = \min(P, 128)$ rows.
# Box $c$ of KV tile $j$ holds keys $128 j + c r, \dots, 128 j + c r + r - 1$, from
#
# $$\text{entry} = \min\!\Big(\Big\lfloor \frac{128 j + c r}{P} \Big\rfloor,\;
# \Big\lfloor \frac{n_b - 1}{P} \Big\rfloor\Big), \qquad
# \text{first row} = (128 j + c r) \bmod P .$$
#
# Below 128, $r = P$ must divide 128 for the boxes to fill a slot exactly: $P \in \{16, 32,
# 64\}$ (8 is possible in principle; the stage stops at a box of 16 rows, 4 KiB at $D = 128$).
# From 128 on, a box is a whole tile and a page must hold whole tiles: $P$ a multiple of 128,
# tile $j$ being tile $j \bmod (P / 128)$ of its page. The $\min$ is the clamp to the last page
# (section 5.4): a box whose keys all lie at or past $n_b$ reads the last page again, so no
# entry past $\lceil n_b / P \rceil - 1$ is read. The cell gives the numbers for $D = 128$, bf16,
# from the kernel object's own `page_rows` and `cta_tile`.

# %%
rows = []
for p in PAGE_SIZES:
    kernel = paged_kernel(p)
    bN, D = kernel.cta_tile[1], kernel.cta_tile[2]
    r = kernel.page_rows
    rows.append(
        (
            p,
            r,
            bN // r,
            f"{r * D * 2 // 1024} KiB",
            bN // r,
            f"{p // bN}" if p >= bN else f"1/{bN // p}",
        )
    )
nb.table(
    (
        "page size P",
        "r = page_rows",
        "boxes per K or V tile",
        "bytes per box (D = 128)",
        "page_table reads per K or V tile",
        "KV tiles per page",
    ),
    rows,
)

# %% [markdown]
# ## 4. What changes
#
# The docstring gives the change and its numbers; then the kernel class's diff against stage 13
# (`make diff-14 TRACK=hopper` shows the whole files). Every hunk is the page: `page_size` and
# `page_rows` in `__init__`; in `__call__` the cache's two middle modes swapped (section 5.2) and
# the TMA atoms of K and V built for a box of (`page_rows`, D) rows,
# the first `page_rows` rows of a slot; the longest key count read from the table's width
# (max_pages x page_size); `page_table` passed to both roles and to `seq_info`; the paged
# partitions in `tma_views`; the last page computed once per work tile in `load`; the box loop
# in `load_tiles`. The consumers' loop does not change: they wait for a full slot and read the
# ring as in stage 13 (only `seq_info`, which every role calls, takes S_k from the table's
# width).

# %%
nb.show_docstring(14, "hopper")

# %%
nb.show_diff(14, "hopper", max_lines=200)

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The page table, drawn
#
# The cache of section 3.1: three sequences of 40, 75 and 18 keys in pages of 16, and three
# pages nobody owns. Above, `page_table` (3, 6): each sequence's entries in the order of its
# keys, -1 after them. Below, the 13 pages in the order they lie in memory, each coloured by its
# owner, with the sequence and entry that name it: a sequence's pages lie anywhere in the pool,
# in any order. Grey is what never reaches O: the pages nobody owns, and the rows of each last
# page past the sequence's keys (8 of 16 for sequence 0, 5 for sequence 1, 14 for sequence 2).

# %%
fig = figures.page_table_map(
    used,
    P,
    table.tolist(),
    k_cache.shape[0],
    title="A paged cache: 3 sequences, pages of 16 keys, 3 pages nobody owns",
)

# %% [markdown]
# Three kinds of memory may hold anything, NaN included, and none reaches O:
#
# - **entries of `page_table` past a sequence's pages** are never read (the clamp,
#   section 5.4): a serving stack leaves -1 there, a freed page, or another sequence's;
# - **pages nobody owns** are never loaded: only entries the host checked name a page;
# - **rows past `seqused_k[b]` in a sequence's last page** are loaded with the keys before them,
#   then masked to $-\infty$ in S, and their V rows zeroed in shared memory before P @ V reads
#   them ($0 \cdot \text{NaN} = \text{NaN}$): stage 13's `seqused_k` handling, unchanged.
#
# ### 5.2 The cache as the kernel sees it: `tma_views`
#
# The cache reaches `__call__` as the caller holds it, (num_pages, page_size, Hkv, D). Its
# first step swaps two modes of the layout, giving (num_pages, Hkv, page_size, D), and stage
# 13's own step then gives the view with the page in the batch mode: (page_size, D, Hkv,
# num_pages). Both are layouts fixed at compile time, so the host makes no permuted view at
# each call. `tma_views` then cuts
# one KV head's pages into boxes of (r, D) with `flat_divide`: (page_size, D, pages) becomes
# (r, D, page_size / r, pages), a box addressed by (box of the page, page); the ring (128, D,
# kv_slots) becomes (r, D, 128 / r, kv_slots), box $c$ of a slot. `seq_info` takes
# $S_k$ = max_pages x page_size, the most keys a row of the table can name, before the
# `seqused_k` clamp of stage 13 - so the kernel never reads past the table even when
# `seqused_k` claims more.

# %%
nb.show_source(14, "hopper", names=["Sm90Kernel.tma_views", "Sm90Kernel.seq_info"])

# %% [markdown]
# ### 5.3 One KV tile: boxes onto one barrier
#
# The producer's step for one K or V tile is `load_tiles`. It waits for the slot's release
# (`producer_acquire`, which also announces the slot's bytes on its full barrier: the pipeline
# was created with `tx_count` = one tile's 32 KiB at D = 128), then issues one TMA copy per box,
# each from the page its first key lies in and each completing its bytes on that same barrier.
# The barrier's phase completes once all 32 KiB have landed, 4 KiB at a time at page size 16, so
# the consumers wait exactly as in stage 13. The loop is not unrolled (`unroll=1`): the
# producer warpgroup gives its registers to the consumers and keeps 24 per thread.
#
# `load` computes the sequence's last page once per work tile and passes it in `pages`:
# `(mPageTable, batch, (seqlen_k - 1) // self.page_size)`.

# %%
nb.show_source(14, "hopper", names=["Sm90Kernel.load_tiles"])

# %% [markdown]
# The cell runs that method on integers: `exercises.box_reads` compiles its source as plain
# Python (no `@cute.jit`), with `cutlass.range` as Python's `range` and the TMA copy replaced
# by a recorder, and calls it for K of every KV tile of one sequence of a decode step. Three
# cases: the last KV tile (keys 1,024-1,151) of a sequence of 1,100 keys in pages of 16 and of
# one of 1,040 keys in pages of 64, and tile 3 of 1,100 keys in pages of 256. The sequence's
# pages are 200, 201, ... in its row, -1 after them.

# %%
BOX_CASES = ((1100, 16, 8), (1040, 64, 8), (1100, 256, 3))  # (seqused_k, page size, KV tile)
panels, rows = [], []
for n, p, tile in BOX_CASES:
    own = -(-n // p)
    row = [200 + i for i in range(own)] + [-1] * 3
    boxes = [r for r in exercises.box_reads(paged_kernel(p), n, row) if r[0] == tile]
    panels.append((f"pages of {p}: KV tile {tile} of a sequence of {n:,} keys", p, n, boxes, own))
    for _, c, entry, page, first_row in boxes:
        key = tile * 128 + c * min(p, 128)
        rows.append((p, tile, c, key, entry, page, first_row, "yes" if key >= n else ""))
fig = figures.tile_boxes(panels, title="One KV tile as TMA boxes, all on the slot's full barrier")
nb.table(
    (
        "page size",
        "KV tile",
        "box c",
        "first key",
        "entry read",
        "page",
        "first row",
        "no key < seqused_k",
    ),
    rows,
)

# %% [markdown]
# At page size 16 the last tile of 1,100 keys is 8 boxes: boxes 0-4 read entries 64-68, the
# sequence's last five pages (box 4 holds keys 1,088-1,103, of which 1,100-1,103 are past the
# sequence), and boxes 5-7, which hold no key of it, read entry 68 again. At page size 64 box 1
# (keys 1,088-1,151) reads entry 16 again. At page size 256 a tile is one box, rows 128-255 of
# the page of entry 1: stage 13's single load from a coordinate the table gives.
#
# ### 5.4 The clamp to the last page
#
# The clamp, `cutlass.min(key // self.page_size, last_page)`, keeps every box inside the
# sequence's own entries. The cases below run `load_tiles` for K of every KV tile of a decode
# step and count the entries read: five sequences, among them a row whose 33 entries are all
# the sequence's own (1,056 keys in pages of 32: its last KV tile, keys 1,024-1,151, reaches
# three entries past the row's end) and a sequence of one key. With pages of 128 or more the
# last tile never reaches past the last page (a page holds whole tiles): the clamp never acts.

# %%
rows = []
for n, p, max_pages in exercises.PAGE_CASES:
    own = -(-n // p)
    row = [100 + i for i in range(own)] + [-1] * (max_pages - own)
    reads = exercises.box_reads(paged_kernel(p), n, row)
    wrong, unchecked, past_row = exercises.page_reads_summary(reads, n, p, max_pages)
    clamped = sum(1 for t, c, _, _, _ in reads if t * 128 + c * min(p, 128) >= n)
    top = max(e for _, _, e, _, _ in reads)
    rows.append(
        (f"{n:,}", p, f"{own} of {max_pages}", len(reads), clamped, top, unchecked + past_row)
    )
nb.table(
    (
        "seqused_k",
        "page size",
        "entries its own",
        "boxes (K)",
        "boxes with no key: last page again",
        "highest entry read",
        "entries read past its pages",
    ),
    rows,
)

# %% [markdown]
# The entries past a sequence's pages are exactly those the host does not check:
# `check_page_table` (section 5.5) checks the first $\lceil n_b / P \rceil$ entries of each row,
# each a page of the cache, and nothing after them. Inside a captured CUDA graph the host checks
# nothing, and the kernel's two clamps are the only guard: `seq_info` clamps `seqused_k` to the
# table's width, and `load_tiles` the entry to the last page. Exercise 14a removes the second.
#
# ### 5.5 The host side: `attention_paged`
#
# `attention_paged(q, k_cache, v_cache, page_table, seqused_k, ...)` checks the arguments'
# shapes, dtypes and strides (`check_paged_args`, once per argument signature), reads
# `seqused_k` and `page_table` to the host to check their values (`check_page_table`; a copy
# and a synchronisation, once per tensor and version - PyTorch's version counter, which every
# in-place write to a tensor advances), and launches stage 13's plan with the cache as it is
# and the table. Tensors made under
# `torch.inference_mode()` carry no version counter, so for them the values are read at every
# call (section 7.2). `check_values=False` skips the read, for a caller whose own allocator
# wrote the table.

# %%
nb.show_function(attention_host.attention_paged)
nb.show_function(checks.check_page_table)

# %% [markdown]
# ### 5.6 What the compiler produced
#
# The stage's compile shape (unpaged: stage 13's kernel with the new arguments), then the paged
# kernel of a decode step at page sizes 16 and 256. The cell compares them: the same `wgmma`,
# exponentials and TMA load instructions (the box loop is one TMA instruction in a loop that is
# not unrolled), and the same two `expect_tx` byte counts at every page size: 32 KiB for each K
# or V slot - the byte count of a tile, whatever the number of boxes that deliver it - and 16 KiB
# for Q's 64-row decode tile.

# %%
report = nb.compile_summary(14, "hopper")
reports = {
    p: nb.compile_summary(
        14, "hopper", shape=(1, 32, 1, 8192, 128), options=dict(kv_heads=8, page_size=p)
    )
    for p in (16, 256)
}
if report is not None and all(r is not None for r in reports.values()):
    from common.tools.ptx import expect_tx_immediates

    for family in ("wgmma.mma_async", "ex2.approx", "cp.async.bulk.tensor (load)"):
        paged = ", ".join(f"pages of {p}: {r.counts[family]}" for p, r in reports.items())
        print(f"{family}: unpaged {report.counts[family]}, {paged}")
    for p, r in reports.items():
        tx = sorted({b for b in expect_tx_immediates(r.ptx) if b is not None})
        print(f"pages of {p}: expect_tx byte counts {tx}")

# %% [markdown]
# ### 5.7 The same stage on Blackwell
#
# The Blackwell kernels are **compile-checked here, not run on hardware** (no sm_100 GPU has run
# them; they are compiled for sm_100a with fake tensors and their PTX is checked). The two cells
# below compare the concepts of `stages/stage14_paged_kv/blackwell.py` with the Hopper file's
# and compile it for sm_100a; where the file is not there, they say so. The paging is the same
# on both tracks: boxes of `page_rows` = min(page_size, 128) keys from the page that holds them,
# all on the slot's one full barrier, the entry clamped to the sequence's last page. On
# Blackwell the boxes are issued by the TMA warp's `load`, which keeps 48 registers, with plain
# tiled TMA atoms laid over the slot's layout (a slot holds K as the MMA reads it); its output
# and the page sizes' cost have not been measured on this track.

# %%
rows = nb.cross_track_table(14)
report_bw = nb.compile_summary(14, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** stage 7's checks, unchanged, through stage 14's unpaged entry (a few $10^{-3}$
# relative error, within 3x PyTorch's own bf16 error; rows with no key O = 0 and LSE = -inf;
# NaN around packed sequences never leaks in). Then the paged cache: four sequences of 1, 1,100,
# 333 and 4,097 keys with 32 query and 8 KV heads, at every page size from 16 to 256, with the
# launch's split count and with 3 splits, NaN in every page nobody owns and in the tail of each
# last page, -1 in the table past each sequence's pages. Each sequence's O and LSE must match
# the fp64 reference on its own keys. With the forced split count they must also equal stage
# 14's unpaged kernel (`attention` with `seqused_k`) bit for bit: the same arithmetic per KV
# tile, only the addresses differ.

# %%
result = nb.run_and_verify(14, (2, 4, 512, 1024, 128))
checks_run = nb.run_and_verify_cases(
    14,
    list(nb.MASK_CASES)
    + [
        ("decode, 32 / 8 heads, the launch's splits", (1, 32, 1, 8269, 128), dict(kv_heads=8)),
        ("speculative, Sq = 4, causal", (1, 32, 4, 4097, 128), dict(kv_heads=8, causal=True)),
    ],
)
packed_checks = nb.run_and_verify_varlen(
    14, [200, 77, 0, 300, 1], [130, 190, 5, 129, 260], heads=4, kv_heads=2, causal=True
)

# %%
if nb.MODE == "gpu" and nb.available(14, nb.TRACK):
    from common.tools import inputs, verify

    paged_used = [1, 1100, 333, 4097]
    B, H, Hkv, D = len(paged_used), 32, 8, 128
    q, _, _ = inputs.attention_inputs(B, H, 1, 1, D, seed=7)
    _, k_gpu, v_gpu = inputs.attention_inputs(B, Hkv, 1, max(paged_used), D, seed=8)
    seqused = torch.tensor(paged_used, dtype=torch.int32, device=q.device)
    rows = []
    for p in PAGE_SIZES:
        kc, vc, pt = paged_cache(k_gpu, v_gpu, paged_used, p, seed=p)
        for splits in (None, 3):
            o, lse = stage14.attention_paged(
                q, kc, vc, pt, seqused, return_lse=True, num_splits=splits
            )
            errors = []
            for b, n in enumerate(paged_used):
                # sequence b's own keys, K and V heads repeated to H for the reference
                kf, vf = (
                    t[b : b + 1, :, :n].repeat_interleave(H // Hkv, dim=1) for t in (k_gpu, v_gpu)
                )
                o_chk, _ = verify.check_attention(
                    f"pages of {p}, sequence {b}",
                    o[b : b + 1],
                    q[b : b + 1],
                    kf,
                    vf,
                    lse=lse[b : b + 1],
                )
                errors.append(o_chk.rel_err)
            same = "-"
            if splits is not None:
                o1, lse1 = stage14.attention(
                    q, k_gpu, v_gpu, return_lse=True, num_splits=splits, seqused_k=seqused
                )
                same = torch.equal(o, o1) and torch.equal(lse, lse1)
                assert same, f"pages of {p}: paged and unpaged differ"
            nan = bool(torch.isnan(o).any())
            assert not nan, f"pages of {p}: NaN in O"
            rows.append((p, splits or "launch's", f"{max(errors):.1e}", nan, same))
    torch.cuda.synchronize()
    nb.table(
        (
            "page size",
            "splits",
            "O: worst relative error",
            "NaN in O",
            "== unpaged, bit for bit",
        ),
        rows,
    )
else:
    print("the paged checks (NaN planted in the cache, -1 in the table) need GPU mode")

# %%
fig = nb.error_picture(14, result)

# %% [markdown]
# ## 7. Measure
#
# ### 7.1 Decode steps by page size
#
# `make bench`'s decode rows on an NVIDIA H100 80GB HBM3 (2026-12-06, bf16, $S_q$ = 1, D = 128;
# `docs/results/decode_h100_2026-12-06_split_launch.md`), the kernels as they are: stage 13 on
# contiguous K and V and stage 14 on a paged copy of them (pages in random order) at page sizes 16,
# 64, 128 and 256, timed in the same interleaved rounds, inputs rotated past L2. The cell reads the
# run's `.json` file and gives stage 14's GB/s of K and V over stage 13's (1.00: as fast as the
# contiguous cache), in GPU time alone (the kernels' durations) and with calls back to back between
# CUDA events (host work included), with stage 13's time per call in microseconds.

# %%
with open(os.path.join(nb.ROOT, "docs/results/decode_h100_2026-12-06_split_launch.json")) as f:
    decode = json.load(f)
BENCH_PAGES = (16, 64, 128, 256)
print(f"{decode['gpu']}, {decode['date']}, torch {decode['torch']}: stage 14 / stage 13")
for kind, label in (("13 decode GPU", "GPU time alone"), ("13 decode", "calls back to back")):
    rows = []
    for r in decode["rows"]:
        if r["stage"] != kind:
            continue
        B, H, Hkv, _, Sk_, _ = r["shape"]
        t = r["tflops"]
        rows.append(
            (
                B,
                f"{H}/{Hkv}",
                f"{Sk_ // 1024}k",
                f"{r['ms']['stage 13'] * 1e3:.1f}",
                *(f"{t[f'14 p{p}'] / t['stage 13']:.2f}" for p in BENCH_PAGES),
            )
        )
    print(label)
    nb.table(("B", "heads", "Sk", "stage 13, us", *(f"page {p}" for p in BENCH_PAGES)), rows)
fig = figures.paged_ratios(
    decode["rows"],
    BENCH_PAGES,
    title=f"Stage 14 on pages / stage 13, decode steps ({decode['gpu']}, {decode['date']}, bf16)",
)

# %% [markdown]
# Read from the tables (H100 80GB HBM3, 2026-12-06):
#
# - **In GPU time, pages of 64 keys or more cost 0-4%** (0.96-1.00 of stage 13) in every row,
#   B = 1 at 8k included.
# - **Pages of 16 keys cost 2-5% in GPU time** (0.95-0.98): every K or V tile is 8 boxes of
#   4 KiB instead of one of 32 KiB, each issued by the producer after its own `page_table` read.
# - **Back to back at B = 1 with 8 KV heads, at 8k and 32k, the host sets the pace**: every page
#   size reads at 0.86-0.90 of stage 13 there: these calls are short, and a paged call costs the
#   host more (section 7.2 measures an unsplit call, 4.9 us more back to back; a split paged call
#   has not been timed on the launch path as it is: with that of 2026-12-05 it took 34.5 us of
#   host time with `check_values=False` against 28.3 for a split stage 13 call, H100 80GB HBM3,
#   `docs/results/host_time_fast_path_ab_h100_2026-12-05.txt`). In the other rows the GPU work
#   dominates and the ratios are those of GPU time.
#
# Over 16 rows (B = 1-64, 4k-256k keys; H100 80GB HBM3, 2026-12-07,
# `docs/results/decode_h100_2026-12-07_sweep.md`) pages of 64 keys or more read 0.94-0.995 of stage
# 13 in GPU time (below 0.95 only at B = 1, 4k, with pages of 128 and 256: 0.944 and 0.947, where
# the run of the same day that timed SDPA differently read 0.955) and pages of 16 0.92-0.97.
#
# On the H200 (2026-12-04, `docs/results/decode_h200_2026-12-04.md`), with the kernel and launch
# path as they were then (128-row tiles, two host calls for a split launch), pages of 64 keys or
# more cost 0-3% in GPU time except at B = 1 with 8k keys (0.85), and pages of 16 keys 9-18%;
# the kernel as it is has not run on an H200.
#
# ### 7.2 Host work per call
#
# `python -m common.tools.host_time --calls 1000 --rounds 3 --profile` (notebook 13, section 7.2)
# times a tiny decode step (K and V of 256 keys; stage 14 on pages of 64 keys) under
# `torch.inference_mode()`. The cell prints a run of the launch path as it is (NVIDIA H100 80GB
# HBM3, 2026-12-07, `docs/results/host_time_h100_2026-12-07_scratch_lse.txt`), and cProfile's view
# of a paged call whose tables were made outside inference mode.

# %%
HOST_TIME = "docs/results/host_time_h100_2026-12-07_scratch_lse.txt"
with open(os.path.join(nb.ROOT, HOST_TIME)) as f:
    text = f.read()
table, _, profiles = text.partition("cProfile of 1000 calls: stage 12\n")
skip = ("round ", "Warning", "_warn_once")  # progress lines and a profiler warning
print("\n".join(ln for ln in table.splitlines() if not any(w in ln for w in skip)))
paged = "cProfile of 1000 calls: stage 14, paged (64 keys a page)\n"
print(paged + profiles.split(paged)[1].split("cProfile of")[0])

# %% [markdown]
# A paged call takes 22.8 us back to back and 23.9 of host time with its tables made outside
# inference mode, 20.8 and 21.8 with `check_values=False`, against an unsplit stage 13's 17.9 / 18.1
# and SDPA's 16.0 / 15.4 (H100 80GB HBM3, 2026-12-07, the same run). What the checks cost per call
# is a lookup: `seqused_k` and `page_table` were read to the host once and remembered with their
# version counters (section 5.5), and a call that finds them unchanged asks nothing else - not even
# whether a CUDA graph is being captured, which is needed only before a read. Tables made under
# `torch.inference_mode()` carry no version counter, so they are read at every call, each read a
# copy and a synchronisation, then every page a sequence uses is checked in Python: 70.1 us back to
# back. Inside a captured CUDA graph nothing is read and no Python runs at replay
# (`tests/test_stage14.py` replays a paged decode step in a graph as the cache grows a page). The
# cache itself goes to the kernel as the caller holds it (section 5.2): no permuted views to make
# per call. Earlier launch paths, and what each change to it saved: `docs/results/README.md`, *Host
# work per call*.
#
# In GPU mode the cells below time stage 14's unpaged entry against stage 13 (the same kernel)
# and the baselines, then stage 14 on pages of 16, 64 and 256 against stage 13 on one decode
# step (B = 1, 32 / 8 heads, 32k keys) in this run.

# %%
bench = nb.measure(14, [(1, 32, 1, 32768, 128)], also_stages=(13,))

# %%
if nb.MODE == "gpu" and nb.available(13, nb.TRACK) and nb.available(14, nb.TRACK):
    from common.tools import bench as bench_tool
    from common.tools import inputs, timing

    stage13 = stage_table.track_module(13, nb.TRACK)
    B, H, Hkv, Sk_, D = 1, 32, 8, 32768, 128
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
    _, k_gpu, v_gpu = inputs.attention_inputs(B, Hkv, 1, Sk_, D, seed=3)
    kv_bytes = 2 * B * Hkv * Sk_ * D * 2  # K and V, bf16
    fns = {"stage 13": (lambda q, k, v: stage13.attention(q, k, v), [(q, k_gpu, v_gpu)])}
    for p in (16, 64, 256):
        fns[f"stage 14, pages of {p}"] = (
            stage14.attention_paged,
            [(q, *bench_tool.paged_copy(k_gpu, v_gpu, p))],
        )
    for fn, sets in fns.values():
        fn(*sets[0])
    torch.cuda.synchronize()
    events, gpu_time = timing.interleaved(fns, gpu=True)
    gpu_name, date = timing.gpu_and_date()
    nb.table(
        ("kernel", "us back to back", "GB/s", "us GPU time", "GB/s, GPU time"),
        [
            (
                name,
                f"{events[name] * 1e3:.1f}",
                f"{kv_bytes / (events[name] * 1e-3) / 1e9:,.0f}",
                f"{gpu_time[name] * 1e3:.1f}",
                f"{kv_bytes / (gpu_time[name] * 1e-3) / 1e9:,.0f}",
            )
            for name in fns
        ],
    )
    print(f"measured on {gpu_name}, {date}, in this run; K and V of {kv_bytes / 2**20:.0f} MiB")
else:
    print("timing stage 14 on pages against stage 13 needs GPU mode")

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU.
#
# 1. **Pages and waste.** For `seqused_k` = 1,000, 1,024 and 1,025 keys, how many entries of its
#    row does a sequence own at page sizes 16, 64 and 256, how many keys does its last page hold,
#    and how many of its rows are unused?
# 2. **Boxes per decode step.** A decode step at B = 1 with 8 KV heads and 32,768 keys: how many
#    TMA boxes, of how many bytes, and how many `page_table` reads does the producer issue for K
#    and V at page sizes 16, 64 and 256 (no split)? How many with 16 splits?
# 3. **Page sizes the kernel refuses.** Why not pages of 48, 96 or 192 keys? For each, say which
#    box of which KV tile would run past its slot or across two pages.
# 4. **The tile of a page.** With pages of 256 keys, which `page_table` entry and which rows of
#    that page does KV tile $j$ read, for $j = 0, \dots, 5$? And with pages of 384?
# 5. **Drop the clamp** (exercise 14a, an edit of the Hopper stage file): `load_tiles` without
#    `cutlass.min(..., last_page)`. The cells at the end of the notebook give the task and check
#    the edit.
#
# ### Answers and checks
#
# <details><summary>1. Pages and waste</summary>
#
# 1,000 keys: 63 entries of 16 (the last holds 8 keys, 8 rows unused), 16 of 64 (40 keys, 24
# unused), 4 of 256 (232 keys, 24 unused). 1,024 keys: 64, 16 and 4 entries, every page full.
# 1,025 keys: 65, 17 and 5 entries, the last page holding 1 key (15, 63 and 255 rows unused).
# The waste is below one page per sequence, however long. The cell prints the table.
# </details>
#
# <details><summary>2. Boxes per decode step</summary>
#
# 32,768 keys are 256 KV tiles per KV head, 512 K and V tiles, 4,096 over 8 KV heads. Pages of
# 16: 8 boxes of 4 KiB per tile, 32,768 boxes and as many `page_table` reads; pages of 64:
# 8,192 boxes of 16 KiB; pages of 256: 4,096 boxes of 32 KiB, one per tile as in stage 13, each
# after one table read. The bytes are the same 128 MiB in every case; the boxes and reads are
# not. Splits cut the same tiles among more CTAs: 16 splits change which CTA issues a box, not
# how many there are (the splits' ranges cover each tile once, section 5.2 of notebook 13).
# </details>
#
# <details><summary>3. Page sizes the kernel refuses</summary>
#
# Below 128 a box is a whole page, and the boxes must fill a 128-row slot: with 48, tile 0's
# third box (keys 96-143, page 2) would run 16 rows past the slot into tile 1's keys, and tile 1
# would start at row 32 of a page; with 96, tile 0's second box (keys 96-191) would run 64 rows
# past. From 128 on a box is a whole tile and a page must hold whole tiles: with 192, tile 1
# (keys 128-255) lies across pages 0 and 1 (rows 128-191 of one, 0-63 of the other), and one
# box cannot reach two pages that lie anywhere in the pool. Boxes of gcd(P, 128) rows (16 for 48,
# 32 for 96, 64 for 192) would work, for more boxes per tile; the stage keeps one rule,
# r = min(P, 128), and `check_paged_args` refuses every size but 16, 32, 64 and multiples of 128
# with that reason.
# </details>
#
# <details><summary>4. The tile of a page</summary>
#
# Pages of 256: tile $j$ reads entry $\lfloor j / 2 \rfloor$, rows $128 (j \bmod 2)$ to
# $128 (j \bmod 2) + 127$ - entries 0, 0, 1, 1, 2, 2 for $j = 0, \dots, 5$. Pages of 384 (3
# tiles a page): entries 0, 0, 0, 1, 1, 1, rows 0, 128, 256, 0, 128, 256. The cell runs
# `load_tiles` on both.
# </details>
#
# <details><summary>5. Drop the clamp (14a)</summary>
#
# 1,100 keys in pages of 16: the sequence owns entries 0-68; its last KV tile's boxes 5-7 read
# entries 69, 70 and 71 instead of 68. 1,056 keys in a row of 33 pages of 32: boxes 1-3 of the
# last tile read entries 33-35, past the row's end: the next sequence's row, or past the table
# for the last sequence. One key in pages of 16: 7 boxes, entries 1-7. Pages of 256: no change,
# since a page holds whole tiles. What those entries hold is what nobody checked: -1 or a huge
# number (TMA fills a box whose coordinate lies outside the cache with zeros), a freed page
# being rewritten, another sequence's page. The keys those boxes bring are all at or past
# `seqused_k`, so they are masked and their V rows zeroed: O stays right. What the clamp keeps
# is the guarantee of section 5.1 - no memory the sequence does not own is read, and nothing
# past the table - which matters inside a CUDA graph, where the host checks nothing.
# </details>

# %%
# Exercise 1: entries owned, keys in the last page, unused rows.
rows = []
for n in (1000, 1024, 1025):
    for p in (16, 64, 256):
        own = -(-n // p)
        last = n - (own - 1) * p
        rows.append((f"{n:,}", p, own, last, p - last))
nb.table(("seqused_k", "page size", "entries owned", "keys in the last page", "unused rows"), rows)

# Exercise 2: boxes and table reads of one decode step, K and V, 8 KV heads, 32,768 keys.
tiles = 2 * 8 * (32768 // 128)  # K and V tiles over the KV heads
for p in (16, 64, 256):
    r = paged_kernel(p).page_rows
    print(f"pages of {p}: {tiles * 128 // r:,} boxes of {r * 128 * 2 // 1024} KiB, as many reads")

# Exercise 3: which rule each refused size breaks.
for p in (48, 96, 192):
    if p < 128:
        print(f"pages of {p}: boxes of {p} rows fill a 128-row slot: {128 % p == 0}")
    else:
        print(f"pages of {p}: a page holds whole 128-key tiles: {p % 128 == 0}")

# Exercise 4: the entry and rows of KV tiles 0-5, the kernel's own load_tiles on ints.
for p in (256, 384):
    reads = exercises.box_reads(paged_kernel(p), 6 * 128, list(range(-(-6 * 128 // p))))
    print(f"pages of {p}:", [(t, e, f"rows {row}-{row + 127}") for t, _, e, _, row in reads])

# %% [markdown]
# ### Exercise 14a: drop the clamp
#
# The first cell gives the task; the second loads the stage file as it is on disk now, compiles
# it (no GPU needed) and runs its `load_tiles` on integers. On the committed file it says "not
# yet".

# %%
nb.exercise("14a")

# %%
nb.check_exercise("14a")

# %% [markdown]
# **Next:** stage 15 adds no kernel: its ring (`stages/stage15_context_parallel/ring.py`) runs this
# stage's kernel over several GPUs, and
# [`stage15_context_parallel.ipynb`](stage15_context_parallel.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped:
# [`docs/notes/stage14.md`](../docs/notes/stage14.md).
