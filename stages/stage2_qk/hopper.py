"""Stage 2 - QK^T only (Hopper, sm_90a). S[b, h] = scale * Q[b, h] @ K[b, h]^T.

Changes from stage 1 (the GEMM with A = Q and B = K, batched over (batch, head), and with the
roles of its loops changed):
- The grid is the attention grid: one CTA per (128-row Q tile, head, batch), blockIdx = (Q tile,
  h, b). Every tensor is viewed as (S, D, H, B) - or (Sq, Sk, H, B) for S - so that one rank-4
  TMA descriptor per tensor serves all (head, batch) pairs: a CTA addresses its own matrix with
  the coordinates (row, 0, h, b).
- The reduction dimension is the head dim, D <= 128, so it fits in one tile: bK = D and the CTA
  tile is 128 x 128 x D. Stage 1's loop over reduction tiles (one A tile and one B tile per
  step) becomes a loop over K tiles - from here on a tile of 128 keys - and every step produces a
  complete 128 x 128 tile of S.
- Q is loaded once, by one TMA load announced on its own mbarrier (q_full, waited on phase 0),
  and stays resident in shared memory for all Sk / 128 steps: operand reuse. The pipeline now
  carries only K tiles through kv_slots = 2 slots (the ab_buffers of stage 1).
- Shared memory (D = 128): Q 128 x 128 x 2 B = 32 KiB, kv_slots x (128 x 128 x 2 B) = 2 x 32 KiB,
  S staging 128 x 128 x 4 B = 64 KiB: 160 KiB of tiles (D = 64: 16 + 2 x 16 + 64 = 112 KiB). The
  kernel asks for 1 KiB more: the mbarriers, and sQ starting on a 1,024-byte boundary.
- Each step waits for its wgmmas (`wgmma.wait_group 0`): the whole S tile is needed before it can
  be written out. The K slot is released at once and refilled with the K tile kv_slots ahead.
- The epilogue of stage 1 runs once per step, inside the main loop: S = scale * acc in fp32,
  registers -> shared memory -> TMA store, which clips rows beyond Sq and keys beyond Sk. The
  staging tile is reused by the next step only after TMA has finished reading it.
- Registers: S accumulator 128 x 128 fp32 / 256 threads = 64 per thread (ptxas of
  CUDA 13.0, 2026-12-07: 90 in all).
- Dynamic layouts: the entry marks B, H, S (shapes and strides) dynamic, one compile per (dtype,
  D). A static size-1 mode (B = 1, H = 1, Sq = 1) would be folded away and change the TMA's
  rank; from here on the attention stages keep dynamic layouts.
- Memory-bound by design: S is written in fp32, 4 bytes per score against 2 D FLOPs (256 at
  D = 128); at (B, H, Sq, Sk, D) = (4, 16, 2048, 2048, 128) that is 1.07 GB of S. Stage 3 keeps
  S on chip.

Q and K are (B, H, S, D) like torch SDPA (D contiguous), bf16 or fp16, D = 64 or 128; the scores
S (B, H, Sq, Sk) are written in fp32. Shapes: B, H, Sq, Sk >= 1, D in {64, 128}, Sk % 4 == 0
(TMA writes rows of S that start on 16-byte boundaries). Q and K tiles that stick out of Sq or
Sk are zero-filled by TMA.

Measured speed: docs/results/README.md (why fp32 S halves it: docs/notes/stage2.md).
"""

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
        self.dtype = (
            dtype  # element type of Q and K (and V, O): cutlass.BFloat16 or cutlass.Float16
        )
        self.acc_dtype = cutlass.Float32
        self.cta_tile = (128, 128, head_dim)  # (bM, bN, bK): query rows, keys per K tile, head dim
        self.mma_warpgroups = 2  # warpgroup w computes query rows [64 w, 64 w + 64) of the tile
        self.threads = 128 * self.mma_warpgroups
        self.kv_slots = 2  # K tiles in flight: 2 x 32 KiB (D = 128)
        self.smem_align = 1024  # the 128-byte swizzle repeats every 8 rows of 128 B

    @cute.jit
    def __call__(
        self, q: cute.Tensor, k: cute.Tensor, s: cute.Tensor, scale: cutlass.Float32, stream
    ):
        bM, bN, bK = self.cta_tile
        row_major = LayoutEnum.ROW_MAJOR  # Q, K: D contiguous; S: Sk contiguous
        # (B, H, S, D) -> (S, D, H, B) and (B, H, Sq, Sk) -> (Sq, Sk, H, B): one matrix per (h, b)
        q, k, s = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))
            for t in (q, k, s)
        ]

        # Two m64n128k16 wgmma atoms stacked along M, one per warpgroup.
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            row_major.sm90_mma_major_mode(),
            row_major.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.mma_warpgroups, 1, 1),
            tiler_mn=(64, bN),
        )
        # (bM, bK, 1), 128B-swizzled
        q_smem_layout = sm90_utils.make_smem_layout_a(row_major, self.cta_tile, self.dtype, 1)
        # (bN, bK, kv_slots), 128B-swizzled
        kv_smem_layout = sm90_utils.make_smem_layout_b(
            row_major, self.cta_tile, self.dtype, self.kv_slots
        )
        # (bM, bN, 1), 128B-swizzled
        s_smem_layout = sm90_utils.make_smem_layout_epi(self.acc_dtype, row_major, (bM, bN), 1)

        # TMA descriptors: Q's (bM, bK) box, a (bN, bK) box of K per K tile, S's tile.
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q, cute.select(q_smem_layout, mode=[0, 1]), (bM, bK)
        )
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), k, cute.select(kv_smem_layout, mode=[0, 1]), (bN, bK)
        )
        tma_atom_s, tma_s = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), s, cute.select(s_smem_layout, mode=[0, 1]), (bM, bN)
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
            sS: cute.struct.Align[
                cute.struct.MemRange[self.acc_dtype, cute.cosize(s_smem_layout)], self.smem_align
            ]

        self.shared_storage = SharedStorage
        self.shared_memory_bytes = SharedStorage.size_in_bytes()

        # One CTA per 128-row Q tile of one (head, batch).
        grid = (cute.ceil_div(q.shape[0], bM), q.shape[2], q.shape[3])
        self.kernel(
            qk_mma,
            tma_atom_q,
            tma_q,
            tma_atom_k,
            tma_k,
            tma_atom_s,
            tma_s,
            q_smem_layout,
            kv_smem_layout,
            s_smem_layout,
            scale,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_s: cute.CopyAtom,
        mS: cute.Tensor,
        q_smem_layout: cute.ComposedLayout,
        kv_smem_layout: cute.ComposedLayout,
        s_smem_layout: cute.ComposedLayout,
        scale: cutlass.Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)

        # 1. Prepare
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)

        # blockIdx = (Q tile, head, batch)
        pid_m, head, batch = cute.arch.block_idx()

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # (bM, bK, 1)
        sQ = storage.sQ.get_tensor(q_smem_layout.outer, swizzle=q_smem_layout.inner)
        # (bN, bK, kv_slots)
        sKV = storage.sKV.get_tensor(kv_smem_layout.outer, swizzle=kv_smem_layout.inner)
        # (bM, bN)
        sS = storage.sS.get_tensor(
            cute.select(s_smem_layout.outer, mode=[0, 1]), swizzle=s_smem_layout.inner
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
        # (bM, bN, kv_tiles)
        gS = cute.local_tile(
            mS[None, None, head, batch], self.cta_tile, (pid_m, None, None), proj=(1, 1, None)
        )
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
        # (TMA) and (TMA, kv_tiles)
        tSsS, tSgS = cpasync.tma_partition(
            tma_atom_s,
            0,
            cute.make_layout(1),
            cute.group_modes(sS, 0, 2),
            cute.group_modes(gS, 0, 2),
        )

        # wgmma views of this thread's warpgroup: shared-memory descriptors for Q and K.
        qk_thr = qk_mma.get_slice(warpgroup_idx * 128)
        # (MMA, MMA_M, MMA_K, 1)
        tSrQ = qk_mma.make_fragment_A(qk_thr.partition_A(sQ))
        # (MMA, MMA_N, MMA_K, kv_slots)
        tSrK = qk_mma.make_fragment_B(qk_thr.partition_B(sKV))
        # (MMA, MMA_M, MMA_N): 64 fp32 per thread
        acc_S = cute.make_rmem_tensor(qk_thr.partition_shape_C(self.cta_tile[:2]), self.acc_dtype)
        k_blocks = cute.size(tSrQ, mode=[2])  # bK / 16 wgmma per K tile

        # 2. Main loop
        producer_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.kv_slots
        )
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_slots)

        # Q once, then fill the pipeline: the first kv_slots K tiles are in flight before the
        # first wgmma.
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(q_full, q_bytes)
            cute.copy(tma_atom_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_full)
            for _ in cutlass.range(cutlass.min(self.kv_slots, kv_tiles), unroll=1):
                self.load_tiles(
                    kv_pipeline, producer_state, producer_state.count, tma_atom_k, tKgK, tKsK
                )
                producer_state.advance()

        # Q has landed (the one and only phase of q_full).
        cute.arch.mbarrier_wait(q_full, 0)
        for kv_tile in cutlass.range(kv_tiles, unroll=1):
            # Wait until TMA has written this K tile.
            kv_pipeline.consumer_wait(read_state)

            # S = Q @ K_tile^T: bK / 16 asynchronous m64n128k16 steps, the first overwrites acc_S.
            warpgroup.fence()
            qk_mma.set(warpgroup.Field.ACCUMULATE, False)
            for k_block in cutlass.range_constexpr(k_blocks):
                coord = (None, None, k_block, read_state.index)
                cute.gemm(qk_mma, acc_S, tSrQ[None, None, k_block, 0], tSrK[coord], acc_S)
                qk_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()

            # The whole S tile is needed: wait for all wgmmas. Then the K slot is read: release
            # it, and refill it with K tile kv_tile + kv_slots.
            warpgroup.wait_group(0)
            kv_pipeline.consumer_release(read_state)
            read_state.advance()
            if warp_idx == 0 and producer_state.count < kv_tiles:
                self.load_tiles(
                    kv_pipeline, producer_state, producer_state.count, tma_atom_k, tKgK, tKsK
                )
                producer_state.advance()

            # The S tile leaves as C did in stage 1. TMA has finished reading the previous S tile
            # out of sS once thread 0 has waited for its store and all threads have synced.
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_threads()

            # S = scale * acc_S, kept in fp32, written to shared memory.
            r2s_copy = cute.make_tiled_copy_C(
                sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.acc_dtype, self.acc_dtype),
                qk_mma,
            )
            thr_r2s = r2s_copy.get_slice(tidx)
            # (R2S, R2S_M, R2S_N)
            tRS_acc = r2s_copy.retile(acc_S)
            # (R2S, R2S_M, R2S_N)
            tRS_rS = cute.make_rmem_tensor_like(tRS_acc, self.acc_dtype)
            tRS_rS.store(tRS_acc.load() * scale)
            # (R2S, R2S_M, R2S_N)
            tRS_sS = thr_r2s.partition_D(sS)
            cute.copy(r2s_copy, tRS_rS, tRS_sS)

            # Make these shared-memory writes visible to TMA (the async proxy), then wait for all.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            # The whole tile, clipped to S's bounds by TMA
            if tidx == 0:
                cute.copy(tma_atom_s, tSsS, tSgS[None, kv_tile])
                cute.arch.cp_async_bulk_commit_group()

        # 3. Epilogue
        # The CTA's shared memory must outlive TMA's reads of the last S tile.
        if tidx == 0:
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


