"""Stage 1 - GEMM (Hopper, sm_90a). C[M, N] = A[M, K] @ B[N, K]^T on H100 / H200.

A and B are K-major (row-major, K contiguous: the layout of Q and K in Q @ K^T), bf16 or fp16;
the accumulator is fp32 in registers; C is written in the input dtype. Stage 1 has no
predecessor; it sets up the skeleton that every later Hopper stage keeps:

- CTA tile 128 x 256 x 64 (bM x bN x bK). Two consumer warpgroups (256 threads); warpgroup w owns
  rows [64 w, 64 w + 64) of the tile and issues `wgmma.mma_async` m64n256k16, 4 per K tile.
- Accumulator: 128 x 256 fp32 / 256 threads = 128 fp32 registers per thread (ptxas of
  CUDA 13.0, 2026-12-07: 154 in all, no spills).
- Shared memory per pipeline buffer: A 128 x 64 x 2 B = 16 KiB, B 256 x 64 x 2 B = 32 KiB, 48 KiB in
  all. A CTA may use 227 KiB on H100/H200, so 4 buffers fit (192 KiB; a fifth would need 240 KiB):
  ab_buffers = 4, one CTA per SM.
- TMA brings each K tile of A and B into shared memory (one elected thread issues
  `cp.async.bulk.tensor`), in the 128-byte swizzle that `wgmma` reads without bank conflicts (a
  64-element bf16 row of a K tile is exactly 128 bytes).
- Pipeline: per buffer a "full" mbarrier (completes when TMA has written its 48 KiB: the producer
  announces them with arrive.expect_tx) and an "empty" mbarrier (completes when all 8 consumer
  warps have released the buffer). Each completion flips the barrier's phase bit, so a waiter of
  the r-th use of a buffer waits for phase r % 2; PipelineState carries (index, phase).
- Main loop per K tile: wait "full", wgmma fence, 4 wgmma, commit, then `wgmma.wait_group 1`: the
  batch just issued keeps running while the previous K tile's buffer is released and refilled
  with the K tile ab_buffers - 1 ahead. Warp 0 is a consumer and also the producer (no warp
  specialisation yet).
- Epilogue: registers -> shared memory (`stmatrix`) -> TMA store of the 128 x 256 tile. The
  staging tile for C (128 x 256 x 2 B = 64 KiB) reuses the A buffers (4 x 16 KiB), idle once the
  last wgmma has finished:

      shared memory | ab_full, ab_empty | sA: 4 x 16 KiB (main loop) | sB: 4 x 32 KiB |
                    |                   | sC: 64 KiB    (epilogue)   |

  A TMA store rather than stores from registers: each thread's accumulator fragment holds pairs
  of adjacent columns scattered over 8-row groups, while TMA writes whole 128-byte lines and
  clips the rows and columns that fall outside C.
- Tile order: the CTA launched i-th (blockIdx.x fastest, the order the hardware starts CTAs in;
  CUDA does not promise it) computes tile i of a band of raster_m = 16 M-tiles walked N-tile by
  N-tile, so the 132 CTAs resident at once (one per SM) cover 16 x ~8 tiles of C and read
  16 x 128 rows of A and ~8 x 256 rows of B (the smallest such footprint), rather than 64 x ~2
  tiles in plain launch order (at M = 8192: 64 M-tiles to a column of C).
- Static layouts (one compile per shape): the index math folds into constants; shapes with a
  size-1 mode get dynamic layouts instead (see gemm()).

Shapes: M, N, K >= 1 with K % 8 == 0 and N % 8 == 0, because TMA needs every row of A, B and C
to start on a 16-byte boundary. M, N and K need not be multiples of the tile: TMA fills the parts
of A and B tiles outside the matrices with zeros (K is padded to a multiple of 64 with zeros,
which add nothing) and clips the store of C.

Measured speed against cuBLAS: docs/results/README.md (the tile order: docs/notes/stage1.md).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from common import checks
from common.compile import cached_compile
from common.cute_interop import current_stream, cute_dtype, fake_stream, fake_tensor, to_cute
from common.outputs import empty_output


class Sm90Kernel:
    def __init__(self, dtype):
        self.dtype = dtype  # element type of A, B and C: cutlass.BFloat16 or cutlass.Float16
        self.acc_dtype = cutlass.Float32
        self.cta_tile = (128, 256, 64)  # (bM, bN, bK)
        self.mma_warpgroups = 2  # warpgroup w computes rows [64 w, 64 w + 64) of the tile
        self.threads = 128 * self.mma_warpgroups
        self.ab_buffers = 4  # 4 x 48 KiB of the 227 KiB of shared memory
        self.raster_m = 16  # M-tiles per band of the tile order
        self.smem_align = 1024  # the 128-byte swizzle repeats every 8 rows of 128 B

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream):
        bM, bN, bK = self.cta_tile
        row_major = LayoutEnum.ROW_MAJOR  # A, B: K contiguous; C: N contiguous

        # Two m64n256k16 wgmma atoms stacked along M, one per warpgroup.
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            row_major.sm90_mma_major_mode(),
            row_major.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.mma_warpgroups, 1, 1),
            tiler_mn=(64, bN),
        )
        # (bM, bK, ab_buffers), 128B-swizzled
        a_smem_layout = sm90_utils.make_smem_layout_a(
            row_major, self.cta_tile, self.dtype, self.ab_buffers
        )
        # (bN, bK, ab_buffers), 128B-swizzled
        b_smem_layout = sm90_utils.make_smem_layout_b(
            row_major, self.cta_tile, self.dtype, self.ab_buffers
        )
        # (bM, bN, 1), 128B-swizzled
        c_smem_layout = sm90_utils.make_smem_layout_epi(self.dtype, row_major, (bM, bN), 1)

        # TMA descriptors: a (bM, bK) box of A and a (bN, bK) box of B per K tile; C's tile.
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), a, cute.select(a_smem_layout, mode=[0, 1]), (bM, bK)
        )
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), b, cute.select(b_smem_layout, mode=[0, 1]), (bN, bK)
        )
        tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, cute.select(c_smem_layout, mode=[0, 1]), (bM, bN)
        )

        @cute.struct
        class SharedStorage:
            ab_full: cute.struct.MemRange[cutlass.Int64, self.ab_buffers]
            ab_empty: cute.struct.MemRange[cutlass.Int64, self.ab_buffers]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(a_smem_layout)], self.smem_align
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(b_smem_layout)], self.smem_align
            ]

        self.shared_storage = SharedStorage
        self.shared_memory_bytes = SharedStorage.size_in_bytes()

        # One CTA per 128 x 256 tile of C.
        grid = (cute.ceil_div(c.shape[0], bM), cute.ceil_div(c.shape[1], bN), 1)
        self.kernel(
            tiled_mma,
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            tma_atom_c,
            tma_c,
            a_smem_layout,
            b_smem_layout,
            c_smem_layout,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        c_smem_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)

        # 1. Prepare
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)

        # Tile order: the CTA launched i-th (blockIdx.x fastest) takes tile i of a band of
        # raster_m M-tiles walked N-tile by N-tile.
        m_tiles, n_tiles, _ = cute.arch.grid_dim()
        bidx, bidy, _ = cute.arch.block_idx()
        launch_idx = bidx + bidy * m_tiles
        band = launch_idx // (self.raster_m * n_tiles)
        band_m_tiles = cutlass.min(m_tiles - band * self.raster_m, self.raster_m)
        in_band = launch_idx - band * self.raster_m * n_tiles
        pid_m = band * self.raster_m + in_band % band_m_tiles
        pid_n = in_band // band_m_tiles

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # (bM, bK, ab_buffers)
        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        # (bN, bK, ab_buffers)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        # (bM, bN): over sA's bytes, used only after the main loop
        sC = cute.make_tensor(
            cute.recast_ptr(sA.iterator, c_smem_layout.inner, dtype=self.dtype),
            cute.select(c_smem_layout.outer, mode=[0, 1]),
        )

        # ab_full[i]: 1 arrive (the producer's expect_tx of 48 KiB) + the 48 KiB TMA writes.
        # ab_empty[i]: 1 arrive from each of the 8 consumer warps.
        a_bytes = cute.size_in_bytes(self.dtype, cute.select(a_smem_layout, mode=[0, 1]))  # 16 KiB
        b_bytes = cute.size_in_bytes(self.dtype, cute.select(b_smem_layout, mode=[0, 1]))  # 32 KiB
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            num_stages=self.ab_buffers,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=a_bytes + b_bytes,
            barrier_storage=storage.ab_full.data_ptr(),
        )

        # (bM, bK, k_tiles)
        gA = cute.local_tile(mA, self.cta_tile, (pid_m, pid_n, None), proj=(1, None, 1))
        # (bN, bK, k_tiles)
        gB = cute.local_tile(mB, self.cta_tile, (pid_m, pid_n, None), proj=(None, 1, 1))
        # (bM, bN)
        gC = cute.local_tile(mC, self.cta_tile, (pid_m, pid_n, None), proj=(1, 1, None))
        k_tiles = cute.size(gA, mode=[2])

        # TMA views, one CTA (no multicast): (TMA, ab_buffers) and (TMA, k_tiles)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a,
            0,
            cute.make_layout(1),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        # (TMA, ab_buffers) and (TMA, k_tiles)
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b,
            0,
            cute.make_layout(1),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )

        # wgmma views of this thread's warpgroup: shared-memory descriptors for A and B.
        thr_mma = tiled_mma.get_slice(warpgroup_idx * 128)
        # (MMA, MMA_M, MMA_K, ab_buffers)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        # (MMA, MMA_N, MMA_K, ab_buffers)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        # (MMA, MMA_M, MMA_N): 128 fp32 per thread
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C(self.cta_tile[:2]), self.acc_dtype)
        k_blocks = cute.size(tCrA, mode=[2])  # bK / 16 = 4 wgmma per K tile

        # 2. Main loop
        producer_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.ab_buffers
        )
        read_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.ab_buffers
        )
        release_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.ab_buffers
        )

        # Fill the pipeline: the first ab_buffers K tiles are in flight before the first wgmma.
        if warp_idx == 0:
            for _ in cutlass.range(cutlass.min(self.ab_buffers, k_tiles), unroll=1):
                self.load_tiles(
                    ab_pipeline, producer_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB
                )
                producer_state.advance()

        # The first wgmma overwrites the accumulator, the others add to it.
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for k_tile in cutlass.range(k_tiles, unroll=1):
            # Wait until TMA has written this K tile's A and B.
            ab_pipeline.consumer_wait(read_state)

            # acc += A_tile @ B_tile^T, as 4 asynchronous m64n256k16 steps
            warpgroup.fence()
            for k_block in cutlass.range_constexpr(k_blocks):
                coord = (None, None, k_block, read_state.index)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()

            # Leave this K tile's wgmmas running; wait for the previous K tile's only.
            warpgroup.wait_group(1)
            read_state.advance()
            if k_tile > 0:
                # The previous K tile's buffer is read: release it, then refill it with K tile
                # k_tile - 1 + ab_buffers. (Refilling before the release would deadlock.)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                if warp_idx == 0 and producer_state.count < k_tiles:
                    self.load_tiles(
                        ab_pipeline, producer_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB
                    )
                    producer_state.advance()

        warpgroup.wait_group(0)

        # 3. Epilogue
        # Both warpgroups have finished reading sA, which sC overwrites.
        cute.arch.sync_threads()

        # C = acc rounded to the input dtype, written to shared memory by stmatrix.
        r2s_copy = cute.make_tiled_copy_C(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, self.acc_dtype),
            tiled_mma,
        )
        thr_r2s = r2s_copy.get_slice(tidx)
        # (R2S, R2S_M, R2S_N)
        tRS_acc = r2s_copy.retile(acc)
        # (R2S, R2S_M, R2S_N)
        tRS_rC = cute.make_rmem_tensor_like(tRS_acc, self.dtype)
        tRS_rC.store(tRS_acc.load().to(self.dtype))
        # (R2S, R2S_M, R2S_N)
        tRS_sC = thr_r2s.partition_D(sC)
        cute.copy(r2s_copy, tRS_rC, tRS_sC)

        # Make these shared-memory writes visible to TMA (the async proxy), then wait for all.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        # (TMA) and (TMA): the whole tile, clipped to C's bounds by TMA
        tCsC, tCgC = cpasync.tma_partition(
            tma_atom_c,
            0,
            cute.make_layout(1),
            cute.group_modes(sC, 0, 2),
            cute.group_modes(gC, 0, 2),
        )
        if tidx == 0:
            cute.copy(tma_atom_c, tCsC, tCgC)
            cute.arch.cp_async_bulk_commit_group()
            # The CTA's shared memory must outlive TMA's reads of it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def load_tiles(
        self, ab_pipeline, producer_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB
    ):
        """Producer step: wait until buffer producer_state.index is empty, announce its 48 KiB on
        its full barrier, and start the TMA loads of K tile producer_state.count into it."""
        ab_pipeline.producer_acquire(producer_state)
        full_barrier = ab_pipeline.producer_get_barrier(producer_state)
        k_tile, buffer = producer_state.count, producer_state.index
        cute.copy(tma_atom_a, tAgA[None, k_tile], tAsA[None, buffer], tma_bar_ptr=full_barrier)
        cute.copy(tma_atom_b, tBgB[None, k_tile], tBsB[None, buffer], tma_bar_ptr=full_barrier)


def compile_args(dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors, shape = (M, N, K); no scale in stage 1.
    The layouts are those gemm() launches with: static, dynamic when a dimension is 1."""
    checks.check_options(options, allowed=())
    M, N, K = shape
    dynamic = 1 in (M, N, K)
    a, b, c = (fake_tensor(dtype, s, dynamic=dynamic) for s in ((M, K), (N, K), (M, N)))
    return Sm90Kernel(cute_dtype(dtype)), (a, b, c, fake_stream())


