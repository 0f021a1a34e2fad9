"""Stage 5 - online softmax (Hopper, sm_90a). One pass with running max and sum.

Changes from stage 4:
- The statistics pass disappears: K and V are read once. Each KV tile updates the running
  row_max m and row_sum l exactly as pass 1 of stage 4 did (the same online_softmax), and its
  P = exp2(S * scale_log2 - m_new * scale_log2) is used at once, unnormalised: O += P V_j.
- When a tile raises m, the O accumulated so far was computed against the old max. It is
  rescaled in registers before P V_j is added: O *= row_scale = exp2((m_old - m_new) *
  scale_log2) (1 when m did not grow, 0 on the first tile, where it multiplies an acc_O that
  was never initialised; harmless, since the first PV wgmma runs with ACCUMULATE off and
  overwrites it).
  Cost: one multiply per element of O (64 per thread per tile, D = 128) and one exp2 per row.
- The division moves to the end: O /= l once (as in stage 3), after the quad-sum of l.
- LSE (fp32, natural log) per row: ln l + m * scale = (m * scale_log2 + log2 l) * ln 2,
  written by one thread of each quad (rows beyond Sq skipped).
- Work per KV tile: 2 wgmma batches (QK^T, PV) and 1 exp2 per score, against stage 4's 3 and 2:
  the ideal speed-up over stage 4 is 1.5x, whatever the lengths.
- Registers (ptxas of CUDA 13.0, 2026-12-07): 160 (D = 128), no spills; shared memory as in
  stage 4 (96 KiB of tiles at D = 128; 97 KiB with the mbarriers and sQ's 1,024-byte alignment).

O = softmax(scale * Q K^T) V and, on request, LSE = log(sum_j exp(scale * Q K_j^T)) per row, for
Q (B, H, Sq, D) and K, V (B, H, Sk, D) of any length, bf16 or fp16, D = 64 or 128: the
FlashAttention-2 algorithm on the skeleton and the K/V ring of stage 4.

Shapes: B, H, Sq, Sk >= 1, D in {64, 128}.

Measured speed: docs/results/README.md (against stage 4: docs/notes/stage5.md).
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
    """The device code is organised as stage 8's will be by warp role (FA4's
    flash_attn/cute/flash_fwd_sm90.py): kernel prepares what every warpgroup shares (shared
    memory, barriers, the K/V ring, the wgmma views) and calls load (warp 0: Q and the first K
    tiles) and mma (every warpgroup: the pass over the KV tiles, one mma_one_n_block per KV
    tile, then epilogue: O normalised and stored, LSE)."""

    def __init__(self, dtype, head_dim):
        self.dtype = dtype  # element type of Q, K, V and O: cutlass.BFloat16 or cutlass.Float16
        self.acc_dtype = cutlass.Float32
        # Warpgroup w = 0, 1 computes query rows [64 w, 64 w + 64) of the 128-row tile.
        self.mma_warpgroups = 2
        # (bM, bN, bK): query rows, keys per KV tile, head dim
        self.cta_tile = (64 * self.mma_warpgroups, 128, head_dim)
        self.mma_threads = 128 * self.mma_warpgroups
        self.threads = self.mma_threads  # every warpgroup computes; warp 0 also loads
        self.kv_slots = 2  # K_j then V_j in one slot, K_{j+1} in the other: 2 x 32 KiB (D = 128)
        self.smem_align = 1024  # the 128-byte swizzle repeats every 8 rows of 128 B

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        o: cute.Tensor,
        lse: cute.Tensor,
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
        # (B, H, Sq) -> (Sq, H, B)
        lse = cute.make_tensor(lse.iterator, cute.select(lse.layout, mode=[2, 1, 0]))

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
            lse,
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
        mLSE: cute.Tensor,
        q_smem_layout: cute.ComposedLayout,
        kv_smem_layout: cute.ComposedLayout,
        vt_smem_layout: cute.ComposedLayout,
        o_smem_layout: cute.ComposedLayout,
        scale_log2: cutlass.Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # Every warpgroup computes: the threads that compute count from mma_tidx = tidx.
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
        mma_tidx = tidx
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
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads // 32),
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
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        kv_tiles = cute.size(gK, mode=[2])

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
        tScS = qk_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((bM, bN)))
        # (MMA, MMA_M, MMA_K): P in the input dtype, 32 registers per thread
        tOrP = cute.make_rmem_tensor(pv_thr.partition_shape_A((bM, bN)), self.dtype)
        # (MMA, MMA_M, MMA_N): bK / 2 fp32 per thread
        acc_O = cute.make_rmem_tensor(pv_thr.partition_shape_C((bM, bK)), self.acc_dtype)
        # One value per row this thread holds (2): m and l of the softmax
        row_max = cute.make_rmem_tensor(cute.size(self.rows_view(acc_S), mode=[0]), self.acc_dtype)
        row_sum = cute.make_rmem_tensor_like(row_max)
        # This thread's wgmma operands and accumulators, as the consumers' methods take them
        views = (tSrQ, tSrK, tOrVt, acc_S, tScS, tOrP, acc_O, row_max, row_sum)

        # Warp 0 starts the ring (load: Q, then K of the first kv_slots KV tiles);
        # then every warpgroup computes its rows of the tile (mma), warp 0 also issuing, from
        # each mma_one_n_block, the loads that refill the ring (refills: what it needs for them).
        steps = kv_tiles
        refills = (warp_idx, steps, tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV)
        if warp_idx == 0:
            self.load(
                tma_atom_q,
                tma_atom_k,
                kv_pipeline,
                q_full,
                q_bytes,
                tQsQ,
                tQgQ,
                tKsK,
                tKgK,
                steps,
            )
        self.mma(
            qk_mma,
            pv_mma,
            gO,
            mLSE,
            sO,
            kv_pipeline,
            q_full,
            views,
            pid_m,
            head,
            batch,
            tma_atom_o,
            seqlen_q,
            seqlen_k,
            kv_tiles,
            scale_log2,
            refills,
            tidx,
            mma_tidx,
        )

    @cute.jit
    def load(
        self,
        tma_atom_q,
        tma_atom_k,
        kv_pipeline,
        q_full,
        q_bytes,
        tQsQ,
        tQgQ,
        tKsK,
        tKgK,
        steps,
    ):
        """Warp 0's first loads: Q, then the K tiles of the first kv_slots steps, one per slot.
        A fresh slot's wait passes at once: the producer's parity 1 is already "complete" on a
        new barrier. The ring's later loads are issued from mma_one_n_block."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(q_full, q_bytes)
        cute.copy(tma_atom_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_full)
        for step in cutlass.range(cutlass.min(self.kv_slots, steps), unroll=1):
            fresh_slot = self.slot_state(step % self.kv_slots, 1)
            self.load_tiles(kv_pipeline, fresh_slot, step % steps, tma_atom_k, tKgK, tKsK)

    @cute.jit
    def mma(
        self,
        qk_mma,
        pv_mma,
        gO,
        mLSE,
        sO,
        kv_pipeline,
        q_full,
        views,
        pid_m,
        head,
        batch,
        tma_atom_o,
        seqlen_q,
        seqlen_k,
        kv_tiles,
        scale_log2,
        refills,
        tidx,
        mma_tidx,
    ):
        """Every warpgroup, for its 64 rows of the Q tile: the pass over the tile's KV tiles
        (S = Q K^T, the online softmax, O += P V) and the epilogue."""
        tSrQ, tSrK, tOrVt, acc_S, tScS, tOrP, acc_O, row_max, row_sum = views
        # 2. Main loop
        # Step t of the ring: K and V tile t. Step t uses slot t % kv_slots; bit i of slot_phase
        # is the phase parity the next use of slot i waits for.
        slot_phase = cutlass.Int32(0)

        # Q has landed (the one and only phase of q_full).
        cute.arch.mbarrier_wait(q_full, 0)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        # One pass: S, the running row_max and row_sum, O rescaled, O += P @ V. K_j and V_j take
        # turns in one slot. The first PV of the pass overwrites acc_O.
        pv_mma.set(warpgroup.Field.ACCUMULATE, False)
        for kv_tile in cutlass.range(kv_tiles, unroll=1):
            slot_phase = self.mma_one_n_block(
                kv_tile,
                slot_phase,
                qk_mma,
                pv_mma,
                kv_pipeline,
                tSrQ,
                tSrK,
                tOrVt,
                acc_S,
                tScS,
                tOrP,
                acc_O,
                row_max,
                row_sum,
                seqlen_k,
                scale_log2,
                refills,
            )
            # From the second KV tile on, P V accumulates into acc_O (the loop carries the flag).
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)

        self.epilogue(
            pv_mma,
            acc_O,
            row_max,
            row_sum,
            scale_log2,
            tScS,
            sO,
            gO,
            mLSE,
            pid_m,
            head,
            batch,
            tma_atom_o,
            seqlen_q,
            tidx,
            mma_tidx,
        )

    @cute.jit
    def mma_one_n_block(
        self,
        kv_tile,
        slot_phase,
        qk_mma,
        pv_mma,
        kv_pipeline,
        tSrQ,
        tSrK,
        tOrVt,
        acc_S,
        tScS,
        tOrP,
        acc_O,
        row_max,
        row_sum,
        seqlen_k,
        scale_log2,
        refills,
    ):
        """One step of the pass, KV tile kv_tile = j: S = Q K_j^T, the mask and the online
        softmax, O rescaled, P_j, then O += P_j V_j; warp 0 loads V_j into K_j's slot and then
        K_{j + kv_slots} into it. Returns slot_phase, the slots' phase bits after V_j, which the
        loop carries."""
        _, bN, _ = self.cta_tile
        warp_idx, steps, tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV = refills
        step = kv_tile
        slot = step % self.kv_slots
        k_state = self.slot_state(slot, (slot_phase >> slot) & 1)
        slot_phase ^= 1 << slot
        # Wait until TMA has written K_j.
        kv_pipeline.consumer_wait(k_state)
        self.issue_qk(qk_mma, acc_S, tSrQ, tSrK, k_state.index)

        # The hazard: V_j will overwrite K_j in this slot. Wait until the wgmmas reading K_j
        # have completed, and only then release the slot. The producer loads V_j once all
        # 8 warps have released it (same parity: this use of the slot is over).
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(k_state)
        if warp_idx == 0:
            self.load_tiles(kv_pipeline, k_state, kv_tile, tma_atom_v, tVgV, tVsV)
        row_scale = self.softmax_step(acc_S, tScS, row_max, row_sum, scale_log2, kv_tile, seqlen_k)
        self.rescale_o_and_convert_p(acc_O, row_scale, acc_S, tOrP)

        v_state = self.slot_state(slot, (slot_phase >> slot) & 1)
        slot_phase ^= 1 << slot
        # Wait until TMA has written V_j.
        kv_pipeline.consumer_wait(v_state)

        self.issue_pv(pv_mma, acc_O, tOrP, tOrVt, v_state.index)
        # V_j is read: release the slot, and refill it with the K tile of step + kv_slots.
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(v_state)
        if warp_idx == 0 and step + self.kv_slots < steps:
            self.load_tiles(
                kv_pipeline, v_state, (step + self.kv_slots) % steps, tma_atom_k, tKgK, tKsK
            )
        return slot_phase

    @cute.jit
    def epilogue(
        self,
        pv_mma,
        acc_O,
        row_max,
        row_sum,
        scale_log2,
        tScS,
        sO,
        gO,
        mLSE,
        pid_m,
        head,
        batch,
        tma_atom_o,
        seqlen_q,
        tidx,
        mma_tidx,
    ):
        """The epilogue of the Q tile, in each thread for its rows: O = O / row_sum, LSE, then O
        rounded to the input dtype and stored through shared memory (sO) to global memory by
        TMA."""
        # 3. Epilogue
        bM = self.cta_tile[0]
        # Each thread's row_sum covers its 32 columns of every tile: add up the 4 of the quad.
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            row_sum[r] = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)

        # O = O / row_sum, row by row.
        acc_O_mn = self.rows_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            acc_O_mn[r, None].store(acc_O_mn[r, None].load() * cute.arch.rcp_approx(row_sum[r]))

        # LSE = ln(row_sum) + row_max * scale = (row_max * scale_log2 + log2(row_sum)) * ln(2),
        # written by the first thread of each quad for the rows inside Sq.
        tScS_mn = self.rows_view(tScS)
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(row_sum)):
                row = pid_m * bM + tScS_mn[r, 0][0]
                if row < seqlen_q:
                    lse_log2 = row_max[r] * scale_log2 + cute.math.log2(row_sum[r], fastmath=True)
                    mLSE[row, head, batch] = lse_log2 * math.log(2.0)

        # Both warpgroups have finished reading sQ, which sO overwrites.
        cute.arch.sync_threads()

        # O rounded to the input dtype, written to shared memory by stmatrix.
        r2s_copy = cute.make_tiled_copy_C(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, self.acc_dtype),
            pv_mma,
        )
        thr_r2s = r2s_copy.get_slice(mma_tidx)
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
    def issue_qk(self, qk_mma, acc_S, tSrQ, tSrK, slot):
        """S = Q @ K^T from K in ring slot `slot`: bK / 16 asynchronous m64n128k16 steps, the first
        overwriting acc_S, as one wgmma group (committed, not waited for)."""
        warpgroup.fence()
        qk_mma.set(warpgroup.Field.ACCUMULATE, False)
        for k_block in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            coord = (None, None, k_block, slot)
            cute.gemm(qk_mma, acc_S, tSrQ[None, None, k_block, 0], tSrK[coord], acc_S)
            qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def issue_pv(self, pv_mma, acc_O, tOrP, tOrVt, slot):
        """O += P @ V from V in ring slot `slot`: bN / 16 asynchronous m64nDk16 steps (the very
        first of the pass overwrites acc_O), as one wgmma group (committed, not waited for)."""
        warpgroup.fence()
        for kv_block in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            coord = (None, None, kv_block, slot)
            cute.gemm(pv_mma, acc_O, tOrP[None, None, kv_block], tOrVt[coord], acc_O)
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def softmax_step(self, acc_S, tScS, row_max, row_sum, scale_log2, kv_tile, seqlen_k):
        """The softmax of one tile: keys at or beyond Sk (zeros from TMA) get S = -inf, weight
        exp2(-inf) = 0; then the fold into row_max and row_sum, P = exp(scale * (S - row_max)) in
        place of S. Returns row_scale."""
        _, bN, _ = self.cta_tile
        if (kv_tile + 1) * bN > seqlen_k:
            self.mask_keys(acc_S, tScS, kv_tile, seqlen_k)
        return self.online_softmax(acc_S, row_max, row_sum, scale_log2)

    @cute.jit
    def rescale_o_and_convert_p(self, acc_O, row_scale, acc_S, tOrP):
        """O *= row_scale (O holds P_0 V_0 + ... + P_{j-1} V_{j-1}, weighted against the previous
        row_max), then P_j rounded to the input dtype, in the register layout of wgmma's A
        operand. After the wait for PV_{j-1}: it writes acc_O and tOrP."""
        acc_O_mn = self.rows_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            acc_O_mn[r, None].store(acc_O_mn[r, None].load() * row_scale[r])
        tOrP.store(self.acc_as_operand_a(acc_S).load().to(self.dtype))

    @cute.jit
    def load_tiles(self, kv_pipeline, producer_state, kv_tile, tma_atom, tXgX, tXsX):
        """Producer step: wait on slot producer_state.index's empty barrier for the phase parity
        producer_state.phase (the release of the slot's previous use; 1 passes on a fresh slot),
        announce one tile's bytes on its full barrier, and start the TMA load of tile kv_tile (of
        tXgX) into the slot."""
        kv_pipeline.producer_acquire(producer_state)
        full_barrier = kv_pipeline.producer_get_barrier(producer_state)
        cute.copy(
            tma_atom,
            tXgX[None, kv_tile],
            tXsX[None, producer_state.index],
            tma_bar_ptr=full_barrier,
        )

    def slot_state(self, slot, phase):
        """The pipeline state of one use of a slot: its barriers' index and the phase parity."""
        return pipeline.PipelineState(self.kv_slots, cutlass.Int32(0), slot, phase)

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
    def online_softmax(self, acc_S, row_max, row_sum, scale_log2):
        """Fold one S tile into the running statistics of each of this thread's rows:
        m_new = max(row_max, max_j S_j), row_scale = exp2((row_max - m_new) * scale_log2),
        P_j = exp2(S_j * scale_log2 - m_new * scale_log2) written over S, row_sum = row_sum *
        row_scale + sum_j P_j, row_max = m_new. The max is reduced across the quad at once
        (the 4 threads of a row must subtract the same m); row_sum stays this thread's partial
        sum over its 32 columns, since the rescaling is the same for all 4. Returns row_scale."""
        acc_S_mn = self.rows_view(acc_S)
        row_scale = cute.make_rmem_tensor_like(row_max)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            s = acc_S_mn[r, None].load()
            m_new = s.reduce(cute.ReductionOp.MAX, row_max[r], 0)
            m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=4)
            row_scale[r] = cute.math.exp2((row_max[r] - m_new) * scale_log2, fastmath=True)
            p = cute.math.exp2(s * scale_log2 - m_new * scale_log2, fastmath=True)
            acc_S_mn[r, None].store(p)
            row_sum[r] = row_sum[r] * row_scale[r] + p.reduce(
                cute.ReductionOp.ADD, cutlass.Float32(0.0), 0
            )
            row_max[r] = m_new
        return row_scale


