"""Stage 8 - warp specialisation (Hopper, sm_90a).

Changes from stage 7:
- Warp roles (384 threads, FlashAttention-3's): warpgroup 0 is the producer, one thread of it
  issuing every TMA load (load); consumer warpgroups 1 and 2 compute query rows [0, 64) and
  [64, 128) with stage 7's arithmetic (mma) and never stop to load, each at its own pace.
- Registers (setmaxnreg): 168 per thread at entry (65,536 / 384, down to a multiple of 8); the
  producer drops to 24, the consumers rise to 240: 128 x 24 + 256 x 240 = 64,512 of 65,536.
- The ring runs ahead: entry 2 t holds K of step t, 2 t + 1 its V, in slot entry % kv_slots,
  as many slots as fit in 227 KiB next to Q and 1 KiB of barriers: 6 x 32 KiB (D = 128) or
  13 x 16 KiB (D = 64). Arrivals per phase: kv_full 1 + the tile's TMA bytes, kv_empty 8 (one per
  consumer warp), q_full 1 + Q's bytes, q_empty 256 (every consumer thread, once sO is stored).
- The work-tile loop: load and mma count tiles and ring entries, so that the phases carry from
  tile to tile (one tile per CTA here; stage 11: several). S starts from zeros and every PV
  accumulates into O's zeros (mma_tile's comments say why). O and LSE: stage 7's, bit for bit.

attention(q, k, v, ...): Q (B, H, Sq, D), K and V (B, Hkv, Sk, D), H % Hkv == 0 (Hkv = 1: MQA).
attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...): q (total_q, H, D), k and v (total_k,
Hkv, D), sequence b in rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1. Stage 6's masks (bottom-right
per sequence), LSE, bf16/fp16, D = 64 or 128, pack-GQA for short Sq.

Shapes: B, H, Hkv, Sq, Sk >= 1 (packed: any lengths >= 0), D in {64, 128}.

Measured speed: docs/results/README.md; what each choice gains: docs/notes/stage8.md.
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
    wgmma views) and calls the roles' methods: load (every TMA load) and mma (the work tiles;
    per tile, mma_tile: the pass over its KV tiles, one mma_one_n_block per KV tile, then
    epilogue: O normalised and stored, LSE)."""

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
        # Consumer warpgroup w = 1, 2 computes query rows [64 (w - 1), 64 w) of the 128-row tile.
        self.mma_warpgroups = 2
        # (bM, bN, bK): query rows, keys per KV tile, head dim
        self.cta_tile = (64 * self.mma_warpgroups, 128, head_dim)
        self.tile_rows = self.cta_tile[0]  # what pack-GQA's G must divide (common/pack_gqa.py)
        self.mma_threads = 128 * self.mma_warpgroups
        self.threads = 128 + self.mma_threads  # warpgroup 0: the TMA producer
        self.load_registers = 24
        self.mma_registers = 240
        # As many K or V tiles as fit in 227 KiB next to Q and 1 KiB of barriers
        q_bytes = self.cta_tile[0] * head_dim * dtype.width // 8
        tile_bytes = self.cta_tile[1] * head_dim * dtype.width // 8
        self.kv_slots = (227 * 1024 - 1024 - q_bytes) // tile_bytes
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

        # S = Q @ K^T: one m64n128k16 wgmma atom per consumer warpgroup, stacked along M.
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
            q_empty: cute.struct.MemRange[cutlass.Int64, 1]
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

        # The work tiles: stage 7's grid (Q tile, head, sequence) in one number, one CTA per
        # tile (the loop over work tiles in load and mma runs once).
        sequences = (
            q.shape[3] if cutlass.const_expr(cu_seqlens_q is None) else cu_seqlens_q.shape[0] - 1
        )
        tiles_m = cute.ceil_div(max_seqlen_q * self.pack_gqa, bM)
        tiles = tiles_m * q.shape[2] * sequences
        grid = (tiles, 1, 1)
        # One CTA per SM (min_blocks_per_mp): ptxas then allocates by setmaxnreg's counts.
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
            tiles_m,
            scale_log2,
            window_left,
            window_right,
        ).launch(grid=grid, block=[self.threads, 1, 1], min_blocks_per_mp=1, stream=stream)

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
        tiles_m: cutlass.Int32,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # 0: the producer; 1 .. mma_warpgroups: the consumers, whose threads count from mma_tidx = 0
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
        mma_tidx = tidx - 128
        bM, bN, bK = self.cta_tile

        # 1. Prepare
        atoms = (tma_atom_q, tma_atom_k, tma_atom_v)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)

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

        # q_full: 1 arrive (the producer's expect_tx of Q's bytes) + the TMA writes of Q, once
        # per work tile. q_empty: 1 arrive from each of the 256 consumer threads once they are
        # done with the tile's Q and with sO over it, once per work tile.
        q_full = storage.q_full.data_ptr()
        q_empty = storage.q_empty.data_ptr()
        q_bytes = cute.size_in_bytes(
            self.dtype, cute.select(q_smem_layout, mode=[0, 1])
        )  # 32 KiB (D = 128)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(q_full, 1)
                cute.arch.mbarrier_init(q_empty, self.mma_threads)
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

        # wgmma views of this thread's consumer warpgroup: shared-memory descriptors for Q, K, V^T.
        qk_thr = qk_mma.get_slice((warpgroup_idx - 1) * 128)
        pv_thr = pv_mma.get_slice((warpgroup_idx - 1) * 128)
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

        # 2. The work tiles: CTA c takes tile c, then next_tile's (here none). Producer (load) and
        # consumers (mma) walk the same tiles and count them (`tiles_done`: the phase of q_full and
        # q_empty) and their ring entries (`entries`: the ring position, ring_state; step t of a
        # tile, KV tile kv_tile_lo + t, takes entries 2 t (K) and 2 t + 1 (V)).
        heads = mQ.shape[2]
        total_tiles = tiles_m * heads * self.sequences(mQ, mCuSeqlensQ)
        # What the role methods take, grouped (each unpacks what it uses)
        gmem = (mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK)
        smem = (sQ, sKV, sO)
        barriers = (kv_pipeline, q_full, q_empty)
        tiling = (total_tiles, tiles_m, heads)
        window = (window_left, window_right)
        if warpgroup_idx == 0:
            # TMA needs few registers: the producer warpgroup gives them up (setmaxnreg is per
            # warpgroup), then warp 0 issues every load.
            cute.arch.setmaxregister_decrease(self.load_registers)
            if warp_idx == 0:
                self.load(atoms, gmem, smem, barriers, q_bytes, tiling, window)
        else:
            # The consumer warpgroups take the registers the producer gave up (168 -> 240).
            cute.arch.setmaxregister_increase(self.mma_registers)
            self.mma(
                qk_mma,
                pv_mma,
                gmem,
                smem,
                barriers,
                views,
                tiling,
                scale_log2,
                window,
                tidx,
                mma_tidx,
            )

    @cute.jit
    def load(self, atoms, gmem, smem, barriers, q_bytes, tiling, window):
        """The producer (warp 0 of warpgroup 0): for each work tile every TMA load, Q and then
        K_j and V_j of every KV tile of its range into the ring."""
        tma_atom_q, tma_atom_k, tma_atom_v = atoms
        mQ, mK, mV, _, _, mCuSeqlensQ, mCuSeqlensK = gmem
        sQ, sKV, _ = smem
        kv_pipeline, q_full, q_empty = barriers
        total_tiles, tiles_m, heads = tiling
        window_left, window_right = window
        tiles_done = cutlass.Int32(0)
        entries = cutlass.Int32(0)
        tile = cute.arch.block_idx()[0]
        while tile < total_tiles:
            pid_m, head, batch = self.tile_coords(tile, tiles_m, heads)
            kv_head = head // (mQ.shape[2] // mK.shape[2])
            offset_q, seqlen_q, offset_k, seqlen_k, batch = self.seq_info(
                batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK
            )
            kv_tile_lo, kv_tile_hi = self.kv_tile_range(
                pid_m, seqlen_q, seqlen_k, window_left, window_right
            )
            # TMA views of the tile: (TMA, 1) and (TMA) for Q, (TMA, kv_slots) and
            # (TMA, kv_tiles) for K and V
            tQsQ, tQgQ, tKsK, tKgK, tVsV, tVgV = self.tma_views(
                atoms, (mQ, mK, mV), (sQ, sKV), pid_m, (head, kv_head, batch), offset_q, offset_k
            )
            # Q once the consumers are done with the previous tile's, then K_j and V_j of every
            # KV tile, each into the next entry (load_tiles waits for its slot's release).
            cute.arch.mbarrier_wait(q_empty, self.q_empty_parity(tiles_done))
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(q_full, q_bytes)
            cute.copy(tma_atom_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_full)
            producer_state = self.ring_state(entries, pipeline.PipelineUserType.Producer)
            for kv_tile in cutlass.range(kv_tile_lo, kv_tile_hi, unroll=1):
                self.load_tiles(kv_pipeline, producer_state, kv_tile, tma_atom_k, tKgK, tKsK)
                producer_state.advance()
                self.load_tiles(kv_pipeline, producer_state, kv_tile, tma_atom_v, tVgV, tVsV)
                producer_state.advance()
            entries += 2 * (kv_tile_hi - kv_tile_lo)
            tiles_done += 1
            tile = self.next_tile(tile)
        # Exit once the consumers have released the last kv_slots entries: no arrive on the
        # ring is outstanding then.
        kv_pipeline.producer_tail(self.ring_state(entries, pipeline.PipelineUserType.Producer))

    @cute.jit
    def mma(
        self,
        qk_mma,
        pv_mma,
        gmem,
        smem,
        barriers,
        views,
        tiling,
        scale_log2,
        window,
        tidx,
        mma_tidx,
    ):
        """The consumers: walk load's work tiles, counting tiles and ring entries as it does, and
        make each tile's pass (mma_tile)."""
        mQ, mK, _, _, _, mCuSeqlensQ, mCuSeqlensK = gmem
        total_tiles, tiles_m, heads = tiling
        window_left, window_right = window
        tiles_done = cutlass.Int32(0)
        entries = cutlass.Int32(0)
        tile = cute.arch.block_idx()[0]
        while tile < total_tiles:
            pid_m, head, batch = self.tile_coords(tile, tiles_m, heads)
            offset_q, seqlen_q, offset_k, seqlen_k, batch = self.seq_info(
                batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK
            )
            kv_tile_lo, kv_tile_hi = self.kv_tile_range(
                pid_m, seqlen_q, seqlen_k, window_left, window_right
            )
            steps = kv_tile_hi - kv_tile_lo
            consumer_state = self.ring_state(entries, pipeline.PipelineUserType.Consumer)
            self.mma_tile(
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
                consumer_state,
                tiles_done,
                tidx,
                mma_tidx,
            )
            entries += 2 * steps
            tiles_done += 1
            tile = self.next_tile(tile)

    @cute.jit
    def mma_tile(
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
        consumer_state,
        tiles_done,
        tidx,
        mma_tidx,
    ):
        """Each consumer warpgroup, for its 64 rows of the Q tile: the pass over the tile's KV
        tiles (S = Q K^T, the online softmax, O += P V), and the epilogue.
        The pass starts at ring entry consumer_state."""
        _, _, _, mO, mLSE, _, mCuSeqlensK = gmem
        _, sKV, sO = smem
        kv_pipeline, q_full, q_empty = barriers
        pid_m, head, batch = coords
        offset_q, seqlen_q, seqlen_k = seq
        kv_tile_lo, kv_tile_hi = kv_range
        window_left, window_right = window
        tSrQ, tSrK, tOrVt, acc_S, tScS, tOrP, acc_O, row_max, row_sum = views
        # Wait until this tile's Q has landed.
        cute.arch.mbarrier_wait(q_full, self.q_full_parity(tiles_done))
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        # A row that sees no key keeps O = 0 (and so does a Q tile with no KV tile at all).
        acc_O.fill(0.0)
        # wgmma reads acc_S even where it overwrites it: without this fill the previous tile's
        # P stays live through its epilogue and ptxas serialises the wgmma (C7512, D = 128).
        acc_S.fill(0.0)
        # One pass, each consumer warpgroup at its own pace: its GEMMs reach the tensor cores as
        # issued. Every PV accumulates into acc_O, which starts at 0.
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        for kv_tile in cutlass.range(kv_tile_lo, kv_tile_hi, unroll=1):
            consumer_state = self.mma_one_n_block(
                kv_tile,
                consumer_state,
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
            )

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
            q_empty,
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
        consumer_state,
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
    ):
        """One step of the pass, KV tile kv_tile = j: S = Q K_j^T, the mask and the online
        softmax, O rescaled, P_j, then O += P_j V_j.
        Returns consumer_state, the ring position after V_j, which the loop carries."""
        _, bN, _ = self.cta_tile
        k_state = consumer_state.clone()
        consumer_state.advance()
        # Wait until TMA has written K_j.
        kv_pipeline.consumer_wait(k_state)
        self.issue_qk(qk_mma, acc_S, tSrQ, tSrK, k_state.index)

        # The hazard: the producer refills a slot as soon as all 8 consumer warps have released
        # it. Wait until the wgmmas reading K_j have completed, and only then release its slot.
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(k_state)
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

        v_state = consumer_state.clone()
        consumer_state.advance()
        # Wait until TMA has written V_j.
        kv_pipeline.consumer_wait(v_state)
        # Packed sequences: the last tile's rows past seqlen_k are the next sequence's V. P is
        # 0 there, but 0 x NaN = NaN: zero those rows before P @ V reads them. (Its barrier
        # joins both consumer warpgroups.)
        if cutlass.const_expr(mCuSeqlensK is not None):
            if (kv_tile + 1) * bN > seqlen_k:
                self.zero_rows(sKV, v_state.index, seqlen_k - kv_tile * bN, mma_tidx)

        self.issue_pv(pv_mma, acc_O, tOrP, tOrVt, v_state.index)
        # V_j is read once PV_j has completed: release its slot.
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(v_state)
        return consumer_state

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
        q_empty,
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

        # All consumer warpgroups are done with this tile's sQ, which sO overwrites. (Named
        # barrier 1: the 256 consumer threads; the producer takes no part.)
        cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)

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

        cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)

        # This tile's rows of O: (bM, bK)
        q_offset = offset_q if cutlass.const_expr(self.pack_gqa == 1) else (0, offset_q)
        mO_seq = cute.domain_offset((q_offset, 0), mO[None, None, head, batch])
        gO = cute.local_tile(mO_seq, self.cta_tile, (pid_m, None, 0), proj=(1, None, 1))
        # Shared memory -> global memory, 16 bytes per thread and copy, only the rows
        # inside the sequence: TMA would clip at the packed tensor's end, not the
        # sequence's, and write the tile's last rows into the next sequence's O. Then
        # this thread is done with the tile's Q and sO: its arrive on q_empty, after a
        # proxy fence (the next Q is written by TMA, the async proxy, over bytes this
        # thread accessed with ordinary loads and stores).
        self.store_rows(sO, gO, seqlen_q * self.pack_gqa - pid_m * bM, mma_tidx, q_empty)

    def q_full_parity(self, tiles_done):
        """The consumers' parity on q_full for tile number tiles_done: one phase a tile."""
        return tiles_done % 2

    def q_empty_parity(self, tiles_done):
        """The producer's parity on q_empty before tile tiles_done's Q (fresh: 1 passes)."""
        return (tiles_done + 1) % 2

    @cute.jit
    def next_tile(self, tile):
        """This CTA's work tile after `tile`: tile + gridDim.x (here past the last one)."""
        return tile + cute.arch.grid_dim()[0]

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
        wgmma group (committed, not waited for); every step accumulates (acc_O starts at 0)."""
        warpgroup.fence()
        for kv_block in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            coord = (None, None, kv_block, slot)
            cute.gemm(pv_mma, acc_O, tOrP[None, None, kv_block], tOrVt[coord], acc_O)
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

    def tile_coords(self, tile, tiles_m, heads):
        """(Q tile, head, sequence) of work tile `tile`, the Q tile fastest (stage 7's grid)."""
        pid_m = tile % tiles_m
        hb = tile // tiles_m
        return pid_m, hb % heads, hb // heads

    @staticmethod
    def sequences(mQ, mCuSeqlensQ):
        """The number of sequences: the batch mode of Q (batch mode) or of cu_seqlens - 1."""
        if cutlass.const_expr(mCuSeqlensQ is None):
            return mQ.shape[3]
        return mCuSeqlensQ.shape[0] - 1

    def ring_state(self, entries, user):
        """Slot entries % kv_slots, parity (entries // kv_slots) % 2 (producer: flipped)."""
        wraps = entries // self.kv_slots
        phase = wraps % 2 if user == pipeline.PipelineUserType.Consumer else (wraps + 1) % 2
        return pipeline.PipelineState(self.kv_slots, entries, entries % self.kv_slots, phase)

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
    def store_rows(self, sO, gO, valid_rows, tidx, q_empty):
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
        # This thread is done reading sO (over Q): its arrive on q_empty, after a proxy fence.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(q_empty)

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
