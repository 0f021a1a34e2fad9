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
# # Stage 15 - context parallelism: one sequence over N GPUs, K and V passed around a ring
#
# This notebook walks through `stages/stage15_context_parallel/ring.py`. A sequence too long for
# one GPU's time or memory is cut into N chunks, one per rank (one process per GPU). Each rank
# keeps its chunk of Q and passes its chunk of K and V to the next rank, N - 1 hops around a
# ring, so that after N steps every rank has seen every K/V chunk once. At each step a rank runs
# stage 14's kernel on its queries against the chunk it holds, with `return_lse=True`, and merges
# that step's partial O and LSE into its running ones by their LSE weights - stage 13's combine,
# one step at a time. The stage adds no kernel: the kernel is stage 14's, called as it is, and
# the lesson is the schedule around it - which (query chunk, key chunk) pairs each step computes
# under a causal mask, how zig-zag chunks give every rank the same work, and when a hop is hidden
# behind the kernel. The notebook imports `ring.py` and displays it; it never pastes code.
#
# **What has run.** The notebook runs the ring on the CPU, its ranks as threads of one process
# (`FakeRing`) with an fp64 attention in place of the kernel. In GPU mode it also runs the ring
# on one GPU as virtual ranks calling stage 14's kernel (sections 6 and 7; in the executed copy
# in `docs/notebooks/`, on an H100 80GB HBM3, 2026-12-07). The same check of the ring of virtual
# ranks, in `tests/test_stage15.py`, passed on an H200 (2026-12-05,
# `docs/results/tests_hopper_gpu_h200_2026-12-05_split_outputs.txt`) and an H100 80GB HBM3
# (2026-12-06, `docs/results/tests_hopper_gpu_h100_2026-12-06_combine.txt`); nothing was timed
# there. **The multi-GPU run - NCCL (NVIDIA's GPU-to-GPU communication library) between GPUs,
# `make cp GPUS=N` - has not run: no number for it exists.** Every time in this notebook is
# computed in its cell from a single-GPU measurement in `docs/results/` and a published
# specification, or measured in the run itself (GPU mode), and says which.
#
# **How to run.** As stage 1: in Jupyter from `notebooks/`, or headless with
# `python -m common.tools.nbrun notebooks/stage15_context_parallel.ipynb`. Without an
# H100/H200 the cells of *Run and verify* and *Measure* that launch kernels say they are
# skipped; everything else (the schedule drawn from `ring.py`'s own functions, the ring on CPU
# threads against one fp64 attention, the overlap arithmetic, the compile summaries of the
# kernel each rank calls) runs in both modes. Stage 15 has no kernel file, so the first cell
# starts the notebook on stage 14's, the kernel every rank calls. Source:
# `notebooks/source/stage15_context_parallel.py`.

# %%
import json
import math
import os
import sys

import torch

