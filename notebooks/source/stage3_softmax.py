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
# # Stage 3 - softmax over one KV tile: row reductions in the accumulator layout, P in registers
#
# This notebook walks through `stages/stage3_softmax/hopper.py` and
# `stages/stage3_softmax/blackwell.py`: full attention
# $O = \text{softmax}(\text{scale}\cdot QK^{\top})V$ for a key length that fits in one KV
# tile ($S_k \le 128$). It imports the stage files and displays them; it never pastes kernel
# code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage3_softmax.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; the compile
# summaries of both tracks appear in both modes. Source: `notebooks/source/stage3_softmax.py`.

# %%
import math
import os
import sys

import torch

# The repository root (it holds `common` and `stages`): the first folder upwards that has `common`.
ROOT = os.getcwd()
while not os.path.isdir(os.path.join(ROOT, "common")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from common.tools import notebook as nb  # noqa: E402
from notebooks.figures import stage3 as figures  # noqa: E402

nb.start(3)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - compute a row max and a row sum over the `wgmma` accumulator layout, where a row is spread over
#   the 4 threads of a quad (2 butterfly shuffles);
# - replace `exp` by `exp2` with $\log_2 e$ folded into the scale (one FFMA and one `ex2.approx`
#   per score): the kernel takes `scale_log2` $= \text{scale}\cdot\log_2 e$;
# - explain why P never leaves the registers on Hopper: the accumulator fragment of $S$ *is* the A
#   operand fragment of the next `wgmma`;
# - build the second GEMM's B operand: V^T viewed over the very bytes of the V tile (`sVt`,
#   "MN-major"), and read the `__call__` that builds the PV MMA;
# - say what the Blackwell kernel does instead: one thread per row reads S from TMEM, writes P back
#   over S in TMEM, and the MMA reads P from TMEM.
#
# ## 2. Previous stage recap
#
# Stage 2 computed $S = \text{scale}\cdot QK^{\top}$ per (batch, head) with one CTA per 128-row Q
# tile: Q loaded once and resident in shared memory, K tiles streaming through `kv_slots` slots,
# rank-4 TMA views with dynamic extents, S written to global memory in fp32 - and we saw that
# writing S makes the kernel memory-bound. Stage 3 keeps S on chip and consumes it.
#
# ## 3. The math
#
# For one row i of one (batch, head), with $x_j = \text{scale}\cdot S_{ij}$:
#
# $$m_i = \max_j x_j, \qquad \ell_i = \sum_j e^{x_j - m_i}, \qquad
# P_{ij} = \frac{e^{x_j - m_i}}{\ell_i}, \qquad O_i = \sum_j P_{ij} V_j.$$
#
# Subtracting $m_i$ changes nothing mathematically ($\text{softmax}(x) = \text{softmax}(x - c)$)
# but keeps every exponent $\le 0$, so nothing overflows. In code, $m$ is `row_max` and $\ell$ is
# `row_sum`. The exponential is computed as a power of two, with the scale and $\log_2 e$ folded
# into one constant $s_2 = \text{scale}\cdot\log_2 e$ (`scale_log2`, computed once on the host and
# passed to the kernel):
#
# $$e^{\text{scale}(S_{ij} - M_i)} = 2^{\,S_{ij} s_2 - M_i s_2}, \qquad M_i = \max_j S_{ij},$$
#
# one fused multiply-add and one `ex2.approx` per score. The max can be taken on the unscaled S
# because scale > 0. Finally the normalisation by $\ell_i$ is done once per output element at the
# end (one reciprocal `rcp.approx` and $D$ multiplies per row) instead of once per probability
# ($S_k$ per row).

# %%
# The identities above, on the CPU in fp32.
torch.manual_seed(0)
D = 128
scale = D**-0.5
scale_log2 = scale * math.log2(math.e)
S = torch.randn(4, 128) * 1000  # logits of a few hundred after scaling, on purpose
naive = torch.exp(scale * S) / torch.exp(scale * S).sum(-1, keepdim=True)
M = S.amax(-1, keepdim=True)
P = torch.exp2(S * scale_log2 - M * scale_log2)  # what the kernel computes
stable = P / P.sum(-1, keepdim=True)
ref = torch.softmax(scale * S.double(), -1)
print(f"max |stable - softmax| = {(stable - ref).abs().max():.2e}")
print(
    f"exp(scale * S) overflows in fp32 for scale * S > 88.7: here max(scale * S) = "
    f"{(scale * S).max():.1f}, naive has {int((~torch.isfinite(naive)).sum())} non-finite entries"
)

# %% [markdown]
# ## 4. What changes
#
# The stage file's docstring gives the changes with their numbers; below it, the diff of the
# kernel class against stage 2 (`make diff-3 TRACK=hopper` shows the whole files).

# %%
nb.show_docstring(3, "hopper")

# %%
nb.show_diff(3, "hopper")

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 A row lives in a quad: the row max and row sum
#
# Each warpgroup owns 64 rows of the 128 x 128 S tile as a 64 x 128 `wgmma` accumulator: lane t
# (0-31) of warp w holds rows $16w + \lfloor t/4\rfloor$ and that $+8$, 32 columns of each (pairs of
# neighbours every 8 columns; stage 1, section 5.5). The 4 threads of a quad (lanes $4r \ldots 4r+3$)
# hold one row between them. So the row max is a max over the thread's own 32 values, then two
# butterfly shuffles inside the quad: exchange with lane XOR 2, then with lane XOR 1 (the order of
# `cute.arch.warp_reduction`). After that all four lanes hold the row's max; no shared memory,
# no barrier. The row sum is reduced the same way.

# %%
fig = figures.quad_reduction(op="max")

# %% [markdown]
# The softmax in the stage file: `rows_view` regroups the accumulator registers as (rows,
# columns) of this thread, and `warp_reduction_max(..., threads_in_group=4)` is the pair of
# shuffles. The loops over the thread's 2 rows are `cutlass.range_constexpr`: unrolled while
# tracing (stage 1's box *trace time and run time*), so the PTX holds straight-line code.

# %%
nb.show_source(3, "hopper", names=["Sm90Kernel.rows_view", "Sm90Kernel.softmax"])

# %% [markdown]
# ### 5.2 P stays in registers
#
# The second GEMM is $O = PV$ with P as the A operand. `wgmma` can take A from registers, in a
# fixed fragment layout: for a 64 x 16 block of A, lane t of warp w holds rows $16w + \lfloor t/4\rfloor$
# and $+8$, columns $2(t \bmod 4) + \{0,1,8,9\}$. That is exactly where the same thread's
# accumulator values of S sit for those 16 keys. So no data moves between threads: the kernel
# rounds P to bf16 and *views* the accumulator as the A operand (`acc_as_operand_a`). The picture
# shows one thread's values in both roles, for the first two 16-key blocks.

# %%
fig = figures.p_register_path(n=32, thread=5)

# The two fragments agree for every thread and every 16-key block (CuTe's atom layouts).
n = 128
for t in range(128):
    c_frag = {(r, c): v for v, r, c in figures.wgmma_c_coords(t, n)}
    for j in range(n // 16):
        for v, r, k in figures.wgmma_a_coords(t):
            assert c_frag[(r, 16 * j + k)] == 8 * j + v
print("for all 128 threads: A value v of k-block j is accumulator register 8 j + v")
nb.show_source(3, "hopper", names=["Sm90Kernel.acc_as_operand_a"])

# %% [markdown]
# ### 5.3 The second GEMM's B operand: V^T over the same bytes
#
# In $O = PV$ the MMA's M is the query rows, N is D and K is the keys, so its B operand is an
# (N, K) = (D, keys) matrix: $V^{\top}$. TMA brings a V tile exactly as it brings a K tile - keys
# as rows, D contiguous, 128-byte swizzle - into the next slot of the ring. No transpose is
# needed: `sVt` is a second view of the same bytes with the two modes swapped, and since its
# contiguous mode is now N (= D), `wgmma` is told B is **MN-major** (`LayoutEnum.COL_MAJOR` in
# CuTe's terms, the "transposed" B mode of `wgmma`) and reads it transposed for free. In the code:
# `vt_smem_layout = make_smem_layout_b(LayoutEnum.COL_MAJOR, (bM, bK, bN), ...)` builds the
# (D, keys, kv_slots) layout, and `sVt = cute.make_tensor(cute.recast_ptr(sKV.iterator,
# vt_smem_layout.inner), vt_smem_layout.outer)` lays it over the ring's bytes.

# %%
fig = figures.vt_operand(keys=8, dims=8)

# %% [markdown]
# `__call__` builds the two MMAs. The QK MMA is stage 2's. The PV MMA has `a_source=RMEM` (A = P
# from registers, section 5.2), B = V^T MN-major (`LayoutEnum.COL_MAJOR.sm90_mma_major_mode()`),
# and `tiler_mn=(64, bK)`: each warpgroup computes 64 rows x D columns of O.

# %%
nb.show_source(3, "hopper", names=["Sm90Kernel.__call__"])

# %% [markdown]
# ### 5.4 The main loop, masking and the epilogue
#
# One KV tile: wait for Q and K, $S = QK^{\top}$, mask keys beyond $S_k$ with $-\infty$ (they get
# weight $2^{-\infty} = 0$), softmax, wait for V, $O = PV$, then $O / \ell$ in the epilogue. The
# first PV wgmma runs with `ACCUMULATE` off, so `acc_O` needs no initialisation.

# %%
nb.show_source(3, "hopper", section="# 2.")
nb.show_source(3, "hopper", names=["Sm90Kernel.mask_keys"])

# %%
nb.show_source(3, "hopper", section="# 3.")

# %% [markdown]
# ### 5.5 What the compiler produced
#
# The Hopper kernel for sm_90a (both modes). The exercises count its `shfl.sync.bfly` and
# `ex2.approx` instructions and compare its registers with the docstring's budget.

# %%
report = nb.compile_summary(3, "hopper")

# %% [markdown]
# ### 5.6 The same stage on Blackwell
#
# The machine model is stage 1's (section 5.8). What stage 3 changes in it, and this is where the
# tracks differ most: **S, P and O all live in TMEM.** Thread t of softmax warp w owns row
# $32w + t$: four `tcgen05.ld.32x32b.x32` (32 columns each) bring its whole row of S into 128
# registers, so the row max and
# sum are per-thread loops - no shuffles. P is written back into TMEM *over S* with `tcgen05.st`
# (two bf16 per 32-bit column, so 64 columns), and the MMA warp issues `tcgen05.mma` with A = P
# from TMEM (`OperandSource.TMEM`) and B = V from shared memory, accumulating O in TMEM. New
# hand-offs join the mbarriers of stage 2: *P ready* (softmax warps -> MMA) and *O ready*
# (MMA -> epilogue). The picture of TMEM takes its column offsets from the stage file's
# `Sm100Kernel`; stages 4 and 5 keep this plan.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors and their PTX is checked for the
# `tcgen05` instructions. Their numerics are tested only where an sm_100 GPU exists.

# %%
fig = figures.blackwell_warp_roles(stage=3)
fig = nb.show_tmem(3, head_dim=128, block_n=128)

# %%
nb.show_docstring(3, "blackwell")
nb.show_diff(3, "blackwell")

# %%
rows = nb.cross_track_table(3)
report_bw = nb.compile_summary(3, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# P is rounded to bf16 before the second GEMM and O is rounded to bf16 at the end, like PyTorch's
# own bf16 attention. **Expected:** a relative error of a few $10^{-3}$, at most 3x the error of
# PyTorch's bf16 SDPA (`torch.nn.functional.scaled_dot_product_attention`, its math backend)
# against the same fp64 reference, and below $10^{-2}$; the table prints this run's error and the
# bound used. The error map shows the (b, h) slice holding the worst element; a correct kernel's
# map is uniform rounding noise.

# %%
result = nb.run_and_verify(3, (2, 4, 512, 128, 128))

# %%
fig = nb.error_picture(3, result)

# %% [markdown]
# ## 7. Measure
#
# Attention FLOPs are $4BHS_qS_kD$ (two GEMMs). With $S_k = 128$ each CTA does a single KV tile,
# so the kernel is dominated by reading Q and writing O, not by the tensor cores; torch SDPA (flash
# and cuDNN backends) is timed on the same inputs in the same run. **Expected:** a few hundred
# TFLOP/s at most for every kernel here - the point of this stage is correctness, stages 4 and 5
# bring long sequences. The table below is this run; its last
# column is stage 3's speed over each kernel.

# %%
bench = nb.measure(3, [(16, 32, 4096, 128, 64), (16, 16, 4096, 128, 128)])

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook.
#
# 1. **Shuffles.** In `quad_reduction`, which lanes exchange values in the first and in the second
#    shuffle? Why would the other order (XOR 1 first, then XOR 2) give the same result? Count the
#    `shfl.sync.bfly` instructions in the compile summary of 5.5: how many do you expect?
# 2. **exp vs exp2.** Count the `ex2.approx` instructions in the compile summary of 5.5. How many
#    per thread per KV tile do you expect, and how many extra multiplies would plain `exp` of
#    `scale * (S - m)` cost?
# 3. **Too long.** Call the entry with $S_k = 129$ on a GPU: what does the error message say, and
#    why is refusing better than computing a wrong answer?
# 4. **Registers.** The docstring lists S 64 + O 64 + P 32 fp32-sized registers per thread at
#    D = 128. That adds up to 160, yet the compile summary reports fewer registers in all. Which of
#    the three are live at the same time? What would a 256-key tile cost? Compile it without
#    editing the file: `nb.compile_summary(3, "hopper", settings=dict(cta_tile=(128, 256, 128)))`.
# 5. **Blackwell.** Why does the Blackwell softmax need no shuffles? What does it pay instead
#    (registers per thread for one row of 128 scores)?
#
# ### Answers and checks
#
# <details><summary>1. Shuffles</summary>
#
# First lane i with i XOR 2 (0<->2, 1<->3), then with i XOR 1 (0<->1, 2<->3). Max and sum are
# associative and commutative, and after both steps every lane has combined all four partial
# values whatever the order. Expected: 2 rows x (2 for the max + 2 for the sum) = 8
# `shfl.sync.bfly` per thread; the cell below counts them (other `shfl.sync` in the summary are
# `shfl.sync.idx` broadcasts, not reductions).
# </details>
#
# <details><summary>2. exp vs exp2</summary>
#
# Each thread holds 2 rows x 32 columns = 64 scores of a KV tile, one `ex2.approx` each: 64 (the
# cell below counts them). `exp(scale * (s - m))` costs a subtraction, a multiply by scale and,
# inside `exp`, a multiply by log2 e before the same `ex2`: one FFMA with `scale_log2` replaces
# all three, saving about 2 operations per score (128 per thread per tile).
# </details>
#
# <details><summary>3. Too long</summary>
#
# `checks.check_max` raises a ValueError naming `Sk = k.shape[2]`, the limit 128 and why (one KV
# tile), and points to stage 4. The kernel would otherwise read only the first 128 keys and return
# a plausible-looking but wrong O.
# </details>
#
# <details><summary>4. Registers</summary>
#
# S (64) is dead once P (32) has been formed from it, and O (64) is written only by the PV wgmma,
# which starts after that: at most S + P or P + O are live at once, about 96, plus addresses,
# descriptors and the 2 + 2 softmax statistics - hence the 124 ptxas reports (CUDA 13.0,
# 2026-12-07, the docstring), not 160. A 256-key tile doubles S and P (128 + 64 per thread) and
# the K and V slots (64 KiB each): the variant's summary (198 registers, 161 KiB; ptxas of CUDA
# 13.0, 2026-12-07) shows how close that comes to the 255 registers a thread may have and to the
# 227 KiB of shared memory (and the entry would still refuse Sk > 128 until its check follows the
# tile).
# </details>
#
# <details><summary>5. Blackwell</summary>
#
# With `tcgen05.ld.32x32b` each thread receives one whole row (one TMEM lane), so its max and sum
# are loops over its own registers. The price: the whole row in registers, 128 fp32 per thread for
# the scores (the compile summary of the Blackwell kernel shows its total), against 64 on Hopper.
# </details>

# %%
# Exercises 1 and 2: count the instructions in the Hopper kernel's PTX.
ptx = report.ptx if report is not None else ""
print("shfl.sync.bfly:", sum("shfl.sync.bfly" in ln for ln in ptx.splitlines()))
print("ex2.approx:    ", sum("ex2.approx" in ln for ln in ptx.splitlines()))

# %% [markdown]
# ### Exercise 3a: wider TMEM loads (Blackwell)
#
# The first cell gives the task; the second compiles the stage file as it is on disk now (no GPU
# needed) and says "done" or "not yet" with what it read. It counts the tcgen05.ld in the PTX and
# reads their shape. On the committed file it says
# "not yet".

# %%
nb.exercise("3a")

# %%
nb.check_exercise("3a")

# %% [markdown]
# **Next:** `make diff-4` shows what stage 4 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage4_kv_interleave.ipynb`](stage4_kv_interleave.ipynb) walks through it.
# This stage's numbers: [`docs/results/README.md`](../docs/results/README.md) (stage 3 has no note).
