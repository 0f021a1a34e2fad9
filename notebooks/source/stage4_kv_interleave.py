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
# # Stage 4 - KV-tile interleaving: K and V share one shared-memory ring, exact two-pass softmax
#
# This notebook walks through `stages/stage4_kv_interleave/hopper.py` and
# `stages/stage4_kv_interleave/blackwell.py`: attention for any key length, with K and V tiles
# sharing one ring of shared-memory slots, and the synchronisation hazard that comes with it. The
# stage is called "V overwrites K" after the Hopper ring, where $V_j$ lands in the very slot $K_j$
# occupied. The Blackwell ring makes every load its own ring entry, so there $V_j$ goes to the
# slot *after* $K_j$'s and overwrites an older tile instead (section 5.5); the hazard and its fix
# are the same: a slot may be refilled only after the MMA that read its previous tile has
# completed. The notebook imports the stage files and displays them; it never pastes kernel code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage4_kv_interleave.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; the compile
# summaries of both tracks appear in both modes. Source: `notebooks/source/stage4_kv_interleave.py`.

# %%
import os
import sys

import torch

# The repository root (it holds `common` and `stages`): the first folder upwards that has `common`.
ROOT = os.getcwd()
while not os.path.isdir(os.path.join(ROOT, "common")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from common.tools import notebook as nb  # noqa: E402
from notebooks.figures import stage4 as figures  # noqa: E402

nb.start(4)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - stream K and V tiles of any length through one ring of `kv_slots` shared-memory slots;
# - state the hazard and its fix: TMA may write a tile into a slot only after every MMA reading
#   the slot's previous tile has *completed* - issuing, even committing, a `wgmma` does not mean it
#   has read its operands;
# - keep the phase bits of barriers whose slots are used unevenly (once per tile in pass 1, twice in
#   pass 2), with the producer's first wait on a fresh slot at parity 1 (stage 1, section 5.2);
# - compute an exact softmax over many KV tiles in two passes, and say what the second pass costs;
# - recognise in a timeline what goes wrong when $V_j$ is loaded without waiting for the release
#   of its slot - the mistake a Blackwell ring written the obvious way makes.
#
# ## 2. Previous stage recap
#
# Stage 3 computed $O = \text{softmax}(\text{scale}\cdot QK^{\top})V$ when all keys fit in one
# 128-key tile: row max and row sum over quads of threads with two shuffles, `exp2` with
# $\log_2 e$ folded into `scale_log2`, P reused in registers as the A operand of $PV$ (Hopper) or
# written over S in TMEM (Blackwell), V^T read MN-major from the V tile's own bytes, and one
# division by the row sum at the end. K and V each had their own slot. Longer sequences were
# refused.
#
# ## 3. The math
#
# With $S_k$ keys split into $n$ tiles $j = 0 \ldots n-1$ of 128 keys (in the code: $j$ is
# `kv_tile`, $n$ is `kv_tiles`, 128 is bN), a row's softmax needs the max and the sum over *all*
# tiles before any probability is final. Stage 4 gets them first, then uses them (for one row;
# $x = \text{scale}\cdot S$):
#
# **Pass 1** (K only), tile by tile:
# $$m \leftarrow \max\big(m, \max_{k \in j} x_k\big), \qquad
# \ell \leftarrow \ell\, e^{m_{\text{old}} - m} + \sum_{k \in j} e^{x_k - m}$$
# (two scalars per row; when the max grows, the sum so far is rescaled).
#
# **Pass 2** (K and V), tile by tile, with the final $m$ and $\ell$:
# $$P_{jk} = \frac{e^{x_k - m}}{\ell}, \qquad O \leftarrow O + P_j V_j .$$
#
# Every P is final when it is computed, so O needs no rescaling and no division at the end. The
# price: $QK^{\top}$ is computed twice, so the matrix work is $6BHS_qS_kD$ instead of $4BHS_qS_kD$
# (1.5x), K is read twice and every score is exponentiated twice. The CPU check below runs both
# passes on random data.

# %%
# Two-pass exact softmax over KV tiles, one (batch, head), on the CPU in fp64.
torch.manual_seed(0)
Sq, Sk, D, tile = 4, 10, 3, 4
q = torch.randn(Sq, D, dtype=torch.float64)
k = torch.randn(Sk, D, dtype=torch.float64)
v = torch.randn(Sk, D, dtype=torch.float64)
scale = D**-0.5
m = torch.full((Sq,), -torch.inf, dtype=torch.float64)
l = torch.zeros(Sq, dtype=torch.float64)
for j0 in range(0, Sk, tile):  # pass 1: K only
    x = scale * q @ k[j0 : j0 + tile].T
    m_new = torch.maximum(m, x.amax(-1))
    l = l * torch.exp(m - m_new) + torch.exp(x - m_new[:, None]).sum(-1)
    m = m_new
o = torch.zeros(Sq, D, dtype=torch.float64)
for j0 in range(0, Sk, tile):  # pass 2: K and V
    x = scale * q @ k[j0 : j0 + tile].T
    o += torch.exp(x - m[:, None]) / l[:, None] @ v[j0 : j0 + tile]
ref = torch.softmax(scale * q @ k.T, -1) @ v
print(
    f"tiles of {tile} keys over Sk = {Sk} (the last one partial): "
    f"max |O - softmax(QK^T)V| = {(o - ref).abs().max():.2e}"
)

# %% [markdown]
# ## 4. What changes
#
# The docstring lists the changes with their numbers; below it, the diff of the kernel class
# against stage 3 (`make diff-4 TRACK=hopper` shows the whole files). Most of the diff is new
# methods: the kernel is now split by role, as stage 8 will split it by warp (the class
# docstring). `kernel` prepares what all threads share; warp 0's `load` issues Q and the K tiles
# of the first `kv_slots` steps; then every warpgroup runs `mma`: pass 1, pass 2 (one
# `mma_one_n_block` per KV tile) and the `epilogue`. Warp 0 is no separate producer yet: it
# issues the ring's later loads from inside `mma`. `mma_threads` is how many threads compute and
# `mma_tidx` numbers them: all 256 here, so `mma_tidx = tidx` (from stage 8 on, a producer
# warpgroup comes first and the count starts after it).

# %%
nb.show_docstring(4, "hopper")

# %%
nb.show_diff(4, "hopper")

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 One ring for K and V
#
# In stage 3, Q, K and V each had a slot. For long sequences, separate K and V rings of
# `kv_slots` tiles each would cost Q + 2 x `kv_slots` tiles of shared memory. Stage 4 keeps one
# ring. Its steps are K tiles $0 \ldots n-1$ (pass 1), then KV tiles $0 \ldots n-1$ (pass 2);
# step t uses slot t % `kv_slots`, in pass 2 twice: $K_j$ lands, $S = QK_j^{\top}$ reads it, the
# slot is released, $V_j$ lands in the same slot, $O \mathrel{+}= PV_j$ reads it, the slot is
# released and refilled with the K tile `kv_slots` steps ahead.

# %%
cfg = nb.show_config(4, "hopper")
bM, bN, D = cfg.get("cta_tile", (128, 128, 128))
kv_slots = cfg.get("kv_slots", 2)
tile_kb = bN * D * 2 // 1024
q_kb = bM * D * 2 // 1024
print(
    f"D = {D}: Q {q_kb} KiB + {kv_slots} slots x {tile_kb} KiB = {q_kb + kv_slots * tile_kb} KiB; "
    f"separate K and V rings of {kv_slots}: {q_kb + 2 * kv_slots * tile_kb} KiB; "
    f"K and V of Sk = 1024 resident: {q_kb + 2 * 1024 * D * 2 // 1024} KiB (of 227 KiB)"
)

# %% [markdown]
# The timeline of one CTA, as a model (durations illustrative, not measured): pass 1 streams the K
# tiles, pass 2 streams $K_j'$ (the same tiles again) and $V_j$. Watch a slot in pass 2: it
# receives a K tile (orange), is released (▲) after the QK MMA, then receives the V tile (green)
# of the same step. Note also the wait of the MMA lane before each PV: $V_j$ can only start
# loading once $QK_j$ is done, and only the softmax is there to hide its latency.

# %%
fig = figures.kv_slot_timeline(kv_tiles=3, kv_slots=kv_slots, two_pass=True)

# %% [markdown]
# ### 5.2 The hazard: release after the MMA completes, load V after the release
#
# `wgmma` is asynchronous: `commit_group` closes a batch of issued MMAs, it does not wait for them.
# The tensor cores may still be reading $K_j$ from shared memory when the warp moves on. So the
# order in pass 2 is: issue the QK wgmmas, `wgmma.wait_group 0` (they have completed, $K_j$ is no
# longer needed), *then* release the slot (an arrive per warp on its empty barrier), and the
# producer waits for all those arrives before it announces $V_j$'s bytes and starts the TMA load.
# Release before that wait, or let the producer load $V_j$ without waiting for the release, and
# TMA silently overwrites $K_j$ under the tensor cores. A Blackwell ring written the obvious way
# does the second (section 5.5): it loads $V_j$ into $K_j$'s slot, under $K_j$'s barrier, without
# waiting for the QK MMA to release the slot. Drop a release altogether instead and the producer
# waits forever (exercise 4b, on the Blackwell file). The same model with the V load not waiting
# for the release shows the race (the hazards row names each overwrite):

# %%
fig = figures.kv_slot_timeline(
    kv_tiles=2, kv_slots=kv_slots, two_pass=True, v_waits_for_release=False
)

# %% [markdown]
# Phase bookkeeping: a barrier completes one phase per use of its slot, and waiters wait for a
# phase parity (stage 1, section 5.2). In pass 2 a slot is used twice per step, so the usual
# `PipelineState` (one flip per lap of the ring) no longer matches; the stage keeps one parity bit
# per slot (`slot_phase`) and builds the state of each use with `slot_state`. The producer's
# first wait on a fresh slot is for parity 1 - on a barrier no phase has completed yet, a wait for
# parity 1 returns at once - so `load` (in the diff of section 4) fills each slot the first time
# with `slot_state(slot, 1)` and does not wait. Below: `slot_state`, the producer step
# `load_tiles`, one step of pass 2 (`mma_one_n_block`: wait for the QK group, the wgmmas reading
# $K_j$, release $K_j$'s slot, only then load $V_j$ into it - the fix of the hazard above, which
# exercise 2 asks about) and the main loop of `mma`:

# %%
nb.show_source(
    4,
    "hopper",
    names=["Sm90Kernel.slot_state", "Sm90Kernel.load_tiles", "Sm90Kernel.mma_one_n_block"],
)

# %%
nb.show_source(4, "hopper", section="# 2.")

# %% [markdown]
# ### 5.3 The statistics of pass 1
#
# Pass 1 folds each S tile into `row_max` and `row_sum` (m and $\ell$) with `online_softmax` - the
# same update stage 5 will use for O as well. Pass 2 uses a rewritten `softmax` (stage 3's without
# its reductions) with the final statistics, dividing by `row_sum` inside P.

# %%
nb.show_source(4, "hopper", names=["Sm90Kernel.online_softmax"])

# %% [markdown]
# ### 5.4 What the compiler produced
#
# The Hopper kernel for sm_90a (both modes). Exercise 4 compares its instruction counts with
# stage 3's.

# %%
report = nb.compile_summary(4, "hopper")

# %% [markdown]
# ### 5.5 The same stage on Blackwell
#
# The machine model is stage 1's (section 5.8), the TMEM plan and the warp roles stage 3's. What
# stage 4 changes on Blackwell is the ring. Every load is its own ring entry (entry e in slot
# e % `kv_slots`, each with its own byte count): in pass 2 the producer loads $K_j'$, then $V_j$
# into the *next* slot, so $V_j$ overwrites the tile two loads older, not $K_j$. A slot is released
# by `tcgen05.commit` when the MMA that read it completes, and the producer waits for that release
# before reusing the slot - the same rule as Hopper's, with the tensor core, not the consumer
# threads, arriving on the empty barrier. The entries per KV tile are declared in the kernel
# class: the TMA warp's `load` loops over `kv_producer_entries`, and `kv_consumer_entries` states
# the order in which the MMA warp's `mma` waits; `common/tools/schedule.py` replays the ring from
# them and checks that the two agree and that no slot is refilled before its release. The file's
# docstring lists how such a ring fails when written the obvious way: $V_j$ loaded into $K_j$'s
# slot under $K_j$'s barrier before the QK MMA had read $K_j$; one ring entry produced per KV tile
# against two consumed (a hang); the ring armed with Q's bytes plus K's (a barrier that never
# completes); S accumulated across KV tiles.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors and their PTX is checked for
# the `tcgen05` instructions. Their numerics are tested only where an sm_100 GPU exists.

# %%
bw = nb.kernel_config(4, "blackwell")
print(
    "ring entries per KV tile, producer (pass 1, pass 2):",
    bw.get("kv_producer_entries"),
    "| consumer:",
    bw.get("kv_consumer_entries"),
)
fig = figures.kv_slot_timelines(
    [
        dict(kv_tiles=3, kv_slots=kv_slots, two_pass=True, slot_per="tile"),
        dict(kv_tiles=3, kv_slots=bw.get("kv_slots", 2), two_pass=True, slot_per="entry"),
    ],
    suptitle="The two rings on one time axis (model): Hopper (top) and Blackwell (bottom)",
)

# %%
nb.show_docstring(4, "blackwell")
nb.show_diff(4, "blackwell")

# %%
rows = nb.cross_track_table(4)
report_bw = nb.compile_summary(4, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** like stage 3, a relative error of a few $10^{-3}$ (bf16 P and bf16 O; the run of
# this notebook's executed copy, `docs/notebooks/stage4_kv_interleave.ipynb`, measured
# $2.4\cdot 10^{-3}$ on an H100 80GB HBM3, 2026-12-07), within 3x PyTorch's own bf16 attention error
# against the fp64 reference; the table prints the bound used. With $S_k = 1024$ there are
# 8 KV tiles, so a slot is reused many times: a phase bookkeeping error shows up as a wrong result
# or a hang (the check has a deadline, a hang fails after 60 s instead of blocking). Run
# `make sanitize` on a GPU for compute-sanitizer's race and synchronisation checks. The error map
# shows the (b, h) slice holding the worst element.

# %%
result = nb.run_and_verify(4, (2, 4, 512, 1024, 128))

# %%
fig = nb.error_picture(4, result)

# %% [markdown]
# ## 7. Measure
#
# Attention FLOPs count the useful work, $4BHS_qS_kD$; stage 4 performs 1.5x that, and waits for
# every V load (5.1), with no warp specialisation. Shapes as in the FlashAttention papers
# (B·S = 16k tokens, H·D = 2048). The baselines: SDPA's flash backend (FlashAttention-2) and its
# cuDNN backend, timed in the same run below, and in the run quoted next also FA4 (FlashAttention
# 4, the library kernel written in the same CuTe DSL). **Expected:** `make bench` measured
# 321 / 361 / 366 TFLOP/s at S = 1k / 4k / 8k, D = 128, about FlashAttention-2's level (SDPA flash
# 336 / 347 / 345 in the same run; SDPA cuDNN 608 / 666 / 673, FA4 589 / 711 / 651; H200,
# 2026-11-29, `docs/results/bench_h200_2026-11-29.md`). The table below is this run; its last
# column is stage 4's speed over each kernel.

# %%
bench = nb.measure(
    4, [(16, 16, 1024, 1024, 128), (4, 16, 4096, 4096, 128), (2, 16, 8192, 8192, 128)]
)

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook.
#
# 1. **Slots.** Re-draw 5.1 with `kv_slots=1` and `kv_slots=3` (on one axis:
#    `figures.kv_slot_timelines([dict(kv_slots=1), dict(kv_slots=3)])`). Does the Hopper scheme
#    deadlock with one slot? How much shared memory does each setting need at D = 128
#    (`nb.compile_summary(4, "hopper", settings=dict(kv_slots=3))`), and what does a third slot
#    buy in the model?
# 2. **The race.** In the racy timeline, which MMA reads a slot while TMA writes into it? Which
#    lines of the stage file's pass 2 prevent it, and what happens if you move
#    `consumer_release` above `wait_group(0)`? (Try it on a GPU under `make sanitize`.)
# 3. **Hopper vs Blackwell rings.** Compare the two timelines of 5.5: why does the Blackwell ring's
#    $V_j$ start loading before $QK_j$ has finished, and what does it need instead to stay correct?
# 4. **Cost of exactness.** Count the `wgmma.mma_async` and `ex2.approx` instructions in the
#    compile summary of stage 4 (5.4) and of stage 3 (`nb.compile_summary(3, "hopper")`). Which
#    ones come from pass 1?
# 5. **Phases.** With `kv_slots = 2` and 3 KV tiles, list for each use of slot 0 (pass 1 and
#    pass 2) the tile it holds and the parity the consumer waits for on its full barrier.
# 6. **Exercises 4a and 4b** edit the stage files (a third K/V slot; a release dropped on the
#    Blackwell ring): the cells after the answers below.
#
# ### Answers and checks
#
# <details><summary>1. Slots</summary>
#
# No deadlock with one slot: each load waits for the previous release, so K, V and the next K
# take turns and every load is exposed (the model's run takes longest). Shared memory at D = 128:
# Q 32 KiB + 32 KiB per slot, 64 / 96 / 128 KiB for 1 / 2 / 3 slots, and 1 KiB more for the
# barriers and alignment in the compile summary (65 / 97 / 129 KiB). A third slot lets the next K
# tile load earlier, but in the model the PV waits for V_j, which can only start after QK_j, so
# the run is not shorter.
# </details>
#
# <details><summary>2. The race</summary>
#
# The QK MMA of pass 2 (QK0', QK1') reads K_j' while V_j lands in the same slot. What prevents it:
# `warpgroup.wait_group(0)` before `kv_pipeline.consumer_release(k_state)`, and the producer's
# `producer_acquire` (in `load_tiles`), which waits for those releases before V_j's TMA starts.
# Releasing before the wait lets TMA start V_j while the tensor cores may still read K_j: wrong
# scores now and then, no error - a silent race, which racecheck may not see (it tracks threads'
# shared-memory accesses; TMA and wgmma work in the async proxy).
# </details>
#
# <details><summary>3. Hopper vs Blackwell rings</summary>
#
# On Blackwell V_j's entry is the next slot, whose previous tile (two loads back) was released
# earlier, so V_j can load while QK_j runs. It must still wait for that slot's release - the
# commit of the MMA that read the older tile - and the consumer must wait for V_j's own full
# barrier, with V_j's own byte count.
# </details>
#
# <details><summary>4. Cost of exactness</summary>
#
# The cell below counts them: stage 4 has one more batch of D / 16 = 8 QK `wgmma` (pass 1) and
# one more exponential per score (64 per thread per tile), plus one `ex2` per row for the rescale
# of l in `online_softmax`.
# </details>
#
# <details><summary>5. Phases</summary>
#
# The cell below lists the uses of each slot in the order of the ring: slot 0 holds K0, K2 (pass
# 1), then K1' and V1 (pass 2), waited for with parities 0, 1, 0, 1.
# </details>

# %%
# Exercise 4: instruction counts of stages 3 and 4 (Hopper).
for st in (3, 4):
    r = nb.compile_report(st, "hopper")
    if r is not None:
        print(
            f"stage {st}: wgmma.mma_async {r.counts['wgmma.mma_async']}, "
            f"ex2.approx {r.counts['ex2.approx']}"
        )

# Exercise 5: the uses of every slot (Hopper ring, kv_slots = 2, 3 KV tiles) and their parities.
loads, _, _ = figures.kv_ring_schedule(kv_tiles=3, kv_slots=2, two_pass=True, slot_per="tile")
for slot in range(2):
    uses = [item for item, s in loads if s == slot]
    print(f"slot {slot}:", ", ".join(f"{item} (parity {r % 2})" for r, item in enumerate(uses)))

# %% [markdown]
# ### Exercise 4a: a third K/V slot
#
# The first cell gives the task; the second compiles the stage file as it is on disk now (no GPU
# needed) and says "done" or "not yet" with what it read: the shared memory the kernel asks for.
# On the committed file it says "not yet".

# %%
nb.exercise("4a")

# %%
nb.check_exercise("4a")

# %% [markdown]
# ### Exercise 4b: drop a barrier release (Blackwell, `stages/stage4_kv_interleave/blackwell.py`)
#
# The first cell gives the task; the second compiles the stage file as it is on disk now (no GPU
# needed) and says "done" or "not yet" with what it read: it counts the MMA warp's
# `tcgen05.commit` in the PTX and replays stage 4's CTA in the schedule model without the missing
# release. On the committed file it says "not yet".

# %%
nb.exercise("4b")

# %%
nb.check_exercise("4b")

# %% [markdown]
# **Next:** `make diff-5` shows what stage 5 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage5_online_softmax.ipynb`](stage5_online_softmax.ipynb) walks through it.
# What this stage's measurements showed:
# [`docs/notes/stage4.md`](../docs/notes/stage4.md).
