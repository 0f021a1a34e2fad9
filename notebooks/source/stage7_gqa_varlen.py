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
# # Stage 7 - real-model shapes: GQA / MQA and packed variable-length sequences
#
# This notebook walks through `stages/stage7_gqa_varlen/hopper.py` (and
# `stages/stage7_gqa_varlen/blackwell.py`): stage 6's kernel for the shapes real
# models run. Query heads share K/V heads (Llama-3 8B: 32 query heads, 8 KV heads), and a batch
# of sequences of different lengths is packed into one tensor instead of being padded to the
# longest. The notebook imports the stage files and displays them; it never pastes kernel code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage7_gqa_varlen.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; everything else runs
# in both modes. Source: `notebooks/source/stage7_gqa_varlen.py`.

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
from common.tools import reference, stage_table  # noqa: E402
from notebooks.figures import stage7 as figures  # noqa: E402

nb.start(7)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - say which KV head a query head reads under GQA and MQA ($h \,/\!/\, (H/H_{kv})$, SDPA's
#   `enable_gqa`), and why sharing costs the kernel nothing: it is a TMA coordinate;
# - read FlashAttention's packed layout (`cu_seqlens`) and the one per-sequence method,
#   `seq_info`, that gives every part of the kernel (offset_q, seqlen_q, offset_k, seqlen_k);
# - draw the (sequence, head, Q tile) -> CTA map of a ragged batch and say which CTAs find work
#   and which find an empty range;
# - explain the two ways a packed tensor breaks a kernel written for a batch - TMA clips at the
#   packed tensor's end, not the sequence's - and how the stage avoids both (V rows zeroed past
#   seqlen_k, O stored by predicated copies);
# - compute how much work padding wastes and measure what packing saves.
#
# ## 2. Previous stage recap
#
# Stage 6 added masks to the online softmax of stage 5: each Q tile computes one range of KV
# tiles (`kv_tile_range`, used by the producer's loads and by the loop), only the tiles an edge
# crosses get the element mask, a safe max keeps rows without keys at O = 0 and LSE = -inf. Its
# tensors were (B, H, S, D) with as many K/V heads as query heads and one length for the batch.
#
# ## 3. The math
#
# ### 3.1 GQA and MQA
#
# With $H$ query heads and $H_{kv}$ K/V heads ($H \bmod H_{kv} = 0$), query head $h$ attends
# with K/V head $g(h) = h \,/\!/\, (H/H_{kv})$:
#
# $$O_h = \operatorname{softmax}\!\big(\text{scale}\cdot Q_h K_{g(h)}^{\top}\big)\,V_{g(h)} .$$
#
# $H_{kv} = H$ is ordinary multi-head attention, $H_{kv} = 1$ is MQA. The FLOPs are those of MHA;
# what shrinks by $H/H_{kv}$ (4x for Llama-3 8B) is K and V: a model's KV cache, and the bytes
# the kernel reads from memory when L2 catches the repeated reads of a group. SDPA's
# `enable_gqa=True` computes the same as repeating each K/V head $H/H_{kv}$ times
# (`repeat_interleave`), which is how the fp64 reference does it. The kernel copies nothing: the
# CTA of query head $h$ reads K/V head $g(h)$ through the TMA coordinate.

# %%
torch.manual_seed(0)
H, Hkv = 8, 2
q, k, v = (torch.randn(1, h, 5, 16, dtype=torch.float64) for h in (H, Hkv, Hkv))
o_gqa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
o_ref, _ = reference.attention_ref(
    q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
)
print(f"max |SDPA(enable_gqa) - reference with K, V repeated| = {(o_gqa - o_ref).abs().max():.1e}")
print("query head -> KV head:", {h: h // (H // Hkv) for h in range(H)})

# %%
fig = figures.gqa_head_map(32, 8)

# %% [markdown]
# ### 3.2 Packed sequences
#
# FlashAttention's varlen layout packs a batch of sequences along the token axis: q is
# (total_q, H, D), k and v (total_k, $H_{kv}$, D), and sequence $b$ occupies rows
# `cu_seqlens[b]` to `cu_seqlens[b + 1] - 1` (int32 offsets, `cu_seqlens[0] = 0`, the last equal
# to the total; zero-length sequences allowed). Each sequence is an attention problem of its own,
# masked as in stage 6 with its own lengths: causal is bottom-right per sequence. What packing
# saves is the padding: a batch padded to its longest sequence computes $B \cdot S_{\max}^2$
# (query, key) pairs instead of $\sum_b S_b^2$. For the batch `make bench` times (16 sequences
# whose lengths are drawn uniformly from 64-2047 tokens with a fixed seed; `nb.varlen_lengths()`
# draws the same):

# %%
lens = nb.varlen_lengths()
longest = max(lens)
real, padded = sum(n * n for n in lens), len(lens) * longest * longest
real_c = sum(n * (n + 1) // 2 for n in lens)
padded_c = len(lens) * longest * (longest + 1) // 2
print("lengths:", lens)
print(f"{sum(lens)} real tokens; padded to the longest ({longest}): {len(lens) * longest} tokens")
print(
    f"(query, key) pairs: real {real:,}, padded {padded:,} - padding multiplies the work by "
    f"{padded / real:.2f}x (causal: {padded_c / real_c:.2f}x)"
)

# %% [markdown]
# ## 4. What changes
#
# The docstring gives the changes with their numbers; then the kernel class against stage 6
# (`make diff-7 TRACK=hopper` shows the whole files, the new entry `attention_varlen` included).
# The diff is the head mapping, pack-GQA (a KV head's query heads sharing one Q tile's rows), the
# sequence offsets (`seq_info`, `domain_offset`), the grid over sequences, and the two boundary
# fixes (`zero_rows`, `store_rows`). Two changes come with them that the later stages build on:
# the host side moves to `common/attention_host.py`, shared by stages 7-14 (the entry functions
# call it), and `load` and `mma` take their arguments grouped (`gmem`, `smem`, `barriers`, ...),
# as the warp-role methods of stage 8 on do.

# %%
nb.show_docstring(7, "hopper")

# %%
nb.show_diff(7, "hopper")

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The head mapping and the sequence offsets
#
# Two lines map the heads and one method maps the sequences. `kv_head = head // (H // Hkv)`
# picks the K/V head; `seq_info` returns where the sequence starts in Q and K and how long it is
# - (0, Sq, 0, Sk) and the batch coordinate in batch mode, offsets read from `cu_seqlens` when
# packed (the tensors then arrive as B = 1 and S = total tokens). Every later line takes the
# sequence from there: `cute.domain_offset` shifts a (S, D) view of one head so that row 0 is
# the sequence's first row, and `local_tile` then tiles it exactly as in stage 6. The tile range,
# the masks and the LSE index all use the per-sequence `seqlen_q`, `seqlen_k`.

# %%
hits = nb.concept_lines(7, "hopper", r"kv_head = |self\.seq_info\(|domain_offset\(")
nb.table(("line of hopper.py", "code"), [(f"l. {n}", f"`{code}`") for n, code in hits])
nb.show_source(7, "hopper", names=["Sm90Kernel.seq_info"])

# %% [markdown]
# ### 5.2 The CTA grid of a ragged batch
#
# The grid is (ceil(G max_seqlen_q / 128), H / G, sequences), G = 1 until pack-GQA (5.3b): as
# many Q tiles per sequence as the longest has. A CTA whose tile starts past its sequence's end
# finds an empty tile range (a line added to `kv_tile_range`) and, like stage 6's Q tiles that see
# no key, loads no K or V and computes nothing; it still loads its Q tile (Q is loaded whatever
# the range) and then stores nothing. The picture: five sequences (one of them empty), causal, two
# of the H heads drawn (all heads look the same); the number in a cell is the count of KV tiles
# that CTA computes.

# %%
cfg = nb.show_config(7, "hopper")
bM, bN, _ = cfg.get("cta_tile", (128, 128, 128))
ragged = [300, 77, 0, 520, 1]
fig = figures.varlen_cta_map(ragged, heads=2, bM=bM, bN=bN, causal=True)

# %%
grid = -(-longest // bM) * len(lens)
busy = sum(-(-n // bM) for n in lens)
print(
    f"make bench's batch: {grid} CTAs per head in the grid, {busy} with work ({busy / grid:.0%}); "
    f"the others load a Q tile and store nothing"
)

# %% [markdown]
# ### 5.3 Sequence boundaries: what TMA does with a packed tensor
#
# TMA clips a tile at the bounds of the tensor it was given, and for packed sequences that bound
# is the total token count. A tile that runs past its sequence's end therefore reads - or, for a
# store, writes - the next sequence's rows. Per operand:
#
# - **Q rows past seqlen_q** are computed from the next sequence's queries and never stored (the
#   LSE is written per row, only for rows < seqlen_q).
# - **K rows past seqlen_k** give S columns that stage 6's mask already sets to -inf (a key
#   $\ge$ seqlen_k makes the tile an edge tile).
# - **V rows past seqlen_k** are multiplied by P = 0 - but $0 \cdot \text{NaN} = \text{NaN}$, and
#   the next sequence's V (or whatever is there) may hold a NaN or an Inf. In packed mode the last
#   V tile's rows past seqlen_k are zeroed in shared memory (`zero_rows`) before $PV$ reads them.
# - **The O store**: stage 6's TMA store of the whole 128-row tile would write the tile's extra
#   rows into the next sequence's O - which another CTA writes too. O now goes from shared memory
#   to global memory by threads, 16 bytes per copy, only for rows < seqlen_q (`store_rows`).
#
# The picture: the sequences of the boundary test (`tests/test_stage7.py` plants NaN in
# every row outside one sequence and checks it never gets in), their Q tiles, and the rows each
# last tile reads from a neighbour.

# %%
fig = figures.packed_rows([200, 77, 300, 1], bM=bM)

# %%
# Why P = 0 does not protect against the neighbour's V: 0 x NaN = NaN.
p_row = torch.tensor([0.7, 0.3, 0.0])  # the third key is past seqlen_k: P = 0 there
v_tile = torch.tensor([[1.0, 2.0], [3.0, 4.0], [float("nan"), 5.0]])  # ... and its V row is NaN
print("P @ V with the neighbour's row:", (p_row @ v_tile).tolist())
v_tile[2] = 0.0  # zero_rows
print("P @ V with the row zeroed:     ", (p_row @ v_tile).tolist())

# %%
nb.show_source(7, "hopper", names=["Sm90Kernel.zero_rows", "Sm90Kernel.store_rows"])

# %% [markdown]
# ### 5.3b Pack-GQA: a decode step fills one row of 128
#
# With Sq = 1 (one new token per sequence) a 128-row Q tile holds one real row, and each of the
# G = H / Hkv query heads of a group reads the whole K/V cache again. Pack-GQA
# (`common/pack_gqa.py`) puts the G heads of a group into one tile's rows: row r is position
# r // G of head r % G. The kernel sees it only as layouts - Q, O and LSE get the nested row mode
# (G, S) and the grid runs over KV heads - and the masks take position r // G. The rule (from
# FlashAttention-3) packs when a head's rows alone would use much less of a tile than the group's:

# %%
from common import pack_gqa  # noqa: E402

nb.table(
    ("H / Hkv", "Sq", "query heads per tile", "rows used unpacked", "rows used packed"),
    [
        (
            f"{H} / {Hkv}",
            Sq,
            pack_gqa.choose_pack(H, Hkv, Sq),
            f"{Sq}/{-(-Sq // 128) * 128}",
            f"{G * Sq}/{-(-G * Sq // 128) * 128}",
        )
        for H, Hkv, Sq in (
            (32, 8, 1),
            (32, 8, 16),
            (32, 8, 40),
            (32, 8, 100),
            (32, 8, 2048),
            (32, 1, 3),
        )
        for G in [H // Hkv]
    ],
)

# %% [markdown]
# Measured on the H200 (2026-12-02, `python -m common.tools.bench --stages 7`,
# `docs/results/gqa_varlen_decode_h200_2026-12-02.md`; B = 32, 32 query / 8 KV heads, Sk = 8192,
# D = 128): Sq = 1 340 us packed against 1085 us unpacked, Sq = 16 343 against 1095 (3.2x; FA4
# 240 and 244 us, SDPA 237 and 1383). Packed, the kernel reads 1.07 GB of K and V at 3.16 TB/s,
# about two thirds of the H200's 4.8 TB/s: 256 CTAs (32 sequences x 8 KV heads) on 132 SMs, each
# streaming one head's 8192 keys alone. FA4 also splits the keys over several CTAs
# (split-KV) to fill the machine - the technique of stage 13. O and LSE are the
# unpacked kernel's bit for bit (tested).

# %% [markdown]
# ### 5.4 What the compiler produced
#
# The Hopper kernel for sm_90a in both modes of the stage: batch mode (no `cu_seqlens`) and packed
# (`options=dict(varlen=True)`). `cutlass.const_expr(mCuSeqlensK is not None)` is decided while
# the kernel is traced (stage 1's box on trace time and run time), so the zeroing of V exists only
# in the packed kernel: one more `bar.sync` and more registers. Neither kernel has a TMA store
# (`cp.async.bulk.tensor (store)`) any more; stage 6 had two.

# %%
report = nb.compile_summary(7, "hopper")
report_packed = nb.compile_summary(7, "hopper", options=dict(varlen=True))

# %% [markdown]
# ### 5.5 The same stage on Blackwell
#
# The same lesson on the machine of stage 1 (section 5.8 there): `seq_info` is called once before
# the warps split into roles, the head mapping is a TMA coordinate, and the two boundary rules
# hold - on Blackwell the O store was already a per-row predicated copy from registers, and the
# zeroing of V past seqlen_k is done where the MMA warp waits for V (`zero_keys`; its docstring
# gives the fences this needs: `tcgen05.mma` reads shared memory through the async proxy). The
# cells below show the docstring of `stages/stage7_gqa_varlen/blackwell.py`, its kernel diff
# against Blackwell stage 6, the concept table and its compile summary.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors and their PTX is checked for the
# `tcgen05` instructions. Their numerics are tested only where an sm_100 GPU exists.

# %%
nb.show_docstring(7, "blackwell")
nb.show_diff(7, "blackwell")

# %%
rows = nb.cross_track_table(7)
report_bw = nb.compile_summary(7, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** stage 5's check of MHA in batch mode (a few $10^{-3}$ relative, within 3x
# PyTorch's own bf16 error); then GQA with group sizes 2, 4 and 8 and MQA, with and without a
# mask, against the fp64 reference with K and V repeated; then a packed batch with a zero-length
# and a one-token sequence and tiles that run into the neighbours, causal per sequence, each
# sequence checked against the reference of that sequence alone - and once more with NaN planted
# in every row outside the sequence, which must not reach it. The last column says whether the
# planted run's O and LSE are bit for bit those of the first run (they should be: nothing outside
# a sequence enters its arithmetic).

# %%
result = nb.run_and_verify(7, (2, 4, 512, 1024, 128))
checks = nb.run_and_verify_cases(
    7,
    [
        ("GQA 8 / 4", (2, 8, 300, 700, 128), dict(kv_heads=4)),
        ("GQA 8 / 2, causal", (2, 8, 300, 700, 128), dict(kv_heads=2, causal=True)),
        ("GQA 16 / 2, window (100, 0)", (1, 16, 300, 300, 64), dict(kv_heads=2, window=(100, 0))),
        ("MQA 8 / 1, causal, Sq > Sk", (1, 8, 520, 200, 128), dict(kv_heads=1, causal=True)),
    ],
)
packed_checks = nb.run_and_verify_varlen(
    7, [200, 77, 0, 300, 1], [130, 190, 5, 129, 260], heads=4, kv_heads=2, causal=True
)

# %%
fig = nb.error_picture(7, result)

# %% [markdown]
# ## 7. Measure
#
# **Expected**, from `python -m common.tools.bench --stages 7` on the H200 (2026-12-02, bf16,
# `docs/results/gqa_varlen_decode_h200_2026-12-02.md`): GQA 32/8 at D = 128, B·S = 16k ran at
# 0.97-1.09x the stage's own MHA at the same shape (509 / 521 TFLOP/s against 472 / 539 at
# S = 2k / 8k; causal 442 / 484 against 404 / 499), FA4 661 / 678 and cuDNN 644 / 620 there
# (causal: FA4 564 / 683, cuDNN 555 / 547). The packed batch of 3.2 (H = 16, D = 128, useful
# FLOPs of the real tokens only): stage 7 390 TFLOP/s (causal 326) against 176 (74) for the same
# batch padded through SDPA cuDNN with a key-padding mask - 2.21x (4.44x causal) - and FA4's
# varlen 575 (430). Without a mask, packing gains about the padding it removes (the factor
# printed in section 3); causal it gains more, because SDPA cuDNN with a key-padding mask and
# causal runs at 74. Stage 7 itself stays at 0.68x (0.76x causal) of FA4's varlen; 5.2's count
# is one fact to start from (35% of the grid's CTAs do no work, and many CTAs have only a few KV
# tiles); nothing here measures which costs what.
#
# The first cell times stage 7 in batch mode against stage 6 (the same work: the head mapping and
# the offsets should cost nothing; one run cannot tell a few percent from noise); the second the
# packed batch against the same batch padded, through this stage and through SDPA cuDNN, all in one
# run.

# %%
bench = nb.measure(7, [(2, 16, 8192, 8192, 128)], also_stages=(6,))

# %%
bench_varlen = nb.measure_varlen(7, lens, heads=16, head_dim=128, with_fa4=True)

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU; where a GPU adds a measurement, the exercise says which call makes it.
#
# 1. **Groups.** With H = 32 and Hkv = 8, which KV head does query head 13 read, and which query
#    heads share it? How many CTAs read each K tile of a (sequence, KV head) at a given Q tile
#    index? And with MQA (Hkv = 1)?
# 2. **The grid.** For `make bench`'s batch (`lens`), how many CTAs does the grid launch at H = 16,
#    how many have work without a mask, and how many of the KV tiles of the padded batch's CTAs
#    would be real work? (Count tile pairs with `masks.kv_tile_range` per sequence.)
# 3. **Zeroing V.** A sequence with seqlen_k = 300 keys: which KV tile is its last, and which rows
#    of that tile does `zero_rows` clear? Why is K not zeroed as well?
# 4. **The store.** With the sequences [200, 77, 300, 1] and 128-row Q tiles, which packed rows
#    would a TMA store of each sequence's last Q tile write that belong to another sequence? Why
#    does stage 7 use the predicated store in batch mode too, where TMA's bound is the batch
#    entry's own Sq?
# 5. **Batch and packed kernels.** Compare the compile summaries of 5.4: which counts differ, and
#    which lines of the stage file exist only in the packed kernel? (`nb.compile_report(7, "hopper",
#    options=dict(varlen=True))` gives the report as an object.)
# 6. **GQA costs nothing.** Why should GQA 32/8 run as fast as MHA at the same shape - or faster?
#    In GPU mode, time it: the cell with the answers builds the two calls for `nb.measure_calls`.
# 7. **GQA is one TMA coordinate** (exercise 7a, an edit of the Hopper stage file): undo the head
#    mapping and read what changes in the PTX. The cells at the end of the notebook give the task
#    and check the edit.
#
# ### Answers and checks
#
# <details><summary>1. Groups</summary>
#
# 13 // 4 = 3: KV head 3, shared by query heads 12-15. At a given Q tile index, the 4 CTAs of
# heads 12-15 read the same K and V tiles - through TMA coordinates, the first from HBM and the
# others, if they run close enough in time, from L2. With MQA all 32 query heads read KV head 0:
# 32 CTAs per K tile. The cell below lists the groups.
# </details>
#
# <details><summary>2. The grid</summary>
#
# The longest sequence has 1912 tokens: 15 Q tiles per sequence, a grid of 15 x 16 x 16 = 3840
# CTAs, of which 157 x 16 = 2512 have work (65%). Of the padded batch's (Q tile, KV tile) pairs
# only those inside each sequence are real work; the cell below counts both. The empty CTAs cost
# a launch slot, a read of `cu_seqlens` and a Q-tile load each - little against a tile of work,
# but not nothing.
# </details>
#
# <details><summary>3. Zeroing V</summary>
#
# KV tiles of 128: keys 256-383 form tile 2, the last; seqlen_k - 2 x 128 = 44, so rows 44-127 of
# that tile are zeroed (`zero_rows(sKV, slot, 44, ...)`). K needs no zeroing: its rows past
# seqlen_k only produce S columns, and the mask *replaces* those with -inf (a select, not a
# multiply), NaN included. V's rows are multiplied by P, and multiplying is what lets a NaN
# through.
# </details>
#
# <details><summary>4. The store</summary>
#
# Sequence 0 (rows 0-199): its tile 1 covers packed rows 128-255, of which 200-255 are sequence 1's.
# Sequence 1 (rows 200-276): tile 0 covers 200-327, and 277-327 belong to sequence 2. Sequence 2
# (rows 277-576): tile 2 covers 533-660, row 577 is sequence 3's and 578-660 lie past the tensor
# (clipped). Sequence 3 (row 577): tile 0 covers 577-704, all past the tensor but its own row. A TMA
# store would overwrite those rows while their own CTA writes them: a race with a wrong result. In
# batch mode TMA would clip at Sq correctly, but one store path for both modes keeps the kernel one
# kernel (a flag selecting the store would make it two), and the store runs once per CTA, outside
# the main loop. </details>
#
# <details><summary>5. Batch and packed kernels</summary>
#
# The packed kernel has one more `bar.sync` (the named barrier of `zero_rows`) and more registers
# per thread (the cell below prints both counts); the `wgmma`, `ex2` and TMA load counts are the
# same. The lines under `cutlass.const_expr(mCuSeqlensK is not None)`
# (the call of `zero_rows`) and the `cu_seqlens` branch of `seq_info` exist only in the packed
# kernel: they are decided at trace time. The cell below prints the counts that differ.
# </details>
#
# <details><summary>6. GQA costs nothing</summary>
#
# Every CTA does exactly the work of MHA - same Q tile, same number of K and V tiles, same FLOPs -
# only the K/V head coordinate of its TMA loads differs. What changes is that 4 CTAs read the same
# K/V bytes, so HBM traffic for K and V drops by up to 4x when the L2 catches the repeats: GQA
# should be as fast or faster. The benchmark run quoted in section 7 (H200, 2026-12-02,
# `docs/results/gqa_varlen_decode_h200_2026-12-02.md`) measured 0.97-1.09x: within run-to-run
# noise of "as fast" at S = 8k, faster at 2k; a ratio a few percent below 1 in the table the cell
# below prints (GPU mode: both at S = 8k in one run) is the same noise.
# </details>

# %%
# Exercise 1: the groups of Llama-3 8B's heads, and MQA.
group = 32 // 8
print(
    "KV head of query head 13:",
    13 // group,
    "| its group:",
    [h for h in range(32) if h // group == 13 // group],
)
print("CTAs per K tile: GQA 32/8:", group, "| MQA 32/1:", 32)

# Exercise 2: the grid of make bench's batch, and real against padded tile pairs.
q_tiles = -(-longest // bM)
real_pairs = padded_pairs = 0
for n in lens:
    lr = masks.resolve_window(False, None, n, n)
    real_pairs += sum(
        hi - lo
        for lo, hi in (masks.kv_tile_range(m, n, n, *lr, bM, bN) for m in range(-(-n // bM)))
    )
    lr = masks.resolve_window(False, None, longest, longest)
    padded_pairs += sum(
        hi - lo
        for lo, hi in (
            masks.kv_tile_range(m, longest, longest, *lr, bM, bN) for m in range(q_tiles)
        )
    )
print(
    f"grid {q_tiles} x 16 x {len(lens)} = {q_tiles * 16 * len(lens)} CTAs, "
    f"{sum(-(-n // bM) for n in lens) * 16} with work; tile pairs per head: packed {real_pairs}, "
    f"padded {padded_pairs} ({real_pairs / padded_pairs:.0%} real)"
)

# Exercise 3: the last KV tile of a 300-key sequence and the rows zero_rows clears.
seqlen_k = 300
last = (seqlen_k - 1) // bN
print(f"last KV tile {last}; rows {seqlen_k - last * bN}..{bN - 1} of it are zeroed")

# Exercise 4: the rows a TMA store of each last Q tile would write outside its sequence.
seqs = [200, 77, 300, 1]
cu = [0]
for n in seqs:
    cu.append(cu[-1] + n)
for b, n in enumerate(seqs):
    first = cu[b] + (n - 1) // bM * bM
    stray = [r for r in range(first, first + bM) if not cu[b] <= r < cu[b + 1] and r < cu[-1]]
    owners = sorted({next(i for i in range(len(seqs)) if cu[i] <= r < cu[i + 1]) for r in stray})
    beyond = first + bM - max(cu[-1], first)
    print(
        f"sequence {b}: last tile rows {first}-{first + bM - 1}; "
        + (
            f"rows {stray[0]}-{stray[-1]} belong to sequence(s) {owners}"
            if stray
            else "no stray rows"
        )
        + (f"; {beyond} rows past the tensor (clipped)" if beyond > 0 else "")
    )

# Exercise 5: what differs between the batch-mode and the packed kernel.
batch_r, packed_r = (
    nb.compile_report(7, "hopper"),
    nb.compile_report(7, "hopper", options=dict(varlen=True)),
)
if batch_r is not None and packed_r is not None:
    for k in batch_r.counts:
        if batch_r.counts[k] != packed_r.counts[k]:
            print(f"{k}: batch {batch_r.counts[k]}, packed {packed_r.counts[k]}")
    regs = (nb.cubin_registers(batch_r.cubin), nb.cubin_registers(packed_r.cubin))
    print(f"registers per thread: batch {regs[0]}, packed {regs[1]}")

# Exercise 6: GQA 32/8 against MHA at B * S = 16k, S = 8k, D = 128 (GPU mode).
if nb.MODE == "gpu" and nb.available(7, nb.TRACK):
    from common.tools import inputs

    mod7 = stage_table.track_module(7, nb.TRACK)
    q8, _, _ = inputs.attention_inputs(2, 32, 8192, 8192, 128, seed=1)
    _, k8, v8 = inputs.attention_inputs(2, 8, 8192, 8192, 128, seed=2)
    _, k32, v32 = inputs.attention_inputs(2, 32, 8192, 8192, 128, seed=3)
    flops = reference.attention_flops(2, 32, 8192, 8192, 128)
    nb.measure_calls(
        7,
        {
            "stage 7 MHA 32/32": (lambda: mod7.attention(q8, k32, v32), flops),
            "stage 7 GQA 32/8": (lambda: mod7.attention(q8, k8, v8), flops),
        },
        title="S = 8k, D = 128",
    )
else:
    print("GQA timing needs GPU mode; the H200 figures are in section 7")

# %% [markdown]
# ### Exercise 7a: GQA is one TMA coordinate
#
# The first cell gives the task; the second compiles the stage file as it is on disk now for
# H = 32, Hkv = 8 (no GPU needed) and says "done" or "not yet" with the head coordinates of the
# TMA loads it read in the PTX. On the committed file it says "not yet".
#
# <details><summary>Answer</summary>
#
# Committed, the K and V loads take `div.s32` of `%ctaid.y` (the query head) by H / Hkv, the Q
# loads `%ctaid.y` itself. After the edit all loads take `%ctaid.y`. Query heads 1-7 then read
# KV heads 1-7 instead of h // 4 (their group's), and heads 8-31 ask TMA for KV heads 8-31 of a
# tensor that has 8: TMA fills a box outside the tensor with zeros, so S = 0, P is uniform and
# O = 0 for those heads. `make stage-7` fails on every GQA case.
# </details>

# %%
nb.exercise("7a")

# %%
nb.check_exercise("7a")

# %% [markdown]
# **Next:** `make diff-8` shows what stage 8 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage8_warp_specialized.ipynb`](stage8_warp_specialized.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage7.md`](../docs/notes/stage7.md).
