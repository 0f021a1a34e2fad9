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
# # Stage 6 - masks: causal and sliding window, with tile skipping
#
# This notebook walks through `stages/stage6_masks/hopper.py` (and
# `stages/stage6_masks/blackwell.py`): stage 5's kernel with a causal or
# sliding-window mask. The lesson is in two parts: which (query tile, key tile) pairs the kernel
# never touches, and what the few tiles that cross a mask edge do element by element. The notebook
# imports the stage files and displays them; it never pastes kernel code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage6_masks.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; everything else
# (the pictures, the CPU examples, the compile summaries of both tracks) runs in both modes.
# Source: `notebooks/source/stage6_masks.py`.

# %%
import os
import sys

import torch

# The repository root (it holds `common` and `stages`): the first folder upwards that has `common`.
ROOT = os.getcwd()
while not os.path.isdir(os.path.join(ROOT, "common")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from common import masks  # noqa: E402
from common.tools import notebook as nb  # noqa: E402
from common.tools import reference  # noqa: E402
from notebooks.figures import stage6 as figures  # noqa: E402

nb.start(6)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - state the mask convention of this tutorial (bottom-right aligned, FlashAttention's) and say
#   where it differs from SDPA's `is_causal` (top-left) - and check it on the CPU;
# - compute the range of KV tiles a Q tile needs, and sort every (Q tile, KV tile) pair into
#   *skipped*, *partial* (element mask) or *full* (stage 5's loop body) - 2016 / 64 / 2016 of the
#   4096 pairs for causal attention at S = 8k with 128 x 128 tiles;
# - read the three methods that carry the lesson: `kv_tile_range` (one range for the producer and
#   the consumers), `crosses_mask_edge` and `mask_keys`;
# - explain why a row that sees no key needs a "safe" max, and why it ends with O = 0 and
#   LSE = -inf instead of NaN;
# - measure what skipping saves, against the share of tiles it skips.
#
# ## 2. Previous stage recap
#
# Stage 5 is FlashAttention-2's forward pass: one pass over the KV tiles with the running row max
# $m$ (`row_max`), the rescale factor $\alpha$ (`row_scale`) and the running sum $\ell$
# (`row_sum`); O rescaled in registers; $O/\ell$ and the LSE in the epilogue. Two shared-memory
# slots form the K/V ring ($V_j$ lands in the slot $K_j$ just left). Every Q tile visits every KV
# tile $0 \ldots \lceil S_k/128\rceil - 1$, and the only element mask is for the keys past $S_k$ in
# the last tile.
#
# ## 3. The math
#
# ### 3.1 The convention
#
# Query row $i$ (of $S_q$) sees key $j$ (of $S_k$) when
#
# $$i + (S_k - S_q) - \text{left} \;\le\; j \;\le\; i + (S_k - S_q) + \text{right},$$
#
# with `window = (left, right)`, `None` for an unbounded side, and `causal=True` meaning
# right = 0. In terms of the diagonal offset $d = j - i$ the seen keys form a band,
# $\text{band\_lo} \le d \le \text{band\_hi}$ with band_lo $= S_k - S_q - \text{left}$ and
# band_hi $= S_k - S_q + \text{right}$. This is **bottom-right alignment**, FlashAttention's
# convention (and this tutorial's): the *last* query row is aligned with the *last* key, which is
# what a decoder needs when $S_q$ new tokens are appended to a cache of $S_k - S_q$ earlier ones.
# SDPA's `is_causal=True` is **top-left** aligned: row $i$ sees $j \le i$. With $S_q = S_k$ the
# two agree; with $S_q \ne S_k$ they differ, and with $S_q > S_k$ bottom-right leaves the first
# $S_q - S_k$ rows without any key.
#
# A small example on the CPU: $S_q = 3$, $S_k = 5$. The fp64 reference with this tutorial's mask
# matches SDPA given the same mask explicitly, and does not match SDPA's `is_causal`:

# %%
torch.manual_seed(0)
Sq, Sk, D = 3, 5, 8
q, k, v = (torch.randn(1, 1, n, D, dtype=torch.float64) for n in (Sq, Sk, Sk))
bottom_right = masks.visible(Sq, Sk, *masks.resolve_window(True, None, Sq, Sk))
print("bottom-right (causal=True here):\n", bottom_right.int())
print("top-left (SDPA is_causal=True):\n", torch.ones(Sq, Sk, dtype=torch.bool).tril().int())
o_ref, _ = reference.attention_ref(q, k, v, mask=bottom_right)
sdpa = torch.nn.functional.scaled_dot_product_attention
print(
    f"max |ref - SDPA(attn_mask=bottom-right)| = {(o_ref - sdpa(q, k, v, attn_mask=bottom_right)).abs().max():.1e}"
)
print(
    f"max |ref - SDPA(is_causal=True)|         = {(o_ref - sdpa(q, k, v, is_causal=True)).abs().max():.1e}"
)

# %%
fig = figures.mask_alignment(((4, 7), (7, 4)))

# %% [markdown]
# ### 3.2 Which tiles a Q tile needs
#
# Q tile $m$ holds rows first_row $= 128m$ to last_row $= \min(128m + 128, S_q) - 1$. The keys
# any of them sees run from first_row + band_lo to last_row + band_hi, clipped to $[0, S_k)$; the
# KV tiles holding them are $[\text{lo}, \text{hi})$ with lo = first_key // 128 and
# hi = ceil(end_key / 128) - an empty range when hi = lo. Inside the range a tile is **full** when
# every (row, key) pair of it is seen, and **partial** when an edge crosses it: a key past $S_k$,
# or a pair with $d$ > band_hi (right of the band, for the tile's first row) or $d$ < band_lo
# (left of it, for its last row). Only partial tiles get the element mask; full tiles run stage
# 5's loop body unchanged; tiles outside the range are neither loaded nor multiplied.
#
# For causal attention with $S_q = S_k = S$ and $T = S/128$ tiles per side, the diagonal tiles are
# partial ($T$), the tiles below it full ($T(T-1)/2$), the tiles above skipped ($T(T-1)/2$): the
# kernel computes $(T+1)/(2T)$ of the pairs, a little more than half. `common.masks.tile_counts`
# (the host twin of the kernel's decisions) counts them:

# %%
rows = []
for S in (1024, 2048, 4096, 8192, 16384):
    c = masks.tile_counts(S, S, *masks.resolve_window(True, None, S, S))
    done = c["partial"] + c["full"]
    rows.append((S, c["all"], c["skipped"], c["partial"], c["full"], f"{done / c['all']:.3f}"))
nb.table(("S", "tile pairs", "skipped", "partial", "full", "computed / all"), rows)

# %% [markdown]
# ### 3.3 A row that sees no key
#
# With a window, a row can see no key in a whole tile; with causal and $S_q > S_k$ (or a narrow
# window) it can see no key at all. While a row has seen no key so far (a tile before its band, or
# no key at all), its running max is $-\infty$, and the online update of
# stage 5 computes $e^{x - m} = e^{-\infty - (-\infty)} = e^{\text{NaN}}$: the NaN enters $\ell$
# and O, and stays there ($\alpha \cdot \text{NaN} = \text{NaN}$ even when $\alpha = 0$). The kernel
# subtracts a **safe max** instead, 0 when $m = -\infty$: then $P = e^{-\infty} = 0$ and
# $\alpha = 0$. A row that saw nothing ends with $\ell = 0$ and $O = 0$; the epilogue keeps
# $O = 0$ instead of dividing by $\ell$ and writes LSE $= \ln 0 = -\infty$ - FlashAttention's
# convention, and the reference's (`common.tools.reference.attention_ref`). The same update on
# the CPU, for a row whose first tile is masked out and a row that sees nothing:


# %%
def online_row(x, v, tile=4, safe=True):
    """O and LSE of one row of scaled scores x (-inf where masked) by stage 5's online update,
    one tile at a time; safe=True subtracts 0 instead of a max of -inf, as stage 6 does, and
    keeps O = 0, LSE = -inf for a row that saw no key."""
    inf = float("inf")
    m, l, o = torch.tensor(-inf, dtype=x.dtype), torch.tensor(0.0, dtype=x.dtype), 0 * v[0]
    for j0 in range(0, len(x), tile):
        xj = x[j0 : j0 + tile]
        m_new = torch.maximum(m, xj.max())
        m_sub = torch.where(m_new == -inf, 0.0, m_new) if safe else m_new
        alpha = torch.exp(m - m_sub)  # row_scale
        p = torch.exp(xj - m_sub)
        l = alpha * l + p.sum()
        o = alpha * o + p @ v[j0 : j0 + tile]
        m = m_new
    if safe and l == 0:
        return 0 * o, torch.tensor(-inf)
    return o / l, m + torch.log(l)


inf = float("inf")
x_window = torch.tensor([-inf] * 4 + [0.3, 1.2, -inf, 0.5], dtype=torch.float64)
x_none = torch.full((8,), -inf, dtype=torch.float64)
v_row = torch.randn(8, 2, dtype=torch.float64)
for name, x_row in (("first tile masked out", x_window), ("no key at all", x_none)):
    for safe in (False, True):
        o_row, lse_row = online_row(x_row, v_row, safe=safe)
        print(f"{name:22s} safe={safe!s:5s}: O = {o_row.tolist()}, LSE = {lse_row.item()}")
seen = torch.isfinite(x_window)
print("reference for the first row:", (torch.softmax(x_window[seen], 0) @ v_row[seen]).tolist())

# %% [markdown]
# ## 4. What changes
#
# The docstring gives the changes with their numbers; then the kernel class against stage 5
# (`make diff-6 TRACK=hopper` shows the whole files). The diff is the tile range (computed once,
# used by the producer's loads and by the loop bounds), the edge test and the mask, the safe max,
# the zero-initialised O and the epilogue's $\ell = 0$ case - and nothing else.

# %%
nb.show_docstring(6, "hopper")

# %%
nb.show_diff(6, "hopper")

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The picture: skipped, partial and full tiles
#
# The kernel's own tile shape (`cta_tile`), and the classification of `common.masks.tile_map`
# for four masks at 1k tokens: causal; a sliding window of 256 keys to the left; causal with
# $S_q < S_k$ (512 new queries against 1024 keys, as when a prompt is appended to a cache); and
# causal with $S_q > S_k$, whose first rows see nothing (Q tiles 0-2 have an empty range: they
# load no K or V at all and write O = 0, LSE = -inf). The lines are the band's edges in element
# coordinates; a tile is partial exactly when one of them (or the end of the keys) crosses it.

# %%
cfg = nb.show_config(6, "hopper")
bM, bN, _ = cfg.get("cta_tile", (128, 128, 128))
fig = figures.mask_tile_maps(
    [
        ("causal", 1024, 1024, True, None),
        ("window (256, 0)", 1024, 1024, False, (256, 0)),
        ("causal, Sq < Sk", 512, 1024, True, None),
        ("causal, Sq > Sk", 1024, 640, True, None),
    ],
    bM,
    bN,
)

# %% [markdown]
# ### 5.2 One tile range for the producer and the consumers
#
# `kv_tile_range` turns the band into $[\text{kv\_tile\_lo}, \text{kv\_tile\_hi})$ with the
# formulas of 3.2. It is called once per CTA, and both sides of the ring use its result: warp 0
# loads the K tiles of the first `kv_slots` steps and refills a slot only while
# `step + kv_slots < steps`, and the consumers loop over the same `steps = kv_tile_hi -
# kv_tile_lo`. Two formulas for the same count (one for the loads, one for the loop) would be a
# hang waiting to happen: a consumer waiting for a tile the producer never loads. Its host twin in
# `common/masks.py` has the same formulas and is tested on the CPU against the boolean mask; the
# cell after the listings repeats that check here.

# %%
nb.show_source(6, "hopper", names=["Sm90Kernel.kv_tile_range"])
nb.show_function(masks.kv_tile_range)

# %%
# The tile classification against the element mask, brute force, for masks with edges inside
# tiles, on tile boundaries, and lengths that are not tile multiples.
checked = 0
for Sq_, Sk_, causal_, window_ in [
    (1024, 1024, True, None),
    (300, 1000, True, None),
    (1000, 300, True, None),
    (700, 700, False, (100, 0)),
    (512, 512, False, (128, 128)),
    (1, 700, True, None),
]:
    left, right = masks.resolve_window(causal_, window_, Sq_, Sk_)
    seen = masks.visible(Sq_, Sk_, left, right)
    tiles = masks.tile_map(Sq_, Sk_, left, right, bM, bN)
    for m in range(tiles.shape[0]):
        for n in range(tiles.shape[1]):
            block = torch.zeros(
                bM, bN, dtype=torch.bool
            )  # rows past Sq: none; keys past Sk: unseen
            part = seen[m * bM : (m + 1) * bM, n * bN : (n + 1) * bN]
            block[: part.shape[0], : part.shape[1]] = part
            rows_in = min(bM, Sq_ - m * bM)
            want = (
                masks.SKIPPED
                if not block.any()
                else masks.FULL
                if block[:rows_in].all()
                else masks.PARTIAL
            )
            assert tiles[m, n] == want, (Sq_, Sk_, causal_, window_, m, n)
            checked += 1
print(f"tile_map agrees with the element mask on all {checked} tile pairs")

# %% [markdown]
# ### 5.3 The edge tiles: `crosses_mask_edge` and `mask_keys`
#
# In the loop the only new lines are a test and a call: a tile that crosses an edge gets
# `mask_keys`, which sets S = -inf where row $i$ must not see key $j$ ($j \ge S_k$, or $j - i$
# outside [band_lo, band_hi]); every other tile runs stage 5's body. The (row, key) of each of
# this thread's accumulator elements comes from `tScS`, the identity tensor partitioned like S
# (the wgmma accumulator layout of stage 3). A mask is a predicate on (row, column) in the tiles
# that cross an edge - no bit masks, no mask callbacks.

# %%
nb.show_source(6, "hopper", names=["Sm90Kernel.crosses_mask_edge", "Sm90Kernel.mask_keys"])

# %%
nb.show_source(6, "hopper", section="# 2.")

# %% [markdown]
# ### 5.4 Rows that see nothing: the safe max and the epilogue
#
# `online_softmax` is stage 5's with one line more, `m_safe`, which its two exponentials subtract
# in place of `m_new`: the CPU function of 3.3 in CuTe.
# `acc_O.fill(0.0)` before the loop makes O start at 0, so that a Q tile with an empty range -
# no K or V loaded, no wgmma issued - still stores zeros, and the epilogue writes LSE = -inf where
# $\ell = 0$.

# %%
nb.show_source(6, "hopper", names=["Sm90Kernel.online_softmax"])
nb.show_source(6, "hopper", section="# 3.")

# %% [markdown]
# ### 5.5 What the compiler produced
#
# The Hopper kernel for sm_90a (both modes). The mask bounds are run-time int32 values
# (`window_left`, `window_right`; an unbounded side is passed as a bound that admits every key),
# so one compiled kernel serves no mask, causal and every window (exercise 5 checks it). The
# counts of `wgmma.mma_async` and `ex2.approx` are stage 5's: the loop body did not grow.

# %%
report = nb.compile_summary(6, "hopper")

# %% [markdown]
# ### 5.6 The same stage on Blackwell
#
# The Blackwell stage 6 follows the same plan on the machine of stage 1 (section 5.8 there):
# `kv_tile_range` computes the KV-tile range once, before the warps split into roles, and the TMA
# warp, the MMA warp and the softmax warps loop over that one range (three roles, one range: a
# role that took one tile more or less would hang its ring); the element mask applies where S is
# in the softmax warps' registers. The cells below show the docstring of
# `stages/stage6_masks/blackwell.py`, its kernel diff against Blackwell stage 5, the concept table
# of both tracks and its compile summary.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors and their PTX is checked for the
# `tcgen05` instructions. Their numerics are tested only where an sm_100 GPU exists.

# %%
nb.show_docstring(6, "blackwell")
nb.show_diff(6, "blackwell")

# %%
rows = nb.cross_track_table(6)
report_bw = nb.compile_summary(6, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** first stage 5's check without a mask (a few $10^{-3}$ relative, within 3x
# PyTorch's own bf16 error), then the masks: causal with $S_q = S_k$, $S_q < S_k$ and $S_q > S_k$
# (rows with no key), windows whose edges fall inside a tile and on tile boundaries, and a single
# query row (decode). Each is held to the fp64 reference with the *explicit* boolean mask
# (`common.masks.visible`; SDPA's `is_causal` would be the wrong reference whenever
# $S_q \ne S_k$), O and LSE, and every row that sees no key must come out exactly O = 0,
# LSE = -inf. The outputs are poisoned with NaN before each launch, so a row the kernel forgets to
# write fails too.

# %%
result = nb.run_and_verify(6, (2, 4, 512, 1024, 128))
checks = nb.run_and_verify_cases(6)

# %%
fig = nb.error_picture(6, result)

# %% [markdown]
# ## 7. Measure
#
# Two questions, each answered in one run: does the mask cost anything when there is none (stage
# 6 without a mask against stage 5), and does skipping pay (stage 6 causal against stage 6
# without a mask at the same shape, next to the share of tiles it computes)? Causal FLOPs are
# counted as the FlashAttention papers count them, half the full count, so equal TFLOP/s would
# mean half the time.
#
# **Expected**, from `make bench` on the H200 (2026-12-01, bf16, B·S = 16k, H·D = 2048,
# `docs/results/bench_h200_2026-12-01_stage6.md`): at D = 128 stage 6 causal ran 475 / 518 / 537
# TFLOP/s at S = 4k / 8k / 16k against 508 / 544 / 563 without a mask (0.94-0.95x: at S = 8k the
# causal time is $0.5 \cdot 544 / 518 = 0.53$ of the full time, for 0.508 of the tiles), and
# 1.6-1.7x SDPA flash causal (297 / 306 / 320); FA4 ran 643 / 639 / 651 and cuDNN 578 / 613 / 596
# causal. In that run the skipping did not pay at S = 2k, D = 128: 263 causal against 511 without
# a mask, i.e. the causal run took $0.5 \cdot 511 / 263 = 0.97$ of the full time for 0.53 of the
# tiles (D = 64: 353 against 491, 0.70). Other runs did not repeat it: stage 7, which keeps stage
# 6's tile range and mask, ran 399 causal against 466 at S = 2k, D = 128 on the H200 on 2026-12-04
# (`docs/results/ablation_h200_2026-12-04.md`), 0.58 of the full time. At this shape the ratio moves
# between runs; exercise 6 looks at what differs between 2k and 8k. Without a mask, stage 6 stayed
# within a few percent of stage 5 in the 2026-12-01 run from S = 2k up (D = 128, S = 8k: 544
# against 555). The tables below are this run's: the column "time / stage 6 no-mask time" of the
# second one is this run's ratio, next to the share of tile pairs computed. The two cells time
# stage 6 without a mask each in their own rounds, a moment apart, so its speed at (2, 16, 8k, 8k,
# 128) can differ between them by several percent (544 and 591 TFLOP/s in the executed copy's run,
# H100 80GB HBM3, 2026-12-07); each ratio is taken within one cell.

# %%
bench = nb.measure(6, [(2, 16, 8192, 8192, 128)], also_stages=(5,))

# %%
bench_masks = nb.measure_masks(
    6,
    [(8, 16, 2048, 2048, 128), (2, 16, 8192, 8192, 128)],
    mask_options={"causal": dict(causal=True), "window (1024, 0)": dict(window=(1024, 0))},
    with_fa4=True,
)

# %%
for S in (2048, 8192):
    for label, causal_, window_ in (("causal", True, None), ("window (1024, 0)", False, (1024, 0))):
        c = masks.tile_counts(S, S, *masks.resolve_window(causal_, window_, S, S), bM, bN)
        share = (c["partial"] + c["full"]) / c["all"]
        print(
            f"S = {S}, {label}: the kernel computes {share:.3f} of the tile pairs (the ideal time ratio)"
        )
if not bench_masks:
    print("no measurement in this mode: the H200 figures above are the comparison")

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU; where a GPU adds a measurement, the exercise says which call makes it.
#
# 1. **A window's tiles.** For `window=(1024, 0)` at $S_q = S_k = 8192$ (a model with a 1k
#    sliding window), predict how many of the 4096 tile pairs are skipped, partial and full, then
#    check with `masks.tile_counts`. What share of causal's work is that? (GPU mode: section 7 timed
#    this window; compare its time ratio with its tile share.)
# 2. **Decode.** One new token ($S_q = 1$) against a cache of $S_k = 700$ keys, `causal=True`.
#    Which keys does the row see under this tutorial's convention, and under SDPA's `is_causal`?
#    Which KV tiles does the kernel load (`masks.kv_tile_range`)?
# 3. **The safe max.** In `online_row` (3.3), with `safe=False`, where does the first NaN appear
#    for the row whose first tile is masked out, and why does the row stay NaN although its second
#    tile has visible keys?
# 4. **Edges inside tiles.** Count the skipped, partial and full tiles at $S = 1024$ for
#    `window=(100, 0)`, `(128, 0)` and `(256, 0)`, against causal. Why does a window have about
#    twice as many partial tiles as causal, and why do the two narrow ones have no full tile?
# 5. **One compile for every mask.** Compare the compile summaries of stage 6 with no mask, causal
#    and a window (`nb.compile_report(6, "hopper", options=dict(causal=True))`, `...
#    options=dict(window=(100, 0))`): what differs, and why does that let one compiled kernel serve
#    all masks?
# 6. **Short sequences.** At S = 2k, D = 128 the causal run's time ratio has ranged from 0.58
#    (stage 7, the same tile range and mask, 2026-12-04,
#    `docs/results/ablation_h200_2026-12-04.md`) to 0.97 (stage 6, 2026-12-01,
#    `docs/results/bench_h200_2026-12-01_stage6.md`) of the no-mask time on the H200 (section 7)
#    for 0.53 of the tiles; the run of this notebook's executed copy measured 0.60 (H100 80GB
#    HBM3, 2026-12-07). Compute, for causal at S = 2k and 8k, how many KV tiles the CTAs of
#    Q tiles 0, the middle one and the last one compute, and the total number of CTAs (B·H·Q
#    tiles at B·S = 16k, H = 16). Which of these numbers differ between 2k and 8k? (This only
#    starts the question: the cause of the 2k figure is not established in this tutorial. In
#    GPU mode,
#    `nb.measure_masks(6, [(8, 16, 2048, 2048, 128)])` repeats the measurement.)
# 7. **Tile skipping off** (exercise 6a, an edit of the Hopper stage file): make the kernel load
#    every KV tile whatever the mask. The cells at the end of the notebook give the task and check
#    the edit.
#
# ### Answers and checks
#
# <details><summary>1. A window's tiles</summary>
#
# Q tile $m$ sees keys $128m - 1024$ to $128m + 127$: KV tiles $m - 8$ to $m$, nine per tile
# (fewer for the first eight). The diagonal tile and the tile eight to the left are crossed by an
# edge (partial), the seven between are full. Over 64 Q tiles: 120 partial, 420 full, 3556
# skipped - 540 computed, 13% of the pairs and a quarter of causal's 2080. The cell below counts
# them. A time ratio well above 0.13 in section 7 would mean per-tile costs the count leaves out
# (the partial tiles' element masks, the fixed cost of each CTA).
# </details>
#
# <details><summary>2. Decode</summary>
#
# Bottom-right: the single row is aligned with the last key, $j \le 0 + 700 - 1$: it sees all 700
# keys, which is what decoding with a cache means. SDPA's `is_causal` (top-left) lets it see key 0
# only. The kernel loads KV tiles 0-5 (`kv_tile_range(0, 1, 700, ...)` = (0, 6)); only the last
# is partial (the keys past 700). The cell below shows both with SDPA on the CPU.
# </details>
#
# <details><summary>3. The safe max</summary>
#
# In the first tile: $m_{\text{new}} = -\infty$ and $e^{x - m} = e^{-\infty + \infty} =$ NaN for
# every key, so $\ell$ and O become NaN. In the second tile $m$ is finite and $\alpha = e^{-\infty}
# = 0$, but $0 \cdot \text{NaN} = \text{NaN}$: nothing washes a NaN out of a running sum. With the
# safe max the first tile gives $P = 0$, $\alpha = 0$, and $\ell = O = 0$ - harmless. The cell
# below prints the state after each tile.
# </details>
#
# <details><summary>4. Edges inside tiles</summary>
#
# Causal at 1024: 8 partial, 28 full. Windows (100, 0) and (128, 0): 15 partial, 0 full; (256,
# 0): 14 partial, 7 full (the cell below counts them). Causal has one edge, the diagonal, which
# crosses one tile per Q tile. A window has a second edge, $d = -\text{left}$, which crosses one
# more tile per Q tile (tile $m - 1$ for left = 100 or 128, tile $m - 2$ for 256): about twice as
# many partial tiles. A Q tile's range then spans the tiles from one edge to the other; when the
# window is at most about one tile wide, every tile of the range touches an edge and none is full.
# For such windows every computed tile pays the element mask (a compare and a select per score).
# </details>
#
# <details><summary>5. One compile for every mask</summary>
#
# Nothing differs: the PTX instruction counts, registers and shared memory are the same, because
# causal and window only change two int32 kernel arguments (`window_left`, `window_right`), run-time
# values the tile range and the edge test read. The compile cache keys on the kernel's settings and
# the tensors' types, not on those values, so `attention(..., causal=True)` after
# `attention(...)` launches the kernel already compiled.
# </details>
#
# <details><summary>6. Short sequences</summary>
#
# Causal Q tile $m$ computes $m + 1$ KV tiles: at S = 2k (16 Q tiles: 0, 8, 15) 1, 9 and 16; at
# S = 8k (64 Q tiles: 0, 32, 63) 1, 33 and 64. The CTA count is the same, 16384 / 128 x 16 =
# 2048, in both. What changes is the work per CTA (8.5 tiles on average at 2k, 32.5 at 8k), so
# any fixed cost per CTA (loading Q, the first K tile's latency, the epilogue) weighs four times
# more at 2k - but the no-mask run at S = 1k, with as many CTAs doing 8 tiles each, reached 435
# TFLOP/s in the H200 run of 2026-12-01 (`docs/results/bench_h200_2026-12-01_stage6.md`), so
# per-CTA cost alone does not explain that run's 263. What these numbers do show differing from
# that run is the spread of work between CTAs (1 to 16 tiles) and one masked tile per CTA;
# whether either matters, and why the ratio moves between runs, is for a measurement to say. The
# question stays open here.
# </details>

# %%
# Exercise 1: a 1k window at S = 8k against causal.
for label, causal_, window_ in (("window (1024, 0)", False, (1024, 0)), ("causal", True, None)):
    t = masks.tile_counts(8192, 8192, *masks.resolve_window(causal_, window_, 8192, 8192))
    print(
        f"{label}: {t['skipped']} skipped, {t['partial']} partial, {t['full']} full of {t['all']}"
    )

# Exercise 2: decode, both conventions, and the tiles the kernel loads.
Sq2, Sk2 = 1, 700
left2, right2 = masks.resolve_window(True, None, Sq2, Sk2)
print(
    "keys seen, bottom-right:",
    int(masks.visible(Sq2, Sk2, left2, right2).sum()),
    "| top-left (SDPA is_causal):",
    int(torch.ones(Sq2, Sk2, dtype=torch.bool).tril().sum()),
    "| KV tiles loaded:",
    masks.kv_tile_range(0, Sq2, Sk2, left2, right2),
)

# Exercise 3: the unsafe update, tile by tile.
m_, l_ = torch.tensor(-inf, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
for j0 in (0, 4):
    xj = x_window[j0 : j0 + 4]
    m_new = torch.maximum(m_, xj.max())
    p = torch.exp(xj - m_new)
    l_ = torch.exp(m_ - m_new) * l_ + p.sum()
    print(f"tile {j0 // 4}: m_new = {m_new.item()}, P = {p.tolist()}, l = {l_.item()}")
    m_ = m_new

# Exercise 4: partial tiles of windows against causal at S = 1024.
for window_ in ((100, 0), (128, 0), (256, 0), None):
    lr = masks.resolve_window(window_ is None, window_, 1024, 1024)
    t = masks.tile_counts(1024, 1024, *lr)
    print(
        f"window {window_ or 'causal'}: {t['skipped']} skipped, {t['partial']} partial, "
        f"{t['full']} full of {t['all']}"
    )

# Exercise 5: the same PTX for every mask.
ptx_texts = {}
for label, options in (
    ("no mask", {}),
    ("causal", dict(causal=True)),
    ("window", dict(window=(100, 0))),
):
    r = nb.compile_report(6, "hopper", options=options)
    if r is not None:
        ptx_texts[label] = r.ptx
        wgmma, ex2 = r.counts["wgmma.mma_async"], r.counts["ex2.approx"]
        regs = nb.cubin_registers(r.cubin)
        print(f"{label}: {wgmma} wgmma, {ex2} ex2, {regs} registers per thread")
if len(ptx_texts) == 3:
    same = len(set(ptx_texts.values())) == 1
    print("the three PTX texts are", "identical" if same else "different")

# Exercise 6: work per CTA, causal, at S = 2k and 8k (B * S = 16k, H = 16).
for S in (2048, 8192):
    q_tiles = S // 128
    lr = masks.resolve_window(True, None, S, S)
    per_cta = [masks.kv_tile_range(m, S, S, *lr) for m in (0, q_tiles // 2, q_tiles - 1)]
    print(
        f"S = {S}: CTAs = {16384 // S * 16 * q_tiles}, KV tiles of Q tiles 0, {q_tiles // 2}, "
        f"{q_tiles - 1}: {[hi - lo for lo, hi in per_cta]}, mean {(q_tiles + 1) / 2}"
    )

# %% [markdown]
# ### Exercise 6a: tile skipping off
#
# The first cell gives the task; the second compiles the stage file as it is on disk now (no GPU
# needed), runs the kernel's own `kv_tile_range` for every Q tile of a causal mask and says "done"
# or "not yet" with the counts it saw. On the committed file it says "not yet".
#
# <details><summary>What happens on a GPU</summary>
#
# O stays right on finite inputs: every tile outside the band crosses a mask edge, so `mask_keys`
# sets its S to -inf and P = 0 there. The cost is the time: causal then computes every tile pair,
# about twice the work at S = 8k. And a tile nobody should read is now read: `make stage-6` has a
# test that plants NaN in K and V tiles no query sees, and P = 0 times a NaN of V is NaN.
# </details>

# %%
nb.exercise("6a")

# %%
nb.check_exercise("6a")

# %% [markdown]
# **Next:** `make diff-7` shows what stage 7 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage7_gqa_varlen.ipynb`](stage7_gqa_varlen.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage6.md`](../docs/notes/stage6.md).
