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
# # Stage 9 - ping-pong: the two consumer warpgroups take turns on the tensor cores
#
# This notebook walks through `stages/stage9_pingpong/hopper.py`: stage 8's warp-specialised
# kernel with FlashAttention-3's second schedule technique. Stage 8's two consumer warpgroups run
# the same instructions at the same time, so they wait for the tensor cores together and then
# compute their exponentials together while the tensor cores idle. Here they take turns: two named
# barriers hand the tensor cores from one warpgroup to the other, so that one warpgroup's softmax
# runs while the other's GEMMs hold the tensor cores. A turn is $PV_j$ and $QK_{j+1}$, issued back
# to back. The arithmetic does not change: O and LSE are stage 8's bit for bit. The notebook
# imports the stage file and displays it; it never pastes kernel code.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage9_pingpong.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* say they are skipped; everything else (the
# turn model, the timelines, the compile summaries) runs in both modes. Source:
# `notebooks/source/stage9_pingpong.py`.

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

from common.tools import notebook as nb  # noqa: E402
from common.tools import stage_table, turns  # noqa: E402
from common.tools.ptx import ptx_lines, tcgen05_mma_order  # noqa: E402
from notebooks.figures import stage9 as figures  # noqa: E402

nb.start(9)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - say why stage 8's two consumer warpgroups collide on the tensor cores and on the exponential
#   units, and what taking turns buys, from the two units' times per KV tile;
# - read a named barrier (`bar.sync` and `bar.arrive` with a thread count) and the four the kernel
#   uses: 0 for the CTA, 1 for the consumer warpgroups, 2 and 3 for the turns (`wait_turn`,
#   `pass_turn`);
# - say what a turn is - $PV_j$ and $QK_{j+1}$, issued back to back, one wait for both - and what
#   it costs ($V_j$'s slot is released one step later);
# - count the turns: `steps + 1` per warpgroup, barrier 2 completing `steps` times and barrier 3
#   `steps + 1`, no arrive left over;
# - run the CPU model of the turns on the kernel object, every interleaving of the two
#   warpgroups, and watch it report the deadlock of a lost turn;
# - draw the schedule model's timelines of stage 8 and stage 9 and say what the model leaves out;
# - read what the step measured on the H200 (2026-12-04).
#
# ## 2. Previous stage recap
#
# Stage 8 split the CTA into roles: warpgroup 0 the producer (one thread issues every TMA load,
# `setmaxnreg` down to 24 registers), warpgroups 1 and 2 the consumers (64 query rows each,
# `setmaxnreg` up to 240). The K/V ring has as many slots as fit in shared memory (6 at D = 128),
# every load is a ring entry of its own, and the producer runs up to 3 KV tiles ahead; the
# barriers' arrival counts and parities were checked on the CPU, every interleaving of the three
# warpgroups. Each consumer warpgroup runs stage 7's step on its own: $QK_j$, wait, softmax,
# $PV_j$, wait. Nothing orders the two warpgroups' GEMMs.
#
# ## 3. The math
#
# ### 3.1 Two shared units
#
# Per KV tile each consumer warpgroup runs two GEMMs on the tensor cores, $S = QK_j^{\top}$ and
# $O \mathrel{+}= PV_j$, $2 \cdot 64 \cdot 128 \cdot D$ FLOPs each, and one exponential per score
# on the special-function units, $64 \cdot 128$ of them. The FlashAttention-3 paper counts, for an
# H100 SXM5, 989 TFLOP/s of bf16 matrix multiply against 3.9 TFLOP/s of special functions, over
# 132 SMs (datasheet rates, not measurements; the H200's are the H100's). Per SM:
#
# $$t_{\text{GEMM}} = \frac{2\cdot 64\cdot 128\cdot D}{989\,\text{TFLOP/s}/132}, \qquad
# t_{\exp} = \frac{64\cdot 128}{3.9\,\text{T/s}/132}.$$
#
# **In step** (stage 8: nothing holds the two warpgroups apart, and they start together on the
# same work) both use the same unit at the same time: each phase takes twice as long and the other
# unit idles, about $2\,(t_{QK} + t_{\exp} + t_{PV})$ per KV tile. **In turns** one warpgroup's
# softmax runs while the other's GEMMs hold the tensor cores: about
# $\max\big(2\,(t_{QK} + t_{PV}),\ 2\,t_{\exp}\big)$. These count the exponentials only; the max,
# sum, scaling and conversions of the softmax, the rescale of O, the loads and every latency are
# left out, so the ratio is an upper bound on what turns can give.

