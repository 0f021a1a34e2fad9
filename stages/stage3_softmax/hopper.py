"""Stage 3 - single-KV-tile softmax (Hopper, sm_90a). O = softmax(scale * Q K^T) V, Sk <= 128.

Changes from stage 2:
- A second GEMM, O = P @ V, with its own tiled MMA: m64nDk16 wgmma whose A operand (P) comes
  from registers and whose B operand (V) comes from shared memory. V is (keys, D) with D
  contiguous; as the B operand of P @ V (N = D, K = keys) that is "MN-major", the transposed
  wgmma mode, so the V tile sits in shared memory exactly as TMA brings it (the same 128B swizzle
  as a K tile: sVt is V^T viewed over the same bytes).
- The ring carries K then V: K in slot 0, V in slot 1 (kv_slots = 2, both loaded up front).
  Shared memory (D = 128): Q 32 KiB + 2 slots x 32 KiB = 96 KiB of tiles, and the kernel asks for
  1 KiB more for the mbarriers and sQ's 1,024-byte alignment (D = 64: 16 + 2 x 16 = 48 KiB). O's
  staging tile reuses Q's bytes, free once both warpgroups' S wgmmas are done; the fp32 S
  staging tile of stage 2 is gone:

      shared memory | q_full, kv_full, kv_empty | sQ: Q 32 KiB        | slot 0: K  | slot 1: V  |
                    |                           | sO: O (epilogue)    | (sVt: V^T over the slots) |
- Softmax in registers. A warpgroup's 64 x 128 S accumulator gives each thread 2 rows x 32
  columns (rows lane / 4 and lane / 4 + 8 of its warp's 16 rows, columns 8 n + 2 (lane % 4) +
  {0, 1}); a row lives in the 4 threads of a quad. row_max: a max over the thread's 32 values,
  then 2 butterfly shuffles (xor 2, xor 1) across the quad; row_sum likewise.
- exp2 with log2(e) folded into the scale: exp(scale * (s - m)) = exp2(s * scale_log2 -
  m * scale_log2) with scale_log2 = scale * log2(e), one FFMA and one `ex2.approx` per score.
  Computing the max on unscaled S is fine since scale > 0.
- P (fp32, accumulator layout) is rounded to the input dtype and used in place as the A operand
  of the second wgmma: for each 16-key block, the 8 values a thread holds for A (rows r, r + 8,
  keys 2 (lane % 4) + {0, 1, 8, 9}) are exactly its accumulator values of S for those keys, so
  no data moves between threads. P: 128 x 128 bf16 / 256 threads = 64 values a thread, two
  16-bit values per 32-bit register: 32 registers.
- Keys beyond Sk (when Sk < 128) read zeros from TMA; their scores are set to -inf before the
  softmax, so they get weight 0.
- Epilogue: O = (P @ V) / row_sum, rounded to the input dtype, stored through shared memory
  and TMA like stage 1's C. Registers: S 64, P 32 and O 64 (D = 128) per thread, never all
  live at once: S is dead once P is formed, and O is written only by the PV wgmma (ptxas of
  CUDA 13.0, 2026-12-07: 124 in all, no spills).
- Nothing overlaps yet: with a single KV tile each CTA waits for its loads, computes, and
  stores.

Q, K, V and O are (B, H, S, D) like torch SDPA (D contiguous), bf16 or fp16, D = 64 or 128; the
softmax runs in fp32 registers and O is written in the input dtype. All Sk keys fit in one KV
tile of bN = 128, so each row's softmax is complete after one S tile; longer sequences are
refused (stage 4 streams KV tiles).

Shapes: B, H, Sq >= 1, 1 <= Sk <= 128, D in {64, 128}.

Measured speed: docs/results/README.md.
"""

