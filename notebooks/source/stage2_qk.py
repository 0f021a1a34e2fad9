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
# # Stage 2 - $QK^{\top}$ only: the attention grid, rank-4 TMA, Q resident
#
# This notebook walks through `stages/stage2_qk/hopper.py` and `stages/stage2_qk/blackwell.py`:
# the GEMM of stage 1 turned into the first half of attention, $S = \text{scale}\cdot QK^{\top}$
# for every (batch, head), written out in fp32. The notebook imports the stage files and displays
# them; it never pastes kernel code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage2_qk.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; the compile
# summaries of both tracks appear in both modes. Source: `notebooks/source/stage2_qk.py`.

# %%
import os
import sys

# The repository root (it holds `common` and `stages`): the first folder upwards that has `common`.
ROOT = os.getcwd()
while not os.path.isdir(os.path.join(ROOT, "common")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from common.tools import notebook as nb  # noqa: E402
from notebooks.figures import stage2 as figures  # noqa: E402

nb.start(2)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - lay out the attention grid: one CTA per (128-row Q tile, head, batch);
# - describe one TMA descriptor that serves every (head, batch) pair by viewing a (B, H, S, D)
#   tensor as (S, D, H, B) - a rank-4 TMA;
# - explain operand reuse: the Q tile is loaded once and stays in shared memory while K tiles
#   stream through a ring of `kv_slots`;
# - read a dynamic layout: one compiled kernel serves every B, H, Sq and Sk, because those
#   extents are run-time values (stage 1's box *trace time and run time*, section 5.2);
# - compute how much memory writing S costs, and why FlashAttention never writes it.
#
# ## 2. Previous stage recap
#
# Stage 1 computed $C = AB^{\top}$ with both operands K-major: TMA loads into 128-byte-swizzled
# shared memory through views built by `local_tile` and `tma_partition`, `ab_buffers` buffers
# guarded by full/empty mbarriers (the full barrier counts bytes, `tx_count`; a producer's first
# wait uses parity 1), `wgmma` m64n256k16 issued by two warpgroups reading shared memory through
# descriptors, the accumulator in registers (rows spread over quads of threads), and an epilogue
# through shared memory and a TMA store. On Blackwell the accumulator lived in TMEM and warps had
# roles (0-3 epilogue, 4 MMA, 5 TMA).
#
# ## 3. The math
#
# For each batch b and head h, with $Q_{b,h} \in \mathbb{R}^{S_q \times D}$ and
# $K_{b,h} \in \mathbb{R}^{S_k \times D}$:
#
# $$S_{b,h} = \text{scale}\cdot Q_{b,h} K_{b,h}^{\top} \in \mathbb{R}^{S_q\times S_k},
# \qquad \text{scale} = \frac{1}{\sqrt{D}} \text{ unless given.}$$
#
# This is stage 1's GEMM with $A = Q$, $B = K$, $M = S_q$, $N = S_k$ and a reduction over only
# $K = D \le 128$: a whole row of Q fits in one reduction step ($b_K = D$), so there is no loop over
# the reduction any more. The loop
# runs over tiles of keys instead (`kv_tile` = 0, 1, ...), and each step produces a finished
# $128 \times 128$ tile of S. Work: $2\,B H S_q S_k D$ operations. Output: $4\,B H S_q S_k$ bytes of
# fp32. The cell below puts the two side by side.


# %%
def qk_traffic(B, H, Sq, Sk, D):
    flops = 2 * B * H * Sq * Sk * D
    read = 2 * B * H * (Sq + Sk) * D  # bf16 Q and K, each read once if Q stays resident
    written = 4 * B * H * Sq * Sk  # fp32 S
    return flops, read, written


for shape in [(4, 16, 1024, 1024, 128), (2, 16, 8192, 8192, 128)]:
    flops, read, written = qk_traffic(*shape)
    print(
        f"{shape}: {flops / 1e12:.2f} TFLOP, reads {read / 2**20:.0f} MiB, writes S = "
        f"{written / 2**30:.2f} GiB -> {flops / (read + written):.0f} FLOP per byte of memory traffic"
    )
print(
    "A GEMM of this size would be compute-bound; writing S makes QK^T memory-bound at D/2 FLOP per byte."
)

# %% [markdown]
# Writing S costs more than computing it: at $D = 128$ each fp32 score costs 4 bytes for 256
# operations, 64 operations per byte, while an H200 needs roughly 200 operations per byte of HBM
# traffic to keep its tensor cores busy (989 TFLOP/s datasheet dense bf16 over 4.8 TB/s datasheet
# HBM bandwidth). Stage 3 stops writing S: the softmax consumes it in registers.
#
# ## 4. What changes
#
# The stage file's docstring lists the changes with their numbers; below it, the diff of the
# kernel class against stage 1 (the docstring and the entry function left out;
# `make diff-2 TRACK=hopper` shows the whole files).

# %%
nb.show_docstring(2, "hopper")

# %%
nb.show_diff(2, "hopper")

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The attention grid
#
# One CTA per 128-row tile of Q of one head of one batch; each CTA produces the 128-row band of S
# for its rows, one 128-key tile at a time. `__init__` now takes the head dim: the reduction tile
# is the whole row of Q, $b_K = D$; from here on "K tile" means a tile of 128 keys.

# %%
cfg = nb.show_config(2, "hopper")
bM, bN, bK = cfg.get("cta_tile", (128, 128, 128))
fig = figures.attention_grid(
    B=2,
    H=4,
    Sq=512,
    Sk=1024,
    D=bK,
    block_m=bM,
    block_n=bN,
    highlight=(1, 2, 1),
    grid_label="grid = (Sq / bM, H, B)",
)

# %% [markdown]
# ### 5.2 One TMA descriptor for all heads: rank-4 views
#
# Q arrives as (B, H, Sq, D) with D contiguous. `__call__` *permutes the modes of the layout* - no
# data moves - to (Sq, D, H, B): a stack of (Sq, D) matrices indexed by (h, b). The TMA descriptor
# is built over this rank-4 view, and a CTA addresses its own matrix by slicing the TMA tensor,
# `mQ[None, None, head, batch]`, before `local_tile` (stage 1, section 5.2) cuts its tile. The
# same trick views S as (Sq, Sk, H, B). The layouts are *dynamic*: B, H, Sq and Sk are read on the
# GPU, so one compiled kernel serves every shape with the same D (stage 1's box *trace time and
# run time*).

# %%
nb.show_source(2, "hopper", names=["Sm90Kernel.__call__"])

# %% [markdown]
# ### 5.3 Q resident, K streaming
#
# Q is loaded once, on its own mbarrier, and every wgmma of the CTA reads it from shared memory. K
# tiles go through a ring of `kv_slots` slots - stage 1's `ab_buffers`, renamed because from stage 3
# on the ring carries K and V. Each step waits for its wgmmas (the whole S tile is needed before it
# can be stored), releases the K slot at once, and writes S through shared memory and TMA.

# %%
D = bK
kv_slots = cfg.get("kv_slots", 2)
q_bytes, k_bytes, s_bytes = bM * D * 2, bN * D * 2, bM * bN * 4
print(
    f"shared memory, D = {D}: Q {q_bytes // 1024} KiB + {kv_slots} K slots x {k_bytes // 1024} KiB "
    f"+ S staging {s_bytes // 1024} KiB = {(q_bytes + kv_slots * k_bytes + s_bytes) // 1024} KiB "
    "of 227 KiB"
)
print("(the compile summary adds 1 KiB: the mbarriers, and sQ's start on a 1,024-byte boundary)")
nb.show_source(2, "hopper", section="# 2.")

# %% [markdown]
# ### 5.4 What the compiler produced
#
# The Hopper kernel for sm_90a (shown in both modes; no GPU needed). Compare with stage 1's
# summary: `wgmma` is now m64n128k16 and there are $b_K / 16 = D / 16$ of them per K tile.

# %%
report = nb.compile_summary(2, "hopper")

# %% [markdown]
# ### 5.5 The same stage on Blackwell
#
# The machine model (TMEM, one thread issuing `tcgen05.mma`, warps 0-3 / 4 / 5) is the one of
# stage 1, section 5.8. What stage 2 changes in it: the MMA warp computes one S tile per K tile
# into TMEM (128 lanes x 128 fp32 columns) and waits until the softmax warps have read the previous
# S before overwriting it (`s_buffers = 1`); the softmax warps `tcgen05.ld` their row, multiply by
# scale and store fp32 S. Q has its own buffer (`q_buffers = 1`) and K streams through `kv_slots`.
# The warp-role picture and the TMEM plan are stage 1's with S in place of C.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors and their PTX is checked for the
# `tcgen05` instructions. Their numerics are tested only where an sm_100 GPU exists.

# %%
nb.show_docstring(2, "blackwell")
nb.show_diff(2, "blackwell")

# %%
rows = nb.cross_track_table(2)
report_bw = nb.compile_summary(2, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# S is written in fp32 and every product of two bf16 numbers is exact in fp32, so the only
# difference from the fp64 reference is the order of the fp32 accumulation over D. The bound is
# the smaller of the hard bound $10^{-4}$ and 3x the error of PyTorch's own fp32 product plus
# $10^{-6}$ - about $10^{-6}$ here, and the table prints it. **Expected:** a relative error around
# $10^{-7}$ (the run of this notebook's executed copy, `docs/notebooks/stage2_qk.ipynb`, measured
# $1.3\cdot 10^{-7}$ on an H100 80GB HBM3, 2026-12-07), below that bound.
# The output is poisoned with NaN before the launch, so an unwritten tile fails. The error map
# shows the (b, h) slice that holds the worst element of the whole output, so that its circle is
# the table's worst element.

# %%
result = nb.run_and_verify(2, (2, 4, 512, 512, 128))

# %%
fig = nb.error_picture(2, result)

# %% [markdown]
# ## 7. Measure
#
# TFLOP/s = $2BHS_qS_kD$ / time, against batched cuBLAS (`torch.matmul`) in the same run. Mind the
# difference: cuBLAS writes S in bf16 (2 bytes per score), stage 2 in fp32 (4 bytes).
# **Expected:** both far below the GEMM numbers of stage 1, their time dominated by writing S as
# computed in section 3. `make bench` measured 187 TFLOP/s for stage 2 against 407 for cuBLAS at
# (4, 16, 2048, 2048, 128), and 102 against 210 at (4, 32, 2048, 2048, 64) (H200, 2026-11-29;
# `docs/results/bench_h200_2026-11-29.md`): at D = 128 stage 2 wrote S at about 2.9 TB/s.
# The table below is this run; its last column is stage 2's speed over each kernel (below 1: stage 2 is slower).

# %%
bench = nb.measure(2, [(4, 32, 2048, 2048, 64), (4, 16, 2048, 2048, 128)])

# %% [markdown]
# ## 8. Exercises
#
# The answers are collected at the end of the notebook.
#
# 1. **Traffic.** For the FlashAttention paper shape (B = 2, H = 16, S = 8192, D = 128), how many
#    GiB does S take in fp32? How long does writing it take at the H200's datasheet 4.8 TB/s, and how
#    long does computing it take at 989 TFLOP/s?
# 2. **Reuse.** How many times is each K tile read from global memory for one (b, h)? How many times
#    would Q be read if it were streamed like K instead of kept resident?
# 3. **Grid order.** The Hopper grid is (Q tiles, H, B) and CTAs are launched x-fastest. Which CTAs
#    run at the same time, and which K tiles do they share in L2?
# 4. **Head dim 64.** Recompute the shared-memory budget of 5.3 for D = 64, and check it with
#    `nb.compile_summary(2, "hopper", shape=(2, 4, 512, 512, 64))`. What else could the freed
#    space hold?
# 5. **Blackwell.** Why does the MMA warp have to wait for the softmax warps before it computes the
#    next S tile, and what would a second S buffer in TMEM (`s_buffers = 2`) buy? Then try
#    `nb.compile_summary(2, "blackwell", settings=dict(s_buffers=2))`: what changes in the summary,
#    and what does not?
#
# ### Answers
#
# <details><summary>1. Traffic</summary>
#
# 2 x 16 x 8192 x 8192 x 4 bytes = 8 GiB; writing it takes 8.6 GB / 4.8 TB/s = 1.8 ms; computing
# it, 2 x 2 x 16 x 8192^2 x 128 = 0.55 TFLOP, takes 0.56 ms at 989 TFLOP/s: writing S costs three
# times the arithmetic.
# </details>
#
# <details><summary>2. Reuse</summary>
#
# Each K tile is read once per Q tile of the same (b, h): Sq / 128 times (from L2 after the first,
# if the CTAs of that (b, h) run together). Streamed like K, Q would be read once per K tile:
# Sk / 128 times instead of once.
# </details>
#
# <details><summary>3. Grid order</summary>
#
# x is the Q tile, so consecutive CTAs are the Q tiles of one (h, b), then of the next head: the
# ~132 CTAs resident at once cover a few whole heads and share each head's K tiles in L2.
# </details>
#
# <details><summary>4. Head dim 64</summary>
#
# Q 16 KiB + 2 x 16 KiB + the 64 KiB fp32 S staging = 112 KiB (113 KiB in the compile summary,
# with the mbarriers and alignment): the S staging tile does not shrink with D. That is 48 KiB less
# than at D = 128 and leaves 114 KiB of the 227 KiB unused: room for a deeper ring (16 KiB per K
# slot) or a second 64 KiB S staging buffer, so that a store overlaps the next tile.
# </details>
#
# <details><summary>5. Blackwell</summary>
#
# There is one S tile in TMEM; the next QK MMA would overwrite it while the softmax warps are
# still reading it. With two, the MMA warp computes S_(j+1) into the other buffer while the
# softmax warps read and store S_j, at the price of 128 more TMEM columns. The setting alone does
# not build that: it deepens the S hand-off's barriers to two stages (`mbarrier.init` x10 in the
# summary instead of x8), but the file still
# allocates TMEM for one 128 x 128 tile and points every S at column 0
# (`self.tmem_s_offset`), so the summary shows the same registers, shared memory and
# `tcgen05.alloc` of 128 columns - and on hardware the MMA warp would overwrite the S the
# softmax warps are still reading. A real second buffer also needs 256 columns allocated and S
# addressed at `tmem_s_offset + 128 * index` of the stage.
# </details>

# %% [markdown]
# ### Exercise 2a: halve the K tile
#
# The first cell gives the task; the second compiles the stage file as it is on disk now (no GPU
# needed) and says "done" or "not yet" with what it read. It reads the wgmma shape in the PTX and the
# shared memory the kernel asks for. On the committed file it says
# "not yet".

# %%
nb.exercise("2a")

# %%
nb.check_exercise("2a")

# %% [markdown]
# **Next:** `make diff-3` shows what stage 3 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage3_softmax.ipynb`](stage3_softmax.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage2.md`](../docs/notes/stage2.md).
