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
# # Stage 5 - online softmax: one pass, O rescaled, the log-sum-exp
#
# This notebook walks through `stages/stage5_online_softmax/hopper.py` and
# `stages/stage5_online_softmax/blackwell.py`: the FlashAttention-2 forward pass on the skeleton and
# the K/V ring of stage 4. Stage 4's statistics pass disappears; K is read once. The notebook
# imports the stage files and displays them; it never pastes kernel code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage5_online_softmax.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; the compile
# summaries of both tracks appear in both modes. Source:
# `notebooks/source/stage5_online_softmax.py`.

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
from notebooks.figures import stage5 as figures  # noqa: E402

nb.start(5)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - run the online softmax update by hand: running max $m$, rescale factor $\alpha$, running sum
#   $\ell$, and the rescaled output $O$;
# - map the notation to the code once and for all: $m$ = `row_max`, $\ell$ = `row_sum`,
#   $\alpha$ = `row_scale`;
# - say where the rescale happens: in registers on Hopper, in TMEM (load, multiply, store) on
#   Blackwell, and who waits for whom around it;
# - produce the log-sum-exp per row, and say what it is for;
# - measure the speed-up over stage 4 and explain why it need not be the 1.5x of the matrix work.
#
# ## 2. Previous stage recap
#
# Stage 4 handled any key length with one shared-memory ring for K and V (on Hopper $V_j$
# overwrites $K_j$ in its slot, after the MMA reading $K_j$ has completed and released it; on
# Blackwell every load is its own ring entry). Its softmax was exact in two passes: pass 1 swept
# the K tiles for the row max and row sum (already with the online update of $m$ and $\ell$, on
# two scalars per row), pass 2 swept K and V again and accumulated final probabilities into O. The
# price was a second $QK^{\top}$ (1.5x the matrix work) and a second exponential per score.
#
# ## 3. The math, step by step
#
# Process the KV tiles once. For one row, with $x = \text{scale}\cdot S$ and tile $j$ (`kv_tile`):
#
# $$m_j = \max\big(m_{j-1},\ \max_{k\in j} x_k\big), \qquad
# \alpha_j = e^{\,m_{j-1} - m_j},$$
# $$\ell_j = \alpha_j\,\ell_{j-1} + \sum_{k\in j} e^{\,x_k - m_j}, \qquad
# O_j = \alpha_j\,O_{j-1} + \sum_{k\in j} e^{\,x_k - m_j}\,V_k,$$
#
# starting from $m_{-1} = -\infty$, $\ell_{-1} = 0$, $O_{-1} = 0$ (so $\alpha_0 = 0$). At the end
# $O = O_{n-1} / \ell_{n-1}$ and $\text{LSE} = m_{n-1} + \ln \ell_{n-1}$. Every term of $O_j$ and
# $\ell_j$ is relative to the current max $m_j$: whenever a tile raises the max, everything
# accumulated so far is multiplied by $\alpha_j < 1$ to move it to the new reference. The kernel
# does the same with powers of two: $\alpha = 2^{(M_{\text{old}} - M_{\text{new}})\,s_2}$ on the
# unscaled max $M$, $s_2$ = `scale_log2` $= \text{scale}\cdot\log_2 e$.
#
# A small example on the CPU: 2 rows, 12 keys in tiles of 4 (tiles 0, 1, 2), a head dim of 2.
# `online_attention` is the update above, written once; the table shows each step for row 0.


# %%
def online_attention(x, v, tile, show=False, rescale_o=True):
    """softmax(x) @ v and the LSE of each row by the online update, one tile of keys at a time
    (x: rows x keys, already scaled; fp64 on the CPU). rescale_o=False forgets alpha on O."""
    rows = x.shape[0]
    m = torch.full((rows,), -torch.inf, dtype=x.dtype)  # row_max
    l = torch.zeros(rows, dtype=x.dtype)  # row_sum
    o = torch.zeros(rows, v.shape[1], dtype=x.dtype)  # O, not yet divided by l
    if show:
        print(
            f"{'tile':>4} | {'m_old':>7} {'m_new':>7} {'alpha':>7} | {'l':>8} | O (row 0, unnormalised)"
        )
    for j, j0 in enumerate(range(0, x.shape[1], tile)):
        xj = x[:, j0 : j0 + tile]
        m_new = torch.maximum(m, xj.amax(-1))
        alpha = torch.exp(m - m_new)  # row_scale; 0 on the first tile
        p = torch.exp(xj - m_new[:, None])  # not divided
        l = alpha * l + p.sum(-1)
        o = (alpha[:, None] if rescale_o else 1.0) * o + p @ v[j0 : j0 + tile]
        if show:
            print(
                f"{j:>4} | {m[0]:7.3f} {m_new[0]:7.3f} {alpha[0]:7.4f} | {l[0]:8.4f} | "
                + ", ".join(f"{val:+.4f}" for val in o[0].tolist())
            )
        m = m_new
    return o / l[:, None], m + torch.log(l)