import math

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
    def __init__(self, dtype, head_dim):
        self.dtype = dtype  # element type of Q, K, V and O: cutlass.BFloat16 or cutlass.Float16
        self.acc_dtype = cutlass.Float32
        self.cta_tile = (128, 128, head_dim)  # (bM, bN, bK): query rows, keys per KV tile, head dim
        self.mma_warpgroups = 2  # warpgroup w computes query rows [64 w, 64 w + 64) of the tile
        self.threads = 128 * self.mma_warpgroups
        self.kv_slots = 2  # K in slot 0, V in slot 1: 2 x 32 KiB (D = 128)
        self.smem_align = 1024  # the 128-byte swizzle repeats every 8 rows of 128 B

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        o: cute.Tensor,
        scale_log2: cutlass.Float32,
        stream,
    ):
        bM, bN, bK = self.cta_tile
        row_major = LayoutEnum.ROW_MAJOR  # Q, K, V, O: D contiguous
        # (B, H, S, D) -> (S, D, H, B): one matrix per (h, b)
        q, k, v, o = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))
            for t in (q, k, v, o)
        ]

        # S = Q @ K^T: two m64n128k16 wgmma atoms stacked along M, one per warpgroup.
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            row_major.sm90_mma_major_mode(),
            row_major.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.mma_warpgroups, 1, 1),
            tiler_mn=(64, bN),
        )
        # O = P @ V: two m64nDk16 atoms; A = P from registers, B = V^T, MN-major (D contiguous).
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            row_major.sm90_mma_major_mode(),
            LayoutEnum.COL_MAJOR.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.mma_warpgroups, 1, 1),
            tiler_mn=(64, bK),
            a_source=warpgroup.OperandSource.RMEM,
        )
        # (bM, bK, 1), 128B-swizzled
        q_smem_layout = sm90_utils.make_smem_layout_a(row_major, self.cta_tile, self.dtype, 1)
        # (bN, bK, kv_slots), 128B-swizzled
        kv_smem_layout = sm90_utils.make_smem_layout_b(
            row_major, self.cta_tile, self.dtype, self.kv_slots
        )
        # (bK, bN, kv_slots): V^T, the B operand of P @ V, MN-major: the bytes of kv_smem_layout
        # with modes 0 and 1 swapped (same 128B swizzle, same offsets).
        vt_smem_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (bM, bK, bN), self.dtype, self.kv_slots
        )
        # (bM, bK, 1), 128B-swizzled
        o_smem_layout = sm90_utils.make_smem_layout_epi(self.dtype, row_major, (bM, bK), 1)

        # TMA descriptors: Q's (bM, bK) box, a (bN, bK) box of K or V per KV tile, O's tile.
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q, cute.select(q_smem_layout, mode=[0, 1]), (bM, bK)
        )
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), k, cute.select(kv_smem_layout, mode=[0, 1]), (bN, bK)
        )
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), v, cute.select(kv_smem_layout, mode=[0, 1]), (bN, bK)
        )
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), o, cute.select(o_smem_layout, mode=[0, 1]), (bM, bK)
        )

        @cute.struct
        class SharedStorage:
            q_full: cute.struct.MemRange[cutlass.Int64, 1]
            kv_full: cute.struct.MemRange[cutlass.Int64, self.kv_slots]
            kv_empty: cute.struct.MemRange[cutlass.Int64, self.kv_slots]
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(q_smem_layout)], self.smem_align
            ]
            sKV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(kv_smem_layout)], self.smem_align
            ]

        self.shared_storage = SharedStorage
        self.shared_memory_bytes = SharedStorage.size_in_bytes()

        # One CTA per 128-row Q tile of one (head, batch).
        grid = (cute.ceil_div(q.shape[0], bM), q.shape[2], q.shape[3])
        self.kernel(
            qk_mma,
            pv_mma,
            tma_atom_q,
            tma_q,
            tma_atom_k,
            tma_k,
            tma_atom_v,
            tma_v,
            tma_atom_o,
            tma_o,
            q_smem_layout,
            kv_smem_layout,
            vt_smem_layout,
            o_smem_layout,
            scale_log2,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_o: cute.CopyAtom,
        mO: cute.Tensor,
        q_smem_layout: cute.ComposedLayout,
        kv_smem_layout: cute.ComposedLayout,
        vt_smem_layout: cute.ComposedLayout,
        o_smem_layout: cute.ComposedLayout,
        scale_log2: cutlass.Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
        bM, bN, bK = self.cta_tile

        # 1. Prepare
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)

        # blockIdx = (Q tile, head, batch)
        pid_m, head, batch = cute.arch.block_idx()

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # (bM, bK, 1)
        sQ = storage.sQ.get_tensor(q_smem_layout.outer, swizzle=q_smem_layout.inner)
        # (bN, bK, kv_slots)
        sKV = storage.sKV.get_tensor(kv_smem_layout.outer, swizzle=kv_smem_layout.inner)
        # (bK, bN, kv_slots): V^T over sKV's bytes
        sVt = cute.make_tensor(
            cute.recast_ptr(sKV.iterator, vt_smem_layout.inner), vt_smem_layout.outer
        )
        # (bM, bK): over sQ's bytes, used only after the last wgmma reading Q
        sO = cute.make_tensor(
            cute.recast_ptr(sQ.iterator, o_smem_layout.inner, dtype=self.dtype),
            cute.select(o_smem_layout.outer, mode=[0, 1]),
        )

        # q_full: 1 arrive (the producer's expect_tx of Q's bytes) + the TMA writes of Q.
        q_full = storage.q_full.data_ptr()
        q_bytes = cute.size_in_bytes(
            self.dtype, cute.select(q_smem_layout, mode=[0, 1])
        )  # 32 KiB (D = 128)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(q_full, 1)
        # kv_full[i]: 1 arrive (the producer's expect_tx of one tile) + the TMA writes of the tile.
        # kv_empty[i]: 1 arrive from each of the 8 consumer warps. (Creating the pipeline fences
        # and syncs the CTA, which also publishes q_full's initialisation.)
        kv_bytes = cute.size_in_bytes(
            self.dtype, cute.select(kv_smem_layout, mode=[0, 1])
        )  # 32 KiB (D = 128)
        kv_pipeline = pipeline.PipelineTmaAsync.create(
            num_stages=self.kv_slots,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=kv_bytes,
            barrier_storage=storage.kv_full.data_ptr(),
        )

        # (bM, bK)
        gQ = cute.local_tile(
            mQ[None, None, head, batch], self.cta_tile, (pid_m, None, 0), proj=(1, None, 1)
        )
        # (bN, bK, kv_tiles)
        gK = cute.local_tile(
            mK[None, None, head, batch], self.cta_tile, (None, None, 0), proj=(None, 1, 1)
        )
        # (bN, bK, kv_tiles)
        gV = cute.local_tile(
            mV[None, None, head, batch], self.cta_tile, (None, None, 0), proj=(None, 1, 1)
        )
        # (bM, bK)
        gO = cute.local_tile(
            mO[None, None, head, batch], self.cta_tile, (pid_m, None, 0), proj=(1, None, 1)
        )
        seqlen_k = mK.shape[0]

        # TMA views, one CTA (no multicast): (TMA, 1) and (TMA)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q,
            0,
            cute.make_layout(1),
            cute.group_modes(sQ, 0, 2),
            cute.group_modes(gQ, 0, 2),
        )
        # (TMA, kv_slots) and (TMA, kv_tiles)
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k,
            0,
            cute.make_layout(1),
            cute.group_modes(sKV, 0, 2),
            cute.group_modes(gK, 0, 2),
        )
        # (TMA, kv_slots) and (TMA, kv_tiles)
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v,
            0,
            cute.make_layout(1),
            cute.group_modes(sKV, 0, 2),
            cute.group_modes(gV, 0, 2),
        )

        # wgmma views of this thread's warpgroup: shared-memory descriptors for Q, K and V^T.
        qk_thr = qk_mma.get_slice(warpgroup_idx * 128)
        pv_thr = pv_mma.get_slice(warpgroup_idx * 128)
        # (MMA, MMA_M, MMA_K, 1)
        tSrQ = qk_mma.make_fragment_A(qk_thr.partition_A(sQ))
        # (MMA, MMA_N, MMA_K, kv_slots)
        tSrK = qk_mma.make_fragment_B(qk_thr.partition_B(sKV))
        # (MMA, MMA_N, MMA_K, kv_slots)
        tOrVt = pv_mma.make_fragment_B(pv_thr.partition_B(sVt))
        # (MMA, MMA_M, MMA_N): 64 fp32 per thread
        acc_S = cute.make_rmem_tensor(qk_thr.partition_shape_C(self.cta_tile[:2]), self.acc_dtype)
        # (MMA, MMA_M, MMA_N): (query row, key) within the tile of this thread's elements of acc_S
        tScS = qk_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((bM, bN)))
        # (MMA, MMA_M, MMA_K): P in the input dtype, 32 registers per thread
        tOrP = cute.make_rmem_tensor(pv_thr.partition_shape_A((bM, bN)), self.dtype)
        # (MMA, MMA_M, MMA_N): bK / 2 fp32 per thread
        acc_O = cute.make_rmem_tensor(pv_thr.partition_shape_C((bM, bK)), self.acc_dtype)
        k_blocks = cute.size(tSrQ, mode=[2])  # bK / 16 wgmma for S
        kv_blocks = cute.size(tOrP, mode=[2])  # bN / 16 wgmma for O
        # One value per row this thread holds (2): m and l of the softmax
        row_max = cute.make_rmem_tensor(cute.size(self.rows_view(acc_S), mode=[0]), self.acc_dtype)
        row_sum = cute.make_rmem_tensor_like(row_max)

        # 2. Main loop
        producer_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.kv_slots
        )
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_slots)

        # Q once, then K (slot 0) and V (slot 1): all in flight before the first wgmma.
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(q_full, q_bytes)
            cute.copy(tma_atom_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_full)
            self.load_tiles(kv_pipeline, producer_state, 0, tma_atom_k, tKgK, tKsK)
            producer_state.advance()
            self.load_tiles(kv_pipeline, producer_state, 0, tma_atom_v, tVgV, tVsV)
            producer_state.advance()

        # Q has landed (the one and only phase of q_full).
        cute.arch.mbarrier_wait(q_full, 0)
        # Wait until TMA has written K.
        kv_pipeline.consumer_wait(read_state)

        # S = Q @ K^T: bK / 16 asynchronous m64n128k16 steps, the first overwrites acc_S.
        warpgroup.fence()
        qk_mma.set(warpgroup.Field.ACCUMULATE, False)
        for k_block in cutlass.range_constexpr(k_blocks):
            coord = (None, None, k_block, read_state.index)
            cute.gemm(qk_mma, acc_S, tSrQ[None, None, k_block, 0], tSrK[coord], acc_S)
            qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

        # The whole S tile is needed: wait for all wgmmas. Then the K slot is read: release it.
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(read_state)
        read_state.advance()

        # Keys at or beyond Sk (zeros from TMA) get S = -inf: weight exp2(-inf) = 0.
        if seqlen_k < bN:
            self.mask_keys(acc_S, tScS, 0, seqlen_k)

        # P = exp(scale * (S - row_max)) in place of S, with row_max and row_sum.
        self.softmax(acc_S, row_max, row_sum, scale_log2)
        # P rounded to the input dtype, in the register layout of wgmma's A operand.
        tOrP.store(self.acc_as_operand_a(acc_S).load().to(self.dtype))

        # Wait until TMA has written V.
        kv_pipeline.consumer_wait(read_state)

        # O = P @ V: bN / 16 asynchronous m64nDk16 steps, the first overwrites acc_O.
        warpgroup.fence()
        pv_mma.set(warpgroup.Field.ACCUMULATE, False)
        for kv_block in cutlass.range_constexpr(kv_blocks):
            coord = (None, None, kv_block, read_state.index)
            cute.gemm(pv_mma, acc_O, tOrP[None, None, kv_block], tOrVt[coord], acc_O)
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(read_state)
        read_state.advance()

        # 3. Epilogue
        # O = O / row_sum, row by row.
        acc_O_mn = self.rows_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            acc_O_mn[r, None].store(acc_O_mn[r, None].load() * cute.arch.rcp_approx(row_sum[r]))

        # Both warpgroups have finished reading sQ, which sO overwrites.
        cute.arch.sync_threads()

        # O rounded to the input dtype, written to shared memory by stmatrix.
        r2s_copy = cute.make_tiled_copy_C(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, self.acc_dtype),
            pv_mma,
        )
        thr_r2s = r2s_copy.get_slice(tidx)
        # (R2S, R2S_M, R2S_N)
        tRS_acc = r2s_copy.retile(acc_O)
        # (R2S, R2S_M, R2S_N)
        tRS_rO = cute.make_rmem_tensor_like(tRS_acc, self.dtype)
        tRS_rO.store(tRS_acc.load().to(self.dtype))
        # (R2S, R2S_M, R2S_N)
        tRS_sO = thr_r2s.partition_D(sO)
        cute.copy(r2s_copy, tRS_rO, tRS_sO)

        # Make these shared-memory writes visible to TMA (the async proxy), then wait for all.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        # (TMA) and (TMA): the whole tile, clipped to O's bounds by TMA
        tOsO, tOgO = cpasync.tma_partition(
            tma_atom_o,
            0,
            cute.make_layout(1),
            cute.group_modes(sO, 0, 2),
            cute.group_modes(gO, 0, 2),
        )
        if tidx == 0:
            cute.copy(tma_atom_o, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            # The CTA's shared memory must outlive TMA's reads of it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def load_tiles(self, kv_pipeline, producer_state, kv_tile, tma_atom, tXgX, tXsX):
        """Producer step: wait until slot producer_state.index is empty, announce one tile's bytes
        on its full barrier, and start the TMA load of tile kv_tile (of tXgX) into the slot."""
        kv_pipeline.producer_acquire(producer_state)
        full_barrier = kv_pipeline.producer_get_barrier(producer_state)
        cute.copy(
            tma_atom,
            tXgX[None, kv_tile],
            tXsX[None, producer_state.index],
            tma_bar_ptr=full_barrier,
        )

    @staticmethod
    def rows_view(acc):
        """A wgmma accumulator ((2, 2, N / 8), MMA_M, MMA_N) viewed as (rows, columns) of this
        thread: ((2, MMA_M), (2, N / 8, MMA_N)). Value (c, r, n) sits at row 8 r and column
        8 n + c, counted from the thread's first element (row lane / 4, column 2 (lane % 4))."""
        (c, r, n), m_, n_ = acc.layout.shape
        (dc, dr, dn), dm_, dn_ = acc.layout.stride
        rows_by_columns = cute.make_layout(((r, m_), (c, n, n_)), stride=((dr, dm_), (dc, dn, dn_)))
        return cute.make_tensor(acc.iterator, rows_by_columns)

    @staticmethod
    def acc_as_operand_a(acc):
        """The accumulator of S ((2, 2, N / 8), MMA_M, MMA_N) viewed as wgmma's A operand
        ((2, 2, 2), MMA_M, (N / 16, MMA_N)): the 8 values of a 16-key block of A are the
        accumulator values of two neighbouring 8-key blocks of S, in the same order."""
        halves = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
        (c, r, (n2, n16)), m_, n_ = halves.shape
        (dc, dr, (dn2, dn16)), dm_, dn_ = halves.stride
        operand_a = cute.make_layout(
            ((c, r, n2), m_, (n16, n_)), stride=((dc, dr, dn2), dm_, (dn16, dn_))
        )
        return cute.make_tensor(acc.iterator, operand_a)

    @cute.jit
    def mask_keys(self, acc_S, tScS, kv_tile, seqlen_k):
        """S = -inf for the keys of KV tile kv_tile at or beyond seqlen_k."""
        acc_S_mn, tScS_mn = self.rows_view(acc_S), self.rows_view(tScS)
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                if kv_tile * self.cta_tile[1] + tScS_mn[r, c][1] >= seqlen_k:
                    acc_S_mn[r, c] = -cutlass.Float32.inf

    @cute.jit
    def softmax(self, acc_S, row_max, row_sum, scale_log2):
        """For each of this thread's rows: row_max = max_j S_j, P_j = exp2(S_j * scale_log2 -
        row_max * scale_log2) written over S, row_sum = sum_j P_j. Each reduction covers the
        thread's 32 columns, then the 4 threads of its quad (2 butterfly shuffles)."""
        acc_S_mn = self.rows_view(acc_S)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            s = acc_S_mn[r, None].load()
            row_max[r] = s.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
            row_max[r] = cute.arch.warp_reduction_max(row_max[r], threads_in_group=4)
            p = cute.math.exp2(s * scale_log2 - row_max[r] * scale_log2, fastmath=True)
            acc_S_mn[r, None].store(p)
            row_sum[r] = p.reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
            row_sum[r] = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)