# %%
rows = []
for D in (64, 128):
    t_qk, t_exp, t_pv = figures.hopper_unit_times(head_dim=D)
    in_step = 2 * (t_qk + t_exp + t_pv)
    in_turns = max(2 * (t_qk + t_pv), 2 * t_exp)
    rows.append(
        (D, f"{t_qk:.0f}", f"{t_exp:.0f}", f"{in_step:.0f}", f"{in_turns:.0f}")
        + (f"{in_step / in_turns:.2f}x",)
    )
nb.table(
    (
        "D",
        "one GEMM, ns",
        "one softmax (exp only), ns",
        "in step, per KV tile",
        "in turns, per KV tile",
        "model gain",
    ),
    rows,
)

# %% [markdown]
# ### 3.2 Named barriers and counting the turns
#
# A named barrier (16 per CTA, `bar.sync id, n` / `bar.arrive id, n`) completes when `n` threads
# have arrived at it: `bar.sync` arrives and waits for the completion, `bar.arrive` arrives and goes
# on. Barrier $1 + w$ is consumer warpgroup $w$'s turn. `wait_turn` is a `bar.sync` of 256
# threads on the warpgroup's own barrier, `pass_turn` a `bar.arrive` of 256 on the next
# warpgroup's: each completion is this warpgroup's 128 threads waiting plus the other's 128
# passing, one turn handed over.
#
# Per work tile of `steps` KV tiles a warpgroup takes `steps + 1` turns: $QK_{lo}$ alone, then
# `steps - 1` pairs $PV_{j-1}, QK_j$, then the last PV alone. Warpgroup 1 takes turn 0 without
# waiting (it starts), warpgroup 2 passes nothing after its last turn (nobody follows), so
#
# $$\text{barrier 2: } \underbrace{\texttt{steps}}_{\text{warpgroup 1 waits}} = \underbrace{\texttt{steps}}_{\text{warpgroup 2 passes}}, \qquad
#   \text{barrier 3: } \underbrace{\texttt{steps} + 1}_{\text{warpgroup 2 waits}} = \underbrace{\texttt{steps} + 1}_{\text{warpgroup 1 passes}} .$$
#
# Every arrive is matched by a wait: no barrier is left half-arrived when the CTA ends (a pending
# arrive would be a hang, or state leaking into the next CTA on the SM).

# %% [markdown]
# ## 4. What changes
#
# The docstring gives the changes with their numbers; then the kernel class's diff against stage 8
# (`make diff-9 TRACK=hopper` shows the whole files): two methods that wait for and pass a turn
# (`wait_turn`, `pass_turn`) and two that number the barriers (`turn_barrier`, `next_warpgroup`),
# their calls in `mma_one_n_block` and after the loop in `mma_tile`, the arguments that carry what
# they need (`steps` and `warpgroup_idx` into `mma_tile`; `kv_tile_lo`, `v_state` and
# `warpgroup_idx` into `mma_one_n_block`), the picture of the turns in `mma_tile`'s comment, and
# $V_j$'s release moved to the next step.

# %%
nb.show_docstring(9, "hopper")

# %%
nb.show_diff(9, "hopper")

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The turn barriers
#
# `wait_turn` and `pass_turn` are one instruction each; `turn_barrier` and `next_warpgroup` are
# plain arithmetic on a warpgroup number, so the CPU model of 5.3 calls the same two methods. The
# table gives every named barrier of the kernel and who takes part.