torch.manual_seed(1)
rows, Sk, D, tile = 2, 12, 2, 4
x = torch.randn(rows, Sk, dtype=torch.float64) * 1.5  # x = scale * Q K^T, already scaled
x[0, 4:8] += 2.0  # tile 1 raises row 0's max
v = torch.randn(Sk, D, dtype=torch.float64)
out, lse = online_attention(x, v, tile, show=True)
ref = torch.softmax(x, -1) @ v
print(
    f"max |O / l - softmax(x) V| = {(out - ref).abs().max():.2e}, "
    f"max |LSE - logsumexp(x)| = {(lse - torch.logsumexp(x, -1)).abs().max():.2e}"
)

# %%
fig = figures.online_softmax_trace(x[0].tolist(), tile=tile)

# %% [markdown]
# ## 4. What changes
#
# The docstring gives the changes with their numbers; then the diff of the kernel class against
# stage 4 (`make diff-5 TRACK=hopper` shows the whole files): pass 1 disappears, `softmax` with
# final statistics gives way to `online_softmax` plus a rescale of O, the division moves to the
# epilogue, and LSE is written.

# %%
nb.show_docstring(5, "hopper")

# %%
nb.show_diff(5, "hopper")

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 One pass through the ring
#
# Same ring as stage 4 (step t uses slot t % `kv_slots`, $K_j$ then $V_j$ in the same slot), but
# each K tile is loaded once. The model timelines of stage 5 and stage 4, on one time axis
# (durations illustrative, not measured):

# %%
cfg = nb.show_config(5, "hopper")
kv_slots = cfg.get("kv_slots", 2)
fig = figures.kv_slot_timelines(
    [
        dict(kv_tiles=4, kv_slots=kv_slots, two_pass=False),
        dict(kv_tiles=4, kv_slots=kv_slots, two_pass=True),
    ],
    suptitle="Stage 5 (top) and stage 4 (bottom), the same 4 KV tiles on one time axis (model)",
)

# %% [markdown]
# ### 5.2 The update in registers
#
# `online_softmax` (shared with stage 4's pass 1) folds an S tile into `row_max` and `row_sum` and
# returns `row_scale`; `rescale_o_and_convert_p`, which `mma_one_n_block` calls for each KV tile,
# multiplies the O accumulator by it before adding $P_jV_j$ (the method exercise 5a edits).
# A thread holds $D/2$ registers of O, 2 rows of $D/4$ each, so that is $D/2$ multiplies per
# thread (64 at D = 128; exercise 5a reads them in the PTX) and one `exp2` per row per tile. The
# row max is reduced across the quad at once (all 4 threads must subtract the same max); the row
# sum stays a per-thread partial sum until the epilogue, because the rescale factor is the same
# for the 4 threads of a row. `acc_O` is never
# initialised: the first PV wgmma runs with `ACCUMULATE` off and overwrites whatever the first
# rescale (by $\alpha_0 = 0$) left in it (exercise 2).

# %%
nb.show_source(
    5, "hopper", names=["Sm90Kernel.online_softmax", "Sm90Kernel.rescale_o_and_convert_p"]
)

# %%
nb.show_source(5, "hopper", section="# 2.")

# %% [markdown]
# ### 5.3 The epilogue: O / l and the log-sum-exp
#
# $O / \ell$ once per output element, then the LSE per row:
# $\ln\ell + m\cdot\text{scale} = (m\,s_2 + \log_2\ell)\ln 2$. The LSE is what a backward pass needs
# to recompute P without storing it, and what lets partial results over key ranges be combined
# (exercise 3).

# %%
nb.show_source(5, "hopper", section="# 3.")

# %% [markdown]
# ### 5.4 What the compiler produced
#
# The Hopper kernel for sm_90a (both modes). Exercise 4 compares its instruction counts with
# stage 4's.

# %%
report = nb.compile_summary(5, "hopper")

# %% [markdown]
# ### 5.5 The same stage on Blackwell
#
# The machine model is stage 1's (section 5.8), the TMEM plan and the warp roles stage 3's, the
# ring stage 4's (one entry per load). What stage 5 changes is **where O is rescaled**: O lives in
# TMEM, so the softmax warps `tcgen05.ld` their row of O (32 columns at a time), multiply it by
# `row_scale` and `tcgen05.st` it back. That has to happen after $PV_{j-1}$ has completed (O is
# final up to tile j - 1, and P's columns are free) and before $PV_j$ starts; three mbarriers
# order it, as the picture shows. Faster Blackwell kernels (FA4) hand this job to a separate
# *correction* warpgroup (four warps; stage 8 here) and skip the rescale when the max barely
# moves (exercise 5; stage 10 here); this stage keeps it in the softmax warps.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors and their PTX is checked for the
# `tcgen05` instructions. Their numerics are tested only where an sm_100 GPU exists.