# The repository root (it holds `common` and `stages`): the first folder upwards that has `common`.
ROOT = os.getcwd()
while not os.path.isdir(os.path.join(ROOT, "common")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from common.tools import exercises  # noqa: E402
from common.tools import notebook as nb  # noqa: E402
from common.tools.reference import attention_gqa_ref  # noqa: E402
from notebooks.figures import stage15 as figures  # noqa: E402
from stages.stage15_context_parallel import ring  # noqa: E402

# Stage 15 has no kernel of its own: start() names the mode and the files of stage 14's kernel.
nb.start(14, heading="Stage 15 - context parallelism: ring attention over several GPUs")
# H200 NVLink: 900 GB/s per GPU, both directions together (NVIDIA's published figure). A hop
# sends one buffer to the next rank and receives one from the previous: each in one direction.
NVLINK_GBS = 900
HOP_GBS = NVLINK_GBS / 2


def ring_run(q, k, v, world, causal, zigzag, attention, timeout=120):
    """attention_cp on `world` ranks as threads of this process (FakeRing), each given its chunk
    (chunk_of) and `attention` as its per-chunk kernel, the calls one at a time and recorded as
    (Sq, Sk, causal). q (B, H, S, D), k and v (B, Hkv, S, D). Returns O (B, H, S, D) and LSE
    (B, H, S) of all ranks put back in sequence order, and the calls."""
    S, calls = q.shape[2], []
    fake = ring.FakeRing(world, timeout=timeout)

    def kernel(q_, k_, v_, step_causal):
        calls.append((q_.shape[2], k_.shape[2], step_causal))
        return attention(q_, k_, v_, step_causal)

    results = fake.run(
        lambda r: ring.attention_cp(
            *(ring.chunk_of(t, r.rank, world, zigzag) for t in (q, k, v)),
            group=r,
            causal=causal,
            zigzag=zigzag,
            attention=fake.one_at_a_time(kernel),
            return_lse=True,
            seqlen=S,
        )
    )
    chunks = ring.Chunks(S, world, zigzag)
    o = torch.empty(*q.shape[:3], q.shape[3], dtype=results[0][0].dtype, device=q.device)
    lse = torch.empty(*q.shape[:3], dtype=results[0][1].dtype, device=q.device)
    for r, (o_r, lse_r) in enumerate(results):
        pos = chunks.positions(r).to(q.device)  # rank r's tokens, in its chunk's order
        o[:, :, pos], lse[:, :, pos] = o_r, lse_r
    return o, lse, calls


def work_pairs(chunks, rank, src, causal):
    """The (query, key) pairs rank `rank` computes at the step where it holds the K/V chunk of
    rank `src`, from ring.step_work's slices: n (n + 1) / 2 for a causal block of n rows, n m for
    n rows against m keys, 0 for a skipped step."""
    work = ring.step_work(chunks, rank, src, causal)
    if work is None:
        return 0
    q_rows, kv_rows, step_causal = work
    n, m = q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start
    return n * (n + 1) // 2 if step_causal else n * m


# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - cut a sequence of $S$ tokens over $N$ ranks into contiguous or zig-zag chunks, for any $S$
#   (`Chunks`: `torch.tensor_split`'s sizes), and say which tokens each rank holds;
# - derive the ring's merge, $\text{lse}' = \ln(e^{\text{lse}} + e^{\text{lse}_t})$,
#   $O' = e^{\text{lse} - \text{lse}'} O + e^{\text{lse}_t - \text{lse}'} O_t$, from stage 13's
#   combine, and say why a row that has seen no key gives no NaN;
# - read the causal schedule from `ring_step`: which steps a rank skips with contiguous chunks
#   (rank $N - 1$ works at every step, rank 0 at one), and why zig-zag chunks give every rank
#   half a chunk pair at every step;
# - say when a hop hides behind the kernel: $4 c H_{kv} D$ bytes per hop against $2 H c^2 D$
#   FLOPs per step, so a chunk of $c \ge 2F / (G \cdot \text{BW})$ tokens hides it ($c$ the
#   chunk's tokens, $F$ the kernel's FLOP/s, BW the link's bytes per second one way,
#   $G = H / H_{kv}$; section 5.5), and evaluate that with the kernel's measured speed (H200,
#   2026-12-04) and NVLink's published bandwidth;
# - run the ring on CPU threads and check it against one attention over the whole sequence;
# - say what has not run: the ring over several GPUs on NCCL.
#
# ## 2. Previous stage recap
#
# Stage 14 reads K and V from a paged cache; its kernel is stage 13's split-KV kernel (stage 12's
# persistent ping-pong loop whose work tiles can be cut along the keys) with the producer loading
# a KV tile as TMA boxes from the pages that hold it. Called without a page table it takes
# contiguous K and V (B, Hkv, S, D), and with `return_lse=True` it returns O in the inputs' dtype
# and LSE in fp32 (B, H, Sq), natural log, $-\infty$ for a row that sees no key. Stage 13 merged
# its splits' partial O and LSE by $O = \sum_s e^{\text{lse}_s - \text{lse}} O_s$: stage 15 uses
# the same merge across GPUs. With causal masking the kernel aligns the diagonal bottom-right
# (query $i$ of $S_q$ sees key $j$ of $S_k$ when $j \le i + S_k - S_q$), FlashAttention's
# convention; the ring only calls it causally on square blocks, where that is the usual
# top-left diagonal. On a long prefill the loop each rank runs is stage 12's: 664-685 TFLOP/s
# at D = 128, S = 16k, without and with the causal mask (H200, 2026-12-04, `make bench`'s
# ablation table in `docs/results/ablation_h200_2026-12-04.md`; the same file's paper-shape
# table, timed in other rounds of that run, has 693 without the mask).
#
# ## 3. The math
#
# ### 3.1 Cutting the sequence
#
# Rank $r$ of $N$ holds a chunk of Q, K and V: the same tokens of each. **Contiguous:** the
# sequence is cut into $N$ pieces and rank $r$ holds piece $r$. **Zig-zag:** it is cut into $2N$
# pieces and rank $r$ holds pieces $r$ and $2N - 1 - r$, concatenated in that order - one from
# the front of the sequence and its mirror image from the back. The pieces follow
# `torch.tensor_split`: with $n$ pieces, $\lfloor S / n \rfloor$ tokens each and one more for
# the first $S \bmod n$, so that any $S \ge 1$ is cut for any $N$, two ranks' chunks differ by at
# most one token, and $S < N$ (zig-zag: $S < 2N$) leaves pieces or whole chunks empty. The cell
# shows `Chunks` and prints the cut of a few lengths.

# %%
nb.show_function(ring.Chunks)
rows = []
for S, N in ((32, 4), (10, 4), (5, 4), (3, 5)):
    for zigzag in (False, True):
        chunks = ring.Chunks(S, N, zigzag)
        rows.append(
            (
                S,
                N,
                "zig-zag" if zigzag else "contiguous",
                "; ".join(" + ".join(f"[{a}, {b})" for a, b in p) for p in chunks.pieces),
                ", ".join(str(chunks.length(r)) for r in range(N)),
            )
        )
nb.table(("S", "N", "chunks", "tokens of rank 0; rank 1; ...", "chunk lengths"), rows)

# %% [markdown]
# ### 3.2 Merging one step at a time
#
# At step $t$ rank $r$ holds the K/V chunk of rank $s = (r - t) \bmod N$ and computes, for the
# keys $K_t$ of that chunk its queries may see, $O_t = \sum_{j \in K_t} e^{x_j} v_j / \ell_t$ and
# $\text{lse}_t = \ln \ell_t$, $\ell_t = \sum_{j \in K_t} e^{x_j}$ (stage 13's split, with a chunk
# for a split). Over all steps $\ell = \sum_t \ell_t$, so $O = \sum_t e^{\text{lse}_t - \text{lse}}
# O_t$ with $\text{lse} = \ln \sum_t e^{\text{lse}_t}$. The ring cannot wait for all steps (each
# $O_t$ would be kept until the end), so it folds each step into a running pair in fp32:
#
# $$\text{lse}' = \ln\!\big(e^{\text{lse}} + e^{\text{lse}_t}\big), \qquad
# O' = e^{\text{lse} - \text{lse}'}\, O + e^{\text{lse}_t - \text{lse}'}\, O_t ,$$
#
# starting from $O = 0$, $\text{lse} = -\infty$. Both weights lie in $[0, 1]$ and sum to 1, so
# nothing overflows whatever the scale of the scores (`torch.logaddexp` computes $\text{lse}'$ as
# $\max + \ln(1 + e^{-|\text{lse} - \text{lse}_t|})$). One case needs care: a row that has seen
# no key yet and sees none at this step has $\text{lse} = \text{lse}_t = -\infty$, so
# $\text{lse}' = -\infty$ and $e^{-\infty - (-\infty)}$ is NaN. `merge` keeps such a row at
# $O = 0$, $\text{lse} = -\infty$ (weights 0). The cell shows it and merges three rows: one that
# sees no key on either side, one that sees keys only at this step, one that sees keys on both.

# %%
nb.show_function(ring.merge)
inf = float("-inf")
out = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [2.0, 4.0]]])  # (H = 1, 3 rows, D = 2), fp32
lse = torch.tensor([[inf, inf, 0.5]])
o_t = torch.tensor([[[1.0, 2.0], [3.0, 5.0], [6.0, 2.0]]])
lse_t = torch.tensor([[inf, 1.5, 0.5]])
new = torch.logaddexp(lse, lse_t)
naive = torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(lse_t - new).unsqueeze(-1) * o_t
ring.merge(out, lse, o_t, lse_t)
for i, what in enumerate(("no key on either side", "keys only at this step", "keys on both")):
    print(
        f"row {i} ({what}): merge gives O = {out[0, i].tolist()}, lse = {float(lse[0, i]):.4g}; "
        f"the formula without the guard gives O = {naive[0, i].tolist()}"
    )

