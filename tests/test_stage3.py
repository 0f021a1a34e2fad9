"""Stage 3, both tracks: O = softmax(scale * Q K^T) V for Sk <= one KV tile against an fp64
reference, and the argument checks.

Every test runs on each track (tests/tracks.py): the Hopper params carry the marker gpu_hopper,
the Blackwell ones gpu_blackwell. The PTX checks of each track are in
tests/test_stage3_hopper.py and tests/test_stage3_blackwell.py.

- GPU tests compare O with an fp64 reference on full and partial KV tiles (masked keys), Sq not a
  multiple of 128 and Sq = 1, both dtypes, D = 64 and 128, logits of magnitude tens, an explicit
  scale and strided views. The cases common to both tracks come first; each track adds its own
  (Hopper: B * H above the 132 SMs, and inputs built to stress the softmax: one key far above the
  rest, in the last column or in the middle, and constant rows; Blackwell: more heads and Q
  tiles, a single key). Outputs are poisoned with NaN before the launch
  (common.outputs.empty_output), so an element the kernel never writes fails. As of 2026-12-01 no
  sm_100 GPU was available: the Blackwell params have not run yet.
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
from tracks import module, on_cpu, per_track

from common.tools import inputs, verify


def attention(track):
    return module("stage3_softmax", track).attention


def run(track, q, k, v, scale=None):
    # A deadlocked pipeline (a barrier phase that never completes) fails instead of hanging.
    return verify.run_with_deadline(
        lambda: attention(track)(q, k, v, scale), seconds=120, what=f"stage 3 {track} attention"
    )


# verify.check_attention holds O to 3x the error of PyTorch's own attention in the input dtype
# against the same fp64 reference (never above 1e-2, never below one rounding of the dtype); its
# docstring derives the bound.


# ---------------------------------------------------------------- numerics on the GPU


COMMON_SHAPES = [
    (1, 1, 128, 128, 64),  # one CTA
    (1, 1, 128, 128, 128),
    (2, 3, 200, 77, 128),  # Sq tail (200 = 128 + 72) and a partial KV tile (77 keys, 51 masked)
    (1, 2, 1, 1, 128),  # one query, one key
    (1, 1, 300, 64, 128),  # 3 Q tiles, the last with 44 rows
]
SHAPES = {
    "hopper": COMMON_SHAPES
    + [
        (4, 40, 256, 128, 64),  # B * H = 160 (h, b) pairs, 320 CTAs: more than the 132 SMs
        (2, 2, 1000, 128, 64),
    ],
    "blackwell": COMMON_SHAPES
    + [
        (2, 4, 512, 128, 64),
        (2, 4, 512, 128, 128),
        (3, 5, 256, 100, 128),  # 28 keys of the tile masked
        (1, 2, 384, 1, 64),  # a single key: P = 1, O = V[0]
        (2, 2, 128, 64, 128),  # half a tile
    ],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("track, shape", per_track(SHAPES, shape_id))
def test_attention_matches_fp64_reference(track, shape, dtype):
    q, k, v = inputs.attention_inputs(*shape, dtype, seed=sum(shape))
    verify.check_attention("O", run(track, q, k, v), q, k, v)


# (shape, dtype, input seed, logit_scale, min_abs_logit): Q scaled by logit_scale, so |scale * S|
# reaches tens and exp(S - row_max) spans the whole fp32 range (exp without the row max would
# overflow). With min_abs_logit, the builder asserts that the largest |S| exceeds it.
LARGE_LOGITS = {
    "hopper": [((2, 4, 256, 128, D), dtype, 3, 10.0, 30) for D in (64, 128) for dtype in DTYPES],
    "blackwell": [
        ((2, 2, 256, 128, 128), torch.bfloat16, 9, logit_scale, None) for logit_scale in (8.0, 30.0)
    ],
}


def large_logits_id(case):
    shape, dtype, _, logit_scale, _ = case
    return f"{shape_id(shape)}-{dtype_id(dtype)}-logits{logit_scale:g}"


@pytest.mark.parametrize("track, case", per_track(LARGE_LOGITS, large_logits_id))
def test_large_logits(track, case):
    shape, dtype, seed, logit_scale, min_abs_logit = case
    q, k, v = attention_cases.large_logits(
        *shape, dtype, seed=seed, logit_scale=logit_scale, min_abs_logit=min_abs_logit
    )
    verify.check_attention("O", run(track, q, k, v), q, k, v)


# (dtype, where the hot key is); Blackwell has no such case yet.
ONE_DOMINANT_KEY = {"hopper": [(dtype, where) for where in ("last", "middle") for dtype in DTYPES]}


@pytest.mark.parametrize(
    "track, case", per_track(ONE_DOMINANT_KEY, lambda c: f"{c[1]}-{dtype_id(c[0])}")
)
def test_one_dominant_key(track, case):
    dtype, where = case
    Sk = 128
    hot = Sk - 1 if where == "last" else 45
    # The builder asserts that the row max is in column `hot` and that the fp64 reference is V's row `hot`.
    q, k, v = attention_cases.one_dominant_key(2, 2, 256, Sk, 128, dtype, hot=hot, seed=5)
    verify.check_attention("O", run(track, q, k, v), q, k, v)


# dtypes; Blackwell has no such case yet.
CONSTANT_ROWS = {"hopper": DTYPES}


@pytest.mark.parametrize("track, dtype", per_track(CONSTANT_ROWS, dtype_id))
def test_constant_rows(track, dtype):
    # All keys equal: P = 1 / Sk, O = the mean of V's rows (the builder asserts the fp64 reference is it).
    q, k, v = attention_cases.constant_rows(2, 2, 200, 100, 64, dtype, seed=6)
    verify.check_attention("O", run(track, q, k, v), q, k, v)


# (shape, input seed, scale, strided): with strided, Q, K, V are (B, H, S, D) views of (B, S, H, D)
# tensors (attention_cases.bshd_views); scale None is 1/sqrt(D).
SCALE_AND_STRIDES = {
    "hopper": [((2, 3, 192, 96, 128), 7, 0.05, True)],
    "blackwell": [((2, 2, 256, 128, 64), 11, 0.3, False), ((2, 3, 256, 128, 128), 5, None, True)],
}


def scale_and_strides_id(case):
    shape, _, scale, strided = case
    return f"{shape_id(shape)}-scale{scale}-{'bshd' if strided else 'bhsd'}"


@pytest.mark.parametrize("track, case", per_track(SCALE_AND_STRIDES, scale_and_strides_id))
def test_explicit_scale_and_strided_inputs(track, case):
    shape, seed, scale, strided = case
    build = attention_cases.bshd_views if strided else inputs.attention_inputs
    q, k, v = build(*shape, torch.bfloat16, seed=seed)
    verify.check_attention("O", run(track, q, k, v, scale=scale), q, k, v, scale=scale)


# (shape, input seed) that the stage package's attention runs on the GPU's track
DISPATCH = {
    "hopper": [((1, 2, 128, 128, 64), 8)],
    "blackwell": [((1, 2, 256, 128, 128), 3)],
}


@pytest.mark.parametrize("track, case", per_track(DISPATCH, lambda c: shape_id(c[0])))
def test_stage_package_dispatches_to_the_track(track, case):
    from stages.stage3_softmax import attention as package_attention

    shape, seed = case
    q, k, v = inputs.attention_inputs(*shape, seed=seed)
    o = verify.run_with_deadline(lambda: package_attention(q, k, v), seconds=120)
    verify.check_attention("O", o, q, k, v)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_ATTENTION_INPUTS)
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_bad_input(track, case):
    case.check(attention(track))


@needs_cuda
@pytest.mark.parametrize("Sk", [129, 256])
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_more_than_one_kv_tile_and_points_to_stage_4(track, Sk):
    with pytest.raises(ValueError, match=rf"Sk = k.shape\[2\] = {Sk} is larger than 128.*stage 4"):
        attention(track)(*attention_cases.qkv(Sk=Sk))
