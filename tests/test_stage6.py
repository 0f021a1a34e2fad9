"""Stage 6, both tracks: causal and sliding-window masks with tile skipping, against an fp64
reference, and the argument checks.

Every test runs on each track (tests/tracks.py), with the same cases: the Hopper params carry the
marker gpu_hopper, the Blackwell ones gpu_blackwell. The PTX checks of each track are in
tests/test_stage6_hopper.py and tests/test_stage6_blackwell.py.

- GPU tests against the fp64 reference with an explicit boolean mask (common.masks.visible; never
  SDPA's is_causal, which is top-left when Sq != Sk): causal and windows of several widths,
  Sq = Sk, Sq < Sk, Sq > Sk (rows and whole Q tiles that see no key: O = 0 and LSE = -inf
  exactly, with NaN in those rows of Q), window edges inside a tile and on a tile boundary,
  lengths that are not tile multiples, Sq = 1, both dtypes, D = 64 and 128, LSE; the unmasked
  kernel equal to stage 5's bit for bit. Outputs are poisoned with NaN before the launch. NaN
  planted in K and V tiles that no query sees proves those tiles are never loaded or
  multiplied. Each launch has a 120 s deadline, so a lost arrive fails instead of hanging. As of
  2026-12-01 no sm_100 GPU was available: the Blackwell params have not run yet.
- Bad input: the shared cases of stages 2-5 plus the mask arguments and compile_args' options.
"""

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from tracks import module, on_cpu, on_gpu

from common import masks
from common.tools import inputs, verify


def attention(track):
    return module("stage6_masks", track).attention


def run(track, q, k, v, causal=False, window=None, scale=None):
    return verify.run_with_deadline(
        lambda: attention(track)(
            q, k, v, scale=scale, causal=causal, window=window, return_lse=True
        ),
        seconds=120,
        what=f"stage 6 {track}",
    )


def check(o, lse, q, k, v, causal, window, scale=None):
    Sq, Sk = q.shape[2], k.shape[2]
    mask = masks.visible(Sq, Sk, *masks.resolve_window(causal, window, Sq, Sk), device=q.device)
    verify.check_attention("O", o, q, k, v, scale=scale, lse=lse, mask=mask)


# (B, H, Sq, Sk, D, causal, window): the shapes and the masks that stress the tile range.
CASES = [
    (2, 3, 1024, 1024, 128, True, None),  # Sq = Sk: 8 x 8 tiles, 8 on the diagonal
    (1, 2, 1000, 1000, 64, True, None),  # not tile multiples: the diagonal crosses Sk's tile
    (2, 2, 300, 1000, 64, True, None),  # Sq < Sk: the band starts at key 700
    (2, 2, 1000, 300, 64, True, None),  # Sq > Sk: rows 0-699 see nothing, Q tiles 0-4 no KV tile
    (1, 2, 512, 128, 128, True, None),  # Sq > Sk: Q tiles 0-2 see no key at all
    (1, 2, 1, 1000, 128, True, None),  # Sq = 1 (decode-like): the query sees every key
    (1, 2, 1, 1000, 64, False, (100, 0)),  # Sq = 1 and a window: keys 899-999
    (2, 2, 1024, 1024, 64, False, (128, 0)),  # window edge on a tile boundary
    (2, 2, 1024, 1024, 64, False, (200, 0)),  # window edge inside a tile
    (1, 2, 777, 1333, 128, True, (61, None)),  # narrow band, ragged lengths
    (1, 2, 640, 640, 64, False, (64, 64)),  # two-sided window
    (1, 2, 512, 512, 64, False, (0, 0)),  # each row sees only its own key
    (1, 2, 500, 700, 64, False, (None, 3)),  # bounded only on the right
    (2, 2, 384, 384, 128, False, None),  # no mask: stage 5's answer
    (1, 1, 1024, 256, 64, False, (10, 10)),  # Sq > Sk with a window: most rows see nothing
]


def case_id(c):
    B, H, Sq, Sk, D, causal, window = c
    return f"{B}x{H}x{Sq}x{Sk}x{D}-{'causal' if causal else 'full'}-w{window}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("track", on_gpu())
