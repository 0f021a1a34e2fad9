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
# # Stage 8 - warp specialisation: a TMA producer warpgroup and two consumer warpgroups
#
# This notebook walks through `stages/stage8_warp_specialized/hopper.py`: stage 7's kernel (all its
# features: masks, GQA, packed sequences, LSE) with the first of FlashAttention-3's schedule
# techniques. One warpgroup only loads; the two others only compute. The loading warpgroup gives
# most of its registers to the computing ones, and the K/V ring grows from 2 slots to as many as
# fit in shared memory, so that the loads run several KV tiles ahead of the computation. The
# arithmetic does not change: O and LSE are stage 7's bit for bit. The notebook imports the stage
# file and displays it; it never pastes kernel code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage8_warp_specialized.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; everything else (the
# pictures, the CPU model of the barriers, the compile summaries) runs in both modes. Source:
# `notebooks/source/stage8_warp_specialized.py`.

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

from cutlass.pipeline import PipelineUserType  # noqa: E402

from common.tools import barrier_protocol, stage_table  # noqa: E402
from common.tools import notebook as nb  # noqa: E402
from common.tools.ptx import ptx_lines  # noqa: E402
from notebooks.figures import stage8 as figures  # noqa: E402

nb.start(8)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - name the warp roles of stage 8 - a producer warpgroup whose one thread issues every TMA load,
#   two consumer warpgroups of 64 query rows each - and say what the split buys over stage 7,
#   where a computing warp also issued the loads;
# - do the register arithmetic of `setmaxnreg`: the 64,512 registers the CTA holds at launch
#   (384 threads x 168), 24 per producer thread and 240 per consumer thread, and why the split
#   must add up;
# - compute how deep the K/V ring is (`kv_slots`: 6 at D = 128, 13 at D = 64) and how far the
#   producer runs ahead, and map a ring entry to its slot and its barrier parity;
# - give each barrier's arrival count (q_full 1, q_empty 256, kv_full 1, kv_empty 8) and say who
#   arrives;
# - read the work-tile loop that producer and consumers walk (once per CTA here; stage 11 makes
#   it persistent);
# - run the CPU model of the CTA's barrier protocol on the kernel object, every interleaving of
#   the three warpgroups, and watch it catch a planted near miss;
# - read what the step measured on the H200 (2026-12-04), and why it gains at D = 128 and not at
#   D = 64.
#
# ## 2. Previous stage recap
#
# Stage 7 runs 256 threads, two warpgroups that both compute, 64 of the Q tile's 128 rows each.
# Warp 0 of the first warpgroup also issues the TMA loads: Q and the first K tiles before the
# loop, then, inside its own loop, $V_j$ once both warpgroups have released $K_j$ (the ring has 2
# slots and $V_j$ goes into $K_j$'s slot). So the loads wait for the computation - warp 0 cannot
# load $V_j$ before all 8 warps have finished $QK_j$ - and the computation waits for the loads.
# Its features stay: causal and window masks with tile skipping (`kv_tile_range`), GQA through
# the TMA coordinate, packed sequences with per-sequence bounds (`seq_info`, `zero_rows`,
# `store_rows`), LSE.
#
# ## 3. The math
#
# ### 3.1 Roles: one thread loads, 256 compute
#
# Warp specialisation splits the CTA by *what* its warps do instead of *which rows*. Warpgroup 0
# (warps 0-3) is the **producer**: one elected thread of warp 0 issues every TMA load into the
# ring, waiting only for free slots; warps 1-3 have no work. Warpgroups 1 and 2 (warps 4-11) are
# the **consumers**: they wait for loaded slots, run stage 7's step on their 64 rows each (QK^T,
# mask, online softmax, PV) and release the slots. Neither role waits for the other except at a
# barrier: the producer runs ahead as far as the ring lets it, the consumers never stop to issue
# a load. The price is 128 threads that hold registers and compute nothing - which is what the
# next section takes back.
#
# ### 3.2 The register budget
#
# An SM has 65,536 32-bit registers. A CTA of 384 threads, one per SM, gets from ptxas at most
# $\lfloor 65{,}536 / 384 \rfloor = 170$ per thread, rounded down to a multiple of 8: **168**, and
# holds $384 \cdot 168 = 64{,}512$ registers from its launch. `setmaxnreg` moves registers between
# the CTA's warpgroups at run time: `setmaxnreg.dec` gives a warpgroup's registers back to a pool
# kept per CTA, `setmaxnreg.inc` takes from that pool and blocks until it holds enough (PTX ISA,
# `setmaxnreg`). Per thread the count is a multiple of 8 between 24 and 256. The producer drops
# to 24 and the consumers rise to 240:
#
# $$128 \cdot (168 - 24) = 18{,}432 = 256 \cdot (240 - 168), \qquad 128 \cdot 24 + 256 \cdot 240 = 64{,}512 .$$
#
# The split uses the pool exactly: a producer that kept even 8 registers more would leave the
# consumers' `setmaxnreg.inc` waiting forever (exercise 1). What the consumers gain is room:
# stage 7's loop body needs 158 registers per thread at D = 128 in batch mode and 189 with packed
# sequences (ptxas of CUDA 13.0, bf16, 2026-12-06; `docs/notes/stage7.md`), close to or above the
# 168 a 384-thread CTA starts with.
#
# ### 3.3 The ring
#
# Every K and V tile takes the next **ring entry**: entry $2t$ holds $K$ of step $t$ (KV tile
# `kv_tile_lo + t`), entry $2t+1$ its $V$, and entry $e$ lives in slot $e \bmod$ `kv_slots`. The
# slots are as many as fit in the 227 KiB (232,448 B) a CTA may use, next to Q and 1 KiB of
# barriers and alignment:
#
# $$\texttt{kv\_slots} = \left\lfloor \frac{232{,}448 - 1{,}024 - 128 \cdot D \cdot 2}{128 \cdot D \cdot 2} \right\rfloor
#   = \begin{cases} 6 & D = 128 \ (32\ \text{KiB tiles}) \\ 13 & D = 64 \ (16\ \text{KiB tiles}) \end{cases}$$
#
# The producer may fill entry $e$ once the consumers have released entry $e - $ `kv_slots`, so it
# runs up to `kv_slots` entries - 3 KV tiles at D = 128 - ahead of the slower consumer warpgroup.
# The barriers of slot $s$ complete one phase per use of the slot, so the $w$-th use waits for
# parity $w \bmod 2$ with $w = \lfloor e / \texttt{kv\_slots} \rfloor$ (the consumers' wait on
# `kv_full[s]`); the producer's wait on `kv_empty[s]` is for the release of the use before, parity
# $(w + 1) \bmod 2$, which a fresh barrier passes for $w = 0$ (stage 1's rule).
#
# ### 3.4 Arrival counts
#
# A barrier completes a phase when its count of arrivals has come (and, for a TMA barrier, its
# bytes have landed). Each count must equal the arrivals one phase receives:
#
# | barrier | who arrives, per phase | count |
# | --- | --- | --- |
# | `q_full` | the producer's `arrive.expect_tx` (+ Q's bytes from TMA) | 1 |
# | `q_empty` | every consumer thread, once its epilogue is done with Q and sO (stored over Q) | 256 |
# | `kv_full[s]` | the producer's `arrive.expect_tx` (+ one tile's bytes) | 1 |
# | `kv_empty[s]` | one lane of each consumer warp (`consumer_release`) | 8 |
#
# A count above the arrivals never completes (a hang); one below completes early (the producer
# overwrites a slot still being read) or twice per use (the parities drift apart). Section 5.6
# checks both on the CPU.