# %% [markdown]
# ### 3.3 Causal work per step
#
# Under a causal mask query $i$ sees key $j \le i$. Count work in chunk pairs: with chunks of $c$
# tokens, a full pair is $c^2$ (query, key) pairs, and the whole sequence $S^2 / 2 = N^2 c^2 / 2$.
#
# **Contiguous chunks.** Rank $r$'s queries are tokens $[rc, (r + 1)c)$. At the step where it
# holds the chunk of rank $s$: if $s = r$ (step 0) the block is causal, $c (c + 1) / 2$ pairs; if
# $s < r$ every key comes before every query, a full pair; if $s > r$ every key comes after every
# query, and the step is skipped. Rank $r$ does $r$ full pairs and a half; rank $N - 1$ works at
# every step, rank 0 only at step 0. All ranks run the steps in lockstep (step $t + 1$ needs the
# chunk step $t$ passed on), so a step lasts as long as its busiest rank: about $c^2/2 + (N - 1)
# c^2$, against the ideal $N c^2 / 2$ (the total shared evenly) - $(2N - 1) / N$ times the ideal,
# 1.75x at $N = 4$.
#
# **Zig-zag chunks.** Rank $r$ holds pieces $r$ and $2N - 1 - r$ of $2N$ (half chunks of $c / 2$
# tokens), in that order. The pieces keep the sequence's order, so at the step where rank $r$
# holds the chunk of rank $s$ (`ring_step`):
#
# - $s = r$: its own two pieces as one causal block, $S_q = S_k = c$ (the first piece's queries
#   see their own keys causally; the second's see the first piece whole and their own causally);
# - $s < r$: piece $s$ comes before both of rank $r$'s pieces and piece $2N - 1 - s$ after both:
#   all of rank $r$'s queries against the first half of the chunk, $c \cdot c/2$ pairs;
# - $s > r$: piece $r$ comes before both of rank $s$'s pieces (it sees neither), piece
#   $2N - 1 - r$ after both: the second half of rank $r$'s queries against the whole chunk,
#   $c/2 \cdot c$ pairs.
#
# Every rank computes $c^2 / 2$ pairs at every step (the first one $c/2$ more, the diagonal), so
# the ring takes the ideal $N c^2 / 2$. The kernel sees three kinds of calls: a causal square of
# $c$, $c$ queries against $c/2$ keys, and $c/2$ queries against $c$ keys.

# %%
nb.show_function(ring.ring_step)
nb.show_function(ring.step_work)

# %% [markdown]
# ## 4. What changes
#
# Nothing inside the kernel: `stages/stage15_context_parallel/ring.py` is the schedule and the
# merge around stage 14's `attention`, called as it is (there is no kernel diff to show). Its
# docstring gives the change and its numbers; then `attention_cp`, the whole ring as one rank
# runs it: check the arguments, agree on $S$ (given, or the chunk lengths passed around the
# ring), the fp32 accumulators, then $N$ steps - start the next hop, run this step's kernel and
# merge, wait for the hop.

# %%
print(ring.__doc__)
nb.show_function(ring.attention_cp)

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The schedule, drawn
#
# $S = 32$ tokens over $N = 4$ ranks, causal, contiguous (top) and zig-zag (middle) chunks. Each
# panel is the whole sequence's (query, key) grid, queries down and keys across in sequence
# order; the pairs a step computes are coloured by the rank that computes them, the lines are the
# pieces' bounds. The last panel of each row is the whole ring: every pair the mask allows
# computed once. Below, the pairs each rank computes at each step. The figure calls `Chunks` and
# `step_work` of `ring.py` (`figures.step_pairs`), so it draws the schedule the ring runs.

# %%
fig = figures.schedule_grids(
    32, 4, causal=True, title="The ring's steps, causal: S = 32 tokens over N = 4 ranks"
)

# %% [markdown]
# With contiguous chunks rank 0 works once and rank 3 four times: 228 pairs of ring time for
# 528 pairs of work, 132 each if shared evenly. With zig-zag chunks every rank computes 32 pairs
# at every step after the first (36 at step 0, the diagonal): 132, the ideal. The cell counts
# the same at a long sequence, $S$ = 131,072 over 4 and 8 ranks, from `step_work`'s slices:
# ring time (the busiest rank per step, summed) over the ideal (all pairs over $N$).