def gemm(a, b):
    """C = A @ B^T for A (M, K) and B (N, K), both bf16 or both fp16, K contiguous. fp32
    accumulation; C (M, N) in the input dtype."""
    checks.check_tensor("a", a, rank=2)
    checks.check_tensor("b", b, rank=2)
    checks.check_same_dtype(("a", "b"), (a, b))
    checks.check_same_device(("a", "b"), (a, b))
    checks.check_inference_only(("a", "b"), (a, b), "this GEMM kernel")
    checks.check_dim_eq("a", a, 1, "b", b, 1, "inner dimension K of C = A @ B^T")
    (M, K), N = a.shape, b.shape[0]
    checks.check_positive("M = a.shape[0]", M)
    checks.check_positive("N = b.shape[0]", N)
    checks.check_positive("K = a.shape[1]", K)
    checks.check_multiple(
        "K = a.shape[1]", K, 8, "TMA reads rows of A and B that start on 16-byte boundaries"
    )
    checks.check_multiple(
        "N = b.shape[0]", N, 8, "TMA writes rows of C that start on 16-byte boundaries"
    )

    with torch.cuda.device(a.device):
        c = empty_output((M, N), a.dtype, a.device)
        # Static shapes and strides, one compile per shape: the index math folds into constants.
        # But a static size-1 mode (M = 1) is folded away and changes the rank of the TMA copies,
        # so such shapes get dynamic layouts, compiled once per dtype. (The cache key holds
        # which.)
        dynamic = 1 in (M, N, K)
        args = [to_cute(t, dynamic=True) if dynamic else to_cute(t) for t in (a, b, c)]
        cached_compile(Sm90Kernel(cute_dtype(a.dtype)), *args, current_stream())(
            *args, current_stream()
        )
    return c
