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
# # Stage 1 - GEMM: TMA, a swizzled shared-memory tile, an mbarrier pipeline, the matrix instruction
#
# This notebook walks through `stages/stage1_gemm/hopper.py` and its Blackwell twin
# `stages/stage1_gemm/blackwell.py`. It imports the stage files and displays them; no kernel code
# is pasted here, so what you read is what runs. It is also where the CuTe DSL itself is
# introduced: section 5.2 takes the kernel's `# 1. Prepare` section apart, and its box *trace time
# and run time* is what later notebooks refer to.
#
# **How to run.** Open it in Jupyter from `notebooks/` and run the cells in order, or run them all
# headless with `python -m common.tools.nbrun notebooks/stage1_gemm.ipynb` (the same cells in
# one process; `make notebooks` runs every notebook). On an
# H100/H200 the cells of *Run and verify* and *Measure* launch the kernel, check it and time it;
# anywhere else they say they are skipped. Everything else - the compile summaries (PTX,
# registers, shared memory) of both tracks included - needs no GPU and appears in both modes. The
# single source of this notebook is `notebooks/source/stage1_gemm.py` (jupytext percent format;
# it also runs as a script); edit it there and run `make notebooks-source`. Copies of the
# notebooks with the outputs of one run, figures included, go to `docs/notebooks/`
# (`python -m common.tools.nbrun --execute-to docs/notebooks notebooks/*.ipynb`); each copy's
# first cell names the GPU, the mode and the date of its run.

# %%
import os
import sys