# %%
rows = []
for S, N in ((131072, 4), (131072, 8)):
    for zigzag in (False, True):
        chunks = ring.Chunks(S, N, zigzag)
        work = [[work_pairs(chunks, r, (r - t) % N, True) for r in range(N)] for t in range(N)]
        ring_time = sum(max(step) for step in work)
        ideal = sum(map(sum, work)) / N
        busy = sum(1 for step in work for w in step if w)
        rows.append(
            (
                f"{S:,}",
                N,
                "zig-zag" if zigzag else "contiguous",
                f"{busy} of {N * N}",
                f"{ring_time / ideal:.3f}",
            )
        )
nb.table(("S", "N", "chunks", "(rank, step) with work", "ring time / ideal"), rows)

# %% [markdown]
# ### 5.2 Uneven and empty chunks
#
# $S$ need not be a multiple of $N$ (or of $2N$). The pieces then differ by a token, and when
# $S < N$ (zig-zag: $S < 2N$) some are empty. Two things follow, both in `ring.py`: a step whose
# rows are empty is skipped (`step_work` returns None: the kernel is never called with no queries
# or no keys, and a rank with nothing to compute still passes its K/V on), and every hop carries
# one buffer of the longest chunk's rows, so that each send and its receive have one shape on
# every rank (NCCL and gloo need the receiver to know the size): a shorter chunk leaves its last
# row of the buffer unused, at most one row of K and V per hop. The rules of `ring_step` only use
# the order of the pieces, so they hold for pieces of any size. The figure shows four cuts: the
# sequence's tokens coloured by rank, each rank's hop buffer in its chunk's order, and at how
# many of the $N$ causal steps it computes.

# %%
fig = figures.uneven_chunks(
    [(10, 4, False), (10, 4, True), (5, 4, True), (3, 5, False)],
    title="Sequences that N does not divide: pieces of unequal sizes, empty pieces and chunks",
)

# %% [markdown]
# At $S = 5$ over 4 zig-zag ranks the last three of the 8 pieces are empty: ranks 0-2 hold one
# token, rank 3 two, and rank 0 computes at step 0 only (at the other steps it would compute
# with its second piece, which is empty). At $S = 3$ over 5 ranks, ranks 3 and 4 hold nothing,
# compute nothing and still pass on what they receive.
#
# ### 5.3 One rank, step by step
#
# `attend_step` is one step of one rank: the rows `step_work` names, the kernel on them, the
# merge. The cell runs rank 1 of 4 (zig-zag, causal, $S = 32$: tokens 4-7 and 24-27) through its
# four steps by hand, handing it at step $t$ the buffer of rank $(1 - t) \bmod 4$ as the hops
# would, with an fp64 attention in place of the kernel. It prints which tokens each step computes
# and the running LSE of two rows, token 4 (first piece) and token 27 (second piece), then
# compares the merged O and LSE with one attention over the whole sequence.

# %%
nb.show_function(ring.attend_step)
S, N, causal = 32, 4, True
g = torch.Generator().manual_seed(15)
q, k, v = (torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64) for _ in range(3))
chunks = ring.Chunks(S, N, True)
rank = 1
pos = chunks.positions(rank)  # tokens 4-7, 24-27
q_r = ring.chunk_of(q, rank, N, True)  # (B, H, 8, D)
out = torch.zeros(1, 2, len(pos), 8)  # fp32 accumulators, as attention_cp starts them
lse = torch.full((1, 2, len(pos)), float("-inf"))
shown = (0, len(pos) - 1)  # rows of the chunk: token 4 and token 27
rows = []
for t in range(N):
    src = (rank - t) % N
    # the hop's buffer: K and V of rank src's chunk, (2, B, Hkv, rows, D)
    kv = torch.stack([ring.chunk_of(x, src, N, True) for x in (k, v)])
    work = ring.attend_step(q_r, kv, out, lse, chunks, rank, src, causal, attention_gqa_ref)
    if work is None:
        what = "skipped"
    else:
        q_rows, kv_rows, step_causal = work
        qt, kt = pos[q_rows].tolist(), chunks.positions(src)[kv_rows].tolist()
        what = f"queries {qt} x keys {kt}" + (", causal" if step_causal else "")
    rows.append((t, src, what, *(f"{float(lse[0, 0, i]):.4f}" for i in shown)))
nb.table(("step", "K/V of rank", "computed", "lse of token 4", "lse of token 27"), rows)
o_ref, lse_ref = attention_gqa_ref(q, k, v, True)
print(
    f"rank {rank} after {N} steps: max |O - O_ref| = "
    f"{float((out.double() - o_ref[:, :, pos]).abs().max()):.1e}, max |LSE - LSE_ref| = "
    f"{float((lse.double() - lse_ref[:, :, pos]).abs().max()):.1e} "
    f"(LSE_ref of tokens 4 and 27: {float(lse_ref[0, 0, 4]):.4f}, {float(lse_ref[0, 0, 27]):.4f})"
)

# %% [markdown]
# Token 4's LSE grows at steps 0 and 1 (its own keys 4, then keys 0-3 of rank 0's first piece)
# and then stays: at steps 2 and 3 only the second piece's queries compute. Token 27's grows at
# every step. After the fourth step both equal one attention over the sequence up to the fp32
# merge's rounding.
#
# ### 5.4 The transport: a hop, and where it overlaps
#
# A `Ring` has one method, `exchange(send)`: send `send` to rank $r + 1$, receive a tensor of
# the same shape from rank $r - 1$, and return a handle whose `wait()` gives it. `TorchRing` does
# it with `torch.distributed`'s `batch_isend_irecv` (NCCL between GPUs, gloo between CPU
# processes: without a GPU, `make cp GPUS=2 CP_ARGS="--cpu --causal"` runs it between two CPU
# processes with an fp64 attention as the kernel, at $S$ = 1,024, since that stand-in holds a
# chunk's whole score matrix: 64 GiB per rank over 2 ranks at the GPU's default of 32k tokens
# and 32 heads, $32 \cdot 16384^2 \cdot 8$ bytes). On NCCL the transfer runs on NCCL's own CUDA
# stream, and `wait()` makes the current stream wait for it without blocking the host.
# `attention_cp` starts the hop of step $t$ before it launches step $t$'s kernel and waits for it
# after the merge: the hop that brings the next chunk runs while the kernel works on this one.
# `FakeRing` runs the ranks as threads of one process and swaps their buffers through shared
# slots behind a barrier: a stand-in for the tests and for $N$ virtual ranks on one GPU, where
# the hops are copies and nothing overlaps.

