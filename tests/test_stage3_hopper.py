"""Stage 3 (Hopper): O = softmax(scale * Q K^T) V for Sk <= one KV tile, softmax in registers.

- Compile-only tests need no GPU: the sm_90a PTX must hold both wgmma shapes (the second with P
  from registers), the TMA loads, the mbarrier waits, the quad shuffles and one ex2 per score.
- GPU tests (marker gpu_hopper) compare O with an fp64 reference on full and partial KV tiles,
  B * H above the 132 SMs, Sq = 1, tails, both dtypes and D = 64 and 128, and on inputs built to
  stress the softmax: logits of magnitude tens, one key far above the rest (in the last column
  or in the middle), constant rows. Outputs are poisoned with NaN before the launch
  (common.outputs.empty_output), so an element the kernel never writes fails.
- Bad input: every error names the argument. Those that fail before any CUDA call run on CPU
  tensors, so they run in CI too; the others need a CUDA device (any: they fail in the argument
  checks, before a kernel is compiled or launched). The cases common to stages 2-5 are in
  tests/attention_cases.py; this file adds its stage's own limit: an Sk above one tile points
  to stage 4.
"""

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id, needs_cuda, shape_id

from common.tools import inputs, verify
from common.tools.ptx import compile_only
from stages.stage3_softmax import hopper

# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_compiles_for_sm90a(dtype, D):
    report = compile_only(3, "hopper", dtype=dtype, shape=(2, 4, 512, 128, D))
    counts, ptx = report.counts, report.ptx
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    # S = Q K^T: D / 16 m64n128k16 wgmma with both operands in shared memory (two descriptors).
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{ab}.{ab}" in ptx
    # O = P V: 128 / 16 = 8 m64nDk16 wgmma whose A operand is 4 registers of P.
    pv = [
        ln
        for ln in ptx.splitlines()
        if f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}" in ln
    ]
    assert sum("}, {%r" in ln for ln in pv) == 8, report.summary()
    assert counts["wgmma.mma_async"] == D // 16 + 8, report.summary()
    # Q, K and V by TMA, O stored by TMA; consumers wait on mbarriers.
    assert (
        counts["cp.async.bulk.tensor (load)"] >= 3 and counts["cp.async.bulk.tensor (store)"] >= 1
    )
    assert counts["mbarrier.try_wait"] >= 3 and "mbarrier.arrive.expect_tx" in ptx
    # One exp2 per score: 64 per thread (2 rows x 32 columns); max and sum over the quad.
    assert counts["ex2.approx"] == 64, report.summary()
    assert counts["shfl.sync"] >= 8
    # Q + 2 KV slots, 128 x D x 2 bytes each, plus 1 KiB: the mbarriers, padded to the 1 KiB
    # alignment of the swizzled tiles. D = 128: 97 KiB; D = 64: 49 KiB.
    assert report.shared_memory_bytes == 3 * 128 * D * 2 + 1024, report.summary()
    if report.resources and "spill_stores" in report.resources:
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )


# ---------------------------------------------------------------- numerics on the H200


def run(q, k, v, scale=None):
    # A deadlocked pipeline (a barrier phase that never completes) fails instead of hanging.
    return verify.run_with_deadline(
        lambda: hopper.attention(q, k, v, scale), seconds=120, what="stage 3 hopper"
    )


# verify.check_attention holds O to 3x the error of PyTorch's own attention in the input dtype
# against the same fp64 reference (never above 1e-2, never below one rounding of the dtype); its
# docstring derives the bound.


SHAPES = [
    (1, 1, 128, 128, 64),
    (1, 1, 128, 128, 128),
    (2, 3, 200, 77, 128),  # Sq tail (200 = 128 + 72) and a partial KV tile (77 keys, 51 masked)
    (4, 40, 256, 128, 64),  # B * H = 160 (h, b) pairs, 320 CTAs: more than the 132 SMs
    (1, 2, 1, 1, 128),  # one query, one key
    (2, 2, 1000, 128, 64),
    (1, 1, 300, 64, 128),
]


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_attention_matches_fp64_reference(shape, dtype):
    q, k, v = inputs.attention_inputs(*shape, dtype, seed=sum(shape))
    verify.check_attention("O", run(q, k, v), q, k, v)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_large_logits(dtype, D):
    # Q scaled by 10: scale * Q K^T has standard deviation ~10, so |S| reaches 30-50 and
    # exp(S - row_max) spans the whole fp32 range.
    q, k, v = attention_cases.large_logits(
        2, 4, 256, 128, D, dtype, seed=3, logit_scale=10.0, min_abs_logit=30
    )
    verify.check_attention("O", run(q, k, v), q, k, v)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("where", ["last", "middle"])
def test_one_dominant_key(dtype, where):
    Sk = 128
    hot = Sk - 1 if where == "last" else 45
    # The builder asserts that the row max is in column `hot` and that the fp64 reference is V's row `hot`.
    q, k, v = attention_cases.one_dominant_key(2, 2, 256, Sk, 128, dtype, hot=hot, seed=5)
    o = run(q, k, v)
    verify.check_attention("O", o, q, k, v)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_constant_rows(dtype):
    # All keys equal: P = 1 / Sk, O = the mean of V's rows (the builder asserts the fp64 reference is it).
    q, k, v = attention_cases.constant_rows(2, 2, 200, 100, 64, dtype, seed=6)
    o = run(q, k, v)
    verify.check_attention("O", o, q, k, v)


@pytest.mark.gpu_hopper
def test_explicit_scale_and_strided_inputs():
    # Q, K, V as (B, H, S, D) views of (B, S, H, D) tensors (the layout of many models): D
    # contiguous, the other strides arbitrary. And a scale other than 1/sqrt(D).
    B, H, Sq, Sk, D = 2, 3, 192, 96, 128
    q4, k4, v4 = (
        t.transpose(1, 2).contiguous() for t in inputs.attention_inputs(B, H, Sq, Sk, D, seed=7)
    )
    q, k, v = (t.transpose(1, 2) for t in (q4, k4, v4))
    assert not q.is_contiguous()
    verify.check_attention("O", run(q, k, v, scale=0.05), q, k, v, scale=0.05)


@pytest.mark.gpu_hopper
def test_stage_package_dispatches_to_hopper():
    from stages.stage3_softmax import attention

    q, k, v = inputs.attention_inputs(1, 2, 128, 128, 64, seed=8)
    verify.check_attention(
        "O", verify.run_with_deadline(lambda: attention(q, k, v), seconds=120), q, k, v
    )


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_ATTENTION_INPUTS)
def test_rejects_bad_input(case):
    case.check(hopper.attention)


@needs_cuda
def test_rejects_sk_above_one_tile():
    with pytest.raises(ValueError, match=r"Sk = k.shape\[2\] = 129 is larger than 128.*stage 4"):
        hopper.attention(*attention_cases.qkv(Sk=129))
