"""Stage 9 - ping-pong (Blackwell, sm_100a): two Q tiles per CTA in TMEM, two softmax
warpgroups taking turns on the tensor core.

Changes from stage 8:
- Why: in stage 8 the tensor core idles twice per KV tile: while the softmax warpgroup turns S_j
  into P_j, and while the MMA warp waits for P_j @ V_j to complete before S_j+1 overwrites P_j.
  Here each CTA takes two Q tiles (2 x 128 rows) and a second softmax warpgroup, as FA4 does:
  warps 0-3 own the rows of Q tile 0, warps 4-7 those of tile 1.
- Q tile s (s = 0, 1) has its own S_s, P_s (over S_s) and O_s in TMEM: S_0 in columns 0-127,
  S_1 128-255, O_0 256 .. 256 + D - 1, O_1 after it; 512 allocated (D = 64 uses 384).
- The MMA warp issues per KV tile QK_0, QK_1, then PV_0, PV_1: while warpgroup 0 computes P_0
  the tensor core computes S_1, and while warpgroup 1 computes P_1 it multiplies P_0 @ V. Each
  warpgroup waits only for its own tile; each tile has its own S, P, O and statistics barriers
  (arrivals as in stage 8). The correction warpgroup (now warps 8-11) rescales and stores both.
- Warp 12 issues the MMAs, warp 13 the TMA loads; 14-15 complete the fourth warpgroup. 512
  threads hold 128 registers each at launch; setmaxnreg: softmax 184, correction 96, MMA/TMA 48
  ((2 x 184 + 96 + 48) x 128 = 65,536); the TMEM barriers count 416 and 384 threads. To fit, the
  MMA warp issues a GEMM's k-blocks in a loop (unrolled, every k-block's descriptors of both Q
  tiles stayed live across the KV loop) and each role takes its work tile in its own branch (a
  value made before the split is live across every branch's setmaxnreg). ptxas of CUDA 13.0
  (2026-12-06): no spill in 24 configurations (168 / 80 / 96, unrolled, spilled 8-236 bytes).
- Shared memory: two Q tiles leave room for 4 ring slots at D = 128 (199,680 bytes), 8 at D = 64
  (166,912 bytes). A CTA's KV tile range is the union of its two tiles' ranges (causal: up to
  one more KV tile for tile 0, masked to -inf element by element).
- The per-tile hand-offs stay serialised (S_s,j+1 waits for P_s,j @ V_j to complete before it
  overwrites P_s): what stage 10 changes where TMEM has room for P of its own (D = 64).

attention(q, k, v, ...): Q (B, H, Sq, D), K and V (B, Hkv, Sk, D), H % Hkv == 0 (Hkv = 1: MQA).
attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...): q (total_q, H, D), k and v (total_k,
Hkv, D), sequence b in rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1. Stage 6's masks (bottom-right
per sequence), LSE, bf16/fp16, D = 64 or 128, pack-GQA for short Sq.

Shapes: B, H, Hkv, Sq, Sk >= 1 (packed: any lengths >= 0), D in {64, 128}. The proxy fences of
zero_keys: docs/notes/stage7.md.

Compile-checked for sm_100a with fake tensors and no GPU (common.tools.ptx.compile_only(9,
"blackwell")); PTX checks and a CPU model of every hand-off between the roles
(common/tools/schedule.py) in tests; never run on Blackwell hardware, so neither its speed nor
what it gains over the stage before is known. The numerical tests run only where an sm_100 GPU
is present. Measured numbers (Hopper track only): docs/results/README.md.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator

from common import attention_host, pack_gqa
from common.cute_interop import rows_of_16_bytes
from common.tmem import fence_after_thread_sync, fence_before_thread_sync


class Sm100Kernel:
    """The device code is organised by warp role, as in FA4's flash_fwd_sm100.py. `kernel` sets up
    what the roles share (shared memory: smem_tensors; the mbarrier pipelines and named barriers:
    make_pipelines; the TMEM allocator; the CTA's tiles: gmem_tiles) and each warp then calls its
    role's method: `load` (the TMA warp), `mma` (the MMA warp), `softmax` (two warpgroups: P per
    KV tile) and `correction` (a warpgroup: O's rescale, then `epilogue`: O stored, and LSE).
    The methods after them are their helpers."""

    def __init__(self, dtype, head_dim, pack_gqa=1):
        self.dtype = dtype  # element type of Q, K, V and O: cutlass.BFloat16 or cutlass.Float16
        # Query heads per Q tile (pack-GQA, common/pack_gqa.py): 1, or G = H / Hkv when the
        # G heads of a group share the tile's rows (row r: position r // G, head r % G).
        self.pack_gqa = pack_gqa
        self.acc_dtype = Float32
        # (bM, bN, bK) = (Q rows, K rows, D): one S tile; one tcgen05.mma is 128 x 128 x 16.
        self.qk_mma_tiler = (128, 128, head_dim)
        # (bM, bN, bK) = (Q rows, D, K rows): O += P @ V; one tcgen05.mma is 128 x D x 16.
        self.pv_mma_tiler = (128, head_dim, 128)
        # Q tiles per CTA, each with its own S, P and O in TMEM and its own softmax warpgroup.
        self.q_tiles = 2
        self.cta_rows = self.q_tiles * self.qk_mma_tiler[0]
        self.cta_group = tcgen05.CtaGroup.ONE  # one CTA per MMA (no 2-CTA pairs)
        self.cluster_shape_mn = (1, 1)
        # Warp roles: softmax warpgroup s (s = 0, 1) owns the rows of Q tile s; the correction
        # warpgroup rescales O and stores it; one MMA warp and one TMA warp as in stages 1-8;
        # warps 14-15 only complete the fourth warpgroup (setmaxnreg acts on whole warpgroups).
        self.softmax_warp_ids = ((0, 1, 2, 3), (4, 5, 6, 7))
        self.correction_warp_ids = (8, 9, 10, 11)
        self.mma_warp_id = 12
        self.tma_warp_id = 13
        self.idle_warp_ids = (14, 15)
        self.threads_per_cta = 32 * 16
        # Registers per thread after setmaxnreg: (2 x 184 + 96 + 48) x 128 = 65536; 48 for the
        # MMA warp, which issues a GEMM's k-blocks in a loop (FA4's count; unrolled, it spilled).
        self.softmax_registers = 184
        self.correction_registers = 96
        self.other_registers = 48
        # Named barriers (0 is __syncthreads): the one before TMEM is freed (the softmax and
        # correction warps), and the TMEM allocation handshake (MMA, softmax and correction).
        self.tmem_free_bar_id = 1
        self.tmem_alloc_bar_id = 2
        # Pipeline depths: the two Q tiles loaded once; a ring of K/V slots; per Q tile one S
        # (and P over it), one O, one row-statistics hand-off.
        self.q_buffers = self.q_tiles
        tile_bytes = 128 * head_dim * dtype.width // 8
        # The sm_100 opt-in limit (227 KiB) less a 4 KiB reserve that holds the barriers, the
        # row statistics (1 KiB per Q tile) and the 1 KiB alignment of the buffers.
        self.smem_budget = 227 * 1024 - 4 * 1024
        self.kv_slots = min((self.smem_budget - self.q_buffers * tile_bytes) // tile_bytes, 8)
        self.s_buffers = 1
        # Ring entries per KV tile, in order, one tuple per sweep over the KV tiles: what the TMA
        # warp loads and what the MMA warp waits for. One pass: K (QK), then V (PV).
        self.kv_producer_entries = (("K", "V"),)
        self.kv_consumer_entries = (("K", "V"),)
        # TMEM columns (32-bit cells; lane = row of the tile): S_0, S_1, then O_0, O_1; P_s over S_s.
        self.tmem_s_offset = tuple(s * self.qk_mma_tiler[1] for s in range(self.q_tiles))
        self.tmem_o_offset = tuple(
            self.q_tiles * self.qk_mma_tiler[1] + s * head_dim for s in range(self.q_tiles)
        )
        self.tmem_p_offset = self.tmem_s_offset
        self.num_tmem_alloc_cols = 512
        # tcgen05.ld.32x32b.x32: each thread reads 32 fp32 columns of its row per load.
        self.tmem_load_cols = 32
        self.smem_align = 1024  # the 128-byte swizzle pattern repeats every 8 rows = 1 KiB

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
        max_seqlen_q: Int32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
    ):
        # O's rows start on 16-byte boundaries: each thread stores its row in 16-byte vectors.
        o = rows_of_16_bytes(o)
        # (B, H, S, D) -> (S, D, (H, B)): the two tile modes first, then (h, b) as one batch mode;
        # K and V have Hkv heads. Packed sequences arrive as B = 1 and S = total tokens.
        # Pack-GQA: Q and O (S, D, H, B) -> ((G, S), D, Hkv, B) first, the packed row (g, s) as
        # mode 0; the grid's head index is then the KV head.
        q, k, o = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))
            for t in (q, k, o)
        ]
        q, o = (pack_gqa.pack_heads(t, self.pack_gqa, 2) for t in (q, o))
        q, k, o = [
            cute.make_tensor(t.iterator, cute.group_modes(t.layout, 2, 4)) for t in (q, k, o)
        ]
        # V -> (D, Sk, (H, B)): the B operand of P @ V is (N, K) = (D, keys), D contiguous (MN-major).
        v = cute.make_tensor(
            v.iterator, cute.group_modes(cute.select(v.layout, mode=[3, 2, 1, 0]), 2, 4)
        )
        # LSE (B, H, Sq) -> (Sq, (H, B)); packed ((G, Sq), (Hkv, B))
        lse = pack_gqa.pack_heads(
            cute.make_tensor(lse.iterator, cute.select(lse.layout, mode=[2, 1, 0])),
            self.pack_gqa,
            1,
        )
        lse = cute.make_tensor(lse.iterator, cute.group_modes(lse.layout, 1, 3))

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
        # O += P @ V per 128 x D x 16: A = P from TMEM (a row of P is a TMEM lane: K-major),
        # B = V from shared memory, MN-major.
        pv_mma = utils.sm100.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.MN,
            self.acc_dtype,
            self.cta_group,
            self.pv_mma_tiler[:2],
            tcgen05.OperandSource.TMEM,
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
        # (MMA, MMA_N=D, MMA_K, kv_slots): a V tile in its own layout, but in K's slots (same slot stride)
        v_smem_one = cute.select(
            utils.sm100.make_smem_layout_b(pv_mma, self.pv_mma_tiler, self.dtype, 1),
            mode=[0, 1, 2],
        )
        v_smem_s = cute.append(
            v_smem_one, cute.make_layout(self.kv_slots, stride=cute.cosize(k_smem_one))
        )
        # (MMA, MMA_M, MMA_K, 1): P in TMEM as the A operand of P @ V
        p_tmem_s = utils.sm100.make_smem_layout_a(pv_mma, self.pv_mma_tiler, self.dtype, 1)

        # TMA descriptors over (S, D, (H, B)) and (D, Sk, (H, B)): a 128 x D tile of Q, of K, of V.
        tma_load_op = cpasync.CopyBulkTensorTileG2SOp(self.cta_group)
        tma_q, tma_tq = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load_op, q, q_smem_one, self.qk_mma_tiler, qk_mma, cluster_layout_vmnk.shape
        )
        tma_k, tma_tk = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load_op, k, k_smem_one, self.qk_mma_tiler, qk_mma, cluster_layout_vmnk.shape
        )
        tma_v, tma_tv = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load_op, v, v_smem_one, self.pv_mma_tiler, pv_mma, cluster_layout_vmnk.shape
        )
        # Bytes each TMA copy moves (its box), and the bytes each pipeline entry arms its full
        # barrier with: 128 x D x 2 each (16 KiB for D = 64, 32 KiB for D = 128).
        self.copy_bytes = {
            name: cute.size_in_bytes(self.dtype, layout)
            for name, layout in (("Q", q_smem_one), ("K", k_smem_one), ("V", v_smem_one))
        }
        self.q_tma_bytes = self.copy_bytes["Q"]
        self.kv_tma_bytes = {"K": self.copy_bytes["K"], "V": self.copy_bytes["V"]}
        self.kv_slot_bytes = cute.size_in_bytes(self.dtype, k_smem_one)

        @cute.struct
        class SharedStorage:
            q_bar: cute.struct.MemRange[Int64, self.q_buffers * 2]
            kv_bar: cute.struct.MemRange[Int64, self.kv_slots * 2]
            # per Q tile, one entry each (full and empty)
            s_bar: cute.struct.MemRange[Int64, self.q_tiles * self.s_buffers * 2]
            p_bar: cute.struct.MemRange[Int64, self.q_tiles * 2]
            o_bar: cute.struct.MemRange[Int64, self.q_tiles * 2]
            stats_bar: cute.struct.MemRange[Int64, self.q_tiles * 2]
            tmem_holding: Int32
            stats: cute.struct.MemRange[Float32, 128 * 2 * self.q_tiles]
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(q_smem_s)], self.smem_align
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(k_smem_s)], self.smem_align
            ]

        self.shared_storage = SharedStorage
        self.shared_memory_bytes = SharedStorage.size_in_bytes()

        # One CTA per two 128-row Q tiles of one (head, sequence): as many as the longest
        # sequence needs (packed: G rows per position); the CTAs past a shorter sequence's end
        # find nothing to do.
        sequences = (
            cute.size(q, mode=[2, 1])
            if cutlass.const_expr(cu_seqlens_q is None)
            else cu_seqlens_q.shape[0] - 1
        )
        grid = (
            cute.ceil_div(max_seqlen_q * self.pack_gqa, self.cta_rows),
            cute.size(q, mode=[2, 0]),
            sequences,
        )
        # One CTA per SM, stated (min_blocks_per_mp), so that ptxas allocates by setmaxnreg's counts
        # (184, 96 and 48 a thread) instead of capping everything at 128.
        self.kernel(
            qk_mma,
            pv_mma,
            tma_q,
            tma_tq,
            tma_k,
            tma_tk,
            tma_v,
            tma_tv,
            o,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            scale_log2,
            window_left,
            window_right,
            cluster_layout_vmnk,
            q_smem_s,
            k_smem_s,
            v_smem_s,
            p_tmem_s,
        ).launch(grid=grid, block=[self.threads_per_cta, 1, 1], min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        cluster_layout_vmnk: cute.Layout,
        q_smem_s: cute.ComposedLayout,
        k_smem_s: cute.ComposedLayout,
        v_smem_s: cute.ComposedLayout,
        p_tmem_s: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        # The work tile: blockIdx. What a role needs of it (its Q tiles, head, sequence, KV
        # range) it takes from work_tile in its own branch: a value made before the warps split
        # is live across every branch's setmaxnreg (ptxas spilled a sequence length, packed).
        work = (mQ, mK, mCuSeqlensQ, mCuSeqlensK, window_left, window_right)

        # 1. Prepare
        if warp_idx == self.tma_warp_id:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)

        storage = SmemAllocator().allocate(self.shared_storage)
        softmax_threads = 32 * len(self.softmax_warp_ids[0])  # 128: one per row of a Q tile
        correction_threads = 32 * len(self.correction_warp_ids)
        (
            (q_prod, q_cons),
            (kv_prod, kv_cons),
            (s_pipes, p_pipes, o_pipes, stats_pipes),
            (tmem_alloc_bar, tmem_free_bar),
        ) = self.make_pipelines(storage, cluster_layout_vmnk)
        # The correction warpgroup allocates and frees TMEM: it is the last to read it.
        tmem = TmemAllocator(
            storage.tmem_holding.ptr,
            barrier_for_retrieve=tmem_alloc_bar,
            allocator_warp_id=self.correction_warp_ids[0],
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)

        sQ, sK, sV, sStats = self.smem_tensors(storage, q_smem_s, k_smem_s, v_smem_s)

        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        # (MMA, MMA_M, MMA_N): the (row, key) coordinates of S's elements within a tile
        tCcS = qk_thr.partition_C(cute.make_identity_tensor(self.qk_mma_tiler[:2]))
        # S and O in TMEM; the base address is known once TMEM is allocated. (MMA, MMA_M, MMA_N)
        tStS_layout = qk_mma.make_fragment_C(qk_thr.partition_shape_C(self.qk_mma_tiler[:2])).layout
        tOtO_layout = pv_mma.make_fragment_C(pv_thr.partition_shape_C(self.pv_mma_tiler[:2])).layout

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        # 2. Main loop by warp role
        # The MMA, TMA and idle warps form the fourth warpgroup: it and the correction warpgroup
        # give registers to the two softmax warpgroups (the counts: the module docstring). Each
        # role's branch lowers or raises its own count first, so that ptxas knows the count of
        # every branch.
        if warp_idx >= self.idle_warp_ids[0]:
            cute.arch.setmaxregister_decrease(self.other_registers)

        if warp_idx == self.tma_warp_id:
            cute.arch.setmaxregister_decrease(self.other_registers)
            w = self.work_tile(cute.arch.block_idx(), *work)
            q_tile0, head, kv_head, batch = w[:4]
            offset_q, seqlen_q, offset_k, seqlen_k = w[4:8]
            kv_tile_lo, kv_tile_hi = w[8:]
            _, _, gQ, gK, gV, _, _ = self.gmem_tiles(
                mQ, mK, mV, mO, mLSE, head, kv_head, batch, offset_q, offset_k
            )
            loads = (q_prod, kv_prod)
            loads = self.load(
                (tma_q, tma_k, tma_v, qk_thr, pv_thr),
                (gQ, gK, gV, sQ, sK, sV),
                *loads,
                q_tile0,
                kv_tile_lo,
                kv_tile_hi,
            )
            # Every buffer released by the MMA warp before this warp exits.
            loads[1].tail()
            loads[0].tail()

        if warp_idx == self.mma_warp_id:
            cute.arch.setmaxregister_decrease(self.other_registers)
            self.mma(
                qk_mma,
                pv_mma,
                sQ,
                sK,
                sV,
                tmem,
                tStS_layout,
                tOtO_layout,
                p_tmem_s,
                q_cons,
                kv_cons,
                s_pipes,
                p_pipes,
                o_pipes,
                work,
                mCuSeqlensK,
            )

        for s in cutlass.range_constexpr(self.q_tiles):
            if warp_idx // 4 == s:
                # Softmax warpgroup s: the rows of Q tile s.
                cute.arch.setmaxregister_increase(self.softmax_registers)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
                s_cons, p_prod = s_pipes[s].make_consumer(), p_pipes[s].make_producer()
                stats_prod = stats_pipes[s].make_producer()
                w = self.work_tile(cute.arch.block_idx(), *work)
                q_tile0, seqlen_q, seqlen_k = w[0], w[5], w[7]
                kv_tile_lo, kv_tile_hi = w[8], w[9]
                s_cons, p_prod, stats_prod = self.softmax(
                    s,
                    tidx % softmax_threads,
                    cute.make_tensor(tmem_ptr + self.tmem_s_offset[s], tStS_layout),
                    tCcS,
                    s_cons,
                    p_prod,
                    stats_prod,
                    sStats,
                    q_tile0 + s,
                    kv_tile_lo,
                    kv_tile_hi,
                    seqlen_q,
                    seqlen_k,
                    scale_log2,
                    window_left,
                    window_right,
                )
                # Done with TMEM: its tcgen05.ld and .st ordered before the barrier that frees TMEM.
                fence_before_thread_sync()
                tmem_free_bar.arrive()

        if warp_idx // 4 == self.correction_warp_ids[0] // 4:
            # Correction warpgroup: allocates TMEM, rescales O_0 and O_1 per KV tile, normalises
            # and stores them, writes LSE, frees TMEM.
            cute.arch.setmaxregister_decrease(self.correction_registers)
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            stats_cons = tuple(p.make_consumer() for p in stats_pipes)
            o_cons = tuple(p.make_consumer() for p in o_pipes)
            w = self.work_tile(cute.arch.block_idx(), *work)
            q_tile0, head, kv_head, batch = w[:4]
            offset_q, seqlen_q, offset_k, seqlen_k = w[4:8]
            kv_tile_lo, kv_tile_hi = w[8:]
            tile_mO, tile_mLSE, _, _, _, gO, cO = self.gmem_tiles(
                mQ, mK, mV, mO, mLSE, head, kv_head, batch, offset_q, offset_k
            )
            stats_cons, o_cons = self.correction(
                tidx % correction_threads,  # this thread's row, in both Q tiles
                tmem_ptr,
                tOtO_layout,
                pv_thr,
                gO,
                cO,
                sStats,
                stats_cons,
                o_cons,
                tile_mO,
                tile_mLSE,
                q_tile0,
                kv_tile_lo,
                kv_tile_hi,
                seqlen_q,
                scale_log2,
            )

            # Every softmax and correction warp is done with TMEM before warp 8 frees it: each
            # orders its tcgen05 loads and stores before the barrier (fence::before_thread_sync);
            # the MMA warp's last MMAs completed before the O commits waited for.
            tmem.relinquish_alloc_permit()
            fence_before_thread_sync()
            tmem_free_bar.arrive_and_wait()
            tmem.free(tmem_ptr)

    @cute.jit
    def load(self, atoms, tiles, q_prod, kv_prod, q_tile0, kv_tile_lo, kv_tile_hi):
        """The TMA warp, for the work tile: Q_0 and Q_1 once, then the K and V tiles of its
        range, each tile its own ring entry. atoms = (TMA atoms, MMA slices), tiles = (global
        tiles, shared buffers)."""
        tma_q, tma_k, tma_v, qk_thr, pv_thr = atoms
        gQ, gK, gV, sQ, sK, sV = tiles
        # (MMA, MMA_M, MMA_K, Q tiles)
        tCgQ = qk_thr.partition_A(gQ)
        # (MMA, MMA_N, MMA_K, kv_tiles)
        tCgK = qk_thr.partition_B(gK)
        # (MMA, MMA_N, MMA_K, kv_tiles)
        tCgV = pv_thr.partition_B(gV)
        # TMA views, one CTA, no multicast: (TMA, q_buffers) and (TMA, Q tiles); (TMA, kv_slots)
        # and (TMA, kv_tiles)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3), cute.group_modes(tCgQ, 0, 3)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3), cute.group_modes(tCgK, 0, 3)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3), cute.group_modes(tCgV, 0, 3)
        )
        q_load, k_load, v_load = (tma_q, tQgQ, tQsQ), (tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV)
        tma_q, tQgQ, tQsQ = q_load
        for s in cutlass.range_constexpr(self.q_tiles):
            q_empty = q_prod.acquire_and_advance()
            cute.copy(
                tma_q,
                tQgQ[(None, q_tile0 + s)],
                tQsQ[(None, q_empty.index)],
                tma_bar_ptr=q_empty.barrier,
            )
        kv_loads = {"K": k_load, "V": v_load}
        for sweep in cutlass.range_constexpr(len(self.kv_producer_entries)):
            for kv_tile in cutlass.range(kv_tile_lo, kv_tile_hi, unroll=1):
                for name in self.kv_producer_entries[sweep]:
                    tma, src, dst = kv_loads[name]
                    # The next slot, once the MMAs that read its previous tile have completed;
                    # its full barrier expects exactly this tile's bytes.
                    kv_empty = kv_prod.acquire_and_advance(expected_tx=self.kv_tma_bytes[name])
                    cute.copy(
                        tma,
                        src[(None, kv_tile)],
                        dst[(None, kv_empty.index)],
                        tma_bar_ptr=kv_empty.barrier,
                    )
        return q_prod, kv_prod

    @cute.jit
    def mma(
        self,
        qk_mma,
        pv_mma,
        sQ,
        sK,
        sV,
        tmem,
        tStS_layout,
        tOtO_layout,
        p_tmem_s,
        q_cons,
        kv_cons,
        s_pipes,
        p_pipes,
        o_pipes,
        work,
        mCuSeqlensK,
    ):
        """The MMA warp; one thread issues, per KV tile j: S_0,j = Q_0 K_j^T and S_1,j = Q_1 K_j^T,
        then O_0 += P_0,j V_j and O_1 += P_1,j V_j."""
        # MMA operands, as shared-memory descriptors (made here, where they are used).
        # (MMA, MMA_M, MMA_K, q_buffers)
        tCrQ = qk_mma.make_fragment_A(sQ)
        # (MMA, MMA_N, MMA_K, kv_slots)
        tCrK = qk_mma.make_fragment_B(sK)
        # (MMA, MMA_N=D, MMA_K, kv_slots)
        tCrV = pv_mma.make_fragment_B(sV)
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
        tStS = [cute.make_tensor(tmem_ptr + c, tStS_layout) for c in self.tmem_s_offset]
        tOtO = [cute.make_tensor(tmem_ptr + c, tOtO_layout) for c in self.tmem_o_offset]
        # (MMA, MMA_M, MMA_K): P_s as 16-bit values in TMEM, over S_s's columns
        tOrP_layout = pv_mma.make_fragment_A(cute.make_tensor(tmem_ptr, p_tmem_s.outer))[
            (None, None, None, 0)
        ].layout
        tOrP = [
            cute.make_tensor(cute.recast_ptr(tmem_ptr + c, dtype=self.dtype), tOrP_layout)
            for c in self.tmem_p_offset
        ]
        # One variable per Q tile and hand-off: the DSL carries a pipeline's state (slot
        # index, phase) through a loop only for a name it sees the loop call methods on.
        s_prod0, s_prod1 = (p.make_producer() for p in s_pipes)
        p_cons0, p_cons1 = (p.make_consumer() for p in p_pipes)
        o_prod0, o_prod1 = (p.make_producer() for p in o_pipes)
        # Waits, like the softmax warps, until P_s,j-1 @ V_j-1 has completed
        p_free0, p_free1 = (p.make_producer() for p in p_pipes)
        pipes = (q_cons, kv_cons, s_prod0, s_prod1, p_cons0, p_cons1)
        pipes += (o_prod0, o_prod1, p_free0, p_free1)
        seqlen_k, kv_tile_lo, kv_tile_hi = self.work_tile(cute.arch.block_idx(), *work)[7:]
        operands = (tCrQ, tCrK, tCrV, sV, tStS, tOtO, tOrP)
        qk_mma, pv_mma, pipes = self.mma_tile(
            qk_mma, pv_mma, operands, pipes, kv_tile_lo, kv_tile_hi, seqlen_k, mCuSeqlensK
        )

    @cute.jit
    def mma_tile(
        self, qk_mma, pv_mma, operands, pipes, kv_tile_lo, kv_tile_hi, seqlen_k, mCuSeqlensK
    ):
        """One work tile's MMAs, with the pipeline states they advance returned."""
        tCrQ, tCrK, tCrV, sV, tStS, tOtO, tOrP = operands
        q_cons, kv_cons, s_prod0, s_prod1, p_cons0, p_cons1 = pipes[:6]
        o_prod0, o_prod1, p_free0, p_free1 = pipes[6:]
        q_full0 = q_cons.wait_and_advance()
        q_full1 = q_cons.wait_and_advance()
        for kv_tile in cutlass.range(kv_tile_lo, kv_tile_hi, unroll=1):
            kv_full = kv_cons.wait_and_advance()  # ring entry: K_j
            # Q tile 0, then Q tile 1: softmax warpgroup s has read S_s,j-1, and S_s,j may
            # overwrite P_s,j-1 once P_s,j-1 @ V_j-1 has completed (two tcgen05.mma are kept
            # in issue order only when they share accumulator and shape; QK writes S, PV O).
            s_empty0 = s_prod0.acquire_and_advance()
            p_free0.acquire_and_advance()
            qk_mma = self.issue_qk(qk_mma, tStS[0], tCrQ, q_full0.index, tCrK, kv_full.index)
            # tcgen05.commit: S_0 is full once these MMAs have completed
            s_empty0.commit()
            s_empty1 = s_prod1.acquire_and_advance()
            p_free1.acquire_and_advance()
            qk_mma = self.issue_qk(qk_mma, tStS[1], tCrQ, q_full1.index, tCrK, kv_full.index)
            s_empty1.commit()
            # The K slot is empty once both tiles' MMAs have read it.
            kv_full.release()
            v_full = kv_cons.wait_and_advance()  # ring entry: V_j
            # Packed sequences: the last tile's keys past seqlen_k are the next sequence's V.
            # P is 0 there, but 0 x NaN = NaN: zero those rows of V before P @ V reads them.
            if cutlass.const_expr(mCuSeqlensK is not None):
                if (kv_tile + 1) * self.qk_mma_tiler[1] > seqlen_k:
                    self.zero_keys(sV, v_full.index, seqlen_k - kv_tile * self.qk_mma_tiler[1])
            # O_s starts afresh with the first KV tile of the range, then accumulates.
            accumulate = kv_tile != kv_tile_lo
            # Q tile 0, then 1: the correction warpgroup is done with O_s (has rescaled it
            # for tile j) and softmax warpgroup s has written P_s,j.
            o_empty0 = o_prod0.acquire_and_advance()
            p_full0 = p_cons0.wait_and_advance()
            pv_mma = self.issue_pv(pv_mma, tOtO[0], tOrP[0], tCrV, v_full.index, accumulate)
            # P_0's columns are free, and O_0 holds tile j, once these MMAs have completed.
            p_full0.release()
            o_empty0.commit()
            o_empty1 = o_prod1.acquire_and_advance()
            p_full1 = p_cons1.wait_and_advance()
            pv_mma = self.issue_pv(pv_mma, tOtO[1], tOrP[1], tCrV, v_full.index, accumulate)
            p_full1.release()
            o_empty1.commit()
            # The V slot is empty once both tiles' PV MMAs have read it.
            v_full.release()
        # Q stays resident until the last MMA; then its buffers are released too.
        q_full0.release()
        q_full1.release()
        pipes = (q_cons, kv_cons, s_prod0, s_prod1, p_cons0, p_cons1)
        return qk_mma, pv_mma, pipes + (o_prod0, o_prod1, p_free0, p_free1)

    @cute.jit
    def softmax(
        self,
        s: cutlass.Constexpr,
        row: Int32,
        tStS: cute.Tensor,
        tCcS: cute.Tensor,
        s_cons,
        p_prod,
        stats_prod,
        sStats: cute.Tensor,
        q_tile: Int32,
        kv_tile_lo: Int32,
        kv_tile_hi: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
    ):
        """The softmax warps: thread `row` owns that row of S, reads it from TMEM per KV tile,
        writes P over it and hands the row's statistics to correction thread `row`."""
        # Thread t of warp w owns row 32 (w % 4) + t (a warp may only read its own 32 TMEM lanes).
        epi_tiler = ((cute.size(tStS, mode=[0, 0]), self.tmem_load_cols),)
        # ((128, 32), 4): S cut into 4 column slices of 32
        tStS_epi = cute.zipped_divide(tStS, epi_tiler)
        tmem_load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), self.acc_dtype),
            tStS_epi[(None, 0)],
        )
        thr_load = tmem_load.get_slice(row)
        # (T2R, T2R_M, slices): this thread's row of S in TMEM, and its (row, column) coordinates
        tTR_tS = thr_load.partition_S(tStS_epi)
        tTR_cS = thr_load.partition_D(cute.zipped_divide(tCcS, epi_tiler))
        # (T2R, T2R_M, slices): the whole row, 128 fp32 registers
        tTR_rS = cute.make_rmem_tensor(tTR_cS.shape, self.acc_dtype)
        # P over S's columns, as 32-bit TMEM cells holding two 16-bit values: (128, 64)
        p_cells = self.qk_mma_tiler[1] * self.dtype.width // 32
        tStP = cute.make_tensor(
            tStS.iterator,
            cute.composition(
                tStS.layout, cute.make_layout((cute.size(tStS, mode=[0, 0]), p_cells))
            ),
        )
        # tcgen05.st.32x32b.x32: each thread writes 32 cells of its row per store, 2 stores
        tmem_store = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition.x32), self.acc_dtype),
            tStP,
        )
        thr_store = tmem_store.get_slice(row)
        # (R2T, R2T_M, stores): this thread's row of P in TMEM, and the 64 registers it comes from
        tRT_tP = thr_store.partition_D(tStP)
        tRT_rP = cute.make_rmem_tensor(thr_store.partition_S(tStP).shape, self.acc_dtype)
        # The same 64 registers as 128 16-bit values, in S's column order
        tTR_rP = cute.make_tensor(cute.recast_ptr(tRT_rP.iterator, dtype=self.dtype), tTR_rS.layout)

        # One pass: row_max and row_sum run over the KV tiles; O's factor goes to the correction.
        row_max = -Float32.inf
        row_sum = Float32(0.0)
        for kv_tile in cutlass.range(kv_tile_lo, kv_tile_hi, unroll=1):
            s_full = s_cons.wait_and_advance()
            # S complete (tcgen05.commit): order the loads after the wait (common/tmem.py, (d))
            fence_after_thread_sync()
            cute.copy(tmem_load, tTR_tS, tTR_rS)
            # tcgen05.ld is asynchronous: tcgen05.wait::ld before the registers are read.
            cute.arch.fence_view_async_tmem_load()
            # S read: order the loads before the release (common/tmem.py, (a))
            fence_before_thread_sync()
            s_full.release()
            # Only a tile that crosses an edge (Sk, or the band of the window: the diagonal
            # when causal) is masked element by element: S = -inf where row i must not see
            # key j (zeros from TMA beyond Sk among them): weight exp2(-inf) = 0.
            if self.crosses_mask_edge(
                q_tile, kv_tile, seqlen_q, seqlen_k, window_left, window_right
            ):
                self.mask_keys(
                    tTR_rS, tTR_cS, q_tile, kv_tile, seqlen_q, seqlen_k, window_left, window_right
                )
            row_max_new = cute.arch.fmax(
                row_max, tTR_rS.load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            )
            # A row that has seen no key yet (new max -inf) subtracts 0 instead: P = exp2(-inf)
            # = 0 and row_scale = 0 rather than exp2(-inf + inf) = NaN.
            row_max_safe = row_max_new if row_max_new != -Float32.inf else 0.0
            # row_scale = exp(scale * (old max - new max)): what the sum and O so far are multiplied by
            row_scale = cute.math.exp2((row_max - row_max_safe) * scale_log2, fastmath=True)
            # To the correction thread of this row (the slot is free once it has read the last one)
            stats_empty = stats_prod.acquire_and_advance()
            sStats[row, 0, s] = row_scale
            stats_empty.commit()
            # P_j = exp(scale * (S_j - new max))
            row_max_scaled = row_max_safe * scale_log2
            for i in cutlass.range(cute.size(tTR_rS), unroll_full=True):
                tTR_rS[i] = cute.math.exp2(tTR_rS[i] * scale_log2 - row_max_scaled, fastmath=True)
            row_sum = row_sum * row_scale + tTR_rS.load().reduce(
                cute.ReductionOp.ADD, Float32(0.0), 0
            )
            row_max = row_max_new
            tTR_rP.store(tTR_rS.load().to(self.dtype))
            # P_s,j-1 @ V_j-1 has completed: P's columns are free (the MMA warp waited for that
            # too, before it wrote S_s,j there).
            p_empty = p_prod.acquire_and_advance()
            # P's columns free (tcgen05.commit): fence after the wait (common/tmem.py, (d))
            fence_after_thread_sync()
            cute.copy(tmem_store, tRT_rP, tRT_tP)
            # tcgen05.st is asynchronous: tcgen05.wait::st before the MMA warp is told.
            cute.arch.fence_view_async_tmem_store()
            # P written: order the stores before the arrive (common/tmem.py, (b))
            fence_before_thread_sync()
            p_empty.commit()
        # The final row sum and max, for the epilogue (an empty range: 0 and -inf).
        stats_empty = stats_prod.acquire_and_advance()
        sStats[row, 0, s] = row_sum
        sStats[row, 1, s] = row_max
        stats_empty.commit()
        return s_cons, p_prod, stats_prod

    @cute.jit
    def correction(
        self,
        row,
        tmem_ptr,
        tOtO_layout,
        pv_thr,
        gO,
        cO,
        sStats,
        stats_cons,
        o_cons,
        mO,
        mLSE,
        q_tile0,
        kv_tile_lo,
        kv_tile_hi,
        seqlen_q,
        scale_log2,
    ):
        """The correction warpgroup: thread `row` owns that row of O_0 and O_1; per KV tile it
        rescales its row of O_s by the factor softmax thread `row` of warpgroup s handed over,
        then (epilogue) normalises and stores O_s and writes LSE."""
        # (MMA, MMA_M, MMA_N, Q tiles): O's tiles and their (query, d) coordinates, derived in
        # the branch that uses them (values made before the warps split stay live into every
        # branch: with the MMA warp's, ptxas spilled at the split).
        tCgO, tCcO = (pv_thr.partition_C(t) for t in (gO, cO))
        tOtO = [cute.make_tensor(tmem_ptr + c, tOtO_layout) for c in self.tmem_o_offset]
        # Thread t of warp w owns row 32 (w % 4) + t (a warp may only read its own 32 lanes).
        epi_tiler = ((cute.size(tOtO[0], mode=[0, 0]), self.tmem_load_cols),)
        tmem_load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), self.acc_dtype),
            cute.zipped_divide(tOtO[0], epi_tiler)[(None, 0)],
        )
        tmem_store = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition.x32), self.acc_dtype),
            cute.zipped_divide(tOtO[0], epi_tiler)[(None, 0)],
        )
        thr_load = tmem_load.get_slice(row)
        thr_store = tmem_store.get_slice(row)
        # (T2R, T2R_M, slices): this thread's row of O_s in TMEM, 32 columns per slice
        tTR_tO = [thr_load.partition_S(cute.zipped_divide(t, epi_tiler)) for t in tOtO]
        tRT_tO = [thr_store.partition_D(cute.zipped_divide(t, epi_tiler)) for t in tOtO]
        # (T2R, T2R_M): 32 fp32 registers, and the same values in the input dtype
        # (Its shape is the register side's, from the coordinates: a shape taken from the
        # TMEM partition crashed the compiler of CuTe DSL 4.8.1.)
        row_shape = thr_load.partition_D(
            cute.zipped_divide(tCcO[(None, None, None, 0)], epi_tiler)
        )[(None, None, 0)].shape
        tTR_rAcc = cute.make_rmem_tensor(row_shape, self.acc_dtype)
        tTR_rO = cute.make_rmem_tensor(row_shape, self.dtype)
        stats_cons0, stats_cons1 = stats_cons
        o_cons0, o_cons1 = o_cons

        for kv_tile in cutlass.range(kv_tile_lo, kv_tile_hi, unroll=1):
            # Q tile 0: the row factor of tile j from softmax thread `row`; O_0 holds sum_(i < j)
            # P_0,i V_i (old max): once complete, O_0 *= row_scale, and back to the MMA warp.
            stats_full0 = stats_cons0.wait_and_advance()
            row_scale0 = sStats[row, 0, 0]
            stats_full0.release()
            if kv_tile > kv_tile_lo:
                o_full0 = o_cons0.wait_and_advance()
                self.rescale_o(tmem_load, tmem_store, tTR_tO[0], tRT_tO[0], tTR_rAcc, row_scale0)
                o_full0.release()
            # Q tile 1, the same
            stats_full1 = stats_cons1.wait_and_advance()
            row_scale1 = sStats[row, 0, 1]
            stats_full1.release()
            if kv_tile > kv_tile_lo:
                o_full1 = o_cons1.wait_and_advance()
                self.rescale_o(tmem_load, tmem_store, tTR_tO[1], tRT_tO[1], tTR_rAcc, row_scale1)
                o_full1.release()

        # After the last KV tile, per Q tile: the row sum and max, then the epilogue; (T2R,
        # T2R_M, slices): this thread's row of O_s in global memory, and its coordinates in O
        for s in cutlass.range_constexpr(self.q_tiles):
            stats_cons = stats_cons0 if s == 0 else stats_cons1
            o_cons = o_cons0 if s == 0 else o_cons1
            stats_full = stats_cons.wait_and_advance()
            row_sum = sStats[row, 0, s]
            row_max = sStats[row, 1, s]
            stats_full.release()
            tTR_gO, tTR_cO = (
                thr_load.partition_D(
                    cute.zipped_divide(t[(None, None, None, q_tile0 + s)], epi_tiler)
                )
                for t in (tCgO, tCcO)
            )
            self.epilogue(
                tmem_load,
                tTR_tO[s],
                tTR_rAcc,
                tTR_rO,
                tTR_gO,
                tTR_cO,
                row_sum,
                row_max,
                o_cons,
                mO,
                mLSE,
                kv_tile_lo,
                kv_tile_hi,
                seqlen_q,
                scale_log2,
            )
        return (stats_cons0, stats_cons1), (o_cons0, o_cons1)

    @cute.jit
    def epilogue(
        self,
        tmem_load,
        tTR_tO,
        tTR_rAcc,
        tTR_rO,
        tTR_gO,
        tTR_cO,
        row_sum,
        row_max,
        o_cons,
        mO,
        mLSE,
        kv_tile_lo,
        kv_tile_hi,
        seqlen_q,
        scale_log2,
    ):
        """Correction warps, after the last KV tile: TMEM -> registers (tcgen05.ld) -> O / row_sum
        -> O in global memory; LSE."""
        # The rows inside the sequence: (G heads, seqlen_q positions) when packed (each
        # element's coordinate in O is then ((g, position), d)).
        q_rows = seqlen_q if cutlass.const_expr(self.pack_gqa == 1) else (self.pack_gqa, seqlen_q)
        # A row that saw no key (row_sum = 0) keeps O = 0.
        inv_row_sum = cute.arch.rcp_approx(row_sum) if row_sum > 0.0 else 0.0
        # O complete after the last PV MMAs (an empty range: no MMA, nothing to wait for)
        o_full = o_cons.current_handle()
        if kv_tile_hi > kv_tile_lo:
            o_cons.wait()
        # O complete (tcgen05.commit): order the loads after the wait (common/tmem.py, (d))
        fence_after_thread_sync()
        for i in cutlass.range_constexpr(cute.size(tTR_tO, mode=[2])):
            if kv_tile_hi > kv_tile_lo:
                cute.copy(tmem_load, tTR_tO[(None, None, i)], tTR_rAcc)
                cute.arch.fence_view_async_tmem_load()
            else:
                # An empty range: no MMA has written O's columns, O = 0.
                tTR_rAcc.fill(0.0)
            # O = (sum_j P_j @ V_j) / row_sum, in the input dtype
            tTR_rO.store((inv_row_sum * tTR_rAcc.load()).to(self.dtype))
            self.store_row(
                tTR_rO,
                tTR_gO[(None, None, i)],
                tTR_cO[(None, None, i)],
                (q_rows, mO.shape[1]),
            )
        # LSE = log(sum_j exp(scale * S_j)) = scale * row_max + log(row_sum), natural log, fp32,
        # for this thread's row (query) if it lies inside the sequence
        row = tTR_cO[0][0]  # packed: (g, position)
        if cute.elem_less(row, q_rows):
            lse_log2 = row_max * scale_log2 + cute.math.log2(row_sum, fastmath=True)
            # A row that saw no key: LSE = log(0) = -inf.
            if row_sum == 0.0:
                lse_log2 = -Float32.inf
            mLSE[(row,)] = lse_log2 * math.log(2.0)
        # O read: order the loads before the release (common/tmem.py, as (a))
        fence_before_thread_sync()
        if kv_tile_hi > kv_tile_lo:
            o_full.release()
            o_cons.advance()

    @cute.jit
    def make_pipelines(self, storage, cluster_layout_vmnk):
        """The CTA's hand-offs: the mbarrier pipelines over the barriers in `storage` (initialised
        here; pipeline_init_arrive and pipeline_init_wait follow in the kernel) and the named
        barriers."""
        softmax_threads = 32 * len(self.softmax_warp_ids[0])  # 128: one per row of a Q tile
        correction_threads = 32 * len(self.correction_warp_ids)
        # Q buffers (Q_0, Q_1) and K/V ring: the TMA warp fills (full = the tile's bytes
        # landed), the MMA warp's tcgen05.commit empties (one arrive).
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
        # Per Q tile s, four hand-offs of one entry each (two mbarriers apiece):
        # S_s, MMA -> softmax warpgroup s: tcgen05.commit marks S_s complete; its 128 threads
        #   arrive once they have read it.
        # P_s, softmax warpgroup s -> MMA: 128 arrivals once P_s is in TMEM; tcgen05.commit after
        #   the PV MMAs marks P_s's columns free again.
        # O_s, MMA -> correction: tcgen05.commit after P_s @ V_j (O_s holds tile j); the 128
        #   correction threads arrive once they have rescaled (or, last, read) it.
        # stats_s, softmax warpgroup s -> correction, through shared memory: per KV tile the row
        #   factor exp(scale (m_old - m_new)) = exp2(scale_log2 (m_old - m_new)), after the loop
        #   the row sum and max; 128 arrivals each way.
        s_pipes, p_pipes, o_pipes, stats_pipes = [], [], [], []
        for s in cutlass.range_constexpr(self.q_tiles):
            s_pipes.append(
                pipeline.PipelineUmmaAsync.create(
                    barrier_storage=storage.s_bar.data_ptr() + 2 * s,
                    num_stages=self.s_buffers,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                    consumer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, softmax_threads
                    ),
                    cta_layout_vmnk=cluster_layout_vmnk,
                    defer_sync=True,
                )
            )
            p_pipes.append(
                pipeline.PipelineAsyncUmma.create(
                    barrier_storage=storage.p_bar.data_ptr() + 2 * s,
                    num_stages=1,
                    producer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, softmax_threads
                    ),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                    cta_layout_vmnk=cluster_layout_vmnk,
                    defer_sync=True,
                )
            )
            o_pipes.append(
                pipeline.PipelineUmmaAsync.create(
                    barrier_storage=storage.o_bar.data_ptr() + 2 * s,
                    num_stages=1,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                    consumer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, correction_threads
                    ),
                    cta_layout_vmnk=cluster_layout_vmnk,
                    defer_sync=True,
                )
            )
            stats_pipes.append(
                pipeline.PipelineAsync.create(
                    barrier_storage=storage.stats_bar.data_ptr() + 2 * s,
                    num_stages=1,
                    producer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, softmax_threads
                    ),
                    consumer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, correction_threads
                    ),
                    defer_sync=True,
                )
            )
        tmem_alloc_bar = pipeline.NamedBarrier(
            barrier_id=self.tmem_alloc_bar_id,
            num_threads=32
            * (1 + 2 * len(self.softmax_warp_ids[0]) + len(self.correction_warp_ids)),
        )
        tmem_free_bar = pipeline.NamedBarrier(
            barrier_id=self.tmem_free_bar_id,
            num_threads=32 * (2 * len(self.softmax_warp_ids[0]) + len(self.correction_warp_ids)),
        )
        return (
            (q_prod, q_cons),
            (kv_prod, kv_cons),
            (s_pipes, p_pipes, o_pipes, stats_pipes),
            (tmem_alloc_bar, tmem_free_bar),
        )

    @cute.jit
    def smem_tensors(self, storage, q_smem_s, k_smem_s, v_smem_s):
        """The CTA's buffers in shared memory: Q, the K/V ring (as K and as V), row statistics."""
        # (MMA, MMA_M, MMA_K, q_buffers)
        sQ = storage.sQ.get_tensor(q_smem_s.outer, swizzle=q_smem_s.inner)
        # (MMA, MMA_N, MMA_K, kv_slots)
        sK = storage.sK.get_tensor(k_smem_s.outer, swizzle=k_smem_s.inner)
        # (MMA, MMA_N=D, MMA_K, kv_slots): the same slots viewed as V tiles (V's own swizzle)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, v_smem_s.inner), v_smem_s.outer)
        # (128 rows, 2 values, q_tiles): the row statistics softmax warpgroup s hands to the
        # correction warpgroup: the KV tile's row factor, or the final row sum and row max.
        sStats = storage.stats.get_tensor(cute.make_layout((128, 2, self.q_tiles)))
        return sQ, sK, sV, sStats

    @cute.jit
    def gmem_tiles(self, mQ, mK, mV, mO, mLSE, head, kv_head, batch, offset_q, offset_k):
        """The work tile's (head, sequence) of the tensors in global memory, O and LSE, and their
        tiles: (mO, mLSE, gQ, gK, gV, gO, cO)."""
        # This CTA's sequence and head, from the sequence's first row: Q (Sq, D), K (Sk, D),
        # V (D, Sk), O (Sq, D) and LSE (Sq); K and V of head kv_head.
        # (Packed, a row is (g, position): the sequence starts at (0, offset_q).)
        q_offset = offset_q if cutlass.const_expr(self.pack_gqa == 1) else (0, offset_q)
        mQ, mK, mV, mO = (
            cute.domain_offset((q_offset, 0), mQ[(None, None, (head, batch))]),
            cute.domain_offset((offset_k, 0), mK[(None, None, (kv_head, batch))]),
            cute.domain_offset((0, offset_k), mV[(None, None, (kv_head, batch))]),
            cute.domain_offset((q_offset, 0), mO[(None, None, (head, batch))]),
        )
        mLSE = cute.domain_offset((q_offset,), mLSE[(None, (head, batch))])
        # (bM, D, Q tiles)
        gQ = cute.local_tile(mQ, self.qk_mma_tiler, (None, 0, 0), proj=(1, None, 1))
        # (bN, D, kv_tiles)
        gK = cute.local_tile(mK, self.qk_mma_tiler, (0, None, 0), proj=(None, 1, 1))
        # (D, bN, kv_tiles)
        gV = cute.local_tile(mV, self.pv_mma_tiler, (0, 0, None), proj=(None, 1, 1))
        # (bM, D, Q tiles): O's tiles, and the (query, d) coordinates of their elements in O
        gO = cute.local_tile(mO, self.pv_mma_tiler, (None, 0, 0), proj=(1, 1, None))
        cO = cute.local_tile(
            cute.make_identity_tensor(mO.shape), self.pv_mma_tiler, (None, 0, 0), proj=(1, 1, None)
        )
        return mO, mLSE, gQ, gK, gV, gO, cO

    @cute.jit
    def issue_qk(self, qk_mma, tStS, tCrQ, q_slot, tCrK, k_slot):
        """S = Q @ K_j^T into TMEM: bK / 16 tcgen05.mma of 128 x 128 x 16, the first overwriting S."""
        # The caller has waited for S's columns (the softmax warps have read S; where P lies over
        # S, the PV MMAs have read P): order these MMAs after the waits (common/tmem.py, (a), (d))
        fence_after_thread_sync()
        # (MMA, MMA_M, MMA_K) and (MMA, MMA_N, MMA_K): the slots' tiles of Q and K_j
        tCrQs, tCrKs = tCrQ[(None, None, None, q_slot)], tCrK[(None, None, None, k_slot)]
        for kb in cutlass.range(cute.size(tCrQ, mode=[2]), unroll=1):
            # S (+)= Q[:, 16 kb : 16 kb + 16] @ K_j[:, 16 kb : 16 kb + 16]^T, kb = 0 overwrites
            qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
            cute.gemm(qk_mma, tStS, tCrQs[(None, None, kb)], tCrKs[(None, None, kb)], tStS)
        # Returned for the caller to rebind: the DSL carries the MMA's ACCUMULATE field through
        # the loop only for a name the loop assigns.
        return qk_mma

    @cute.jit
    def issue_pv(self, pv_mma, tOtO, tOrP, tCrV, v_slot, accumulate):
        """O += P_j @ V_j in TMEM (O = P_j @ V_j when not accumulate): bN / 16 tcgen05.mma of
        128 x D x 16 (bN = 128 keys), A = P from TMEM."""
        # The caller has waited for P (written by the softmax warps) and O (rescaled by the
        # correction warps): order these MMAs after the waits (common/tmem.py, (b), (c))
        fence_after_thread_sync()
        tCrVs = tCrV[(None, None, None, v_slot)]  # (MMA, MMA_N=D, MMA_K): the slot's V_j
        for kb in cutlass.range(cute.size(tOrP, mode=[2]), unroll=1):
            # O (+)= P_j[:, 16 kb : 16 kb + 16] @ V_j[16 kb : 16 kb + 16, :]  (128 x D x 16)
            pv_mma.set(tcgen05.Field.ACCUMULATE, accumulate or kb != 0)
            cute.gemm(pv_mma, tOtO, tOrP[(None, None, kb)], tCrVs[(None, None, kb)], tOtO)
        return pv_mma

    @cute.jit
    def rescale_o(self, tmem_load, tmem_store, tTR_tO, tRT_tO, tTR_rAcc, row_scale):
        """This thread's row of O *= row_scale, in TMEM: tcgen05.ld, multiply, tcgen05.st, 32
        columns at a time; then tcgen05.wait::st, so that the MMA warp, told next, sees it. The
        caller waits for O before and releases it after; the tcgen05 fences are in here."""
        # O complete (tcgen05.commit): order the loads after the caller's wait (common/tmem.py, (d))
        fence_after_thread_sync()
        for i in cutlass.range_constexpr(cute.size(tTR_tO, mode=[2])):
            cute.copy(tmem_load, tTR_tO[(None, None, i)], tTR_rAcc)
            cute.arch.fence_view_async_tmem_load()
            tTR_rAcc.store(row_scale * tTR_rAcc.load())
            cute.copy(tmem_store, tTR_rAcc, tRT_tO[(None, None, i)])
        cute.arch.fence_view_async_tmem_store()
        # O rescaled: order the stores before the caller's release (common/tmem.py, (c))
        fence_before_thread_sync()

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

    @cute.jit
    def seq_info(self, batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK):
        """(offset_q, seqlen_q, offset_k, seqlen_k, batch coordinate) of sequence `batch`, the
        one place every role of the kernel takes them from. Batch mode (no cu_seqlens): the
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
    def work_tile(self, tile, mQ, mK, mCuSeqlensQ, mCuSeqlensK, window_left, window_right):
        """What every role takes from work tile `tile`: (q_tile0, head, kv_head, batch,
        offset_q, seqlen_q, offset_k, seqlen_k, kv_tile_lo, kv_tile_hi); tile = blockIdx. q_tile0
        is the first of the CTA's `self.q_tiles` Q tiles."""
        heads = cute.size(mQ, mode=[2, 0])
        # CTA row block bidx: Q tiles 2 bidx and 2 bidx + 1. Query head `head` reads KV head
        # head // group. (Pack-GQA: mQ has Hkv heads, the group is 1 and `head` is the KV head.)
        bidx, head, batch = tile
        kv_head = head // (heads // cute.size(mK, mode=[2, 0]))
        q_tile0 = bidx * self.q_tiles
        # Where this sequence starts in Q and K, and how long it is (batch mode: 0, Sq, 0, Sk).
        offset_q, seqlen_q, offset_k, seqlen_k, batch = self.seq_info(
            batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK
        )
        # The KV tiles holding a key that some row of the CTA's 256 rows sees: one range for
        # both Q tiles, the one the TMA warp loads, the MMA warp multiplies and every
        # warpgroup folds (empty: no K or V is read, no MMA issued).
        kv_tile_lo, kv_tile_hi = self.kv_tile_range(
            bidx, seqlen_q, seqlen_k, window_left, window_right, self.cta_rows
        )
        return (q_tile0, head, kv_head, batch, offset_q, seqlen_q, offset_k, seqlen_k) + (
            kv_tile_lo,
            kv_tile_hi,
        )

    @cute.jit
    def zero_keys(self, sV, slot, first_key):
        """V = 0 for keys first_key .. bN - 1 of ring slot `slot`, by the 32 lanes of the MMA
        warp, 8 elements (16 bytes) of a key's row of V per lane and step. Then each lane makes
        its stores visible to the async proxy, through which tcgen05.mma reads shared memory
        (fence.proxy.async.shared::cta), and the warp meets (__syncwarp) before its elected
        lane issues the PV MMAs."""
        D, bN = self.pv_mma_tiler[1], self.pv_mma_tiler[2]
        # (D, bN): the slot's (MMA, MMA_N, MMA_K) = ((D, 16), 1, bN / 16) holds (d, key) at
        # index d + D * key
        v_slot = sV[(None, None, None, slot)]
        sV_dk = cute.make_tensor(
            v_slot.iterator,
            cute.composition(v_slot.layout, cute.make_layout((D, bN), stride=(1, D))),
        )
        per_key = D // 8  # 16-byte pieces per key
        for piece in cutlass.range(cute.arch.lane_idx(), (bN - first_key) * per_key, 32, unroll=1):
            key, d = first_key + piece // per_key, (piece % per_key) * 8
            for e in cutlass.range_constexpr(8):
                sV_dk[d + e, key] = self.dtype(0.0)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()

    @cute.jit
    def q_positions(self, q_tile, seqlen_q, bM: cutlass.Constexpr = 128):
        """The first and last query position of row block q_tile (of bM rows: a Q tile, the CTA's
        rows) inside the sequence: rows q_tile * bM .. q_tile * bM + bM - 1, G rows per
        position when packed (G = 1 otherwise)."""
        first_row = q_tile * bM
        last_row = cutlass.min(first_row + bM, seqlen_q * self.pack_gqa) - 1
        return first_row // self.pack_gqa, last_row // self.pack_gqa

    @cute.jit
    def kv_tile_range(
        self, cta, seqlen_q, seqlen_k, window_left, window_right, bM: cutlass.Constexpr
    ):
        """[lo, hi): the KV tiles holding a key that some row of the CTA's bM rows (row block
        `cta`) sees. Row i sees key j when band_lo <= j - i <= band_hi, band_lo = Sk - Sq - left,
        band_hi = Sk - Sq + right. The rows' positions run from first_row to last_row
        (q_positions), so the keys seen run from first_row + band_lo to last_row + band_hi,
        clipped to [0, Sk). (common.masks.kv_tile_range is the same on the host for G = 1.)"""
        bN = self.qk_mma_tiler[1]
        band_lo, band_hi = seqlen_k - seqlen_q - window_left, seqlen_k - seqlen_q + window_right
        first_row, last_row = self.q_positions(cta, seqlen_q, bM)
        first_key = cutlass.max(first_row + band_lo, 0)
        end_key = cutlass.max(cutlass.min(last_row + band_hi + 1, seqlen_k), 0)
        lo = first_key // bN
        hi = cutlass.max((end_key + bN - 1) // bN, lo)
        # A Q tile past the end of its (shorter) sequence sees nothing.
        if first_row >= seqlen_q:
            hi = lo
        return lo, hi

    @cute.jit
    def crosses_mask_edge(self, q_tile, kv_tile, seqlen_q, seqlen_k, window_left, window_right):
        """Whether tile (q_tile, kv_tile) holds a (row, key) pair that must not be seen: a key at
        or beyond Sk, right of the band (j - i > band_hi for the tile's first row) or left of
        it (j - i < band_lo for its last row). Every other tile of the range is seen whole."""
        bM, bN = self.qk_mma_tiler[:2]
        band_lo, band_hi = seqlen_k - seqlen_q - window_left, seqlen_k - seqlen_q + window_right
        first_row, last_row = self.q_positions(q_tile, seqlen_q)
        first_key, last_key = kv_tile * bN, kv_tile * bN + bN - 1
        crosses = last_key >= seqlen_k
        crosses = crosses or last_key - first_row > band_hi
        crosses = crosses or first_key - last_row < band_lo
        return crosses

    @cute.jit
    def mask_keys(
        self, tTR_rS, tTR_cS, q_tile, kv_tile, seqlen_q, seqlen_k, window_left, window_right
    ):
        """S = -inf where this thread's row i of Q tile q_tile must not see key j of KV tile
        kv_tile: j >= Sk, or j - i outside [band_lo, band_hi] (tTR_cS: the (row, key) of each
        element within the tile). The thread owns the row, so the keys it sees are one interval
        of the tile's columns, [keys_first, keys_end). A select per element, not a branch per
        element: the branches took stage 3 to 253 registers against 157
        (ptxas of CUDA 13.0, sm_100a, bf16, 2026-12-01)."""
        bM, bN = self.qk_mma_tiler[:2]
        band_lo, band_hi = seqlen_k - seqlen_q - window_left, seqlen_k - seqlen_q + window_right
        row = (q_tile * bM + tTR_cS[0][0]) // self.pack_gqa  # its position
        keys_first = row + band_lo - kv_tile * bN
        keys_end = cutlass.min(row + band_hi + 1, seqlen_k) - kv_tile * bN
        for i in cutlass.range(cute.size(tTR_rS), unroll_full=True):
            key = tTR_cS[i][1]
            tTR_rS[i] = -Float32.inf if key < keys_first or key >= keys_end else tTR_rS[i]


def compile_args(dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors, shape = (B, H, Sq, Sk, D); options
    causal, window, kv_heads (Hkv, default H), varlen (True: packed sequences, B of them,
    through cu_seqlens) and pack_gqa (None, True, False: as attention's). The host side of
    stages 7-14 is one copy, common/attention_host.py."""
    return attention_host.compile_args(Sm100Kernel, dtype, shape, scale, **options)


def attention(q, k, v, scale=None, causal=False, window=None, return_lse=False, pack_gqa=None):
    """O = softmax(scale * Q @ K^T + mask) @ V for Q (B, H, Sq, D) and K, V (B, Hkv, Sk, D) with
    H % Hkv == 0 (Hkv = 1: MQA): query head h reads KV head h // (H // Hkv), as SDPA's
    enable_gqa. All bf16 or all fp16, D contiguous, D in {64, 128}; scale defaults to
    1/sqrt(D); causal and window as in stage 6 (bottom-right aligned). O (B, H, Sq, D); with
    return_lse also LSE (B, H, Sq) in fp32. A row that sees no key gets O = 0, LSE = -inf.

    pack_gqa: the G = H / Hkv query heads of a KV head share one Q tile (common/pack_gqa.py).
    None (default) packs where a tile would otherwise be mostly empty, Sq short against the
    128-row tile (decode-like shapes: Sq = 1 uses 1 of 128 rows unpacked, G packed); True /
    False force it. The same answer either way (the same arithmetic per row; on this track
    compile-checked only: no Blackwell GPU has run it)."""
    return attention_host.attention(
        Sm100Kernel, q, k, v, scale, causal, window, return_lse, pack_gqa
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
        Sm100Kernel,
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
