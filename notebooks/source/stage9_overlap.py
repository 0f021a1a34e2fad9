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
# # Stage 9 - overlap inside the loop: the next QK^T and the last PV issued together
#
# This notebook walks through `stages/stage9_overlap/hopper.py`: stage 8's kernel (producer
# warpgroup, two consumer warpgroups in ping-pong, every feature of stage 7) with
# FlashAttention-3's second speed technique, the *intra-warpgroup overlap*: each consumer
# warpgroup issues $QK_j$ and $PV_{j-1}$ together and runs the softmax of tile $j$ while $PV_{j-1}$
# is still on the tensor cores. The notebook imports the stage file and displays it; it never
# pastes kernel code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or `make notebooks`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; everything else (the
# pictures, the schedule model, the compile summaries) runs in both modes. Source:
# `notebooks/source/stage9_overlap.py`.

# %%
import json
import os
import sys

import cutlass
import torch

# The repository root (it holds `common` and `stages`): the first folder upwards that has `common`.
ROOT = os.getcwd()
while not os.path.isdir(os.path.join(ROOT, "common")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from common.tools import notebook as nb  # noqa: E402
from common.tools import stage_table  # noqa: E402
from common.tools.ptx import ptx_lines  # noqa: E402
from notebooks.figures import stage9 as figures  # noqa: E402

nb.start(9)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - write the software-pipelined loop of one consumer warpgroup: a prologue ($QK_{lo}$, softmax),
#   steps that issue $QK_j$ and $PV_{j-1}$ together and wait for them one at a time
#   (`wait_group 1`, then `wait_group 0`), and a last $PV$;
# - say which registers are live across the GEMMs now (S of tile $j$ being written, P of tile
#   $j-1$ being read, O) and why stage 8's 240-register budget is what makes it possible;
# - check that the ping-pong turns still balance when a turn is the pair ($QK_j$, $PV_{j-1}$);
# - read the timeline model before and after, and say what it predicts and why the measurement
#   disagrees with it;
# - put the measured step next to the FlashAttention-3 paper's ablation (582 -> 661 TFLOP/s);
# - say what stage 8's persistent CTAs, dynamic tile scheduler and third consumer warpgroup at
#   D = 64 do for this stage (section 7), and why short masks keep two.
#
# ## 2. Previous stage recap
#
# Stage 8 splits the CTA into a TMA producer warpgroup (24 registers per thread after
# `setmaxnreg.dec`) and two consumer warpgroups (240 registers), each owning 64 rows of the
# 128-row Q tile. The two consumers take turns on the tensor cores through named barriers 2 and 3:
# a turn is $PV_j$ with $QK_{j+1}$, issued back to back (one wait after both), so one warpgroup's
# softmax runs while the other's GEMMs hold the tensor cores. At D = 64 three consumer warpgroups (160 registers each) share a 192-row tile and
# the turns go round 1 -> 2 -> 3 (two under short masks). Inside one warpgroup, though, everything
# is serial: $QK_j$, wait (for $PV_{j-1}$ too), softmax$_j$, $PV_j$. Its exponentials never overlap
# its own GEMMs.
#
# ## 3. The math
#
# The loop computes, per KV tile $j$, $S_j = Q K_j^{\top}$, the online softmax
# $m_j = \max(m_{j-1}, \operatorname{rowmax} S_j)$, $P_j = \exp(s\,(S_j - m_j))$,
# $\ell_j = \ell_{j-1} e^{s(m_{j-1}-m_j)} + \operatorname{rowsum} P_j$, and
# $O_j = O_{j-1}\, e^{s(m_{j-1}-m_j)} + P_j V_j$. The dependencies are
# $S_j \to P_j \to O_j$, and $O_j$ needs $O_{j-1}$; but $S_{j+1}$ needs only $Q$ and $K_{j+1}$.
# So $QK_{j+1}$ can start before $P_j V_j$ has finished - or, shifted by one, step $j$ may issue
# $QK_j$ and then $PV_{j-1}$:
#
# $$\underbrace{QK_j,\ PV_{j-1}}_{\text{one turn}} \;\to\; \text{wait } QK_j \;\to\;
# \operatorname{softmax}_j \;\to\; \text{wait } PV_{j-1} \;\to\; O \mathrel{*}= e^{s(m_{j-1}-m_j)},\
# P_j = \operatorname{bf16}(\ldots).$$
#
# The operations on O keep their order (rescale by $e^{s(m_{j-1}-m_j)}$, then add $P_j V_j$), so the
# result is stage 8's bit for bit. The price is registers: while the two GEMMs run, $S_j$ (64 fp32
# per thread for a 64 x 128 tile), $P_{j-1}$ (64 bf16 = 32 registers) and $O$ ($D/2$ fp32) are all
# live, about 160 registers at D = 128 before addresses and statistics.

# %%
cfg = nb.show_config(9, "hopper")
bM, bN, D = cfg.get("cta_tile", (128, 128, 128))
rows_per_wg = bM // cfg.get("mma_warpgroups", 2)
kernel_class = stage_table.track_module(9, "hopper").Sm90Kernel
for D_ in (64, 128):
    k_ = kernel_class(cutlass.BFloat16, D_)  # the kernel object at this D (compiles nothing)
    rows_, keys_ = k_.cta_tile[0] // k_.mma_warpgroups, k_.cta_tile[1]
    s_regs, p_regs, o_regs = rows_ * keys_ // 128, rows_ * keys_ // 2 // 128, D_ // 2
    print(
        f"D = {D_}: S {s_regs} + P {p_regs} + O {o_regs} = {s_regs + p_regs + o_regs} registers "
        f"per thread live across the GEMMs, of the {k_.mma_registers} a consumer has "
        f"({k_.mma_warpgroups} consumer warpgroups)"
    )

# %% [markdown]
# ## 4. What changes
#
# The docstring gives the changes with their numbers; then the start of the kernel class's diff
# against stage 8 (`make diff-9 TRACK=hopper` shows the whole files). The consumer branch's loop is restructured
# into a prologue, the pipelined steps and a last PV; the GEMM issues and the softmax move into
# three small methods (`issue_qk`, `issue_pv`, `softmax_step`) because each is now called from two
# places. The loop over work tiles (persistent CTAs, the tile scheduler and order, O's own
# buffer) is stage 8's (its section 5.6; section 7 measures what it does here), so the diff does
# not show it. Second, the mask of an edge tile compares each
# element's column offset, a constant, against one interval per row (`mask_edges`, `mask_keys`;
# the same elements as stage 8). The CTA's shape is stage 8's: three consumer warpgroups on a
# 192-row Q tile at D = 64, two under short masks (section 7.2). Last, two changes that only the
# machine code shows (section 5.4): the GEMMs index the ring slot before the k-blocks, and at
# D = 128 the row max runs in four `fmax` chains (`quad_row_max`).

# %%
nb.show_docstring(9, "hopper")

# %%
nb.show_diff(9, "hopper", max_lines=120)

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The pipelined loop
#
# Three pieces: the prologue computes $S_{lo}$ alone (turn 0) and converts it to $P_{lo}$; each
# step issues $QK_j$ into `acc_S` (free again: $S_{j-1}$ already lives on as $P_{j-1}$ in `tOrP`) and
# $PV_{j-1}$ behind it as a second wgmma group, passes the turn, waits for the first group only
# (`wait_group(1)`: groups complete in order, so one pending group means $QK_j$ is done), runs the
# softmax, then waits for $PV_{j-1}$ (`wait_group(0)`) before rescaling O and overwriting `tOrP`.
# The last PV runs after the loop; `zero_rows` (packed sequences) stands before its turn, as in
# stage 8.

# %%
nb.show_source(9, "hopper", names=["Sm90Kernel.issue_qk", "Sm90Kernel.issue_pv"])

# %%
nb.show_source(
    9,
    "hopper",
    names=[
        "Sm90Kernel.first_half_block_overlap",
        "Sm90Kernel.mma_one_n_block",
        "Sm90Kernel.last_half_block_overlap",
    ],
)

# %% [markdown]
# ### 5.2 The turns still balance
#
# A turn is now ($QK_j$, $PV_{j-1}$); turn 0 is $QK_{lo}$ alone and the last turn $PV_{hi-1}$
# alone, so each warpgroup still takes `steps + 1` turns and barriers 2 and 3 complete `steps` and
# `steps + 1` times, as in stage 8. The schedule model replays the kernel's sequence of waits,
# passes and issues and counts (the tests also explore every interleaving of the two warpgroups):

# %%
for steps in (0, 1, 2, 5):
    r = figures.attention_schedule(True, steps, overlap=True)
    print(f"steps = {steps}: completions {r['turns']}, arrives left over {r['pending']}")

# %% [markdown]
# ### 5.3 Before and after, in the model
#
# The model of stage 8 with the durations of the FlashAttention-3 paper's H100 throughputs (989
# TFLOP/s of matrix multiply, 3.9 T exponentials/s) for this kernel's tile, counting only the
# exponentials of the softmax. Top: stage 8; bottom: stage 9.

# %%
fig = figures.pingpong_timelines(
    head_dim=D, block_n=bN, rows=rows_per_wg, steps=3, compare="stage 9"
)

# %% [markdown]
# In this model ping-pong alone already keeps the tensor cores busy: the tensor cores and the
# exponential units are its only shared resources, and a softmax of exponentials is about as long
# as one GEMM at D = 128, so the overlap gains about 1%. Making the softmax longer in the model
# (`exp_tflops` lower) does not change that much, because the exponential units, shared by the
# two warpgroups, then become the bound for both stages (exercise 4). The H200 measured +2% at
# D = 128, S = 8k non-causal, +6-9% causal from S = 4k and +4-7% at D = 64 from 2k to 8k
# (section 7, 2026-12-04): the gain comes from what the model leaves out - the latency between
# issuing
# a wgmma and its results (stage 8's warpgroup waits for $PV_j$ and $QK_{j+1}$ before its softmax,
# stage 9's only for $QK_j$), the FMA and ALU work of the softmax next to the exponentials (ncu on
# the H200, 2026-12-01, stage 9 at D = 128: XU pipe 39% busy, FMA 16%, ALU 18%), the barriers.
# Which of them carries the gain was not measured separately.

# %% [markdown]
# ### 5.4 What the compiler produced
#
# The Hopper kernel for sm_90a (both modes): stage 8's `.reqntid 384` and `setmaxnreg` at
# D = 128 (`.reqntid 512`, 24 / 160 at D = 64), twice
# the wgmma and `ex2.approx` of stage 8 (the prologue and the loop each hold a softmax and a
# QK^T; the loop and the last step each hold a PV), and `wgmma.wait_group 1` in the loop. The
# register count ptxas reports is the 168 of the kernel's entry; nvdisasm's count of the consumer
# code (H200 machine, 2026-12-01, bf16) is 184 registers in batch mode and 185 packed at D = 128,
# 158 and 165 at D = 64, against stage 8's 155, 170, 127 and 137: the second live S-sized set.
# (These counts predate the tile loop of 7.1 and the three warpgroups of 7.2; the stage file's
# docstring has the current ones: at D = 64, 156-157 of the 160 registers three consumer
# warpgroups get, no spills.)
#
# **The SASS does less overlapping than the PTX asks for.** In the PTX the wait for $PV_{j-1}$
# (`wgmma.wait_group 0`) comes after the softmax. ptxas, which schedules the machine code, moves
# it up to the top of its basic block: in the sm_90a cubin of the CUDA 13 build of the DSL (the
# build the H200 runs; 2026-12-02) the wait (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) stood right after
# the mask, so of the softmax only the mask ran under the warpgroup's own $PV_{j-1}$; the row
# max, the 66 exponentials and the row sum waited for it - 405 instructions from that wait to
# the end of the loop body (D = 128). FA4's Hopper kernel has the same code shape and the same
# wait moved, but less far: after its row max, the scaling and 10 of its 66 exponentials.
#
# **Putting the wait where it should be (D = 128).** A wait moves only inside its block, so the
# kernel gives it a block of its own: after the row max it branches on a test that is always
# true but that neither compiler can fold (`always_true_after`: inline PTX adds the row scales,
# each an `exp2`, tests the sum with `setp.geu` and takes `vote.any` across the warp), and
# behind the branch come the wait, the exponentials, $O \mathrel{*}= $ row_scale and $P_j$. The
# vote matters: with a per-thread test ptxas treated the block as divergent, moved the K/V
# descriptor arithmetic off the uniform datapath (9% more instructions) and the kernel ran
# slower. With it: the same bits, 316 instructions after the wait instead of 405, and on the
# H200 (2026-12-02, GPU time against the kernel without the test, two runs) +0.9-5.9% at
# D = 128 - Nsight Compute: the tensor pipe active 81.8% of the cycles instead of 78.7%. Moving
# more than the
# row max ahead of the wait was *slower*: all 66 exponentials -1.5% at 8k, with the stalls on a
# busy math pipe up from 0.03 to 0.25 per instruction - those exponentials then run while the
# other warpgroup's do, on the same MUFU units (exercise 4's model points the same way). At
# D = 64, three consumer warpgroups, even the row max alone ran 5-6% slower, so D = 64 keeps
# the PTX order (`max_before_wait`).
#
# **Counting instructions against FA4's.** FA4's Hopper kernel compiles without a GPU too (under
# torch's `FakeTensorMode`, with `FLASH_ATTENTION_ARCH=sm_90`), and `cuobjdump -sass` (pip's
# `nvidia-cuda-cuobjdump`) prints both cubins, so the steady-state loops can be read side by side:
# per warp and KV tile (bf16, S = 16k, a tile without the mask) this kernel issued 454
# instructions at D = 64 against FA4's 420, and 501 against 457 at D = 128 (2026-12-02). Most of
# the difference was the wgmma descriptors. Indexed as `tSrK[None, None, k_block, slot]`, each of
# the 8 descriptors of a QK^T at D = 128 was rebuilt half by half (a logical OR on the low word and
# a move of the high word: 63 uniform-datapath instructions per tile against FA4's 38); sliced
# by slot first and then by k-block (`issue_qk`, `issue_pv` above), a descriptor is the slot's
# plus a constant, one 64-bit add: 442 and 473 instructions, the same bits. The row max in four
# `fmax` chains, as FA4 writes it, took 4 more. On the H200 (GPU time, interleaved rounds) that
# was +0-4.5% at D = 128; at D = 64 the indexing alone moved the time by -1 to +2% and the `fmax`
# chains made it 1-6% *slower*, so D = 64 keeps `TensorSSA.reduce` (`fmax_row_max`): where the
# exponentials set the pace, fewer instructions are not the same as less time.

# %%
report = nb.compile_summary(9, "hopper")

# %%
if report is not None:
    for pattern in (r"wgmma\.wait_group", r"setmaxnreg"):
        print("\n".join(ptx_lines(report.ptx, pattern, limit=4)))

# %% [markdown]
# ### 5.5 The same stage on Blackwell
#
# On Blackwell, stage 9 changes the MMA warp's order to FA4's: for each Q tile it issues $P_{j-1}
# V_{j-1}$ and right behind it $S_j = Q K_j^T$, the QK of the next tile without waiting for the
# softmax of this one, so that each softmax warpgroup finds its next S ready after two GEMMs
# while the other tile's two GEMMs keep the tensor core busy. The new S must not land on a P that
# a PV may still read: at D = 64 P gets TMEM columns of its own (the map below) and FA4's order
# needs no wait. At D = 128 all 512 columns are taken by S and O, P lies over S, and a QK must
# wait for the last PV's commit; right behind that PV the wait would leave the tensor core
# idle, so at D = 128 the stage keeps stage 8's order, whose waits have the other tile's GEMM
# queued. FA4 runs its order without the wait, trusting the tensor core to run one thread's
# MMAs in order, which PTX promises only for MMAs into the same accumulator. And O is rescaled only when a row max has grown by more
# than $2^8$ (FA4's conditional rescale): $P$ then lies in $(0, 2^8]$, which costs no precision
# (rounding to 16 bits is relative) and cannot overflow fp16.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** This project has an H200;
# the Blackwell files are compiled for sm_100a with fake tensors, their PTX is checked and the
# hand-offs are replayed on the CPU by the schedule checker. Their numerics are tested only where
# an sm_100 GPU exists.

# %%
nb.show_docstring(9, "blackwell")
nb.show_diff(9, "blackwell", max_lines=120)

# %%
rows = nb.cross_track_table(9)
report_bw = nb.compile_summary(9, "blackwell")
if report_bw is not None:
    from common.tools.ptx import tcgen05_mma_order  # noqa: E402

    # the order at D = 64 (FA4's) and D = 128 (stage 8's), read from the PTX
    orders = [
        (f"stage {n}, D = {d}", nb.compile_report(n, "blackwell", shape=(2, 4, 512, 1024, d)).ptx)
        for n, d in ((8, 64), (9, 64), (9, 128))
    ]
    fig = figures.mma_issue_orders(
        [(label, tcgen05_mma_order(ptx)) for label, ptx in orders],
        [{"Q": 4, "P": 8}, {"Q": 4, "P": 8}, {"Q": 8, "P": 8}],
        notes=[
            "per KV tile: QK0, QK1, then PV0, PV1",
            "QK0 QK1 once | per later tile: PV0 QK0 PV1 QK1 | PV0 PV1 once",
            "P over S: stage 8's order",
        ],
    )
    # TMEM at D = 64 (P in columns of its own) and D = 128 (P over S), from the kernel objects
    bw9 = stage_table.track_module(9, "blackwell")
    for D_bw in (64, 128):
        kernel_bw, _ = bw9.compile_args(torch.bfloat16, (1, 1, 256, 256, D_bw))
        fig = figures.tmem_two_tiles(vars(kernel_bw))
    print("\n".join(ptx_lines(report_bw.ptx, r"vote\.sync\.any", limit=2)))


# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** the checks of stages 7 and 8, unchanged (a few $10^{-3}$ relative, within 3x
# PyTorch's own bf16 error; rows with no key O = 0 and LSE = -inf; NaN planted around packed
# sequences never leaks in), and O and LSE equal to stage 8's bit for bit.

# %%
result = nb.run_and_verify(9, (2, 4, 512, 1024, 128))
checks = nb.run_and_verify_cases(
    9,
    list(nb.MASK_CASES)
    + [
        ("GQA 8 / 2, causal", (2, 8, 300, 700, 128), dict(kv_heads=2, causal=True)),
        ("MQA 8 / 1, D = 64", (1, 8, 520, 520, 64), dict(kv_heads=1)),
    ],
)
packed_checks = nb.run_and_verify_varlen(
    9, [200, 77, 0, 300, 1], [130, 190, 5, 129, 260], heads=4, kv_heads=2, causal=True
)

# %%
if nb.MODE == "gpu" and nb.available(8, nb.TRACK) and nb.available(9, nb.TRACK):
    from common.tools import inputs

    q, k, v = inputs.attention_inputs(2, 8, 1000, 1000, 128, seed=5)
    o8, lse8 = stage_table.track_module(8, nb.TRACK).attention(
        q, k, v, causal=True, return_lse=True
    )
    o9, lse9 = stage_table.track_module(9, nb.TRACK).attention(
        q, k, v, causal=True, return_lse=True
    )
    torch.cuda.synchronize()
    print(f"stage 9 == stage 8 bit for bit: O {torch.equal(o8, o9)}, LSE {torch.equal(lse8, lse9)}")
else:
    print("the bit-for-bit comparison with stage 8 needs GPU mode")

# %%
fig = nb.error_picture(9, result)

# %% [markdown]
# ## 7. Measure
#
# Stage 9 against stages 5 and 8 and the baselines, FA4 included, at the paper shapes, all timed
# in one run.
#
# **Expected**, from `make bench` on the H200 (2026-12-04, bf16, B·S = 16k, H·D = 2048; every
# kernel of a row timed in the same interleaved rounds, event-timed;
# `docs/results/bench_h200_2026-12-04.md`, its ablation table). The cell below reads the rows from
# S = 2k out of the run's `.json` file, in TFLOP/s, with the step in GPU time alone (CUPTI kernel
# durations) next to it.

# %%
with open(os.path.join(nb.ROOT, "docs/results/bench_h200_2026-12-04.json")) as f:
    h200 = {}
    for r in json.load(f)["rows"]:
        if r["stage"] in ("ablation", "ablation GPU time"):
            h200[(r["stage"], r["shape"][4], r["shape"][5], r["shape"][2])] = r["tflops"]


def tflops_or_ratio(t, a, b=None):
    if a not in t or (b is not None and b not in t):
        return "-"
    return f"{t[a] / t[b]:.2f}" if b else f"{t[a]:.0f}"


names = ("stage 5", "stage 8", "stage 9", "FA4", "SDPA cuDNN")
nb.table(
    ("D", "causal", "S", *names, "9 / 8", "9 / FA4", "9 / 8 GPU", "9 / FA4 GPU"),
    [
        (D_, causal, S_, *(tflops_or_ratio(t, n) for n in names))
        + tuple(tflops_or_ratio(t, "stage 9", n) for n in ("stage 8", "FA4"))
        + tuple(
            tflops_or_ratio(h200[("ablation GPU time", D_, causal, S_)], "stage 9", n)
            for n in ("stage 8", "FA4")
        )
        for (kind, D_, causal, S_), t in sorted(
            h200.items(), key=lambda kv: (-kv[0][1], *kv[0][2:])
        )
        if kind == "ablation" and S_ >= 2048
    ],
)

# %% [markdown]
# Stages 8 and 9 share everything but the overlap - the persistent CTAs, the tile order and
# O's own buffer (stage 8's section 5.6), the slot release from an elected lane - with one
# difference of measurement: where a launch masks nothing, stage 8 runs a kernel compiled
# without the mask code at both head dims (+7% at D = 128, S = 8k and 16k; H200, 2026-12-03),
# stage 9 only at D = 64 (at D = 128 it ran 1-3% slower without it, same day; its docstring). At
# D = 128 the step is then +2% at S = 2k, 0% at 4k, +2% at 8k and -6% at 16k non-causal
# (655 -> 668, 675 -> 675, 657 -> 670, 677 -> 635), -2% at 2k and +6-9% causal from 4k
# (599 -> 636, 610 -> 656, 621 -> 679); in GPU time alone +1-2% non-causal and +5-6% causal
# from 2k. The paper's ablation on an H100 at head dimension 128 measured +14% for the same step
# (582 -> 661). Before stage 8 issued the two GEMMs of a turn back to back (its section 5.3) the
# step was larger: that took the tensor cores' idle gap inside each turn out of stage 8, and with
# it part of what this stage had gained there - so in the paper's ablation, too, part of the
# intra-warpgroup step may be that gap, which its warp-specialised kernel keeps. Runs differ by a
# few percent (the same code by up to 7% at 16k); stage 9 ends at 0.94-1.01x FA4 non-causal from
# 2k in event time (0.98-1.01 in GPU time alone): the gap at 8k-16k is the open part of this
# stage. It is not the clock: run back to back at the 700 W power cap (H200, 2026-12-03,
# `python -m common.tools.clock_probe`, `docs/results/clock_probe_h200_2026-12-03.md`) stage 9
# holds FA4's clock within 1-2% and does 2-5% less work per cycle - the instructions around the
# GEMMs and the exponentials (`docs/results/ncu_opcodes_h200_2026-12-03.md` has the counts). At
# D = 64 the step is +4-7% from 2k to 8k (483 -> 513, 487 -> 520, 524 -> 548; -1% at 16k) on
# stage 8's CTA of three consumer warpgroups (section 7.2). With two, stages 8 and 9 stayed below
# stage 5 at D = 64: Nsight Compute on the H200 (2026-12-01) showed stage 5 fitting two CTAs per
# SM there (block limit by registers 2), so four warpgroups compute on each SM against two, and
# D = 64 is bound by the exponentials (the XU pipe 58% busy in stage 5 against 50% in stages 8
# and 9).

# %%
bench = nb.measure(
    9,
    [
        (8, 16, 2048, 2048, 128),
        (2, 16, 8192, 8192, 128),
        (8, 32, 2048, 2048, 64),
        (2, 32, 8192, 8192, 64),
    ],
    also_stages=(5, 8),
    with_fa4=True,
)

# %%
# The step next to the paper's ablation: this run's ratios where there is a run, else the H200's
# (the non-causal rows of the table above at these four shapes).
quoted = {
    f"({16384 // S_}, {2048 // D_}, {S_}, {S_}, {D_})": h200[("ablation", D_, False, S_)]
    for D_ in (128, 64)
    for S_ in (2048, 8192)
}
source = "this run" if bench else "H200, 2026-12-04 (make bench)"
rows = [("FlashAttention-3 paper, H100, head dim 128, 8k", "582", "661", "-", "1.14", "paper")]
for shape, res in (bench or quoted).items():
    s8, s9, fa4 = res.get("stage 8"), res.get("stage 9"), res.get("FA4")
    rows.append(
        (
            shape,
            f"{s8:.0f}" if s8 else "-",
            f"{s9:.0f}",
            f"{fa4:.0f}" if fa4 else "-",
            f"{s9 / s8:.2f}" if s8 else "-",
            source,
        )
    )
nb.table(
    (
        "shape (B, H, S, S, D)",
        "warp specialised (stage 8)",
        "+ overlap (stage 9)",
        "FA4",
        "step",
        "measured",
    ),
    rows,
)

# %% [markdown]
# ### 7.1 Persistent CTAs
#
# Stage 8 has persistent CTAs (its notebook, section 5.6), with the scheduler of 7.3 and the same
# tile order; the measurements of 7.1 and 7.3 compare stage 9 with and without them. Each CTA walks
# work tiles in a loop (`tile_coords`: tile c, c + gridDim.x, ...). Where every tile has the
# same work (no causal or window cut, batch mode) `__call__` caps the grid at one CTA per SM, so
# a CTA's set-up and its first loads are paid once per SM rather than once per 128-row tile, and the next tile's K and V stream in under this tile's last GEMMs. Q passes from
# tile to tile through two barriers (`q_full`, `q_empty`) with one phase per tile, and the ring's
# position carries over: entry e, counted across tiles, takes slot e % kv_slots (`ring_state`).
# O got its own buffer so that Q is released before the epilogue rather than after it.
#
# **Measured** (H200, 2026-12-01, bf16, paper shapes, GPU time from CUPTI, FA4 in the same run;
# `docs/results/bench_h200_2026-12-01_persistent.json`): at D = 128 non-causal +8% at S = 1k,
# +5% at 2k, +3% at 4k, +1% at 8k, nothing at 16k - a per-CTA cost shrinks as 1 / S. Forced onto
# causal shapes the capped grid loses (right panel's red line, 36% at 16k): a fixed share of tiles
# per CTA cannot follow the unequal tiles as the hardware's dispatch of one CTA per tile does,
# and the CTAs end up spread over many heads at once, so K and V are likely re-read from HBM
# (the arithmetic: 16 heads x 8 MB of K and V at 16k against 50 MB of L2; not profiled).
# Under a mask the capped grid now takes its tiles at run time instead (section 7.3).

# %%
with open(os.path.join(nb.ROOT, "docs/results/bench_h200_2026-12-01_persistent.json")) as f:
    persistent_rows = json.load(f)
fig = figures.persistent_ctas(
    [r for r in persistent_rows if r["D"] == 128 or not r["causal"]],
    title="Stage 9 with and without persistent CTAs (H200, 2026-12-01, bf16, GPU time)",
)

# %%
# On a GPU: the same comparison in this run (event-timed), the capped grid against one CTA per
# tile (kernel_settings turns the cap off; the rest of the kernel is the same).
bench_persistent = nb.measure(
    9,
    [(16, 16, 1024, 1024, 128), (8, 16, 2048, 2048, 128), (2, 16, 8192, 8192, 128)],
    baselines=(),
    variants={"one CTA per tile": dict(persistent=False)},
)

# %% [markdown]
# ### 7.2 Three consumer warpgroups at D = 64
#
# At D = 64 stage 9 runs stage 8's CTA of three consumer warpgroups (stage 8's notebook, section
# 5.5); the measurements of this section compare stage 9 with three and with two. `mma_warpgroups` is 3
# (`Sm90Kernel.warpgroups_for`; 2 under short masks, the end of this section), so the Q tile has
# 192 rows, 64 per consumer warpgroup, and the CTA 512 threads. The register split follows: 128 x 24 for the producer and
# 384 x 160 for the consumers, 64,512 of the SM's 65,536. At D = 64 the S, P and O sets of section 3 take 64 + 32 + 32 = 128 of the 160. The
# ping-pong's turns go round: warpgroup w waits on named barrier 1 + w, which warpgroup w - 1
# arrives on (warpgroup 1's: warpgroup 3), so the tensor cores see 1: QK0, 2: QK0, 3: QK0, 1: QK1
# PV0, ... The tests explore every interleaving of the three programs on the CPU, as for two. The
# rest of the kernel only needed its counts generalised: the zeroing of V rows (`zero_rows`, 1,024
# chunks over 384 threads) and the store of O (`store_rows`, 48 rows per pass, or 32 where a
# pack-GQA group of 32 or 64 heads would not split evenly). Pack-GQA now needs G to divide 192.
#
# Why it pays: D = 64 is bound by the exponentials, not the tensor cores (7, above), and a
# third computing warpgroup puts one more softmax in flight on each SM; each K/V tile loaded also
# serves 192 rows instead of 128. **Measured** (H200, 2026-12-01, bf16, paper shapes, GPU time,
# one run; `docs/results/bench_h200_2026-12-01_3wg.json`): non-causal +4% at S = 512 rising to
# +28% at 16k (8k: 445 -> 553, FA4 581); causal +4-16% from 2k but 10-11% slower at 512-1k, where
# more of a 192-row tile falls in partly masked KV tiles and there are fewer CTAs.

# %%
for d in (64, 128):
    k_ = kernel_class(cutlass.BFloat16, d)
    print(
        f"D = {d}: {k_.mma_warpgroups} consumer warpgroups, Q tile {k_.cta_tile[0]} rows, "
        f"{k_.threads} threads, setmaxnreg {k_.load_registers} / {k_.mma_registers} "
        f"({128 * k_.load_registers + k_.mma_threads * k_.mma_registers:,} of 65,536 registers), "
        f"{k_.kv_slots} K/V slots"
    )
with open(os.path.join(nb.ROOT, "docs/results/bench_h200_2026-12-01_3wg.json")) as f:
    wg3_rows = json.load(f)
fig = figures.consumer_warpgroups(
    wg3_rows,
    title="Stage 9 at D = 64: three consumer warpgroups against two (H200, 2026-12-01, bf16, GPU time)",
)

# %%
# On a GPU: the same comparison in this run (event-timed): two consumer warpgroups at D = 64
# (kernel_settings; a 128-row tile) against the stage as it is.
bench_wg = nb.measure(
    9,
    [(8, 32, 2048, 2048, 64), (2, 32, 8192, 8192, 64)],
    baselines=(),
    variants={"two consumer warpgroups": dict(mma_warpgroups=2)},
)

# %% [markdown]
# **Short masks keep two.** The 10-11% lost at S = 512-1k causal comes back this way: the launch
# asks the kernel class for its options at each call
# (`Sm90Kernel.launch_options`, called by `common/attention_host.py`), and at D = 64 a causal or
# window mask that leaves no query row more than 1,024 keys gets `mma_warpgroups = 2`, the
# 128-row tile, in a compile of its own. Measured (H200, 2026-12-02, bf16, paper shapes, GPU time,
# two / three warpgroups, us): causal S = 512 170 / 188, 1k 243 / 268, 2k 388 / 367, 4k 678 / 610;
# a window of 256 keys to the left 168-198 / 189-231 from S = 512 to 4k. So the cut sits at 1,024
# keys (`Sm90Kernel.SHORT_MASK_KEYS`); the outputs are the same bits either way (tested). The
# comparison just above is non-causal, where three warpgroups run at every length.

# %% [markdown]
# ### 7.3 A dynamic tile scheduler under a mask
#
# Under a causal or window mask the tiles are unequal: the last Q tile of a head sees every KV
# tile, the first one a single one. A fixed share per CTA cannot follow that (7.1), and one CTA
# per tile gives up what the persistent loop bought: every CTA pays its set-up again, and its
# epilogue runs with nothing behind it. FlashAttention-3's answer, now in `next_tile`: the grid
# is capped at one CTA per SM here too, CTA c starts with tile c, and when its producer has
# issued a tile's last load it draws a ticket from a global counter (one `atomic_add` by lane 0;
# `tile_counter`, which the host zeroes at every call) and takes tile gridDim.x + ticket. The
# consumers learn the number with the tile's Q: the producer writes it to shared memory
# (`tile_id`) before its arrive on `q_full`, the consumers read it after their wait, and a number
# past the end, with a `q_full` of its own, ends their loop. The tickets come in order, so the
# tiles still start longest first - and `tile_coords` now orders them across a section of heads
# whose K and V fit in L2 together (every head's longest tile before any head's second longest,
# FlashAttention's LPT order) rather than head by head.
#
# **Measured** (H200, 2026-12-01, bf16, causal paper shapes, GPU time, outputs not poisoned, FA4
# in the same run; `docs/results/dynamic_h200_2026-12-01.json`): at D = 128 +22% at S = 512, +19%
# at 1k, +11% at 2k, +5% at 4k, +3% at 8k, +1% at 16k; at D = 64 +17-24% at 512-1k, +12% at 2k,
# +4-8% at 4k-8k, within the spread at 16k. Stage 9 / FA4 causal: 0.97-1.06 at D = 128, 0.89-1.02
# at D = 64 and 0.93-0.99 there from 1k (0.87-0.96 and 0.72-0.99 with one CTA per tile, same
# run). The outputs are the same bits whichever CTA computes a tile (tested).
#
# **Packed sequences** take the same road: their tiles differ with the lengths,
# so they too run on a grid of one CTA per SM with the tiles drawn from the counter. One thing is
# new there. The grid counts as many Q tiles per (head, sequence) as the *longest* sequence has
# (the grid is sized from `max_seqlen_q`, not from each sequence's own count of tiles), so a
# shorter sequence's last tiles are empty: 15 of 16 for a 64-token sequence next to a 2047-token
# one. The producer
# skips them before it hands a tile over (`Sm90Kernel.live_tile`: it reads the sequence's length
# from `cu_seqlens` and draws the next ticket), so an empty tile costs one atomic add instead of a
# Q load and an epilogue. Measured (H200, 2026-12-01, bf16, D = 128, GPU time, FA4's varlen in
# the same run; `docs/results/varlen_dynamic_h200_2026-12-01.json`): `make bench`'s 16 sequences
# of 64-2047 tokens went from 0.84x / 0.85x FA4 (non-causal / causal, one CTA per tile) to
# 0.97x / 1.07x; 64 sequences of 64-1023 tokens +24% / +36% over one CTA per tile, 8 of 1k-8k
# +2% / +7% - the more and the shorter the sequences, the more the per-CTA set-up and the tail
# weighed.
#
# ![Stage 9 on packed sequences: one CTA per tile against the persistent grid, H200](../docs/results/varlen_dynamic_h200_2026-12-01.png)

# %%
nb.show_source(9, "hopper", names=["Sm90Kernel.next_tile", "Sm90Kernel.tile_coords"])

# %%
with open(os.path.join(nb.ROOT, "docs/results/dynamic_h200_2026-12-01.json")) as f:
    dynamic_rows = json.load(f)["rows"]
fig = figures.dynamic_tiles(
    dynamic_rows,
    title="Stage 9 causal: one CTA per tile and the dynamic scheduler (H200, 2026-12-01, bf16)",
)

# %%
# On a GPU: the same comparison in this run (event-timed), causal: the dynamic scheduler against
# one CTA per tile (kernel_settings turns persistence off; the rest of the kernel is the same).
bench_dynamic = nb.measure(
    9,
    [(32, 16, 512, 512, 128), (16, 16, 1024, 1024, 128), (2, 16, 8192, 8192, 128)],
    baselines=(),
    variants={"one CTA per tile": dict(persistent=False)},
    causal=True,
)

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU; where a GPU adds a measurement, the exercise says which call makes it.
#
# 1. **Why `wait_group(1)`.** After issuing $QK_j$ and $PV_{j-1}$ as two commit groups, the
#    warpgroup waits with `wait_group(1)` before the softmax. What would `wait_group(0)` there
#    cost, and what would go wrong if the two GEMMs were issued in the other order ($PV_{j-1}$
#    first) with the same wait?
# 2. **The register count.** From section 3, how many registers does the second S-sized set add,
#    and how does that compare with nvdisasm's counts of stages 8 and 9 in 5.4? Could stage 7's
#    kernel (no `setmaxnreg`, 256 threads) afford the overlap at D = 128?
# 3. **A lost pass.** Drop warpgroup 1's pass after its last PV in the model:
#    `figures.attention_schedule(True, 3, overlap=True, final_pass=False)`. What happens?
# 4. **The model and the measurement.** The model gives stage 9 about 1% over stage 8 at D = 128;
#    the H200 measured +2% at S = 8k non-causal and +7% causal (section 7). Stretch the softmax in the model (`exp_tflops` of
#    `figures.hopper_unit_times` lower) and watch the gain and the tensor cores' busy share. Why
#    does a longer softmax not make the overlap pay in this model, and what would the model need
#    to show the measured gain?
#
# 5. **Bit for bit.** Stage 9's first PV accumulates into `acc_O = 0` instead of overwriting it as
#    stage 8's does. Why does that not change a single bit of O?
#
# ### Answers and checks
#
# <details><summary>1. Why wait_group(1)</summary>
#
# `wait_group(0)` waits for $PV_{j-1}$ as well, so the softmax would start only after both GEMMs:
# the loop would be serial again, stage 8's. Issued in the other order, the group still pending
# after `wait_group(1)` would be $QK_j$: the softmax would read `acc_S` while the tensor cores
# still write it - a race that gives wrong numbers, not a hang. The PTX check in the tests pins the
# order (QK group, PV group, pass, `wait_group 1`, `wait_group 0`).
# </details>
#
# <details><summary>2. The register count</summary>
#
# 64 (S) + 32 (P) + 64 (O at D = 128) = 160 live across the GEMMs against 128 in stage 8, which
# converts S to P before the PV and frees S. nvdisasm counted 155 -> 184 registers (batch, D =
# 128): +29. Stage 7's 256-thread kernel has at most 255 registers per thread but ran at 164 with
# one CTA per SM; the overlap would fit there too, but without the producer warpgroup the loads
# would stay on the consumers' path. The cell below prints the arithmetic.
# </details>
#
# <details><summary>3. A lost pass</summary>
#
# Warpgroup 2 waits before its last PV for a turn nobody passes: the model raises `Deadlock`, as
# the kernel would hang until the test's deadline. The cell below catches it.
# </details>
#
# <details><summary>4. The model and the measurement</summary>
#
# The cell below scans the softmax length: the gain stays at 1-3% and the tensor cores' busy share
# falls, because in the model the stretched softmax is all exponentials, and the exponential units
# are shared by the two warpgroups - both stages become bound by them. To show the measured gain
# the model would need what it leaves out: wgmma latency (issue to result), softmax work on
# per-warpgroup FP32 and ALU pipes that is not the shared exponential unit, and the cost of the
# barriers. A model is a tool for reasoning about one effect; the measurement decides. And the
# machine code adds a reason of its own (5.4): ptxas moves the wait for $PV_{j-1}$ ahead of the
# exponentials, so the model's exponentials under the warpgroup's own PV are not what runs; and
# where the kernel keeps them ahead, they meet the other warpgroup's on the shared MUFU units.
# </details>
#
# <details><summary>5. Bit for bit</summary>
#
# $0 + x = x$ exactly in floating point, so accumulating the first $PV$ into zeros gives the same
# bits as overwriting (the only difference would be the sign of an exact zero, $-0 + 0 = +0$,
# which `torch.equal` treats as equal). Every other operation on O is the same, in the same order.
# </details>

# %%
# Exercise 2: registers live across the GEMMs, stage 8 and stage 9.
print("stage 8 (S or P, O):", 64 + 64, " stage 9 (S, P, O):", 64 + 32 + 64)

# Exercise 3: the lost pass in the model.
try:
    figures.attention_schedule(True, 3, overlap=True, final_pass=False)
except figures.Deadlock as e:
    print("Deadlock:", e)

# Exercise 4: the model's gain of stage 9 over stage 8 against the softmax's length.
for stretch in (1.0, 1.6, 2.5, 4.0):
    t = figures.hopper_unit_times(
        head_dim=D, block_n=bN, rows=rows_per_wg, exp_tflops=3.9 / stretch
    )
    s8 = figures.attention_schedule(True, 8, *t, D // 16, bN // 16)
    s9 = figures.attention_schedule(True, 8, *t, D // 16, bN // 16, overlap=True)
    print(
        f"softmax {stretch:.1f}x its exponentials: stage 9 {s8['end'] / s9['end']:.3f}x stage 8, "
        f"tensor cores busy {100 * s8['tc_busy']:.0f}% -> {100 * s9['tc_busy']:.0f}%"
    )
