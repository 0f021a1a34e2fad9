"""Stages 7-14 (Hopper): where the math does not change, O and LSE do not change either.

Stages 8-12 change only the schedule (warp roles, turns, the overlap inside the loop, persistent
CTAs, the tunings); every query row gets stage 7's operations in stage 7's order. So each stage's
O and LSE must equal the previous stage's bit for bit, and stage 12 with any one tuning must
equal stage 11 (a tuning that changed a bit would be a bug, not noise). Stage 13 with
num_splits=1 (no split, no combine) must equal stage 12 bit for bit, and stage 14 (unpaged)
stage 13. GPU tests (marker
gpu_hopper), outputs poisoned with NaN before each launch (common/outputs.py under pytest), each
launch under a 120 s deadline. The cases cover what schedule bugs break: ranges of 1 and 2 KV
tiles, a range long enough to wrap the ring many times, Q tiles with no KV tile at all (empty
sequences, rows past a short sequence), packed sequences, causal and window masks, GQA and
pack-GQA, both dtypes and head dims.
"""

import pytest
import torch
from test_stage7 import PACKS, packed_inputs

from common.tools import inputs, stage_table, verify

pytestmark = pytest.mark.gpu_hopper


def module(stage):
    return stage_table.track_module(stage, "hopper")


def run(fn, what):
    return verify.run_with_deadline(fn, seconds=120, what=what)


# (B, H, Hkv, Sq, Sk, D, dtype, causal, window)
BATCH_CASES = [
    (2, 4, 4, 100, 128, 128, torch.bfloat16, False, None),  # one KV tile
    (2, 4, 2, 200, 256, 64, torch.float16, True, None),  # two
    (1, 4, 4, 4096, 4096, 64, torch.bfloat16, False, None),  # 64 entries: wraps the ring
    (1, 4, 1, 2048, 2048, 128, torch.float16, True, None),  # causal, MQA
    (2, 4, 2, 700, 1500, 64, torch.float16, False, (300, 0)),  # a window
    (1, 2, 2, 129, 3000, 128, torch.bfloat16, False, (None, 10)),
    (2, 8, 2, 1, 900, 64, torch.bfloat16, True, None),  # decode-like: pack-GQA
    (1, 4, 2, 2000, 2000, 64, torch.bfloat16, True, None),  # 3 warpgroups in stage 12
    (2, 2, 2, 1100, 1100, 64, torch.float16, True, None),
]


def case_id(c):
    return "x".join(map(str, c[:6])) + ("-causal" if c[7] else "") + ("-win" if c[8] else "")


def unsplit(stage):
    """Stage 13 on: the keyword that keeps every KV range whole (stage 12's arithmetic)."""
    return {"num_splits": 1} if stage >= 13 else {}


def batch_outputs(stage_or_class, case):
    B, H, Hkv, Sq, Sk, D, dtype, causal, window = case
    q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=Sq + D)
    _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, D, dtype, seed=Sk + D)
    if isinstance(stage_or_class, int):
        fn = lambda: module(stage_or_class).attention(  # noqa: E731
            q, k, v, causal=causal, window=window, return_lse=True, **unsplit(stage_or_class)
        )
    else:
        from common import attention_host

        fn = lambda: attention_host.attention(  # noqa: E731
            stage_or_class, q, k, v, None, causal, window, True, None
        )
    return run(fn, f"{stage_or_class} {case_id(case)}")


def packed_outputs(stage, pack, D, causal):
    lens_q, lens_k = PACKS[pack]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, D, torch.bfloat16, seed=21 + D)
    return run(
        lambda: module(stage).attention_varlen(
            q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **unsplit(stage)
        ),
        f"stage {stage} packed {pack}",
    )


def assert_same(got, ref, what):
    (o, lse), (o_ref, lse_ref) = got, ref
    assert torch.equal(o, o_ref), f"{what}: max |dO| = {(o.float() - o_ref.float()).abs().max()}"
    assert torch.equal(lse, lse_ref), f"{what}: max |dLSE| = {(lse - lse_ref).abs().max()}"


@pytest.mark.parametrize("case", BATCH_CASES, ids=case_id)
@pytest.mark.parametrize("stage", [8, 9, 10, 11, 12, 13, 14])
def test_equals_the_stage_before_bit_for_bit(stage, case):
    assert_same(batch_outputs(stage, case), batch_outputs(stage - 1, case), f"stage {stage}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("stage", [8, 9, 10, 11, 12, 13, 14])
def test_packed_equals_the_stage_before_bit_for_bit(stage, pack, D, causal):
    assert_same(
        packed_outputs(stage, pack, D, causal),
        packed_outputs(stage - 1, pack, D, causal),
        f"stage {stage} packed {pack}",
    )


@pytest.mark.parametrize("case", BATCH_CASES[:2] + BATCH_CASES[3:5] + BATCH_CASES[7:8], ids=case_id)
@pytest.mark.parametrize("name", module(12).TUNINGS)
def test_each_tuning_alone_equals_stage_11(name, case):
    tuned = module(12).with_tunings([name])
    assert_same(batch_outputs(tuned, case), batch_outputs(11, case), f"{name} alone")