# %%
fig = figures.o_rescale_handoff()

# %%
bw = nb.kernel_config(5, "blackwell")
fig = figures.kv_slot_timeline(
    kv_tiles=4, kv_slots=bw.get("kv_slots", 2), two_pass=False, slot_per="entry"
)

# %%
nb.show_docstring(5, "blackwell")
nb.show_diff(5, "blackwell")

# %%
rows = nb.cross_track_table(5)
report_bw = nb.compile_summary(5, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** O within 3x PyTorch's own bf16 attention error against the fp64 reference (a few
# $10^{-3}$ relative; the table prints this run's error next to PyTorch's own), and the LSE
# (fp32, natural log) within $10^{-4}$ relative of the fp64 log-sum-exp - it comes from fp32
# statistics, so its error is $10^{-6}$ or less (the table prints this run's); a wrong base
# ($\log_2$ instead of $\ln$) or a missing scale would be off by far more. The table prints both
# bounds; the error map shows the (b, h) slice holding O's worst element.

# %%
result = nb.run_and_verify(5, (2, 4, 512, 1024, 128))

# %%
fig = nb.error_picture(5, result)

# %% [markdown]
# ## 7. Measure
#
# Stage 5 against stage 4 and the baselines, the same shapes and inputs, timed in the same run.
# **Expected:** per KV tile stage 5 runs 2 MMA batches where stage 4 ran 3, so counting the matrix
# work alone the speed-up would be 1.5x at any lengths. But stage 4 also exponentiates every score
# twice, reads K twice and waits for each $V_j$ after $QK_j$ with only one softmax to hide it;
# where those costs weigh, the measured speed-up can exceed 1.5x, and where per-tile fixed costs
# dominate (short sequences) it falls below. `make bench` (H200, 2026-11-29,
# `docs/results/bench_h200_2026-11-29.md`) measured stage 5 at 435 / 491 / 524 TFLOP/s at
# S = 1k / 4k / 8k, D = 128: 1.36x / 1.36x / 1.43x stage 4, and up to 1.63x at D = 64, S = 2k;
# above SDPA flash (336 / 347 / 345) and below cuDNN and FA4 (589-711) in the same run. The
# ablation run of 2026-12-04 on the H200 (`docs/results/ablation_h200_2026-12-04.md`, no stage 4)
# measured stage 5 at 513 at S = 8k, D = 128. Stage 5 is FlashAttention-2's algorithm without
# FlashAttention-3's scheduling (warp specialisation, ping-pong warpgroups, softmax overlapped
# with the next $QK^{\top}$). The table below is this run - its numbers, not the quoted ones, are
# the comparison - and the cell after it prints this run's speed-up over stage 4.

# %%
bench = nb.measure(
    5,
    [(16, 16, 1024, 1024, 128), (4, 16, 4096, 4096, 128), (2, 16, 8192, 8192, 128)],
    also_stages=(4,),
)

# %%
if bench:
    for shape, res in bench.items():
        if "stage 4" in res:
            print(
                f"{shape}: stage 5 / stage 4 = {res['stage 5'] / res['stage 4']:.2f}x "
                "(1.5x from the matrix work alone)"
            )
else:
    print("no measurement in this mode: see the make bench numbers above")

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook.
#
# 1. **Forget alpha.** In the CPU example of section 3, drop the rescale of O
#    (`online_attention(x, v, tile, rescale_o=False)`). Which rows go wrong, and by how much? When
#    would the mistake be invisible?
# 2. **First tile.** Neither kernel initialises O: `acc_O` (Hopper) holds whatever its registers
#    held, O in TMEM whatever its columns held. On the first tile the Hopper kernel still
#    multiplies `acc_O` by $\alpha_0 = 2^{-\infty} = 0$ - and 0 x Inf or 0 x NaN is NaN. Why is
#    the result right anyway? (Look at what the first PV MMA does with `ACCUMULATE`.) What would
#    go wrong if the first PV accumulated, and why does the Blackwell kernel skip the rescale of
#    O on the first tile?
# 3. **Combining with the LSE.** Split the keys into two halves, run the online softmax on each to
#    get $(O_a, \text{LSE}_a)$ and $(O_b, \text{LSE}_b)$, and combine them with weights
#    $e^{\text{LSE}_a - \text{LSE}}$, $e^{\text{LSE}_b - \text{LSE}}$ where
#    $\text{LSE} = \text{logaddexp}(\text{LSE}_a, \text{LSE}_b)$. Why is that exact?
# 4. **Instruction counts.** Compare `ex2.approx` and `wgmma.mma_async` in the compile summaries of
#    stage 5 (5.4) and stage 4 (`nb.compile_summary(4, "hopper")`). Which difference explains the
#    speed-up?
# 5. **Blackwell.** The Blackwell rescale reads and writes all of O in TMEM on every tile. FA4 skips
#    it unless the max grew by more than a threshold. Why is that still exact at the end?
# 6. **Forget alpha in the kernel** (exercise 5a, an edit of the Hopper stage file): exercise 1 on
#    the real kernel. The cells at the end of the notebook give the task and check the edit.
#
# ### Answers and checks
#
# <details><summary>1. Forget alpha</summary>
#
# Both rows: each one's max grows at tile 1 (row 0's by construction, row 1's by chance), so its
# tile-0 contribution to O stays weighted against the old max, too large by $e^{m_1 - m_0}$, while
# $\ell$ is rescaled - the cell below prints the tile maxima and the error per row. The mistake is
# invisible for a row whose max is reached in its first tile (every later $\alpha = 1$), which is
# why a test needs inputs whose max moves.
# </details>
#
# <details><summary>2. First tile</summary>
#
# The first PV MMA runs with `ACCUMULATE` off (Hopper sets it off before the loop; Blackwell sets
# it to "tile index != 0"), so it overwrites O instead of adding to it: whatever the rescale by 0
# produced, NaN included, is discarded. If it accumulated, O would start from garbage x 0 - NaN
# wherever the memory held Inf or NaN. On Blackwell the rescale is a TMEM load, multiply and store
# per 32 columns; on the first tile it would only move garbage, so it is skipped.
# </details>
#
# <details><summary>3. Combining with the LSE</summary>
#
# $O_a = \sum_{k\in a} e^{x_k - \text{LSE}_a} V_k$, so $e^{\text{LSE}_a - \text{LSE}}\,O_a =
# \sum_{k\in a} e^{x_k - \text{LSE}} V_k$ - the full softmax's share of half a; the two halves add
# up to the whole. The cell below does it with `online_attention`.
# </details>
#
# <details><summary>4. Instruction counts</summary>
#
# The cell below counts them: stage 5 drops pass 1's D / 16 = 8 QK `wgmma` (a third of stage 4's
# 24) and its 64 exponentials per thread per tile (about half of stage 4's). Both shrink the time
# per tile; which matters more depends on whether the tensor cores or the exponentials bound it.
# </details>
#
# <details><summary>5. Blackwell</summary>
#
# O and $\ell$ are both accumulated relative to the same reference max, whatever it is; the
# epilogue's $O / \ell$ cancels it. Skipping the rescale only lets the reference lag behind the
# true max, which is safe as long as $e^{x - m_{\text{ref}}}$ stays small: P is rounded to bf16 or
# fp16 for the PV MMA (fp16 overflows above 65,504) and O and $\ell$ grow in fp32 - hence the
# threshold.
# </details>

# %%
# Exercise 1: the rescale of O forgotten.
print("max of each tile, per row:", x.reshape(x.shape[0], -1, tile).amax(-1).tolist())
wrong, _ = online_attention(x, v, tile, rescale_o=False)
print("max |error| per row without alpha on O:", (wrong - ref).abs().amax(-1).tolist())

# Exercise 3: two halves of the keys, each through the online update, combined with their LSEs.
o_a, lse_a = online_attention(x[:, :6], v[:6], tile)
o_b, lse_b = online_attention(x[:, 6:], v[6:], tile)
lse_ab = torch.logaddexp(lse_a, lse_b)
o_ab = torch.exp(lse_a - lse_ab)[:, None] * o_a + torch.exp(lse_b - lse_ab)[:, None] * o_b
print(
    f"max |combined - full| = {(o_ab - ref).abs().max():.2e}, "
    f"max |LSE_ab - LSE| = {(lse_ab - lse).abs().max():.2e}"
)

# Exercise 4: instruction counts of stages 4 and 5 (Hopper).
for st in (4, 5):
    r = nb.compile_report(st, "hopper")
    if r is not None:
        print(
            f"stage {st}: wgmma.mma_async {r.counts['wgmma.mma_async']}, "
            f"ex2.approx {r.counts['ex2.approx']}"
        )

# %% [markdown]
# ### Exercise 5a: forget alpha in the kernel
#
# The first cell gives the task; the second compiles the stage file as it is on disk now (no GPU
# needed) and says "done" or "not yet" with the PTX counts it read. On the committed file it says
# "not yet". The line `acc_O_mn = self.rows_view(acc_O)` stands in `epilogue` too, where the two
# lines after it divide O by the row sum: leave those.

# %%
nb.exercise("5a")

# %%
nb.check_exercise("5a")

# %% [markdown]
# **Next:** `make diff-6` shows what stage 6 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage6_masks.ipynb`](stage6_masks.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage5.md`](../docs/notes/stage5.md).