# %%
cfg = nb.show_config(8, "hopper")
threads = cfg.get("threads", 384)
load_regs, mma_regs = cfg.get("load_registers", 24), cfg.get("mma_registers", 240)
consumers = cfg.get("mma_threads", 256)
at_entry = 65536 // threads // 8 * 8
print(f"at launch: {threads} threads x {at_entry} = {threads * at_entry:,} registers (the pool)")
print(
    f"after setmaxnreg: 128 x {load_regs} + {consumers} x {mma_regs} = "
    f"{128 * load_regs + consumers * mma_regs:,}; the producer gives "
    f"{128 * (at_entry - load_regs):,}, the consumers take {consumers * (mma_regs - at_entry):,}"
)
for D in (64, 128):
    tile = 128 * D * 2  # a K or V tile: 128 keys x D, bf16
    slots = (227 * 1024 - 1024 - tile) // tile  # Q is a tile of the same size
    print(
        f"D = {D}: kv_slots = ({227 * 1024:,} - 1,024 - {tile:,}) // {tile:,} = {slots}; "
        f"the producer runs up to {slots} entries = {slots / 2:g} KV tiles ahead"
    )

# %% [markdown]
# ## 4. What changes
#
# The docstring gives the changes with their numbers; then the start of the kernel class's diff
# against stage 7 (the whole files differ by about 250 lines added and 150 removed; `make diff-8
# TRACK=hopper` shows them). A **work tile** is one (Q tile, head, sequence), what stage 7's grid
# gave each CTA; section 5.5 shows how the roles walk them. Stage 7 already has stage 8's methods
# (`load`, `mma_one_n_block`, `epilogue`, and `mma`, which stage 8 renames `mma_tile`: one work
# tile's pass), so the hunks are the roles themselves: the producer warpgroup and setmaxnreg in
# `kernel`, `load` issuing every load, the ring's entries in place of stage 7's slot phases, and the
# work-tile loops in `load` and in the new `mma`. The diff pairs stage 7's `mma` with the new one by
# name, so the new `mma`'s loop and the line `def mma_tile(` show as added lines in the middle of
# the old method, whose body continues as `mma_tile`'s. Section 5 goes through the new code method
# by method. The arithmetic of each consumer warpgroup is stage 7's but for two lines: S is
# zero-filled before the loop (without it ptxas serialises the wgmma at D = 128, warning C7512), and
# every PV accumulates into O's zeros where stage 7's first PV overwrote them. O and LSE stay bit
# for bit.