# %%
nb.show_function(ring.TorchRing.exchange)
nb.show_function(ring.FakeRing.run)

# %% [markdown]
# ### 5.5 When a hop hides behind the kernel
#
# With chunks of $c = S / N$ tokens, $H$ query and $H_{kv}$ KV heads ($G = H / H_{kv}$), head
# dimension $D$ and 2-byte elements, one hop carries K and V of a chunk, and one zig-zag step
# computes half a chunk pair (section 3.3; step 0's causal square counts the same, as the
# FlashAttention papers count a causal FLOP):
#
# $$\text{bytes per hop} = 2 \cdot c \cdot H_{kv} \cdot D \cdot 2 = 4 c H_{kv} D, \qquad
# \text{FLOPs per step} = 4 H \cdot \frac{c}{2} \cdot c \cdot D = 2 H c^2 D .$$
#
# At a link bandwidth BW (one direction: a hop sends one buffer and receives one, each on its own
# direction of the link) and a kernel speed $F$, the hop is hidden when it takes no longer than
# the kernel:
#
# $$\frac{4 c H_{kv} D}{\text{BW}} \le \frac{2 H c^2 D}{F} \iff
# c \ge \frac{2 F}{G \cdot \text{BW}} .$$
#
# $D$ cancels: the hop grows with $c$, the kernel with $c^2$, so a long enough chunk always hides
# it, and grouped KV heads ($G > 1$) shrink the hop $G$ times. The numbers: BW = 450 GB/s, half of
# the H200's published NVLink bandwidth of 900 GB/s per GPU (both directions together); $F$ the
# kernel's measured speed at the chunk's length, read from the ablation run of `make bench`
# (stage 12's loop, bf16, D = 128, H200, 2026-12-04,
# `docs/results/ablation_h200_2026-12-04.json`: the row whose S is nearest $c$, causal for step 0
# and without a mask for the others). Stage 14's kernel runs that loop on these calls (one split,
# no pages); stage 14 itself was not timed at these shapes. The cell computes the hop, the kernel
# time of each step and the shortest chunk that hides a hop, for a few ring sizes.

# %%
with open(os.path.join(nb.ROOT, "docs/results/ablation_h200_2026-12-04.json")) as f:
    ablation = json.load(f)
# stage 12's TFLOP/s by (S, causal): (B, H, S, S, D = 128, causal) rows, event-timed
SPEED = {
    (r["shape"][2], r["shape"][5]): r["tflops"]["stage 12"]
    for r in ablation["rows"]
    if r["stage"] == "ablation" and r["shape"][4] == 128
}


def kernel_speed(c, causal):
    """(TFLOP/s, the measured S it comes from): the ablation row whose S is nearest c."""
    s = min({s for s, _ in SPEED}, key=lambda s: abs(math.log(s / c)))
    return SPEED[(s, causal)], s


