"""Stage 11 - persistent CTAs (Hopper, sm_90a).

Changes from stage 10:
- Why: a CTA per tile pays its set-up (barriers, setmaxnreg, the first loads) with the tensor
  cores idle, and under a causal mask the tiles differ in work, so the grid's tail runs a few
  long tiles on a mostly idle GPU.
- Persistent CTAs: min(tiles, SMs) CTAs (225 KiB of shared memory: one per SM), each walking
  tiles in stage 8's loop; the producer picks the next tile under this tile's last GEMMs.
- The scheduler (next_tile): no mask, batch mode: CTA c takes c, c + gridDim.x, ...; under a
  mask or for packed sequences the producer draws the next tile from an atomic counter and hands
  its number to the consumers with Q (tile_id); a number past the end ends both loops.
- The order (tile_coords): longest first; under a mask in batch mode in sections of (head,
  sequence) pairs whose K and V fit in the 50 MiB L2 together (l2_section_heads).
- O gets its own buffer (32 KiB at D = 128, 16 KiB at D = 64): the consumers release Q after
  their last GEMM, so the next tile's Q and K/V load while O is stored. The ring loses a slot:
  5 x 32 KiB (D = 128), 12 x 16 KiB (D = 64), 225 KiB both.
- O and LSE are stage 10's bit for bit (tested).

attention(q, k, v, ...): Q (B, H, Sq, D), K and V (B, Hkv, Sk, D), H % Hkv == 0 (Hkv = 1: MQA).
attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...): q (total_q, H, D), k and v (total_k,
Hkv, D), sequence b in rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1. Stage 6's masks (bottom-right
per sequence), LSE, bf16/fp16, D = 64 or 128, pack-GQA for short Sq.

Shapes: B, H, Hkv, Sq, Sk >= 1 (packed: any lengths >= 0), D in {64, 128}.

Measured speed: docs/results/README.md; what each choice gains: docs/notes/stage11.md.
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
from common.arch import device_sm_count
from common.cute_interop import rows_of_16_bytes


class Sm90Kernel:
    """The device code is organised by warp role, as FA4's flash_attn/cute/flash_fwd_sm90.py:
    kernel prepares what every warpgroup shares (shared memory, barriers, the K/V ring, the
    wgmma views) and hands each warpgroup its role. load is the producer's (every TMA load),
    mma the consumers' (the work tiles; per tile, in mma_tile, the pass over its KV tiles,
    software-pipelined: first_half_block_overlap for QK_lo, one mma_one_n_block per later KV
    tile, QK_j issued with PV_{j-1}, last_half_block_overlap for the last PV; then epilogue: O
    normalised and stored, LSE)."""

    def __init__(
        self,
        dtype,
        head_dim,
        pack_gqa=1,
        persistent=True,
        o_buffer=True,
        sm_count=None,
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
        # As many K or V tiles as fit in 227 KiB next to Q, O and 1 KiB of barriers: 5 x 32 KiB
        # next to 2 x 32 KiB (D = 128), 12 x 16 KiB next to 2 x 16 KiB (D = 64).
        q_bytes = self.cta_tile[0] * head_dim * dtype.width // 8
        tile_bytes = self.cta_tile[1] * head_dim * dtype.width // 8
        # Persistent CTAs: a grid of at most one CTA per SM (1 fits: 225 KiB of shared memory),
        # each walking work tiles: blockIdx.x, blockIdx.x + gridDim.x, ... in batch mode without
        # a mask, drawn from an atomic counter under one and for packed sequences (see __call__,
        # load and mma).
        # Off: one CTA per tile, the same loop run once. o_buffer: O staged in its own buffer
        # instead of over Q, so that the next tile's Q can land during this tile's epilogue (one
        # K/V slot less).
        self.persistent = persistent
        self.o_buffer = o_buffer
        self.sm_count = sm_count if sm_count is not None else device_sm_count()
        o_bytes = q_bytes if self.o_buffer else 0
        self.kv_slots = (227 * 1024 - 1024 - q_bytes - o_bytes) // tile_bytes
        self.smem_align = 1024  # the 128-byte swizzle repeats every 8 rows of 128 B
        self.longest_first = True  # Q tiles in reverse order: see tile_coords
        # Under a mask (batch mode) the work tiles go longest first across as many (head,
        # sequence) pairs as fit their K and V in L2 (tile_coords); off: head by head.
        self.l2_sections = True
        self.l2_bytes = 50 * 1024 * 1024  # L2 of the H100 and the H200: 50 MiB
        # The launch passes tile_counter (common/attention_host.py): the dynamic scheduler's.
        self.uses_tile_counter = True

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
        tile_counter: cute.Tensor,
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
            # The work tile the producer hands to the consumers with each q_full (see load, mma).
            tile_id: cute.struct.MemRange[cutlass.Int32, 1]
            q_empty: cute.struct.MemRange[cutlass.Int64, 1]
            kv_full: cute.struct.MemRange[cutlass.Int64, self.kv_slots]
            kv_empty: cute.struct.MemRange[cutlass.Int64, self.kv_slots]
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(q_smem_layout)], self.smem_align
            ]
            sKV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(kv_smem_layout)], self.smem_align
            ]
            sO: cute.struct.Align[
                cute.struct.MemRange[
                    self.dtype, cute.cosize(o_smem_layout) if self.o_buffer else 0
                ],
                self.smem_align,
            ]

        self.shared_storage = SharedStorage
        self.shared_memory_bytes = SharedStorage.size_in_bytes()

        # The work tiles: one per Q tile (bM rows) of one (head, sequence), as many Q tiles as the
        # longest sequence has (packed: G rows per position); the tiles past a shorter
        # sequence's end have nothing to do (the producer's first_nonempty_tile skips them).
        # Persistent: min(tiles, SMs) CTAs share them out; persistent off: one CTA per tile.
        sequences = (
            q.shape[3] if cutlass.const_expr(cu_seqlens_q is None) else cu_seqlens_q.shape[0] - 1
        )
        tiles_m = cute.ceil_div(max_seqlen_q * self.pack_gqa, bM)
        tiles = tiles_m * q.shape[2] * sequences
        grid = (tiles, 1, 1)
        # Under a mask (batch mode), the tiles go longest first across sections of l2_heads
        # (head, sequence) pairs whose K and V fit in L2 together (tile_coords; 1: head by head),
        # and, persistent, they are handed out at run time (dynamic = 1): a CTA that finishes a
        # tile takes the next one not yet taken, from tile_counter (zeroed by the host).
        l2_heads = cutlass.Int32(1)
        dynamic = cutlass.Int32(0)
        if cutlass.const_expr(self.persistent):
            # At most one CTA per SM. Equal tiles (batch mode without a causal or window cut:
            # left >= Sk and right >= Sq) are shared out in a fixed order, CTA c taking tiles
            # c, c + gridDim.x, ...; unequal ones as CTAs free up, longest first.
            grid = (cutlass.min(tiles, self.sm_count), 1, 1)
            if cutlass.const_expr(cu_seqlens_q is not None):
                # Packed sequences: the tiles differ with the lengths (and past a shorter
                # sequence's end they are empty: the producer's first_nonempty_tile skips them).
                # They go head by head, sequence after sequence (longest first only inside a (head,
                # sequence)): a long sequence late in cu_seqlens is drawn last.
                dynamic = cutlass.Int32(1)
        if cutlass.const_expr(cu_seqlens_q is None):
            if window_left < k.shape[0] or window_right < max_seqlen_q:
                if cutlass.const_expr(self.persistent):
                    dynamic = cutlass.Int32(1)
                if cutlass.const_expr(self.l2_sections):
                    l2_heads = self.l2_section_heads(k.shape[0], q.shape[2] * q.shape[3])
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
            l2_heads,
            dynamic,
            tile_counter,
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
        l2_heads: cutlass.Int32,
        dynamic: cutlass.Int32,
        tile_counter: cute.Tensor,
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
        # (bM, bK): O's own buffer, or over sQ's bytes, used only after the last wgmma reading Q
        o_bytes_at = storage.sO.data_ptr() if cutlass.const_expr(self.o_buffer) else sQ.iterator
        sO = cute.make_tensor(
            cute.recast_ptr(o_bytes_at, o_smem_layout.inner, dtype=self.dtype),
            cute.select(o_smem_layout.outer, mode=[0, 1]),
        )

        # q_full: 1 arrive (the producer's expect_tx of Q's bytes) + the TMA writes of Q, once
        # per work tile. q_empty: 1 arrive from each consumer thread (mma_threads) once they are
        # done with the tile's Q (and with sO, when it lies over Q), once per work tile.
        q_full = storage.q_full.data_ptr()
        q_empty = storage.q_empty.data_ptr()
        # The number of the tile whose Q q_full announces (the producer writes it before its
        # arrive, the consumers read it after their wait).
        tile_id = storage.tile_id.get_tensor(cute.make_layout(1))
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

        # 2. The work tiles. Tile t is (Q tile, head, sequence) by tile_coords; CTA c starts with
        # tile c, and its producer picks the next one (next_tile: c + gridDim.x, ..., or drawn from
        # tile_counter under a mask and for packed sequences) and hands each to the consumers with
        # its Q (tile_id, q_full).
        # Producer and consumers walk the same tiles and count what they have walked: `tiles_done`
        # gives the phase of q_full and q_empty, `entries` (2 per KV tile) the ring position.
        # The ring: entry 2 t holds K of step t (KV tile kv_tile_lo + t), entry 2 t + 1 its V;
        # entry e takes slot e % kv_slots, and its barriers are waited for the parity
        # (e / kv_slots) % 2 (consumers) or its flip (the producer: 1 passes a fresh empty
        # barrier), from one tile to the next as within one. Every consumer warpgroup reads every
        # entry: its slot is free again once every consumer warp has
        # released it. The producer's walk is load, the consumers' mma.
        heads = mQ.shape[2]
        if cutlass.const_expr(mCuSeqlensQ is not None):
            # Packed sequences: head by head, handed out at run time when persistent (the values
            # __call__ passes, as constants: fewer live registers in the 24 of the producer).
            l2_heads = 1
            if cutlass.const_expr(self.persistent):
                dynamic = 1
        total_tiles = tiles_m * heads * self.sequences(mQ, mCuSeqlensQ)
        # What the role methods take, grouped (each unpacks what it uses)
        gmem = (mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK)
        smem = (sQ, sKV, sO)
        barriers = (kv_pipeline, q_full, q_empty)
        tiling = (total_tiles, tiles_m, heads, l2_heads)
        window = (window_left, window_right)
        if warpgroup_idx == 0:
            # TMA needs few registers: the producer warpgroup gives them up (setmaxnreg is per
            # warpgroup), then warp 0 issues every load.
            cute.arch.setmaxregister_decrease(self.load_registers)
            if warp_idx == 0:
                self.load(
                    atoms,
                    gmem,
                    smem,
                    barriers,
                    tile_id,
                    q_bytes,
                    tiling,
                    dynamic,
                    tile_counter,
                    window,
                )
        else:
            # The consumer warpgroups take the registers the producer gave up (168 -> 240).
            cute.arch.setmaxregister_increase(self.mma_registers)
            self.mma(
                qk_mma,
                pv_mma,
                gmem,
                smem,
                barriers,
                tile_id,
                views,
                tiling,
                scale_log2,
                window,
                warpgroup_idx,
                tidx,
                mma_tidx,
            )

    @cute.jit
    def load(
        self, atoms, gmem, smem, barriers, tile_id, q_bytes, tiling, dynamic, tile_counter, window
    ):
        """The producer: warp 0 of warpgroup 0 walks the work tiles and issues every TMA load
        of each, Q (with the tile's number, for the consumers) and then K_j and V_j of every
        KV tile of its range into the ring; at the end, a tile number past the last."""
        tma_atom_q, tma_atom_k, tma_atom_v = atoms
        mQ, mK, mV, _, _, mCuSeqlensQ, mCuSeqlensK = gmem
        sQ, sKV, _ = smem
        kv_pipeline, q_full, q_empty = barriers
        total_tiles, tiles_m, heads, l2_heads = tiling
        window_left, window_right = window
        tiles_done = cutlass.Int32(0)
        entries = cutlass.Int32(0)
        live = (tiles_m, heads, l2_heads, dynamic, tile_counter, mCuSeqlensQ)
        tile = self.first_nonempty_tile(cute.arch.block_idx()[0], total_tiles, *live)
        while tile < total_tiles:
            pid_m, head, batch = self.tile_coords(tile, tiles_m, heads, l2_heads)
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
            # With Q comes the tile's number, for the consumers (released by the arrive).
            cute.arch.mbarrier_wait(q_empty, self.q_empty_parity(tiles_done))
            with cute.arch.elect_one():
                tile_id[0] = tile
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
            # Every load of this tile is issued (the consumers are a few KV tiles behind):
            # take the next tile now (packed sequences: the next one with rows of Q).
            tile = self.first_nonempty_tile(
                self.next_tile(tile, dynamic, tile_counter), total_tiles, *live
            )
        # No tile left: tell the consumers with a tile number past the end and a q_full
        # of its own (an arrive without bytes), once they are done with the last Q.
        cute.arch.mbarrier_wait(q_empty, self.q_empty_parity(tiles_done))
        with cute.arch.elect_one():
            tile_id[0] = tile
            cute.arch.mbarrier_arrive(q_full)
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
        tile_id,
        views,
        tiling,
        scale_log2,
        window,
        warpgroup_idx,
        tidx,
        mma_tidx,
    ):
        """The consumers: walk load's work tiles, counting tiles and ring entries as it does, and
        make each tile's pass (mma_tile)."""
        mQ, mK, _, _, _, mCuSeqlensQ, mCuSeqlensK = gmem
        _, q_full, _ = barriers
        total_tiles, tiles_m, heads, l2_heads = tiling
        window_left, window_right = window
        tiles_done = cutlass.Int32(0)
        entries = cutlass.Int32(0)
        # Each tile's number comes with its Q (q_full); a number past the end ends the loop.
        cute.arch.mbarrier_wait(q_full, self.q_full_parity(tiles_done))
        tile = tile_id[0]
        while tile < total_tiles:
            pid_m, head, batch = self.tile_coords(tile, tiles_m, heads, l2_heads)
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
                steps,
                scale_log2,
                window,
                consumer_state,
                warpgroup_idx,
                tidx,
                mma_tidx,
            )
            entries += 2 * steps
            tiles_done += 1
            cute.arch.mbarrier_wait(q_full, self.q_full_parity(tiles_done))
            tile = tile_id[0]

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
        steps,
        scale_log2,
        window,
        consumer_state,
        warpgroup_idx,
        tidx,
        mma_tidx,
    ):
        """Each consumer warpgroup, for its 64 rows of the Q tile: the pass over the tile's KV
        tiles (S = Q K^T, the online softmax, O += P V), and the epilogue.
        The pass starts at ring entry consumer_state."""
        _, _, _, mO, mLSE, _, mCuSeqlensK = gmem
        _, sKV, sO = smem
        kv_pipeline, _, q_empty = barriers
        pid_m, head, batch = coords
        offset_q, seqlen_q, seqlen_k = seq
        kv_tile_lo, kv_tile_hi = kv_range
        window_left, window_right = window
        tSrQ, tSrK, tOrVt, acc_S, tScS, tOrP, acc_O, row_max, row_sum = views
        # This tile's Q has landed (mma's wait before its loop or at the end of the last tile).
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        # A row that sees no key keeps O = 0 (and so does a Q tile with no KV tile at all).
        acc_O.fill(0.0)
        # wgmma reads acc_S even where it overwrites it: without this fill the previous tile's
        # P stays live through its epilogue and ptxas serialises the wgmma (C7512, D = 128).
        acc_S.fill(0.0)
        # One pass, software-pipelined inside each warpgroup: the QK^T of a tile is issued
        # before the softmax of the tile before it is done with. Step j issues QK_j and then
        # PV_{j-1} (P_{j-1} is already in registers), and runs softmax_j while PV_{j-1} still
        # holds the tensor cores. Beside O, two register sets are live across the GEMMs:
        # acc_S (S_j, being written, 64 fp32 a thread) and tOrP (P_{j-1} in 16 bits, 32).
        # Per warpgroup:
        #   step lo (prologue)  : QK_lo              | wait all | softmax_lo, P_lo
        #   step j (lo < j < hi): QK_j, PV_{j-1}     | wait QK  | softmax_j | wait PV,
        #                                                           O *= row_scale_j, P_j
        #   after the loop      : PV_{hi-1}          | wait all
        # O gets the same operations in the same order as in stage 9 (O *= row_scale_j, then
        # O += P_j V_j), so O and LSE are stage 9's bit for bit (tested).
        # Ping-pong as in stage 9, but a turn is now the pair issued together, QK_j and
        # PV_{j-1} (turn 0: QK_lo; the last: PV_{hi-1}); steps + 1 turns per warpgroup, the
        # same counts on the turn barriers. With steps = 3:
        #   tensor cores | 1: QK0 | 2: QK0 | 1: QK1 PV0 | 2: QK1 PV0 | 1: QK2 PV1 | ...
        #   warpgroup 1  |        | sm0    |            | sm1        |            |
        #   warpgroup 2  |        |        | sm0        |            | sm1        |
        # where sm_j (softmax_j) also runs under the warpgroup's own PV_{j-1}. With n consumer
        # warpgroups the turns go round 1, ..., n, 1, ... on barriers 2 ... n + 1. Every PV
        # accumulates into acc_O, which starts at 0.
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        if steps > 0:
            v_state, consumer_state = self.first_half_block_overlap(
                kv_tile_lo,
                consumer_state,
                qk_mma,
                kv_pipeline,
                tSrQ,
                tSrK,
                acc_S,
                tScS,
                tOrP,
                row_max,
                row_sum,
                pid_m,
                seqlen_q,
                seqlen_k,
                scale_log2,
                window_left,
                window_right,
                warpgroup_idx,
            )
            for kv_tile in cutlass.range(kv_tile_lo + 1, kv_tile_hi, unroll=1):
                v_state, consumer_state = self.mma_one_n_block(
                    kv_tile,
                    consumer_state,
                    v_state,
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
                    pid_m,
                    seqlen_q,
                    seqlen_k,
                    scale_log2,
                    window_left,
                    window_right,
                    warpgroup_idx,
                )
            self.last_half_block_overlap(
                kv_tile_hi,
                v_state,
                pv_mma,
                mCuSeqlensK,
                sKV,
                kv_pipeline,
                tOrVt,
                tOrP,
                acc_O,
                seqlen_k,
                warpgroup_idx,
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
    def first_half_block_overlap(
        self,
        kv_tile_lo,
        consumer_state,
        qk_mma,
        kv_pipeline,
        tSrQ,
        tSrK,
        acc_S,
        tScS,
        tOrP,
        row_max,
        row_sum,
        pid_m,
        seqlen_q,
        seqlen_k,
        scale_log2,
        window_left,
        window_right,
        warpgroup_idx,
    ):
        """The prologue of the pass, KV tile kv_tile_lo: S_lo = Q @ K_lo^T alone (turn 0), then
        its softmax and P_lo (in tOrP). Returns (v_state, consumer_state), the values the loop
        carries: V_lo's ring entry, read by the next step's PV, and the ring position after it."""
        k_state = consumer_state.clone()
        consumer_state.advance()
        v_state = consumer_state.clone()  # V_lo, read by the next step's PV
        consumer_state.advance()
        kv_pipeline.consumer_wait(k_state)
        # Turn 0 goes round from warpgroup 1: every other warpgroup waits for it.
        if warpgroup_idx > 1:
            self.wait_turn(warpgroup_idx)
        self.issue_qk(qk_mma, acc_S, tSrQ, tSrK, k_state.index)
        self.pass_turn(warpgroup_idx)
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(k_state)
        # O = 0 so far: the first row_scale has nothing to rescale.
        self.softmax_step(
            acc_S,
            tScS,
            row_max,
            row_sum,
            scale_log2,
            pid_m,
            kv_tile_lo,
            seqlen_q,
            seqlen_k,
            window_left,
            window_right,
        )
        tOrP.store(self.acc_as_operand_a(acc_S).load().to(self.dtype))
        return v_state, consumer_state

    @cute.jit
    def mma_one_n_block(
        self,
        kv_tile,
        consumer_state,
        v_state,
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
        pid_m,
        seqlen_q,
        seqlen_k,
        scale_log2,
        window_left,
        window_right,
        warpgroup_idx,
    ):
        """One step of the pass, KV tile kv_tile = j (lo < j < hi): QK_j and PV_{j-1} issued as
        one turn, softmax_j under PV_{j-1}, then O *= row_scale_j and P_j once PV_{j-1} has
        completed. v_state comes in as V_{j-1}'s ring entry. Returns (v_state, consumer_state),
        the values the loop carries: V_j's entry and the ring position after it."""
        k_state = consumer_state.clone()
        consumer_state.advance()
        # Wait until TMA has written K_j; then this warpgroup's turn.
        kv_pipeline.consumer_wait(k_state)
        self.wait_turn(warpgroup_idx)
        # S = Q @ K_j^T into acc_S (S_{j-1} has become P_{j-1} in tOrP) ...
        self.issue_qk(qk_mma, acc_S, tSrQ, tSrK, k_state.index)
        # ... and O += P_{j-1} @ V_{j-1} behind it, in the same turn.
        kv_pipeline.consumer_wait(v_state)
        self.issue_pv(pv_mma, acc_O, tOrP, tOrVt, v_state.index)
        self.pass_turn(warpgroup_idx)

        # wgmma groups complete in order: one still pending (PV_{j-1}) means S_j is complete.
        # K_j is read: release its slot.
        warpgroup.wait_group(1)
        kv_pipeline.consumer_release(k_state)
        # softmax_j, under PV_{j-1}: it reads acc_S, never acc_O or tOrP.
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
        # PV_{j-1} complete: V_{j-1} is read, and acc_O and tOrP are free.
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(v_state)
        self.rescale_o_and_convert_p(acc_O, row_scale, acc_S, tOrP)
        v_state = consumer_state.clone()  # V_j, read by the next step's PV
        consumer_state.advance()
        return v_state, consumer_state

    @cute.jit
    def last_half_block_overlap(
        self,
        kv_tile_hi,
        v_state,
        pv_mma,
        mCuSeqlensK,
        sKV,
        kv_pipeline,
        tOrVt,
        tOrP,
        acc_O,
        seqlen_k,
        warpgroup_idx,
        mma_tidx,
    ):
        """After the loop, the last PV: O += P_{hi-1} @ V_{hi-1}, this warpgroup's last turn,
        waited for; then V_{hi-1}'s slot is released."""
        _, bN, _ = self.cta_tile
        kv_pipeline.consumer_wait(v_state)
        # Packed sequences: the last tile's rows past seqlen_k are the next sequence's V. P is
        # 0 there, but 0 x NaN = NaN: zero those rows before P @ V reads them. Only the range's
        # last tile can reach past seqlen_k. (Its barrier joins all consumer warpgroups, so it
        # stands between turns, as in stage 9.)
        if cutlass.const_expr(mCuSeqlensK is not None):
            if kv_tile_hi * bN > seqlen_k:
                self.zero_rows(sKV, v_state.index, seqlen_k - (kv_tile_hi - 1) * bN, mma_tidx)
        self.wait_turn(warpgroup_idx)
        self.issue_pv(pv_mma, acc_O, tOrP, tOrVt, v_state.index)
        # The last turn goes round too; the last warpgroup's hands over to nobody.
        if warpgroup_idx < self.mma_warpgroups:
            self.pass_turn(warpgroup_idx)
        warpgroup.wait_group(0)
        kv_pipeline.consumer_release(v_state)

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
        # O has its own buffer: every wgmma reading this tile's Q is complete, so the
        # next tile's Q may land while the epilogue runs (this thread's arrive on q_empty).
        if cutlass.const_expr(self.o_buffer):
            cute.arch.mbarrier_arrive(q_empty)
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

        # All consumer warpgroups are done with the previous tile's sO (store_rows) and,
        # when sO lies over Q, with this tile's sQ. (Named barrier 1: the
        # mma_threads consumer threads; the producer takes no part.)
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
        # sequence's, and write the tile's last rows into the next sequence's O. With O
        # over Q (o_buffer off) this thread is then done with the tile's Q and sO: its
        # arrive on q_empty, after a proxy fence (the next Q is written by TMA, the async
        # proxy, over bytes this thread accessed with ordinary loads and stores); with O's
        # own buffer it arrived at the top of the epilogue.
        self.store_rows(
            sO,
            gO,
            seqlen_q * self.pack_gqa - pid_m * bM,
            mma_tidx,
            None if cutlass.const_expr(self.o_buffer) else q_empty,
        )

    def q_full_parity(self, tiles_done):
        """The consumers' parity on q_full for tile number tiles_done: one phase a tile."""
        return tiles_done % 2

    def q_empty_parity(self, tiles_done):
        """The producer's parity on q_empty before tile tiles_done's Q (fresh: 1 passes)."""
        return (tiles_done + 1) % 2

    @cute.jit
    def next_tile(self, tile, dynamic, tile_counter):
        """The producer's next work tile after `tile`: tile + gridDim.x (a fixed share), or with
        dynamic = 1, gridDim.x + a ticket that lane 0 draws from tile_counter (an atomic add, in
        the order the CTAs ask), broadcast to the warp."""
        grid = cute.arch.grid_dim()[0]
        nxt = tile + grid
        if dynamic != 0:
            ticket = cutlass.Int32(0)
            if cute.arch.lane_idx() == 0:
                ticket = cute.arch.atomic_add(tile_counter.iterator, cutlass.Int32(1))
            nxt = grid + cute.arch.shuffle_sync(ticket, 0)
        return nxt

    @cute.jit
    def first_nonempty_tile(
        self, tile, total_tiles, tiles_m, heads, l2_heads, dynamic, tile_counter, mCuSeqlensQ
    ):
        """The first work tile from `tile` on (next_tile past each one skipped) that has rows of
        Q, or a number past the end. Packed sequences only: the grid counts the longest
        sequence's Q tiles for every sequence, and a shorter one's last tiles are empty."""
        if cutlass.const_expr(mCuSeqlensQ is not None):
            searching = cutlass.Int32(1)
            while searching != 0:
                searching = cutlass.Int32(0)
                if tile < total_tiles:
                    pid_m, _, batch = self.tile_coords(tile, tiles_m, heads, l2_heads)
                    if self.tile_is_empty(pid_m, mCuSeqlensQ[batch + 1] - mCuSeqlensQ[batch]):
                        tile = self.next_tile(tile, dynamic, tile_counter)
                        searching = cutlass.Int32(1)
        return tile

    def tile_is_empty(self, pid_m, seqlen_q):
        """Whether Q tile pid_m starts past a sequence of seqlen_q positions (G rows each when
        packed): pid_m * bM >= seqlen_q * G. Shared with the CPU model of the ticket walk."""
        return pid_m * self.cta_tile[0] >= seqlen_q * self.pack_gqa

    @cute.jit
    def wait_turn(self, warpgroup_idx):
        """Ping-pong: block consumer warpgroup w until the one before it (w - 1; for warpgroup 1
        the last one) has passed it the tensor cores. Its named barrier (turn_barrier) counts 256
        threads: this warpgroup's 128 (bar.sync, here) and the previous one's 128 (bar.arrive,
        in pass_turn); each completion is one turn. The turns go strictly round, in
        next_warpgroup's order, so no barrier sees two passes before a wait."""
        cute.arch.barrier(barrier_id=self.turn_barrier(warpgroup_idx), number_of_threads=2 * 128)

    @cute.jit
    def pass_turn(self, warpgroup_idx):
        """Ping-pong: consumer warpgroup w hands the tensor cores to the next one
        (next_warpgroup): an arrive, without waiting, on that warpgroup's turn barrier."""
        barrier = self.turn_barrier(self.next_warpgroup(warpgroup_idx))
        cute.arch.barrier_arrive(barrier_id=barrier, number_of_threads=2 * 128)

    def turn_barrier(self, warpgroup):
        """The named barrier of consumer warpgroup w's turns: 1 + w (barrier 1 is all consumers').
        Plain arithmetic, on a warpgroup number or the kernel's run-time warpgroup_idx alike; the
        CPU model in the tests uses these two methods."""
        return 1 + warpgroup

    def next_warpgroup(self, warpgroup):
        """The consumer warpgroup after w of N = mma_warpgroups: w % N + 1 (N = 2: 1 <-> 2)."""
        return warpgroup % self.mma_warpgroups + 1

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

    def tile_coords(self, tile, tiles_m, heads, l2_heads):
        """(Q tile, head, sequence) of work tile `tile`. The (head, sequence) pairs hb = head +
        H sequence are cut into sections of l2_heads pairs; inside a section the pair varies
        fastest and the Q tile slowest, longest first: every pair's last Q tile (under a causal
        mask the one with the most KV tiles), then every pair's second last, and so on; the
        CTAs running at one time read one section's K and V. l2_heads = 1: head by head."""
        section_tiles = l2_heads * tiles_m
        section = tile // section_tiles
        in_section = tile - section * section_tiles
        block = in_section // l2_heads
        hb = section * l2_heads + in_section - block * l2_heads
        pid_m = block
        if cutlass.const_expr(self.longest_first):
            pid_m = tiles_m - 1 - block
        return pid_m, hb % heads, hb // heads

    @cute.jit
    def l2_section_heads(self, seqlen_k, pairs):
        """How many (head, sequence) pairs' K and V (Sk x 2 D bytes each) fit in the 50 MiB L2
        together (the H100's and the H200's), rounded down to a power of two as FlashAttention's
        LPT scheduler, at least 1 and at most the largest power of two dividing the number of
        pairs (pairs & -pairs), so that every section is whole."""
        per_key = 2 * self.cta_tile[2] * self.dtype.width // 8  # bytes of K and V per key
        fit = (self.l2_bytes // per_key) // seqlen_k
        heads = cutlass.Int32(1)
        for _ in cutlass.range_constexpr(24):
            heads = heads * 2 if heads * 2 <= fit else heads
        return cutlass.min(heads, pairs & -pairs)

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
        if cutlass.const_expr(q_empty is not None):
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
