"""Stage 2, both tracks: S = scale * Q K^T in fp32 against an fp64 reference, and the argument
checks.

Every test runs on each track (tests/tracks.py): the Hopper params carry the marker gpu_hopper,
the Blackwell ones gpu_blackwell. The PTX checks of each track are in
tests/test_stage2_hopper.py and tests/test_stage2_blackwell.py.

- GPU tests compare S with an fp64 reference on full and partial tiles (Sq and Sk that are not
  multiples of 128), Sq = 1, more K tiles than pipeline slots, both dtypes, D = 64 and 128, an
  explicit scale (on Hopper with logits of magnitude tens), and Q/K given as transposed views of
  (B, S, H, D) tensors. The shapes common to both tracks come first; each track adds its own
  (Hopper: B * H above the 132 SMs; Blackwell: more Q and K tiles per head, an odd number of K
  tiles through the 2-slot ring). Outputs are poisoned with NaN before the launch
  (common.outputs.empty_output), so an element the kernel never writes fails. As of 2026-12-01 no
  sm_100 GPU was available: the Blackwell params have not run yet.
- Bad input: every error names the argument. Those that fail before any CUDA call run on CPU
  tensors, so they run in CI too; the others need a CUDA device (any: they fail in the argument
  checks, before a kernel is compiled or launched). The cases common to stages 2-5 are in
  tests/attention_cases.py; this file adds its stage's own limits.
"""

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id, needs_cuda, shape_id
from tracks import module, on_cpu, per_track

from common.tools import inputs, reference, verify


def qk(track):
    return module("stage2_qk", track).qk


def run_qk(track, q, k, scale=None):
    # A deadlocked pipeline (a barrier phase that never completes) fails instead of hanging.
    return verify.run_with_deadline(
        lambda: qk(track)(q, k, scale), seconds=120, what=f"stage 2 {track} qk"
    )


def check_s(s, q, k, scale=None):
    """S against the fp64 reference. Products of bf16/fp16 values are exact in fp32 and S is
    stored in fp32: only the tensor core's fp32 accumulation over D terms (its own order and
    truncation, ~1e-7 to 1e-6 relative) separates it from the reference. 1e-4 leaves margin yet
    fails S rounded to bf16 (~2e-3 relative) or a scale off by 1% (~1e-2). PyTorch's own bf16/fp16
    Q @ K^T rounds every score to the input dtype (unit roundoff 2^-8 / 2^-11), far above the
    bound: it is printed alongside, never the yardstick."""
    B, H, Sq, D = q.shape
    assert s.shape == (B, H, Sq, k.shape[2]) and s.dtype == torch.float32
    scale = D**-0.5 if scale is None else scale
    torch_lowp = (q @ k.transpose(-1, -2)) * scale
    return verify.check_close(
        "S", s, reference.qk_ref(q, k, scale), rtol=1e-4, torch_lowp=torch_lowp
    )


# ---------------------------------------------------------------- numerics on the GPU


COMMON_SHAPES = [
    (1, 1, 128, 128, 64),  # one CTA, one K tile
    (1, 1, 128, 128, 128),
    (2, 3, 200, 260, 128),  # tails: Sq = 128 + 72, Sk = 2 x 128 + 4
    (1, 2, 1, 4, 128),  # one query, four keys
    (2, 2, 1000, 1000, 64),
]
SHAPES = {
    "hopper": COMMON_SHAPES
    + [
        (4, 40, 256, 512, 64),  # B * H = 160 (h, b) pairs, 320 CTAs: more than the 132 SMs
        (1, 1, 384, 2048, 128),  # 16 K tiles through 2 slots: each slot refilled 7 times
    ],
    "blackwell": COMMON_SHAPES
    + [
        (2, 4, 512, 512, 64),
        (2, 4, 512, 512, 128),
        (3, 5, 256, 1024, 128),  # 15 heads; 8 K tiles: each of the 2 slots reused 4 times
        (1, 2, 1024, 256, 64),  # 8 Q tiles per head, 2 K tiles
        (4, 8, 128, 384, 64),  # 3 K tiles: an odd number through the 2-slot ring
    ],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("track, shape", per_track(SHAPES, shape_id))
def test_qk_matches_fp64_reference(track, shape, dtype):
    q, k, _ = inputs.attention_inputs(*shape, dtype, seed=sum(shape))
    check_s(run_qk(track, q, k), q, k)


# (shape, dtype, input seed, logit_scale, scale): Hopper with logits of magnitude tens, so that
# |S| > 30 is checked too; Blackwell with unit logits.
EXPLICIT_SCALE = {
    "hopper": [((2, 4, 256, 384, 128), dtype, 3, 10.0, 0.2) for dtype in DTYPES],
    "blackwell": [((2, 2, 256, 256, 64), torch.bfloat16, 11, 1.0, 0.3)],
}


def explicit_scale_id(case):
    shape, dtype, _, logit_scale, scale = case
    return f"{shape_id(shape)}-{dtype_id(dtype)}-logits{logit_scale:g}-scale{scale:g}"


@pytest.mark.parametrize("track, case", per_track(EXPLICIT_SCALE, explicit_scale_id))
def test_explicit_scale(track, case):
    shape, dtype, seed, logit_scale, scale = case
    q, k, _ = inputs.attention_inputs(*shape, dtype, seed=seed, logit_scale=logit_scale)
    s = run_qk(track, q, k, scale=scale)
    check_s(s, q, k, scale=scale)
    if logit_scale >= 10:
        assert s.abs().max() > 30


# (shape, input seed) of Q, K given as (B, H, S, D) views of (B, S, H, D) tensors
STRIDED = {
    "hopper": [((2, 3, 192, 320, 64), 7)],
    "blackwell": [((2, 3, 256, 384, 128), 5)],
}


@pytest.mark.parametrize("track, case", per_track(STRIDED, lambda c: shape_id(c[0])))
def test_qk_reads_transposed_bshd_views(track, case):
    shape, seed = case
    q, k, _ = attention_cases.bshd_views(*shape, seed=seed)
    check_s(run_qk(track, q, k), q, k)


# (shape, input seed) that the stage package's qk runs on the GPU's track
DISPATCH = {
    "hopper": [((1, 2, 128, 256, 64), 8)],
    "blackwell": [((1, 2, 256, 256, 128), 3)],
}


@pytest.mark.parametrize("track, case", per_track(DISPATCH, lambda c: shape_id(c[0])))
def test_stage_package_dispatches_to_the_track(track, case):
    from stages.stage2_qk import qk as package_qk

    shape, seed = case
    q, k, _ = inputs.attention_inputs(*shape, seed=seed)
    check_s(verify.run_with_deadline(lambda: package_qk(q, k), seconds=120), q, k)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_QK_INPUTS)
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_bad_input(track, case):
    case.check(qk(track))


@needs_cuda
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_sk_that_breaks_16_byte_rows(track):
    with pytest.raises(ValueError, match=r"Sk = k.shape\[2\] = 130 must be a multiple of 4"):
        qk(track)(*attention_cases.qkv(Sk=130)[:2])
