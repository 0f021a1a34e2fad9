"""Stage 5 - online softmax (Blackwell, sm_100a). One pass with running max and sum, plus LSE.

Changes from stage 4:
- One pass over the KV tiles (FlashAttention-2 style): stage 4's statistics pass is gone, so K
  is read once. Per KV tile: 2 tile loads (K, V) and 2 tile GEMMs (QK, PV) instead of 3 and 3
  (1/3 fewer of each); the TMA warp produces ("K", "V") per tile in a single sweep.
- row_max and row_sum run over the tiles. When tile j raises a row's max from m_old to m_new,
  everything accumulated so far is relative to m_old and gets multiplied by
  row_scale = exp(scale * (m_old - m_new)) = exp2((m_old - m_new) * scale_log2):
  row_sum in a register, and O in TMEM. P_j = exp(scale * (S_j - m_new)) is not divided.
- O is rescaled in TMEM by the softmax warps: each thread tcgen05.ld's its row of O 32 columns
  at a time (D / 32 = 4 loads at D = 128), multiplies by row_scale and tcgen05.st's it back.
  Ordering: the rescale of O for tile j starts after PV_(j-1) has completed (the same wait that
  frees P's columns) and PV_j starts after the rescale (the MMA warp waits for the P_j
  hand-off, which the softmax warps give after tcgen05.wait::st of both P_j and O).
- Epilogue: O / row_sum as in stage 3, and LSE = scale * row_max + log(row_sum) per row (one
  fp32 per thread: the thread owns the row, and skips the store when the row is at or beyond
  Sq).
- Shared memory and TMEM are unchanged: Q + 2 slots = 96 KiB (D = 128, bf16; 97 KiB with the
  mbarriers and alignment); S at columns
  0-127, P over S at 0-63, O at 128-255 (D = 128) or 128-191; 256 columns.
- Registers (ptxas of CUDA 13.0, sm_100a, 2026-12-01): 163 (bf16) and 192 (fp16), at D = 64
  and D = 128 alike, no spills, one compile for every Sk. Only the KV tile that crosses Sk
  masks its keys (a run-time branch, as in stage 4).

Q (B, H, Sq, D), K and V (B, H, Sk, D) in bf16 or fp16, the layout of torch SDPA (D contiguous);
O (B, H, Sq, D) is written in the input dtype; scale defaults to 1/sqrt(D). With return_lse the
entry also returns LSE = logsumexp(scale * Q K^T) (B, H, Sq) in fp32, natural log.

Shapes: B, H, Sq, Sk >= 1, D in {64, 128}, as on Hopper. One CTA per (128-row Q tile, head,
batch); the last Q tile's rows beyond Sq are read as zeros by TMA and neither O nor LSE is
stored for them. Dynamic layouts: one compile per (dtype, D).

Compile-checked for sm_100a with fake tensors and no GPU (common.tools.ptx.compile_only(5,
"blackwell") sets CuTe DSL's target arch for the compile); never run on Blackwell hardware, so
nothing here is measured. The numerical tests run only where an sm_100 GPU is present.
Measured numbers (Hopper track only): docs/results/README.md.
"""