# %%
nb.show_source(
    9,
    "hopper",
    names=[
        "Sm90Kernel.wait_turn",
        "Sm90Kernel.pass_turn",
        "Sm90Kernel.turn_barrier",
        "Sm90Kernel.next_warpgroup",
    ],
)
kernel9 = None
if nb.available(9, "hopper"):
    mod9 = stage_table.track_module(9, "hopper")
    kernel9, _ = mod9.compile_args(torch.bfloat16, (2, 4, 512, 1024, 128))
    nb.table(
        ("named barrier", "threads", "who", "what for"),
        [
            (0, 384, "the whole CTA", "after the mbarriers are initialised (once)"),
            (1, 256, "both consumer warpgroups", "the epilogue (twice), zero_rows (packed)"),
        ]
        + [
            (
                kernel9.turn_barrier(w),
                256,
                f"warpgroup {w} waits, warpgroup {3 - w} passes",
                f"warpgroup {w}'s turn (next_warpgroup({w}) = {kernel9.next_warpgroup(w)})",
            )
            for w in (1, 2)
        ],
    )

# %% [markdown]
# ### 5.2 The loop with turns
#
# In `mma_one_n_block` (step $j$) the warpgroup waits for $K_j$, warpgroup 2 waits for turn 0
# before its first $QK$, it issues $QK_j$ and passes the turn at once - the other warpgroup's pair
# queues behind its own - and only then waits (`wait_group 0`), for $QK_j$ and for the $PV_{j-1}$
# issued just before it in the same turn. It releases $K_j$'s and $V_{j-1}$'s slots, runs its
# softmax while the other warpgroup holds the tensor cores, waits for $V_j$, waits for its next
# turn and issues $PV_j$ - and does not wait: $QK_{j+1}$, at the top of the next step, goes out
# right behind it. After the loop, warpgroup 1 passes the last turn on, and both wait for the last
# PV. `mma_tile`'s comment (in the diff above) draws the turns for `steps = 2`.

# %%
nb.show_source(9, "hopper", names=["Sm90Kernel.mma_one_n_block"])

# %% [markdown]
# ### 5.3 The turns on the CPU
#
# A lost or extra arrive on a named barrier hangs the kernel - or worse, leaves an arrive pending
# that completes some later, unrelated barrier. `common/tools/turns.py` models each consumer
# warpgroup as its program of `bar.sync`, `bar.arrive` and GEMMs in the kernel's order, with the
# barrier numbers of the kernel object's `turn_barrier` and `next_warpgroup`, and explores
# **every interleaving** of the two programs under named-barrier rules. It reports a deadlock, an
# arrive left over at the end, a warpgroup arriving twice in one phase, and a GEMM that reaches
# the tensor cores out of turn. The programs for a work tile of 2 KV tiles:

# %%
if kernel9 is not None:
    for wg in (1, 2):
        ops = turns.pingpong_program(kernel9, wg, 2)
        print(f"warpgroup {wg}: " + ", ".join(f"{k} {a}" for k, a in ops))

# %% [markdown]
# The order of these operations is the PTX's: `tests/test_stage9_hopper.py` reads the compiled
# kernel's sequence of named barriers and wgmma (`turns.schedule_string`) and requires it to be
# this one, and the cell below reads which of the four turn operations the PTX performs. Then the
# model, for work tiles of 0 to 5 KV tiles: the states it visits, what it finds, the completions of
# each turn barrier, and the tensor cores' order.