def test_masked_attention_matches_fp64_reference(track, case, dtype):
    B, H, Sq, Sk, D, causal, window = case
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=Sq + Sk + D)
    o, lse = run(track, q, k, v, causal, window)
    check(o, lse, q, k, v, causal, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("track", on_gpu())
def test_skipped_tiles_are_never_read(track, dtype):
    # Sq = 128 rows see keys i + 896 - 200 .. i + 896 of Sk = 1024: no row sees keys 0-695, so
    # KV tiles 0-4 (keys 0-639) are outside the range. NaN there would poison O if they were
    # loaded and multiplied (0 x NaN = NaN).
    B, H, Sq, Sk, D = 2, 2, 128, 1024, 64
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=21)
    left, right = masks.resolve_window(True, (200, None), Sq, Sk)
    assert masks.kv_tile_range(0, Sq, Sk, left, right) == (5, 8)
    k[:, :, :640] = float("nan")
    v[:, :, :640] = float("nan")
    o, lse = run(track, q, k, v, causal=True, window=(200, None))
    check(o, lse, q, k.nan_to_num(0.0), v.nan_to_num(0.0), True, (200, None))


@pytest.mark.parametrize("track", on_gpu())
def test_q_tiles_without_keys_never_read_k_or_v(track):
    # Sq = 512, Sk = 128, causal: Q tiles 0-2 see no key (Q tile 3 sees every key, so K and V
    # cannot hold NaN here). NaN in Q tiles 0-2's rows of Q: their O must still be exactly 0
    # and LSE -inf (no S is computed from them; on Blackwell no MMA runs and O's TMEM columns
    # are never written).
    q, k, v = inputs.attention_inputs(1, 2, 512, 128, 64, seed=23)
    q[:, :, :384] = float("nan")
    o, lse = run(track, q, k, v, causal=True)
    assert (o[:, :, :384] == 0).all() and (lse[:, :, :384] == float("-inf")).all()
    check(o[:, :, 384:], lse[:, :, 384:], q[:, :, 384:], k, v, True, None)


@pytest.mark.parametrize("track", on_gpu())
def test_large_logits_causal(track):
    q, k, v = attention_cases.large_logits(
        2, 2, 700, 700, 128, torch.bfloat16, seed=3, logit_scale=10.0, min_abs_logit=30
    )
    o, lse = run(track, q, k, v, causal=True)
    check(o, lse, q, k, v, True, None)


@pytest.mark.parametrize("track", on_gpu())
def test_non_causal_is_stage5_bit_for_bit(track):
    # With no mask the loop is stage 5's: the same bits.
    stage5 = module("stage5_online_softmax", track)

    q, k, v = inputs.attention_inputs(2, 4, 384, 1000, 128, seed=31)
    o6, lse6 = run(track, q, k, v)
    o5, lse5 = verify.run_with_deadline(lambda: stage5.attention(q, k, v, return_lse=True), 120)
    assert torch.equal(o6, o5) and torch.equal(lse6, lse5)


@pytest.mark.parametrize("track", on_gpu())
def test_stage_package_dispatches_to_the_track(track):
    from stages.stage6_masks import attention

    q, k, v = inputs.attention_inputs(1, 2, 300, 300, 64, seed=8)
    o, lse = verify.run_with_deadline(
        lambda: attention(q, k, v, causal=True, return_lse=True), seconds=120
    )
    check(o, lse, q, k, v, True, None)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_ATTENTION_INPUTS)
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_bad_input(track, case):
    case.check(attention(track))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"window": (-1, 0)}, ValueError, "argument 'window': the left bound must be >= 0"),
        ({"window": 5}, TypeError, "argument 'window': expected None or a pair"),
        ({"window": (0.5, None)}, TypeError, "the left bound must be an int or None"),
        ({"causal": 1}, TypeError, "argument 'causal': expected a bool"),
        ({"causal": True, "window": (None, 3)}, ValueError, "causal=True means right = 0"),
        ({"return_lse": "yes"}, TypeError, "argument 'return_lse': expected a bool"),
    ],
)
@pytest.mark.parametrize("track", on_cpu())
def test_rejects_bad_mask_arguments(track, kwargs, error, match):
    q, k, v = attention_cases.qkv("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(error, match=match):
        attention(track)(q, k, v, **kwargs)


@pytest.mark.parametrize("track", on_cpu())
def test_compile_args_rejects_unknown_options(track):
    with pytest.raises(TypeError, match="unknown option"):
        module("stage6_masks", track).compile_args(
            torch.bfloat16, (1, 1, 128, 128, 64), sliding=True
        )
