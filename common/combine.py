"""The combine of split-KV (stage 13 on, both tracks): the splits of one KV range merged by their
LSE weights, FlashDecoding's second kernel.

Split s of a query row saw keys K_s only. With x_j the scaled scores, m_s the split's row max
and p_j = e^{x_j - m_s}, it wrote O_s = sum_{j in K_s} p_j v_j / l_s, normalised by its own row
sum l_s = sum_{j in K_s} p_j, and lse_s = m_s + ln l_s = ln sum_{j in K_s} e^{x_j}. Over all keys
the row sum is sum_j e^{x_j} = sum_s e^{m_s} l_s = sum_s e^{lse_s}, and so

    lse = ln sum_s e^{lse_s},    O = sum_s e^{lse_s - lse} O_s.

The kernel takes lse_max = max_s lse_s first, so that no exponential overflows: lse = lse_max +
ln sum_s e^{lse_s - lse_max}. A split that saw no key has lse_s = -inf: weight e^{-inf} = 0
(its O_s = 0 is never NaN). A row that no split saw (every lse_s = -inf: a window or a causal
cut that leaves it no key) keeps O = 0 and LSE = -inf, as the unsplit kernel gives.

Work: one row (b, h, s) per D / 4 threads, 4 columns each; a CTA of one warp takes 32 / (D / 4)
rows (1 at D = 128, 2 at D = 64), so that a decode step's few rows spread over as many SMs. Each
thread reads the row's num_splits LSEs (the same for the row's threads: one transaction per warp)
and its 4 columns of every O_s: num_splits x (D + 1) x 4 bytes per row, 16 x 129 x 4 = 8 KB for a
decode row cut 16 ways. So little data makes the kernel's time that of its loads' latency: both
loops over the splits are unrolled 16 ways, so that a thread has the loads of up to 16 splits in
flight, not one after another. A decode step at B = 1 (32 rows, 16 splits) took 7.3 us with the
loops rolled and 3.6 us unrolled 8 ways in CTAs of 128 threads (NVIDIA H100 80GB HBM3, 2026-12-05);
under Nsight Compute, caches flushed, 7.6 us that way and 6.1 us as it is now (NVIDIA H100 80GB
HBM3, 2026-12-06; docs/results/README.md, stage 13). It is plain CUDA-core code (no TMA, no tensor
cores): the same kernel compiles for sm_90a and sm_100a."""

import math

import cutlass
import cutlass.cute as cute
import torch

from common.compile import cached_compile_ffi
from common.cute_interop import cute_dtype


class Combine:
    """O (B, H, S, D) in the input dtype and LSE (B, H, S) fp32 from O_partial (splits, B, H, S,
    D) and LSE_partial (splits, B, H, S), both fp32. Every tensor may have any strides (packed
    sequences pass (1, H, total, D) views of (total, H, D)); D is contiguous in O and O_partial."""

    def __init__(self, dtype, head_dim):
        self.dtype = dtype  # cutlass.BFloat16 or cutlass.Float16: O's element type
        self.head_dim = head_dim
        self.columns = 4  # per thread
        self.threads_per_row = head_dim // self.columns  # 32 (D = 128) or 16 (D = 64)
        self.threads = 32  # one warp: a decode step's few rows spread over as many SMs
        self.rows_per_cta = self.threads // self.threads_per_row

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
        row = bidx * self.rows_per_cta + tidx // self.threads_per_row
        col = (tidx % self.threads_per_row) * self.columns
        if row < B * H * S:
            # row = (b H + h) S + s
            s = row % S
            h = (row // S) % H
            b = row // (S * H)
            # lse_max = max_s lse_s (unrolled: 16 loads in flight)
            lse_max = -cutlass.Float32.inf
            for split in cutlass.range(splits, unroll=16):
                lse_max = cutlass.max(lse_max, mLSEp[split, b, h, s])
            out = cute.make_rmem_tensor(self.columns, cutlass.Float32)
            out.fill(0.0)
            lse_row = -cutlass.Float32.inf
            if lse_max != -cutlass.Float32.inf:
                # weight_s = e^{lse_s - lse_max} = 2^{(lse_s - lse_max) log2 e}
                total = cutlass.Float32(0.0)
                for split in cutlass.range(splits, unroll=16):
                    weight = cute.math.exp2(
                        (mLSEp[split, b, h, s] - lse_max) * math.log2(math.e), fastmath=True
                    )
                    total += weight
                    for c in cutlass.range_constexpr(self.columns):
                        out[c] += weight * mOp[split, b, h, s, col + c]
                # O = sum_s weight_s O_s / sum_s weight_s; lse = lse_max + ln sum_s weight_s
                inv_total = 1.0 / total
                for c in cutlass.range_constexpr(self.columns):
                    out[c] = out[c] * inv_total
                lse_row = lse_max + cute.math.log(total, fastmath=True)
            for c in cutlass.range_constexpr(self.columns):
                mO[b, h, s, col + c] = out[c].to(self.dtype)
            if col == 0:
                mLSE[b, h, s] = lse_row


def compiled_combine(o_partial, lse_partial, o, lse):
    """The compiled combine for tensors like these (torch tensors, shapes as Combine's): a
    function of (o_partial, lse_partial, o, lse) that launches on the current stream. Compiled
    once per dtype, D and stride pattern (common/compile.py)."""
    kernel = Combine(cute_dtype(o.dtype), o.shape[3])
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