def compile_args(dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors, shape = (B, H, Sq, Sk, D)."""
    checks.check_options(options, allowed=())
    B, H, Sq, Sk, D = shape
    q, k, v = (fake_tensor(dtype, (B, H, S, D), dynamic=True) for S in (Sq, Sk, Sk))
    o = fake_tensor(dtype, (B, H, Sq, D), dynamic=True)
    return Sm90Kernel(cute_dtype(dtype), D), (
        q,
        k,
        v,
        o,
        checks.check_scale(scale, D) * math.log2(math.e),
        fake_stream(),
    )


def attention(q, k, v, scale=None):
    """O = softmax(scale * Q @ K^T) @ V for Q (B, H, Sq, D) and K, V (B, H, Sk, D) with Sk <= 128,
    all bf16 or all fp16, D contiguous, D in {64, 128}; scale defaults to 1/sqrt(D). O (B, H, Sq, D)
    in the input dtype."""
    B, H, Sq, Sk, D = checks.check_attention_args(q, k, v)
    scale = checks.check_scale(scale, D)
    # exp(scale * x) = exp2(scale_log2 * x): the kernel takes the folded multiplier.
    scale_log2 = scale * math.log2(math.e)
    checks.check_max(
        "Sk = k.shape[2]",
        Sk,
        128,
        "stage 3 computes the softmax of one KV tile of 128 keys; stage 4 (stages.stage4_kv_interleave) takes any Sk",
    )

    with torch.cuda.device(q.device):
        o = empty_output((B, H, Sq, D), q.dtype, q.device)
        # Dynamic shapes and strides: one compile per (dtype, D) serves every B, H, Sq, Sk. (A
        # static size-1 mode, B = 1 say, would be folded away and change the rank of the TMA.)
        args = [to_cute(t, dynamic=True) for t in (q, k, v, o)] + [
            scale_log2,
            current_stream(),
        ]
        cached_compile(Sm90Kernel(cute_dtype(q.dtype), D), *args)(*args)
    return o