# %%
if kernel9 is not None:
    report9 = nb.compile_report(9, "hopper")
    if report9 is not None:
        print("PTX order:", turns.schedule_string(report9.ptx))
        print("turn operations in the PTX:", turns.pingpong_turn_ops(report9.ptx))
    rows = []
    for steps in range(6):
        programs = [turns.pingpong_program(kernel9, wg, steps) for wg in (1, 2)]
        stats = {}
        found = turns.explore(programs, turns.pingpong_order(steps), stats=stats)
        waits = {b: sum(op == ("sync", b) for p in programs for op in p) for b in (2, 3)}
        passes = {b: sum(op == ("arrive", b) for p in programs for op in p) for b in (2, 3)}
        order, _ = turns.issue_order(programs)
        rows.append(
            (
                steps,
                stats["states"],
                "; ".join(sorted(found)) or "none",
                f"{waits[2]} / {passes[2]}",
                f"{waits[3]} / {passes[3]}",
                ", ".join(order) if steps <= 2 else f"{len(order)} GEMMs, in turn",
            )
        )
    nb.table(
        (
            "steps",
            "states",
            "problems",
            "barrier 2: waits / passes",
            "barrier 3: waits / passes",
            "tensor cores' order",
        ),
        rows,
    )

# %% [markdown]
# The model must also fail. Below, each of the four turn operations in turn is left out of both
# programs, as if deleted from the kernel; the last column follows one interleaving to where the
# warpgroups stop. (Exercise 9a deletes one from the kernel file itself; the check reads the PTX
# and runs this model.)

# %%
if kernel9 is not None:
    rows = []
    for lost in turns.TURN_OPS:
        kept = tuple(op for op in turns.TURN_OPS if op != lost)
        programs = [turns.pingpong_program(kernel9, wg, 3, turn_ops=kept) for wg in (1, 2)]
        found = sorted(turns.explore(programs, turns.pingpong_order(3)))
        _, stuck = turns.issue_order(programs)
        rows.append((lost, "; ".join(turns.problem_kinds(found)) or "none", stuck or "finishes"))
    nb.table(("turn operation lost", "what the model reports", "one interleaving"), rows)

# %% [markdown]
# ### 5.4 The schedule, drawn
#
# A second model puts times on it: `figures.attention_schedule` runs the two warpgroups' programs
# on a clock, with the tensor cores serving wgmma instructions in the order they were issued (two
# warpgroups issuing at once interleave theirs) and the exponential units shared between the
# warpgroups computing a softmax, the durations those of 3.1 for the kernel's tile. Top: stage 8,
# the two warpgroups in step (the model starts their QK and PV together; nothing in stage 8 holds
# them apart). Bottom: stage 9's turns. The tensor-core lane is split in one half per warpgroup;
# hatched GEMMs share the tensor cores with the other warpgroup's at the same time, dotted
# softmaxes share the exponential units.

# %%
cfg = nb.show_config(9, "hopper")
bM, bN, D = cfg.get("cta_tile", (128, 128, 128))
rows_per_wg = bM // cfg.get("mma_warpgroups", 2)
fig = figures.pingpong_timelines(head_dim=D, block_n=bN, rows=rows_per_wg, steps=3)
for steps in (0, 1, 2, 5):
    r = figures.attention_schedule(True, steps)
    want = {2: steps, 3: steps + 1 if steps else 0}
    print(f"steps = {steps}: completions {r['turns']} (3.2: {want}), arrives left {r['pending']}")

# %% [markdown]
# Inside a turn the two GEMMs go out back to back: the warpgroup issues $PV_j$, does not wait for
# it, issues $QK_{j+1}$, passes the turn and only then waits, once for both. FlashAttention-3's
# kernel without the intra-warpgroup overlap waits for $PV_j$ before it issues $QK_{j+1}$; the
# tensor cores then sit idle while the warpgroup holding the turn sees $PV_j$ complete and issues
# again, and the other warpgroup cannot fill the gap, since it waits for the turn. The price of
# the single wait: $V_j$'s slot is released one step later, one ring entry less of lead for the
# producer. The model above charges nothing for a wait, so it would draw both orders alike; give it
# a cost for seeing a wgmma complete and issuing again (30 ns below, an illustrative figure: the
# kernel's own is not measured) and the gap in the turn appears:

