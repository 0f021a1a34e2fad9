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
# # Stage 13 - split-KV (FlashDecoding): a decode step on every SM
#
# This notebook walks through `stages/stage13_split_kv/hopper.py`: stage 12's kernel (persistent
# CTAs, ping-pong consumer warpgroups with the overlap inside the loop, every tuning, every feature
# of stage 7) whose work tiles can each be cut along the keys. A decode step - one new query token
# per sequence against a long KV cache - has too few work tiles to fill the GPU: at batch 1 with 8
# KV heads, 8 CTAs stream all of K and V while the other SMs wait. Stage 13 cuts each tile's KV
# range into splits (Flash-Decoding: Dao, Haziza, Massa and Sizov, *Flash-Decoding for long-context
# inference*, 2023), each its own work tile; each split writes its O and its LSE (the natural log of
# its row's softmax sum, the second output since stage 5) in fp32, and a second kernel, the combine
# (`common/combine.py`), merges them by their LSE weights. The launch picks the split count
# (`splits_for` in `common/attention_host.py`), and `seqused_k` lets a sequence use only the first
# keys of a cache allocated longer. The notebook imports the stage file and displays it; it never
# pastes kernel code. Every number measured here is Hopper's; the Blackwell track is section 5.8.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage13_split_kv.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; everything else
# (the split arithmetic on the kernel's own methods, the combine checked in fp64 on the CPU,
# the compile summaries, the measured tables read from `docs/results/`) runs in both modes.
# Source: `notebooks/source/stage13_split_kv.py`.

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

from common import attention_host  # noqa: E402
from common.combine import Combine, SplitLaunch, combine_reference  # noqa: E402
from common.tools import notebook as nb  # noqa: E402
from common.tools import stage_table  # noqa: E402
from notebooks.figures import stage13 as figures  # noqa: E402

nb.start(13)
stage13 = stage_table.track_module(13, "hopper")
SMS = 132  # the H200's SMs (H100 SXM: 132 as well)


def decode_kernel(Sk=8192, num_splits=16, B=1, H=32, Hkv=8, D=128):
    """Stage 13's kernel object for a decode step (Sq = 1), bf16, built as the launch builds it
    (common.attention_host.compile_args; building it compiles nothing). The cells below call its
    plain methods on Python ints."""
    return stage13.compile_args(
        torch.bfloat16, (B, H, 1, Sk, D), kv_heads=Hkv, num_splits=num_splits
    )[0]


kernel = decode_kernel()
# The kernel's split_range as plain Python (its source under the DSL decorator), run on ints.
split_range = type(kernel).split_range.__wrapped__

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - count the work tiles of a decode step and say how many SMs they leave idle: at batch 1 with
#   32 query and 8 KV heads, packed, 8 tiles for 132 SMs;
# - derive the combine: why each split's O normalised by its own row sum and its LSE are enough
#   to rebuild the answer over all keys, and why the combine subtracts the largest LSE first;
# - cut a KV range the way `split_range` does, say which splits get no key and what they write;
# - apply the split-count rule (`splits_for`) to a shape and say why a batch of 16 is not split;
# - use `seqused_k` and say why keys past it never reach O even when they hold NaN;
# - read the measured decode table (H100 80GB HBM3, 2026-12-07): where stage 13 reaches SDPA's
#   cuDNN backend, where it does not, and what the host's work per call has to do with it.
#
# ## 2. Previous stage recap
#
# Stage 12 is stage 11's persistent kernel with seven tunings, each a switch: one CTA per SM
# walks the work tiles - one Q tile of one (head, sequence) - in ping-pong, QK^T of one KV tile
# issued with PV of the last. For short queries it packs the G = H / Hkv query heads of a KV
# head into one tile (pack-GQA, stage 7): a decode step with 32 / 8 heads puts 4 rows (one
# token, four heads) in a 128-row tile, so each work tile reads its KV head's K and V once. On
# the paper shapes at S = 8k it runs at 0.94-1.02x FA4, event-timed (H200, 2026-12-04,
# `docs/results/ablation_h200_2026-12-04.md`). On a
# decode step at batch 1 it reads K and V at 359-384 GB/s (H200, 2026-12-04,
# `docs/results/decode_h200_2026-12-04.md`), under 10% of what the GPU's memory can deliver:
# the loop is not the problem, the number of CTAs is.
#
# ## 3. The math
#
# ### 3.1 Too few work tiles
#
# With pack-GQA one KV head of one sequence has $\lceil S_q G / b_M \rceil$ Q tiles, each a
# work tile; a decode step ($S_q = 1$, $B = 1$, $H_{kv} = 8$, $G = 4$, $b_M = 128$) has
#
# $$\text{tiles} = \lceil 1 \cdot 4 / 128 \rceil \cdot H_{kv} \cdot B = 8,$$
#
# each streaming $2 \cdot S_k \cdot D \cdot 2$ bytes of K and V (16 MiB at $S_k$ = 32k, D = 128):
# the step is bound by memory, and 8 SMs cannot draw the memory system's bandwidth. Cutting each
# tile's $n$ KV tiles into $s$ splits gives $8 s$ work tiles of $\lceil n / s \rceil$ KV tiles
# each; $s = 16$ gives 128 CTAs on the 132 SMs.
#
# The tile wastes its rows too. A `wgmma` computes 64 rows a warpgroup, and stage 12's tile of
# two consumer warpgroups has $b_M = 128$ rows, of which a decode step fills $G \cdot S_q = 4$.
# Every KV tile then costs $2 \cdot 2 \cdot 128 \cdot 128 \cdot D$ FLOP of QK and PV (8.4
# MFLOP at D = 128), 124 of its 128 rows past the sequence: the second warpgroup's half holds
# no query row. Stage 13 takes one consumer warpgroup and a 64-row tile wherever
# $G \cdot S_q \le 64$ and $G$ divides 64 (section 5.1): 4.2 MFLOP per KV tile.
#
# ### 3.2 Merging the splits
#
# Split $s$ of a query row sees only its keys $K_s$. With scores $x_j$ (scale included), its
# kernel computes as stage 12 does and writes, in fp32,
#
# $$O_s = \frac{\sum_{j \in K_s} e^{x_j} v_j}{\ell_s}, \qquad \ell_s = \sum_{j \in K_s} e^{x_j},
# \qquad \text{lse}_s = \ln \ell_s$$
#
# (computed with its own running max $m_s$: $\text{lse}_s = m_s + \ln \sum e^{x_j - m_s}$; the
# max cancels). Over all keys, $\ell = \sum_s \ell_s = \sum_s e^{\text{lse}_s}$, so
#
# $$\text{lse} = \ln \sum_s e^{\text{lse}_s}, \qquad
# O = \frac{\sum_s \ell_s O_s}{\ell} = \sum_s e^{\text{lse}_s - \text{lse}}\, O_s .$$
#
# A split that sees no key has $\ell_s = 0$: $\text{lse}_s = -\infty$, weight $e^{-\infty} = 0$,
# and it writes $O_s = 0$, never NaN: the combine multiplies $O_s$ by its weight 0, and
# $0 \cdot \text{NaN}$ is NaN. LSEs are natural
# logs, the scale of the scores included: they can be large (a row whose scores reach 100 has
# $\text{lse} > 100$) and $e^{100}$ is past fp32's largest number ($3.4 \cdot 10^{38} \approx
# e^{88.7}$). The combine therefore takes $\text{lse}_{\max} = \max_s \text{lse}_s$ first:
#
# $$w_s = e^{\text{lse}_s - \text{lse}_{\max}} \in [0, 1], \qquad
# O = \frac{\sum_s w_s O_s}{\sum_s w_s}, \qquad
# \text{lse} = \text{lse}_{\max} + \ln \sum_s w_s .$$
#
# The cell below checks the merge in fp64 on the CPU: one head's row against 8,269 keys
# (65 KV tiles of 128), cut 16 ways with the kernel's own `split_range`, each split's
# $(O_s, \text{lse}_s)$ computed directly from its keys, merged by `combine_reference` (the fp64
# twin of the combine kernel, `common/combine.py`), against one softmax over all keys - then
# the same with every score multiplied by 1,000 (the row labelled "scores in the thousands": its
# LSEs are in the thousands), and the fp32 merge with and without $\text{lse}_{\max}$.

