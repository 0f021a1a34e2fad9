"""Stage 1 - GEMM (Blackwell). C[M, N] = A[M, K] @ B[N, K]^T on sm_100a (B200, GB200).

A and B are K-major (row-major, K contiguous: the shape of Q @ K^T), bf16 or fp16; the
accumulator is fp32 in tensor memory (TMEM); C is written in the input dtype. The code already
uses the names of the attention kernel it grows into: A is `q`, B is `k`, the accumulator tile
is S (`tStS`), the tiled MMA is `qk_mma`. This first stage sets up the skeleton every later
Blackwell stage keeps:

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
  `tcgen05.mma` 128 x 128 x 16 per k-step, and freed with `tcgen05.dealloc` at the end.
- Epilogue: once `tcgen05.commit` signals the accumulator complete, thread t of softmax warp w
  reads row 32 w + t with `tcgen05.ld.32x32b.x32` (32 fp32 columns per load, 4 loads), converts
  to bf16/fp16 and stores its 64 contiguous bytes per load straight to global memory.

Shapes. M and N must be multiples of 128 (whole tiles of C: the epilogue stores without
masking). K may be any positive size with 16-byte rows (K % 8 == 0): TMA zero-fills the part of
the last 64-wide k-step that lies beyond K.

Verification status (2026-11-29): compile-checked for sm_100a here with fake tensors and no GPU,
through common.compile.compile_only(stage, "blackwell"), which sets CuTe DSL's target arch to
sm_100a for the compile; not run on Blackwell hardware. The numerical tests run only where an
sm_100 GPU is present.
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
from common.checker import empty_output
from common.compile import cached_compile
from common.cute_interop import current_stream, cute_dtype, fake_stream, fake_tensor, to_cute


class Sm100Kernel:
    def __init__(self, dtype):
        self.q_dtype = dtype  # A and B (q and k) element type: cutlass.BFloat16 or cutlass.Float16
        self.c_dtype = dtype  # C element type
        self.qk_acc_dtype = Float32
        # (bM, bN, bK): the tile of C per CTA and the k-step; one tcgen05.mma is 128 x 128 x 16.
        self.qk_mma_tiler = (128, 128, 64)
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
        # Pipeline depths: 4 buffers of (A, B) k-steps; one S tile in TMEM. The A (q) and B (k)
        # tiles of a k-step share one ring entry, so both take ab_buffers buffers; from stage 2 on
        # Q has a buffer of its own (q_buffers = 1) and K streams through kv_slots.
        self.ab_buffers = 4
        self.q_buffers = self.ab_buffers
        self.kv_slots = self.ab_buffers
        self.s_buffers = 1
        # TMEM columns (32-bit cells; lane = row of the tile): S from column 0.
        self.tmem_s_offset = 0
        # tcgen05.ld.32x32b.x32: each softmax thread reads 32 fp32 columns of its row per load.
        self.tmem_load_cols = 32
        self.smem_align = 1024  # the 128-byte swizzle pattern repeats every 8 rows = 1 KiB

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, c: cute.Tensor, stream):
        # One tcgen05.mma.cta_group::1.kind::f16 per 128 x 128 x 16: A and B from shared memory,
        # both K-major, D (the accumulator) in TMEM.
        qk_mma = utils.sm100.make_trivial_tiled_mma(
            self.q_dtype,
            self.q_dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.qk_acc_dtype,
            self.cta_group,
            self.qk_mma_tiler[:2],
            tcgen05.OperandSource.SMEM,
        )
        cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (qk_mma.thr_id.shape,)
        )

        # (MMA, MMA_M, MMA_K, q_buffers) and (MMA, MMA_N, MMA_K, kv_slots), 128-byte swizzled
        q_smem_s = utils.sm100.make_smem_layout_a(
            qk_mma, self.qk_mma_tiler, self.q_dtype, self.q_buffers
        )
        k_smem_s = utils.sm100.make_smem_layout_b(
            qk_mma, self.qk_mma_tiler, self.q_dtype, self.kv_slots
        )
        q_smem_one = cute.select(q_smem_s, mode=[0, 1, 2])
        k_smem_one = cute.select(k_smem_s, mode=[0, 1, 2])

        # TMA descriptors: one 128 x 64 box of A and one of B per k-step.
        tma_load_op = cpasync.CopyBulkTensorTileG2SOp(self.cta_group)
        tma_q, tma_tq = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load_op, q, q_smem_one, self.qk_mma_tiler, qk_mma, cluster_layout_vmnk.shape
        )
        tma_k, tma_tk = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load_op, k, k_smem_one, self.qk_mma_tiler, qk_mma, cluster_layout_vmnk.shape
        )
        # Bytes one buffer receives: 128 x 64 x 2 (A) + 128 x 64 x 2 (B) = 32 KiB.
        self.ab_tma_bytes = cute.size_in_bytes(self.q_dtype, q_smem_one) + cute.size_in_bytes(
            self.q_dtype, k_smem_one
        )
        # TMEM: the 128 x 128 fp32 tile S takes 128 columns (lane = row, column = column).
        s_tmem_shape = qk_mma.partition_shape_C(self.qk_mma_tiler[:2])
        self.num_tmem_alloc_cols = get_num_tmem_alloc_cols(qk_mma.make_fragment_C(s_tmem_shape))

        @cute.struct
        class SharedStorage:
            ab_bar: cute.struct.MemRange[Int64, self.ab_buffers * 2]
            mma_si_bar: cute.struct.MemRange[Int64, self.s_buffers * 2]
            tmem_holding: Int32
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.q_dtype, cute.cosize(q_smem_s)], self.smem_align
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.q_dtype, cute.cosize(k_smem_s)], self.smem_align
            ]

        self.shared_storage = SharedStorage
        self.shared_memory_bytes = SharedStorage.size_in_bytes()

        # One CTA per 128 x 128 tile of C.
        grid = (c.shape[0] // self.qk_mma_tiler[0], c.shape[1] // self.qk_mma_tiler[1], 1)
        self.kernel(
            qk_mma, tma_q, tma_tq, tma_k, tma_tk, c, cluster_layout_vmnk, q_smem_s, k_smem_s
        ).launch(grid=grid, block=[self.threads_per_cta, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        mC: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        q_smem_s: cute.ComposedLayout,
        k_smem_s: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        tile_coord = (bidx, bidy, None)  # (m tile, n tile, all k-steps)

        # 1. Prepare
        if warp_idx == self.tma_warp_id:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)

        storage = SmemAllocator().allocate(self.shared_storage)
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
        # S hand-off, MMA -> softmax warps: tcgen05.commit marks S complete (full); the 128
        # softmax threads each arrive once they have read it (empty).
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

        # (MMA, MMA_M, MMA_K, q_buffers)
        sQ = storage.sQ.get_tensor(q_smem_s.outer, swizzle=q_smem_s.inner)
        # (MMA, MMA_N, MMA_K, kv_slots)
        sK = storage.sK.get_tensor(k_smem_s.outer, swizzle=k_smem_s.inner)

        # (bM, bK, k_tiles)
        gQ = cute.local_tile(mQ, self.qk_mma_tiler, tile_coord, proj=(1, None, 1))
        # (bN, bK, k_tiles)
        gK = cute.local_tile(mK, self.qk_mma_tiler, tile_coord, proj=(None, 1, 1))
        # (bM, bN)
        gC = cute.local_tile(mC, self.qk_mma_tiler, tile_coord, proj=(1, 1, None))
        k_tiles = cute.size(gQ, mode=[2])

        qk_thr = qk_mma.get_slice(0)
        # (MMA, MMA_M, MMA_K, k_tiles)
        tCgQ = qk_thr.partition_A(gQ)
        # (MMA, MMA_N, MMA_K, k_tiles)
        tCgK = qk_thr.partition_B(gK)
        # (MMA, MMA_M, MMA_N)
        tCgC = qk_thr.partition_C(gC)
        # TMA views, one CTA, no multicast: (TMA, ab_buffers) and (TMA, k_tiles)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3), cute.group_modes(tCgQ, 0, 3)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3), cute.group_modes(tCgK, 0, 3)
        )
        # MMA operands, as shared-memory descriptors. (MMA, MMA_M, MMA_K, q_buffers)
        tCrQ = qk_mma.make_fragment_A(sQ)
        # (MMA, MMA_N, MMA_K, kv_slots)
        tCrK = qk_mma.make_fragment_B(sK)
        # S in TMEM; the base address is known once TMEM is allocated. (MMA, MMA_M, MMA_N)
        tStS_layout = qk_mma.make_fragment_C(qk_thr.partition_shape_C(self.qk_mma_tiler[:2])).layout

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        # 2. Main loop by warp role
        if warp_idx == self.tma_warp_id:
            # TMA warp: the A and B tiles of k-step kt into the next empty buffer.
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_empty = ab_prod.acquire_and_advance()
                cute.copy(
                    tma_q,
                    tQgQ[(None, kt)],
                    tQsQ[(None, ab_empty.index)],
                    tma_bar_ptr=ab_empty.barrier,
                )
                cute.copy(
                    tma_k,
                    tKgK[(None, kt)],
                    tKsK[(None, ab_empty.index)],
                    tma_bar_ptr=ab_empty.barrier,
                )
            # Every buffer released by the MMA warp before this warp exits.
            ab_prod.tail()

        if warp_idx == self.mma_warp_id:
            # MMA warp: S = sum over k-steps of Q_kt @ K_kt^T, issued by one thread.
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.qk_acc_dtype)
            tStS = cute.make_tensor(tmem_ptr + self.tmem_s_offset, tStS_layout)
            s_empty = mma_si_prod.acquire_and_advance()
            # The first MMA overwrites S, every later one accumulates.
            qk_mma.set(tcgen05.Field.ACCUMULATE, False)
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_full = ab_cons.wait_and_advance()
                for kb in cutlass.range_constexpr(cute.size(tCrQ, mode=[2])):
                    # S += Q[:, 16 kb : 16 kb + 16] @ K[:, 16 kb : 16 kb + 16]^T  (128 x 128 x 16)
                    cute.gemm(
                        qk_mma,
                        tStS,
                        tCrQ[(None, None, kb, ab_full.index)],
                        tCrK[(None, None, kb, ab_full.index)],
                        tStS,
                    )
                    qk_mma.set(tcgen05.Field.ACCUMULATE, True)
                # tcgen05.commit: the buffer is empty once the MMAs above have read it.
                ab_full.release()
            # tcgen05.commit: S is full once every MMA issued above has completed.
            s_empty.commit()

        if warp_idx < self.mma_warp_id:
            # Softmax warps: warp 0 allocates TMEM, all four read S.
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.qk_acc_dtype)
            tStS = cute.make_tensor(tmem_ptr + self.tmem_s_offset, tStS_layout)

            # 3. Epilogue: TMEM -> registers (tcgen05.ld) -> C in global memory
            # Thread t of warp w owns row 32 w + t (a warp may only read its own 32 TMEM lanes).
            epi_tiler = ((cute.size(tStS, mode=[0, 0]), self.tmem_load_cols),)
            # ((128, 32), 4): S cut into 4 column slices of 32
            tStS_epi = cute.zipped_divide(tStS, epi_tiler)
            tmem_load = tcgen05.make_tmem_copy(
                cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), self.qk_acc_dtype),
                tStS_epi[(None, 0)],
            )
            thr_load = tmem_load.get_slice(tidx)
            # (T2R, T2R_M, slices): this thread's 32 TMEM cells per slice
            tTR_tS = thr_load.partition_S(tStS_epi)

            s_full = mma_si_cons.wait_and_advance()
            # (T2R, T2R_M, slices): where they go in C
            tTR_gC = thr_load.partition_D(cute.zipped_divide(tCgC, epi_tiler))
            # (T2R, T2R_M): 32 fp32 registers, and the same values in C's dtype
            tTR_rS = cute.make_rmem_tensor(tTR_gC[(None, None, 0)].shape, self.qk_acc_dtype)
            tTR_rC = cute.make_rmem_tensor(tTR_gC[(None, None, 0)].shape, self.c_dtype)
            for i in cutlass.range_constexpr(cute.size(tTR_tS, mode=[2])):
                cute.copy(tmem_load, tTR_tS[(None, None, i)], tTR_rS)
                # tcgen05.ld is asynchronous: tcgen05.wait::ld before the registers are read.
                cute.arch.fence_view_async_tmem_load()
                # C = S rounded to the input dtype
                tTR_rC.store(tTR_rS.load().to(self.c_dtype))
                cute.autovec_copy(tTR_rC, tTR_gC[(None, None, i)])
            s_full.release()

            # All four softmax warps are done with TMEM before warp 0 frees it.
            tmem.relinquish_alloc_permit()
            epilog_sync_bar.arrive_and_wait()
            tmem.free(tmem_ptr)


def compile_args(dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors: shape = (M, N, K); scale is unused."""
    checks.check_options(options, allowed=())
    M, N, K = shape
    kernel = Sm100Kernel(cute_dtype(dtype))
    args = (
        fake_tensor(dtype, (M, K)),
        fake_tensor(dtype, (N, K)),
        fake_tensor(dtype, (M, N)),
        fake_stream(),
    )
    return kernel, args


def gemm(a, b):
    """C = A @ B^T for A (M, K) and B (N, K), bf16 or fp16, fp32 accumulation, C in A's dtype."""
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
    bM, bN, _ = Sm100Kernel(cute_dtype(a.dtype)).qk_mma_tiler
    checks.check_multiple(
        "M = a.shape[0]", M, bM, "each CTA stores a whole 128 x 128 tile of C, unmasked"
    )
    checks.check_multiple(
        "N = b.shape[0]", N, bN, "each CTA stores a whole 128 x 128 tile of C, unmasked"
    )
    checks.check_multiple(
        "K = a.shape[1]", K, 8, "TMA reads rows of A and B that start on 16-byte boundaries"
    )

    with torch.cuda.device(a.device):
        c = empty_output((M, N), a.dtype, a.device)
        args = (to_cute(a), to_cute(b), to_cute(c))
        # Static shapes and strides: one compiled kernel per layout (the cache key holds them).
        compiled = cached_compile(Sm100Kernel(cute_dtype(a.dtype)), *args, current_stream())
        compiled(*args, current_stream())
    return c
