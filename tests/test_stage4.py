"""Stage 4, both tracks: O = softmax(scale * Q K^T) V for any Sk (exact two-pass softmax, K and V
through one ring) against an fp64 reference, and the argument checks.

Every test runs on each track (tests/tracks.py): the Hopper params carry the marker gpu_hopper,
the Blackwell ones gpu_blackwell. The PTX checks of each track are in
tests/test_stage4_hopper.py and tests/test_stage4_blackwell.py.

- GPU tests compare O with an fp64 reference on 1 to 128 KV tiles (odd counts: V lands in slots
  that held K), Sk and Sq not multiples of 128, Sq = 1, both dtypes, D = 64 and 128, logits of
  magnitude tens, an explicit scale and strided views, and repeated launches through the cached
  kernel. The cases common to both tracks come first; each track adds its own (Hopper: B * H
  above the 132 SMs, Sk = 16k, inputs built to stress the softmax: the row max arriving in the
  last column of the last KV tile or in the middle, constant rows, and bit-identical repeated
  launches; Blackwell: logits that grow along the keys, so that the running max changes from
  tile to tile). Outputs are poisoned with NaN before the launch (common.outputs.empty_output),
  so an element the kernel never writes fails. As of 2026-12-01 no sm_100 GPU was available: the
  Blackwell params have not run yet.
- Bad input: every error names the argument. Those that fail before any CUDA call run on CPU
  tensors, so they run in CI too; the others need a CUDA device (any: they fail in the argument
  checks, before a kernel is compiled or launched). The cases common to stages 2-5 are in
  tests/attention_cases.py.
"""

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id, shape_id
from tracks import module, on_cpu, per_track

from common.tools import inputs, verify


def attention(track):
    return module("stage4_kv_interleave", track).attention


def run(track, q, k, v, scale=None):
    # A deadlocked pipeline (a barrier phase that never completes) fails instead of hanging.
    return verify.run_with_deadline(
        lambda: attention(track)(q, k, v, scale), seconds=120, what=f"stage 4 {track} attention"
    )


# verify.check_attention holds O to 3x the error of PyTorch's own attention in the input dtype
# against the same fp64 reference (never above 1e-2, never below one rounding of the dtype); its
# docstring derives the bound.


# ---------------------------------------------------------------- numerics on the GPU


