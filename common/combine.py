"""The combine of split-KV (stage 13 on, both tracks): the splits of one KV range merged by their
LSE weights, FlashDecoding's second kernel.

Split s of a query row saw keys K_s only. With x_j the scaled scores, m_s the split's row max
and p_j = e^{x_j - m_s}, it wrote O_s = sum_{j in K_s} p_j v_j / l_s, normalised by its own row
sum l_s = sum_{j in K_s} p_j, and lse_s = m_s + ln l_s = ln sum_{j in K_s} e^{x_j}. Over all keys
the row sum is sum_j e^{x_j} = sum_s e^{m_s} l_s = sum_s e^{lse_s}, and so

    lse = ln sum_s e^{lse_s},    O = sum_s e^{lse_s - lse} O_s.

The kernel takes m = max_s lse_s first, so that no exponential overflows: lse = m +
ln sum_s e^{lse_s - m}. A split that saw no key has lse_s = -inf: weight e^{-inf} = 0
(its O_s = 0 is never NaN). A row that no split saw (every lse_s = -inf: a window or a causal
cut that leaves it no key) keeps O = 0 and LSE = -inf, as the unsplit kernel gives.

Work: a row (b, h, s) reads num_splits x (D + 1) x 4 bytes, about 8 KiB (16 x 129 x 4) for a decode
row cut 16 ways. So little data makes the kernel's time that of its loads' latency, and the
kernel is laid out to wait for global memory once: a row takes D / 4 x lanes threads, 4 columns
of O_s each, lane i (a group of D / 4 threads) reading splits i, i + lanes, ... (lanes: the split
count rounded up to a power of two, at least 2 and at most 256 / (D / 4); a CTA of 256 threads
takes 256 / (D / 4 x lanes) rows, whole warps each). A thread holds 8 splits' loads at once, so
one wait covers up to 8 x lanes splits: 64 at D = 128, 128 at D = 64; a count forced above that
takes one more round of loads, and one more wait, per 8 x lanes splits.

  1. The loads, all issued before the first barrier: thread t of the row loads lse_t into
     shared memory (t < num_splits; a row has at least num_splits threads for num_splits up
     to 256), and each thread the 4 columns of its first 8 splits' O_s (16-byte loads).
  2. After that barrier, each warp of the row reduces the row's LSEs from shared memory itself
     (shuffles): m = max_s lse_s and l = sum_s e^{lse_s - m}, no exponential overflowing.
  3. Each thread sums e^{lse_s - m} O_s over its splits and writes its sum to shared memory.
  4. After a second barrier the D / 4 threads of lane 0 add the lanes' sums: O = sum / l, and
     LSE = m + ln l. A row that no split saw (m = -inf) skips the sum of 2 and the loop of 3
     (its shares are 0), and lane 0 writes O = 0 and LSE = -inf.

In the last CTA, threads whose row lies past B x H x S load and store nothing but meet both
barriers. A decode step at B = 1, 8k keys (32 rows, 16 splits) took 2.5 us of GPU time this way,
against 3.3 us in CTAs of one warp with the loops over the splits unrolled 16 ways and 2.8 us for
cuDNN's reduction (torch.profiler; NVIDIA H100 80GB HBM3, 2026-12-06;
docs/results/decode_kernels_h100_2026-12-06.txt). It is plain CUDA-core code (no TMA, no tensor
cores): the same kernel compiles for sm_90a and sm_100a."""

import math

import cutlass
import cutlass.cute as cute
import torch
from cutlass.utils import SmemAllocator

from common.compile import cached_compile_ffi
from common.cute_interop import cute_dtype, rows_of_16_bytes


