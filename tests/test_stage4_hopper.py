"""Stage 4 (Hopper): attention for any Sk with K and V sharing one shared-memory ring (V_j is
loaded into the slot K_j occupied, once the wgmmas reading K_j have completed) and an exact
two-pass softmax (pass 1: row max and sum over all K tiles; pass 2: P = exp(S - max) / sum,
O += P V).

- Compile-only tests need no GPU: the sm_90a PTX must hold the two wgmma shapes (the second with
  P from registers), the TMA loads, the mbarrier waits, the quad shuffles, and the two passes
  (3 wgmma batches and 2 ex2 per score and KV tile).
- GPU tests (marker gpu_hopper) compare O with an fp64 reference on 1 to 128 KV tiles (Sk up to
  16k; odd tile counts, so that the two slots are used unevenly by pass 1), partial last tiles,
  B * H above the 132 SMs, Sq = 1, both dtypes, D = 64 and 128, and on inputs built to stress
  the softmax: logits of magnitude tens, the row max in the last column of the last KV tile,
  one dominant key in the middle, constant rows. Outputs are poisoned with NaN before the launch
  (common.outputs.empty_output), so an element the kernel never writes fails. Repeated launches
  must give bit-identical results.
- Bad input: every error names the argument. Those that fail before any CUDA call run on CPU
  tensors, so they run in CI too; the others need a CUDA device (any: they fail in the argument
  checks, before a kernel is compiled or launched). The cases common to stages 2-5 are in
  tests/attention_cases.py; this file adds its stage's own limits.
"""

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id, shape_id

from common.tools import inputs, verify
from common.tools.ptx import compile_only
from stages.stage4_kv_interleave import hopper

# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_compiles_for_sm90a(dtype, D):
    report = compile_only(4, "hopper", dtype=dtype, shape=(2, 4, 512, 1024, D))
    counts, ptx = report.counts, report.ptx
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    # Pass 1: D / 16 wgmma for S = Q K^T per KV tile. Pass 2: D / 16 again, and 128 / 16 = 8
    # for O += P V (A operand: 4 registers of P). Each batch is written once in its loop.
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{ab}.{ab}" in ptx
    pv = [
        ln
        for ln in ptx.splitlines()
        if f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}" in ln
    ]
    assert sum("}, {%r" in ln for ln in pv) == 8, report.summary()
    assert counts["wgmma.mma_async"] == 2 * (D // 16) + 8, report.summary()
    assert counts["wgmma.wait_group"] == 3, report.summary()
    # Q, K and V by TMA, O stored by TMA; consumers wait on the ring's full barriers, the
    # producer on its empty barriers.
    assert (
        counts["cp.async.bulk.tensor (load)"] >= 3 and counts["cp.async.bulk.tensor (store)"] >= 1
    )
    assert counts["mbarrier.try_wait"] >= 4 and "mbarrier.arrive.expect_tx" in ptx
    # 64 exp2 per thread per tile (2 rows x 32 columns) in each pass, + 2 for the rescaling
    # factors of row_sum in pass 1.
    assert counts["ex2.approx"] == 2 * 64 + 2, report.summary()
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
        lambda: hopper.attention(q, k, v, scale), seconds=120, what="stage 4 hopper"
    )


# verify.check_attention holds O to 3x the error of PyTorch's own attention in the input dtype
# against the same fp64 reference (never above 1e-2, never below one rounding of the dtype); its
# docstring derives the bound.


SHAPES = [
    (1, 1, 128, 128, 64),  # one KV tile
    (1, 1, 256, 1024, 128),  # 8 KV tiles: each of the 2 slots used 4 times in pass 1, 8 in pass 2
    (2, 3, 200, 260, 128),  # Sq tail, 3 KV tiles of which the last holds 4 keys (124 masked)
    (1, 1, 128, 640, 64),  # 5 KV tiles: pass 1 uses slot 0 three times, slot 1 twice
    (4, 40, 256, 512, 64),  # B * H = 160 (h, b) pairs, 320 CTAs: more than the 132 SMs
    (1, 2, 1, 1, 128),  # one query, one key
    (2, 2, 1000, 1000, 64),
    (1, 2, 256, 16384, 128),  # Sk = 16k: 128 KV tiles
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
    # Q scaled by 10: scale * Q K^T has standard deviation ~10, so |S| reaches 30-50, exp(S -
    # row_max) spans the whole fp32 range, and pass 1's row_max jumps by tens between tiles.
    q, k, v = attention_cases.large_logits(
        2, 4, 256, 1024, D, dtype, seed=3, logit_scale=10.0, min_abs_logit=30
    )
    o = run(q, k, v)
    verify.check_attention("O", o, q, k, v)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("where", ["last", "middle"])
def test_one_dominant_key(dtype, where):
    # "last": the row max arrives in the last column of the last KV tile, ~45 above every
    # earlier max, so pass 1 rescales row_sum by ~e^-45 at the end. "middle": in tile 2 of 4.
    Sk = 1000
    hot = Sk - 1 if where == "last" else 300
    # The builder asserts that the row max is in column `hot` and that the fp64 reference is V's row `hot`.
    q, k, v = attention_cases.one_dominant_key(2, 2, 256, Sk, 128, dtype, hot=hot, seed=5)
    o = run(q, k, v)
    verify.check_attention("O", o, q, k, v)


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_constant_rows(dtype):
    # All keys equal: P = 1 / Sk, O = the mean of V's rows (the builder asserts the fp64 reference is it).
    q, k, v = attention_cases.constant_rows(2, 2, 200, 700, 64, dtype, seed=6)
    o = run(q, k, v)
    verify.check_attention("O", o, q, k, v)


@pytest.mark.gpu_hopper
def test_repeated_launches_are_bit_identical():
    # No atomics and a fixed reduction order: the same inputs give the same (correct) bits, and a
    # second input set through the cached kernel gives its own correct result.
    q, k, v = inputs.attention_inputs(2, 4, 384, 2048, 128, seed=11)
    o1, o2 = run(q, k, v), run(q, k, v)
    verify.check_attention("O", o1, q, k, v)
    assert torch.equal(o1, o2)
    q2, k2, v2 = inputs.attention_inputs(2, 4, 384, 2048, 128, seed=12)
    verify.check_attention("O", run(q2, k2, v2), q2, k2, v2)


@pytest.mark.gpu_hopper
def test_explicit_scale_and_strided_inputs():
    # Q, K, V as (B, H, S, D) views of (B, S, H, D) tensors (the layout of many models): D
    # contiguous, the other strides arbitrary. And a scale other than 1/sqrt(D).
    B, H, Sq, Sk, D = 2, 3, 192, 500, 128
    q4, k4, v4 = (
        t.transpose(1, 2).contiguous() for t in inputs.attention_inputs(B, H, Sq, Sk, D, seed=7)
    )
    q, k, v = (t.transpose(1, 2) for t in (q4, k4, v4))
    assert not q.is_contiguous()
    verify.check_attention("O", run(q, k, v, scale=0.05), q, k, v, scale=0.05)


@pytest.mark.gpu_hopper
def test_stage_package_dispatches_to_hopper():
    from stages.stage4_kv_interleave import attention

    q, k, v = inputs.attention_inputs(1, 2, 128, 256, 64, seed=8)
    verify.check_attention(
        "O", verify.run_with_deadline(lambda: attention(q, k, v), seconds=120), q, k, v
    )


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_ATTENTION_INPUTS)
def test_rejects_bad_input(case):
    case.check(hopper.attention)
