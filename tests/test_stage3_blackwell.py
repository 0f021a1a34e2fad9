"""Stage 3 (Blackwell): O = softmax(scale * Q K^T) V for one KV tile (Sk <= 128) on sm_100a.

- Compile-only tests need no GPU and run in CI: the sm_100a PTX must hold both forms of
  tcgen05.mma (QK with A and B from shared memory, PV with A = P from TMEM:
  `tcgen05.mma... [d_tmem], [a_tmem], b_desc`), TMEM allocation, the tcgen05.ld of S and O, the
  tcgen05.st of P, TMA loads of Q, K and V with their byte counts, and mbarrier waits.
- GPU tests (marker gpu_blackwell) compare O with an fp64 reference for D = 64 and 128, bf16 and
  fp16, Sk = 128 and partial tiles (masked keys), large logits, an explicit scale and strided
  views. O is poisoned with NaN before the launch. As of 2026-11-29 no sm_100 GPU was
  available: these tests have not run yet.
- Bad-input tests: every error names the argument; the CPU-tensor ones run in CI. The cases
  common to stages 2-5 are in tests/attention_cases.py; this file adds its stage's own limits.
"""

import re

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id, needs_cuda, shape_id

from common import checker, inputs
from common.compile import compile_only, expect_tx_immediates
from stages.stage3_softmax import blackwell

# tcgen05.mma with A and B as shared-memory descriptors (QK) / with A in TMEM (PV)
QK_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*%rd\d+,\s*%rd\d+,")
PV_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*\[%r\d+\],\s*%rd\d+,")


# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape", [(2, 4, 512, 128, 128), (2, 4, 512, 128, 64), (1, 2, 256, 100, 128)], ids=shape_id
)
def test_compiles_for_sm100a(dtype, shape):
    B, H, Sq, Sk, D = shape
    report = compile_only(3, "blackwell", dtype=dtype, shape=shape)
    counts, ptx = report.counts, report.ptx
    assert ".target sm_100a" in ptx
    assert counts["wgmma.mma_async"] == 0
    # S = Q @ K^T: D / 16 MMAs 128 x 128 x 16, A (Q) and B (K) from shared memory.
    assert len(QK_MMA.findall(ptx)) == D // 16, report.summary()
    # O = P @ V: 128 / 16 = 8 MMAs 128 x D x 16, A = P read from TMEM, B (V) from shared memory.
    assert len(PV_MMA.findall(ptx)) == 128 // 16, report.summary()
    assert counts["tcgen05.mma"] == D // 16 + 8, report.summary()
    assert counts["tcgen05.alloc"] == 1 and counts["tcgen05.dealloc"] == 1, report.summary()
    # tcgen05.ld: S (128 columns) and O (D columns), 32 fp32 columns per load, each waited for.
    assert counts["tcgen05.ld"] == 128 // 32 + D // 32, report.summary()
    assert "tcgen05.ld.sync.aligned.32x32b.x32.b32" in ptx
    assert ptx.count("tcgen05.wait::ld") == 1 + D // 32
    # tcgen05.st: P, 128 16-bit values = 64 cells per row, 32 cells per store, then wait::st.
    assert counts["tcgen05.st"] == 2 and "tcgen05.st.sync.aligned.32x32b.x32.b32" in ptx, (
        report.summary()
    )
    assert ptx.count("tcgen05.wait::st") == 1
    # tcgen05.commit: S full, K slot free, P free, V slot free, Q free, O full.
    assert counts["tcgen05.commit"] == 6, report.summary()
    # TMA over (S, D, H, B) (rank 4; a batch of 1 folds to rank 3): Q, K and V, D / 64 boxes
    # of 128-byte rows each.
    assert re.search(r"cp\.async\.bulk\.tensor\.[34]d\.shared::cta\.global", ptx)
    assert counts["cp.async.bulk.tensor (load)"] == 3 * (D // 64), report.summary()
    # Each of Q, K, V arms exactly its own tile: 128 x D x 2 bytes (never Q + K).
    assert expect_tx_immediates(ptx) == [128 * D * 2] * 3
    # Barriers: full + empty for Q (1), the K/V ring (2 slots), S, P and O (1 each).
    assert counts["mbarrier.init"] == 2 * (1 + 2 + 1 + 1 + 1), report.summary()
    assert counts["mbarrier.try_wait"] >= 6, report.summary()
    # exp2 of every unmasked score of the row
    assert counts["ex2.approx"] >= Sk, report.summary()
    # Q + K + V, 128 x D x 2 bytes each, plus 1 KiB for the barriers.
    assert report.shared_memory_bytes == 3 * 128 * D * 2 + 1024, report.summary()
    if report.resources and "spill_stores" in report.resources:
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )


# ---------------------------------------------------------------- numerics on an sm_100 GPU


SHAPES = [
    (1, 1, 128, 128, 64),  # one CTA
    (1, 1, 128, 128, 128),
    (2, 4, 512, 128, 64),
    (2, 4, 512, 128, 128),
    (3, 5, 256, 100, 128),  # 28 keys of the tile masked
    (1, 2, 384, 1, 64),  # a single key: P = 1, O = V[0]
    (2, 2, 128, 64, 128),  # half a tile
]


def run_attention(q, k, v, scale=None):
    return checker.run_with_deadline(
        lambda: blackwell.attention(q, k, v, scale), seconds=120, what="stage 3 blackwell attention"
    )


# checker.check_attention holds O to 3x the error of PyTorch's own attention in the input dtype
# against the same fp64 reference (never above 1e-2, never below one rounding of the dtype); its
# docstring derives the bound.


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_attention_matches_fp64_reference(shape, dtype):
    B, H, Sq, Sk, D = shape
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=B + H + Sq + Sk + D)
    checker.check_attention("O", run_attention(q, k, v), q, k, v)


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("logit_scale", [8.0, 30.0])
def test_attention_large_logits(logit_scale):
    # |scale * S| of tens: exp without the row max would overflow fp32.
    q, k, v = attention_cases.large_logits(
        2, 2, 256, 128, 128, torch.bfloat16, seed=9, logit_scale=logit_scale
    )
    checker.check_attention("O", run_attention(q, k, v), q, k, v)


@pytest.mark.gpu_blackwell
def test_attention_explicit_scale():
    q, k, v = inputs.attention_inputs(2, 2, 256, 128, 64, torch.bfloat16, seed=11)
    checker.check_attention("O", run_attention(q, k, v, 0.3), q, k, v, 0.3)


@pytest.mark.gpu_blackwell
def test_attention_reads_transposed_bshd_views():
    # Q, K, V stored as (B, S, H, D) and passed as (B, H, S, D) views.
    B, H, Sq, Sk, D = 2, 3, 256, 128, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = [
        torch.randn(B, S, H, D, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
        for S in (Sq, Sk, Sk)
    ]
    assert not q.is_contiguous() and q.stride(-1) == 1
    checker.check_attention("O", run_attention(q, k, v), q, k, v)


@pytest.mark.gpu_blackwell
def test_stage_package_dispatches_to_blackwell():
    from stages.stage3_softmax import attention

    q, k, v = inputs.attention_inputs(1, 2, 256, 128, 128, torch.bfloat16, seed=3)
    checker.check_attention(
        "O", checker.run_with_deadline(lambda: attention(q, k, v), seconds=120), q, k, v
    )


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_ATTENTION_INPUTS)
def test_rejects_bad_input(case):
    case.check(blackwell.attention)


@needs_cuda
def test_rejects_more_than_one_kv_tile_and_points_to_stage_4():
    with pytest.raises(ValueError, match=r"Sk = k.shape\[2\] = 256 is larger than 128 .*stage 4"):
        blackwell.attention(*attention_cases.qkv(Sk=256))


@needs_cuda
def test_rejects_q_length_that_is_not_whole_tiles():
    with pytest.raises(ValueError, match=r"Sq = q.shape\[2\] = 200 must be a multiple of 128"):
        blackwell.attention(*attention_cases.qkv(Sq=200))