def ring_times(S, N, H, Hkv, D=128):
    """(hop us, [kernel us of each zig-zag step], the S the speeds come from, shortest c that
    hides a hop) for S tokens over N ranks, bf16, at HOP_GBS."""
    c = S // N
    hop_us = 4 * c * Hkv * D / (HOP_GBS * 1e9) * 1e6
    flops = 2 * H * c * c * D
    (f0, s0), (f1, _) = kernel_speed(c, True), kernel_speed(c, False)
    kernel_us = [flops / (f0 * 1e12) * 1e6] + [flops / (f1 * 1e12) * 1e6] * (N - 1)
    c_min = 2 * f1 * 1e12 / ((H // Hkv) * HOP_GBS * 1e9)
    return hop_us, kernel_us, s0, c_min


RING_SHAPES = [(131072, 4, 32, 8), (262144, 8, 32, 8), (32768, 4, 32, 8), (8192, 4, 32, 8)]
RING_SHAPES += [(8192, 4, 32, 32)]
rows = []
for S, N, H, Hkv in RING_SHAPES:
    hop_us, kernel_us, s_from, c_min = ring_times(S, N, H, Hkv)
    c = S // N
    rows.append(
        (
            f"{S:,} / {N}",
            f"{H}/{Hkv}",
            f"{c:,}",
            f"{4 * c * Hkv * 128 / 2**20:.0f} MiB",
            f"{hop_us:,.1f}",
            f"{kernel_us[0]:,.1f} / {kernel_us[1]:,.1f}",
            f"{s_from // 1024}k",
            f"{kernel_us[1] / hop_us:.1f}",
            f"{c_min:,.0f}",
        )
    )
print(f"kernel speeds: {ablation['gpu']}, {ablation['date']}; link: {HOP_GBS:.0f} GB/s each way")
nb.table(
    (
        "S / N",
        "heads q/kv",
        "chunk c",
        "bytes per hop",
        "hop, us",
        "kernel per step, us (step 0 / others)",
        "speed read at S",
        "kernel / hop",
        "shortest c hiding a hop",
    ),
    rows,
)

# %% [markdown]
# At 128k tokens over 4 GPUs with 32 / 8 heads a hop of 128 MiB takes 298 us at 450 GB/s and a
# step's kernel 12.8-13.3 ms: the kernel is 44 times longer, and any chunk of 738 tokens or more
# would hide the hop at that speed. A ring of 8 over 256k tokens has the same chunks, hence the
# same per-step numbers. Only short chunks without grouped heads come near: 8k tokens over 4
# ranks with 32 KV heads (MHA, $G = 1$) moves 32 MiB per hop, 75 us, against 52 us of kernel per
# step after the first. The timeline below is one rank under the model `attention_cp` follows
# (step $t + 1$ starts when step $t$'s kernel and hop are both done): the first case and the MHA
# one, where the hops started at steps 1 and 2 outlast those steps' kernels by 23 us each, so
# steps 2 and 3 start 23 us late (276 us for 230 us of kernels).

# %%
cases = []
for S, N, H, Hkv in ((131072, 4, 32, 8), (8192, 4, 32, 32)):
    hop_us, kernel_us, _, _ = ring_times(S, N, H, Hkv)
    cases.append((f"S = {S // 1024}k over {N}, {H}/{Hkv} heads", kernel_us, [hop_us] * (N - 1)))
    steps, end = figures.ring_timeline(kernel_us, [hop_us] * (N - 1))
    print(f"{cases[-1][0]}: {end:,.1f} us, of which kernels {sum(kernel_us):,.1f} us")
fig = figures.hop_timelines(
    cases,
    title=f"One rank's steps: kernel speeds {ablation['gpu']}, {ablation['date']}; "
    f"hops at {HOP_GBS:.0f} GB/s (half of NVLink's published 900 GB/s)",
)

# %% [markdown]
# What this arithmetic leaves out, none of it measured: NCCL reaches less than the link's
# published bandwidth; its point-to-point transfers run as kernels on a few SMs, which the
# attention kernel's persistent CTAs (one per SM) then cannot use while they run; each step adds
# a merge (elementwise, in fp32, over the rank's O) and, for the sliced calls, copies of the rows
# `step_work` names; and the kernel's speed at the shorter calls of a zig-zag step ($c/2$ queries
# or keys) is not the speed at $S = c$. `make cp GPUS=N` measures the ring's time against its
# kernels' and its hops' alone on each rank (`common/tools/cp_run.py`); it has not run on
# several GPUs.
#
# ### 5.6 The kernel each rank calls
#
# Stage 14's kernel as the ring calls it: the compile summary of its Hopper file for the stage's
# compile shape (unchanged by the ring: `default_attention` calls `attention(q, k, v,
# causal=..., return_lse=True)` with contiguous K and V).

# %%
nb.show_function(ring.default_attention)
report = nb.compile_summary(14, "hopper")

# %% [markdown]
# ### 5.7 The same stage on Blackwell
#
# `ring.py` is the same on both tracks: `default_attention` picks stage 14's kernel of the
# machine's track, and nothing else in the ring depends on it. The Blackwell kernels are
# **compile-checked here, not run on hardware** (no sm_100 GPU has run them; they are compiled for
# sm_100a with fake tensors and their PTX is checked). The cell compiles Blackwell's stage 14
# for sm_100a; where the file is not there, it says so. With a faster kernel the shortest chunk
# that hides a hop grows in proportion to $F$, for the same link; no Blackwell number exists here.

# %%
report_bw = nb.compile_summary(14, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# **Expected:** on the CPU, in both modes, the ring over 1-5 thread ranks with an fp64
# attention in place of the kernel equals one fp64 attention over the whole sequence to
# $10^{-5}$ in O and LSE (the merge is fp32, so about $10^{-7}$), for lengths that $N$ divides
# and lengths it does not, empty pieces and chunks included, GQA and MQA; its kernel calls
# compute exactly the (query, key) pairs the mask allows. In GPU mode, stage 14's kernel checked
# alone as notebook 14 checks it, then the ring of virtual ranks on one GPU calling it, each
# rank's O and LSE put back in sequence order and checked against the fp64 reference under the
# suite's bound (3x PyTorch's own bf16 error).

# %%
rows = []
CPU_CASES = [
    (1, 13, 4, 2, False, False),
    (2, 64, 4, 2, True, True),
    (3, 37, 4, 1, True, True),
    (4, 32, 4, 2, True, False),
    (4, 7, 4, 4, True, True),  # S < 2N: empty zig-zag pieces
    (5, 3, 4, 2, True, False),  # S < N: empty chunks
    (5, 101, 4, 2, False, True),
]
for world, S, H, Hkv, causal, zigzag in CPU_CASES:
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, H, S, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, Hkv, S, 16, generator=g, dtype=torch.float64) for _ in range(2))
    o, lse, calls = ring_run(q, k, v, world, causal, zigzag, attention_gqa_ref)
    o_ref, lse_ref = attention_gqa_ref(q, k, v, causal)
    err_o = float((o - o_ref).abs().max())
    err_lse = float((lse.double() - lse_ref).abs().max())
    pairs = sum(n * (n + 1) // 2 if c else n * m for n, m, c in calls)
    want = S * (S + 1) // 2 if causal else S * S
    assert err_o < 1e-5 and err_lse < 1e-5, (world, S, err_o, err_lse)
    assert pairs == want, (world, S, pairs, want)
    rows.append(
        (
            world,
            S,
            f"{H}/{Hkv}",
            "causal" if causal else "none",
            "zig-zag" if zigzag else "contiguous",
            len(calls),
            f"{pairs:,} of {want:,}",
            f"{err_o:.1e}",
            f"{err_lse:.1e}",
        )
    )
nb.table(
    (
        "N",
        "S",
        "heads q/kv",
        "mask",
        "chunks",
        "kernel calls",
        "pairs computed",
        "max |O - O_ref|",
        "max |LSE - LSE_ref|",
    ),
    rows,
)

# %%
result = nb.run_and_verify(14, (1, 8, 2048, 2048, 128))

# %%
GPU_CASES = [  # (N, S, H, Hkv, D, causal, zig-zag)
    (4, 16384, 8, 2, 128, True, True),
    (3, 4099, 8, 2, 128, True, False),
    (4, 5000, 4, 2, 64, False, True),
    (4, 7, 4, 2, 64, True, True),
]
if nb.MODE == "gpu" and nb.available(14, nb.TRACK):
    from common import masks
    from common.tools import verify

    kernel = ring.default_attention(nb.TRACK)
    rows = []
    for world, S, H, Hkv, D, causal, zigzag in GPU_CASES:
        g = torch.Generator(device="cuda").manual_seed(S)
        q = torch.randn(1, H, S, D, generator=g, device="cuda").to(torch.bfloat16)
        k, v = (
            torch.randn(1, Hkv, S, D, generator=g, device="cuda").to(torch.bfloat16)
            for _ in range(2)
        )
        o, lse, calls = verify.run_with_deadline(
            lambda: ring_run(q, k, v, world, causal, zigzag, kernel, timeout=900),
            seconds=900,
            what=f"stage 15 on {world} virtual ranks",
        )
        torch.cuda.synchronize()
        kf, vf = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
        mask = masks.visible(S, S, *masks.resolve_window(causal, None, S, S), device=q.device)
        name = f"ring of {world}, S = {S}"
        o_chk, lse_chk = verify.check_attention(name, o, q, kf, vf, lse=lse, mask=mask)
        rows.append(
            (
                world,
                S,
                f"{H}/{Hkv}",
                D,
                "causal" if causal else "none",
                "zig-zag" if zigzag else "contiguous",
                len(calls),
                f"{o_chk.rel_err:.1e} / {o_chk.bound:.1e}",
                f"{lse_chk.rel_err:.1e}",
            )
        )
    nb.table(
        (
            "N",
            "S",
            "heads q/kv",
            "D",
            "mask",
            "chunks",
            "kernel calls",
            "O: relative error / bound",
            "LSE: relative error",
        ),
        rows,
    )
else:
    print("the ring of virtual ranks on stage 14's kernel needs GPU mode")

# %% [markdown]
# ## 7. Measure
#
# **No measurement of the ring across GPUs exists.** `make cp GPUS=N` (torchrun, NCCL, one
# process per GPU) would give each rank's time per call, its kernels' time alone and its hops'
# alone; it has not run. The goal it is written for: at $S$ = 256k, causal, at least 0.85 x N of
# one GPU's throughput on 2 and 4 GPUs. What can be measured on one GPU, in GPU mode:
#
# 1. stage 14's kernel over a whole sequence of 32k tokens, causal, against SDPA - the one-GPU
#    time a ring of $N$ would divide by up to $N$ (with 32 KV heads here; the ring of item 2 runs
#    8, so its own call over the sequence takes a different time);
# 2. `python -m common.tools.cp_run --virtual-ranks 4 --causal` on that sequence: the ring of
#    virtual ranks against one call, then each rank's step (its kernel and its merge) timed
#    alone: the ring's compute time on 4 GPUs (the busiest rank per step, summed) against one
#    call over the sequence, and the link bandwidth that would hide each hop.

# %%
bench = nb.measure(14, [(1, 32, 32768, 32768, 128)], causal=True)

# %%
if nb.MODE == "gpu" and nb.available(14, nb.TRACK):
    from common.tools import cp_run, timing

    cp_run.main(["--virtual-ranks", "4", "--seqlen", "32768", "--causal", "--reps", "5"])
    gpu_name, date = timing.gpu_and_date()
    print(f"measured on {gpu_name}, {date}, in this run")
else:
    print("timing the ring's steps on one GPU needs GPU mode")

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook. Every exercise can be done
# without a GPU.
#
# 1. **A cut.** $S$ = 1,000 tokens over $N = 3$ zig-zag ranks: the sizes of the 6 pieces, each
#    rank's tokens, and the rows of a hop's buffer. How many buffer rows are unused per hop?
# 2. **Skipped steps.** With contiguous chunks and a causal mask over $N = 8$ ranks, how many of
#    the 64 (rank, step) pairs compute anything, and how long is the ring in units of a full
#    chunk pair $c^2$ against the ideal? And with zig-zag chunks?
# 3. **No mask.** Without a causal mask, what does each rank compute at each step, contiguous
#    or zig-zag? Which layout would you pick, and why does `attention_cp` default `zigzag` to
#    `causal`?
# 4. **The shortest chunk.** At the kernel speed of 664 TFLOP/s (stage 12, D = 128, S = 16k,
#    no mask, H200, 2026-12-04, `docs/results/ablation_h200_2026-12-04.md`) and 450 GB/s each
#    way, what is the shortest chunk that hides a hop with 32 query heads and 32, 8 or 1 KV
#    heads? And for a link of 64 GB/s each way (PCIe Gen5 x16's published figure)?
# 5. **Swap the zig-zag pieces** (exercise 15a, an edit of `ring.py`): rank $r$ holds pieces
#    $2N - 1 - r$, then $r$. The cells at the end of the notebook give the task and check it.
#
# ### Answers and checks
#
# <details><summary>1. A cut</summary>
#
# 1,000 = 6 x 166 + 4: pieces of 167, 167, 167, 167, 166, 166 tokens, i.e. [0, 167), [167, 334),
# [334, 501), [501, 668), [668, 834), [834, 1000). Rank 0 holds pieces 0 and 5 (333 tokens),
# rank 1 pieces 1 and 4 (333), rank 2 pieces 2 and 3 (334). A hop's buffer has 334 rows: ranks
# 0 and 1 leave one unused. The cell prints the cut.
# </details>
#
# <details><summary>2. Skipped steps</summary>
#
# Contiguous: rank $r$ computes at steps $0, \dots, r$: $1 + 2 + \dots + 8 = 36$ of the 64. Step
# 0 costs half a pair (the causal square) and each later step a full pair (rank 7 is always
# busy): $7.5\, c^2$ against the ideal $8 c^2 / 2 = 4 c^2$, 1.875x. Zig-zag: all 64 compute, half
# a pair each, $4 c^2$ (plus the diagonal's $c/2$ at step 0): the ideal. The cell counts it from
# `step_work`.
# </details>
#
# <details><summary>3. No mask</summary>
#
# Without a mask every rank computes its whole chunk against every chunk: a full pair at every
# step, whichever layout (`ring_step` returns ("all", "all", False)). The cut makes no
# difference to the work; contiguous chunks keep each rank's tokens together (simpler to gather
# afterwards), and zig-zag only pays under a causal mask - hence `zigzag=None` meaning
# `zigzag=causal`. Every rank must cut the same way as `attention_cp` is told: the layout is an
# argument, not something the ring can see in the tensors.
# </details>
#
# <details><summary>4. The shortest chunk</summary>
#
# $c \ge 2F / (G \cdot \text{BW})$ = 2 x 663.8e12 / (G x 450e9) = 2,950 / G: 2,950 tokens
# for MHA (32 KV heads), 738 for 8 KV heads, 92 for MQA. At 64 GB/s each way: 20,745 / G -
# 20,745, 5,186 and 648 tokens. At chunks that short the kernel no longer runs at 664 TFLOP/s:
# without a mask the same run measured 667 at S = 2k, 503 at 1k and only 259 at 512 (H200,
# 2026-12-04, `docs/results/ablation_h200_2026-12-04.md`). A slower kernel lowers the threshold
# (the hop then hides behind a longer kernel time); the formula with the speed at that length is
# what decides.
# </details>
#
# <details><summary>5. Swap the zig-zag pieces (15a)</summary>
#
# With 8 tokens over 2 ranks, rank 0's chunk becomes tokens 6, 7, 0, 1 and rank 1's 4, 5, 2, 3.
# Step 0's causal block is the lower triangle in the chunk's own order: for rank 0 it computes
# (6, 6), (7, 6), (7, 7), (0, 0), (1, 0), (1, 1), which are right, and (0, 6), (0, 7), (1, 6),
# (1, 7), which the mask forbids, and it misses (6, 0), (6, 1), (7, 0), (7, 1). At step 1 rank 0
# computes its "second" piece, now tokens 0 and 1, against rank 1's whole chunk (all forbidden),
# and rank 1 all its tokens against rank 0's "first" piece, now tokens 6 and 7 (all forbidden).
# In all, 24 of the 36 pairs the mask allows are missed and 24 forbidden ones computed; none
# twice. O is wrong by order 1 (the check prints it). Contiguous chunks, one piece each, do not
# change. `ring_step`'s rules say "first" and "second" and mean "earlier" and "later": the order
# of the pieces in the chunk is part of the schedule, and the causal square of step 0 is a lower
# triangle only in that order.
# </details>

# %%
# Exercise 1: 1,000 tokens over 3 zig-zag ranks.
chunks = ring.Chunks(1000, 3, True)
rows_per_hop = max(chunks.length(r) for r in range(3))
for r in range(3):
    n = chunks.length(r)
    print(
        f"rank {r}: pieces {chunks.pieces[r]}, {n} tokens, buffer rows unused: {rows_per_hop - n}"
    )

# Exercise 2: (rank, step) pairs with work and the ring time in units of c^2, N = 8.
N, c = 8, 1024
for zigzag in (False, True):
    chunks = ring.Chunks(N * c, N, zigzag)
    work = [[work_pairs(chunks, r, (r - t) % N, True) for r in range(N)] for t in range(N)]
    busy = sum(1 for step in work for w in step if w)
    ring_time = sum(max(step) for step in work) / c**2
    print(
        f"{'zig-zag' if zigzag else 'contiguous'}: {busy} of {N * N} compute; ring time "
        f"{ring_time:.3f} c^2, ideal {sum(map(sum, work)) / N / c**2:.3f} c^2"
    )

# Exercise 3: what each step computes without a mask.
print("no mask:", {ring.ring_step(2, 4, s, False, z) for s in range(4) for z in (False, True)})

# Exercise 4: the shortest chunk that hides a hop, c >= 2 F / (G BW).
F = SPEED[(16384, False)] * 1e12
for bw in (HOP_GBS, 64):
    print(
        f"{bw:.0f} GB/s:",
        {f"32/{hkv}": round(2 * F / (32 // hkv * bw * 1e9)) for hkv in (32, 8, 1)},
    )

# %% [markdown]
# ### Exercise 15a: swap the zig-zag pieces
#
# The first cell gives the task; the second loads `ring.py` as it is on disk now, runs its own
# `Chunks` and `step_work` on integers and its ring on CPU threads. On the committed file it
# says "not yet". Once the check says "done", the cell after it draws the edited file's
# schedule, as section 5.1 drew the committed one.

# %%
nb.exercise("15a")

# %%
check = nb.check_exercise("15a")

# %%
if check.done:
    ex = exercises.exercise("15a")
    edited = exercises.load_stage_file(15, None, path=ex.path)
    fig = figures.schedule_grids(
        8, 2, causal=True, schedule=edited, title="The edited ring.py: 8 tokens over 2 ranks"
    )
else:
    print("the edited schedule is drawn once the check says done")

# %% [markdown]
# **This is the last stage.** Every measured number, with its GPU and date:
# [`docs/results/README.md`](../docs/results/README.md).
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage15.md`](../docs/notes/stage15.md).