# %%
fig = figures.pingpong_timelines(
    head_dim=D, block_n=bN, rows=rows_per_wg, steps=3, compare="wait for PV", wait_latency=30
)

# %% [markdown]
# ### 5.5 What the compiler produced
#
# The Hopper kernel for sm_90a: stage 8's instructions plus the named barriers of the turns - two
# `bar.sync` and two `bar.arrive` of 256 threads on a register (the barrier number is
# `turn_barrier(warpgroup_idx)`, computed at run time) - and, at run time, one `wgmma.wait_group 0`
# per turn instead of one per GEMM (the PTX still holds two: one in the loop, one after it for the
# last PV). The letters print the PTX's order (0: the CTA's barrier, d/i:
# `setmaxnreg`, L: a TMA load, T: `wait_turn`, P: `pass_turn`, G: wgmma, C: commit, W: wait,
# B: barrier 1).

# %%
report = nb.compile_summary(9, "hopper")
if report is not None:
    for pattern in (r"bar\.sync", r"bar\.arrive", r"wgmma\.wait_group"):
        print("\n".join(ptx_lines(report.ptx, pattern, limit=4)))
    print("order:", turns.schedule_string(report.ptx))

# %% [markdown]
# ### 5.6 The same stage on Blackwell
#
# On Blackwell one thread issues every `tcgen05.mma`, so there is no turn to hand over; what stage
# 9 there does is FA4's answer to the same idle tensor core. Each CTA takes **two Q tiles** (2 x
# 128 rows) with S, P and O of each in tensor memory and a softmax warpgroup for each, and the MMA
# warp issues per KV tile $QK_0$, $QK_1$, then $PV_0$, $PV_1$: while softmax warpgroup 0 turns
# $S_0$ into $P_0$, the tensor core computes $S_1$, and the two warpgroups take turns. Four
# warpgroups now share the 65,536 registers: `setmaxnreg` gives each softmax warpgroup 184, the
# correction warpgroup 96 and the MMA, TMA and idle warps FA4's 48,
# $(2 \cdot 184 + 96 + 48) \cdot 128 = 65{,}536$. To fit, the MMA warp issues a GEMM's k-blocks in
# a loop (unrolled, the descriptors of every k-block of both Q tiles stayed live and spilled) and
# each role takes its work tile in its own branch; ptxas of CUDA 13.0 then reports no spill in
# any tested configuration (2026-12-06, `docs/notes/stage9.md`). The cells show the docstring,
# the kernel diff against Blackwell stage 8 (the start), the concept table, the compile summary,
# and three pictures drawn from the kernel's own settings and PTX: the roles, tensor memory, and
# the MMA warp's GEMMs in program order for stages 8 and 9 (stage 8 unrolls a GEMM's k-blocks,
# one `tcgen05.mma` each; stage 9 issues one in a loop).
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors, their PTX is checked and the
# hand-offs between their roles are replayed on the CPU (`common/tools/schedule.py`). Their
# numerics are tested only where an sm_100 GPU exists.

# %%
nb.show_docstring(9, "blackwell")
nb.show_diff(9, "blackwell", max_lines=60)

# %%
rows = nb.cross_track_table(9)
report_bw = nb.compile_summary(9, "blackwell")
cfg_bw = nb.show_config(9, "blackwell")
if cfg_bw:
    fig = figures.blackwell_two_tile_roles(cfg_bw)
    fig = figures.tmem_two_tiles(cfg_bw)