import math

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
    """The device code is organised by warp role, as in FA4's flash_fwd_sm100.py. `kernel` sets up
    what the roles share (shared memory: smem_tensors; the mbarrier pipelines and named barriers:
    make_pipelines; the TMEM allocator; the CTA's tiles) and each warp then calls its
    role's method: `load` (the TMA warp), `mma` (the MMA warp) and `softmax` (the four softmax
    warps: P and O's rescale per KV tile, then `epilogue`: O normalised and stored, and LSE).
    The methods after them are their helpers."""

    def __init__(self, dtype, head_dim):
        self.dtype = dtype  # element type of Q, K, V and O: cutlass.BFloat16 or cutlass.Float16
        self.acc_dtype = Float32
        # (bM, bN, bK) = (Q rows, K rows, D): one S tile; one tcgen05.mma is 128 x 128 x 16.
        self.qk_mma_tiler = (128, 128, head_dim)
        # (bM, bN, bK) = (Q rows, D, K rows): O += P @ V; one tcgen05.mma is 128 x D x 16.
        self.pv_mma_tiler = (128, head_dim, 128)
        self.cta_group = tcgen05.CtaGroup.ONE  # one CTA per MMA (no 2-CTA pairs)
        self.cluster_shape_mn = (1, 1)
        # Warp roles: 0-3 softmax (and epilogue), 4 MMA, 5 TMA.
        self.softmax_warp_ids = (0, 1, 2, 3)
        self.mma_warp_id = 4
        self.tma_warp_id = 5
        self.threads_per_cta = 32 * len(
            (*self.softmax_warp_ids, self.mma_warp_id, self.tma_warp_id)
        )
        # Named barriers (0 is __syncthreads): the one before TMEM is freed (the softmax warps
        # among themselves), and the TMEM allocation handshake (MMA and softmax warps).
        self.tmem_free_bar_id = 1
        self.tmem_alloc_bar_id = 2
        # Pipeline depths: Q loaded once; a ring of 2 K/V slots; one S tile in TMEM.
        self.q_buffers = 1
        self.kv_slots = 2
        self.s_buffers = 1
        # Ring entries per KV tile, in order, one tuple per sweep over the KV tiles: what the TMA
        # warp loads and what the MMA warp waits for. One pass: K (QK), then V (PV).
        self.kv_producer_entries = (("K", "V"),)
        self.kv_consumer_entries = (("K", "V"),)
        # TMEM columns (32-bit cells; lane = row of the tile): S, P over S, O after S.
        self.tmem_s_offset = 0
        self.tmem_p_offset = 0
        self.tmem_o_offset = self.qk_mma_tiler[1]
        # tcgen05.ld.32x32b.x32: each softmax thread reads 32 fp32 columns of its row per load.
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
        scale_log2: Float32,
        stream,
    ):
        # O's rows start on 16-byte boundaries: each thread stores its row in 16-byte vectors.
        o = rows_of_16_bytes(o)
        # (B, H, S, D) -> (S, D, (H, B)): the two tile modes first, then (h, b) as one batch mode.
        q, k, o = [
            cute.make_tensor(
                t.iterator, cute.group_modes(cute.select(t.layout, mode=[2, 3, 1, 0]), 2, 4)
            )
            for t in (q, k, o)
        ]
        # V -> (D, Sk, (H, B)): the B operand of P @ V is (N, K) = (D, keys), D contiguous (MN-major).
        v = cute.make_tensor(
            v.iterator, cute.group_modes(cute.select(v.layout, mode=[3, 2, 1, 0]), 2, 4)
        )
        # LSE (B, H, Sq) -> (Sq, (H, B))
        lse = cute.make_tensor(
            lse.iterator, cute.group_modes(cute.select(lse.layout, mode=[2, 1, 0]), 1, 3)
        )

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
        # TMEM: S (128 columns) and O (D columns); P lives over S.
        s_tmem_shape = qk_mma.partition_shape_C(self.qk_mma_tiler[:2])
        o_tmem_shape = pv_mma.partition_shape_C(self.pv_mma_tiler[:2])
        self.num_tmem_alloc_cols = get_num_tmem_alloc_cols(
            [qk_mma.make_fragment_C(s_tmem_shape), pv_mma.make_fragment_C(o_tmem_shape)]
        )

        @cute.struct
        class SharedStorage:
            q_bar: cute.struct.MemRange[Int64, self.q_buffers * 2]
            kv_bar: cute.struct.MemRange[Int64, self.kv_slots * 2]
            s_bar: cute.struct.MemRange[Int64, self.s_buffers * 2]
            p_bar: cute.struct.MemRange[Int64, 2]
            o_bar: cute.struct.MemRange[Int64, 2]
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
            scale_log2,
            cluster_layout_vmnk,
            q_smem_s,
            k_smem_s,
            v_smem_s,
            p_tmem_s,
        ).launch(grid=grid, block=[self.threads_per_cta, 1, 1], stream=stream)

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
        scale_log2: Float32,
        cluster_layout_vmnk: cute.Layout,
        q_smem_s: cute.ComposedLayout,
        k_smem_s: cute.ComposedLayout,
        v_smem_s: cute.ComposedLayout,
        p_tmem_s: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        # blockIdx = (Q tile, head, batch)
        bidx, head, batch = cute.arch.block_idx()
        tile_coord = (bidx, None, 0)  # (Q tile, every K tile, the one D tile)
        pv_tile_coord = (bidx, 0, None)  # (Q tile, the one D tile, every KV tile)
        seqlen_k = mK.shape[0]

        # 1. Prepare
        if warp_idx == self.tma_warp_id:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)

        storage = SmemAllocator().allocate(self.shared_storage)
        (
            (q_prod, q_cons),
            (kv_prod, kv_cons),
            (s_pipe, p_pipe, o_pipe),
            (tmem_alloc_bar, tmem_free_bar),
        ) = self.make_pipelines(storage, cluster_layout_vmnk)
        # Softmax warp 0 allocates and frees TMEM: the softmax warps are the last to read it.
        tmem = TmemAllocator(
            storage.tmem_holding.ptr,
            barrier_for_retrieve=tmem_alloc_bar,
            allocator_warp_id=self.softmax_warp_ids[0],
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)

        sQ, sK, sV = self.smem_tensors(storage, q_smem_s, k_smem_s, v_smem_s)

        # This CTA's (b, h): Q (Sq, D), K (Sk, D), V (D, Sk), O (Sq, D) and LSE (Sq).
        mQ, mK, mV, mO = (
            mQ[(None, None, (head, batch))],
            mK[(None, None, (head, batch))],
            mV[(None, None, (head, batch))],
            mO[(None, None, (head, batch))],
        )
        mLSE = mLSE[(None, (head, batch))]
        # (bM, D)
        gQ = cute.local_tile(mQ, self.qk_mma_tiler, tile_coord, proj=(1, None, 1))
        # (bN, D, kv_tiles)
        gK = cute.local_tile(mK, self.qk_mma_tiler, tile_coord, proj=(None, 1, 1))
        # (D, bN, kv_tiles)
        gV = cute.local_tile(mV, self.pv_mma_tiler, pv_tile_coord, proj=(None, 1, 1))
        # (bM, D): O's tile, and the (query, d) coordinates of its elements in O
        gO = cute.local_tile(mO, self.pv_mma_tiler, pv_tile_coord, proj=(1, 1, None))
        cO = cute.local_tile(
            cute.make_identity_tensor(mO.shape), self.pv_mma_tiler, pv_tile_coord, proj=(1, 1, None)
        )
        kv_tiles = cute.size(gK, mode=[2])

        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        # (MMA, MMA_M, MMA_K)
        tCgQ = qk_thr.partition_A(gQ)
        # (MMA, MMA_N, MMA_K, kv_tiles)
        tCgK = qk_thr.partition_B(gK)
        # (MMA, MMA_N, MMA_K, kv_tiles)
        tCgV = pv_thr.partition_B(gV)
        # (MMA, MMA_M, MMA_N)
        tCgO = pv_thr.partition_C(gO)
        tCcO = pv_thr.partition_C(cO)
        # (MMA, MMA_M, MMA_N): the (row, key) coordinates of S's elements within a tile
        tCcS = qk_thr.partition_C(cute.make_identity_tensor(self.qk_mma_tiler[:2]))
        # TMA views, one CTA, no multicast: (TMA, q_buffers) and (TMA); (TMA, kv_slots) and (TMA, kv_tiles)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3), cute.group_modes(tCgQ, 0, 3)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3), cute.group_modes(tCgK, 0, 3)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3), cute.group_modes(tCgV, 0, 3)
        )
        # MMA operands, as shared-memory descriptors. (MMA, MMA_M, MMA_K, q_buffers)
        tCrQ = qk_mma.make_fragment_A(sQ)
        # (MMA, MMA_N, MMA_K, kv_slots)
        tCrK = qk_mma.make_fragment_B(sK)
        # (MMA, MMA_N=D, MMA_K, kv_slots)
        tCrV = pv_mma.make_fragment_B(sV)
        # S and O in TMEM; the base address is known once TMEM is allocated. (MMA, MMA_M, MMA_N)
        tStS_layout = qk_mma.make_fragment_C(qk_thr.partition_shape_C(self.qk_mma_tiler[:2])).layout
        tOtO_layout = pv_mma.make_fragment_C(pv_thr.partition_shape_C(self.pv_mma_tiler[:2])).layout

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        # 2. Main loop by warp role
        if warp_idx == self.tma_warp_id:
            self.load(
                (tma_q, tQgQ, tQsQ),
                (tma_k, tKgK, tKsK),
                (tma_v, tVgV, tVsV),
                q_prod,
                kv_prod,
                kv_tiles,
            )

        if warp_idx == self.mma_warp_id:
            self.mma(
                qk_mma,
                pv_mma,
                tCrQ,
                tCrK,
                tCrV,
                tmem,
                tStS_layout,
                tOtO_layout,
                p_tmem_s,
                q_cons,
                kv_cons,
                s_pipe,
                p_pipe,
                o_pipe,
                kv_tiles,
            )

        if warp_idx < self.mma_warp_id:
            # Softmax warps: warp 0 allocates TMEM, all four run the softmax and the epilogue.
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            self.softmax(
                tidx,  # this thread's row of the Q tile
                cute.make_tensor(tmem_ptr + self.tmem_s_offset, tStS_layout),
                cute.make_tensor(tmem_ptr + self.tmem_o_offset, tOtO_layout),
                tCcS,
                tCgO,
                tCcO,
                s_pipe.make_consumer(),
                p_pipe.make_producer(),
                o_pipe.make_consumer(),
                mO,
                mLSE,
                kv_tiles,
                seqlen_k,
                scale_log2,
            )

            # All four softmax warps are done with TMEM before warp 0 frees it: each orders its
            # tcgen05.ld and tcgen05.st before the barrier (tcgen05.fence::before_thread_sync),
            # then they meet.
            tmem.relinquish_alloc_permit()
            fence_before_thread_sync()
            tmem_free_bar.arrive_and_wait()
            tmem.free(tmem_ptr)

    @cute.jit
    def load(self, q_load, k_load, v_load, q_prod, kv_prod, kv_tiles):
        """The TMA warp: Q once, then every K and V tile, each tile its own ring entry.
        x_load = (TMA atom, the tiles in global memory, the buffers in shared memory)."""
        tma_q, tQgQ, tQsQ = q_load
        q_empty = q_prod.acquire_and_advance()
        cute.copy(tma_q, tQgQ, tQsQ[(None, q_empty.index)], tma_bar_ptr=q_empty.barrier)
        kv_loads = {"K": k_load, "V": v_load}
        for sweep in cutlass.range_constexpr(len(self.kv_producer_entries)):
            for kv_tile in cutlass.range(kv_tiles, unroll=1):
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
        # Every buffer released by the MMA warp before this warp exits.
        kv_prod.tail()
        q_prod.tail()

    @cute.jit
    def mma(
        self,
        qk_mma,
        pv_mma,
        tCrQ,
        tCrK,
        tCrV,
        tmem,
        tStS_layout,
        tOtO_layout,
        p_tmem_s,
        q_cons,
        kv_cons,
        s_pipe,
        p_pipe,
        o_pipe,
        kv_tiles,
    ):
        """The MMA warp; one thread issues, per KV tile j: S_j = Q @ K_j^T, then O += P_j @ V_j."""
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
        tStS = cute.make_tensor(tmem_ptr + self.tmem_s_offset, tStS_layout)
        tOtO = cute.make_tensor(tmem_ptr + self.tmem_o_offset, tOtO_layout)
        # (MMA, MMA_M, MMA_K): P as 16-bit values in TMEM, over S's columns
        tOrP = pv_mma.make_fragment_A(cute.make_tensor(tmem_ptr, p_tmem_s.outer))[
            (None, None, None, 0)
        ]
        tOrP = cute.make_tensor(
            cute.recast_ptr(tmem_ptr + self.tmem_p_offset, dtype=self.dtype), tOrP.layout
        )
        # One variable per hand-off: the DSL carries a pipeline's state (slot index, phase)
        # through a loop only for a name it sees the loop call methods on.
        s_prod = s_pipe.make_producer()
        p_cons = p_pipe.make_consumer()
        o_prod = o_pipe.make_producer()
        # Waits, like the softmax warps, until the PV MMAs of the previous tile (readers of P)
        # have completed
        p_free = p_pipe.make_producer()
        q_full = q_cons.wait_and_advance()
        o_empty = o_prod.acquire_and_advance()
        for kv_tile in cutlass.range(kv_tiles, unroll=1):
            kv_full = kv_cons.wait_and_advance()  # ring entry: K_j
            # The softmax warps have read the previous S: it may be overwritten.
            s_empty = s_prod.acquire_and_advance()
            # S_j overwrites P_(j-1), which sits in S's columns: wait until the PV MMAs of
            # tile j-1 have completed (PTX keeps two tcgen05.mma in issue order only when
            # they share accumulator and shape; QK writes S, PV writes O).
            p_free.acquire_and_advance()
            qk_mma = self.issue_qk(qk_mma, tStS, tCrQ, q_full.index, tCrK, kv_full.index)
            # tcgen05.commit: S is full once these MMAs have completed ...
            s_empty.commit()
            # ... and the K slot is empty once they have read it.
            kv_full.release()
            # the softmax warps have written P_j and rescaled O
            p_full = p_cons.wait_and_advance()
            v_full = kv_cons.wait_and_advance()  # ring entry: V_j
            # O starts afresh with the first KV tile, then accumulates over the KV tiles.
            accumulate = kv_tile != 0
            pv_mma = self.issue_pv(pv_mma, tOtO, tOrP, tCrV, v_full.index, accumulate)
            # P's columns and the V slot are free once these MMAs have completed.
            p_full.release()
            v_full.release()
        # Q stays resident until the last MMA; then its buffer is released too.
        q_full.release()
        # O is complete once every MMA above has completed.
        o_empty.commit()

    @cute.jit
    def softmax(
        self,
        row: Int32,
        tStS: cute.Tensor,
        tOtO: cute.Tensor,
        tCcS: cute.Tensor,
        tCgO: cute.Tensor,
        tCcO: cute.Tensor,
        s_cons,
        p_prod,
        o_cons,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        kv_tiles: Int32,
        seqlen_k: Int32,
        scale_log2: Float32,
    ):
        """The softmax warps: thread `row` owns that row of S, reads it from TMEM per KV tile,
        writes P over it and rescales its row of O; then the epilogue."""
        # Thread t of warp w owns row 32 w + t (a warp may only read its own 32 TMEM lanes).
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
            tStS.iterator + self.tmem_p_offset,
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
        # O, for the rescale and the epilogue. ((128, 32), D / 32): O cut into column slices of 32
        tOtO_epi = cute.zipped_divide(tOtO, epi_tiler)
        # (T2R, T2R_M, slices): this thread's row of O in TMEM and in global memory, and its
        # (query, d) coordinates
        tTR_tO = thr_load.partition_S(tOtO_epi)
        tTR_gO = thr_load.partition_D(cute.zipped_divide(tCgO, epi_tiler))
        tTR_cO = thr_load.partition_D(cute.zipped_divide(tCcO, epi_tiler))
        # (T2R, T2R_M): 32 fp32 registers, and the same values in the input dtype
        tTR_rAcc = cute.make_rmem_tensor(tTR_gO[(None, None, 0)].shape, self.acc_dtype)
        tTR_rO = cute.make_rmem_tensor(tTR_gO[(None, None, 0)].shape, self.dtype)
        # tcgen05.st.32x32b.x32: the rescaled O back into the same 32 columns
        tmem_store_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition.x32), self.acc_dtype),
            tOtO_epi[(None, 0)],
        )
        tRT_tO = tmem_store_o.get_slice(row).partition_D(tOtO_epi)

        # One pass: row_max and row_sum run over the KV tiles; O is rescaled when row_max grows.
        row_max = -Float32.inf
        row_sum = Float32(0.0)
        for kv_tile in cutlass.range(kv_tiles, unroll=1):
            s_full = s_cons.wait_and_advance()
            # S complete (tcgen05.commit): order the loads after the wait (common/tmem.py, (d))
            fence_after_thread_sync()
            cute.copy(tmem_load, tTR_tS, tTR_rS)
            # tcgen05.ld is asynchronous: tcgen05.wait::ld before the registers are read.
            cute.arch.fence_view_async_tmem_load()
            # S read: order the loads before the release (common/tmem.py, (a))
            fence_before_thread_sync()
            s_full.release()
            # Keys at or beyond Sk (zeros from TMA) get S = -inf: weight exp2(-inf) = 0. Only
            # the last KV tile can reach beyond Sk.
            if (kv_tile + 1) * self.qk_mma_tiler[1] > seqlen_k:
                self.mask_keys(tTR_rS, tTR_cS, kv_tile, seqlen_k)
            row_max_new = cute.arch.fmax(
                row_max, tTR_rS.load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            )
            # row_scale = exp(scale * (old max - new max)): what the sum and O so far are multiplied by
            row_scale = cute.math.exp2((row_max - row_max_new) * scale_log2, fastmath=True)
            # P_j = exp(scale * (S_j - new max))
            row_max_scaled = row_max_new * scale_log2
            for i in cutlass.range(cute.size(tTR_rS), unroll_full=True):
                tTR_rS[i] = cute.math.exp2(tTR_rS[i] * scale_log2 - row_max_scaled, fastmath=True)
            row_sum = row_sum * row_scale + tTR_rS.load().reduce(
                cute.ReductionOp.ADD, Float32(0.0), 0
            )
            row_max = row_max_new
            tTR_rP.store(tTR_rS.load().to(self.dtype))
            # The PV MMAs of tile j-1 have completed: P's columns are free, and O holds
            # sum_(i < j) P_i @ V_i, relative to the old max.
            p_empty = p_prod.acquire_and_advance()
            # P's columns free (tcgen05.commit): fence after the wait (common/tmem.py, (d))
            fence_after_thread_sync()
            if kv_tile > 0:
                self.rescale_o(tmem_load, tmem_store_o, tTR_tO, tRT_tO, tTR_rAcc, row_scale)
            cute.copy(tmem_store, tRT_rP, tRT_tP)
            # tcgen05.st is asynchronous: tcgen05.wait::st (P and O) before the MMA warp is told.
            cute.arch.fence_view_async_tmem_store()
            # P and O written: order the stores before the arrive (common/tmem.py, (b), (c))
            fence_before_thread_sync()
            p_empty.commit()

        self.epilogue(
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
            scale_log2,
        )

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
        scale_log2,
    ):
        """The softmax warps, after the last KV tile: TMEM -> registers (tcgen05.ld) -> O / row_sum
        -> O in global memory; LSE."""
        inv_row_sum = cute.arch.rcp_approx(row_sum)
        o_full = o_cons.wait_and_advance()
        # O complete (tcgen05.commit): order the loads after the wait (common/tmem.py, (d))
        fence_after_thread_sync()
        for i in cutlass.range_constexpr(cute.size(tTR_tO, mode=[2])):
            cute.copy(tmem_load, tTR_tO[(None, None, i)], tTR_rAcc)
            cute.arch.fence_view_async_tmem_load()
            # O = (sum_j P_j @ V_j) / row_sum, in the input dtype
            tTR_rO.store((inv_row_sum * tTR_rAcc.load()).to(self.dtype))
            self.store_row(tTR_rO, tTR_gO[(None, None, i)], tTR_cO[(None, None, i)], mO.shape)
        # LSE = log(sum_j exp(scale * S_j)) = scale * row_max + log(row_sum), natural log, fp32,
        # for this thread's row (query) if it lies inside Sq
        row = tTR_cO[0][0]
        if row < mO.shape[0]:
            lse_log2 = row_max * scale_log2 + cute.math.log2(row_sum, fastmath=True)
            mLSE[row] = lse_log2 * math.log(2.0)
        # O read: order the loads before the release (common/tmem.py, as (a))
        fence_before_thread_sync()
        o_full.release()

    @cute.jit
    def make_pipelines(self, storage, cluster_layout_vmnk):
        """The CTA's hand-offs: the mbarrier pipelines over the barriers in `storage` (initialised
        here; pipeline_init_arrive and pipeline_init_wait follow in the kernel) and the named
        barriers."""
        softmax_threads = 32 * len(self.softmax_warp_ids)  # 128: one per row of the Q tile
        # Q buffer and K/V ring: the TMA warp fills (full = the tile's bytes
        # landed), the MMA warp's tcgen05.commit empties (one arrive). Each has barriers and a
        # byte count of its own: a ring entry holds one K or one V tile and arms its bytes.
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
        # Three hand-offs of one entry each (two mbarriers apiece):
        # S, MMA -> softmax warps: tcgen05.commit marks S complete; the 128 softmax threads
        #   arrive once they have read it.
        # P, softmax warps -> MMA: 128 arrivals once P is in TMEM (and O rescaled);
        #   tcgen05.commit after the PV MMAs marks P's columns free again.
        # O, MMA -> epilogue: tcgen05.commit after the last PV MMA.
        s_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.s_bar.data_ptr(),
            num_stages=self.s_buffers,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, softmax_threads),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        p_pipe = pipeline.PipelineAsyncUmma.create(
            barrier_storage=storage.p_bar.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, softmax_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        o_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.o_bar.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, softmax_threads),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        tmem_alloc_bar = pipeline.NamedBarrier(
            barrier_id=self.tmem_alloc_bar_id,
            num_threads=32 * (1 + len(self.softmax_warp_ids)),
        )
        tmem_free_bar = pipeline.NamedBarrier(
            barrier_id=self.tmem_free_bar_id, num_threads=softmax_threads
        )
        return (
            (q_prod, q_cons),
            (kv_prod, kv_cons),
            (s_pipe, p_pipe, o_pipe),
            (tmem_alloc_bar, tmem_free_bar),
        )

    @cute.jit
    def smem_tensors(self, storage, q_smem_s, k_smem_s, v_smem_s):
        """The CTA's buffers in shared memory: Q, the K/V ring (as K and as V)."""
        # (MMA, MMA_M, MMA_K, q_buffers)
        sQ = storage.sQ.get_tensor(q_smem_s.outer, swizzle=q_smem_s.inner)
        # (MMA, MMA_N, MMA_K, kv_slots)
        sK = storage.sK.get_tensor(k_smem_s.outer, swizzle=k_smem_s.inner)
        # (MMA, MMA_N=D, MMA_K, kv_slots): the same slots viewed as V tiles (V's own swizzle)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, v_smem_s.inner), v_smem_s.outer)
        return sQ, sK, sV

    @cute.jit
    def issue_qk(self, qk_mma, tStS, tCrQ, q_slot, tCrK, k_slot):
        """S = Q @ K_j^T into TMEM: bK / 16 tcgen05.mma of 128 x 128 x 16, the first overwriting S."""
        # The caller has waited for S's columns (the softmax warps have read S; where P lies over
        # S, the PV MMAs have read P): order these MMAs after the waits (common/tmem.py, (a), (d))
        fence_after_thread_sync()
        qk_mma.set(tcgen05.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(cute.size(tCrQ, mode=[2])):
            # S += Q[:, 16 kb : 16 kb + 16] @ K_j[:, 16 kb : 16 kb + 16]^T  (128 x 128 x 16)
            cute.gemm(
                qk_mma, tStS, tCrQ[(None, None, kb, q_slot)], tCrK[(None, None, kb, k_slot)], tStS
            )
            qk_mma.set(tcgen05.Field.ACCUMULATE, True)
        # Returned for the caller to rebind: the DSL carries the MMA's ACCUMULATE field through
        # the loop only for a name the loop assigns.
        return qk_mma

    @cute.jit
    def issue_pv(self, pv_mma, tOtO, tOrP, tCrV, v_slot, accumulate):
        """O += P_j @ V_j in TMEM (O = P_j @ V_j when not accumulate): bN / 16 tcgen05.mma of
        128 x D x 16 (bN = 128 keys), A = P from TMEM."""
        # The caller has waited for P (written by the softmax warps) and O (rescaled by the
        # softmax warps too): order these MMAs after the waits (common/tmem.py, (b), (c))
        fence_after_thread_sync()
        pv_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
        for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            # O += P_j[:, 16 kb : 16 kb + 16] @ V_j[16 kb : 16 kb + 16, :]  (128 x D x 16)
            cute.gemm(pv_mma, tOtO, tOrP[(None, None, kb)], tCrV[(None, None, kb, v_slot)], tOtO)
            pv_mma.set(tcgen05.Field.ACCUMULATE, True)
        return pv_mma

    @cute.jit
    def rescale_o(self, tmem_load, tmem_store, tTR_tO, tRT_tO, tTR_rAcc, row_scale):
        """This thread's row of O *= row_scale, in TMEM: tcgen05.ld, multiply, tcgen05.st, 32
        columns at a time. The caller waits for P's columns (and O) before and, after its store
        of P, waits for the stores and tells the MMA warp; the tcgen05 fences are its."""
        for i in cutlass.range_constexpr(cute.size(tTR_tO, mode=[2])):
            cute.copy(tmem_load, tTR_tO[(None, None, i)], tTR_rAcc)
            cute.arch.fence_view_async_tmem_load()
            tTR_rAcc.store(row_scale * tTR_rAcc.load())
            cute.copy(tmem_store, tTR_rAcc, tRT_tO[(None, None, i)])

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
    def mask_keys(self, tTR_rS, tTR_cS, kv_tile, seqlen_k):
        """S = -inf for the keys of KV tile kv_tile at or beyond seqlen_k, in this thread's row
        (tTR_cS: the (row, key) of each element within the tile). A select per element, not a
        branch per element: the branches took stage 3 to 253 registers against 157
        (ptxas of CUDA 13.0, sm_100a, bf16, 2026-12-01)."""
        keys_left = seqlen_k - kv_tile * self.qk_mma_tiler[1]
        for i in cutlass.range(cute.size(tTR_rS), unroll_full=True):
            tTR_rS[i] = -Float32.inf if tTR_cS[i][1] >= keys_left else tTR_rS[i]


def compile_args(dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors, shape = (B, H, Sq, Sk, D)."""
    checks.check_options(options, allowed=())
    B, H, Sq, Sk, D = shape
    q, k, v = (fake_tensor(dtype, (B, H, S, D), dynamic=True) for S in (Sq, Sk, Sk))
    o, lse = (
        fake_tensor(dtype, (B, H, Sq, D), dynamic=True),
        fake_tensor(torch.float32, (B, H, Sq), dynamic=True),
    )
    return Sm100Kernel(cute_dtype(dtype), D), (
        q,
        k,
        v,
        o,
        lse,
        checks.check_scale(scale, D) * math.log2(math.e),
        fake_stream(),
    )


def attention(q, k, v, scale=None, return_lse=False):
    """O = softmax(scale * Q @ K^T) @ V for Q (B, H, Sq, D) and K, V (B, H, Sk, D), any Sk,
    all bf16 or all fp16, D contiguous, D in {64, 128}; scale defaults to 1/sqrt(D). O (B, H, Sq, D)
    in the input dtype; with return_lse, also LSE = logsumexp(scale * Q @ K^T) (B, H, Sq) in fp32,
    natural log."""
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
        cached_compile(Sm100Kernel(cute_dtype(q.dtype), D), *args)(*args)
    return (o, lse) if return_lse else o
