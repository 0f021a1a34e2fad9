"""Stage 2 - QK^T only (Blackwell, sm_100a). S[b, h] = scale * Q[b, h] @ K[b, h]^T.

Changes from stage 1:
- Batching over (B, H): each tensor is viewed as (S, D, (H, B)), so one TMA descriptor covers
  every head of every batch (a rank-4 TMA over S, D, H, B). The grid is the attention grid:
  one CTA per (128-row Q tile, head, batch), blockIdx = (Q tile, h, b), as on Hopper; the CTA
  addresses its own matrices with the coordinates (row, 0, (h, b)).
- The reduction runs over D only (64 or 128), which fits one tile: the tiler is (bM, bN, bK) =
  (128, 128, D), so one S tile is D / 16 = 4 or 8 `tcgen05.mma` 128 x 128 x 16. Every K tile
  gives a fresh S tile (the first MMA of each tile does not accumulate), and the loop now runs
  over K tiles, the columns of S, instead of over k-steps.
- Operand reuse: Q is loaded once into its own buffer (q_buffers = 1, its own full/empty barriers
  and byte count) and read by every MMA of the CTA; K tiles stream through a ring of
  kv_slots = 2. Shared memory: Q 128 x D x 2 B plus 2 K slots of the same size = 48 KiB (D = 64)
  or 96 KiB (D = 128), instead of 128 KiB for stage 1's A/B ring (+1 KiB for the mbarriers and
  alignment: 49 / 97 KiB in the compile summary).
- S goes through TMEM once per K tile (128 lanes x 128 fp32 columns, s_buffers = 1): the MMA
  warp waits until the softmax warps have read the previous S before overwriting it, and the
  softmax warps `tcgen05.ld` each S tile, multiply it by scale and store it in fp32
  (128 x 128 x 4 B = 64 KiB of S per K tile), in the 16-byte pieces of stage 1 that lie inside
  S: the last Q tile's rows beyond Sq and the last K tile's keys beyond Sk are skipped.
- Dynamic layouts: the entry marks B, H, S (shapes and strides) dynamic, one compile per (dtype,
  D) for every B, H, Sq, Sk, as on Hopper (a static size-1 mode, B = 1 say, would be folded
  away and change the TMA's rank).

Q (B, H, Sq, D) and K (B, H, Sk, D) in bf16 or fp16, the layout of torch SDPA (D contiguous);
S (B, H, Sq, Sk) is written in fp32; scale defaults to 1/sqrt(D).

Shapes: B, H, Sq, Sk >= 1, D in {64, 128}, Sk % 4 == 0 (rows of S in fp32 are then whole
16-byte pieces), as on Hopper. Q and K tiles that stick out of Sq or Sk are zero-filled by TMA.

Compile-checked for sm_100a with fake tensors and no GPU (common.tools.ptx.compile_only(2,
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
    def __init__(self, dtype, head_dim):
        self.dtype = dtype  # element type of Q and K: cutlass.BFloat16 or cutlass.Float16
        self.acc_dtype = Float32  # the accumulator, and S as written
        # (bM, bN, bK) = (Q rows, K rows, D): one S tile; one tcgen05.mma is 128 x 128 x 16.
        self.qk_mma_tiler = (128, 128, head_dim)
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
        # Pipeline depths: Q loaded once; a ring of 2 K tiles; one S tile in TMEM.
        self.q_buffers = 1
        self.kv_slots = 2
        self.s_buffers = 1
        # Ring entries per KV tile, read by the CPU model of the schedule (common/tools/schedule.py),
        # not by this kernel: one tuple per pass over the KV tiles (stage 4 makes two), naming
        # what the TMA warp loads and the MMA warp waits for (here K only).
        self.kv_producer_entries = (("K",),)
        self.kv_consumer_entries = (("K",),)
        # TMEM columns (32-bit cells; lane = row of the tile): S from column 0.
        self.tmem_s_offset = 0
        # tcgen05.ld.32x32b.x32: each softmax thread reads 32 fp32 columns of its row per load.
        self.tmem_load_cols = 32
        self.smem_align = 1024  # the 128-byte swizzle pattern repeats every 8 rows = 1 KiB

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, s: cute.Tensor, scale: Float32, stream):
        # S's rows start on 16-byte boundaries: each thread stores its row in 16-byte vectors.
        s = rows_of_16_bytes(s)
        # (B, H, S, D) -> (S, D, (H, B)): the two tile modes first, then (h, b) as one batch mode.
        q, k, s = [
            cute.make_tensor(
                t.iterator, cute.group_modes(cute.select(t.layout, mode=[2, 3, 1, 0]), 2, 4)
            )
            for t in (q, k, s)
        ]

        # One tcgen05.mma.cta_group::1.kind::f16 per 128 x 128 x 16: A and B from shared memory,
        # both K-major, D (the accumulator) in TMEM.
        qk_mma = utils.sm100.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            self.cta_group,
            self.qk_mma_tiler[:2],
            tcgen05.OperandSource.SMEM,
        )
        cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (qk_mma.thr_id.shape,)
        )

        # (MMA, MMA_M, MMA_K, q_buffers) and (MMA, MMA_N, MMA_K, kv_slots), 128-byte swizzled
        q_smem_s = utils.sm100.make_smem_layout_a(
            qk_mma, self.qk_mma_tiler, self.dtype, self.q_buffers
        )
        k_smem_s = utils.sm100.make_smem_layout_b(
            qk_mma, self.qk_mma_tiler, self.dtype, self.kv_slots
        )
        q_smem_one = cute.select(q_smem_s, mode=[0, 1, 2])
        k_smem_one = cute.select(k_smem_s, mode=[0, 1, 2])

        # TMA descriptors over (S, D, (H, B)): a 128 x D tile of Q, or of K.
        tma_load_op = cpasync.CopyBulkTensorTileG2SOp(self.cta_group)
        tma_q, tma_tq = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load_op, q, q_smem_one, self.qk_mma_tiler, qk_mma, cluster_layout_vmnk.shape
        )
        tma_k, tma_tk = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load_op, k, k_smem_one, self.qk_mma_tiler, qk_mma, cluster_layout_vmnk.shape
        )
        # Bytes each TMA copy moves (its box), and the bytes each pipeline entry arms its full
        # barrier with: 128 x D x 2 each (16 KiB for D = 64, 32 KiB for D = 128).
        self.copy_bytes = {
            name: cute.size_in_bytes(self.dtype, layout)
            for name, layout in (("Q", q_smem_one), ("K", k_smem_one))
        }
        self.q_tma_bytes = self.copy_bytes["Q"]
        self.kv_tma_bytes = {"K": self.copy_bytes["K"]}
        self.kv_slot_bytes = cute.size_in_bytes(self.dtype, k_smem_one)
        # TMEM: the 128 x 128 fp32 tile S takes 128 columns (lane = row, column = column).
        s_tmem_shape = qk_mma.partition_shape_C(self.qk_mma_tiler[:2])
        self.num_tmem_alloc_cols = get_num_tmem_alloc_cols(qk_mma.make_fragment_C(s_tmem_shape))

        @cute.struct
        class SharedStorage:
            q_bar: cute.struct.MemRange[Int64, self.q_buffers * 2]
            kv_bar: cute.struct.MemRange[Int64, self.kv_slots * 2]
            mma_si_bar: cute.struct.MemRange[Int64, self.s_buffers * 2]
            tmem_holding: Int32
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(q_smem_s)], self.smem_align
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(k_smem_s)], self.smem_align
            ]

        self.shared_storage = SharedStorage
        self.shared_memory_bytes = SharedStorage.size_in_bytes()

        # One CTA per 128-row Q tile of one (head, batch); the last Q tile may stick out of Sq.
        grid = (
            cute.ceil_div(cute.size(q, mode=[0]), self.qk_mma_tiler[0]),
            cute.size(q, mode=[2, 0]),
            cute.size(q, mode=[2, 1]),
        )
        self.kernel(
            qk_mma, tma_q, tma_tq, tma_k, tma_tk, s, scale, cluster_layout_vmnk, q_smem_s, k_smem_s
        ).launch(grid=grid, block=[self.threads_per_cta, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        mS: cute.Tensor,
        scale: Float32,
        cluster_layout_vmnk: cute.Layout,
        q_smem_s: cute.ComposedLayout,
        k_smem_s: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        # blockIdx = (Q tile, head, batch)
        bidx, head, batch = cute.arch.block_idx()
        tile_coord = (bidx, None, 0)  # (Q tile, every K tile, the one D tile)

        # 1. Prepare
        if warp_idx == self.tma_warp_id:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)

        storage = SmemAllocator().allocate(self.shared_storage)
        # Q buffer and K ring: the TMA warp fills (full = the tile's bytes landed), the MMA
        # warp's tcgen05.commit empties (one arrive). Each has its own barriers and byte count;
        # a ring entry holds one K tile and arms kv_tma_bytes of it.
        q_prod, q_cons = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.q_bar.data_ptr(),
            num_stages=self.q_buffers,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.q_tma_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        ).make_participants()
        kv_prod, kv_cons = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.kv_bar.data_ptr(),
            num_stages=self.kv_slots,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.kv_tma_bytes["K"],
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

        # This CTA's (b, h): Q (Sq, D), K (Sk, D) and S (Sq, Sk).
        mQ, mK, mS = (
            mQ[(None, None, (head, batch))],
            mK[(None, None, (head, batch))],
            mS[(None, None, (head, batch))],
        )
        # (bM, D)
        gQ = cute.local_tile(mQ, self.qk_mma_tiler, tile_coord, proj=(1, None, 1))
        # (bN, D, kv_tiles)
        gK = cute.local_tile(mK, self.qk_mma_tiler, tile_coord, proj=(None, 1, 1))
        # (bM, bN, kv_tiles): S's tiles, and the (query, key) coordinates of their elements in S
        gS = cute.local_tile(mS, self.qk_mma_tiler, tile_coord, proj=(1, 1, None))
        cS = cute.local_tile(
            cute.make_identity_tensor(mS.shape), self.qk_mma_tiler, tile_coord, proj=(1, 1, None)
        )
        kv_tiles = cute.size(gK, mode=[2])

        qk_thr = qk_mma.get_slice(0)
        # (MMA, MMA_M, MMA_K)
        tCgQ = qk_thr.partition_A(gQ)
        # (MMA, MMA_N, MMA_K, kv_tiles)
        tCgK = qk_thr.partition_B(gK)
        # (MMA, MMA_M, MMA_N, kv_tiles)
        tCgS = qk_thr.partition_C(gS)
        tCcS = qk_thr.partition_C(cS)
        # TMA views, one CTA, no multicast: (TMA, q_buffers) and (TMA); (TMA, kv_slots) and (TMA, kv_tiles)
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
            # TMA warp: Q once, then K tile kv_tile into the next empty slot of the ring.
            q_empty = q_prod.acquire_and_advance()
            cute.copy(tma_q, tQgQ, tQsQ[(None, q_empty.index)], tma_bar_ptr=q_empty.barrier)
            for kv_tile in cutlass.range(kv_tiles, unroll=1):
                kv_empty = kv_prod.acquire_and_advance()
                cute.copy(
                    tma_k,
                    tKgK[(None, kv_tile)],
                    tKsK[(None, kv_empty.index)],
                    tma_bar_ptr=kv_empty.barrier,
                )
            # Every buffer released by the MMA warp before this warp exits.
            kv_prod.tail()
            q_prod.tail()

        if warp_idx == self.mma_warp_id:
            # MMA warp: S_j = Q @ K_j^T for every K tile j, issued by one thread.
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tStS = cute.make_tensor(tmem_ptr + self.tmem_s_offset, tStS_layout)
            q_full = q_cons.wait_and_advance()
            for kv_tile in cutlass.range(kv_tiles, unroll=1):
                kv_full = kv_cons.wait_and_advance()
                # The softmax warps have read the previous S: it may be overwritten.
                s_empty = mma_si_prod.acquire_and_advance()
                # S read by the softmax warps: fence after the wait (common/tmem.py, (a))
                fence_after_thread_sync()
                # The first MMA of each K tile overwrites S, the others accumulate over D.
                qk_mma.set(tcgen05.Field.ACCUMULATE, False)
                for kb in cutlass.range_constexpr(cute.size(tCrQ, mode=[2])):
                    # S += Q[:, 16 kb : 16 kb + 16] @ K_j[:, 16 kb : 16 kb + 16]^T  (128 x 128 x 16)
                    cute.gemm(
                        qk_mma,
                        tStS,
                        tCrQ[(None, None, kb, q_full.index)],
                        tCrK[(None, None, kb, kv_full.index)],
                        tStS,
                    )
                    qk_mma.set(tcgen05.Field.ACCUMULATE, True)
                # tcgen05.commit: S is full once these MMAs have completed ...
                s_empty.commit()
                # ... and the K slot is empty once they have read it.
                kv_full.release()
            # Q stays resident until the last MMA; then its buffer is released too.
            q_full.release()

        if warp_idx < self.mma_warp_id:
            # Softmax warps: warp 0 allocates TMEM, all four read S.
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tStS = cute.make_tensor(tmem_ptr + self.tmem_s_offset, tStS_layout)

            # 3. Epilogue, once per K tile: TMEM -> registers (tcgen05.ld) -> scale -> S in global memory
            # Thread t of warp w owns row 32 w + t (a warp may only read its own 32 TMEM lanes).
            epi_tiler = ((cute.size(tStS, mode=[0, 0]), self.tmem_load_cols),)
            # ((128, 32), 4): S cut into 4 column slices of 32
            tStS_epi = cute.zipped_divide(tStS, epi_tiler)
            tmem_load = tcgen05.make_tmem_copy(
                cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), self.acc_dtype),
                tStS_epi[(None, 0)],
            )
            thr_load = tmem_load.get_slice(tidx)
            # (T2R, T2R_M, slices): this thread's 32 TMEM cells per slice
            tTR_tS = thr_load.partition_S(tStS_epi)

            for kv_tile in cutlass.range(kv_tiles, unroll=1):
                s_full = mma_si_cons.wait_and_advance()
                # (T2R, T2R_M, slices): where they go in S for K tile kv_tile, and their coordinates
                tTR_gS = thr_load.partition_D(
                    cute.zipped_divide(tCgS[(None, None, None, kv_tile)], epi_tiler)
                )
                tTR_cS = thr_load.partition_D(
                    cute.zipped_divide(tCcS[(None, None, None, kv_tile)], epi_tiler)
                )
                # (T2R, T2R_M): 32 fp32 registers
                tTR_rS = cute.make_rmem_tensor(tTR_gS[(None, None, 0)].shape, self.acc_dtype)
                # S complete (tcgen05.commit): order the loads after the wait (common/tmem.py, (d))
                fence_after_thread_sync()
                for i in cutlass.range_constexpr(cute.size(tTR_tS, mode=[2])):
                    cute.copy(tmem_load, tTR_tS[(None, None, i)], tTR_rS)
                    # tcgen05.ld is asynchronous: tcgen05.wait::ld before the registers are read.
                    cute.arch.fence_view_async_tmem_load()
                    # S = scale * Q @ K^T, in fp32
                    tTR_rS.store(scale * tTR_rS.load())
                    self.store_row(
                        tTR_rS, tTR_gS[(None, None, i)], tTR_cS[(None, None, i)], mS.shape
                    )
                # Every tcgen05.ld of this S has completed (wait::ld above): the MMA warp may overwrite it.
                # S read: order the loads before the release (common/tmem.py, (a))
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
    """(kernel, args) for cute.compile with fake tensors, shape = (B, H, Sq, Sk, D)."""
    checks.check_options(options, allowed=())
    B, H, Sq, Sk, D = shape
    q, k = (fake_tensor(dtype, (B, H, S, D), dynamic=True) for S in (Sq, Sk))
    s = fake_tensor(torch.float32, (B, H, Sq, Sk), dynamic=True)
    return Sm100Kernel(cute_dtype(dtype), D), (q, k, s, checks.check_scale(scale, D), fake_stream())


def qk(q, k, scale=None):
    """S = scale * Q @ K^T for Q (B, H, Sq, D) and K (B, H, Sk, D), both bf16 or both fp16, D
    contiguous, D in {64, 128}; scale defaults to 1/sqrt(D). S (B, H, Sq, Sk) in fp32."""
    B, H, Sq, Sk, D = checks.check_attention_args(q, k)
    scale = checks.check_scale(scale, D)
    checks.check_multiple(
        "Sk = k.shape[2]", Sk, 4, "the epilogue writes rows of S (fp32) in 16-byte pieces"
    )

    with torch.cuda.device(q.device):
        s = empty_output((B, H, Sq, Sk), torch.float32, q.device)
        # Dynamic shapes and strides: one compile per (dtype, D) serves every B, H, Sq, Sk. (A
        # static size-1 mode, B = 1 say, would be folded away and change the rank of the TMA.)
        args = [to_cute(t, dynamic=True) for t in (q, k, s)]
        args += [scale, current_stream()]
        cached_compile(Sm100Kernel(cute_dtype(q.dtype), D), *args)(*args)
    return s
