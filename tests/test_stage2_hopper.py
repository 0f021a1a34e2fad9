"""Stage 2 (Hopper): S = scale * Q K^T in fp32, batched over (batch, head) with rank-4 TMA, Q
resident in shared memory and K tiles streaming through the pipeline.

- Compile-only tests need no GPU: the sm_90a PTX must hold the m64n128k16 wgmma, the TMA loads
  of Q and K and the TMA store of S, the mbarrier waits.
- GPU tests (marker gpu_hopper) compare S with an fp64 reference on full and partial tiles,
  B * H above the 132 SMs, Sq = 1, more K tiles than pipeline slots, both dtypes, D = 64 and 128,
  large logits. Outputs are poisoned with NaN before the launch (common.outputs.empty_output),
  so an element the kernel never writes fails.
- Bad input: every error names the argument. Those that fail before any CUDA call run on CPU
  tensors, so they run in CI too; the others need a CUDA device (any: they fail in the argument
  checks, before a kernel is compiled or launched). The cases common to stages 2-5 are in
  tests/attention_cases.py; this file adds its stage's own limits.
"""

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id, needs_cuda, shape_id

from common.tools import inputs, reference, verify
from common.tools.ptx import compile_only
from stages.stage2_qk import hopper

# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_compiles_for_sm90a(dtype, D):
    report = compile_only(2, "hopper", dtype=dtype, shape=(2, 4, 512, 512, D))
    counts, ptx = report.counts, report.ptx
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    # One K tile: D / 16 m64n128k16 wgmma per warpgroup, both operands from shared memory.
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{ab}.{ab}" in ptx
    assert counts["wgmma.mma_async"] == D // 16, report.summary()
    # Rank-4 TMA: Q and K tiles addressed by (row, 0, head, batch); S stored by TMA.
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in ptx
    assert (
        counts["cp.async.bulk.tensor (load)"] >= 2 and counts["cp.async.bulk.tensor (store)"] >= 1
    )
    assert counts["mbarrier.try_wait"] >= 3 and "mbarrier.arrive.expect_tx" in ptx
    # Q (128 x D) + 2 K slots (128 x D each) x 2 bytes, the fp32 S staging tile (128 x 128 x 4),
    # plus 1 KiB: the mbarriers, padded to the 1 KiB alignment of the swizzled tiles.
    # D = 128: 32 + 64 + 64 + 1 = 161 KiB; D = 64: 16 + 32 + 64 + 1 = 113 KiB.
    assert report.shared_memory_bytes == 3 * 128 * D * 2 + 128 * 128 * 4 + 1024, report.summary()
    if report.resources and "spill_stores" in report.resources:
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )


# ---------------------------------------------------------------- numerics on the H200


def run(q, k, scale=None):
    # A deadlocked pipeline (a barrier phase that never completes) fails instead of hanging.
    return verify.run_with_deadline(
        lambda: hopper.qk(q, k, scale), seconds=120, what="stage 2 hopper"
    )


def check_s(s, q, k, scale=None):
    """S against the fp64 reference. S is written in fp32, so only the order of the fp32
    accumulation inside wgmma separates it from the reference (~1e-6 relative). PyTorch's own
    bf16/fp16 Q @ K^T rounds every score to the input dtype (unit roundoff 2^-8 / 2^-11): the
    bound 1e-4 is far below that error, which is printed alongside."""
    B, H, Sq, D = q.shape
    assert s.shape == (B, H, Sq, k.shape[2]) and s.dtype == torch.float32
    scale = D**-0.5 if scale is None else scale
    torch_lowp = (q @ k.transpose(-1, -2)) * scale
    return verify.check_close(
        "S", s, reference.qk_ref(q, k, scale), rtol=1e-4, torch_lowp=torch_lowp
    )


SHAPES = [
    (1, 1, 128, 128, 64),
    (1, 1, 128, 128, 128),
    (2, 3, 200, 260, 128),  # tails: Sq = 128 + 72, Sk = 2 x 128 + 4
    (4, 40, 256, 512, 64),  # B * H = 160 (h, b) pairs, 320 CTAs: more than the 132 SMs
    (1, 2, 1, 4, 128),  # one query, four keys
    (2, 2, 1000, 1000, 64),
    (1, 1, 384, 2048, 128),  # 16 K tiles through 2 slots: each slot refilled 7 times
]


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_qk_matches_fp64_reference(shape, dtype):
    q, k, _ = inputs.attention_inputs(*shape, dtype, seed=sum(shape))
    check_s(run(q, k), q, k)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_large_logits_and_explicit_scale(dtype):
    q, k, _ = inputs.attention_inputs(2, 4, 256, 384, 128, dtype, seed=3, logit_scale=10.0)
    s = run(q, k, scale=0.2)
    check_s(s, q, k, scale=0.2)
    assert s.abs().max() > 30


@pytest.mark.gpu_hopper
def test_strided_inputs():
    # Q, K as (B, H, S, D) views of (B, S, H, D) tensors: D contiguous, other strides arbitrary.
    B, H, Sq, Sk, D = 2, 3, 192, 320, 64
    q4, k4 = (
        t.transpose(1, 2).contiguous() for t in inputs.attention_inputs(B, H, Sq, Sk, D, seed=7)[:2]
    )
    q, k = q4.transpose(1, 2), k4.transpose(1, 2)
    assert not q.is_contiguous()
    check_s(run(q, k), q, k)


@pytest.mark.gpu_hopper
def test_stage_package_dispatches_to_hopper():
    from stages.stage2_qk import qk

    q, k, _ = inputs.attention_inputs(1, 2, 128, 256, 64, seed=8)
    check_s(verify.run_with_deadline(lambda: qk(q, k), seconds=120), q, k)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_QK_INPUTS)
def test_rejects_bad_input(case):
    case.check(hopper.qk)


@needs_cuda
def test_rejects_sk_that_breaks_tma_alignment():
    with pytest.raises(ValueError, match=r"Sk = k.shape\[2\] = 130 must be a multiple of 4"):
        hopper.qk(*attention_cases.qkv(Sk=130)[:2])
