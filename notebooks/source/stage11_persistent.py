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
# # Stage 11 - persistent CTAs: one CTA per SM walks the work tiles
#
# This notebook walks through `stages/stage11_persistent/hopper.py`: stage 10's kernel - a TMA
# producer warpgroup, two consumer warpgroups in ping-pong, QK^T of one KV tile issued with PV
# of the last - launched on at most one CTA per SM instead of one CTA per work tile. Each CTA
# walks work tiles: a fixed share where the tiles are equal, tiles drawn from an atomic counter
# where a mask makes them unequal, longest first, in sections whose K and V fit in L2. The
# notebook imports the stage file and displays it; it never pastes kernel code. The Blackwell
# stage 11, compile-checked only, is section 5.8.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage11_persistent.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; everything else (the
# tile-order and timeline models, the hand-over model, the compile summaries) runs in both modes.
# Source: `notebooks/source/stage11_persistent.py`.

# %%
import dataclasses
import json
import os
import sys

import torch

# The repository root (it holds `common` and `stages`): the first folder upwards that has `common`.
ROOT = os.getcwd()
while not os.path.isdir(os.path.join(ROOT, "common")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from common import attention_host, masks  # noqa: E402
from common.tools import notebook as nb  # noqa: E402
from common.tools import stage_table, tile_scheduler  # noqa: E402
from common.tools.ptx import ptx_lines  # noqa: E402
from notebooks.figures import stage11 as figures  # noqa: E402

nb.start(11)


def stage_kernel(stage, D=128, **settings):
    """The kernel object of Hopper stage `stage` at head dim D, bf16, with `settings` in place
    of what its __init__ writes (nb.kernel_settings). Building it compiles nothing; the models
    below call its plain methods (tile_coords, q_full_parity, ...)."""
    with nb.kernel_settings(stage, "hopper", **settings):
        module = stage_table.track_module(stage, "hopper")
        return module.compile_args(torch.bfloat16, (1, 1, 128, 128, D))[0]


# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - say what a CTA pays before its first GEMM, and why a grid of causal tiles ends in a tail:
#   a grid takes at least max(work / SMs, the longest tile);
# - read the persistent loop: a grid of min(tiles, SMs) CTAs, the fixed share (CTA $c$ takes
#   $c, c + \text{gridDim.x}, \ldots$) and the tile counter (one atomic add per tile, zeroed by
#   the host at every call that reads it);
# - follow a tile number from the producer to the consumers with its Q (`tile_id`, `q_full`,
#   `q_empty`) and compute both barriers' parities for any tile;
# - say which tiles `first_nonempty_tile` skips in packed sequences and why;
# - compute the order of the tiles for a shape - longest first, in sections of a power of two
#   (head, sequence) pairs whose K and V fit in the 50 MiB L2 - and draw which SM runs which tile;
# - do the shared-memory arithmetic of O's own buffer: 5 K/V slots instead of 6 at D = 128;
# - read the measured step from stage 10 to stage 11 (H200, 2026-12-04): where it gains, and
#   where it is slower.
#
# ## 2. Previous stage recap
#
# Stage 10 runs 384 threads per CTA: a producer warpgroup that gives its registers away (24 per
# thread) and issues every TMA load, and two consumer warpgroups (240 registers) that take turns
# on the tensor cores; inside a warpgroup, $QK_j$ is issued with $PV_{j-1}$ and the softmax of
# tile $j$ runs under the PV. Both roles already walk *work tiles* - a work tile is one 128-row
# Q tile of one (head, sequence) - in a loop: `tile = blockIdx.x`, then `tile + gridDim.x`. But
# the grid has one CTA per tile, so every loop runs once. O is staged in shared memory over Q's
# bytes, and the K/V ring takes what is left of 227 KiB: 6 slots at D = 128, 13 at D = 64. One
# CTA fits an SM (225 KiB of shared memory), and the hardware starts the next CTA of the grid on
# an SM when the CTA before it there has ended.
#
# ## 3. The math
#
# ### 3.1 What a grid of tiles costs
#
# Work tile $t$ has $w_t$ KV tiles, each one QK^T, a softmax and one PV. On $P$ SMs, one tile at a
# time per SM, no order can end before
#
# $$T \;\ge\; \max\Big(\tfrac{1}{P}\textstyle\sum_t w_t,\ \max_t w_t\Big).$$
#
# Without a mask every tile of a (B, H, S, D) launch has $w_t = S_k / 128$, and the grid runs in
# $\lceil \text{tiles} / P \rceil$ rounds of equal tiles. Under a causal mask ($S_q = S_k$) Q tile
# $m$ sees KV tiles $0..m$: $w = m + 1$, from 1 to $S/128$. Two costs come on top of the sum:
#
# - **Set-up.** Before its first GEMM a CTA initialises its barriers, prefetches the TMA
#   descriptors, moves registers with `setmaxnreg`, and waits for Q and the first K tile - with
#   the tensor cores idle. One CTA per tile pays it for every tile; a persistent CTA once.
# - **The tail.** With unequal tiles, what runs last decides $T$. Stage 10's grid numbers its
#   tiles Q tile fastest, shortest first, so the longest tiles of the last heads start last.
#   *Longest first* (largest $w$ first, each SM taking the next tile when it is free) is the
#   classic LPT (longest processing time first) rule: the last tiles to start are the
#   shortest, and the SMs end close together.
#
# The cell below counts the paper shape (B x S = 16k, H x D = 2048) at S = 8k.

# %%
rows = []
for D in (128, 64):
    for causal in (False, True):
        S = 8192
        B, H = 16384 // S, 2048 // D
        plan = tile_scheduler.launch_plan(stage_kernel(11, D), B, H, S, S, causal)
        w = [t.kv_tiles for t in plan.tiles]
        rows.append(
            (
                D,
                causal,
                len(w),
                f"{min(w)}-{max(w)}",
                sum(w),
                f"{sum(w) / 132:.1f}",
                f"{len(w) / 132:.1f}",
                plan.grid,
            )
        )
nb.table(
    (
        "D",
        "causal",
        "work tiles",
        "KV tiles per tile",
        "KV tiles in all",
        "per SM (132)",
        "tiles per SM",
        "stage 11 grid",
    ),
    rows,
)

# %% [markdown]
# ### 3.2 The L2 section
#
# The CTAs that run at the same time should read the same K and V, so that L2 serves the
# repeats. A (head, sequence) pair has $S_k \cdot 2D$ elements of K and V; an L2 of 50 MiB
# (`l2_bytes` = 50 x 2^20: the H100's and the H200's) holds
#
# $$\text{fit} = \Big\lfloor \frac{\texttt{l2\_bytes}}{2D \cdot 2\,\text{B} \cdot S_k}\Big\rfloor
# \text{ pairs,} \qquad
# \texttt{l2\_heads} = \min\big(2^{\lfloor \log_2 \text{fit} \rfloor},\ \text{pairs} \mathbin{\&}
# (-\text{pairs})\big),$$
#
# rounded down to a power of two (FlashAttention's LPT tile scheduler rounds the same way) and
# capped at the largest power of two that divides the number of pairs, so that the sections cut
# the pairs evenly. Inside a section the tiles go longest first across all its pairs: every
# pair's last Q tile, then every pair's second last, and so on. The rule, as the notebook's
# model computes it (the kernel's own `l2_section_heads` is device code; the tests run its
# source on integers and compare):

# %%
nb.show_function(tile_scheduler.l2_section_heads)
k128, k64 = stage_kernel(11, 128), stage_kernel(11, 64)
rows = []
for S in (1024, 2048, 4096, 8192, 16384):
    for kernel in (k128, k64):
        D = kernel.cta_tile[2]
        B, H = 16384 // S, 2048 // D
        heads = tile_scheduler.l2_section_heads(kernel, S, B * H)
        per_pair = S * 2 * D * 2
        rows.append(
            (
                S,
                D,
                B * H,
                f"{per_pair / 2**20:g} MiB",
                kernel.l2_bytes // per_pair,
                heads,
                f"{heads * per_pair / 2**20:g} MiB",
                heads * -(-S // 128),
            )
        )
nb.table(
    (
        "S",
        "D",
        "pairs",
        "K, V per pair",
        "fit",
        "l2_heads",
        "K, V of a section",
        "tiles per section",
    ),
    rows,
)

# %% [markdown]
# ## 4. What changes
#
# The docstring gives the changes with their numbers; then the start of the kernel class's diff
# against stage 10 (`make diff-11 TRACK=hopper` shows the whole files). The loop inside a tile is
# untouched: the diff is the grid and its two decisions in `__call__` (the fixed share or the
# counter, the section size), the tile number handed over with Q, `next_tile`,
# `first_nonempty_tile`, `tile_coords` with sections, and O's buffer.

# %%
nb.show_docstring(11, "hopper")

# %%
nb.show_diff(11, "hopper", max_lines=160)

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The grid and the two schedulers
#
# `__call__` counts the work tiles - Q tiles x heads x sequences - and launches
# `min(tiles, sm_count)` CTAs (`device_sm_count`: 132 on the H100 and the H200). The producer
# starts with tile `blockIdx.x` and hands every tile to the consumers with its Q (section 5.3).
# Then `next_tile` decides, from one run-time value, `dynamic`:
#
# - **Fixed share** (`dynamic = 0`): batch mode without a causal or window cut, where every tile
#   has the same work. CTA $c$ takes $c, c + \text{gridDim.x}, \ldots$ - no memory traffic, and
#   no order is better than another.
# - **Tile counter** (`dynamic = 1`): under a mask, and for packed sequences. Lane 0 of the
#   producer warp adds 1 to `tile_counter` (`atom.global.add`) and gets the old value, its
#   *ticket*; the shuffle hands it to the warp's other lanes; the next tile is
#   $\text{gridDim.x} + \text{ticket}$ (tiles $0 .. \text{gridDim.x} - 1$ are the CTAs' first).
#   The tickets go out in the order the CTAs ask: a CTA that finishes early asks early, and
#   takes more tiles. A ticket past the last tile ends the CTA.
#
# The producer draws once it has issued the current tile's last load - the consumers are then a
# few KV tiles (the ring's depth) from the end of that tile - so the next tile's number and Q are
# on their way before the consumers need them. `dynamic` is an argument, not a compile-time
# constant: one compiled kernel serves masked and unmasked launches.

# %%
nb.show_source(11, "hopper", names=["Sm90Kernel.next_tile"])

# %% [markdown]
# The counter must read 0 when the kernel starts, at every call: a count left over from the
# call before would skip that many tiles (O of those tiles never written). The host hands the
# kernel a fresh zeroed `int32` wherever the kernel draws from it, and an unset one where it
# does not (no fill kernel for the fixed share):

# %%
nb.show_function(attention_host.tile_counter)

# %% [markdown]
# ### 5.2 Which SM runs which tile
#
# A model of the grid from the kernel's own numbering (`tile_scheduler.launch_plan` calls the
# kernel objects' `tile_coords`, and `common.masks.kv_tile_range` gives each tile's KV tiles):
# 8 SMs, one sequence of 3 heads, S = 2048, causal - 48 work tiles of 1 to 16 KV tiles. Time
# is counted in KV tiles, and each CTA's set-up is *assumed* to take one KV tile (a figure for
# the picture: the kernel's own was not measured). Four schedules:
#
# 1. stage 10: one CTA per tile, started in tile-number order on the next free SM (the model
#    assumes the hardware starts a grid's CTAs in `blockIdx` order);
# 2. the fixed share on the same causal tiles, in stage 11's order - what stage 11 would do if
#    it did not draw under a mask;
# 3. the tile counter, shortest first (`longest_first = False`);
# 4. stage 11: the tile counter, longest first. The producer draws `kv_slots / 2` KV tiles before
#    the end of its tile.

# %%
sms, B_, H_, S_ = 8, 1, 3, 2048
k10 = stage_kernel(10)
k11 = stage_kernel(11, sm_count=sms)
k11_shortest = stage_kernel(11, sm_count=sms, longest_first=False)
lead = k11.kv_slots / 2
plan10 = tile_scheduler.launch_plan(k10, B_, H_, S_, S_, causal=True)
plan11 = tile_scheduler.launch_plan(k11, B_, H_, S_, S_, causal=True)
plan_fixed = dataclasses.replace(plan11, dynamic=False)  # a fixed share of the same tiles
plan_shortest = tile_scheduler.launch_plan(k11_shortest, B_, H_, S_, S_, causal=True)
small = [
    ("1. stage 10: one CTA per tile", tile_scheduler.walk(plan10, sms, setup=1)),
    ("2. a fixed share (c, c + 8, ...)", tile_scheduler.walk(plan_fixed, sms, setup=1)),
    ("3. the tile counter, shortest first", tile_scheduler.walk(plan_shortest, sms, 1, lead)),
    ("4. stage 11: the tile counter, longest first", tile_scheduler.walk(plan11, sms, 1, lead)),
]
fig = figures.cta_timelines(
    small, title=f"{len(plan11.tiles)} causal work tiles (S = {S_}, {H_} heads) on {sms} SMs"
)
work, longest = small[0][1].work, max(t.kv_tiles for t in plan11.tiles)
print(f"lower bound: max(work / SMs, longest tile) + 1 set-up = {max(work / sms, longest) + 1:g}")

# %% [markdown]
# Three pairs make `l2_heads` = 1 here (head by head), and the fixed share hands SM $c$ the Q
# tiles $15 - c$ and $7 - c$ of every head: SM 0 the longest of each half, SM 7 the shortest -
# the order decides each SM's load, not the SMs' progress. Shortest first, the last tiles to start
# are the longest, and the SMs that draw them end late. Longest first, every SM's last tiles are
# short, and the SMs end within a tile or two of each other. Stage 10 also pays 48 set-ups
# instead of 8. The same model on the paper shapes, 132 SMs, set-up 0 and 1:

# %%
rows = []
for D in (128, 64):
    for S in (2048, 8192, 16384):
        B, H = 16384 // S, 2048 // D
        p10 = tile_scheduler.launch_plan(stage_kernel(10, D), B, H, S, S, causal=True)
        k = stage_kernel(11, D)
        p11 = tile_scheduler.launch_plan(k, B, H, S, S, causal=True)
        for setup in (0, 1):
            t10 = tile_scheduler.walk(p10, 132, setup)
            t11 = tile_scheduler.walk(p11, 132, setup, k.kv_slots / 2)
            bound = max(t11.work / 132, max(t.kv_tiles for t in p11.tiles)) + setup
            rows.append(
                (
                    D,
                    S,
                    setup,
                    f"{bound:.0f}",
                    f"{t10.end:g} ({t10.busy:.0%})",
                    f"{t11.end:g} ({t11.busy:.0%})",
                    f"{t10.end / t11.end:.2f}",
                )
            )
nb.table(
    (
        "D",
        "S (causal)",
        "set-up",
        "lower bound",
        "stage 10 ends (SMs busy)",
        "stage 11 ends",
        "model: 10 / 11",
    ),
    rows,
)

# %% [markdown]
# The model leaves out everything but the order and the set-up: L2 and HBM traffic, the
# producer's lead beyond the draw, the epilogue's store, clock changes. Section 7 puts its ratio
# next to what the H200 measured.
#
# ### 5.3 The tile number travels with Q
#
# Only the producer draws; the consumers must learn each tile's number. It travels with the
# tile's Q, through the two barriers that already guard Q:
#
# - the producer waits on `q_empty` (the consumers are done with the previous Q), writes the
#   number to shared memory (`tile_id[0]`), then arrives on `q_full` with Q's byte count and
#   starts Q's TMA load;
# - each consumer thread waits on `q_full` (Q has landed, and the arrive that completed the
#   phase was made after the write), reads `tile_id[0]`, and computes the tile; it arrives on
#   `q_empty` once its last GEMM has read Q;
# - after the last tile the producer waits on `q_empty` once more and writes a number past the
#   end with a plain arrive (no bytes): both loops end on `tile < total_tiles`.
#
# Each barrier completes one phase per tile, so the parity of the wait for the tile after
# `tiles_done` tiles is plain arithmetic. A wait for parity $p$ passes once the phase of parity
# $p$ has completed; a fresh barrier counts as having completed the phase before phase 0, of
# parity 1. The consumers wait `q_full` for parity `tiles_done % 2`, the producer `q_empty`
# for `(tiles_done + 1) % 2` - which a fresh barrier passes for the first tile:

# %%
nb.show_source(11, "hopper", names=["Sm90Kernel.q_full_parity", "Sm90Kernel.q_empty_parity"])
walked = [7, 139, 271]
nb.table(
    ("tiles_done", "number handed over", "producer waits q_empty for", "consumers wait q_full for"),
    [
        (
            i,
            t if t != tile_scheduler.END else "past the end",
            k11.q_empty_parity(i),
            k11.q_full_parity(i),
        )
        for i, t in enumerate(walked + [tile_scheduler.END])
    ],
)

# %% [markdown]
# The model below (`tile_scheduler.handover_programs`, `explore_handover`) writes out the
# producer's and both consumer warpgroups' operations with the kernel's own parity methods and
# runs every interleaving of them on the CPU, with the hardware's rule for a wait: each
# consumer must read exactly its tiles' numbers and then the end, and every program must finish.
# Then it breaks the protocol in three ways; each must show up as a wrong read or a hang.

# %%
arrivals = {"q_full": 1, "q_empty": k11.mma_warpgroups}
outcomes = tile_scheduler.explore_handover(tile_scheduler.handover_programs(k11, walked), arrivals)
print(f"the kernel's protocol, tiles {walked}: {sorted(map(str, outcomes))}")
broken = {}
programs = tile_scheduler.handover_programs(k11, walked)
i = programs[0].index(("write", 139))
programs[0][i], programs[0][i + 1] = programs[0][i + 1], programs[0][i]
broken["the number written after the q_full arrive"] = programs
programs = tile_scheduler.handover_programs(k11, walked)
programs[0][0] = ("wait", "q_empty", 0)
broken["the first q_empty wait for parity 0"] = programs
programs = tile_scheduler.handover_programs(k11, walked)
programs[1].remove(("arrive", "q_empty"))
broken["one consumer warpgroup never releases a Q"] = programs
for what, programs in broken.items():
    got = tile_scheduler.explore_handover(programs, arrivals)
    print(f"{what}: {sorted(map(str, got))}")

# %% [markdown]
# ### 5.4 Packed sequences: `first_nonempty_tile`
#
# With packed sequences the grid counts as many Q tiles per (head, sequence) as the *longest*
# sequence has, so a shorter sequence's last tiles hold no row of Q. Stage 10's CTA for such a
# tile loaded Q, found an empty range and stored nothing. A persistent CTA would waste the same
# time inside its walk, so the producer skips them: `first_nonempty_tile` draws again while the tile
# starts past its sequence's end (`tile_is_empty`), and hands the consumers only tiles with
# rows. Packed sequences always take the counter (their tiles differ with the lengths), head by
# head and sequence after sequence (longest first only inside a sequence's tiles; a long
# sequence late in `cu_seqlens` is drawn late).

# %%
nb.show_source(11, "hopper", names=["Sm90Kernel.first_nonempty_tile", "Sm90Kernel.tile_is_empty"])

# %% [markdown]
# `make bench`'s packed batch (16 sequences of 64-2047 tokens, H = 16), walked by the ticket
# model (`tile_scheduler.ticket_walk`: 132 CTAs, the order of their draws shuffled, the kernel's
# `tile_coords` and `tile_is_empty`): every live tile is handed out once, the empty ones are
# drawn and skipped, and the counter ends at the number of tiles - every ticket drawn once.

# %%
import random  # noqa: E402

lens = nb.varlen_lengths()
handed, drawn, tiles_m, total = tile_scheduler.ticket_walk(k128, lens, 16, 132, random.Random(0))
live = sum(-(-n // 128) for n in lens) * 16
print(
    f"lengths {lens}\n{tiles_m} Q tiles per (head, sequence) x 16 heads x {len(lens)} = {total} "
    f"tiles; live (with rows of Q): {live}; handed to the consumers: {len(handed)} "
    f"({len(set(handed))} distinct); tickets drawn: {drawn} = {total} tiles - the 132 first "
    "tiles + one draw past the end per CTA"
)

# %% [markdown]
# ### 5.5 The order: longest first, in L2 sections
#
# `tile_coords` turns a tile number into (Q tile, head, sequence). Inside a section of
# `l2_heads` pairs the pair varies fastest and the Q tile slowest, last Q tile first; without a
# mask (or packed) `l2_heads` = 1, head by head.

# %%
nb.show_source(11, "hopper", names=["Sm90Kernel.tile_coords"])

# %% [markdown]
# Three orders of the paper shape at S = 8k, D = 128, causal (2048 tiles, 32 pairs of 4 MiB of K
# and V each): head by head (`l2_sections = False`), the kernel's sections of 8 pairs, and one
# section of all 32 pairs (`l2_bytes` raised past 128 MiB). On top, each tile's KV tiles in the
# order the counter hands them out; below, the K and V of the pairs among 132 consecutive tiles
# - about what the 132 CTAs read at one time - against the L2.

# %%
S, D = 8192, 128
orders = [
    ("head by head", stage_kernel(11, D, l2_sections=False)),
    ("the kernel: 50 MiB of L2", stage_kernel(11, D)),
    ("all pairs in one section", stage_kernel(11, D, l2_bytes=2**30)),
]
plans = [(label, tile_scheduler.launch_plan(k, 2, 16, S, S, causal=True)) for label, k in orders]
fig = figures.l2_orders(
    plans, 132, k128.l2_bytes, title="Causal, S = 8k, D = 128, B = 2, H = 16: three orders"
)
for (label, plan), (_, k) in zip(plans, orders):
    t = tile_scheduler.walk(plan, 132, 1, k.kv_slots / 2)
    mib = max(tile_scheduler.pairs_in_flight(plan, 132)) * plan.kv_bytes_per_pair / 2**20
    print(
        f"{label}: model ends at {t.end:g} KV tiles; K, V of 132 tiles in a row: up to {mib:g} MiB"
    )

# %% [markdown]
# Head by head, the 132 CTAs read 3-4 heads' K and V at a time, well inside L2, but the long
# and short tiles alternate head after head, and the model ends later. One section of all pairs
# gives the best order and asks L2 for 128 MiB. The sections keep the order's gain and the
# working set under 50 MiB, except near a section's end, where the CTAs run tiles of two sections.
#
# ### 5.6 O gets its own buffer
#
# In stage 10 O is staged over Q's bytes: the consumers may release Q (`q_empty`) only after
# their copies of O out of shared memory are done, so the next tile's Q load starts after the
# epilogue. With a walk of many tiles that wait is on every tile's path. Stage 11 gives O a
# buffer of its own, and each consumer thread arrives on `q_empty` at the start of the epilogue:
# the next Q lands while this tile's O is normalised and stored, and with it the first K and V
# tiles (`load` issues a tile's K and V after its Q, so they too wait for `q_empty`). The price
# is one K/V slot:
#
# $$\texttt{kv\_slots} = \Big\lfloor \frac{227 \cdot 1024 - 1024 - Q - O}{\text{tile}} \Big\rfloor,
# \qquad Q = O = \text{tile} = 128 \cdot D \cdot 2\,\text{B}.$$

# %%
for D in (128, 64):
    k10_, k11_ = stage_kernel(10, D), stage_kernel(11, D)
    tile = 128 * D * 2
    for name, k, o in (("stage 10, O over Q", k10_, 0), ("stage 11, O's buffer", k11_, tile)):
        used = k.kv_slots * tile + tile + o + 1024
        print(
            f"D = {D}, {name}: (232,448 - 1,024 - {tile:,} - {o:,}) // {tile:,} = {k.kv_slots} "
            f"slots; {k.kv_slots} x {tile // 1024} + Q {tile // 1024} + O {o // 1024} + 1 KiB "
            f"= {used // 1024} KiB of 227"
        )
hits = nb.concept_lines(11, "hopper", r"mbarrier_arrive\(q_empty\)|o_bytes_at = ")
nb.table(("line of hopper.py", "code"), [(f"l. {n}", f"`{code}`") for n, code in hits])

# %% [markdown]
# ### 5.7 What the compiler produced
#
# Batch mode and packed, for sm_90a: the same `wgmma` and `ex2` counts as stage 10 (the loop
# inside a tile is unchanged), two barriers fewer (`mbarrier.init`: one slot less), the atomic add
# of `next_tile` and the shuffle that broadcasts the ticket, and 225 KiB of shared memory as before.

# %%
report = nb.compile_summary(11, "hopper")
report_packed = nb.compile_summary(11, "hopper", options=dict(varlen=True))
report10 = nb.compile_report(10, "hopper")
if report is not None:
    # The draw (atomic add), the ticket's broadcast (shuffle from lane 0), gridDim.x.
    for pattern in (r"atom\.global\.add", r"shfl\.sync\.idx", r"%nctaid\.x"):
        print("\n".join(ptx_lines(report.ptx, pattern, limit=2)))
if report is not None and report10 is not None:
    for family in ("wgmma.mma_async", "ex2.approx", "mbarrier.init", "cp.async.bulk.tensor (load)"):
        print(f"{family}: stage 10 {report10.counts[family]}, stage 11 {report.counts[family]}")
    if report_packed is not None:
        atoms = [len(ptx_lines(r.ptx, r"atom\.global\.add", 10)) for r in (report, report_packed)]
        print(
            f"atom.global.add: batch {atoms[0]}, packed {atoms[1]} (first_nonempty_tile draws too)"
        )

# %% [markdown]
# ### 5.8 The same stage on Blackwell
#
# `stages/stage11_persistent/blackwell.py` walks the same tiles in the same order (a fixed share
# without a mask, tickets from `tile_counter` otherwise, longest first in 50 MiB L2 sections),
# but the tile number must reach every role of Blackwell stage 10's CTA - the TMA and MMA warps,
# two softmax warpgroups, the correction warpgroup - not only two consumer warpgroups. So the
# TMA warp picks the tiles and writes each number to shared memory under a one-entry pipeline
# (`hand_over`: 32 arrivals full, 416 empty), every other role reads it (`handed_tile`), and a
# number past the end ends every loop. Every pipeline state lives across tiles; O still leaves
# by the correction warps' rows (its TMA store is Blackwell stage 12's tuning 4). The loops keep
# more values live: the correction warpgroup's 96 registers of stage 9's split hold them (at 80
# it spilled), and ptxas of CUDA 13.0 reports no spill in any tested configuration (2026-12-07,
# `docs/notes/stage11.md`). The cells below show the concept table of the two tracks and the
# compile summary.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors, their PTX is checked and the
# hand-offs between their roles are replayed on the CPU (`common/tools/schedule.py`). Their
# numerics are tested only where an sm_100 GPU exists.

# %%
rows = nb.cross_track_table(11)
report_bw = nb.compile_summary(11, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** the checks of stage 10, unchanged: MHA in batch mode (a few $10^{-3}$ relative,
# within 3x PyTorch's own bf16 error), the masks of stage 6 including rows with no key, GQA, and a
# packed batch with a zero-length and a one-token sequence and NaN planted around each sequence.
# The loop inside a tile is stage 10's, so O and LSE should equal stage 10's bit for bit whatever
# SM runs a tile; the second cell below runs stage 11 on a grid capped at 7 CTAs (`sm_count = 7`), so
# that each CTA walks many tiles and the ring and Q's barriers wrap many times, and compares it
# with stage 10 bit for bit, without a mask (the fixed share) and causal (the tile counter).

# %%
result = nb.run_and_verify(11, (2, 4, 512, 1024, 128))
checks = nb.run_and_verify_cases(
    11,
    list(nb.MASK_CASES)
    + [
        ("GQA 8 / 2, causal", (2, 8, 300, 700, 128), dict(kv_heads=2, causal=True)),
        ("MQA 8 / 1, D = 64", (1, 8, 520, 520, 64), dict(kv_heads=1)),
    ],
)
packed_checks = nb.run_and_verify_varlen(
    11, [200, 77, 0, 300, 1], [130, 190, 5, 129, 260], heads=4, kv_heads=2, causal=True
)

# %%
if nb.MODE == "gpu" and nb.available(10, nb.TRACK) and nb.available(11, nb.TRACK):
    from common.tools import inputs

    mod10, mod11 = (stage_table.track_module(n, nb.TRACK) for n in (10, 11))
    q, k, v = inputs.attention_inputs(2, 8, 1000, 1000, 128, seed=5)
    tiles = -(-1000 // 128) * 8 * 2  # Q tiles x heads x sequences
    for causal in (False, True):
        o10, lse10 = mod10.attention(q, k, v, causal=causal, return_lse=True)
        with nb.kernel_settings(11, nb.TRACK, sm_count=7):
            o11, lse11 = mod11.attention(q, k, v, causal=causal, return_lse=True)
        torch.cuda.synchronize()
        print(
            f"causal={causal}: {tiles} tiles on 7 CTAs, stage 11 == stage 10 bit for bit: "
            f"O {torch.equal(o10, o11)}, LSE {torch.equal(lse10, lse11)}"
        )
else:
    print("the bit-for-bit comparison with stage 10 needs GPU mode")

# %%
fig = nb.error_picture(11, result)

# %% [markdown]
# ## 7. Measure
#
# **Expected**, from the ablation run of `make bench` on the H200 (2026-12-04, bf16, paper
# shapes, every kernel of a row timed in the same interleaved rounds;
# `docs/results/ablation_h200_2026-12-04.md`). The cell below reads stage 10 and stage 11 from
# the run's `.json` file, in event time (CUDA events around each call, host work included where
# it is longer than the kernel) and in GPU time (the kernels' own durations).

# %%
with open(os.path.join(nb.ROOT, "docs/results/ablation_h200_2026-12-04.json")) as f:
    ablation = json.load(f)
measured = {}
for r in ablation["rows"]:
    if r["stage"] in ("ablation", "ablation GPU time"):
        _, _, S_, _, D_, causal_ = r["shape"]
        timing = "event" if r["stage"] == "ablation" else "GPU"
        measured[(D_, causal_, S_, timing)] = (r["tflops"]["stage 10"], r["tflops"]["stage 11"])
nb.table(
    ("D", "causal", "S", "stage 10", "stage 11", "11 / 10", "11 / 10, GPU time"),
    [
        (D_, causal_, S_, f"{a:.0f}", f"{b:.0f}", f"{b / a:.2f}", "{:.2f}".format(g[1] / g[0]))
        for (D_, causal_, S_, timing), (a, b) in sorted(
            measured.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][2])
        )
        if timing == "event"
        for g in [measured[(D_, causal_, S_, "GPU")]]
    ],
)
print(f"{ablation['gpu']}, {ablation['date']}, bf16, TFLOP/s (event time)")
fig = figures.ablation_step(
    ablation["rows"], title=f"Stage 11 over stage 10 ({ablation['gpu']}, {ablation['date']}, bf16)"
)

# %% [markdown]
# Read from the table (H200, 2026-12-04):
#
# - **Where it gains.** Under a causal mask at D = 128 from S = 4k: 542 -> 613, 589 -> 655 and
#   626 -> 674 TFLOP/s at 4k, 8k, 16k (1.13, 1.11, 1.08; GPU time 1.09, 1.08, 1.07), the size
#   of gain section 5.2's model finds in the order and the set-up. At D = 64 causal it gains at
#   every S, most at short S (1.15 at 512, 1.01 at 16k). Without a mask it gains at D = 64 below
#   S = 4k (1.14 at 512, 1.01 at 2k) and at D = 128 from 2k to 8k (1.06 at 2k, 1.01 at 8k).
# - **Where it is slower.** At D = 64 without a mask from S = 4k: 437 -> 431, 454 -> 439,
#   462 -> 443 (0.99, 0.97, 0.96; GPU time 0.99, 0.97, 0.95); at D = 128 without a mask at
#   S = 16k, 637 -> 623 (0.98; GPU time 0.99). There the tiles are equal, the fixed share draws
#   nothing, and one set-up saved per tile is little against 32-128 KV tiles; what else changes
#   is the ring, one slot shallower for O's buffer (12 slots against 13 at D = 64, 5 against 6
#   at D = 128), and the walk itself. Which of these costs the 1-5% was not measured on the
#   H200; the `O over Q` variant below times the first. On an H100 (2026-12-07, no mask, S = 8k,
#   event time; `docs/notes/stage11.md`) it closed the gap at D = 128 and most of it at D = 64:
#   stage 11 656, the variant 678, stage 10 673 TFLOP/s at D = 128; 424, 443 and 449 at D = 64.
# - **At S <= 1k, D = 128, in event time:** 323 -> 288 and 539 -> 535 without a mask, 147 -> 106
#   and 341 -> 267 causal (0.72 at S = 512). In GPU time the same rows gain (1.10-1.15): the
#   kernel is faster, the call is slower (so is S = 2k causal: 1.01 in event time, 1.13 in GPU
#   time). At short S a call's host work can be longer than the kernel, and event timing then
#   measures the host (`docs/results/README.md`). Stage 11's causal calls also zero the tile
#   counter, one more launch (`torch.zeros`) before the kernel; how much of the host time that
#   is was not measured.
#
# In GPU mode the cells below time stage 11 against stage 10 in one run, with stage 11's choices
# undone one at a time as `kernel_settings` variants: O over Q with stage 10's ring depth (one
# K/V slot more), and under a causal mask one CTA per tile (`persistent = False`), shortest first
# (`longest_first = False`) and head by head (`l2_sections = False`).

# %%
# O over Q with stage 10's ring depth (6 slots at D = 128, 13 at D = 64): kv_slots is set
# with o_buffer, so that the variant's ring is that depth whatever __init__ derives.
bench = {}
for shape in [(2, 16, 8192, 8192, 128), (2, 32, 8192, 8192, 64)]:
    slots = stage_kernel(10, shape[4]).kv_slots
    variant = {f"O over Q, {slots} slots": dict(o_buffer=False, kv_slots=slots)}
    bench.update(nb.measure(11, [shape], also_stages=(10,), variants=variant) or {})

# %%
bench_causal = nb.measure(
    11,
    [(8, 16, 2048, 2048, 128), (2, 16, 8192, 8192, 128)],
    also_stages=(10,),
    causal=True,
    variants={
        "one CTA per tile": dict(persistent=False),
        "shortest first": dict(longest_first=False),
        "head by head": dict(l2_sections=False),
    },
)

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU; where a GPU adds a measurement, the exercise says which call makes it.
#
# 1. **Count the grid.** For the causal paper shape at S = 16k, D = 64 (B = 1, H = 32): how many
#    work tiles, how many CTAs, how many tiles per CTA on average, how many set-ups does stage 11
#    save over stage 10, and what is `l2_heads`?
# 2. **The parities.** Replace the producer's parity with `tiles_done % 2`
#    (`kernel.q_empty_parity = lambda i: i % 2` on a kernel object from `stage_kernel(11)`) and
#    run the hand-over model. What happens, and on which barrier? Which tile does it reach?
# 3. **Shortest first.** Build the kernel with `longest_first = False`
#    (`stage_kernel(11, longest_first=False)`), walk the causal paper shape at S = 8k, D = 128 on
#    132 SMs and compare its end with the kernel's. Where in the timeline does the time go? In
#    GPU mode the `shortest first` variant of section 7 measures it.
# 4. **A smaller L2.** With `l2_bytes` at 20 MiB (`stage_kernel(11, l2_bytes=20 * 2**20)`), what
#    is `l2_heads` for the causal paper shapes at S = 2k-16k, D = 128? Why must it be a power of
#    two that divides the number of pairs - what would `tile_coords` do with sections of 12 pairs
#    out of 32?
# 5. **O's buffer.** Without it (`o_buffer = False`), how many slots does the ring get at D = 64
#    and 128, and how much shared memory does the kernel ask for? Check it in the compile summary
#    (`nb.compile_summary(11, "hopper", settings=dict(o_buffer=False, kv_slots=...))`, your
#    count as `kv_slots`, so that the ring is the one you computed). What would the consumers
#    have to wait for before their arrive on `q_empty`?
# 6. **Packed order.** Sort `make bench`'s packed batch longest first (`sorted(lens,
#    reverse=True)`) and walk both orders with `tile_scheduler.ticket_walk`: do the same tiles get
#    handed out? Why can the order of `cu_seqlens` change the tail of a packed launch, although
#    the tiles drawn are the same?
# 7. **Shortest first, in the kernel** (exercise 11a, an edit of the Hopper stage file): exercise
#    3 with the order changed in `tile_coords` itself. The cells at the end of the notebook give
#    the task and check the edit.
#
# ### Answers and checks
#
# <details><summary>1. Count the grid</summary>
#
# 128 Q tiles x 32 heads = 4096 work tiles; the grid is min(4096, 132) = 132 CTAs, 31.0 tiles
# each on average; stage 10 launches 4096 CTAs, so stage 11 pays 3964 set-ups fewer. K and V of
# a head are 16384 x 2 x 64 x 2 B = 4 MiB: 12 fit in 50 MiB, rounded down to 8, and 32 pairs
# allow 8: `l2_heads` = 8. The cell below computes each number.
# </details>
#
# <details><summary>2. The parities</summary>
#
# The producer's first wait is then for parity 0 on a fresh `q_empty`: phase 0 completes only
# when every consumer has arrived, and no consumer arrives before it has a tile - which the
# producer has not handed over. Every interleaving hangs before tile 0: the model reports only
# `deadlock`. In the kernel, every CTA would wait forever on its first `q_empty`.
# </details>
#
# <details><summary>3. Shortest first</summary>
#
# The cell below prints both ends: shortest first ends later, because the last tiles handed out
# are the longest (64 KV tiles), and the SMs that draw them run alone at the end. The timeline of
# section 5.2 (schedule 3) shows the same on 8 SMs.
# </details>
#
# <details><summary>4. A smaller L2</summary>
#
# K and V of a pair are $S \cdot 512$ B at D = 128: 1 MiB at S = 2k (20 fit, rounded down to
# 16; 128 pairs allow it), 2 MiB at 4k (10 fit: 8), 4 MiB at 8k (5: 4), 8 MiB at 16k (2: 2).
# The cap makes every section whole: `tile_coords` numbers the tiles of a section as if it held
# `l2_heads` pairs. With sections of 12 out of 32 pairs the third section starts at pair 24 and
# runs to pair 35: tiles go to pairs 32-35, which do not exist, and the Q tiles of pairs 24-31
# that those tile numbers should have reached are never handed out (O never written). The cell
# below prints the sections, and counts what tile_coords gives with 12 pairs per section.
# </details>
#
# <details><summary>5. O's buffer</summary>
#
# Without O's buffer the ring gets one slot more: 6 at D = 128 and 13 at D = 64, the shared
# memory stays about 225 KiB (6 x 32 + 32 + 1; 13 x 16 + 16 + 1). The consumers would then have
# to finish their copies of O out of shared memory before arriving on `q_empty`, since the next
# Q would be written over the same bytes (stage 10's order); the cell below prints the numbers.
# </details>
#
# <details><summary>6. Packed order</summary>
#
# The same set of live tiles is handed out (the cell below compares the sets), and the counter
# ends at the same total. What changes is which tiles come last: packed tiles go sequence after
# sequence, so a long sequence late in `cu_seqlens` puts its long causal tiles at the end of the
# draw, where few tiles are left to balance them. Sorted longest first, the last tiles drawn
# belong to the shortest sequence. The cell below adds up the KV tiles (causal) of the last 132
# live tiles in tile-number order for both orders: the work the grid's last round holds.
# </details>
#
# <details><summary>7. Shortest first, in the kernel (11a)</summary>
#
# Without the two lines, tile t of a section is Q tile t / l2_heads counted from the first: under
# a causal mask the counter hands out the 1-KV-tile tiles first and the longest last, exercise
# 3's order. The check prints both walks: the edited one ends later, with the last tiles to start
# the longest. O is the same (the same tiles run, in another order); on a GPU the check runs the
# edited kernel against the fp64 reference.
# </details>

# %%
# Exercise 1: the grid of the causal paper shape at S = 16k, D = 64.
k1 = stage_kernel(11, 64)
plan1 = tile_scheduler.launch_plan(k1, 1, 32, 16384, 16384, causal=True)
print(
    f"{len(plan1.tiles)} tiles, grid {plan1.grid}, {len(plan1.tiles) / plan1.grid:.1f} tiles per "
    f"CTA, set-ups saved {len(plan1.tiles) - plan1.grid}, l2_heads {plan1.l2_heads}"
)

# Exercise 2: the producer's q_empty parity off by one.
k2 = stage_kernel(11)
k2.q_empty_parity = lambda tiles_done: tiles_done % 2
got = tile_scheduler.explore_handover(tile_scheduler.handover_programs(k2, walked), arrivals)
print("q_empty parity tiles_done % 2:", sorted(map(str, got)))

# Exercise 3: shortest first against longest first, causal, S = 8k, D = 128, 132 SMs.
for label, k in (
    ("longest first", k128),
    ("shortest first", stage_kernel(11, longest_first=False)),
):
    t = tile_scheduler.walk(
        tile_scheduler.launch_plan(k, 2, 16, 8192, 8192, causal=True), 132, 1, k.kv_slots / 2
    )
    last = sorted(
        (seg for row in t.rows for seg in row if seg.tile is not None), key=lambda s: s.start
    )[-5:]
    print(
        f"{label}: ends at {t.end:g} KV tiles, SMs busy {t.busy:.1%}; the last five tiles to "
        f"start have {[seg.tile.kv_tiles for seg in last]} KV tiles"
    )

# Exercise 4: the sections at 20 MB of L2, and sections of 12 pairs out of 32.
k4 = stage_kernel(11, l2_bytes=20 * 2**20)
for S in (2048, 4096, 8192, 16384):
    B, H = 16384 // S, 16
    print(f"S = {S}: {B * H} pairs, l2_heads {tile_scheduler.l2_section_heads(k4, S, B * H)}")
tiles_m4, heads4 = 64, 16  # S = 8k: 64 Q tiles, B = 2 x H = 16 = 32 pairs
coords = {k128.tile_coords(t, tiles_m4, heads4, 12) for t in range(tiles_m4 * 32)}
absent = [(m, h, b) for m, h, b in coords if h + heads4 * b >= 32]
missed = tiles_m4 * 32 - (len(coords) - len(absent))
print(f"12 pairs per section: {len(absent)} tiles of pairs past the 32nd, {missed} tiles never run")

# Exercise 5: the ring and the shared memory without O's buffer.
for D in (128, 64):
    tile = 128 * D * 2  # Q, O and one K or V tile: 128 rows x D x 2 B
    slots = (227 * 1024 - 1024 - tile) // tile
    settings = dict(o_buffer=False, kv_slots=slots)
    r = nb.compile_report(11, "hopper", shape=(2, 4, 512, 1024, D), settings=settings)
    if r is not None:
        kb = r.shared_memory_bytes / 1024
        print(f"D = {D}: {slots} slots without O's buffer; shared memory {kb:.0f} KiB")


# Exercise 6: the packed batch in two orders of cu_seqlens.
def causal_kv_tiles(m, n):
    """The KV tiles of Q tile m of a causal sequence of n tokens (the kernel's range)."""
    lo, hi = masks.kv_tile_range(m, n, n, *masks.resolve_window(True, None, n, n))
    return hi - lo


sets = []
for order in (lens, sorted(lens, reverse=True)):
    handed6, drawn6, tiles_m6, _ = tile_scheduler.ticket_walk(
        k128, order, 16, 132, random.Random(1)
    )
    coords6 = [k128.tile_coords(t, tiles_m6, 16, 1) for t in sorted(handed6)]
    sets.append({(order[b], m, h) for m, h, b in coords6})
    last_round = [causal_kv_tiles(m, order[b]) for m, _, b in coords6[-132:]]
    print(
        f"{order[:4]}...: {len(handed6)} tiles handed out, {drawn6} tickets drawn; the last 132 "
        f"tiles hold {sum(last_round)} KV tiles (longest {max(last_round)})"
    )
print("the same (length, Q tile, head) tiles in both orders:", sets[0] == sets[1])

# %% [markdown]
# ### Exercise 11a: shortest first
#
# The first cell gives the task; the second loads the stage file as it is on disk now, compiles
# it (no GPU needed), numbers the tiles with its `tile_coords` and walks them on the CPU. On the
# committed file it says "not yet".

# %%
nb.exercise("11a")

# %%
nb.check_exercise("11a")

# %% [markdown]
# **Next:** `make diff-12` shows what stage 12 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage12_last_percent.ipynb`](stage12_last_percent.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage11.md`](../docs/notes/stage11.md).