reports_bw = [nb.compile_report(n, "blackwell") for n in (8, 9)]
if cfg_bw and None not in reports_bw:
    D_bw = cfg_bw["pv_mma_tiler"][1]
    fig = figures.mma_issue_orders(
        [(f"stage {n}", tcgen05_mma_order(r.ptx)) for n, r in zip((8, 9), reports_bw)],
        {"Q": D_bw // 16, "P": cfg_bw["qk_mma_tiler"][1] // 16},
        notes=["per KV tile: QK, PV (one Q tile)", "per KV tile: QK0, QK1, then PV0, PV1"],
    )
    print("\n".join(ptx_lines(report_bw.ptx, r"setmaxnreg", limit=4)))

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** the checks of stage 7, unchanged: MHA in batch mode (a few $10^{-3}$ relative,
# within 3x PyTorch's own bf16 error), the masks of stage 6 including rows with no key, GQA and
# MQA, and a packed batch with NaN planted around each sequence (its `zero_rows` is the barrier 1
# that stands between turns). The turns change *when* each warpgroup issues, not *what* it
# computes, so O and LSE should equal stage 8's bit for bit; the last cell of this section
# compares them on one input.

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
# **Expected**, from the ablation of `make bench` on the H200 (2026-12-04, bf16, the paper shapes
# B·S = 16k, H·D = 2048; every kernel of a row timed in the same interleaved rounds;
# `docs/results/ablation_h200_2026-12-04.md`). The cell reads the rows from S = 2k out of the
# run's `.json` and prints stage 9 over stage 8, event-timed and from GPU time alone, and over
# FA4.

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
            f"{t['stage 8']:.0f}",
            f"{t['stage 9']:.0f}",
            f"{t['FA4']:.0f}",
            f"{t['stage 9'] / t['stage 8']:.2f}",
            f"{g['stage 9'] / g['stage 8']:.2f}",
            f"{t['stage 9'] / t['FA4']:.2f}",
        )
    )
nb.table(
    ("D", "mask", "S", "stage 8", "stage 9", "FA4", "9 / 8", "9 / 8 (GPU time)", "9 / FA4"),
    rows,
)
fig = figures.step_against_s(
    ablation["rows"],
    "stage 8",
    "stage 9",
    f"Stage 8 -> 9, TFLOP/s ({ablation['gpu']}, {ablation['date']}, bf16, event-timed)",
)

# %% [markdown]
# What the table says (H200, 2026-12-04): at D = 128 the turns gain 14-18% over stage 8
# non-causal and 11-18% causal from S = 2k (11-14% in GPU time), taking stage 9 to 0.94-1.03 of
# FA4 non-causal and 0.88-0.92 causal. At D = 64 they gain 3-8%, and stage 9 stays at 0.73-0.81
# of FA4. The model of 3.1 promised up to 1.50x at D = 128 and 1.99x at D = 64: it counts the
# exponentials as the whole softmax, and at D = 64, where a GEMM takes half as long, the rest of
# the softmax (the row max and sum, the scaling, the conversion of P, the rescale of O - work on
# the FP32 units that does not shrink with D) weighs most. Both warpgroups also still run their
# own softmax strictly after their own $QK_j$: stage 10 overlaps it with the warpgroup's own $PV$,
# and stage 12 gives D = 64 a third consumer warpgroup.
#
# The FlashAttention-3 paper (Shah et al., 2024) describes this schedule - its ping-pong
# scheduling of two warpgroups, through named barriers - as part of its warp-specialised design.
# Its ablation table (notebooks 8 and 10 quote it) switches off warp specialisation and the
# pipelining inside a warpgroup, not the ping-pong on its own, so no row of it sits beside this
# step.
#
# The cell below measures stage 9 against stage 8 and FA4 on this machine's GPU, all in one run.
# One such run moves by a few percent from the next: in this notebook's executed copy (H100 80GB
# HBM3, 2026-12-07) stage 9 read 1.16x stage 8 at D = 128 and 0.99x at D = 64, where the H100's
# ablation of 2026-12-06 read 1.17x and 1.05x at S = 8k
# ([`docs/results/ablation_h100_2026-12-06.md`](../docs/results/ablation_h100_2026-12-06.md)).

