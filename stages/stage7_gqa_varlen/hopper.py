"""Stage 7 - real-model shapes: GQA / MQA and packed sequences (Hopper, sm_90a).

Changes from stage 6:
- GQA: the CTA of query head `head` reads K and V of kv_head = head // (H / Hkv), a TMA
  coordinate; the H / Hkv heads of a group read the same K/V tiles, which L2 serves.
- Packed sequences: seq_info() gives (offset_q, seqlen_q, offset_k, seqlen_k) to the kernel
  (batch mode: (0, Sq, 0, Sk)); packed, each sequence is a domain_offset view of its rows, with
  ceil(G x max_seqlen_q / 128) Q tiles (G = 1 without pack-GQA, the last change below; those
  past a shorter sequence's end store nothing).
- Sequence boundaries: TMA clips at the packed tensor's end, not the sequence's. P = 0 past
  seqlen_k, but 0 x NaN = NaN: the next sequence's V rows are zeroed in shared memory first
  (zero_rows); O is stored by threads, only rows < seqlen_q (store_rows).
- Pack-GQA for short Sq: the G = H / Hkv heads of a KV head share a Q tile (row r: position
  r // G of head r % G) when that fills tiles much better (common/pack_gqa.py). Only the layouts
  of Q, O and LSE and the masks' position change; O and LSE are the same bit for bit.

attention(q, k, v, ...): Q (B, H, Sq, D), K and V (B, Hkv, Sk, D), H % Hkv == 0 (Hkv = 1: MQA).
attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...): q (total_q, H, D), k and v (total_k,
Hkv, D), sequence b in rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1. Stage 6's masks (bottom-right
per sequence), LSE, bf16/fp16, D = 64 or 128, pack-GQA for short Sq.

Shapes: B, H, Hkv, Sq, Sk >= 1 (packed: any lengths >= 0), D in {64, 128}.

Measured speed: docs/results/README.md; GQA, packed sequences, decode: docs/notes/stage7.md.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from common import attention_host, pack_gqa
from common.cute_interop import rows_of_16_bytes


class Sm90Kernel:
    """The device code is organised by warp role, as FA4's flash_attn/cute/flash_fwd_sm90.py:
    kernel prepares what every warpgroup shares (shared memory, barriers, the K/V ring, the
    wgmma views) and calls the roles' methods: load (Q and the first K tiles) and mma (the
    pass over the tile's KV tiles, one mma_one_n_block per KV tile, which also refills the ring,
    then epilogue: O normalised and stored, LSE)."""

    def __init__(
        self,
        dtype,
        head_dim,
        pack_gqa=1,
    ):
        self.dtype = dtype  # element type of Q, K, V and O: cutlass.BFloat16 or cutlass.Float16
        # Query heads per Q tile (pack-GQA, common/pack_gqa.py): 1, or G = H / Hkv when the
        # G heads of a group share the tile's rows (row r: position r // G, head r % G).
        self.pack_gqa = pack_gqa
        self.acc_dtype = cutlass.Float32
        # Warpgroup w = 0, 1 computes query rows [64 w, 64 w + 64) of the 128-row tile.
        self.mma_warpgroups = 2
        # (bM, bN, bK): query rows, keys per KV tile, head dim
        self.cta_tile = (64 * self.mma_warpgroups, 128, head_dim)
        self.tile_rows = self.cta_tile[0]  # what pack-GQA's G must divide (common/pack_gqa.py)
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
        cu_seqlens_q: cute.Tensor | None,
        cu_seqlens_k: cute.Tensor | None,
        max_seqlen_q: cutlass.Int32,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        stream,
    ):
        bM, bN, bK = self.cta_tile
        row_major = LayoutEnum.ROW_MAJOR  # Q, K, V, O: D contiguous
        # O is stored by threads in 16-byte chunks: tell the compiler what check_tensor makes
        # sure of at run time, that every stride of O but D's is a multiple of 16 bytes.
        o = rows_of_16_bytes(o)
        # (B, H, S, D) -> (S, D, H, B): one matrix per (h, b); K and V have Hkv heads. Packed
        # sequences arrive as B = 1 and S = total tokens, cut into sequences by cu_seqlens.
        q, k, v, o = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))
            for t in (q, k, v, o)
        ]
        # (B, H, Sq) -> (Sq, H, B)
        lse = cute.make_tensor(lse.iterator, cute.select(lse.layout, mode=[2, 1, 0]))
        # Pack-GQA: (S, D, H, B) -> ((G, S), D, Hkv, B), the packed row (g, s) as mode 0; LSE
        # (S, H, B) -> ((G, S), Hkv, B). The grid's head index is then the KV head.
        q, o = (pack_gqa.pack_heads(t, self.pack_gqa, 2) for t in (q, o))
        lse = pack_gqa.pack_heads(lse, self.pack_gqa, 1)

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
        # O = P @ V: one m64nDk16 atom per warpgroup; A = P from registers, B = V^T, MN-major
        # (D contiguous).
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
        # Packed, Q's box is (G heads, bM / G positions, bK).
        q_box = (
            (bM, bK)
            if cutlass.const_expr(self.pack_gqa == 1)
            else ((self.pack_gqa, bM // self.pack_gqa), bK)
        )
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q, cute.select(q_smem_layout, mode=[0, 1]), q_box
        )
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), k, cute.select(kv_smem_layout, mode=[0, 1]), (bN, bK)
        )
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), v, cute.select(kv_smem_layout, mode=[0, 1]), (bN, bK)
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

        # One CTA per 128-row Q tile of one (head, sequence): as many Q tiles as the longest
        # sequence has (packed: G rows per position); the CTAs past a shorter sequence's end
        # find nothing to do.
        sequences = (
            q.shape[3] if cutlass.const_expr(cu_seqlens_q is None) else cu_seqlens_q.shape[0] - 1
        )
        grid = (cute.ceil_div(max_seqlen_q * self.pack_gqa, bM), q.shape[2], sequences)
        self.kernel(
            qk_mma,
            pv_mma,
            tma_atom_q,
            tma_q,
            tma_atom_k,
            tma_k,
            tma_atom_v,
            tma_v,
            o,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            q_smem_layout,
            kv_smem_layout,
            vt_smem_layout,
            o_smem_layout,
            scale_log2,
            window_left,
            window_right,
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
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        q_smem_layout: cute.ComposedLayout,
        kv_smem_layout: cute.ComposedLayout,
        vt_smem_layout: cute.ComposedLayout,
        o_smem_layout: cute.ComposedLayout,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # Every warpgroup computes: the threads that compute count from mma_tidx = tidx.
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
        mma_tidx = tidx
        bM, bN, bK = self.cta_tile

        # 1. Prepare
        atoms = (tma_atom_q, tma_atom_k, tma_atom_v)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)

        # blockIdx = (Q tile, head, sequence). Query head `head` reads KV head head // group.
        # (Pack-GQA: mQ has Hkv heads, the group is 1 and `head` is the KV head.)
        pid_m, head, batch = cute.arch.block_idx()
        kv_head = head // (mQ.shape[2] // mK.shape[2])
        # Where this sequence starts in Q and K, and how long it is (batch mode: 0, Sq, 0, Sk).
        offset_q, seqlen_q, offset_k, seqlen_k, batch = self.seq_info(
            batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK
        )

        allocator = SmemAllocator()
        storage = allocator.allocate(self.shared_storage)
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
        # kv_empty[i]: 1 arrive from each of the 8 consumer warps. (Creating the pipeline
        # fences and syncs the CTA, which also publishes the initialisation of the barriers above.)
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

        # The KV tiles holding a key that some row of this Q tile sees: [kv_tile_lo, kv_tile_hi),
        # the one range the producer loads and the consumers compute (empty: no K or V is read).
        kv_tile_lo, kv_tile_hi = self.kv_tile_range(
            pid_m, seqlen_q, seqlen_k, window_left, window_right
        )

        # TMA views of the tile: (TMA, 1) and (TMA) for Q, (TMA, kv_slots) and (TMA, kv_tiles) for
        # K and V
        tQsQ, tQgQ, tKsK, tKgK, tVsV, tVgV = self.tma_views(
            atoms, (mQ, mK, mV), (sQ, sKV), pid_m, (head, kv_head, batch), offset_q, offset_k
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
        steps = kv_tile_hi - kv_tile_lo
        refills = (warp_idx, steps, tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV)
        # What the role methods take, grouped (each unpacks what it uses)
        gmem = (mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK)
        smem = (sQ, sKV, sO)
        barriers = (kv_pipeline, q_full)
        window = (window_left, window_right)
        if warp_idx == 0:
            self.load(
                atoms, barriers, q_bytes, tQsQ, tQgQ, tKsK, tKgK, (kv_tile_lo, kv_tile_hi), steps
            )
        self.mma(
            qk_mma,
            pv_mma,
            gmem,
            smem,
            barriers,
            views,
            (pid_m, head, batch),
            (offset_q, seqlen_q, seqlen_k),
            (kv_tile_lo, kv_tile_hi),
            scale_log2,
            window,
            refills,
            tidx,
            mma_tidx,
        )

    @cute.jit
    def load(self, atoms, barriers, q_bytes, tQsQ, tQgQ, tKsK, tKgK, kv_range, steps):
        """Warp 0's first loads: Q, then the K tiles of the first kv_slots steps, one per slot.
        A fresh slot's wait passes at once: the producer's parity 1 is already "complete" on a
        new barrier. The ring's later loads are issued from mma_one_n_block."""
        tma_atom_q, tma_atom_k, _ = atoms
        kv_pipeline, q_full = barriers
        kv_tile_lo, _ = kv_range
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(q_full, q_bytes)
        cute.copy(tma_atom_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_full)
        for step in cutlass.range(cutlass.min(self.kv_slots, steps), unroll=1):
            fresh_slot = self.slot_state(step % self.kv_slots, 1)
            self.load_tiles(kv_pipeline, fresh_slot, kv_tile_lo + step, tma_atom_k, tKgK, tKsK)

    @cute.jit
    def mma(
        self,
        qk_mma,
        pv_mma,
        gmem,
        smem,
        barriers,
        views,
        coords,
        seq,
        kv_range,
        scale_log2,
        window,
        refills,
        tidx,
        mma_tidx,
    ):
        """Each consumer warpgroup, for its 64 rows of the Q tile: the pass over the tile's KV
        tiles (S = Q K^T, the online softmax, O += P V), and the epilogue."""
        _, _, _, mO, mLSE, _, mCuSeqlensK = gmem
        _, sKV, sO = smem
        kv_pipeline, q_full = barriers
        pid_m, head, batch = coords
        offset_q, seqlen_q, seqlen_k = seq
        kv_tile_lo, kv_tile_hi = kv_range
        window_left, window_right = window
        tSrQ, tSrK, tOrVt, acc_S, tScS, tOrP, acc_O, row_max, row_sum = views
        # 2. Main loop
        # Step t of the ring: K and V tile kv_tile_lo + t. Step t uses slot t % kv_slots; bit i of
        # slot_phase is the phase parity the next use of slot i waits for.
        slot_phase = cutlass.Int32(0)

        # Wait until this tile's Q has landed (parity 0: q_full completes once).
        cute.arch.mbarrier_wait(q_full, 0)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        # A row that sees no key keeps O = 0 (and so does a Q tile with no KV tile at all).
        acc_O.fill(0.0)
        # One pass: S, the running row_max and row_sum, O rescaled, O += P @ V. K_j and V_j take
        # turns in one slot. The first PV of the pass overwrites acc_O.
        pv_mma.set(warpgroup.Field.ACCUMULATE, False)
        for kv_tile in cutlass.range(kv_tile_lo, kv_tile_hi, unroll=1):
            slot_phase = self.mma_one_n_block(
                kv_tile,
                slot_phase,
                qk_mma,
                pv_mma,
                mCuSeqlensK,
                sKV,
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
                pid_m,
                seqlen_q,
                seqlen_k,
                scale_log2,
                window_left,
                window_right,
                mma_tidx,
                kv_tile_lo,
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
            mO,
            mLSE,
            pid_m,
            head,
            batch,
            offset_q,
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
        mCuSeqlensK,
        sKV,
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
        pid_m,
        seqlen_q,
        seqlen_k,
        scale_log2,
        window_left,
        window_right,
        mma_tidx,
        kv_tile_lo,
        refills,
    ):
        """One step of the pass, KV tile kv_tile = j: S = Q K_j^T, the mask and the online
        softmax, O rescaled, P_j, then O += P_j V_j.
        Warp 0 loads V_j into K_j's slot, then K_{j + kv_slots}; returns slot_phase, the slots'
        phase bits after V_j, which the loop carries."""
        _, bN, _ = self.cta_tile
        warp_idx, steps, tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV = refills
        step = kv_tile - kv_tile_lo
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
        row_scale = self.softmax_step(
            acc_S,
            tScS,
            row_max,
            row_sum,
            scale_log2,
            pid_m,
            kv_tile,
            seqlen_q,
            seqlen_k,
            window_left,
            window_right,
        )
        self.rescale_o_and_convert_p(acc_O, row_scale, acc_S, tOrP)

        v_state = self.slot_state(slot, (slot_phase >> slot) & 1)
        slot_phase ^= 1 << slot
        # Wait until TMA has written V_j.
        kv_pipeline.consumer_wait(v_state)
        # Packed sequences: the last tile's rows past seqlen_k are the next sequence's V. P is
        # 0 there, but 0 x NaN = NaN: zero those rows before P @ V reads them.
        if cutlass.const_expr(mCuSeqlensK is not None):
            if (kv_tile + 1) * bN > seqlen_k:
                self.zero_rows(sKV, v_state.index, seqlen_k - kv_tile * bN, mma_tidx)

        self.issue_pv(pv_mma, acc_O, tOrP, tOrVt, v_state.index)
        # V_j is read: release the slot, and refill it with the K tile of step + kv_slots.
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(v_state)
        if warp_idx == 0 and step + self.kv_slots < steps:
            self.load_tiles(kv_pipeline, v_state, kv_tile + self.kv_slots, tma_atom_k, tKgK, tKsK)
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
        mO,
        mLSE,
        pid_m,
        head,
        batch,
        offset_q,
        seqlen_q,
        tidx,
        mma_tidx,
    ):
        """The epilogue of the Q tile, in each consumer thread for its rows: O = O / row_sum,
        LSE, then O rounded to the input dtype and stored through shared memory (sO) to global
        memory, only the rows inside the sequence."""
        # 3. Epilogue
        bM = self.cta_tile[0]
        # Each thread's row_sum covers its 32 columns of every tile: add up the 4 of the quad.
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            row_sum[r] = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)

        # O = O / row_sum, row by row; a row that saw no key (row_sum = 0) keeps O = 0.
        acc_O_mn = self.rows_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            inv_row_sum = cute.arch.rcp_approx(row_sum[r]) if row_sum[r] > 0.0 else 0.0
            acc_O_mn[r, None].store(acc_O_mn[r, None].load() * inv_row_sum)

        # LSE = ln(row_sum) + row_max * scale = (row_max * scale_log2 + log2(row_sum)) * ln(2),
        # written by the first thread of each quad for the rows inside Sq.
        tScS_mn = self.rows_view(tScS)
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(row_sum)):
                row = pid_m * bM + tScS_mn[r, 0][0]  # packed: G rows per position
                if row < seqlen_q * self.pack_gqa:
                    lse_log2 = row_max[r] * scale_log2 + cute.math.log2(row_sum[r], fastmath=True)
                    # A row that saw no key: LSE = log(0) = -inf.
                    if row_sum[r] == 0.0:
                        lse_log2 = -cutlass.Float32.inf
                    lse_ln = lse_log2 * math.log(2.0)
                    if cutlass.const_expr(self.pack_gqa == 1):
                        mLSE[offset_q + row, head, batch] = lse_ln
                    else:  # row = (head in the group, position)
                        g, pos = row % self.pack_gqa, row // self.pack_gqa
                        mLSE[(g, offset_q + pos), head, batch] = lse_ln

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

        cute.arch.sync_threads()

        # This tile's rows of O: (bM, bK)
        q_offset = offset_q if cutlass.const_expr(self.pack_gqa == 1) else (0, offset_q)
        mO_seq = cute.domain_offset((q_offset, 0), mO[None, None, head, batch])
        gO = cute.local_tile(mO_seq, self.cta_tile, (pid_m, None, 0), proj=(1, None, 1))
        # Shared memory -> global memory, 16 bytes per thread and copy, only the rows
        # inside the sequence: TMA would clip at the packed tensor's end, not the
        # sequence's, and write the tile's last rows into the next sequence's O.
        self.store_rows(sO, gO, seqlen_q * self.pack_gqa - pid_m * bM, mma_tidx)

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
        """O += P @ V from V in ring slot `slot`: bN / 16 asynchronous m64nDk16 steps, as one
        wgmma group (committed, not waited for); the very first of the pass overwrites acc_O."""
        warpgroup.fence()
        for kv_block in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            coord = (None, None, kv_block, slot)
            cute.gemm(pv_mma, acc_O, tOrP[None, None, kv_block], tOrVt[coord], acc_O)
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def softmax_step(
        self,
        acc_S,
        tScS,
        row_max,
        row_sum,
        scale_log2,
        pid_m,
        kv_tile,
        seqlen_q,
        seqlen_k,
        window_left,
        window_right,
    ):
        """The softmax of one tile: the element mask on a tile that crosses an edge (Sk, or the
        band of the window: the diagonal when causal), then the fold into row_max and row_sum,
        P = exp(scale * (S - row_max)) in place of S. Returns row_scale."""
        if self.crosses_mask_edge(pid_m, kv_tile, seqlen_q, seqlen_k, window_left, window_right):
            self.mask_keys(
                acc_S, tScS, pid_m, kv_tile, seqlen_q, seqlen_k, window_left, window_right
            )
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
    def tma_views(self, atoms, tensors, smem, pid_m, heads, offset_q, offset_k):
        """The TMA partitions of one Q tile, one CTA (no multicast): Q's (TMA, 1) and
        (TMA), K's and V's (TMA, kv_slots) and (TMA, kv_tiles). Query head `head` reads KV head
        kv_head; packed sequences start at offset_q, offset_k of the single batch entry."""
        tma_atom_q, tma_atom_k, tma_atom_v = atoms
        mQ, mK, mV = tensors
        sQ, sKV = smem
        head, kv_head, batch = heads
        # This sequence's rows of one head, starting at its offset: (S, D)
        q_offset = offset_q if cutlass.const_expr(self.pack_gqa == 1) else (0, offset_q)
        mQ_seq = cute.domain_offset((q_offset, 0), mQ[None, None, head, batch])
        mK_seq = cute.domain_offset((offset_k, 0), mK[None, None, kv_head, batch])
        mV_seq = cute.domain_offset((offset_k, 0), mV[None, None, kv_head, batch])
        # (bM, bK)
        gQ = cute.local_tile(mQ_seq, self.cta_tile, (pid_m, None, 0), proj=(1, None, 1))
        # (bN, bK, kv_tiles)
        gK = cute.local_tile(mK_seq, self.cta_tile, (None, None, 0), proj=(None, 1, 1))
        gV = cute.local_tile(mV_seq, self.cta_tile, (None, None, 0), proj=(None, 1, 1))
        one = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, one, cute.group_modes(sKV, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v, 0, one, cute.group_modes(sKV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        return tQsQ, tQgQ, tKsK, tKgK, tVsV, tVgV

    @cute.jit
    def seq_info(self, batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK):
        """(offset_q, seqlen_q, offset_k, seqlen_k, batch coordinate) of sequence `batch`, the
        one place every part of the kernel takes them from. Batch mode (no cu_seqlens): the
        sequences are the batch mode of the tensors. Packed: rows cu_seqlens[b] ..
        cu_seqlens[b + 1] - 1 of the single batch entry 0."""
        if cutlass.const_expr(mCuSeqlensQ is None):
            seqlen_q = mQ.shape[0] if cutlass.const_expr(self.pack_gqa == 1) else mQ.shape[0][1]
            return 0, seqlen_q, 0, mK.shape[0], batch
        offset_q, offset_k = mCuSeqlensQ[batch], mCuSeqlensK[batch]
        seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        return offset_q, seqlen_q, offset_k, seqlen_k, 0

    @cute.jit
    def zero_rows(self, sKV, slot, first_row, tidx):
        """Zero rows first_row .. bN - 1 of slot `slot` of the K/V ring (all consumer threads,
        tidx counted among them), then make the writes visible to the wgmma that reads the slot
        (the async proxy) and wait for all consumer threads: every warpgroup reads all of V."""
        _, bN, bK = self.cta_tile
        per_row = bK // 8  # 16-byte chunks per row
        for i in cutlass.range_constexpr(bN * per_row // self.mma_threads):
            chunk = i * self.mma_threads + tidx
            row, col = chunk // per_row, (chunk % per_row) * 8
            if row >= first_row:
                for e in cutlass.range_constexpr(8):
                    sKV[row, col + e, slot] = self.dtype(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)

    @cute.jit
    def store_rows(self, sO, gO, valid_rows, tidx):
        """gO[r, :] = sO[r, :] for the rows r < valid_rows of the tile, 8 elements (16 bytes)
        per thread and copy: bK / 8 threads per row, `rows` rows per pass."""
        bM, _, bK = self.cta_tile
        copy_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128
        )
        per_row = bK // 8
        rows = self.mma_threads // per_row
        thr_layout = cute.make_layout((rows, per_row), stride=(per_row, 1))
        s2g = cute.make_tiled_copy_tv(copy_atom, thr_layout, cute.make_layout((1, 8)))
        thr_s2g = s2g.get_slice(tidx)
        # (CPY, CPY_M, CPY_K): this thread's chunks of the tile, and their (row, column)
        tOsO = thr_s2g.partition_S(sO)
        tOgO = thr_s2g.partition_D(gO)
        tOcO = thr_s2g.partition_D(cute.make_identity_tensor((bM, bK)))
        tOrO = cute.make_rmem_tensor_like(tOsO)
        cute.copy(s2g, tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            if tOcO[0, m, 0][0] < valid_rows:
                cute.copy(s2g, tOrO[None, m, None], tOgO[None, m, None])

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
    def q_positions(self, pid_m, seqlen_q):
        """The first and last query position of Q tile pid_m inside the sequence: rows pid_m * bM
        .. pid_m * bM + bM - 1, G rows per position when packed (G = 1 otherwise)."""
        bM = self.cta_tile[0]
        first_row = pid_m * bM
        last_row = cutlass.min(first_row + bM, seqlen_q * self.pack_gqa) - 1
        return first_row // self.pack_gqa, last_row // self.pack_gqa

    @cute.jit
    def kv_tile_range(self, pid_m, seqlen_q, seqlen_k, window_left, window_right):
        """[lo, hi): the KV tiles holding a key that some row of Q tile pid_m sees. Row i sees key
        j when band_lo <= j - i <= band_hi, band_lo = Sk - Sq - left, band_hi = Sk - Sq + right.
        The tile's positions run from first_row to last_row (q_positions), so the keys seen run
        from first_row + band_lo to last_row + band_hi, clipped to [0, Sk).
        (common.masks.kv_tile_range is the same on the host for G = 1.)"""
        bM, bN, _ = self.cta_tile
        band_lo, band_hi = seqlen_k - seqlen_q - window_left, seqlen_k - seqlen_q + window_right
        first_row, last_row = self.q_positions(pid_m, seqlen_q)
        first_key = cutlass.max(first_row + band_lo, 0)
        end_key = cutlass.max(cutlass.min(last_row + band_hi + 1, seqlen_k), 0)
        lo = first_key // bN
        hi = cutlass.max((end_key + bN - 1) // bN, lo)
        # A Q tile past the end of its (shorter) sequence sees nothing.
        if first_row >= seqlen_q:
            hi = lo
        return lo, hi

    @cute.jit
    def crosses_mask_edge(self, pid_m, kv_tile, seqlen_q, seqlen_k, window_left, window_right):
        """Whether tile (pid_m, kv_tile) holds a (row, key) pair that must not be seen: a key at
        or beyond Sk, right of the band (j - i > band_hi for the tile's first row) or left of
        it (j - i < band_lo for its last row). Every other tile of the range is seen whole."""
        bM, bN, _ = self.cta_tile
        band_lo, band_hi = seqlen_k - seqlen_q - window_left, seqlen_k - seqlen_q + window_right
        first_row, last_row = self.q_positions(pid_m, seqlen_q)
        first_key, last_key = kv_tile * bN, kv_tile * bN + bN - 1
        crosses = last_key >= seqlen_k
        crosses = crosses or last_key - first_row > band_hi
        crosses = crosses or first_key - last_row < band_lo
        return crosses

    @cute.jit
    def mask_keys(self, acc_S, tScS, pid_m, kv_tile, seqlen_q, seqlen_k, window_left, window_right):
        """S = -inf where row i of Q tile pid_m must not see key j of KV tile kv_tile: j >= Sk,
        or j - i outside [band_lo, band_hi]."""
        bM, bN, _ = self.cta_tile
        band_lo, band_hi = seqlen_k - seqlen_q - window_left, seqlen_k - seqlen_q + window_right
        acc_S_mn, tScS_mn = self.rows_view(acc_S), self.rows_view(tScS)
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                row = (pid_m * bM + tScS_mn[r, c][0]) // self.pack_gqa  # its position
                key = kv_tile * bN + tScS_mn[r, c][1]
                if key >= seqlen_k or key - row > band_hi or key - row < band_lo:
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
            # A row that has seen no key yet (m_new = -inf) subtracts 0 instead: P = exp2(-inf)
            # = 0 and row_scale = 0 rather than exp2(-inf + inf) = NaN.
            m_safe = m_new if m_new != -cutlass.Float32.inf else 0.0
            row_scale[r] = cute.math.exp2((row_max[r] - m_safe) * scale_log2, fastmath=True)
            p = cute.math.exp2(s * scale_log2 - m_safe * scale_log2, fastmath=True)
            acc_S_mn[r, None].store(p)
            row_sum[r] = row_sum[r] * row_scale[r] + p.reduce(
                cute.ReductionOp.ADD, cutlass.Float32(0.0), 0
            )
            row_max[r] = m_new
        return row_scale


def compile_args(dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors, shape = (B, H, Sq, Sk, D); options
    causal, window, kv_heads (Hkv, default H), varlen (True: packed sequences, B of them,
    through cu_seqlens) and pack_gqa (None, True, False: as attention's). The host side of
    stages 7-14 is one copy, common/attention_host.py."""
    return attention_host.compile_args(Sm90Kernel, dtype, shape, scale, **options)


def attention(q, k, v, scale=None, causal=False, window=None, return_lse=False, pack_gqa=None):
    """O = softmax(scale * Q @ K^T + mask) @ V for Q (B, H, Sq, D) and K, V (B, Hkv, Sk, D) with
    H % Hkv == 0 (Hkv = 1: MQA): query head h reads KV head h // (H // Hkv), as SDPA's
    enable_gqa. All bf16 or all fp16, D contiguous, D in {64, 128}; scale defaults to
    1/sqrt(D); causal and window as in stage 6 (bottom-right aligned). O (B, H, Sq, D); with
    return_lse also LSE (B, H, Sq) in fp32. A row that sees no key gets O = 0, LSE = -inf.

    pack_gqa: the G = H / Hkv query heads of a KV head share one Q tile (common/pack_gqa.py).
    None (default) packs where a tile would otherwise be mostly empty, Sq short against the
    Q tile (the kernel's tile_rows; decode-like shapes: Sq = 1 uses 1 row unpacked, G packed);
    True / False force it (True needs G to divide the tile's rows). The same answer either way
    (the same arithmetic per row); the speed is in docs/results/README.md."""
    return attention_host.attention(
        Sm90Kernel, q, k, v, scale, causal, window, return_lse, pack_gqa
    )


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    scale=None,
    causal=False,
    window=None,
    return_lse=False,
    pack_gqa=None,
):
    """Packed sequences, FlashAttention's flash_attn_varlen_func layout: q (total_q, H, D), k and
    v (total_k, Hkv, D); sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and
    cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 of k and v (int32 CUDA tensors of batch + 1
    non-decreasing offsets from 0; zero-length sequences allowed). Masks per sequence, causal
    bottom-right aligned in each. O (total_q, H, D); with return_lse also LSE (H, total_q).

    Checking cu_seqlens (starts at 0, non-decreasing, ends at the total, max_seqlen not below a
    real length) reads them to the host: a small device-to-host copy and a synchronisation, the
    price of refusing wrong input rather than reading out of bounds. It is paid once per pair of
    cu_seqlens tensors: a later call with the same two tensors, not written since, skips it
    (common/checks.py), so a model pays it once per batch, not per layer. max_seqlen_q
    (default: computed) sets the grid. pack_gqa as in attention(), decided on max_seqlen_q."""
    return attention_host.attention_varlen(
        Sm90Kernel,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        causal,
        window,
        return_lse,
        pack_gqa,
    )