def compile_args(dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors, shape = (B, H, Sq, Sk, D)."""
    checks.check_options(options, allowed=())
    B, H, Sq, Sk, D = shape
    q, k, v = (fake_tensor(dtype, (B, H, S, D), dynamic=True) for S in (Sq, Sk, Sk))
    o, lse = (
        fake_tensor(dtype, (B, H, Sq, D), dynamic=True),
        fake_tensor(torch.float32, (B, H, Sq), dynamic=True),
    )
    return Sm90Kernel(cute_dtype(dtype), D), (
        q,
        k,
        v,
        o,
        lse,
        checks.check_scale(scale, D) * math.log2(math.e),
        fake_stream(),
    )


def attention(q, k, v, scale=None, return_lse=False):
    """O = softmax(scale * Q @ K^T) @ V for Q (B, H, Sq, D) and K, V (B, H, Sk, D), all bf16 or all
    fp16, D contiguous, D in {64, 128}; scale defaults to 1/sqrt(D). O (B, H, Sq, D) in the input
    dtype; with return_lse, also LSE (B, H, Sq) in fp32, the natural-log log-sum-exp of each row
    of scale * Q @ K^T."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"argument 'return_lse': expected a bool, got {type(return_lse).__name__}")
    B, H, Sq, Sk, D = checks.check_attention_args(q, k, v)
    scale = checks.check_scale(scale, D)
    # exp(scale * x) = exp2(scale_log2 * x): the kernel takes the folded multiplier.
    scale_log2 = scale * math.log2(math.e)

    with torch.cuda.device(q.device):
        o = empty_output((B, H, Sq, D), q.dtype, q.device)
        lse = empty_output((B, H, Sq), torch.float32, q.device)
        # Dynamic shapes and strides: one compile per (dtype, D) serves every B, H, Sq, Sk. (A
        # static size-1 mode, B = 1 say, would be folded away and change the rank of the TMA.)
        args = [to_cute(t, dynamic=True) for t in (q, k, v, o)]
        args += [to_cute(lse, dynamic=True), scale_log2, current_stream()]
        cached_compile(Sm90Kernel(cute_dtype(q.dtype), D), *args)(*args)
    return (o, lse) if return_lse else o