# %%
bench = nb.measure(
    9,
    [(2, 16, 8192, 8192, 128), (2, 32, 8192, 8192, 64)],
    also_stages=(8,),
    with_fa4=True,
)

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU; where a GPU adds a measurement, the exercise says which call makes it.
#
# 1. **Count the turns.** For a work tile of 4 KV tiles, how many times does each turn barrier
#    complete, and how many turns does each warpgroup take? What does the model say if warpgroup 1
#    also waited for turn 0 (`programs[0].insert(0, ("sync", 2))`)?
# 2. **Three warpgroups.** Set `mma_warpgroups = 3` on a kernel object and build the three
#    programs with `turns.pingpong_program`: which barriers take the turns, in which order do the
#    tensor cores see the GEMMs, and does the model find a problem? (Stage 12 runs three consumer
#    warpgroups at D = 64.)
# 3. **zero_rows between turns.** The packed kernel's `zero_rows` synchronises both consumer
#    warpgroups on barrier 1 before the last PV. Move that sync inside the turn (after the
#    warpgroup's `wait_turn`, before its PV) in the model's programs: what happens, and why?
# 4. **The model at D = 64.** Draw `figures.pingpong_timelines(head_dim=64)`. Which unit is busy
#    all the time in the bottom panel? What gain does the model predict, what did the H200 measure
#    (section 7), and what does the model leave out?
# 5. **The price of one wait.** With the single wait per turn, $V_j$'s slot is released one step
#    later. How many ring entries ahead can the producer now be at D = 128, and does it matter?
# 6. **Lose the last turn** (exercise 9a, an edit of the Hopper stage file): delete the last
#    `pass_turn` and watch the model report the deadlock - and, on a GPU, the kernel hang inside
#    a deadline. The cells at the end of the notebook give the task and check the edit.
#
# ### Answers and checks
#
# <details><summary>1. Count the turns</summary>
#
# Each warpgroup takes 5 turns ($QK_0$; $PV_0 QK_1$; $PV_1 QK_2$; $PV_2 QK_3$; $PV_3$). Barrier 2
# completes 4 times (warpgroup 1 waits before each PV, warpgroup 2 passes after each QK), barrier 3
# 5 times (warpgroup 2 also waits before $QK_0$; warpgroup 1 also passes after its last PV).
# With warpgroup 1 waiting before turn 0, both warpgroups wait for a turn nobody has passed: the
# model reports a deadlock. The cell below counts and runs it.
# </details>
#
# <details><summary>2. Three warpgroups</summary>
#
# Barriers 2, 3 and 4; `next_warpgroup` goes 1 -> 2 -> 3 -> 1, and the tensor cores see each turn
# warpgroup by warpgroup: $QK_0$ of 1, 2, 3, then $PV_0 QK_1$ of 1, 2, 3, and so on
# (`turns.pingpong_order(steps, 3)`). Barrier 1 now counts three warpgroups. The model finds no
# problem: the turns go strictly round, so no barrier sees two passes before a wait.
# </details>
#
# <details><summary>3. zero_rows between turns</summary>
#
# A deadlock. The warpgroup that holds the turn waits at barrier 1 for the other warpgroup, which
# waits for the turn - which the first passes only after its PV. The kernel puts the zeroing
# before `wait_turn` for this reason (its comment says so); the model finds it in every
# interleaving.
# </details>
#
# <details><summary>4. The model at D = 64</summary>
#
# The exponential units: at D = 64 a GEMM takes 140 ns and a softmax's exponentials 277 ns
# (3.1), so in turns the tensor cores wait for the softmaxes. The model predicts 1.99x; the H200
# measured 1.03-1.08 (2026-12-04, `docs/results/ablation_h200_2026-12-04.md`). The model leaves
# out the rest of the softmax (FP32 work that does not shrink with D), the latencies of wgmma,
# barriers and loads, and the per-tile work of Q's load and the epilogue. It says only that the
# tensor-core / exponential balance would favour turns.
# </details>
#
# <details><summary>5. The price of one wait</summary>
#
# The producer may fill an entry once the entry `kv_slots` before it is released. In stage 8 a
# consumer releases $V_j$ before it waits for $K_{j+1}$; in stage 9 it releases $V_j$ only after
# the wait behind $QK_{j+1}$, so the oldest entry still held is one further back and the producer
# is one entry - half a KV tile - less far ahead of what the consumers read: about 5 entries of 6,
# 2.5 KV tiles at D = 128. That costs time only where the consumers wait for loads, not for the
# tensor cores.
# </details>