def compile_args(dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors, shape = (B, H, Sq, Sk, D)."""
    checks.check_options(options, allowed=())
    B, H, Sq, Sk, D = shape
    q, k = (fake_tensor(dtype, (B, H, S, D), dynamic=True) for S in (Sq, Sk))
    s = fake_tensor(torch.float32, (B, H, Sq, Sk), dynamic=True)
    return Sm90Kernel(cute_dtype(dtype), D), (q, k, s, checks.check_scale(scale, D), fake_stream())


def qk(q, k, scale=None):
    """S = scale * Q @ K^T for Q (B, H, Sq, D) and K (B, H, Sk, D), both bf16 or both fp16, D
    contiguous, D in {64, 128}; scale defaults to 1/sqrt(D). S (B, H, Sq, Sk) in fp32."""
    B, H, Sq, Sk, D = checks.check_attention_args(q, k)
    scale = checks.check_scale(scale, D)
    checks.check_multiple(
        "Sk = k.shape[2]", Sk, 4, "TMA writes rows of S (fp32) that start on 16-byte boundaries"
    )

    with torch.cuda.device(q.device):
        s = empty_output((B, H, Sq, Sk), torch.float32, q.device)
        # Dynamic shapes and strides: one compile per (dtype, D) serves every B, H, Sq, Sk. (A
        # static size-1 mode, B = 1 say, would be folded away and change the rank of the TMA.)
        args = [to_cute(t, dynamic=True) for t in (q, k, s)] + [
            scale,
            current_stream(),
        ]
        cached_compile(Sm90Kernel(cute_dtype(q.dtype), D), *args)(*args)
    return s
