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
# # Stage 10 - overlap inside the loop: the next QK^T issued with the last PV
#
# This notebook walks through `stages/stage10_overlap/hopper.py`: stage 9's kernel (a TMA producer
# warpgroup, two consumer warpgroups taking turns on the tensor cores, every feature of stage 7)
# with the next of FlashAttention-3's schedule techniques, the *intra-warpgroup overlap*: each
# consumer warpgroup issues $QK_j$ and $PV_{j-1}$ in one turn, waits for $QK_j$ alone, and so may
# run the softmax of tile $j$ while $PV_{j-1}$ is still on the tensor cores (at D = 128 ptxas moves
# the wait up and takes that back: section 5.5). The notebook imports the stage file and displays
# it; it never pastes kernel code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage10_overlap.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; everything else (the
# pictures, the turn model, the compile summaries) runs in both modes. Source:
# `notebooks/source/stage10_overlap.py`.

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
from common.tools import stage_table, turns  # noqa: E402
from common.tools.ptx import ptx_lines  # noqa: E402
from notebooks.figures import stage10 as figures  # noqa: E402

nb.start(10)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - write the software-pipelined loop of one consumer warpgroup: a prologue ($QK_{lo}$ and its
#   softmax), steps that issue $QK_j$ and $PV_{j-1}$ in one turn and wait for them one at a time
#   (`wait_group 1`, then `wait_group 0`), and a last $PV$ on its own;
# - say which registers are live while the softmax runs under $PV_{j-1}$ (S of tile $j$, P of
#   tile $j - 1$ still read by the wgmma, O written by it) and check that they fit the 240
#   registers a consumer thread has;
# - replay the turns on the CPU and watch the model reject the pair issued the other way round;
# - read the schedule model before and after and say what it does and does not predict;
# - put the measured step next to the FlashAttention-3 paper's ablation, and say where this
#   stage is slower than the one before it;
# - say what the same stage does on Blackwell (compile-checked only).
#
# ## 2. Previous stage recap
#
# Stage 9 splits the CTA into a TMA producer warpgroup (24 registers per thread after
# `setmaxnreg.dec`) and two consumer warpgroups (240 registers each), each owning 64 rows of the
# 128-row Q tile. The two consumers take turns on the tensor cores through named barriers 2 and 3:
# a turn is $PV_j$ with $QK_{j+1}$, issued back to back, and one wait after both, so that one
# warpgroup's softmax runs while the other's GEMMs hold the tensor cores. Inside one warpgroup
# everything is still serial: $QK_j$, wait, softmax$_j$, $PV_j$. Its exponentials never run under
# its own GEMMs.
#
# ## 3. The math
#
# Per KV tile $j$ the loop computes $S_j = Q K_j^{\top}$, the online softmax
# $m_j = \max(m_{j-1}, \operatorname{rowmax} S_j)$, $P_j = \exp(s\,(S_j - m_j))$,
# $\ell_j = \ell_{j-1}\, e^{s(m_{j-1} - m_j)} + \operatorname{rowsum} P_j$ and
# $O_j = O_{j-1}\, e^{s(m_{j-1} - m_j)} + P_j V_j$ (in the code: `row_max` = $m$, `row_sum` =
# $\ell$, `row_scale` = $e^{s(m_{j-1} - m_j)}$). The dependencies are $S_j \to P_j \to O_j$ and
# $O_{j-1} \to O_j$; $S_j$ needs only $Q$ and $K_j$. So $QK_j$ can be issued before $PV_{j-1}$
# has finished, and a step becomes
#
# $$\underbrace{QK_j,\ PV_{j-1}}_{\text{one turn}} \;\to\; \text{wait for } QK_j \;\to\;
# \operatorname{softmax}_j \;\to\; \text{wait for } PV_{j-1} \;\to\;
# O \mathrel{*}= e^{s(m_{j-1} - m_j)},\ P_j = \operatorname{bf16}(\ldots).$$
#
# The operations on O keep their order (rescale by $e^{s(m_{j-1} - m_j)}$, then add
# $P_j V_j$ one step later), so O and LSE are stage 9's bit for bit. The price is registers.
# Per consumer thread (64 rows, 128 keys, 128 threads): S is $64 \cdot 128 / 128 = 64$ fp32, P is
# 64 bf16 in 32 registers, O is $64 \cdot D / 128 = D/2$ fp32. Stage 9's softmax runs with none
# of its warpgroup's GEMMs in flight: S and O are live, and P's registers are free (P_{j-1} has
# been read, P_j is not written yet). Stage 10's softmax runs under $PV_{j-1}$, which still reads
# $P_{j-1}$ and writes O: S, P and O are all live, and the softmax's own temporaries come on top.

# %%
cfg = nb.show_config(10, "hopper")
bM, bN, D = cfg.get("cta_tile", (128, 128, 128))
kernel_class = stage_table.track_module(10, "hopper").Sm90Kernel
register_rows = []
for D_ in (64, 128):
    k_ = kernel_class(cutlass.BFloat16, D_)  # the kernel object at this D (compiles nothing)
    rows_, keys_ = k_.cta_tile[0] // k_.mma_warpgroups, k_.cta_tile[1]
    s_regs = rows_ * keys_ // 128  # fp32 scores per thread
    p_regs = rows_ * keys_ // 2 // 128  # bf16 pairs per thread
    o_regs = rows_ * D_ // 128  # fp32 output per thread
    register_rows += [
        (f"stage 9, D = {D_}: S and O", s_regs, 0, o_regs, k_.mma_registers),
        (f"stage 10, D = {D_}: S, P and O", s_regs, p_regs, o_regs, k_.mma_registers),
    ]
    print(
        f"D = {D_}: S {s_regs} + P {p_regs} + O {o_regs} = {s_regs + p_regs + o_regs} registers "
        f"per thread live while the softmax runs, of the {k_.mma_registers} a consumer thread has"
    )
fig = figures.register_sets(register_rows)

# %% [markdown]
# ## 4. What changes
#
# The docstring gives the changes with their numbers; then the kernel class's diff against
# stage 9 (`make diff-10 TRACK=hopper` shows the whole files). The pass over a tile's KV tiles
# is rewritten as three methods named as in FA4's `flash_fwd_sm90.py`:
# `first_half_block_overlap` (the prologue), `mma_one_n_block` (one pipelined step) and
# `last_half_block_overlap` (the last PV). The producer, the ring, the turn barriers and the
# epilogue are stage 9's.

# %%
nb.show_docstring(10, "hopper")

# %%
nb.show_diff(10, "hopper", max_lines=160)

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The pipelined loop
#
# Three pieces. The prologue computes $S_{lo}$ alone (turn 0) and converts it to $P_{lo}$ in
# `tOrP`. Each step issues $QK_j$ into `acc_S` (free again: $S_{j-1}$ lives on as $P_{j-1}$ in
# `tOrP`) and $PV_{j-1}$ behind it as a second wgmma group, passes the turn, waits for the first
# group only (`wait_group(1)`), releases $K_j$'s slot and runs the softmax of $S_j$; then it waits
# for $PV_{j-1}$ (`wait_group(0)`), releases $V_{j-1}$'s slot, rescales O and writes $P_j$ over
# `tOrP`. After the loop the last $PV$ runs in a turn of its own; for packed sequences
# `zero_rows` stands before that turn, as in stage 9, because its barrier joins both
# warpgroups. The loop carries two ring positions: `consumer_state` (the next K) and `v_state`
# (the V that the next step's PV reads).

# %%
nb.show_source(
    10,
    "hopper",
    names=[
        "Sm90Kernel.first_half_block_overlap",
        "Sm90Kernel.mma_one_n_block",
        "Sm90Kernel.last_half_block_overlap",
    ],
)

# %% [markdown]
# ### 5.2 wait_group 1, then 0
#
# `wgmma.commit_group` closes a group of wgmma instructions and `wgmma.wait_group N` waits until
# at most N of this warpgroup's groups are still pending; groups complete in the order they were
# committed. A step commits $QK_j$ first and $PV_{j-1}$ second, so `wait_group 1` returns once
# $QK_j$ is complete, whatever $PV_{j-1}$ is doing: that is what lets the softmax start. The
# order is the whole trick. With $PV_{j-1}$ committed first, the group still pending after
# `wait_group 1` would be $QK_j$, and the program would have the softmax read `acc_S` while the
# tensor cores may still write it. ptxas sees that read of a wgmma's accumulator registers and
# serialises the wgmma instead (warning C7514): the result stays right and the overlap is gone
# (exercise 10a makes that edit).
#
# The kernel's order, read from its PTX with one letter per statement (`turns.schedule_string`):
# `T` wait for the turn, `P` pass it, `G` a run of wgmma, `C` commit, `w` wait_group 1, `W`
# wait_group 0, `B` the consumers' own barrier, `L` a TMA load, `d` / `i` setmaxnreg down / up,
# `0` the CTA-wide sync. The loop body is stage 10's `TGCGCPwW`: two groups, the pass, then the
# two waits.

# %%
schedule = {}
for n in (9, 10):
    r = nb.compile_report(n, "hopper")
    if r is not None:
        schedule[n] = turns.schedule_string(r.ptx)
        print(f"stage {n:2d}: {schedule[n]}")
# The loop of stage 10: QK_j committed, PV_{j-1} committed, the turn passed, wait 1, wait 0.
if 10 in schedule:
    assert "TGCGCPwW" in schedule[10], schedule[10]

# %% [markdown]
# ### 5.3 The turns still balance
#
# A turn is now ($QK_j$, $PV_{j-1}$); turn 0 is $QK_{lo}$ alone and the last turn $PV_{hi-1}$
# alone, so each warpgroup still takes `steps + 1` turns and barriers 2 and 3 complete as often
# as in stage 9. `common/tools/turns.py` writes each warpgroup's program as the kernel runs it
# (its waits, passes and GEMM issues, with the kernel object's own barrier numbers) and explores
# every interleaving of the two under the rules of named barriers. It reports a deadlock, an
# arrival left over at the end, or a GEMM that reaches the tensor cores out of the intended
# order (1: QK0, 2: QK0, 1: QK1 PV0, 2: QK1 PV0, ...). The tests run it for 0-6 KV tiles, batch and
# packed; here for three, then with the pair issued the other way round in warpgroup 1.

# %%
kernel10 = kernel_class(cutlass.BFloat16, 128)
programs = [turns.overlap_program(kernel10, wg, 3, zero_rows=False) for wg in (1, 2)]
spell = {"sync": "bar.sync {}", "arrive": "bar.arrive {}", "gemm": "{}"}
nb.table(
    ("warpgroup", "program: named barriers (2, 3: the turns; 1: all consumers) and GEMMs"),
    [
        (wg, ", ".join(spell[k].format(a.split(": ")[-1] if k == "gemm" else a) for k, a in p))
        for wg, p in zip((1, 2), programs)
    ],
)
print("tensor cores, intended order:", ", ".join(turns.overlap_order(3)))
problems = turns.explore(programs, turns.overlap_order(3))
print("problems in any interleaving:", problems or "none")
assert problems == set()

# The same with warpgroup 1's loop issuing PV_0 before QK_1: the model must object.
swapped = [list(p) for p in programs]
i = swapped[0].index(("gemm", "1: QK1"))
swapped[0][i], swapped[0][i + 1] = swapped[0][i + 1], swapped[0][i]
problems = turns.explore(swapped, turns.overlap_order(3))
print("PV before QK in warpgroup 1:", sorted(problems))
assert problems

# %% [markdown]
# ### 5.4 Before and after, in the model
#
# The schedule model of notebook 9 (`figures.attention_schedule`) with durations from the
# FlashAttention-3 paper's H100 throughputs (989 TFLOP/s of matrix multiply, 3.9 T exponentials
# per second, 132 SMs) for this kernel's tile, counting only the exponentials of the softmax.
# Top: stage 9; bottom: stage 10; D = 64, where a softmax takes about twice as long as a GEMM.

# %%
fig = figures.overlap_timelines(head_dim=64, block_n=bN, rows=64, steps=3)

# %%
model_rows = []
for D_ in (64, 128):
    qk, sm, pv = figures.hopper_unit_times(D_, bN, 64)
    ends = {}
    for steps in (4, 8):
        for label, overlap in (("stage 9", False), ("stage 10", True)):
            r = figures.attention_schedule(
                True, steps, qk, sm, pv, D_ // 16, bN // 16, overlap=overlap
            )
            ends[label, steps] = r["end"]
    per_tile = {s: (ends[s, 8] - ends[s, 4]) / 4 for s in ("stage 9", "stage 10")}
    model_rows.append(
        (
            D_,
            f"{qk:.0f} / {sm:.0f}",
            f"{ends['stage 9', 8]:.0f} / {ends['stage 10', 8]:.0f}",
            f"{per_tile['stage 9']:.0f} / {per_tile['stage 10']:.0f}",
        )
    )
nb.table(
    ("D", "one GEMM / one softmax (ns)", "8 KV tiles, stage 9 / 10 (ns)", "per extra KV tile (ns)"),
    model_rows,
)

# %% [markdown]
# In this model the overlap gains nothing per KV tile: the time of one more tile is the same
# for both stages at both head dims. The model's shared units are the tensor cores and the
# exponential units, and ping-pong alone already keeps the busier of the two busy in the steady
# state (the tensor cores at D = 128, the exponential units at D = 64); stage 10 only starts the
# first softmax earlier, a fixed amount per pass. So whatever the overlap gains on the hardware
# comes from what the model leaves out: the latency between issuing a wgmma and seeing its
# result (stage 9's warpgroup waits for $PV_j$ and $QK_{j+1}$ before its softmax, stage 10's only
# for $QK_j$), and the softmax's FMA and ALU work next to its exponentials. Section 7 has the
# measurement, and exercise 4 stretches the model.

# %% [markdown]
# ### 5.5 What the compiler produced
#
# The Hopper kernel for sm_90a (both modes): twice stage 9's `wgmma.mma_async` and `ex2.approx` (the
# prologue and the loop each hold a QK^T and a softmax; the loop and the last step each a PV), and a
# `wgmma.wait_group 1` in the loop. The register count is that of the kernel's entry, 65,536 / 384
# threads rounded down to a multiple of 8 = 168; `setmaxnreg` then moves the consumers to 240. ptxas
# of CUDA 13.0 reports no spill at D = 64 or 128, bf16 or fp16, batch or packed, causal
# (`tests/test_stage10_hopper.py` fails on one); the compile summary below leaves spills uncounted
# where the installed ptxas cannot read the DSL's PTX.
#
# **What the machine code does with the wait.** The PTX puts `wgmma.wait_group 0` after the whole
# softmax. ptxas schedules the machine code, and it moves a wgmma wait up to the top of its basic
# block: in the SASS (the GPU's machine code, which ptxas makes from the PTX; `cuobjdump -sass`
# prints it) of this loop at D = 128 the wait for $PV_{j-1}$ stands right after the mask, so of the
# softmax only the mask runs under the warpgroup's own $PV_{j-1}$, and only on a tile that needs one
# (SASS read from ptxas of CUDA 13.0 on the H200, 2026-12-02, in stage 12's kernel without tuning 6,
# whose loop is this stage's). Stage 12's tuning 6 gives the wait a block of its own after the row
# max (notebook 12); this stage keeps the plain program order, the lesson, and section 7 shows what
# that costs at D = 128. How the wait was found in the SASS, and what else was tried:
# [`docs/notes/stage10.md`](../docs/notes/stage10.md).

# %%
report = nb.compile_summary(10, "hopper")

# %%
if report is not None:
    for pattern in (r"wgmma\.wait_group", r"setmaxnreg"):
        print("\n".join(ptx_lines(report.ptx, pattern, limit=4)))
    r9 = nb.compile_report(9, "hopper")
    if r9 is not None:
        for name in ("wgmma.mma_async", "ex2.approx", "wgmma.wait_group"):
            print(f"{name}: stage 9 {r9.counts[name]}, stage 10 {report.counts[name]}")

# %% [markdown]
# ### 5.6 The same stage on Blackwell
#
# On Blackwell, stage 10 changes the MMA warp's order to FA4's: for each Q tile it issues
# $P_{j-1} V_{j-1}$ and right behind it $S_j = Q K_j^{\top}$, without waiting for that PV to
# complete (only for the softmax to have read $S_{j-1}$), so each softmax warpgroup finds its
# next S ready after two GEMMs while the other Q tile's two GEMMs keep the tensor core busy. The new S must not land
# on a P that a PV may still read, and PTX keeps two `tcgen05.mma` of one thread in order only
# when they share the accumulator: at D = 64 P gets TMEM columns of its own (the first map
# below), at D = 128 S and O fill all 512 columns and P lies over S (the second map), and the
# docstring says which order each head dim takes. The stage also takes FA4's conditional
# rescale: O is rescaled only when the growth of a row's max scales its exponentials by more
# than $2^8$.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors, their PTX is checked and the
# hand-offs between the warp roles are replayed on the CPU by `common/tools/schedule.py`. Their
# numerics are tested only where an sm_100 GPU exists, and no number in this notebook was
# measured on Blackwell.

# %%
nb.show_docstring(10, "blackwell")
nb.show_diff(10, "blackwell", max_lines=120)

# %%
rows = nb.cross_track_table(10)
report_bw = nb.compile_summary(10, "blackwell")
if report_bw is not None:
    from common.tools.ptx import tcgen05_mma_order  # noqa: E402

    # The MMA warp's order, read from the PTX: stage 9 and stage 10 at D = 64, stage 10 at 128.
    orders = [
        (f"stage {n}, D = {d}", nb.compile_report(n, "blackwell", shape=(2, 4, 512, 1024, d)))
        for n, d in ((9, 64), (10, 64), (10, 128))
    ]
    fig = figures.mma_issue_orders(
        [(label, tcgen05_mma_order(r.ptx)) for label, r in orders if r is not None],
        [{"Q": 4, "P": 8}, {"Q": 4, "P": 8}, {"Q": 8, "P": 8}],
        notes=[
            "per KV tile: QK of Q tile 0, of Q tile 1, then PV 0, PV 1",
            "prologue QK0 QK1 | per later KV tile: PV0 QK0 PV1 QK1 | last PV0 PV1",
            "D = 128: as the docstring says",
        ],
    )
    # TMEM at D = 64 and D = 128, from the kernel objects' own column offsets.
    bw10 = stage_table.track_module(10, "blackwell")
    for D_bw in (64, 128):
        kernel_bw, _ = bw10.compile_args(torch.bfloat16, (1, 1, 256, 256, D_bw))
        fig = figures.tmem_two_tiles(vars(kernel_bw))

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** the checks of stages 7-9, unchanged (a few $10^{-3}$ relative error, within 3x
# PyTorch's own bf16 error; rows that see no key O = 0 and LSE = -inf; NaN planted around packed
# sequences never leaks in), and O and LSE equal to stage 9's bit for bit.

# %%
result = nb.run_and_verify(10, (2, 4, 512, 1024, 128))
checks = nb.run_and_verify_cases(
    10,
    list(nb.MASK_CASES)
    + [
        ("GQA 8 / 2, causal", (2, 8, 300, 700, 128), dict(kv_heads=2, causal=True)),
        ("MQA 8 / 1, D = 64", (1, 8, 520, 520, 64), dict(kv_heads=1)),
    ],
)
packed_checks = nb.run_and_verify_varlen(
    10, [200, 77, 0, 300, 1], [130, 190, 5, 129, 260], heads=4, kv_heads=2, causal=True
)

# %%
if nb.MODE == "gpu" and nb.available(9, nb.TRACK) and nb.available(10, nb.TRACK):
    from common.tools import inputs

    q, k, v = inputs.attention_inputs(2, 8, 1000, 1000, 128, seed=5)
    o9, lse9 = stage_table.track_module(9, nb.TRACK).attention(
        q, k, v, causal=True, return_lse=True
    )
    o10, lse10 = stage_table.track_module(10, nb.TRACK).attention(
        q, k, v, causal=True, return_lse=True
    )
    torch.cuda.synchronize()
    same = torch.equal(o9, o10) and torch.equal(lse9, lse10)
    print(
        f"stage 10 == stage 9 bit for bit: O {torch.equal(o9, o10)}, LSE {torch.equal(lse9, lse10)}"
    )
    assert same, "stage 10 must give stage 9's O and LSE bit for bit"
else:
    print("the bit-for-bit comparison with stage 9 needs GPU mode")

# %%
fig = nb.error_picture(10, result)

# %% [markdown]
# ## 7. Measure
#
# **Expected**, from `make bench` on an NVIDIA H200 (2026-12-04, bf16, paper shapes
# B·S = 16k, H·D = 2048; every kernel of a row timed in the same interleaved rounds, event-timed,
# and again in GPU time alone from CUPTI kernel durations;
# `docs/results/ablation_h200_2026-12-04.md`). The cell reads the rows from S = 2k out of the
# run's `.json` file: stage 9, stage 10 and FA4 in TFLOP/s, the step 10 / 9 both ways, and
# stage 10 against FA4 (event time).

# %%
with open(os.path.join(nb.ROOT, "docs/results/ablation_h200_2026-12-04.json")) as f:
    ablation = json.load(f)
h200 = {
    (r["stage"], r["shape"][4], bool(r["shape"][5]), r["shape"][2]): r["tflops"]
    for r in ablation["rows"]
    if r["stage"] in ("ablation", "ablation GPU time")
}
step_rows = []
for (kind, D_, causal, S_), t in sorted(h200.items(), key=lambda kv: (-kv[0][1], *kv[0][2:])):
    if kind != "ablation" or S_ < 2048:
        continue
    gpu = h200[("ablation GPU time", D_, causal, S_)]
    step_rows.append(
        (
            D_,
            causal,
            S_,
            f"{t['stage 9']:.0f}",
            f"{t['stage 10']:.0f}",
            f"{t['FA4']:.0f}",
            f"{t['stage 10'] / t['stage 9']:.3f}",
            f"{gpu['stage 10'] / gpu['stage 9']:.3f}",
            f"{t['stage 10'] / t['FA4']:.2f}",
        )
    )
print(f"{ablation['gpu']}, {ablation['date']}, torch {ablation['torch']}")
nb.table(
    ("D", "causal", "S", "stage 9", "stage 10", "FA4", "10 / 9", "10 / 9 GPU time", "10 / FA4"),
    step_rows,
)

# %%
fig = figures.measured_ratios(
    ablation["rows"],
    [("stage 10", "stage 9")],
    f"Stage 10 / stage 9, paper shapes ({ablation['gpu']}, {ablation['date']}, bf16)",
)

# %% [markdown]
# **What the table says** (H200, 2026-12-04). At D = 64 the overlap pays: +2.9% to +6.5% from S = 2k
# in event time, +2.8% to +5.4% in GPU time alone, causal and not. At D = 128 it does not: in GPU
# time alone stage 10 is 0.5-1.6% slower than stage 9 at every length from 2k; event-timed the step
# runs from 0.92 (non-causal S = 16k: 637 TFLOP/s against stage 9's 689) to 1.005 (causal 16k). The
# two timings of one row differ by up to 0.06 (non-causal 16k: 0.92 event-timed, 0.98 in GPU time),
# so a step of a few percent is not settled by one of them; the GPU-time column is the steadier one.
# The FlashAttention-3 paper measured this step on an H100 SXM5 (its Table 2: FP16, non-causal,
# batch 4, 8448 tokens, 16 heads of 128, the GPU clock fixed at 1830 MHz): 582 TFLOP/s with warp
# specialisation and without the GEMM-softmax pipelining, 661 with both, +14%.
#
# Why so much less here, and nothing at D = 128: section 5.5's machine code. In the SASS the wait
# for $PV_{j-1}$ stands before the row max and the exponentials, so the softmax this stage means to
# run under $PV_{j-1}$ mostly runs after it, while the warpgroup now keeps $P_{j-1}$ live through
# its softmax and commits two groups per step. What is left of the overlap is the mask and the
# earlier start of each QK^T; at D = 64, where the exponentials set the pace, that is worth a few
# percent. Stage 12's tuning 6 (notebook 12) puts the wait behind the row max at D = 128: on the
# same H200 the same day, that one tuning measured +2.4% to +4.1% non-causal and +1.3% to +3.6%
# causal at S = 2k, 8k and 16k (`docs/results/tunings_h200_2026-12-04.md`). Stage 10 itself runs at
# 0.87-0.95x FA4 at D = 128 and 0.77-0.84x at D = 64 from 2k (event time, the last column); stages
# 11 and 12 close most of that gap.
#
# In GPU mode the cell below times stage 10 against stage 9 and FA4 in this run.

# %%
bench = nb.measure(
    10,
    [
        (8, 16, 2048, 2048, 128),
        (2, 16, 8192, 8192, 128),
        (8, 32, 2048, 2048, 64),
        (2, 32, 8192, 8192, 64),
    ],
    also_stages=(9,),
    with_fa4=True,
)

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU; where a GPU adds a measurement, the exercise says which call makes it.
#
# 1. **Why wait_group(1).** After issuing $QK_j$ and $PV_{j-1}$ as two commit groups, the
#    warpgroup waits with `wait_group(1)` before the softmax. What would `wait_group(0)` there
#    cost? And what would go wrong with the two GEMMs issued in the other order?
# 2. **The register budget.** At D = 64, stage 12 runs three consumer warpgroups of 160
#    registers each (128 x 24 + 384 x 160 = 64,512 of the SM's 65,536). Do stage 10's three
#    live register sets ($S_j$, $P_{j-1}$ and O) fit in 160 at D = 64? At D = 128?
# 3. **A lost pass.** Remove warpgroup 1's pass after its last PV from the programs of 5.3 and
#    explore again. What does the model report, and what would the kernel do?
# 4. **The model and the measurement.** Stretch the softmax in the model (`exp_tflops` of
#    `figures.hopper_unit_times` lower) and compare the time per extra KV tile of stages 9 and
#    10. When does the overlap gain per tile in the model, and what would the model need to show
#    the gain measured at D = 64?
# 5. **Bit for bit.** Stage 10 issues every PV one step later than stage 9, behind the next
#    tile's QK^T. Why does that not change a single bit of O?
# 6. **The order of the pair** (exercise 10a, an edit of the Hopper stage file): issue
#    $PV_{j-1}$ before $QK_j$ in `mma_one_n_block`. The cells at the end of the notebook give the
#    task and check the edit.
#
# ### Answers and checks
#
# <details><summary>1. Why wait_group(1)</summary>
#
# `wait_group(0)` waits for $PV_{j-1}$ as well, so the softmax would start only after both GEMMs:
# the step would be serial again, stage 9's order with more registers. Issued the other way
# round ($PV_{j-1}$ committed first), the group still pending after `wait_group(1)` would be
# $QK_j$: as written, the softmax would read `acc_S` while the tensor cores may still write it.
# ptxas catches this one (C7514) and serialises the wgmma, so the answer stays right and the
# overlap is lost; a compiler that did not would give wrong numbers, not a hang. The turn model
# of 5.3 also sees the tensor cores take the GEMMs in another order than intended; the PTX check
# in the tests pins the order (QK group, PV group, pass, `wait_group 1`, `wait_group 0`).
# </details>
#
# <details><summary>2. The register budget</summary>
#
# At D = 64: S 64 + P 32 + O 32 = 128 registers per thread of the 160, leaving 32 for addresses,
# loop counters and the softmax statistics - tight, which is why stage 12's three-warpgroup
# kernel is checked for spills. At D = 128: 64 + 32 + 64 = 160, all of it, with nothing left for
# the rest: stage 12 keeps two consumer warpgroups of 240 registers there. The cell below prints
# the arithmetic.
# </details>
#
# <details><summary>3. A lost pass</summary>
#
# Warpgroup 2 waits before its last PV for a turn that nobody passes any more: the model reports
# a deadlock (and, depending on the interleaving, barrier arrivals left over). The kernel would
# hang until the test's deadline. The cell below removes the pass and explores.
# </details>
#
# <details><summary>4. The model and the measurement</summary>
#
# The cell below scans the softmax length. At both head dims the time per extra KV tile of the
# two stages stays within 1% of each other, however long the softmax: the exponential units,
# shared by the two warpgroups, or the tensor cores bound both stages, and one softmax and two
# GEMMs per warpgroup and tile have to run on them either way. To show the gain measured at
# D = 64 the model would need what it leaves out: the latency from issuing a wgmma to its
# result, the softmax's work on the FMA and ALU pipes of each warpgroup, and the cost of the
# waits. A model is a tool for one effect; the measurement decides.
# </details>
#
# <details><summary>5. Bit for bit</summary>
#
# Each O row goes through the same operations in the same order in both stages: O is set to 0,
# then for each KV tile $O \leftarrow O \cdot$ `row_scale` followed by $O \leftarrow O + P V$.
# Stage 10 delays each $PV$ by one step but still applies it after the rescale of its own tile
# and before the next tile's rescale, since `mma_one_n_block` calls `rescale_o_and_convert_p` only
# after `wait_group(0)` has seen $PV_{j-1}$ complete. The
# same floating-point operations on the same values in the same order give the same bits;
# `tests/test_stage_chain.py` checks it on the H200.
# </details>
#
# <details><summary>6. The order of the pair (10a)</summary>
#
# `wait_group(1)` now waits for $PV_{j-1}$ only: $QK_j$, the newest group, may still run when
# the softmax reads `acc_S`. The check reads the order of the wgmma groups from the PTX and runs
# the turn model of 5.3 with the pair in that order: the tensor cores take each turn's GEMMs the
# other way round, and the softmax's reads of S are no longer covered by a wait. Where ptxas is
# installed the check also shows its warning C7514: it serialises the wgmma because registers of
# a running wgmma are read, so the edited kernel still gives the right O while nothing overlaps
# any more. The check's message with that warning, from a CPU-only machine (ptxas of CUDA 13.0,
# 2026-12-07): `docs/results/exercise_10a_ptxas_cpu_2026-12-07.txt`; the edited kernel's O right
# on an H200 (2026-12-04: `tests/test_exercises.py` passes only then,
# `docs/results/exercises_h200_2026-12-04_8a-10a.txt`). On a GPU the check runs it and says so.
# </details>

# %%
# Exercise 2: registers live during the softmax against the budget of a consumer thread.
for D_, budget in ((64, 160), (128, 160), (128, 240)):
    live = 64 + 32 + D_ // 2
    print(f"D = {D_}: S 64 + P 32 + O {D_ // 2} = {live} of {budget}: {budget - live} left")

# Exercise 3: warpgroup 1's last pass lost.
lost = [list(p) for p in programs]
last_pass = max(i for i, op in enumerate(lost[0]) if op[0] == "arrive")
del lost[0][last_pass]
found = sorted(turns.explore(lost, turns.overlap_order(3)))
_, stuck = turns.issue_order(lost)
print("without warpgroup 1's last pass:", "; ".join(turns.problem_kinds(found)) or "no problem")
print("where the warpgroups stop:", stuck or "they finish")

# Exercise 4: the model's time per extra KV tile against the softmax's length.
for D_ in (64, 128):
    for stretch in (1.0, 1.5, 2.5):
        qk, sm, pv = figures.hopper_unit_times(D_, bN, 64, exp_tflops=3.9 / stretch)
        per_tile = []
        for overlap in (False, True):
            ends = [
                figures.attention_schedule(
                    True, n, qk, sm, pv, D_ // 16, bN // 16, overlap=overlap
                )["end"]
                for n in (4, 8)
            ]
            per_tile.append((ends[1] - ends[0]) / 4)
        print(
            f"D = {D_}, softmax {sm:.0f} ns (GEMM {qk:.0f} ns): per extra KV tile "
            f"stage 9 {per_tile[0]:.0f} ns, stage 10 {per_tile[1]:.0f} ns"
        )

# %% [markdown]
# ### Exercise 10a: the order of the pair
#
# The first cell gives the task; the second loads the stage file as it is on disk now, compiles
# it (no GPU needed) and says "done" or "not yet" with the tensor-core order it found. On the
# committed file it says "not yet". Both lines of the task also stand outside the loop's step
# (the prologue issues $QK_0$ alone, the last turn $PV$ alone): move the pair in
# `mma_one_n_block` only.

# %%
nb.exercise("10a")

# %%
nb.check_exercise("10a")

# %% [markdown]
# **Next:** `make diff-11` shows what stage 11 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage11_persistent.ipynb`](stage11_persistent.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage10.md`](../docs/notes/stage10.md).