# %%
# Exercise 1: the turns of a work tile of 4 KV tiles, and warpgroup 1 waiting for turn 0.
if kernel9 is not None:
    programs = [turns.pingpong_program(kernel9, wg, 4) for wg in (1, 2)]
    for b in (2, 3):
        print(f"barrier {b}: {sum(op == ('sync', b) for p in programs for op in p)} completions")
    programs[0].insert(0, ("sync", kernel9.turn_barrier(1)))
    found = turns.explore(programs, turns.pingpong_order(4))
    print("warpgroup 1 waiting for turn 0:", "; ".join(turns.problem_kinds(found)))
    print("  one interleaving stops:", turns.issue_order(programs)[1])

# Exercise 2: three consumer warpgroups.
if kernel9 is not None:
    k3, _ = mod9.compile_args(torch.bfloat16, (2, 4, 512, 1024, 128))
    k3.mma_warpgroups = 3
    programs = [turns.pingpong_program(k3, wg, 2) for wg in (1, 2, 3)]
    print("turn barriers:", [k3.turn_barrier(w) for w in (1, 2, 3)])
    print("order:", ", ".join(turns.issue_order(programs)[0]))
    print("problems:", turns.explore(programs, turns.pingpong_order(2, 3)) or "none")

# Exercise 3: zero_rows inside the turn.
if kernel9 is not None:
    programs = []
    for wg in (1, 2):
        ops = turns.pingpong_program(kernel9, wg, 2, zero_rows=True)
        i = ops.index(("sync", 1))  # zero_rows; the turn's wait follows it
        ops[i], ops[i + 1] = ops[i + 1], ops[i]
        programs.append(ops)
    found = turns.explore(programs, turns.pingpong_order(2))
    print("zero_rows inside the turn:", "; ".join(turns.problem_kinds(found)))
    print("  one interleaving stops:", turns.issue_order(programs)[1])

# Exercise 4: the model at D = 64.
fig = figures.pingpong_timelines(head_dim=64, block_n=bN, rows=rows_per_wg, steps=3)

# %% [markdown]
# ### Exercise 9a: lose the last turn
#
# The first cell gives the task; the second compiles the stage file as it is on disk now (no GPU
# needed), reads from the PTX which turn operations the kernel performs, runs the turn model with
# them, and says "done" or "not yet". On the committed file it says "not yet". Where a Hopper GPU
# exists it also runs the edited kernel - in a process of its own, with a deadline, since this
# edit hangs it.
#
# <details><summary>Answer</summary>
#
# Warpgroup 2 waits at barrier 3 for the turn of its last PV (over one KV tile, the interleaving
# the check prints, that is its PV0), which only warpgroup 1's last `pass_turn` would complete.
# Warpgroup 1, done with its last PV, goes on to the epilogue and waits at barrier 1 for
# warpgroup 2. Neither can move: a deadlock, in every interleaving and for every work tile with
# at least one KV tile. On a GPU the kernel never finishes: the check reports that the process
# running it was ended after its deadline. `tests/test_exercises.py` passes only if it does, and it
# passed on an H200 (2026-12-04, `docs/results/exercises_h200_2026-12-04_8a-10a.txt`).
# </details>

# %%
nb.exercise("9a")

# %%
nb.check_exercise("9a")

# %% [markdown]
# **Next:** `make diff-10` shows what stage 10 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage10_overlap.ipynb`](stage10_overlap.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage9.md`](../docs/notes/stage9.md).