# %%
nb.show_docstring(8, "hopper")

# %%
nb.show_diff(8, "hopper", max_lines=80)

# %% [markdown]
# The diff is long: about 400 lines added + removed in the whole files (`make diff-sizes` lists
# every pair of stages). To read it in `make diff-8`, a map of where its lines fall, method by
# method, in the order of stage 8's file. `kernel` loses the Q tile's set-up (its sequence, KV
# range and TMA views move into the roles, per work tile) and gains the role dispatch; `load` and
# `mma` gain the work-tile loops; `mma_tile` is new as a name, its body is stage 7's `mma`; the
# small new methods hold the bookkeeping of the loops (`tile_coords`, `next_tile`, `sequences`,
# `ring_state`, the two parities). Two small hunks in the epilogue follow from the split: its
# `sync_threads` becomes named barrier 1 of the 256 consumer threads (the producer never reaches
# the epilogue, so a barrier of the whole CTA would wait for it forever), and each consumer thread
# ends a tile with a proxy fence and an arrive on `q_empty` (its reads of sQ and sO, by ordinary
# loads, ordered before the TMA write of the next tile's Q into the same bytes).

# %%
nb.diff_map(8, "hopper")

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The warp roles
#
# Drawn from the kernel's own settings (D = 128): warpgroup 0 the producer, warpgroups 1 and 2
# the consumers, the ring of `kv_slots` slots with the barriers between them, and the register
# file before and after `setmaxnreg`. The kernel's section 2 is where the roles part: every
# warpgroup computes `total_tiles`, the number of work tiles, then warpgroup 0 gives its registers
# up (`setmaxregister_decrease`, all four warps, since `setmaxnreg` acts on a whole warpgroup) and
# its warp 0 calls `load`; the consumers take the registers (`setmaxregister_increase`) and call
# `mma`, passing it `views`: this thread's wgmma operands and accumulators, made once in section 1
# and unpacked at the top of `mma_tile`. The other arguments travel in named groups, each
# unpacked at the top of the method that takes it (`stages/README.md` lists them): `gmem`,
# `smem`, `barriers` and `window` go to `load`, `mma` and `mma_tile`; `atoms` (the TMA atoms) to
# `load` only; `tiling` (`total_tiles`, `tiles_m`, `heads`) to `load` and `mma`, which walk the
# work tiles; and `mma` hands `mma_tile` one work tile as `coords` (Q tile, head, sequence), `seq`
# (`offset_q`, `seqlen_q`, `seqlen_k`) and `kv_range` (`kv_tile_lo`, `kv_tile_hi`).

# %%
fig = figures.warp_specialized_roles(
    threads=threads,
    load_registers=load_regs,
    mma_registers=mma_regs,
    kv_slots=cfg.get("kv_slots", 6),
    mma_warpgroups=cfg.get("mma_warpgroups", 2),
    cta_tile=cfg.get("cta_tile", (128, 128, 128)),
)

# %%
nb.show_source(8, "hopper", section="# 2. The work tiles")

# %% [markdown]
# ### 5.2 The producer
#
# `load` walks the CTA's work tiles (5.5) and issues, per tile, Q and then $K_j$, $V_j$ of every KV
# tile of the range - the same `kv_tile_range` and `seq_info` the consumers call, so that both
# sides count the same entries. Before Q it waits on `q_empty` (the consumers are done with the
# previous tile's Q); before each K or V tile, in `load_tiles`, on the slot's `kv_empty`
# (`producer_acquire`), then it announces the tile's bytes on `kv_full` and starts the copy. At
# the end, `producer_tail` waits for the release of the last `kv_slots` entries, so that no
# arrive on the ring is outstanding when the CTA exits.

# %%
nb.show_source(8, "hopper", names=["Sm90Kernel.load", "Sm90Kernel.load_tiles"])

# %% [markdown]
# ### 5.3 The ring runs ahead
#
# The ring model of notebook 4 with one consumer lane standing for both consumer warpgroups (a
# slot is free once both have released it): stage 7's 2 slots, $V_j$ loaded into $K_j$'s slot
# after $QK_j$ - the producer waits (hatched) after almost every load - against stage 8's ring,
# where every load is an entry of its own and the producer is several tiles ahead from the start.
# Durations are illustrative (a load takes two MMA steps here).

# %%
fig = figures.ring_timelines(kv_tiles=5, slots_before=2, slots_after=cfg.get("kv_slots", 6))

# %% [markdown]
# `ring_state` turns an entry count into the `PipelineState` each side waits with: slot
# $e \bmod$ `kv_slots` and the parity of 3.3. Producer and consumers keep their own count
# (`entries`, two per KV tile), carried from one work tile to the next, so the phases stay
# right when a CTA walks several tiles (stage 11). The table is computed by the kernel object's
# own method.