COMMON_SHAPES = [
    (1, 1, 128, 128, 64),  # one KV tile
    (2, 3, 200, 260, 128),  # Sq tail, 3 KV tiles of which the last holds 4 keys (124 masked)
    (1, 2, 1, 1, 128),  # one query, one key
    (2, 2, 1000, 1000, 64),  # 8 Q tiles, the last with 104 rows; 8 KV tiles, 24 keys masked
]
SHAPES = {
    "hopper": COMMON_SHAPES
    + [
        (
            1,
            1,
            256,
            1024,
            128,
        ),  # 8 KV tiles: each of the 2 slots used 4 times in pass 1, 8 in pass 2
        (1, 1, 128, 640, 64),  # 5 KV tiles: pass 1 uses slot 0 three times, slot 1 twice
        (4, 40, 256, 512, 64),  # B * H = 160 (h, b) pairs, 320 CTAs: more than the 132 SMs
        (1, 2, 256, 16384, 128),  # Sk = 16k: 128 KV tiles
    ],
    "blackwell": COMMON_SHAPES
    + [
        (1, 1, 128, 256, 128),  # 2 KV tiles: pass 2 starts in slot 0, K and V alternate slots
        (2, 4, 512, 384, 64),  # 3 KV tiles: pass 2 starts in slot 1, V_j lands where K_j' was
        (2, 4, 512, 1024, 128),
        (1, 2, 256, 8192, 128),  # 64 KV tiles: each slot reused 96 times
        (3, 5, 256, 300, 128),  # 3 tiles, the last with 84 keys masked
        (1, 2, 384, 64, 64),  # fewer keys than one tile
    ],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("track, shape", per_track(SHAPES, shape_id))
def test_attention_matches_fp64_reference(track, shape, dtype):
    q, k, v = inputs.attention_inputs(*shape, dtype, seed=sum(shape))
    verify.check_attention("O", run(track, q, k, v), q, k, v)


# (shape, dtype, input seed, logit_scale, min_abs_logit): Q scaled by logit_scale, so |scale * S|
# reaches tens, exp(S - row_max) spans the whole fp32 range (exp without the row max would
# overflow) and pass 1's row_max jumps by tens between tiles. With min_abs_logit, the builder
# asserts that the largest |S| exceeds it.
LARGE_LOGITS = {
    "hopper": [((2, 4, 256, 1024, D), dtype, 3, 10.0, 30) for D in (64, 128) for dtype in DTYPES],
    "blackwell": [
        ((2, 2, 256, 640, 128), torch.bfloat16, 9, logit_scale, None) for logit_scale in (8.0, 30.0)
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
    # "last": the row max arrives in the last column of the last KV tile, ~45 above every
    # earlier max, so pass 1 rescales row_sum by ~e^-45 at the end. "middle": in tile 2 of 4.
    dtype, where = case
    Sk = 1000
    hot = Sk - 1 if where == "last" else 300
    # The builder asserts that the row max is in column `hot` and that the fp64 reference is V's row `hot`.
    q, k, v = attention_cases.one_dominant_key(2, 2, 256, Sk, 128, dtype, hot=hot, seed=5)
    verify.check_attention("O", run(track, q, k, v), q, k, v)


# dtypes; Blackwell has no such case yet.
CONSTANT_ROWS = {"hopper": DTYPES}


@pytest.mark.parametrize("track, dtype", per_track(CONSTANT_ROWS, dtype_id))
def test_constant_rows(track, dtype):
    # All keys equal: P = 1 / Sk, O = the mean of V's rows (the builder asserts the fp64 reference is it).
    q, k, v = attention_cases.constant_rows(2, 2, 200, 700, 64, dtype, seed=6)
    verify.check_attention("O", run(track, q, k, v), q, k, v)


# shapes; Hopper has no such case yet.
GROWING_LOGITS = {"blackwell": [(2, 2, 256, 1024, 128)]}


@pytest.mark.parametrize("track, shape", per_track(GROWING_LOGITS, shape_id))
def test_attention_when_the_row_max_grows_across_tiles(track, shape):
    # Keys scaled up along the sequence: most rows find a larger max in each later tile, so pass 1
    # rescales row_sum at almost every tile.
    q, k, v = attention_cases.growing_logits(*shape, torch.bfloat16, seed=13, logit_scale=3.0)
    verify.check_attention("O", run(track, q, k, v), q, k, v)


# (shape, input seeds, bit_identical): new values through the cached kernel; with bit_identical,
# the first input set twice must give the same bits (no atomics and a fixed reduction order).
REPEATED = {
    "hopper": [((2, 4, 384, 2048, 128), (11, 12), True)],
    "blackwell": [((1, 2, 256, 512, 128), (1, 2), False)],
}


@pytest.mark.parametrize("track, case", per_track(REPEATED, lambda c: shape_id(c[0])))
def test_repeated_launches_agree(track, case):
    shape, seeds, bit_identical = case
    for i, seed in enumerate(seeds):
        q, k, v = inputs.attention_inputs(*shape, seed=seed)
        o = run(track, q, k, v)
        verify.check_attention("O", o, q, k, v)
        if bit_identical and i == 0:
            assert torch.equal(o, run(track, q, k, v))


# (shape, input seed, scale, strided): with strided, Q, K, V are (B, H, S, D) views of (B, S, H, D)
# tensors (attention_cases.bshd_views); scale None is 1/sqrt(D).
SCALE_AND_STRIDES = {
    "hopper": [((2, 3, 192, 500, 128), 7, 0.05, True)],
    "blackwell": [((2, 2, 256, 512, 64), 11, 0.3, False), ((2, 3, 256, 384, 128), 5, None, True)],
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
    "hopper": [((1, 2, 128, 256, 64), 8)],
    "blackwell": [((1, 2, 256, 512, 128), 3)],
}


@pytest.mark.parametrize("track, case", per_track(DISPATCH, lambda c: shape_id(c[0])))
def test_stage_package_dispatches_to_the_track(track, case):
    from stages.stage4_kv_interleave import attention as package_attention

    shape, seed = case
    q, k, v = inputs.attention_inputs(*shape, seed=seed)
    o = verify.run_with_deadline(lambda: package_attention(q, k, v), seconds=120)
    verify.check_attention("O", o, q, k, v)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_ATTENTION_INPUTS)
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_bad_input(track, case):
    case.check(attention(track))