class Combine:
    """O (B, H, S, D) in the input dtype and LSE (B, H, S) fp32 from O_partial (splits, B, H, S,
    D) and LSE_partial (splits, B, H, S), both fp32. Every tensor may have any strides (packed
    sequences pass (1, H, total, D) views of (total, H, D)), but D is contiguous in O and
    O_partial and their other strides are multiples of 16 bytes (kernel: rows_of_16_bytes).
    `lanes`: how many groups of D / 4 threads a row has, lane i reading splits i, i + lanes, ...
    (a power of two, 2 ... 256 / (D / 4): lanes_for)."""

    def __init__(self, dtype, head_dim, lanes):
        self.dtype = dtype  # cutlass.BFloat16 or cutlass.Float16: O's element type
        self.head_dim = head_dim
        self.columns = 4  # per thread: one 16-byte load of O_s
        self.threads_per_split = head_dim // self.columns  # 32 (D = 128) or 16 (D = 64)
        self.threads = 256
        self.lanes = lanes
        self.row_threads = self.threads_per_split * lanes  # at least 32: no warp spans two rows
        self.rows_per_cta = self.threads // self.row_threads
        self.max_splits = 256  # attention_host's bound on num_splits
        self.loads_in_flight = 8  # O_s loads a thread issues before it waits for any
        assert self.row_threads >= 32 and self.rows_per_cta >= 1, (head_dim, lanes)

    @staticmethod
    def lanes_for(splits, head_dim):
        """The lanes of a combine of `splits` splits: the power of two at or above it, at most
        256 / (D / 4) (8 at D = 128, 16 at D = 64), at least 2."""
        lanes = 2
        while lanes < splits and lanes < 256 // (head_dim // 4):
            lanes *= 2
        return lanes

    @cute.jit
    def __call__(
        self,
        o_partial: cute.Tensor,
        lse_partial: cute.Tensor,
        o: cute.Tensor,
        lse: cute.Tensor,
        stream,
    ):
        rows = o.shape[0] * o.shape[1] * o.shape[2]
        grid = (cute.ceil_div(rows, self.rows_per_cta), 1, 1)
        self.kernel(o_partial, lse_partial, o, lse).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        B, H, S = mO.shape[0], mO.shape[1], mO.shape[2]
        splits = mOp.shape[0]
        log2_e = math.log2(math.e)
        # Every stride of O_partial and O but D's is a multiple of 16 bytes (the launch
        # allocates O_partial, check_tensor checks O): a thread's 4 columns are one 16-byte
        # load of O_s and one 8-byte store of O.
        mOp, mO = rows_of_16_bytes(mOp), rows_of_16_bytes(mO)
        # Thread (r, lane, c): row r of the CTA's rows_per_cta, splits lane, lane + lanes, ...,
        # columns [4 c, 4 c + 4).
        r = tidx // self.row_threads
        t = tidx % self.row_threads  # the thread within its row
        lane = t // self.threads_per_split
        col = (t % self.threads_per_split) * self.columns
        row = bidx * self.rows_per_cta + r
        # The last CTA's rows may end before the CTA does: a thread of a row past the end
        # loads and stores nothing (live False) but meets both barriers.
        live = row < B * H * S
        # row = (b H + h) S + s
        s = row % S
        h = (row // S) % H
        b = row // (S * H)

        smem = SmemAllocator()
        # lse_s of the CTA's rows, (max_splits, rows_per_cta); each lane's sum over its splits,
        # (D, lanes, rows_per_cta): 1 KiB and 4 KiB a row at most
        sLSE = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((self.max_splits, self.rows_per_cta)), 16
        )
        sO = smem.allocate_tensor(
            cutlass.Float32,
            cute.make_layout((self.head_dim, self.lanes, self.rows_per_cta)),
            16,
        )

        # 1. The loads, all issued before the first barrier: thread t's lse_t (t < splits: a
        # row has at least as many threads as splits, up to max_splits), and this thread's
        # first loads_in_flight splits' 4 columns of O_s.
        if live and t < splits:
            sLSE[t, r] = mLSEp[t, b, h, s]
        per = self.loads_in_flight
        o_s = cute.make_rmem_tensor((self.columns, per), cutlass.Float32)
        o_s.fill(0.0)
        for i in cutlass.range_constexpr(per):
            split = lane + i * self.lanes
            if live and split < splits:
                o_s[None, i].store(self.o_columns(mOp, split, b, h, s, col).load())
        cute.arch.barrier()

        # 2. m = max_s lse_s and l = sum_s e^{lse_s - m}: each warp of the row reduces the
        # row's LSEs itself (its 32 threads, max_splits / 32 values each), so every warp has m
        # and l without a barrier between 2 and 3. A row past the end reads no LSE (nothing was
        # loaded for it): its m stays -inf, and 3 adds nothing.
        lane32 = tidx % 32
        m = -cutlass.Float32.inf
        for k in cutlass.range_constexpr(self.max_splits // 32):
            if live and k * 32 + lane32 < splits:
                m = cutlass.max(m, sLSE[k * 32 + lane32, r])
        m = cute.arch.warp_reduction_max(m)
        total = cutlass.Float32(0.0)
        if m != -cutlass.Float32.inf:  # else no split saw a key of this row: O = 0, -inf
            for k in cutlass.range_constexpr(self.max_splits // 32):
                if k * 32 + lane32 < splits:
                    total += cute.math.exp2((sLSE[k * 32 + lane32, r] - m) * log2_e, fastmath=True)
        total = cute.arch.warp_reduction_sum(total)

        # 3. This lane's share: sum over its splits of e^{lse_s - m} O_s, lanes x `per` splits a
        # round (the first round's loads were issued in 1; a later round, only for more than
        # lanes x per splits, loads and then waits again).
        acc = cute.make_rmem_tensor(self.columns, cutlass.Float32)
        acc.fill(0.0)
        if m != -cutlass.Float32.inf:
            for first in cutlass.range(0, splits, self.lanes * per, unroll=1):
                if first > 0:
                    for i in cutlass.range_constexpr(per):
                        split = first + lane + i * self.lanes
                        if live and split < splits:
                            o_s[None, i].store(self.o_columns(mOp, split, b, h, s, col).load())
                for i in cutlass.range_constexpr(per):
                    split = first + lane + i * self.lanes
                    if split < splits:
                        weight = cute.math.exp2((sLSE[split, r] - m) * log2_e, fastmath=True)
                        acc.store(acc.load() + weight * o_s[None, i].load())
        cute.local_tile(sO[None, lane, r], (self.columns,), (col // self.columns,)).store(
            acc.load()
        )
        cute.arch.barrier()

        # 4. Lane 0 of the row (its D / 4 threads) sums the lanes' shares: O = sum_s
        # e^{lse_s - m} O_s / l, and LSE = m + ln l; a row no split saw: O = 0, LSE = -inf.
        if live and lane == 0:
            out = cute.make_rmem_tensor(self.columns, cutlass.Float32)
            out.fill(0.0)
            for k in cutlass.range_constexpr(self.lanes):
                part = cute.local_tile(sO[None, k, r], (self.columns,), (col // self.columns,))
                out.store(out.load() + part.load())
            lse_row = -cutlass.Float32.inf
            if m != -cutlass.Float32.inf:
                out.store(out.load() * (1.0 / total))
                lse_row = m + cute.math.log(total, fastmath=True)
            cute.local_tile(mO[b, h, s, None], (self.columns,), (col // self.columns,)).store(
                out.load().to(self.dtype)
            )
            if col == 0:
                mLSE[b, h, s] = lse_row

    @cute.jit
    def o_columns(self, mOp, split, b, h, s, col):
        """This thread's 4 columns of O_s at row (b, h, s): (4,), 16-byte aligned."""
        return cute.local_tile(mOp[split, b, h, s, None], (self.columns,), (col // self.columns,))


def partial_offsets(splits, rows, head_dim):
    """Where a split launch's fp32 buffer holds what, in elements: (O_partial's offset,
    LSE_partial's offset, the total). LSE (rows = B x H x Sq of them) first at offset 0, when the
    call returns none of its own; O_partial (splits, B, H, Sq, D) from the next multiple of 64
    (256 bytes); LSE_partial (splits, B, H, Sq) right behind it. Python ints
    (attention_host.partials_layout) and the DSL's run-time integers (SplitLaunch) alike."""
    o_at = (rows + 63) // 64 * 64
    lse_at = o_at + splits * rows * head_dim
    return o_at, lse_at, lse_at + splits * rows


class SplitLaunch:
    """A split-KV launch as one compiled function: the split kernel (stage 13 on, either track)
    writes the partials into `buffer`, then the combine merges them into O and LSE, on the same
    stream. One host call, not two, and the buffer goes over as one flat fp32 tensor: its views
    (partial_offsets) are made here, at compile time, from O's run-time shape, not by torch at
    every call (host time per call: docs/notes/stage13.md). `lse` None: the call returns no LSE,
    and the combine writes it into the buffer's first rows. `page_table` is None for a kernel
    that takes none (stage 13)."""

    def __init__(self, kernel, combine):
        self.kernel = kernel  # the split kernel object (split_kv=True)
        self.combine = combine  # a Combine
        self.takes_pages = getattr(kernel, "takes_pages", False)

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        o: cute.Tensor,
        lse: cute.Tensor | None,
        buffer: cute.Tensor,
        cu_seqlens_q: cute.Tensor | None,
        cu_seqlens_k: cute.Tensor | None,
        max_seqlen_q: cutlass.Int32,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        tile_counter: cute.Tensor,
        seqused_k: cute.Tensor | None,
        num_splits: cutlass.Int32,
        page_table: cute.Tensor | None,
        stream,
    ):
        B, H, S, D = o.shape
        # Row-major views with 64-bit strides (a forced split count times a long prefill's rows
        # passes 2^31 elements); every offset is a multiple of 64 elements (D is 64 or 128).
        s_stride = cutlass.Int64(S)  # LSE's row (b, h) of S entries
        h_stride = s_stride * H
        rows = h_stride * B
        o_at, lse_at, _ = partial_offsets(num_splits, rows, D)
        at = lambda n: buffer.iterator + cute.assume(n, divby=64)  # noqa: E731
        o_partial = cute.make_tensor(
            at(o_at),
            cute.make_layout(
                (num_splits, B, H, S, D),
                stride=(rows * D, h_stride * D, s_stride * D, D, 1),
            ),
        )
        lse_partial = cute.make_tensor(
            at(lse_at),
            cute.make_layout((num_splits, B, H, S), stride=(rows, h_stride, s_stride, 1)),
        )
        if cutlass.const_expr(lse is None):
            lse = cute.make_tensor(
                at(0), cute.make_layout((B, H, S), stride=(h_stride, s_stride, 1))
            )
        args = (q, k, v, o_partial, lse_partial, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
        args += (scale_log2, window_left, window_right, tile_counter, seqused_k, num_splits)
        if cutlass.const_expr(self.takes_pages):
            args += (page_table,)
        self.kernel(*args, stream)
        self.combine(o_partial, lse_partial, o, lse, stream)


def compiled_combine(o_partial, lse_partial, o, lse):
    """The compiled combine for tensors like these (torch tensors, shapes as Combine's): a
    function of (o_partial, lse_partial, o, lse) that launches on the current stream. Compiled
    once per dtype, D and stride pattern (common/compile.py)."""
    D = o.shape[3]
    kernel = Combine(cute_dtype(o.dtype), D, Combine.lanes_for(o_partial.shape[0], D))
    return cached_compile_ffi(kernel, o_partial, lse_partial, o, lse)


def combine(o_partial, lse_partial, o, lse):
    """Merge the splits into o and lse (torch tensors, shapes as Combine's) on the current
    stream."""
    compiled_combine(o_partial, lse_partial, o, lse)(o_partial, lse_partial, o, lse)


def combine_reference(o_partial, lse_partial):
    """The same merge in fp64 with torch (tests): (O, LSE) from O_partial and LSE_partial."""
    lse_partial = lse_partial.double()
    lse = torch.logsumexp(lse_partial, dim=0)
    weight = torch.exp(lse_partial - lse.unsqueeze(0)).nan_to_num(0.0)
    o = (weight.unsqueeze(-1) * o_partial.double()).sum(0)
    return o, lse
