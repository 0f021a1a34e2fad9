"""Stage 5, both tracks: one-pass attention with the online softmax (running max and sum, O
rescaled as the KV tiles go by) and the log-sum-exp of each row, against an fp64 reference, and
the argument checks.

Every test runs on each track (tests/tracks.py): the Hopper params carry the marker gpu_hopper,
the Blackwell ones gpu_blackwell. The PTX checks of each track are in
tests/test_stage5_hopper.py and tests/test_stage5_blackwell.py.

- GPU tests compare O and LSE with an fp64 reference on 1 to 128 KV tiles, Sk and Sq not
  multiples of 128, Sq = 1, both dtypes, D = 64 and 128, logits of magnitude tens, an explicit
  scale and strided views, and O alone when return_lse is False. The cases common to both tracks
  come first; each track adds its own (Hopper: B * H above the 132 SMs, Sk = 16k, inputs built to
  stress the online softmax: the row max arriving only in the last column of the last KV tile, so
  that every earlier tile is rescaled, one dominant key in the middle, constant rows, and
  bit-identical repeated launches; Blackwell: logits that grow along the keys, so that O is
  rescaled at almost every tile, and O against stage 4's). Outputs are poisoned with NaN before
  the launch (common.outputs.empty_output), so an element the kernel never writes fails. As of
  2026-12-01 no sm_100 GPU was available: the Blackwell params have not run yet.
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

from common.tools import inputs, reference, verify


def attention(track):
    return module("stage5_online_softmax", track).attention


def run(track, q, k, v, scale=None, return_lse=True):
    """(O, LSE) from the kernel (O alone with return_lse=False), under a deadline: a deadlocked
    pipeline (a barrier phase that never completes) fails instead of hanging."""
    return verify.run_with_deadline(
        lambda: attention(track)(q, k, v, scale, return_lse),
        seconds=120,
        what=f"stage 5 {track} attention",
    )


def check(o, lse, q, k, v, scale=None):
    # verify.check_attention holds O to 3x the error of PyTorch's own attention in the input dtype
    # against the same fp64 reference (never above 1e-2, never below one rounding of the dtype),
    # and LSE to 1e-4 relative; its docstring derives both bounds.
    verify.check_attention("O", o, q, k, v, scale=scale, lse=lse)


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
        (1, 1, 128, 256, 128),  # 2 KV tiles: one rescale of O
        (2, 4, 512, 384, 64),  # 3 KV tiles
        (2, 4, 512, 1024, 128),
        (1, 2, 256, 8192, 128),  # 64 KV tiles: 63 rescales, each ring slot reused 64 times
        (3, 5, 256, 300, 128),  # 3 tiles, the last with 84 keys masked
        (1, 2, 384, 64, 64),  # fewer keys than one tile
    ],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("track, shape", per_track(SHAPES, shape_id))
def test_attention_and_lse_match_fp64_reference(track, shape, dtype):
    q, k, v = inputs.attention_inputs(*shape, dtype, seed=sum(shape))
    check(*run(track, q, k, v), q, k, v)


# (shape, dtype, input seed, logit_scale, min_abs_logit): Q scaled by logit_scale, so |scale * S|
# reaches tens, exp(S - row_max) spans the whole fp32 range (exp without the row max would
# overflow) and row_max jumps by tens between tiles. With min_abs_logit, the builder
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
    check(*run(track, q, k, v), q, k, v)


# (dtype, where the hot key is); Blackwell has no such case yet.
ONE_DOMINANT_KEY = {"hopper": [(dtype, where) for where in ("last", "middle") for dtype in DTYPES]}


@pytest.mark.parametrize(
    "track, case", per_track(ONE_DOMINANT_KEY, lambda c: f"{c[1]}-{dtype_id(c[0])}")
)
def test_one_dominant_key(track, case):
    # "last": the row max arrives in the last column of the last KV tile, ~45 above every
    # earlier max, so all of O is rescaled by ~e^-45 at the end. "middle": in tile 2 of 4.
    dtype, where = case
    Sk = 1000
    hot = Sk - 1 if where == "last" else 300
    # The builder asserts that the row max is in column `hot` and that the fp64 reference is V's row `hot`.
    q, k, v = attention_cases.one_dominant_key(2, 2, 256, Sk, 128, dtype, hot=hot, seed=5)
    check(*run(track, q, k, v), q, k, v)


# dtypes; Blackwell has no such case yet.
CONSTANT_ROWS = {"hopper": DTYPES}


@pytest.mark.parametrize("track, dtype", per_track(CONSTANT_ROWS, dtype_id))
def test_constant_rows(track, dtype):
    # All keys equal: P = 1 / Sk, O = the mean of V's rows (the builder asserts the fp64 reference is it).
    q, k, v = attention_cases.constant_rows(2, 2, 200, 700, 64, dtype, seed=6)
    check(*run(track, q, k, v), q, k, v)


# shapes; Hopper has no such case yet.
GROWING_LOGITS = {"blackwell": [(2, 2, 256, 1024, 128)]}


@pytest.mark.parametrize("track, shape", per_track(GROWING_LOGITS, shape_id))
def test_attention_when_the_row_max_grows_across_tiles(track, shape):
    # Keys scaled up along the sequence: most rows find a larger max in each later tile, so O and
    # row_sum are rescaled at almost every tile.
    q, k, v = attention_cases.growing_logits(*shape, torch.bfloat16, seed=13, logit_scale=3.0)
    check(*run(track, q, k, v), q, k, v)


# (shape, input seeds); Blackwell has no such case yet.
REPEATED = {"hopper": [((2, 4, 384, 2048, 128), (11, 12))]}


@pytest.mark.parametrize("track, case", per_track(REPEATED, lambda c: shape_id(c[0])))
def test_repeated_launches_are_bit_identical(track, case):
    # No atomics and a fixed reduction order: the same inputs give the same (correct) bits, and a
    # second input set through the cached kernel gives its own correct result.
    shape, (seed, seed2) = case
    q, k, v = inputs.attention_inputs(*shape, seed=seed)
    o1, lse1 = run(track, q, k, v)
    o2, lse2 = run(track, q, k, v)
    check(o1, lse1, q, k, v)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    q2, k2, v2 = inputs.attention_inputs(*shape, seed=seed2)
    verify.check_attention("O", run(track, q2, k2, v2, return_lse=False), q2, k2, v2)


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
    check(*run(track, q, k, v, scale=scale), q, k, v, scale=scale)


# (shape, input seed, against_stage_4): with against_stage_4, O is also held to stage 4's O.
O_ONLY = {
    "hopper": [((1, 2, 128, 256, 64), 9, False)],
    "blackwell": [((1, 2, 256, 1024, 128), 21, True)],
}


@pytest.mark.parametrize("track, case", per_track(O_ONLY, lambda c: shape_id(c[0])))
def test_return_lse_false_returns_only_o(track, case):
    shape, seed, against_stage_4 = case
    q, k, v = inputs.attention_inputs(*shape, seed=seed)
    o5 = run(track, q, k, v, return_lse=False)
    assert isinstance(o5, torch.Tensor)
    verify.check_attention("O", o5, q, k, v)
    if against_stage_4:
        stage4 = module("stage4_kv_interleave", track)
        o4 = verify.run_with_deadline(lambda: stage4.attention(q, k, v), seconds=120)
        # Both stages keep S in fp32 and round P and O to bf16, P at different points (P / row_sum
        # in stage 4, P against the running max in stage 5), so their roundings are independent.
        # Emulated in PyTorch on inputs like these (CPU, 2026-11-29), the two differ by 1.5-1.9x
        # PyTorch's own bf16 error against the fp64 reference: bound 3x, the reference check's
        # factor.
        o_ref, _ = reference.attention_ref(q, k, v)
        torch_err = verify.rel_err(reference.attention_lowp(q, k, v), o_ref)
        verify.check_close("O (stage 5 vs stage 4)", o5, o4, rtol=3 * torch_err)


# (shape, input seed) that the stage package's attention runs on the GPU's track
DISPATCH = {
    "hopper": [((1, 2, 128, 256, 64), 8)],
    "blackwell": [((1, 2, 256, 512, 128), 3)],
}


@pytest.mark.parametrize("track, case", per_track(DISPATCH, lambda c: shape_id(c[0])))
def test_stage_package_dispatches_to_the_track(track, case):
    from stages.stage5_online_softmax import attention as package_attention

    shape, seed = case
    q, k, v = inputs.attention_inputs(*shape, seed=seed)
    o, lse = verify.run_with_deadline(
        lambda: package_attention(q, k, v, return_lse=True), seconds=120
    )
    check(o, lse, q, k, v)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_ATTENTION_INPUTS)
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_bad_input(track, case):
    case.check(attention(track))


@pytest.mark.parametrize("track", on_cpu())
def test_rejects_return_lse_that_is_not_a_bool(track):
    with pytest.raises(TypeError, match="argument 'return_lse': expected a bool, got str"):
        attention(track)(*attention_cases.qkv("cpu"), return_lse="yes")