# The repository root (it holds `common` and `stages`): the first folder upwards that has
# `common`, so that this runs from notebooks/ in Jupyter and as a script from the root.
ROOT = os.getcwd()
while not os.path.isdir(os.path.join(ROOT, "common")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from common.tools import notebook as nb  # noqa: E402
from notebooks.figures import stage1 as figures  # noqa: E402

nb.start(1)

# %% [markdown]
# ## 1. Objectives
#
# After this notebook you can:
#
# - read the parts every kernel of this repository has: the host side `__call__` (layouts, TMA
#   descriptors, grid, launch) and the device side `kernel` with its numbered sections
#   `# 1. Prepare`, `# 2. Main loop`, `# 3. Epilogue`;
# - follow the CuTe DSL of `# 1. Prepare`: how `local_tile(..., proj=...)` cuts a CTA's tile out
#   of a global tensor, how `tma_partition` turns it into TMA boxes, why `partition_A` /
#   `make_fragment_A` produce shared-memory *descriptors* and not registers, what `tx_count`
#   counts, and why a producer's first wait on a fresh barrier uses parity 1;
# - tell trace-time Python from run-time code: `cutlass.range_constexpr` against
#   `cutlass.range(..., unroll=1)`, `cutlass.const_expr`, and why `if warp_idx == 0` is a branch
#   on the GPU while a Python `if` on a shape is not;
# - explain why operand tiles sit in shared memory in the 128-byte swizzle, and where each 16-byte
#   chunk of a row lands;
# - follow an `ab_buffers`-deep pipeline of *full* and *empty* mbarriers: who waits for what, and
#   what the phase bit is for;
# - say which thread of a warpgroup holds which element of a `wgmma` accumulator;
# - find the matrix instructions in the PTX and count them per K tile;
# - change a pipeline depth or a tile size from the notebook and see the new kernel compiled and
#   measured (`settings=` of `nb.compile_summary`, `variants=` of `nb.measure`, `nb.reload_stage`);
# - say what changes on Blackwell: the accumulator in tensor memory (TMEM), one thread issuing
#   `tcgen05.mma`, warps with fixed roles.
#
# ## 2. Previous stage recap
#
# Stage 1 is the first stage; there is no earlier kernel. It assumes:
#
# - a GEMM computed tile by tile (each block of threads owns one tile of C; CUDA's thread block is
#   called a CTA, cooperative thread array, throughout);
# - CuTe layouts: a shape and a stride that map a coordinate to an offset, written
#   `shape:stride`, and tensors = pointer + layout (the CUTLASS notebooks `tensor.ipynb` and
#   `cute_layout_algebra.ipynb` introduce them);
# - a warp is 32 threads, a warpgroup 4 consecutive warps (128 threads): `wgmma` is issued by a
#   whole warpgroup.
#
# Every later stage keeps this file's skeleton (same class, same method names, same section
# banners), so that `make diff-N` shows only what stage N adds.
#
# ## 3. The math
#
# $$C_{mn} = \sum_{k=0}^{K-1} A_{mk}\,B_{nk}, \qquad C = A B^{\top}, \qquad
# A \in \mathbb{R}^{M\times K},\ B \in \mathbb{R}^{N\times K}.$$
#
# Both operands are *K-major* (K is the contiguous dimension), which is the shape of $QK^{\top}$ in
# attention: stage 2 will call A `Q` and B `K`. Inputs are bf16 or fp16, the accumulation is fp32,
# C is rounded to the input type. The work is $2MNK$ floating-point operations.
#
# A CTA owns one $b_M \times b_N$ tile of C and sweeps K in tiles of $b_K$:
#
# $$C_{[i,j]} = \sum_{t=0}^{\lceil K / b_K \rceil - 1} A_{[i,t]}\,B_{[j,t]}^{\top},$$
#
# where $A_{[i,t]}$ is rows $i b_M \ldots (i+1) b_M - 1$, columns $t b_K \ldots (t+1) b_K - 1$ of A
# (tiles are numbered from 0, as in the code). Per K tile the CTA loads $(b_M + b_N)\,b_K$
# elements (2 bytes each) and performs $2\,b_M b_N b_K$ operations, so it does
# $\frac{b_M b_N}{b_M + b_N}$ operations per byte loaded: the bigger the tile, the less memory
# traffic per operation. The cell below evaluates this for the tile the stage file uses.

# %%
cfg = nb.kernel_config(1, "hopper")
bM, bN, bK = cfg.get("cta_tile", (128, 256, 64))
per_tile_bytes = (bM + bN) * bK * 2
per_tile_flops = 2 * bM * bN * bK
print(
    f"CTA tile {bM} x {bN} x {bK}: {per_tile_bytes // 1024} KiB loaded per K tile, "
    f"{per_tile_flops / per_tile_bytes:.0f} FLOP per byte loaded into shared memory"
)
print(
    f"a {bM} x {bM} tile would give {bM * bM / (2 * bM):.0f} FLOP per byte: "
    f"{(bM * bN / (bM + bN)) / (bM / 2):.2f}x more traffic per FLOP"
)

# %% [markdown]
# ## 4. What changes
#
# Stage 1 has no predecessor, so instead of a diff here is the file's opening docstring (each design
# choice with the numbers behind it) and its outline: the skeleton every later Hopper stage keeps.

# %%
nb.show_docstring(1, "hopper")
for name, kind in nb.outline(1, "hopper"):
    print(f"{kind:8s} {name}")

# %% [markdown]
# ## 5. Walkthrough
#
# ### 5.1 The grid: one CTA per tile of C
#
# `__init__` fixes every tile size and pipeline depth; `__call__` (host side, traced once per
# compile) builds the shared-memory layouts, one TMA descriptor per operand (TMA, the Tensor
# Memory Accelerator: the engine that copies whole tiles between global and shared memory
# asynchronously; section 5.3) and the grid, then launches `kernel`. The table lists what `__init__` sets.

# %%
cfg = nb.show_config(1, "hopper")
fig = figures.gemm_tiling(M=1024, N=1024, K=512, tile=cfg.get("cta_tile", (128, 256, 64)))

# %% [markdown]
# Each CTA reads a row panel of A and a row panel of B (drawn transposed, on top) one K tile at a
# time. The real kernel walks the tiles in a *rasterised* order (`raster_m` M-tiles per band) so
# that the CTAs resident at the same moment share panels in L2; the docstring above gives the
# numbers. Here is the host side:

# %%
nb.show_source(1, "hopper", names=["Sm90Kernel.__call__"])

# %% [markdown]
# ### 5.2 Prepare: from a global tensor to what the tensor cores read
#
# The `# 1. Prepare` section of `kernel` is where the CuTe DSL does most of its work, and none of
# it moves data: every line builds a *view* (a tensor = an iterator + a layout) or a barrier.

# %%
nb.show_source(1, "hopper", section="# 1.")

# %% [markdown]
# Read it for operand A (B is the same with its own names):
#
# 1. **`mA`**, the kernel's argument, is not the matrix A but the *TMA tensor* that
#    `make_tiled_tma_atom` returned in `__call__`: a tensor of coordinates (its strides print as
#    `1@1`, `1@0`: one step of coordinate 1, of coordinate 0), because a TMA instruction takes tile
#    coordinates; the address, strides, box size and swizzle of A live in the TMA descriptor,
#    `tma_atom_a`.
# 2. **`gA = cute.local_tile(mA, self.cta_tile, (pid_m, pid_n, None), proj=(1, None, 1))`** cuts
#    out this CTA's tiles. The tiler `cta_tile = (bM, bN, bK)` describes the whole problem
#    (M, N, K), but A has only the modes M and K: `proj=(1, None, 1)` keeps modes 0 and 2 of tiler
#    and coordinate and drops N (`None` in `proj` = not a mode of this tensor). The coordinate then
#    picks M-tile `pid_m` and - `None` in the coordinate = keep them all - every K tile: `gA` is
#    (bM, bK, k_tiles). B uses `proj=(None, 1, 1)`, C `proj=(1, 1, None)`.
# 3. **`tAsA, tAgA = cpasync.tma_partition(tma_atom_a, 0, cute.make_layout(1), group_modes(sA, 0, 2), group_modes(gA, 0, 2))`**
#    pairs shared and global views for the copy: `group_modes(x, 0, 2)` folds a tile's (bM, bK)
#    into one mode, and the result's first mode, "TMA", is everything one TMA instruction moves -
#    here the whole 128 x 64 box. `0` and `make_layout(1)` say: CTA 0 of a cluster of one, no
#    multicast. So `cute.copy(tma_atom_a, tAgA[None, k_tile], tAsA[None, buffer], tma_bar_ptr=full)`
#    is one `cp.async.bulk.tensor` that brings K tile `k_tile` into buffer `buffer`. (CuTe's
#    names read `t`, partitioner, memory, tensor: `tAgA` is the global (`g`) tensor A
#    partitioned (`t`) for A's copy (`A`); `tCrA` of item 5 is A partitioned for the MMA (`C`)
#    as a register (`r`) fragment.)
# 4. **`sA`** is the shared-memory buffer ring, (bM, bK, ab_buffers), carrying the 128-byte
#    swizzle of section 5.3 in its layout.
# 5. **`thr_mma = tiled_mma.get_slice(warpgroup_idx * 128)`** is the part of the tiled MMA (two
#    warpgroups stacked along M) this thread's warpgroup executes; **`thr_mma.partition_A(sA)`**
#    gives that warpgroup's 64 rows of every buffer, in the 64 x 16 blocks of one `wgmma`, and
#    **`tiled_mma.make_fragment_A(...)`** turns them into `tCrA` (MMA, MMA_M, MMA_K, ab_buffers):
#    one 64-bit **wgmma descriptor** per block (shared-memory start address, strides, swizzle
#    mode). The `r` of CuTe's naming convention notwithstanding, no element of A is in registers:
#    `wgmma` reads A and B from shared memory through these descriptors. Only **`acc`**, the
#    accumulator, is a register tensor.
# 6. **`cute.gemm(tiled_mma, acc, tCrA[None, None, k_block, buffer], tCrB[...], acc)`** in the
#    main loop issues one `wgmma` with one descriptor of each operand.
#
# The layouts are static here (the GEMM is compiled for one shape), so CuTe computes them while
# the kernel is traced. `nb.trace_layouts` compiles a copy of the file with a print-like hook
# after each of these lines (the stage file is not touched) and shows what CuTe computed for
# M = N = K = 1024; the picture places them on the path from global memory to the tensor cores.

# %%
layouts = nb.trace_layouts(
    1, "hopper", ["mA", "gA", "tAgA", "tAsA", "sA", "tCrA", "tCrB", "acc"], shape=(1024, 1024, 1024)
)
fig = figures.prepare_views(
    cta_tile=cfg.get("cta_tile", (128, 256, 64)),
    ab_buffers=cfg.get("ab_buffers", 4),
    mma_warpgroups=cfg.get("mma_warpgroups", 2),
    shape=(1024, 1024, 1024),
    layouts=layouts,
)

# %% [markdown]
# **What `tx_count` counts.** `PipelineTmaAsync.create(num_stages=ab_buffers, producer_group=...,
# consumer_group=..., tx_count=a_bytes + b_bytes)` creates, per buffer, a *full* barrier that
# expects one arrival (the producer's `mbarrier.arrive.expect_tx`) and `tx_count` **bytes**: every
# byte TMA writes into the buffer counts the transaction count down, and the phase completes when
# arrivals and bytes both reach zero. So `tx_count` must be exactly what the copies of one K tile
# bring, 16 KiB of A + 32 KiB of B. Too many and the barrier never completes (a hang); too few and
# the consumers start reading before the last bytes have landed (a race). The PTX shows the
# number the producer arms:

# %%
from common.tools.ptx import expect_tx_immediates  # noqa: E402

report = nb.compile_report(1, "hopper")
armed = sorted({b for b in expect_tx_immediates(report.ptx) if b is not None})
print(
    f"arrive.expect_tx arms {armed} bytes; A tile {bM * bK * 2} + B tile {bN * bK * 2} = "
    f"{(bM + bN) * bK * 2} bytes per K tile"
)

# %% [markdown]
# **Why the producer's first wait uses parity 1.** An mbarrier counts *phases*: it starts in
# phase 0, and each time its pending arrivals (and bytes) reach zero the phase completes and the
# next one begins. `mbarrier.try_wait.parity p` returns once the most recent phase of parity `p`
# has completed. On a fresh barrier no phase has completed, but the one "before phase 0" - parity
# 1 - counts as complete, so a wait for parity 1 returns at once and a wait for parity 0 blocks
# until the first completion. The pipeline uses exactly that: the r-th use of a buffer waits on
# *full* with parity r % 2 (the consumer must wait for TMA), and the producer's r-th fill waits on
# *empty* with parity (r + 1) % 2, so its first wait, on a buffer nobody has used yet, passes at
# once. That is why CuTe's `make_pipeline_state(PipelineUserType.Producer, n)` starts with phase
# 1 and the consumer's with phase 0, and why stage 4 can start a fresh slot with
# `slot_state(slot, 1)`.

# %%
fig = figures.barrier_phases(uses=3)

# %% [markdown]
# > **Trace time and run time.** `cute.compile` runs the Python of `__call__` and `kernel` once,
# > to *trace* them: each CuTe call records operations into an MLIR program, which is compiled to
# > PTX. A kernel therefore mixes two kinds of values.
# >
# > - **Trace-time values** are plain Python: `self.cta_tile`, `self.ab_buffers`, static shapes,
# >   `k_blocks = cute.size(tCrA, mode=[2])` (= 4). Python arithmetic on them happens once, at
# >   compile time; `print(x)` in a kernel prints once, while tracing (how `trace_layouts` above
# >   works).
# > - **Run-time values** exist only on the GPU: `cute.arch.thread_idx()`, `warp_idx`,
# >   `block_idx`, loop counters, `cutlass.Int32` variables, the extents of a dynamic layout
# >   (from stage 2 on). `cute.printf` prints them at run time.
# > - `for k_block in cutlass.range_constexpr(k_blocks):` is a Python loop, unrolled while
# >   tracing: its 4 `cute.gemm` calls are 4 `wgmma` instructions in the PTX. Its bound must be a
# >   trace-time value.
# > - `for k_tile in cutlass.range(k_tiles, unroll=1):` becomes a loop *in the PTX*, run
# >   `k_tiles` times on the GPU (`unroll=1`: do not unroll it); its bound may be a run-time value.
# > - `if warp_idx == 0:` tests a run-time value, so the DSL (which rewrites the kernel's `if` and
# >   `for` statements) emits a branch: warp 0 takes it on the GPU, the others skip it.
# > - A Python `if` on a trace-time value (a shape, `self.ab_buffers > 2`) is decided when the
# >   kernel is compiled: the DSL emits it with a constant condition, which the compiler folds
# >   away - no branch in the PTX. `if cutlass.const_expr(cond):` goes further: `cond` is
# >   evaluated in Python and only the taken branch is traced at all (needed when the other branch
# >   would not even trace for this configuration); a run-time `cond` is an error there.
# >
# > Later notebooks refer to this box as "trace time and run time (stage 1, section 5.2)".
#
# The compiled PTX shows the difference: the K loop runs 16 times at M = N = K = 1024, yet the
# PTX holds only one K tile's worth of `wgmma`:

# %%
print(
    f"K tiles at K = 1024: {1024 // bK} (a run-time loop: cutlass.range); wgmma.mma_async in the "
    f"PTX: {report.counts['wgmma.mma_async']} = bK / 16 (cutlass.range_constexpr, unrolled)"
)

# %% [markdown]
# ### 5.3 Shared memory: TMA and the 128-byte swizzle
#
# One thread issues a TMA load (`cp.async.bulk.tensor`) per operand tile; the copy engine writes the
# tile into shared memory and counts the bytes on an mbarrier. A K tile row of 64 bf16 is exactly
# 128 bytes = eight 16-byte chunks. Shared memory has 32 banks of 4 bytes, so a plain row-major tile
# puts chunk 0 of every row in banks 0-3: when the tensor cores read the same chunk from 8 rows,
# they hit the same 4 banks 8 times. The 128-byte swizzle (CuTe's `Swizzle<3,4,3>` applied to byte
# addresses, TMA's `SWIZZLE_128B`) stores logical chunk c of row r at chunk c XOR (r mod 8): the same
# 8 reads now touch all 32 banks. TMA writes in this pattern and `wgmma` reads in it, so nobody
# pays for it, and it is why the tiles are 1024-byte aligned (`smem_align`).

# %%
fig = figures.swizzle_128b(rows=8)

# Where does element (row 5, k = 20) of a bf16 K tile live?
row, k = 5, 20
chunk = k * 2 // 16
byte = figures.swizzle(row * 128 + k * 2)
print(
    f"element (row {row}, k {k}) is in logical chunk {chunk}, stored in chunk "
    f"{figures.swizzle_128b_chunk(row, chunk)} of its row: byte {byte} of the 1 KiB swizzle atom "
    f"(row-major would be byte {row * 128 + k * 2})"
)

# %% [markdown]
# ### 5.4 The pipeline: full and empty barriers
#
# `ab_buffers` shared-memory buffers each hold one K tile of A and B. Every buffer has two
# mbarriers:
#
# - **full[i]** completes when TMA has written the buffer: the producer announces the byte count
#   with `arrive.expect_tx`, the copy engine counts the bytes down (section 5.2);
# - **empty[i]** completes when every consumer warp has arrived after its MMAs finished reading.
#
# The r-th use of buffer i waits for parity r % 2 (section 5.2), which is why the `PipelineState`
# objects carry `(index, phase)` and `advance()` flips the phase every time the index wraps
# around. The kernel first fills all `ab_buffers` buffers; after that, while K tile k is being
# multiplied, TMA can be loading at most `ab_buffers - 1` tiles ahead of it (k + 1 ...
# k + ab_buffers - 1): the buffer of tile k - 1 is refilled only once its wgmmas have completed.
# The picture is a model schedule (durations illustrative, not measured) with 2 buffers and with
# the stage's `ab_buffers`, on one time axis: with 2, the tensor cores wait for every load.

# %%
fig = figures.gemm_pipeline_timeline(
    ab_buffers=(2, cfg.get("ab_buffers", 4)), k_tiles=10, load_time=3.0, mma_time=1.0
)

# %% [markdown]
# The main loop in the stage file. Note the order inside an iteration: issue this K tile's 4
# `wgmma` (m64n256k16: 4 x 16 = 64 = $b_K$), commit them as a group, `wait_group(1)` = wait until
# only the group just issued is still running, *then* release the previous buffer and refill it.
# Releasing before the wait would let TMA overwrite operands the tensor cores are still reading.

# %%
nb.show_source(1, "hopper", section="# 2.")
nb.show_source(1, "hopper", names=["Sm90Kernel.load_tiles"])

# %% [markdown]
# ### 5.5 The accumulator: which thread holds what
#
# `wgmma.mma_async.m64nNk16` multiplies a 64 x 16 tile of A by a 16 x N tile of B into a 64 x N fp32
# accumulator spread over the 128 threads of the warpgroup. The PTX ISA fixes the layout: lane t
# (0-31) of warp w holds rows $16w + \lfloor t/4 \rfloor$ and $16w + \lfloor t/4 \rfloor + 8$, columns
# $2(t \bmod 4) + 8i + \{0, 1\}$ for $i = 0 \ldots N/8 - 1$: N/2 registers per thread, and each
# row spread over the 4 threads of a *quad*. With two warpgroups stacked along M and N = 256 that is
# 128 fp32 registers per thread for C. This layout matters from stage 3 on, when the softmax
# reduces rows.

# %%
fig = figures.wgmma_accumulator_layout(n=32, thread=5)

# The picture is drawn from CuTe's thread-value layout of the atom; check it against the rule above.
n = cfg.get("cta_tile", (128, 256, 64))[1]
for t in range(128):
    w, lane = divmod(t, 32)
    for v, r, c in figures.wgmma_c_coords(t, n):
        i, j = divmod(v, 4)  # register v = 4 i + j
        assert r == 16 * w + lane // 4 + 8 * (j // 2) and c == 2 * (lane % 4) + 8 * i + j % 2
print(
    f"64 x {n} accumulator ({figures.layout_str(*figures.wgmma_c_tv(n))}): "
    f"{len(figures.wgmma_c_coords(0, n))} fp32 registers per thread, the rule holds for all 128 threads"
)

# %% [markdown]
# ### 5.6 The epilogue
#
# After the last `wgmma` has completed, the accumulator is rounded to bf16, written to shared memory
# with `stmatrix` (a warp-wide store of 8 x 8 tiles of 16-bit values from registers, the reverse
# of `ldmatrix`; reusing the A buffers, idle by then) and stored by one TMA store per tile, which
# also clips rows and columns that fall outside C.

# %%
nb.show_source(1, "hopper", section="# 3.")

# %% [markdown]
# ### 5.7 What the compiler produced
#
# The Hopper kernel compiled for sm_90a with fake tensors (no GPU needed, so this is shown in
# both modes): registers per thread and spills (where the ptxas on PATH reads the DSL's PTX; the
# summary says when it cannot), the dynamic shared memory, the bytes each full
# barrier expects, how many instructions of each family the PTX holds and a few of them. The
# exercises refer to this summary.

# %%
report = nb.compile_summary(1, "hopper")

# %% [markdown]
# ### 5.8 The same stage on Blackwell
#
# `stages/stage1_gemm/blackwell.py` computes the same thing on sm_100a (B200, GB200) with a
# different machine model. This is the one place the model is described; later notebooks say only
# what their stage changes in it.
#
# - **Registers -> tensor memory.** The accumulator of `tcgen05.mma` lives in TMEM, 128 lanes x 512
#   columns of 32 bits per SM, not in the registers of the threads that issued the MMA. Threads
#   reach it with `tcgen05.ld` / `tcgen05.st`; a warp may touch only its quarter of the lanes
#   (warp w % 4 owns lanes 32 (w % 4) ... 32 (w % 4) + 31), so row r of a 128-row tile belongs to
#   one thread.
# - **One thread issues the MMA.** On Hopper a whole warpgroup issues `wgmma` and owns its result;
#   on Blackwell one thread of the MMA warp issues `tcgen05.mma` for the whole 128-row tile, and
#   `tcgen05.commit` makes an mbarrier fire when the MMAs are done (that is how a buffer is
#   released: the *empty* barrier is completed by the tensor core, not by consumer threads).
# - **Warp roles.** 6 warps, 192 threads: warps 0-3 run the epilogue here (the softmax from stage 3
#   on; one TMEM lane, i.e. one row, per thread), warp 4 issues the MMAs, warp 5 issues the TMA
#   loads. They hand work to each other only through mbarriers, and each role has its own branch,
#   `if warp_idx == self.tma_warp_id:` - a run-time branch in the sense of section 5.2.
#
# In stage 1 the epilogue warps `tcgen05.ld` their row of the 128 x 128 fp32 accumulator from
# TMEM into registers, 32 columns at a time, and write C. The accumulator takes 128 of the 512
# TMEM columns.
#
# **Blackwell kernels are compile-checked here, not run on hardware.** No sm_100 GPU has run
# them: the Blackwell files are compiled for sm_100a with fake tensors and their PTX is checked for the
# `tcgen05` instructions. Their numerics are tested only where an sm_100 GPU exists.

# %%
fig = figures.blackwell_warp_roles(stage=1)
fig = nb.show_tmem(1)

# %%
nb.show_docstring(1, "blackwell")
nb.show_source(1, "blackwell", section="# 2.")

# %% [markdown]
# The two files share the algorithm, TMA and the mbarrier pipeline, not the MMA, its operands or
# its accumulator. Rather than a whole-file diff, the table puts the lines that do the same job
# side by side (line numbers of the files, found in the code, so they follow it):

# %%
rows = nb.cross_track_table(1)

# %%
report_bw = nb.compile_summary(1, "blackwell")

# %% [markdown]
# ## 6. Run and verify
#
# The check (`common.tools.verify`): C is computed from random bf16 inputs drawn with a fixed seed, the
# output is filled with NaN before the launch (an element the kernel forgets to write fails), and
# the result is compared with an fp64 reference computed from the same bf16 inputs.
# **Expected:** a relative error (norm of the difference over norm of the reference) around
# $2\cdot 10^{-3}$, the rounding of C to bf16, within 3x PyTorch's own bf16 GEMM error and below
# the hard bound $10^{-2}$ (the table prints the bound used: the smaller of the two). Without a GPU
# the cell says it is skipped, and the error map below is PyTorch's own bf16 GEMM on the CPU: the
# yardstick the kernel is held to, uniform rounding noise. A bug would show structure instead - a
# tile, a band of rows, a column.

# %%
result = nb.run_and_verify(1, (1024, 1024, 1024))

# %%
fig = nb.error_picture(1, result)

# %% [markdown]
# ## 7. Measure
#
# TFLOP/s = $2MNK$ / time, medians of CUDA-event timings after warm-up, inputs rotated so that they
# do not stay in L2, cuBLAS (`torch.matmul`) timed in the same run. **Expected:** about as fast
# as cuBLAS at $8192^3$, well below the H100/H200 datasheet peak for dense bf16 (989); at
# $4096^3$, where cuBLAS's call takes about 0.17 ms, the ratio moves more from run to run (each
# call is timed between CUDA events, host work included: a call whose host work outlasts its
# kernel is timed by the host). A `make bench`
# run (H200, 2026-11-29, bf16; `docs/results/bench_h200_2026-11-29.md`) measured stage 1 at 758
# TFLOP/s against cuBLAS's 774 at $4096^3$ (0.98x) and 784 against 690 at $8192^3$ (1.14x); two
# runs of this notebook on an H100 80GB HBM3 on 2026-12-07
# (`docs/results/notebook_runs_h100_2026-12-07.md`) measured 0.51x and 0.98x at $4096^3$, 1.06x
# and 1.13x at $8192^3$. Numbers drift between runs and machines, so the table below - this run - is what to compare; its last column is stage 1's
# speed over each kernel (above 1: stage 1 is faster).
#
# To measure a changed kernel in the same run, pass variants: the kernel class is built with
# those settings, compiled anew and timed next to the original, e.g.
# `nb.measure(1, shapes, variants={"ab_buffers=2": dict(ab_buffers=2)})`. To measure an edit of
# the file itself, run `nb.reload_stage(1)` first.

# %%
bench = nb.measure(1, [(4096, 4096, 4096), (8192, 8192, 8192)])

# %% [markdown]
# ## 8. Exercises
#
# The answers and checks are collected at the end of the notebook.
#
# 1. **Pipeline depth.** In the model of 5.4, try `ab_buffers=(2, 3)`. Show that the MMAs never
#    wait once `load_time <= (ab_buffers - 1) * mma_time`. How many 48 KiB buffers fit in the 227 KiB
#    a CTA may use on an H200, and what does the epilogue's reuse of the A buffers save? Check the
#    shared memory of other depths without a GPU:
#    `nb.compile_summary(1, "hopper", settings=dict(ab_buffers=5))`. On a GPU, time them in one
#    run: `nb.measure(1, [(8192, 8192, 8192)], variants={"ab_buffers=2": dict(ab_buffers=2), "ab_buffers=3": dict(ab_buffers=3)})`
#    (or edit `self.ab_buffers` in `hopper.py`, run `nb.reload_stage(1)` and re-run section 7).
# 2. **Who holds C[37, 100]?** With two warpgroups stacked along M and N = 256, find the thread of
#    the CTA and the register that hold element (37, 100) of the 128 x 256 tile.
# 3. **Swizzle.** Where does element (row 13, k = 41) of a bf16 K tile land? Why must the buffers be
#    1024-byte aligned rather than 128-byte aligned?
# 4. **PTX.** In the compile summary of 5.7, find the `wgmma.mma_async` instructions. Which m/n/k
#    shape do they have, and why are there 4 in the PTX although the kernel runs one per 16-wide K
#    step of every K tile? (The box of 5.2.)
# 5. **Tile size.** Compile the kernel with `settings=dict(cta_tile=(128, 128, 64))` and compare
#    registers, shared memory, the `expect_tx` bytes and the `wgmma` shape with 5.7. Which number
#    of section 3 predicts the speed you would lose, and by how much? On a GPU, measure it as a
#    variant.
# 6. **Trace time.** In `# 1. Prepare` and `# 2. Main loop`, which values are known at trace time
#    and which only at run time: `k_tiles`, `k_blocks`, `pid_m`, `warp_idx`, `read_state.index`?
#    Which `if` statements become branches in the PTX?
# 7. **Blackwell.** The Blackwell file uses a 128 x 128 tile and `tcgen05.ld` in slices of 32
#    columns. How many TMEM columns would a 128 x 256 fp32 accumulator take, and how many registers
#    per thread would one `tcgen05.ld` of all of it need?
#
# ### Answers and checks
#
# <details><summary>1. Pipeline depth</summary>
#
# K tile k + ab_buffers - 1 is loaded into the buffer that the MMAs of tile k - 1 release, so it
# starts when those end and lands load_time later, while the MMAs of tiles k ... k + ab_buffers - 2
# run, (ab_buffers - 1) x mma_time in all: no wait if load_time <= (ab_buffers - 1) x mma_time.
# 4 buffers of 48 KiB take 192 KiB; a fifth would need 240 KiB > 227 KiB (the compile summary with
# `ab_buffers=5` shows 241 KiB, the buffers plus 1 KiB of mbarriers and alignment: it compiles,
# but a launch would be refused). The 64 KiB staging tile of C lives in the A buffers; without
# that reuse, 4 x 48 + 64 = 256 KiB would not fit, so only 3 buffers would.
# </details>
#
# <details><summary>2. Who holds C[37, 100]</summary>
#
# Row 37 is in warpgroup 0 (rows 0-63), warp 2 (rows 32-47), row 5 of that warp: lanes 4 x 5 ...
# 4 x 5 + 3 = 20-23 hold it; column 100 = 8 x 12 + 4, so lane 20 + (4 / 2) = 22, i.e. thread
# 32 x 2 + 22 = 86, register 4 x 12 + 0 = 48 (the cell below searches all 128 threads).
# </details>
#
# <details><summary>3. Swizzle</summary>
#
# k = 41 is in logical chunk 5 (bytes 80-95 of the row), stored at chunk 5 XOR (13 mod 8) = 0 of
# row 13: byte 13 x 128 + 0 + 2 = 1666 of the tile (the cell below computes it). The XOR takes its
# 3 bits from address bits 7-9 (the row within 8 rows of 128 bytes): the pattern is defined on
# 1024-byte blocks, and TMA and `wgmma` assume a block starts at a 1024-byte boundary.
# </details>
#
# <details><summary>4. PTX</summary>
#
# `wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16`: 64 rows (one warpgroup), N = 256, K =
# 16. The inner loop over the 4 k_blocks of a K tile is `cutlass.range_constexpr`, unrolled while
# tracing into 4 instructions; the K loop around it is `cutlass.range`, a run-time loop that runs
# those 4 instructions k_tiles times.
# </details>
#
# <details><summary>5. Tile size</summary>
#
# With bN = 128: 90 registers (64 for the accumulator; ptxas of CUDA 13.0, 2026-12-07), 129 KiB
# of shared memory (4 x 32 KiB and 1 KiB of mbarriers and alignment), `expect_tx` 32 KiB, `wgmma`
# m64n128k16. Section 3's FLOP per byte falls from 85 to 64: 1.33x more traffic per FLOP, so
# where the GEMM is bound by feeding the tensor cores it loses up to a quarter of its speed.
# </details>
#
# <details><summary>6. Trace time</summary>
#
# `k_blocks` (4) is a trace-time value. `k_tiles` is known at trace time here because stage 1
# compiles one kernel per shape (static layouts), but it is used as the bound of a run-time loop;
# with dynamic layouts (from stage 2 on) the same code would read it on the GPU. `pid_m`, `warp_idx`
# and `read_state.index` are run-time values. `if warp_idx == 0:`, `if k_tile > 0:` and
# `if warp_idx == 0 and producer_state.count < k_tiles:` are run-time branches; the
# `cutlass.range_constexpr` loop leaves no loop at all.
# </details>
#
# <details><summary>7. Blackwell</summary>
#
# 256 of the 512 columns (one 32-bit column per fp32 element of a row). A whole row is 256 fp32
# values per thread: more than the 255 registers a thread may have, and more than one `tcgen05.ld`
# moves (`.32x32b` goes up to `.x128`, 128 registers). So a 128 x 256 accumulator needs more than
# one load per row; the epilogue reads 32 columns at a time, which also keeps few registers live.
# </details>

# %%
# Exercise 2: every (thread, register) of warpgroup 0 holding row 37, column 100 of its 64 x 256
# accumulator (warpgroup 0 owns rows 0-63 of the tile, so its thread numbers are the CTA's).
hits = [
    (t, v) for t in range(128) for v, r, c in figures.wgmma_c_coords(t, 256) if (r, c) == (37, 100)
]
print("(thread, register d<v>):", hits)

# Exercise 3: element (row 13, k = 41).
row, k = 13, 41
print(
    f"logical chunk {k * 2 // 16} -> stored chunk {figures.swizzle_128b_chunk(row, k * 2 // 16)}: "
    f"byte {figures.swizzle(row * 128 + k * 2)} of the tile"
)

# %% [markdown]
# **Next:** `make diff-2` shows what stage 2 adds to this one (`TRACK=blackwell` for the other
# track), and [`stage2_qk.ipynb`](stage2_qk.ipynb) walks through it.
# What this stage's measurements showed, and what was tried and dropped: [`docs/notes/stage1.md`](../docs/notes/stage1.md).