# %%
kernel8 = None
if nb.available(8, "hopper"):
    mod8 = stage_table.track_module(8, "hopper")
    kernel8, _ = mod8.compile_args(torch.bfloat16, (2, 4, 512, 1024, 128))
    nb.show_source(8, "hopper", names=["Sm90Kernel.ring_state"])
    rows = []
    for e in range(2 * kernel8.kv_slots + 2):
        cons = kernel8.ring_state(e, PipelineUserType.Consumer)
        prod = kernel8.ring_state(e, PipelineUserType.Producer)
        what = ("K" if e % 2 == 0 else "V") + f" of step {e // 2}"
        rows.append((e, what, cons.index, prod.phase, cons.phase))
    nb.table(
        (
            "entry",
            "holds",
            "slot",
            "producer waits on kv_empty for",
            "consumers wait on kv_full for",
        ),
        rows,
    )

# %% [markdown]
# ### 5.4 The consumers
#
# `mma` walks the same work tiles and calls `mma_tile` for each. That waits for Q (`q_full`), resets
# the statistics and calls `mma_one_n_block` once per KV tile - stage 7's step: wait for $K_j$,
# issue $QK_j$, wait for it, release $K_j$'s slot, mask and online softmax, rescale O, wait for
# $V_j$, issue $PV_j$, wait, release $V_j$'s slot. Then `epilogue`: O normalised, LSE, O through
# shared memory (over Q) to global memory, and every consumer thread's arrive on `q_empty`. The two
# consumer warpgroups do all this independently: nothing orders their GEMMs, and they reach the
# tensor cores as they are issued. (Stage 9 gives them turns.)

# %%
nb.show_source(8, "hopper", names=["Sm90Kernel.mma_one_n_block"])

# %% [markdown]
# ### 5.5 The work-tile loop, run once
#
# Both roles walk *work tiles*: tile $t$ is (Q tile, head, sequence) by `tile_coords` (the Q tile
# fastest, as stage 7's grid), CTA $c$ starts at tile $c$ and goes on to `next_tile`. Here the grid
# has one CTA per tile, so `next_tile` (tile + gridDim.x) is past the last tile at once and the
# loop runs once. It is written as a loop now so that the barriers' phases (`q_full_parity`,
# `q_empty_parity`, `ring_state`) are counted per tile from the start, and stage 11 only changes
# which tiles a CTA visits.

