"""Stage 1 - GEMM (Blackwell, sm_100a). C[M, N] = A[M, K] @ B[N, K]^T on B200 / GB200.

A and B are K-major (row-major, K contiguous: the layout of Q and K in Q @ K^T), bf16 or fp16;
the accumulator is fp32 in tensor memory (TMEM); C is written in the input dtype. Stage 1 has
no predecessor; it sets up the skeleton every later Blackwell stage keeps:

- One CTA of 192 threads computes one 128 x 128 tile of C, in three warp roles:
  warp 5 (tma_warp_id) issues the TMA loads, warp 4 (mma_warp_id) issues `tcgen05.mma` from one
  thread, warps 0-3 (softmax_warp_ids) read the accumulator out of TMEM with `tcgen05.ld` and
  write C. From stage 3 on these four warps run the softmax, hence their name.
- Per k-step TMA brings a 128 x 64 tile of A and one of B: 16 KiB + 16 KiB = 32 KiB (64 bf16 =
  128 bytes, one row of the 128-byte swizzle). ab_buffers = 4 such buffers take 128 KiB of the
  227 KiB a CTA may use (129 KiB with barriers and alignment).
- Pipeline: per buffer a "full" mbarrier (the TMA warp announces 32 KiB with arrive.expect_tx,
  the TMA bytes complete it) and an "empty" mbarrier (completed by `tcgen05.commit` once the
  MMAs that read the buffer have finished). The phase bit flips each time a buffer is reused.
- The accumulator lives in TMEM, not in registers: 128 lanes (one per row of the tile) x 128
  fp32 columns, allocated by warp 0 (`tcgen05.alloc`, 128 of the 512 columns), filled by four
  `tcgen05.mma` 128 x 128 x 16 per k-step, and freed with `tcgen05.dealloc` at the end, after
  every warp that read it has issued `tcgen05.fence::before_thread_sync` and met the others at
  a barrier (common/tmem.py says why). Before that, `tcgen05.relinquish_alloc_permit` tells the
  hardware that this CTA will allocate no more TMEM.
- Epilogue: once `tcgen05.commit` signals the accumulator complete, thread t of softmax warp w
  reads row 32 w + t with `tcgen05.ld.32x32b.x32` (32 fp32 columns per load, 4 loads), converts
  to bf16/fp16 and stores its 64 contiguous bytes per load straight to global memory, 16 bytes
  at a time: a 16-byte piece is stored only if its (row, column) lies inside C, so the last
  tiles of a C whose M or N is not a multiple of 128 write no element outside C.

Shapes: M, N, K >= 1 with K % 8 == 0 and N % 8 == 0, as in the Hopper stage 1: TMA needs every
row of A and B to start on a 16-byte boundary, and a 16-byte piece of a row of C is then either
wholly inside C or wholly outside. TMA fills the parts of A and B tiles outside the matrices
with zeros (K is padded to a multiple of 64 with zeros, which add nothing); the predicated
epilogue skips the rows beyond M and the columns beyond N.

Compile-checked for sm_100a with fake tensors and no GPU (common.tools.ptx.compile_only(1,
"blackwell") sets CuTe DSL's target arch for the compile); never run on Blackwell hardware, so
nothing here is measured. The numerical tests run only where an sm_100 GPU is present.
Measured numbers (Hopper track only): docs/results/README.md.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import torch
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols

from common import checks
from common.compile import cached_compile
from common.cute_interop import (
    current_stream,
    cute_dtype,
    fake_stream,
    fake_tensor,
    rows_of_16_bytes,
    to_cute,
)
from common.outputs import empty_output
from common.tmem import fence_after_thread_sync, fence_before_thread_sync


class Sm100Kernel:
    def __init__(self, dtype):
        self.dtype = dtype  # element type of A, B and C: cutlass.BFloat16 or cutlass.Float16
        self.acc_dtype = Float32
        # (bM, bN, bK): the tile of C per CTA and the k-step; one tcgen05.mma is 128 x 128 x 16.
        self.mma_tiler = (128, 128, 64)
        self.cta_group = tcgen05.CtaGroup.ONE  # one CTA per MMA (no 2-CTA pairs)
        self.cluster_shape_mn = (1, 1)
        # Warp roles: 0-3 read TMEM (epilogue here, softmax from stage 3), 4 MMA, 5 TMA.
        self.softmax_warp_ids = (0, 1, 2, 3)
        self.mma_warp_id = 4
        self.tma_warp_id = 5
        self.threads_per_cta = 32 * len(
            (*self.softmax_warp_ids, self.mma_warp_id, self.tma_warp_id)
        )
        # Named barriers (0 is __syncthreads): the softmax warps among themselves, and the TMEM
        # allocation handshake between the softmax warps and the MMA warp.
        self.epilog_sync_bar_id = 1
        self.tmem_alloc_bar_id = 2
        # Pipeline depths: 4 buffers of (A, B) k-steps; one accumulator tile in TMEM (S from
        # stage 2 on, hence s_buffers).
        self.ab_buffers = 4
        self.s_buffers = 1
        # TMEM columns (32-bit cells; lane = row of the tile): the accumulator from column 0.
        self.tmem_s_offset = 0
        # tcgen05.ld.32x32b.x32: each softmax thread reads 32 fp32 columns of its row per load.
        self.tmem_load_cols = 32
        self.smem_align = 1024  # the 128-byte swizzle pattern repeats every 8 rows = 1 KiB

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream):
        # C's rows start on 16-byte boundaries: each thread stores its row in 16-byte vectors.
        c = rows_of_16_bytes(c)

        # One tcgen05.mma.cta_group::1.kind::f16 per 128 x 128 x 16: A and B from shared memory,
        # both K-major, D (the accumulator) in TMEM.
        tiled_mma = utils.sm100.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            self.cta_group,
            self.mma_tiler[:2],
            tcgen05.OperandSource.SMEM,
        )
        cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (tiled_mma.thr_id.shape,)
        )

        # (MMA, MMA_M, MMA_K, ab_buffers) and (MMA, MMA_N, MMA_K, ab_buffers), 128-byte swizzled
        a_smem_s = utils.sm100.make_smem_layout_a(
            tiled_mma, self.mma_tiler, self.dtype, self.ab_buffers
        )
        b_smem_s = utils.sm100.make_smem_layout_b(
            tiled_mma, self.mma_tiler, self.dtype, self.ab_buffers
        )
        a_smem_one = cute.select(a_smem_s, mode=[0, 1, 2])
        b_smem_one = cute.select(b_smem_s, mode=[0, 1, 2])

        # TMA descriptors: one 128 x 64 box of A and one of B per k-step.
        tma_load_op = cpasync.CopyBulkTensorTileG2SOp(self.cta_group)
        tma_a, tma_ta = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load_op, a, a_smem_one, self.mma_tiler, tiled_mma, cluster_layout_vmnk.shape
        )
        tma_b, tma_tb = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load_op, b, b_smem_one, self.mma_tiler, tiled_mma, cluster_layout_vmnk.shape
        )
        # Bytes one buffer receives: 128 x 64 x 2 (A) + 128 x 64 x 2 (B) = 32 KiB.
        self.ab_tma_bytes = cute.size_in_bytes(self.dtype, a_smem_one) + cute.size_in_bytes(
            self.dtype, b_smem_one
        )
        # TMEM: the 128 x 128 fp32 accumulator takes 128 columns (lane = row, column = column).
        acc_tmem_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        self.num_tmem_alloc_cols = get_num_tmem_alloc_cols(
            tiled_mma.make_fragment_C(acc_tmem_shape)
        )

        @cute.struct
        class SharedStorage:
            ab_bar: cute.struct.MemRange[Int64, self.ab_buffers * 2]
            mma_si_bar: cute.struct.MemRange[Int64, self.s_buffers * 2]
            tmem_holding: Int32
            sA: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(a_smem_s)], self.smem_align
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(b_smem_s)], self.smem_align
            ]

        self.shared_storage = SharedStorage
        self.shared_memory_bytes = SharedStorage.size_in_bytes()

        # One CTA per 128 x 128 tile of C; the last tiles of each dimension may stick out of C.
        grid = (
            cute.ceil_div(cute.size(c, mode=[0]), self.mma_tiler[0]),
            cute.ceil_div(cute.size(c, mode=[1]), self.mma_tiler[1]),
            1,
        )
        self.kernel(
            tiled_mma, tma_a, tma_ta, tma_b, tma_tb, c, cluster_layout_vmnk, a_smem_s, b_smem_s
        ).launch(grid=grid, block=[self.threads_per_cta, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        mC: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        a_smem_s: cute.ComposedLayout,
        b_smem_s: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        tile_coord = (bidx, bidy, None)  # (m tile, n tile, all k-steps)

        # 1. Prepare
        if warp_idx == self.tma_warp_id:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        storage = SmemAllocator().allocate(self.shared_storage)
        # UMMA is CUTLASS's name for tcgen05.mma. PipelineTmaUmma: TMA fills, tcgen05.commit
        # empties; PipelineUmmaAsync: tcgen05.commit fills, threads empty.
        # A/B ring: the TMA warp fills a buffer (full = 32 KiB landed), the MMA warp's
        # tcgen05.commit empties it (one arrive).
        ab_prod, ab_cons = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_bar.data_ptr(),
            num_stages=self.ab_buffers,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.ab_tma_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        ).make_participants()
        # Accumulator hand-off, MMA -> softmax warps: tcgen05.commit marks it complete (full);
        # the 128 softmax threads each arrive once they have read it (empty).
        mma_si_prod, mma_si_cons = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.mma_si_bar.data_ptr(),
            num_stages=self.s_buffers,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 32 * len(self.softmax_warp_ids)
            ),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        ).make_participants()
        epilog_sync_bar = pipeline.NamedBarrier(
            barrier_id=self.epilog_sync_bar_id, num_threads=32 * len(self.softmax_warp_ids)
        )
        tmem_alloc_bar = pipeline.NamedBarrier(
            barrier_id=self.tmem_alloc_bar_id,
            num_threads=32 * len((self.mma_warp_id, *self.softmax_warp_ids)),
        )
        tmem = TmemAllocator(
            storage.tmem_holding.ptr,
            barrier_for_retrieve=tmem_alloc_bar,
            allocator_warp_id=self.softmax_warp_ids[0],
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)

        # (MMA, MMA_M, MMA_K, ab_buffers)
        sA = storage.sA.get_tensor(a_smem_s.outer, swizzle=a_smem_s.inner)
        # (MMA, MMA_N, MMA_K, ab_buffers)
        sB = storage.sB.get_tensor(b_smem_s.outer, swizzle=b_smem_s.inner)

        # (bM, bK, k_tiles)
        gA = cute.local_tile(mA, self.mma_tiler, tile_coord, proj=(1, None, 1))
        # (bN, bK, k_tiles)
        gB = cute.local_tile(mB, self.mma_tiler, tile_coord, proj=(None, 1, 1))
        # (bM, bN): C's tile, and the (m, n) coordinates of its elements in C
        gC = cute.local_tile(mC, self.mma_tiler, tile_coord, proj=(1, 1, None))
        cC = cute.local_tile(
            cute.make_identity_tensor(mC.shape), self.mma_tiler, tile_coord, proj=(1, 1, None)
        )
        k_tiles = cute.size(gA, mode=[2])

        thr_mma = tiled_mma.get_slice(0)
        # (MMA, MMA_M, MMA_K, k_tiles)
        tCgA = thr_mma.partition_A(gA)
        # (MMA, MMA_N, MMA_K, k_tiles)
        tCgB = thr_mma.partition_B(gB)
        # (MMA, MMA_M, MMA_N)
        tCgC = thr_mma.partition_C(gC)
        tCcC = thr_mma.partition_C(cC)
        # TMA views, one CTA, no multicast: (TMA, ab_buffers) and (TMA, k_tiles)
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3)
        )
        # MMA operands, as shared-memory descriptors. (MMA, MMA_M, MMA_K, ab_buffers)
        tCrA = tiled_mma.make_fragment_A(sA)
        # (MMA, MMA_N, MMA_K, ab_buffers)
        tCrB = tiled_mma.make_fragment_B(sB)
        # The accumulator in TMEM; the base address is known once TMEM is allocated.
        # (MMA, MMA_M, MMA_N)
        tCtAcc_layout = tiled_mma.make_fragment_C(
            thr_mma.partition_shape_C(self.mma_tiler[:2])
        ).layout

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        # 2. Main loop by warp role
        if warp_idx == self.tma_warp_id:
            # TMA warp: the A and B tiles of k-step k_tile into the next empty buffer.
            for k_tile in cutlass.range(k_tiles, unroll=1):
                ab_empty = ab_prod.acquire_and_advance()
                cute.copy(
                    tma_a,
                    tAgA[(None, k_tile)],
                    tAsA[(None, ab_empty.index)],
                    tma_bar_ptr=ab_empty.barrier,
                )
                cute.copy(
                    tma_b,
                    tBgB[(None, k_tile)],
                    tBsB[(None, ab_empty.index)],
                    tma_bar_ptr=ab_empty.barrier,
                )
            # Every buffer released by the MMA warp before this warp exits.
            ab_prod.tail()

        if warp_idx == self.mma_warp_id:
            # MMA warp: C = sum over k-steps of A_k @ B_k^T, issued by one thread.
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc = cute.make_tensor(tmem_ptr + self.tmem_s_offset, tCtAcc_layout)
            s_empty = mma_si_prod.acquire_and_advance()
            # The first MMA overwrites the accumulator, every later one adds to it.
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for k_tile in cutlass.range(k_tiles, unroll=1):
                ab_full = ab_cons.wait_and_advance()
                for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    # acc += A[:, 16 kb : 16 kb + 16] @ B[:, 16 kb : 16 kb + 16]^T  (128 x 128 x 16)
                    cute.gemm(
                        tiled_mma,
                        tCtAcc,
                        tCrA[(None, None, kb, ab_full.index)],
                        tCrB[(None, None, kb, ab_full.index)],
                        tCtAcc,
                    )
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                # tcgen05.commit: the buffer is empty once the MMAs above have read it.
                ab_full.release()
            # tcgen05.commit: the accumulator is full once every MMA issued above has completed.
            s_empty.commit()

        if warp_idx < self.mma_warp_id:
            # Softmax warps: warp 0 allocates TMEM, all four read the accumulator.
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc = cute.make_tensor(tmem_ptr + self.tmem_s_offset, tCtAcc_layout)

            # 3. Epilogue: TMEM -> registers (tcgen05.ld) -> C in global memory
            # Thread t of warp w owns row 32 w + t (a warp may only read its own 32 TMEM lanes).
            epi_tiler = ((cute.size(tCtAcc, mode=[0, 0]), self.tmem_load_cols),)
            # ((128, 32), 4): the accumulator cut into 4 column slices of 32
            tCtAcc_epi = cute.zipped_divide(tCtAcc, epi_tiler)
            tmem_load = tcgen05.make_tmem_copy(
                cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), self.acc_dtype),
                tCtAcc_epi[(None, 0)],
            )
            thr_load = tmem_load.get_slice(tidx)
            # (T2R, T2R_M, slices): this thread's 32 TMEM cells per slice
            tTR_tAcc = thr_load.partition_S(tCtAcc_epi)

            s_full = mma_si_cons.wait_and_advance()
            # (T2R, T2R_M, slices): where they go in C, and their (m, n) coordinates
            tTR_gC = thr_load.partition_D(cute.zipped_divide(tCgC, epi_tiler))
            tTR_cC = thr_load.partition_D(cute.zipped_divide(tCcC, epi_tiler))
            # (T2R, T2R_M): 32 fp32 registers, and the same values in C's dtype
            tTR_rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, 0)].shape, self.acc_dtype)
            tTR_rC = cute.make_rmem_tensor(tTR_gC[(None, None, 0)].shape, self.dtype)
            # The accumulator complete (tcgen05.commit): order the loads after the wait
            # (common/tmem.py, (d))
            fence_after_thread_sync()
            for i in cutlass.range_constexpr(cute.size(tTR_tAcc, mode=[2])):
                cute.copy(tmem_load, tTR_tAcc[(None, None, i)], tTR_rAcc)
                # tcgen05.ld is asynchronous: tcgen05.wait::ld before the registers are read.
                cute.arch.fence_view_async_tmem_load()
                # C = acc rounded to the input dtype
                tTR_rC.store(tTR_rAcc.load().to(self.dtype))
                self.store_row(tTR_rC, tTR_gC[(None, None, i)], tTR_cC[(None, None, i)], mC.shape)
            # The accumulator read: order the loads before the release (common/tmem.py, (a))
            fence_before_thread_sync()
            s_full.release()

            # All four softmax warps are done with TMEM before warp 0 frees it: each orders its
            # tcgen05.ld before the barrier (tcgen05.fence::before_thread_sync), then they meet.
            tmem.relinquish_alloc_permit()
            fence_before_thread_sync()
            epilog_sync_bar.arrive_and_wait()
            tmem.free(tmem_ptr)

    @cute.jit
    def store_row(self, tTR_rX, tTR_gX, tTR_cX, shape):
        """Registers -> global memory: one slice of this thread's row of the output tile, in
        16-byte pieces. tTR_cX holds each element's (row, column) in the output; a piece is
        stored only if it lies inside shape (rows, columns), so the last tiles skip the rows and
        columns beyond the output. The output's rows are whole 16-byte pieces, so a piece is
        either wholly inside or wholly outside: its first element decides."""
        vec = 128 // tTR_rX.element_type.width  # elements per 16-byte store
        # (vec, pieces), for the registers, the global memory and the coordinates
        rX, gX, cX = [
            cute.zipped_divide(cute.make_tensor(t.iterator, cute.coalesce(t.layout)), (vec,))
            for t in (tTR_rX, tTR_gX, tTR_cX)
        ]
        for j in cutlass.range_constexpr(cute.size(rX, mode=[1])):
            if cute.elem_less(cX[(0, j)], shape):
                cute.autovec_copy(rX[(None, j)], gX[(None, j)])


def compile_args(dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors: shape = (M, N, K); scale is unused. The
    layouts are those gemm() launches with: static, dynamic when a dimension is 1."""
    checks.check_options(options, allowed=())
    M, N, K = shape
    dynamic = 1 in (M, N, K)
    kernel = Sm100Kernel(cute_dtype(dtype))
    args = (
        fake_tensor(dtype, (M, K), dynamic=dynamic),
        fake_tensor(dtype, (N, K), dynamic=dynamic),
        fake_tensor(dtype, (M, N), dynamic=dynamic),
        fake_stream(),
    )
    return kernel, args


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
    checks.check_multiple("N = b.shape[0]", N, 8, "the epilogue writes rows of C in 16-byte pieces")

    with torch.cuda.device(a.device):
        c = empty_output((M, N), a.dtype, a.device)
        # Static shapes and strides, one compile per shape, as in the Hopper stage 1: the index
        # math folds into constants. A size-1 mode (M = 1) gets dynamic layouts, compiled once
        # per dtype, as on Hopper. (The cache key holds which.)
        dynamic = 1 in (M, N, K)
        args = [to_cute(t, dynamic=True) if dynamic else to_cute(t) for t in (a, b, c)]
        cached_compile(Sm100Kernel(cute_dtype(a.dtype)), *args, current_stream())(
            *args, current_stream()
        )
    return c