# %%
g = torch.Generator().manual_seed(13)
Sk, D, num_splits = 8269, 128, 16
q_row = torch.randn(D, generator=g, dtype=torch.float64)
keys = torch.randn(Sk, D, generator=g, dtype=torch.float64)
values = torch.randn(Sk, D, generator=g, dtype=torch.float64)


def split_partials(scores, values, num_splits, bN=128):
    """(O_partial (splits, D), LSE_partial (splits,)) of one query row, split s over the keys of
    the KV tiles the kernel's split_range gives it (fp64)."""
    tiles = -(-scores.shape[0] // bN)
    o_part = torch.zeros(num_splits, values.shape[1], dtype=torch.float64)
    lse_part = torch.full((num_splits,), float("-inf"), dtype=torch.float64)
    for s in range(num_splits):
        lo, hi = split_range(kernel, (0, tiles), s, num_splits)
        x = scores[lo * bN : hi * bN]
        if x.numel():
            p = torch.exp(x - x.max())
            o_part[s] = p @ values[lo * bN : hi * bN] / p.sum()
            lse_part[s] = x.max() + torch.log(p.sum())
    return o_part, lse_part


rows = []
for label, factor in (("scores of a unit-variance row", 1.0), ("scores in the thousands", 1e3)):
    scores = factor * (keys @ q_row) / D**0.5
    o_part, lse_part = split_partials(scores, values, num_splits)
    # combine_reference takes (splits, B, H, S, D) and (splits, B, H, S): one row of one head.
    o, lse = combine_reference(o_part.view(num_splits, 1, 1, 1, D), lse_part.view(-1, 1, 1, 1))
    direct = torch.softmax(scores, dim=0) @ values
    direct_lse = torch.logsumexp(scores, dim=0)
    empty = int((lse_part == float("-inf")).sum())
    lse32 = lse_part.float()
    naive = torch.exp(lse32)  # fp32 weights without lse_max
    naive_o = (naive[:, None] * o_part.float()).sum(0) / naive.sum()
    w = torch.exp(lse32 - lse32.max())
    kept_o = (w[:, None] * o_part.float()).sum(0) / w.sum()
    rows.append(
        (
            label,
            f"{float(lse_part.max()):.4g}",
            empty,
            f"{float((o.flatten() - direct).abs().max()):.1e}",
            f"{abs(float(lse) - float(direct_lse)):.1e}",
            f"{float((kept_o.double() - direct).abs().max()):.1e}",
            "NaN"
            if torch.isnan(naive_o).any()
            else f"{float((naive_o.double() - direct).abs().max()):.1e}",
        )
    )
nb.table(
    (
        "row",
        "largest lse_s",
        "empty splits",
        "fp64 merge: max |O - O_direct|",
        "|lse - lse_direct|",
        "fp32, lse_max first",
        "fp32, without lse_max",
    ),
    rows,
)

# %% [markdown]
# In fp64 the merge gives the softmax over all keys to rounding ($10^{-16}$), with 3 of the 16
# splits empty (section 5.2 says why). In fp32 the merge that subtracts $\text{lse}_{\max}$ is
# as close as fp32 allows at both scales; without it the weights $e^{\text{lse}_s}$ overflow to
# $\infty$ once the LSEs pass 88.7, and $\infty / \infty$ is NaN.
#
# ## 4. What changes
#
# The docstring gives the change and its numbers; then the kernel class's diff against stage 12
# (`make diff-13 TRACK=hopper` shows the whole files). Most hunks are the split: `split_kv` and
# two more kernel arguments (`seqused_k`, `num_splits`) passed to both roles, the grid and
# `total_tiles` multiplied by `num_splits`, `tile_coords` returning the split, `split_range`
# applied to `kv_tile_range`'s result in the producer and the consumers alike, `seq_info`
# reading `seqused_k`, and the split's own epilogue. The others are the decode tile of section
# 5.1: `launch_options`' new first rule, the register count of a single consumer warpgroup, and
# `wait_turn` / `pass_turn` doing nothing when there is no second warpgroup to take turns with.

# %%
nb.show_docstring(13, "hopper")

# %%
nb.show_diff(13, "hopper", max_lines=200)

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The idle SMs
#
# The picture puts CTA $c$ on SM $c$ (the hardware places them as it likes; what counts is how
# many run): stage 12's decode step at batch 1, 8 work tiles, and stage 13's, each tile cut 16
# ways. Each square is coloured by its KV head, and in the split launch labelled with its split.

# %%
tiles_b1 = 8  # B = 1, 8 KV heads, query heads packed: one Q tile per KV head
fig = figures.idle_sms(
    [
        ("stage 12: one work tile per KV head", tiles_b1, 1),
        ("stage 13: each tile cut 16 ways", tiles_b1, attention_host.splits_for(8, 256, SMS)),
    ],
    sm_count=SMS,
    title="A decode step at B = 1, 32 query / 8 KV heads, Sk = 32k, on 132 SMs",
)

# %% [markdown]
# How many splits: `splits_for` fills one wave of CTAs (a wave: as many CTAs as run at once,
# here one per SM). When the work tiles occupy fewer than
# `FILLED_SHARE` = 0.8 of the SMs, each tile gets $\lfloor \text{SMs} / \text{tiles} \rfloor$
# splits; one more split per tile would start a second, mostly empty wave. Two caps apply: at
# most one split per KV tile (a split of less than one KV tile would be empty) and at most
# `MAX_SPLITS` = 64. A range of `UNSPLIT_KV_TILES` = 4 KV tiles or fewer is not split at all:
# there the second launch and the partials cost more than the few tiles' loads they spread (the
# sweep below). The cell shows the function and applies it to decode steps (32 query / 8 KV
# heads, heads packed).

# %%
nb.show_function(attention_host.splits_for)
DECODE_STEPS = [(1, 8, 1000), (1, 8, 8192), (1, 8, 32768), (1, 32, 32768), (4, 8, 32768)]
DECODE_STEPS += [(8, 8, 32768), (12, 8, 32768), (16, 8, 8192), (32, 8, 8192)]
rows = []
for B, Hkv, Sk_ in DECODE_STEPS:
    tiles, kv_tiles = Hkv * B, -(-Sk_ // 128)
    s = attention_host.splits_for(tiles, kv_tiles, SMS)
    rows.append((B, Hkv, Sk_, tiles, s, tiles * s, f"{tiles * s / SMS:.0%}", -(-kv_tiles // s)))
nb.table(
    ("B", "KV heads", "Sk", "work tiles", "splits", "CTAs", "of 132 SMs", "KV tiles per split"),
    rows,
)

# %% [markdown]
# The decode tile: `launch_options` (stage 12's, with one rule more) gives a launch whose query
# rows fit in 64 one consumer warpgroup. The tensor-core work per KV tile halves, the ring gets
# a sixth K/V slot (Q and O take 16 KiB each instead of 32), and without a second warpgroup there
# are no turns to take: `wait_turn` and `pass_turn` compile to nothing. The split kernel of the
# 8k step took 8.8 us with the decode tile and 11.7 us with 128 rows, on an H100 80GB HBM3 with K
# and V warm in L2, in two runs a day apart, with the combine of each day (2026-12-06,
# `docs/results/decode_kernels_h100_2026-12-06.txt`; 2026-12-05,
# `docs/results/decode_kernels_h100_2026-12-05.txt`; cuDNN's attention kernel took 8.9-9.0 us in
# both). The cell builds the kernel object each launch would get.

# %%
nb.show_function(stage13.Sm90Kernel.launch_options)
for Sq_, H_, Hkv_ in ((1, 32, 8), (16, 32, 8), (17, 32, 8), (1, 32, 32), (64, 32, 32)):
    k_ = stage13.compile_args(torch.bfloat16, (1, H_, Sq_, 8192, 128), kv_heads=Hkv_)[0]
    print(
        f"Sq = {Sq_:2d}, {H_}/{Hkv_} heads, G x Sq = {H_ // Hkv_ * Sq_:3d}: "
        f"{k_.mma_warpgroups} consumer warpgroup(s), {k_.cta_tile[0]}-row tile, "
        f"{k_.kv_slots} K/V slots"
    )

# %% [markdown]
# Where the 4-tile bound comes from: the same decode step at short KV ranges with every split
# count forced, measured on an H100 80GB HBM3 (2026-12-05,
# `docs/results/split_count_sweep_h100_2026-12-05.txt`; B = 1, 32 query / 8 KV heads, causal).
# Left, a CUDA graph of the calls replayed, so only the GPU's time counts (the kernels and the
# gaps between them): up to 512 keys (4 KV tiles, the dotted line) no split gains more than
# 0.1 us (10.5 against 10.6 us at 512); from 8 tiles every split count gains. Right, the same
# calls made eagerly: a split call then cost the host a second launch and the partials' buffer,
# and up to 2k keys the unsplit call was the faster one. The numbers under the purple line are the
# fastest split counts; at 2k and 4k they are 8, not the launch's 16 (5-8% apart in the graph).

# %%
sweep = figures.read_split_sweep(
    os.path.join(nb.ROOT, "docs/results/split_count_sweep_h100_2026-12-05.txt")
)
fig = figures.split_sweep(
    sweep, B=1, title="Decode step, B = 1, 32/8 heads: us per call (H100 80GB HBM3, 2026-12-05)"
)

# %% [markdown]
# ### 5.2 Cutting a range: `split_range`
#
# Split $s$ of a work tile whose KV tiles are $[lo, hi)$ takes
# $[lo + s n,\ \min(lo + (s + 1) n, hi))$ with $n = \lceil (hi - lo) / \text{num\_splits} \rceil$,
# its start clamped to $hi$ too. The splits tile the range exactly once; the last ones are
# shorter, and where $n \cdot \text{num\_splits}$ overshoots by a whole $n$ or more, the last
# splits are empty ($lo = hi$): they load nothing and write O = 0 and LSE = $-\infty$. The
# producer and the consumers call the same method on the same `kv_tile_range`, so they agree on
# every split's trip count (a disagreement would hang the ring). Below, the kernel's own
# `split_range` on integers.

# %%
nb.show_source(13, "hopper", names=["Sm90Kernel.split_range"])
cases = []
for tiles, s in ((65, 16), (64, 16), (8, 16), (65, 3), (65, 64)):
    ranges = [split_range(kernel, (0, tiles), i, s) for i in range(s)]
    cases.append((f"{tiles} KV tiles, {s} splits", tiles, ranges))
fig = figures.split_cuts(cases, title="split_range: the KV tiles each split reads")
for label, tiles, ranges in cases:
    n = -(-tiles // len(ranges))
    empty = sum(1 for lo, hi in ranges if hi <= lo)
    print(
        f"{label}: n = {n}, {empty} empty, last non-empty {max(r for r in ranges if r[1] > r[0])}"
    )

# %% [markdown]
# 65 KV tiles cut 16 ways: $n = 5$, 13 splits cover the 65 tiles and 3 are empty. Every split
# gets the same rounded-up length $n$, so the last splits can be left with no tile, and their
# CTAs do nothing but write O = 0 and LSE = $-\infty$: the price of one rule shared by the
# producer, the consumers and every range length.
#
# ### 5.3 The work tiles: `tile_coords` with the split
#
# Work tile $t$ is split $t \bmod \text{num\_splits}$ of stage 12's tile
# $\lfloor t / \text{num\_splits} \rfloor$, whose (Q tile, head, sequence) follow as before, so the
# splits of one tile are neighbours in the order the CTAs take them. `seq_info` gives every role
# the sequence's lengths, now with `seqused_k`.

# %%
nb.show_source(13, "hopper", names=["Sm90Kernel.tile_coords", "Sm90Kernel.seq_info"])
nb.table(
    ("work tile t", "(Q tile, KV head, sequence, split)"),
    [(t, str(kernel.tile_coords(t, 1, 8, 1, 16))) for t in (0, 1, 15, 16, 17, 127)],
)

# %% [markdown]
# `seqused_k` (B,) int32, as in FlashAttention's API: sequence $b$ uses only its first
# `seqused_k[b]` keys of a cache allocated longer. `seq_info` takes $S_k$ = min(`seqused_k[b]`,
# the allocated length), so `kv_tile_range`, the masks (bottom-right aligned to that length)
# and `split_range` all see the used length. The keys past it may hold anything, NaN included:
# a tile that reaches past it has those keys masked to $-\infty$ (P = 0), and its V rows past
# it are zeroed in shared memory before P @ V reads them, since $0 \cdot \text{NaN} = \text{NaN}$
# - the same zeroing packed sequences need at a sequence's end (stage 7). Only a range's last
# KV tile can reach past $S_k$, so only that one is zeroed.
#
# ### 5.4 The split's epilogue: fp32 partials from registers
#
# `epilogue_partial` normalises O by the split's own row sum, writes LSE (natural log), and
# stores O in fp32 straight from the accumulator registers to `O_partial[s]`, only the rows
# inside the sequence: no shared memory, so no barrier between the consumer warpgroups. The
# partial buffers take $\text{splits} \cdot B \cdot H \cdot S_q \cdot (D + 1) \cdot 4$ bytes per
# call, against the $2 \cdot S_k \cdot H_{kv} \cdot D \cdot 2$ bytes of K and V the call reads.

# %%
nb.show_source(13, "hopper", names=["Sm90Kernel.epilogue_partial"])
for Sk_ in (8192, 32768, 131072):
    partial = 16 * 1 * 32 * 1 * (128 + 1) * 4
    kv = 2 * Sk_ * 8 * 128 * 2
    print(
        f"B = 1, 32 / 8 heads, Sk = {Sk_ // 1024}k, 16 splits: partials {partial / 1024:.0f} KiB "
        f"written and read once more ({2 * partial / 1024:.0f} KiB of traffic), K and V "
        f"{kv / 2**20:.0f} MiB read: {2 * partial / kv:.2%}"
    )

# %% [markdown]
# fp32 partials cost little (1.6% of the traffic at 8k, 0.4% at 32k) and keep one rounding: O
# is rounded to bf16 once, after the merge, as the unsplit kernel rounds it once.
#
# ### 5.5 The combine kernel
#
# `common/combine.py`'s `Combine` merges a row's splits: $\text{splits} \cdot (D + 1) \cdot 4$ bytes
# read per row, 8 KiB for a decode row cut 16 ways. So little data makes the kernel's time that of
# its loads' latency, and the kernel is laid out to wait for global memory once. A row takes $D / 4
# \cdot \text{lanes}$ threads, 4 columns each; lane $i$ reads splits $i$, $i + \text{lanes}$, ...
# (`lanes`: the split count rounded up to a power of two, at least 2, at most 8 at D = 128). Every
# load is issued before the first barrier - each thread's $\text{lse}_t$ into shared memory, its
# first 8 splits' columns of $O_s$ as 16-byte loads - then each warp reduces the row's LSEs from
# shared memory with shuffles (the max $m$, then $l = \sum_s e^{\text{lse}_s - m}$), each thread
# weights its $O_s$, and after a second barrier lane 0 adds the lanes' sums. A decode step's combine
# at 16 splits takes 2.5 us of GPU time, against 2.8 us for cuDNN's reduction; a kernel of one warp
# per CTA with its loops over the splits unrolled took 3.3 us, its loads going out in rounds (B = 1,
# 8k; H100 80GB HBM3, 2026-12-06; `docs/results/decode_kernels_h100_2026-12-06.txt`). It is plain
# CUDA-core code, no TMA or tensor cores, so the same kernel compiles for sm_90a and sm_100a. A row
# that no split saw keeps O = 0 and LSE = $-\infty$, as the unsplit kernel gives.

# %%
nb.show_function(Combine.kernel)
nb.show_function(combine_reference)

# %% [markdown]
# ### 5.6 The host side: one launch plan per argument signature
#
# A split launch runs two kernels (the attention kernel into the partials, then the combine)
# and allocates the partials. `common/attention_host.py` decides everything that depends only
# on the arguments' types, shapes, strides and options once and keeps it as a `LaunchPlan`
# (`plan_key`, `make_plan`): the compiled function, the mask bounds, the split count, the
# partial buffers' layout in one fp32 allocation, the canonical strides of the inputs whose
# size-1 modes need them. A later call with the same signature allocates and launches.
# `make_plan` also drops a mask bound that cuts nothing: under `causal=True` a single query row
# ($S_q = 1$, bottom-right aligned) sees every key, so a decode step runs the kernel without a
# mask (no tile counter to zero; only a tile that reaches past $S_k$ runs the mask code).
#
# The two kernels are one compiled function, `SplitLaunch` in `common/combine.py`: a `cute.jit`
# function may launch several kernels, one after the other on its stream. It takes the
# partials' buffer flat and makes the views of O_partial and LSE_partial at compile time, from
# O's run-time shape (`partial_offsets`), so a call pays for one host-to-kernel call and no
# torch view.

# %%
nb.show_function(SplitLaunch.__call__)
nb.show_function(attention_host.LaunchPlan.run)

# %% [markdown]
# ### 5.7 What the compiler produced
#
# The stage's compile shape (unsplit, the kernel of stage 12 with the new arguments), then the
# split kernel of a decode step (16 splits, 8 KV heads, pack-GQA): the same `wgmma`,
# exponentials and TMA loads, and fewer `bar.sync` in the split kernel: its one consumer
# warpgroup takes no turns (section 5.1), and its epilogue stores O from registers without
# staging it in shared memory (the cell prints the four counts).

# %%
report = nb.compile_summary(13, "hopper")
report_split = nb.compile_summary(
    13, "hopper", shape=(1, 32, 1, 8192, 128), options=dict(kv_heads=8, num_splits=16)
)
if report is not None and report_split is not None:
    for family in ("wgmma.mma_async", "ex2.approx", "cp.async.bulk.tensor (load)", "bar.sync"):
        print(f"{family}: unsplit {report.counts[family]}, split {report_split.counts[family]}")

# %% [markdown]
# ### 5.8 The same stage on Blackwell
#
# The Blackwell kernels are **compile-checked here, not run on hardware** (no sm_100 GPU has run
# them; they are compiled for sm_100a with fake tensors and their PTX is checked). The two cells
# below compare the concepts of `stages/stage13_split_kv/blackwell.py` with the Hopper file's
# and compile it for sm_100a; where the file is not there, they say so. The split is the same
# on both tracks: the same ranges from a `split_range` of the same arithmetic, the same
# combine kernel (`common/combine.py` is CUDA-core code and compiles for sm_100a as it is);
# what differs is the split's epilogue, which on Blackwell reads O from tensor memory.

# %%
rows = nb.cross_track_table(13)
report_bw = nb.compile_summary(13, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** stage 7's checks, unchanged (a few $10^{-3}$ relative error, within 3x PyTorch's
# own bf16 error; rows with no key O = 0 and LSE = -inf; NaN planted around packed sequences
# never leaks in), now through the split launch wherever a shape leaves SMs idle and has more
# than 4 KV tiles (the first run below, and two of the mask cases; the others are not split).
# Then decode steps with the launch's split count and forced ones (3, and 64: more
# splits than KV tiles, many empty), speculative decoding ($S_q$ = 4, causal), and a
# `seqused_k` cache whose unused keys hold NaN. Finally `num_splits=1` must give stage 12's O
# and LSE bit for bit (the same kernel).

# %%
result = nb.run_and_verify(13, (2, 4, 512, 1024, 128))
checks = nb.run_and_verify_cases(
    13,
    list(nb.MASK_CASES)
    + [
        ("decode, 32 / 8 heads, the launch's splits", (1, 32, 1, 8269, 128), dict(kv_heads=8)),
        (
            "decode, 3 splits, causal",
            (1, 32, 1, 8269, 128),
            dict(kv_heads=8, num_splits=3, causal=True),
        ),
        (
            "decode, 64 splits (more than KV tiles)",
            (2, 16, 1, 3000, 64),
            dict(kv_heads=4, num_splits=64),
        ),
        ("speculative, Sq = 4, causal", (1, 32, 4, 4097, 128), dict(kv_heads=8, causal=True)),
    ],
)
packed_checks = nb.run_and_verify_varlen(
    13, [200, 77, 0, 300, 1], [130, 190, 5, 129, 260], heads=4, kv_heads=2, causal=True
)

# %%
if nb.MODE == "gpu" and nb.available(12, nb.TRACK) and nb.available(13, nb.TRACK):
    from common.tools import inputs, verify

    # seqused_k: a cache of 4096 keys of which 1100 are used; NaN in every key and value past them.
    q, _, _ = inputs.attention_inputs(1, 32, 1, 1, 128, seed=7)
    _, k, v = inputs.attention_inputs(1, 8, 1, 4096, 128, seed=8)
    k[:, :, 1100:], v[:, :, 1100:] = float("nan"), float("nan")
    used = torch.tensor([1100], dtype=torch.int32, device=q.device)
    for splits in (None, 4, 16):
        o, lse = stage13.attention(q, k, v, return_lse=True, num_splits=splits, seqused_k=used)
        kf, vf = (t[:, :, :1100].repeat_interleave(4, dim=1) for t in (k, v))
        o_chk, _ = verify.check_attention(f"seqused_k, splits {splits}", o, q, kf, vf, lse=lse)
        print(
            f"seqused_k = 1100 of 4096 keys, NaN past them, num_splits={splits}: O relative "
            f"error {o_chk.rel_err:.1e}, NaN in O: {bool(torch.isnan(o).any())}"
        )
    # num_splits = 1 is stage 12's kernel: the same bits.
    stage12 = stage_table.track_module(12, nb.TRACK)
    q, k, v = inputs.attention_inputs(2, 8, 1000, 1024, 128, seed=5)
    o12, lse12 = stage12.attention(q, k, v, causal=True, return_lse=True)
    o13, lse13 = stage13.attention(q, k, v, causal=True, return_lse=True, num_splits=1)
    torch.cuda.synchronize()
    same = torch.equal(o12, o13) and torch.equal(lse12, lse13)
    print(f"num_splits=1: stage 13 == stage 12 bit for bit: {same}")
    assert same, "stage 13 with one split must give stage 12's O and LSE bit for bit"
else:
    print("the seqused_k check and the bit-for-bit comparison with stage 12 need GPU mode")

# %%
fig = nb.error_picture(13, result)

# %% [markdown]
# ## 7. Measure
#
# ### 7.1 Decode steps
#
# The stage's goals (`docs/notes/stage13.md`, "What misses the goals"): at least 1.0x SDPA's
# cuDNN backend in every decode row, at least 3,800 GB/s at B = 1 from $S_k$ = 32k, and at most
# 25 us of host work per call. The 3,800 GB/s are set for the H200's 4.8 TB/s; the H100 below
# has 3,350 GB/s and cannot reach them.
#
# `python -m common.tools.bench --stages 13 --decode-sweep` on an NVIDIA H100 80GB HBM3
# (2026-12-07, bf16, $S_q$ = 1, D = 128; `docs/results/decode_h100_2026-12-07_sweep.md`), the
# kernels as they are: the six decode rows of `make bench` first, then B = 1, 4, 16, 64 x $S_k$ =
# 4k, 16k, 64k, 256k (rows over 4 GB of K and V left out); stage 12, stage 13, FA4 and SDPA's
# cuDNN, flash and memory-efficient backends, all timed in the same interleaved rounds, inputs
# rotated past L2, SDPA inside its backend's context (`sdpa_kernel`) entered once around the
# timed calls. A decode step is bound by memory, so the unit is GB/s of K and V read,
# $2 S_k H_{kv} D \cdot 2\,\text{B} \cdot B$ / time. Two timings: calls back to back between CUDA
# events (what a model sees, host work included) and GPU time alone (the kernels' durations; for
# stage 13 the attention kernel and the combine). The cell reads the run's `.json` file (which also
# holds stage 14 on paged caches: `docs/notes/stage14.md`).

# %%
with open(os.path.join(nb.ROOT, "docs/results/decode_h100_2026-12-07_sweep.json")) as f:
    decode = json.load(f)
KERNELS = ["stage 12", "stage 13", "FA4", "SDPA cuDNN", "SDPA flash", "SDPA efficient"]
gpu_time = {tuple(r["shape"]): r["tflops"] for r in decode["rows"] if r["stage"] == "13 decode GPU"}
rows = []
for r in decode["rows"]:
    if r["stage"] != "13 decode":
        continue
    B, H, Hkv, _, Sk_, D_ = r["shape"]
    t, g_ = r["tflops"], gpu_time[tuple(r["shape"])]
    splits = attention_host.splits_for(Hkv * B, -(-Sk_ // 128), SMS)
    rows.append(
        (
            B,
            f"{H}/{Hkv}",
            f"{Sk_ // 1024}k",
            splits,
            *(f"{t[k]:,.0f}" if k in t else "-" for k in KERNELS),
            f"{t['stage 13'] / t['SDPA cuDNN']:.2f}",
            f"{g_['stage 13'] / g_['SDPA cuDNN']:.2f}",
            f"{t['stage 13'] / t['stage 12']:.1f}",
        )
    )
print(
    f"{decode['gpu']}, {decode['date']}, torch {decode['torch']}: GB/s of K and V, calls back to back"
)
nb.table(
    ("B", "heads", "Sk", "splits", *KERNELS, "13 / cuDNN", "13 / cuDNN, GPU time", "13 / 12"),
    rows,
)
fig = figures.decode_bars(
    decode["rows"],
    KERNELS,
    title=f"Decode steps, GB/s of K and V ({decode['gpu']}, {decode['date']}, bf16, D = 128)",
)

# %% [markdown]
# Read from the table (H100 80GB HBM3, 2026-12-07):
#
# - **The split pays where the tiles are few.** At batch 1 with 8 KV heads stage 12 stays under
#   400 GB/s whatever $S_k$ (8 CTAs); stage 13, cut 16 ways, reads 735 GB/s at 8k, 1,969 at 32k,
#   2,999 at 128k and 3,108 at 256k back to back, 7.7x stage 12 at 128k. FA4 stays near stage 12
#   on these rows. With 32 KV heads (4 splits) or a batch of 8 (2 splits) stage 13 reaches
#   3,015-3,099 GB/s; from a batch of 16 the launch does not split.
# - **Against SDPA's cuDNN backend, in GPU time:** 0.985-1.045x; at or above cuDNN in 8 of the 16
#   rows, 0.2-0.6% behind in 6 and 1.3-1.5% behind at batch 32, 8k and batch 64, 4k, where stage
#   13 reads 93% of the H100's 3,350 GB/s and cuDNN 94-95%: 256 and 512 work tiles over 132 SMs
#   leave the last round 3% short (`docs/notes/stage13.md`).
# - **Back to back, short caches are host-bound:** 0.79-1.01x cuDNN, 18-21% behind at batch 1
#   with 8 KV heads at 8k and 32k (1,969 GB/s at 32k back to back against 2,748 in GPU time),
#   where a split call's host work is longer than its kernels. The next section is the host's
#   side. Runs before this one entered SDPA's backend context inside every timed call, and there
#   SDPA's call read 29-37 us longer at batch 1, 4k-8k (this run against the one before it that
#   day, `docs/results/decode_h100_2026-12-07_sweep_pin_per_call.md`): their back-to-back ratios
#   (up to 1.42x on 2026-12-06) overstate stage 13.
#
# On the H200 (2026-12-04, `docs/results/decode_h200_2026-12-04.md`), with the kernel as it was
# then (128-row tiles, the combine's loops rolled), stage 13 read 491 GB/s at 8k, 1,732 at 32k and
# 3,998 at 128k back to back, 0.65-0.99x cuDNN in GPU time; the kernel as it is has not run on an
# H200, and the goal of 3,800 GB/s at batch 1 is the H200's.
#
# ### 7.2 Host work per call
#
# `python -m common.tools.host_time --calls 1000 --rounds 3 --profile` times a tiny decode step (K
# and V of 256 keys, causal: 5-7 us of GPU work, less than the host's) under
# `torch.inference_mode()`, every entry in rotated order each round: back to back between CUDA
# events, the host's own time, the GPU's. The cell prints a run of the launch path as it is
# (NVIDIA H100 80GB HBM3, 2026-12-07, `docs/results/host_time_h100_2026-12-07_scratch_lse.txt`)
# with cProfile's view of stage 13's call, and the split count the launch picks for this step:
# none, since a range of 4 KV tiles or fewer is not split (section 5.1).

# %%
HOST_TIME = "docs/results/host_time_h100_2026-12-07_scratch_lse.txt"
with open(os.path.join(nb.ROOT, HOST_TIME)) as f:
    text = f.read()
table, _, profiles = text.partition("cProfile of 1000 calls: stage 12\n")
skip = ("round ", "Warning", "_warn_once")  # progress lines and a profiler warning
print("\n".join(ln for ln in table.splitlines() if not any(w in ln for w in skip)))
stage13_profile = profiles.split("cProfile of 1000 calls: stage 13\n")[1].split("cProfile of")[0]
print("cProfile of 1000 calls: stage 13\n" + stage13_profile)
print("splits the launch picks for this step now:", attention_host.splits_for(8, 2, SMS))

# %% [markdown]
# Stage 12, and stage 13 where it does not split, take 17.9-18.2 us per call back to back and of
# host time, against SDPA's 16.0 / 15.4 (back to back / host): within the goal of 25 us. A split
# call (`num_splits=2`) takes 26.2 / 26.6, over the goal on this host (24.4 / 24.8 on a quicker
# one, 2026-12-06, `docs/results/host_time_h100_2026-12-06_traced_copy_profile.txt`; 23.3-28.3 in
# that day's five other runs with the split launch in one call, `..._split_launch.txt`,
# `..._stage_env_once.txt`, `..._autograd_fallthrough*.txt` and `..._traced_copy.txt`): the
# partials' buffer and one call that launches both kernels (section 5.6).
# The custom op takes 24.4 / 25.2 under inference mode and 25.2 / 25.0 under `torch.no_grad()`
# (H100 80GB HBM3, 2026-12-07, the same run). An unsplit call that returns no LSE writes it into
# the device's scratch: one allocation less, 2.0-2.8 us a call in an A/B the same day
# (`docs/results/host_time_scratch_lse_ab_h100_2026-12-07.txt`). Of stage 12's 18.8 us in an A/B
# on the same GPU model (2026-12-05, `docs/results/host_time_fast_path_ab_h100_2026-12-05.txt`),
# when it still allocated the LSE, its compiled function called alone on ready arguments took 5.1
# (the TVM-FFI call and the launch), each of its two outputs 2.2 (`torch.empty_strided`) and Q's
# canonical view 0.9 (`as_strided`): the other 8.4 us was the launch path's Python. A call whose
# tensors and options match an earlier call's (`call_key` in `common/attention_host.py`) takes
# the fast path: no shape checks, and the launch plan made for the first such call, which keeps
# everything decided once (the compiled kernel and combine, the mask bounds, the split count, the
# partials' layout, the inputs' canonical strides). What is left is Python per call, which only
# fewer Python calls per step remove: a CUDA graph over a model's decode step, as
# `tests/test_stage13.py` replays one. Earlier launch paths, and what each change to it saved:
# `docs/results/README.md`, *Host work per call*.
#
# In GPU mode the cell below times stage 13 against stage 12 and the baselines at two decode
# shapes (MHA, 32 heads: the launch picks 4 splits) in this run. Its table gives TFLOP/s,
# `nb.measure`'s unit for every stage; for a decode step read the milliseconds and the ratios.

# %%
bench = nb.measure(
    13, [(1, 32, 1, 32768, 128), (1, 32, 1, 131072, 128)], also_stages=(12,), with_fa4=True
)

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU; where a GPU adds a measurement, the exercise says which call makes it.
#
# 1. **Count the splits.** With `splits_for`, how many splits and CTAs do these decode steps
#    get on 132 SMs (32 query / 8 KV heads, packed): B = 2 at 32k, B = 4 at 32k, B = 13 at 8k?
#    Why does B = 13 get none, although 104 CTAs leave 28 SMs idle?
# 2. **Empty splits.** A decode step with 1,000 keys and `num_splits=16` forced: how many KV
#    tiles, how many splits get keys, and what do the others write? What weight does the
#    combine give them?
# 3. **A whole range in one split.** Run `split_partials` of section 3 with `num_splits = 1`
#    and with 65 (one KV tile each). Is the merged O the same to fp64 rounding? Does either case
#    have more splits than KV tiles? With how many splits would some lie past the last tile,
#    and what does `split_range` give them?
# 4. **Why fp32 partials.** Round the 16 $O_s$ of section 3 to bf16 before the merge and compare
#    the merged O with the fp64 direct softmax, against rounding the merged O once. How much
#    error does the second rounding add?
# 5. **Drop the clamps** (exercise 13a, an edit of the Hopper stage file): `split_range` without
#    `cutlass.min(..., hi)`. The cells at the end of the notebook give the task and check the
#    edit.
# 6. **Rows per tile.** Speculative decoding checks a few draft tokens at once. With 32 query /
#    4 KV heads (G = 8), which tile does the launch take for $S_q$ = 8 and for $S_q$ = 9 (build
#    the kernel objects as section 5.1 does), and what share of each QK's rows lies past the
#    sequence in each?
#
# ### Answers and checks
#
# <details><summary>1. Count the splits</summary>
#
# B = 2: 16 tiles, 132 // 16 = 8 splits, 128 CTAs; B = 4: 32 tiles, 4 splits, 128 CTAs; B = 13:
# 104 tiles, below 0.8 x 132 = 105.6, so the rule may split, but 132 // 104 = 1. Two splits per
# tile would make 208 CTAs of half the work each: a first wave of 132 and a second of 76, which
# starts when the first ends - the same time as one wave of 104 whole tiles, plus the partials
# and the combine. The cell below prints the three.
# </details>
#
# <details><summary>2. Empty splits</summary>
#
# 1,000 keys are 8 KV tiles (the last one 104 keys). With 16 splits $n = \lceil 8/16 \rceil = 1$:
# splits 0-7 get one tile each, splits 8-15 get $[8, 8)$, load nothing and write O = 0 and
# LSE = $-\infty$. Their weight in the combine is $e^{-\infty - \text{lse}_{\max}} = 0$. (The
# launch itself would not pick 16 here: `splits_for` caps the count at one per KV tile, 8.)
# </details>
#
# <details><summary>3. A whole range in one split</summary>
#
# With one split the merge has one term of weight 1: $O = O_0$, the direct softmax. With 65,
# each split holds one KV tile and the merge is exact to fp64 rounding too. Neither has more
# splits than tiles: with 65 tiles and 65 splits $n = 1$ and every split gets one. A split lies
# past the last tile whenever $(s - 1) \lceil 65/s \rceil \ge 65$ for $s$ splits, not only
# past 65 splits: from 12 on ($n = 6$, split 11 starts at 66), except 13, 17, 22, 33 and 65.
# Section 3's 16 splits ($n = 5$) leave splits 13-15 past it, its 3 empty splits. `split_range`
# clamps their start to $hi$: $[65, 65)$, no tile.
# </details>
#
# <details><summary>4. Why fp32 partials</summary>
#
# bf16 keeps 8 significant bits (a unit roundoff of $2^{-8} \approx 4 \cdot 10^{-3}$). Rounding
# every $O_s$ first and the merged O again adds a second rounding of the same order as the
# first: the cell prints both errors, and the bf16 partials' is the larger, though by less than
# twice (the two roundings are not aligned). fp32 partials keep the unsplit kernel's single
# rounding, for 258 KiB of partials written and read once more (516 KiB of traffic) against
# 128 MiB of K and V at 32k (section 5.4).
# </details>
#
# <details><summary>5. Drop the clamps (13a)</summary>
#
# 65 KV tiles cut 16 ways: $n = 5$, and without the clamps split $s$ reads
# $[5s, 5s + 5)$: splits 13, 14 and 15 read tiles 65-79, 15 KV tiles past the range, where the
# committed kernel leaves them empty. 8 tiles cut 16 ways: splits 8-15 read tiles 8-15, 8 past
# it. What those tiles hold decides what O does. In batch mode without `seqused_k` they lie
# past $S_k$: TMA fills them with zeros and `mask_keys` sets every key past $S_k$ to $-\infty$,
# so O stays right, for twice the work at 8 tiles (except where the kernel was compiled without
# the mask code, D = 64 with nothing masked: there the zero keys get weight and O is wrong).
# With `seqused_k` they are the unused cache: the keys are masked, but only the range's last
# tile has its V rows zeroed, so NaN in a middle tile meets P = 0 and $0 \cdot \text{NaN}$ is
# NaN in O. The clamp is what keeps every split inside its range.
# </details>
#
# <details><summary>6. Rows per tile</summary>
#
# $S_q$ = 8 gives $G \cdot S_q$ = 64 rows: one consumer warpgroup, a 64-row tile, every row
# used. $S_q$ = 9 gives 72 rows, more than one warpgroup's 64: two warpgroups, a 128-row tile,
# of which 56 rows (44%) lie past the sequence. One more draft token doubles the tensor
# work per KV tile.
# </details>

# %%
# Exercise 1: the split count of three decode steps.
for B, Sk_ in ((2, 32768), (4, 32768), (13, 8192)):
    s = attention_host.splits_for(8 * B, -(-Sk_ // 128), SMS)
    print(f"B = {B}, Sk = {Sk_}: {8 * B} tiles, {s} splits, {8 * B * s} CTAs on {SMS} SMs")

# Exercise 2: 1,000 keys (8 KV tiles) cut 16 ways.
ranges = [split_range(kernel, (0, 8), s, 16) for s in range(16)]
print("1,000 keys, 16 splits:", ranges)

# Exercise 3: one split and 65 splits against the direct softmax.
scores = (keys @ q_row) / D**0.5
direct = torch.softmax(scores, dim=0) @ values
for s in (1, 65):
    o_part, lse_part = split_partials(scores, values, s)
    o, _ = combine_reference(o_part.view(s, 1, 1, 1, D), lse_part.view(-1, 1, 1, 1))
    print(f"{s} splits: max |O - O_direct| = {float((o.flatten() - direct).abs().max()):.1e}")

# Exercise 4: bf16 partials against fp32 partials, each merged O rounded to bf16 once.
o_part, lse_part = split_partials(scores, values, 16)
for label, parts in (("fp32 partials", o_part.float()), ("bf16 partials", o_part.bfloat16())):
    o, _ = combine_reference(parts.view(16, 1, 1, 1, D), lse_part.view(-1, 1, 1, 1))
    err = (o.flatten().bfloat16().double() - direct).abs().max() / direct.abs().max()
    print(f"{label}: O in bf16, max error relative to max |O| = {float(err):.1e}")

# Exercise 6: the tile of a speculative-decoding step, 32 query / 4 KV heads.
for Sq_ in (8, 9):
    k_ = stage13.compile_args(torch.bfloat16, (1, 32, Sq_, 8192, 128), kv_heads=4)[0]
    rows_ = 8 * Sq_
    print(
        f"Sq = {Sq_}: {rows_} rows, {k_.cta_tile[0]}-row tile, "
        f"{1 - rows_ / k_.cta_tile[0]:.0%} of each QK past the sequence"
    )

# %% [markdown]
# ### Exercise 13a: drop the clamps
#
# The first cell gives the task; the second loads the stage file as it is on disk now, compiles
# it (no GPU needed) and runs its `split_range` on integers. On the committed file it says "not
# yet".

# %%
nb.exercise("13a")

# %%
nb.check_exercise("13a")

# %% [markdown]
# **Next:** `make diff-14` shows what stage 14 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage14_paged_kv.ipynb`](stage14_paged_kv.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped:
# [`docs/notes/stage13.md`](../docs/notes/stage13.md).