# %%
nb.show_source(
    8,
    "hopper",
    names=[
        "Sm90Kernel.tile_coords",
        "Sm90Kernel.next_tile",
        "Sm90Kernel.q_full_parity",
        "Sm90Kernel.q_empty_parity",
    ],
)
if kernel8 is not None:
    B, H, S, D_ = 2, 16, 8192, 128
    tiles_m = -(-S // kernel8.cta_tile[0])
    total = tiles_m * H * B
    print(
        f"(B, H, S, S, D) = {(B, H, S, S, D_)}: {tiles_m} Q tiles x {H} heads x {B} sequences = "
        f"{total} work tiles, grid = {total} CTAs; CTA c takes tile c, next_tile(c) = c + {total} "
        ">= the last: one pass of the loop"
    )
    for t in (0, 1, tiles_m, total - 1):
        print(f"  tile {t}: (Q tile, head, sequence) = {kernel8.tile_coords(t, tiles_m, H)}")

# %% [markdown]
# ### 5.6 The barrier protocol on the CPU
#
# Three warpgroups, 14 mbarriers (D = 128: 2 + 2 x 6 slots) and a ring whose slots wrap: a mistake
# in a parity or a count hangs the GPU, or worse, lets the producer overwrite a slot a consumer
# still reads - which a test run may never show. `common/tools/barrier_protocol.py` models the
# protocol from the kernel object itself: the producer and each consumer warpgroup become programs
# of waits, fills, reads and arrives in the kernel's order, with the parities of the kernel's own
# `ring_state`, `q_full_parity` and `q_empty_parity`. A barrier completes a phase when its count of
# arrivals has come; a wait for parity $P$ passes once the completed phases have the other parity.
# The model runs **every interleaving** of the three programs and reports a hang, a read of the
# wrong tile, a fill over a slot still being read, and an arrive left over at the end.
#
# First the counts: the kernel object's (what `arrival_counts` says the protocol needs) and what
# the compiled kernel initialises its barriers with (read from the PTX's `mbarrier.init`).

# %%
if kernel8 is not None:
    counts = barrier_protocol.arrival_counts(kernel8)
    report8 = nb.compile_report(8, "hopper")
    in_ptx = (
        barrier_protocol.counts_from_ptx(report8.ptx, kernel8.kv_slots) if report8 else None
    ) or {}
    who = {
        "q_full": "the producer (+ Q's bytes)",
        "q_empty": "every consumer thread",
        "full": "the producer (+ a tile's bytes)",
        "empty": "one lane per consumer warp",
    }
    nb.table(
        ("barrier", "who arrives", "count the protocol needs", "count in the PTX"),
        [
            (
                barrier_protocol.barrier_name(b),
                who[b.rstrip("0123456789")],
                c,
                in_ptx.get(b, "-"),
            )
            for b, c in counts.items()
            if b in ("q_full", "q_empty", "full0", "empty0", f"empty{kernel8.kv_slots - 1}")
        ],
    )

# %% [markdown]
# Then the protocol, at the kernel's own 6-slot ring: a CTA with one work tile of 1 and of 4 KV
# tiles (8 entries: the ring wraps), and a walk of three work tiles with 2, 0 and 1 KV tiles (an
# empty range in the middle, the phases carried across tiles as stage 11's persistent CTAs will
# need). Every reachable state of the three programs is visited.

# %%
if kernel8 is not None:
    rows = []
    for walk in ([1], [4], [2, 0, 1]):
        stats = {}
        found = barrier_protocol.explore_cta(
            barrier_protocol.cta_programs(kernel8, walk), counts, stats=stats
        )
        rows.append(
            (
                f"{len(walk)} work tile{'s' * (len(walk) > 1)}: "
                + ", ".join(map(str, walk))
                + " KV tiles",
                2 * sum(walk),
                stats["states"],
                "; ".join(sorted(found)) or "none",
            )
        )
    nb.table(("CTA", "ring entries", "states explored", "problems"), rows)

# %% [markdown]
# A model that finds nothing proves little until it is seen to fail. Each near miss below is
# planted in the model of the same kernel object with its ring cut to 2 slots (the same methods,
# a state space small enough to wrap many times), one work tile of 3 KV tiles. `tests/
# test_stage8_hopper.py` requires every one of them to be caught.

# %%
if kernel8 is not None:
    small, _ = mod8.compile_args(torch.bfloat16, (2, 4, 512, 1024, 128))
    small.kv_slots = 2
    rows = []
    for change, what in barrier_protocol.NEAR_MISSES.items():
        programs, planted_counts, fill = barrier_protocol.plant_near_miss(small, change, [3])
        found = sorted(barrier_protocol.explore_cta(programs, planted_counts, fill))
        rows.append((what, f"{len(found)} found, e.g. {found[0]}" if found else "none"))
    nb.table(("near miss planted", "what the model reports"), rows)

# %% [markdown]
# The third row is a count one warpgroup short: kv_empty completes as soon as one warpgroup has
# released a slot, and the producer refills it while the other warpgroup may still read it. On a
# GPU that race shows only when the timing lines up; the model finds it in every run.
#
# ### 5.7 What the compiler produced
#
# The Hopper kernel for sm_90a: `.reqntid 384` (with `.minnctapersm 1`: the register cap of 168 at
# entry: the cubin's register count below is that cap, not what the consumers use after
# `setmaxnreg`), the two `setmaxnreg` instructions, the 14 `mbarrier.init` (2 + 2 x 6) with the
# counts of 5.6, and stage 7's loop body: the same `wgmma.mma_async` and `ex2.approx` counts,
# each GEMM waited for (`wgmma.wait_group 0` twice). 225 KiB of dynamic shared memory: Q and six
# 32 KiB slots and 1 KiB.

# %%
report = nb.compile_summary(8, "hopper")
if report is not None:
    for pattern in (r"\.reqntid", r"setmaxnreg", r"mbarrier\.init", r"wgmma\.wait_group"):
        print("\n".join(ptx_lines(report.ptx, pattern, limit=3)))

# %% [markdown]
# ### 5.8 What is left
#
# The two consumer warpgroups start together (both wait on `q_full`) and run the same instructions
# on the same tiles; nothing in stage 8 holds them apart. So they tend to use the same unit at the
# same time: both issue their GEMMs and wait while the tensor cores serve them, then both compute
# exponentials while the tensor cores idle. Stage 9 makes them take turns on the tensor cores.
#
# ### 5.9 The same stage on Blackwell
#
# On Blackwell, warp roles were the design from stage 1 on (a TMA warp, an MMA warp, four warps
# that read tensor memory: stage 1's epilogue, from stage 3 on the softmax), because one thread
# issues the `tcgen05.mma` and the accumulators live in tensor memory.
# Stage 8 there splits the jobs of stage 7's softmax warps as FA4 does: a softmax warpgroup only
# turns S into P, a **correction** warpgroup rescales O in tensor memory and runs the epilogue
# (O and LSE stored by rows, as in stage 7; stage 12 adds the TMA store of O), and the MMA and
# TMA warps and two idle warps make a third (`setmaxnreg` acts on whole warpgroups). From the 168
# registers a thread that 384 threads hold at launch, `setmaxnreg` gives the three 208, 152 and
# 144: $(208 + 152 + 144) \cdot 128 = 64{,}512 = 384 \cdot 168$, the same pool arithmetic as on
# Hopper. The cells show the docstring of
# `stages/stage8_warp_specialized/blackwell.py`, its kernel diff against Blackwell stage 7 (the
# start), the concept table of the two tracks and the compile summary.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors, their PTX is checked and the
# hand-offs between their roles are replayed on the CPU (`common/tools/schedule.py`). Their
# numerics are tested only where an sm_100 GPU exists.

# %%
nb.show_docstring(8, "blackwell")
nb.show_diff(8, "blackwell", max_lines=60)
nb.diff_map(8, "blackwell")

# %%
rows = nb.cross_track_table(8)
report_bw = nb.compile_summary(8, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** the checks of stage 7, unchanged: MHA in batch mode (a few $10^{-3}$ relative,
# within 3x PyTorch's own bf16 error), the masks of stage 6 including rows with no key, GQA and
# MQA, and a packed batch with NaN planted around each sequence. Each consumer warpgroup runs
# stage 7's arithmetic in the same order (only *when* changes, not *what*), so O and LSE should
# equal stage 7's bit for bit; the last cell of this section compares them on one input.

# %%
result = nb.run_and_verify(8, (2, 4, 512, 1024, 128))
checks = nb.run_and_verify_cases(
    8,
    list(nb.MASK_CASES)
    + [
        ("GQA 8 / 2, causal", (2, 8, 300, 700, 128), dict(kv_heads=2, causal=True)),
        ("MQA 8 / 1, D = 64", (1, 8, 520, 520, 64), dict(kv_heads=1)),
    ],
)
packed_checks = nb.run_and_verify_varlen(
    8, [200, 77, 0, 300, 1], [130, 190, 5, 129, 260], heads=4, kv_heads=2, causal=True
)

# %%
if nb.MODE == "gpu" and nb.available(7, nb.TRACK) and nb.available(8, nb.TRACK):
    from common.tools import inputs

    q, k, v = inputs.attention_inputs(2, 8, 1000, 1000, 128, seed=5)
    o7, lse7 = stage_table.track_module(7, nb.TRACK).attention(
        q, k, v, causal=True, return_lse=True
    )
    o8, lse8 = stage_table.track_module(8, nb.TRACK).attention(
        q, k, v, causal=True, return_lse=True
    )
    torch.cuda.synchronize()
    print(f"stage 8 == stage 7 bit for bit: O {torch.equal(o7, o8)}, LSE {torch.equal(lse7, lse8)}")
else:
    print("the bit-for-bit comparison with stage 7 needs GPU mode")

# %%
fig = nb.error_picture(8, result)

# %% [markdown]
# ## 7. Measure
#
# **Expected**, from the ablation of `make bench` on the H200 (2026-12-04, bf16, the paper shapes
# B·S = 16k, H·D = 2048; `docs/results/ablation_h200_2026-12-04.md`). Every kernel of a row was
# timed in the same interleaved rounds: the kernels take turns, round after round, so that the
# steps of the H200's clock under its power cap fall on all of them alike. Each is timed two
# ways: *event-timed*, by CUDA events around each call (host work included where it is longer
# than the kernel), and in *GPU time* alone, the kernels' own durations (CUPTI). The cell reads
# the rows from S = 2k out of the run's `.json` (below 2k a call's host work can be longer than
# the kernel) and prints stage 8 over stage 7 both ways, and over FA4 (event-timed).

# %%
with open(os.path.join(nb.ROOT, "docs/results/ablation_h200_2026-12-04.json")) as f:
    ablation = json.load(f)
print(f"{ablation['gpu']}, {ablation['date']}, bf16, torch {ablation['torch']}")
gpu_time = {
    tuple(r["shape"]): r["tflops"] for r in ablation["rows"] if r["stage"] == "ablation GPU time"
}
rows = []
for r in sorted(
    (r for r in ablation["rows"] if r["stage"] == "ablation" and r["shape"][2] >= 2048),
    key=lambda r: (-r["shape"][4], r["shape"][5], r["shape"][2]),
):
    t, g = r["tflops"], gpu_time[tuple(r["shape"])]
    rows.append(
        (
            r["shape"][4],
            "causal" if r["shape"][5] else "-",
            r["shape"][2],
            f"{t['stage 7']:.0f}",
            f"{t['stage 8']:.0f}",
            f"{t['FA4']:.0f}",
            f"{t['stage 8'] / t['stage 7']:.2f}",
            f"{g['stage 8'] / g['stage 7']:.2f}",
            f"{t['stage 8'] / t['FA4']:.2f}",
        )
    )
nb.table(
    ("D", "mask", "S", "stage 7", "stage 8", "FA4", "8 / 7", "8 / 7 (GPU time)", "8 / FA4"),
    rows,
)
fig = figures.step_against_s(
    ablation["rows"],
    "stage 7",
    "stage 8",
    f"Stage 7 -> 8, TFLOP/s ({ablation['gpu']}, {ablation['date']}, bf16, event-timed)",
)

# %% [markdown]
# What the table says (H200, 2026-12-04): at D = 128 warp specialisation gains 8-16% over stage 7
# non-causal and 7-13% causal from S = 2k (9-17% and 6-12% in GPU time). At D = 64 it gains nothing
# to 8% (0.98-1.05 causal): there a GEMM takes half the time it takes at D = 128 and the
# exponentials as long (at the FlashAttention-3 paper's H100 rates, about 140 against 280 ns a GEMM
# and 277 ns an exponential pass per KV tile: notebook 9's section 3), so the loads and the
# registers that warp specialisation frees were not what held D = 64 back. In that run stage 7 ran
# one CTA an SM at D = 64 in bf16: ptxas gave it 133 registers a thread, and two 256-thread CTAs
# share an SM only at 128 or fewer. In fp16 the same run's stage 7 got 128, two CTAs, and stage 8
# ran at 0.72-0.77 of it at D = 64 from 2k (`docs/results/ablation_h200_2026-12-04_fp16.md`). Stage
# 7's code from 2026-12-05 on gets 123 in bf16, so two CTAs (four warpgroups computing, where stage
# 8 has two consumers), and then stage 8 runs at 0.74-0.85 of it at D = 64 (H100 80GB HBM3,
# 2026-12-05; the registers and that run in `docs/notes/stage8.md`; stage 12's third consumer
# warpgroup wins the difference back). On the H200, stage 8 stays at 0.77-0.88 of FA4 at D = 128 and
# 0.69-0.77 at D = 64: FA4's Hopper path (FlashAttention-3's schedule) has the next three stages'
# techniques too.
#
# The FlashAttention-3 paper (Shah et al., 2024) justifies warp specialisation with an ablation
# on an H100 SXM5 at one shape (its Table 2: FP16, non-causal, batch 4, 8448 tokens, 16 heads of
# 128, the clock fixed at 1830 MHz): its full kernel ran 661 TFLOP/s, the same kernel without
# warp specialisation 570 (+16% for it), and without the softmax/GEMM pipelining inside a
# warpgroup (stage 10 here) 582. Its variants switch one technique off in its finished kernel,
# where this tutorial adds them one after the other, on another GPU: read the two as the same
# technique measured from two sides, not as numbers that should agree.
#
# The cell below measures stage 8 against stage 7 and FA4 on this machine's GPU, all in one run.
# One such run moves by a few percent from the next: in this notebook's executed copy (H100 80GB
# HBM3, 2026-12-07) stage 8 read 1.02x stage 7 at D = 128 and 0.82x at D = 64, where the H100's
# ablation of 2026-12-06 read 1.09x and 0.82x at S = 8k
# ([`docs/results/ablation_h100_2026-12-06.md`](../docs/results/ablation_h100_2026-12-06.md)).

# %%
bench = nb.measure(
    8,
    [(2, 16, 8192, 8192, 128), (2, 32, 8192, 8192, 64)],
    also_stages=(7,),
    with_fa4=True,
)

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU; where a GPU adds a measurement, the exercise says which call makes it.
#
# 1. **The register pool.** Why is 24 / 240 the largest split with 240? What happens if the
#    producer keeps 32 registers (`self.load_registers = 32`)? Predict, then compile it without a
#    GPU: `nb.compile_summary(8, "hopper", settings=dict(load_registers=32))` - does the compiler
#    object?
# 2. **The ring's depth.** With one ring entry per load but only 2 slots, how far ahead could the
#    producer run? Draw it: `figures.ring_timelines(kv_tiles=5, slots_before=2, slots_after=2)`.
#    Why does stage 7 manage with
#    2 slots at all?
# 3. **Parities.** In 5.3's table, why does the producer's first wait on each `kv_empty` pass at
#    once, and which entry is the first whose producer waits for a real release?
# 4. **A near miss of your own.** Make `q_empty` count one consumer warpgroup's threads (128)
#    instead of both's: `counts["q_empty"] = 128` in the model of 5.6, with a walk of several
#    work tiles (say `[1, 1]`). What does the model report, and why does a CTA with one work tile
#    (this stage's grid) hide it?
# 5. **The grid.** For the paper shape (2, 16, 8192, 8192, 128), how many CTAs does the grid
#    launch, how many can run at once on the H200's 132 SMs (one per SM: why?), and how many
#    rounds of CTAs does that make?
# 6. **Count the wrong arrivals** (exercise 8a, an edit of the Hopper stage file): make kv_empty
#    count threads and watch the model - and, on a GPU, the kernel. The cells at the end of the
#    notebook give the task and check the edit.
#
# ### Answers and checks
#
# <details><summary>1. The register pool</summary>
#
# The CTA's pool is what it got at launch, $384 \cdot 168 = 64{,}512$; the producer frees
# $128 \cdot (168 - 24) = 18{,}432$ and the consumers need $256 \cdot (240 - 168) = 18{,}432$: all
# of it (24 is also the smallest count `setmaxnreg` allows). With 32 the producer frees only
# $128 \cdot 136 = 17{,}408$, and the consumers' `setmaxnreg.inc 240` blocks until the pool holds
# enough - forever: the kernel hangs at its start. The compiler cannot know: the PTX simply says
# `setmaxnreg.dec.sync.aligned.u32 32`, and the cell below shows it compiles. (The sum
# $128 \cdot 32 + 256 \cdot 240 = 65{,}536$ fits the SM's register file; it does not fit the CTA's
# pool.)
# </details>
#
# <details><summary>2. The ring's depth</summary>
#
# Two slots, one entry per load: entry $e$ needs entry $e - 2$ released, so $K_{j+1}$ waits for
# the release of $K_j$ and $V_{j+1}$ for that of $V_j$ - the producer is one KV tile ahead at most
# and waits after nearly every load, as stage 7's does. Stage 7 manages with 2 slots for the same
# reason: $K_{j+1}$ has the other slot while $V_j$ reuses $K_j$'s, one tile ahead, no more. Six
# slots keep up to 3 KV tiles in flight, so a load may take as long as 3 steps of computation
# before a consumer waits for it.
# </details>
#
# <details><summary>3. Parities</summary>
#
# The producer's parity for the first use of a slot ($w = 0$) is 1, and a fresh barrier counts
# as having completed the phase before phase 0 - so the wait passes (stage 1's rule). Entry
# `kv_slots` (6) is the first that reuses a slot: its producer waits for parity 0, the phase the
# consumers' release of entry 0 completes.
# </details>
#
# <details><summary>4. A near miss of your own</summary>
#
# With 128, `q_empty` completes when the first warpgroup's epilogue is done, and again when the
# second's is: two phases per tile. The model reports the producer loading the next tile's Q while
# a consumer still reads this one ("Q1 overwrites slot Q while it is read"), reads of the wrong Q,
# and hangs (the parities drift apart). With one work tile per CTA the producer never waits on
# `q_empty` for a real release (its first wait passes on the fresh barrier), so nothing goes wrong
# - until stage 11 walks several tiles per CTA. The cell below runs it.
# </details>
#
# <details><summary>5. The grid</summary>
#
# 64 Q tiles x 16 heads x 2 sequences = 2,048 CTAs. One runs per SM: 225 KiB of shared memory
# leaves no room for a second CTA's (and 384 x 168 registers leave 1,024). So 132 run at once,
# in $\lceil 2048 / 132 \rceil = 16$ rounds, the last one 68 CTAs. Every CTA pays its set-up
# (barriers, descriptors, Q's load, the first K and V) - what stage 11's persistent CTAs pay once
# per SM.
# </details>

# %%
# Exercise 1: the producer at 32 registers compiles (the PTX asks; nothing checks the pool).
r32 = nb.compile_summary(8, "hopper", settings=dict(load_registers=32), patterns=(r"setmaxnreg",))
print("pool:", 384 * 168, "| producer frees:", 128 * (168 - 32), "| consumers need:", 256 * 72)

# Exercise 2: one entry per load in 2 slots.
fig = figures.ring_timelines(kv_tiles=5, slots_before=2, slots_after=2)

# Exercise 3: the first entry whose producer waits for a real release.
if kernel8 is not None:
    first = next(
        e
        for e in range(100)
        if kernel8.ring_state(e, PipelineUserType.Producer).phase == 0 and e >= kernel8.kv_slots
    )
    print(f"first entry that waits for a release: {first} (slot {first % kernel8.kv_slots})")

# Exercise 4: q_empty counting one consumer warpgroup's threads.
if kernel8 is not None:
    wrong = dict(counts, q_empty=128)
    for walk in ([1], [1, 1]):
        found = sorted(
            barrier_protocol.explore_cta(barrier_protocol.cta_programs(kernel8, walk), wrong)
        )
        print(f"walk {walk}: {len(found)} problems" + (f", e.g. {found[0]}" if found else ""))

# Exercise 5: the grid of the paper shape.
tiles = -(-8192 // 128) * 16 * 2
print(
    f"{tiles} CTAs on 132 SMs: {-(-tiles // 132)} rounds, the last {tiles - 132 * (tiles // 132)}"
)

# %% [markdown]
# ### Exercise 8a: count the wrong arrivals
#
# The first cell gives the task; the second compiles the stage file as it is on disk now (no GPU
# needed), reads the barriers' counts from the PTX and replays the protocol with them, and says
# "done" or "not yet". On the committed file it says "not yet". Where a Hopper GPU exists it also
# runs the edited kernel - in a process of its own, with a deadline, since an edit of the
# barriers may hang it.
#
# <details><summary>Answer</summary>
#
# kv_empty then needs 256 arrivals per phase and gets 8 per use of its slot: it never completes
# a phase. Nothing goes wrong while the producer fills the 6 fresh slots (its first waits pass on
# fresh barriers); at entry 6 it waits on `kv_empty[0]` for the release of entry 0 - forever. The
# consumers finish the tiles that were loaded and then wait on `kv_full[0]` for entry 6, which
# never comes. A CTA whose range has 3 KV tiles or fewer loads everything and hangs one step
# later, in `producer_tail`. The model reports both hangs; on a GPU the kernel does not finish:
# `tests/test_exercises.py` runs the edited kernel under a deadline and passes only if the check
# reports the hang, and it passed on an H200 (2026-12-04,
# `docs/results/exercises_h200_2026-12-04_8a-10a.txt`).
# </details>

# %%
nb.exercise("8a")

# %%
nb.check_exercise("8a")

# %% [markdown]
# **Next:** `make diff-9` shows what stage 9 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage9_pingpong.ipynb`](stage9_pingpong.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage8.md`](../docs/notes/stage8.md).
