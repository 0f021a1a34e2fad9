"""Stage 2 (Blackwell): S = scale * Q @ K^T per (batch, head) on sm_100a, Q resident, K streaming.

- Compile-only tests need no GPU: the sm_100a PTX must hold the rank-4 TMA loads, the
  tcgen05.mma of one S tile (D / 16 of them), TMEM allocation and the tcgen05.ld epilogue, its
  stores 16-byte vectors only (predicated at the edges of S), and tcgen05.dealloc after
  tcgen05.fence::before_thread_sync and the softmax warps' barrier. Dynamic layouts: Sq and Sk
  that are not tile multiples compile to the very same PTX, and so do the layouts qk() launches
  with (to_cute of real tensors, here CPU ones). They run in CI.
- GPU tests (marker gpu_blackwell) compare S with an fp64 reference for head dims 64 and 128,
  several (B, H, Sq, Sk) including Sq and Sk that are not multiples of 128 and Sq = 1, bf16 and
  fp16, the default and an explicit scale, and Q/K given as transposed views of (B, S, H, D)
  tensors. S is poisoned with NaN before the launch, and one test launches into the corner of a
  larger NaN buffer so that a store past Sq or Sk fails. As of 2026-12-01 no sm_100 GPU was
  available: these tests have not run yet.
- Bad-input tests: every error names the argument; the CPU-tensor ones run in CI. The cases
  common to stages 2-5 are in tests/attention_cases.py; this file adds its stage's own limits.
"""

import re

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id, needs_cuda, shape_id

from common.compile import cached_compile
from common.cute_interop import current_stream, cute_dtype, fake_stream, to_cute
from common.tools import inputs, reference, verify
from common.tools.ptx import compile_for_arch, compile_only
from stages.stage2_qk import blackwell


def global_stores(ptx):
    """The st.global statements of the PTX, their opcode only (st.global.v4.b32, ...)."""
    return [ln.split()[0] for ln in ptx.splitlines() if ln.strip().startswith("st.global")]


def assert_tmem_freed_after_fence(ptx):
    """tcgen05.dealloc comes after tcgen05.fence::before_thread_sync and the softmax warps'
    named barrier (bar.sync 1, 128), and the fence after every tcgen05.ld and tcgen05.st."""
    lines = ptx.splitlines()

    def where(pattern):
        return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]

    (fence,) = where(r"tcgen05\.fence::before_thread_sync")
    (dealloc,) = where(r"tcgen05\.dealloc")
    assert max(where(r"tcgen05\.(ld|st)\.")) < fence < dealloc
    assert any(re.search(r"\bbar(rier)?\.sync\s+1,\s*128;", ln) for ln in lines[fence:dealloc])


# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape", [(2, 4, 512, 512, 128), (2, 4, 512, 384, 64), (1, 2, 200, 132, 64)], ids=shape_id
)
def test_compiles_for_sm100a(dtype, shape):
    B, H, Sq, Sk, D = shape
    report = compile_only(2, "blackwell", dtype=dtype, shape=shape)
    counts, ptx = report.counts, report.ptx
    assert ".target sm_100a" in ptx
    # One S tile = D / 16 tcgen05.mma 128 x 128 x 16, in the (not unrolled) loop over K tiles.
    assert counts["tcgen05.mma"] == D // 16, report.summary()
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx
    assert counts["wgmma.mma_async"] == 0
    assert counts["tcgen05.alloc"] == 1 and counts["tcgen05.dealloc"] == 1, report.summary()
    assert_tmem_freed_after_fence(ptx)
    # tcgen05.commit: S complete and K slot free (per K tile), Q free (once).
    assert counts["tcgen05.commit"] == 3, report.summary()
    # The softmax warps read each S tile in 4 loads of 32 fp32 columns, each waited for.
    assert counts["tcgen05.ld"] == 4 and "tcgen05.ld.sync.aligned.32x32b.x32.b32" in ptx, (
        report.summary()
    )
    assert ptx.count("tcgen05.wait::ld") == 4
    # Each load's 32 fp32 values (128 bytes of a row of S) leave in 8 predicated 16-byte stores,
    # none narrower: 4 loads x 8 = 32 in the (not unrolled) loop over K tiles.
    assert global_stores(ptx) == ["st.global.v4.b32"] * 32, report.summary()
    # Rank-4 TMA over (S, D, H, B): a 128 x D tile is D / 64 boxes of 128-byte rows, for Q
    # (once) and for K (per K tile).
    assert "cp.async.bulk.tensor.4d" in ptx
    assert counts["cp.async.bulk.tensor (load)"] == 2 * (D // 64), report.summary()
    # Barriers: full + empty for Q (1 buffer), the K ring (kv_slots = 2) and S (1 tile).
    assert counts["mbarrier.init"] == 2 * (1 + 2 + 1), report.summary()
    assert "mbarrier.arrive.expect_tx" in ptx and counts["mbarrier.try_wait"] >= 4
    # Q + 2 K slots, 128 x D x 2 bytes each, plus 1 KiB for the barriers.
    assert report.shared_memory_bytes == 3 * 128 * D * 2 + 1024, report.summary()
    if report.resources and "spill_stores" in report.resources:
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )
    assert report.seconds < 60, report.summary()


@pytest.mark.parametrize("D", [64, 128])
def test_every_shape_compiles_to_one_kernel(D):
    # Dynamic layouts: B, H, Sq, Sk are run-time values, one compile per (dtype, D).
    whole = compile_only(2, "blackwell", shape=(2, 4, 512, 512, D), resources=False)
    ragged = compile_only(2, "blackwell", shape=(3, 5, 1, 132, D), resources=False)
    assert ragged.ptx == whole.ptx


def test_launch_layouts_store_s_in_16_byte_vectors():
    # qk() wraps real tensors with to_cute(dynamic=True), whose strides carry no divisibility;
    # the kernel states it (rows_of_16_bytes) and must store S as with the fake tensors.
    q, k, _ = attention_cases.qkv("cpu", B=2, H=3, Sq=200, Sk=132)
    s = torch.empty(2, 3, 200, 132)
    args = [to_cute(t, dynamic=True) for t in (q, k, s)] + [0.125, fake_stream()]
    ptx, _ = compile_for_arch(blackwell.Sm100Kernel(cute_dtype(q.dtype), 64), args, "sm_100a")
    assert global_stores(ptx) == ["st.global.v4.b32"] * 32


# ---------------------------------------------------------------- numerics on an sm_100 GPU


SHAPES = [
    (1, 1, 128, 128, 64),  # one CTA, one K tile
    (1, 1, 128, 128, 128),
    (2, 4, 512, 512, 64),
    (2, 4, 512, 512, 128),
    (3, 5, 256, 1024, 128),  # 15 heads; 8 K tiles: each of the 2 slots reused 4 times
    (1, 2, 1024, 256, 64),  # 8 Q tiles per head, 2 K tiles
    (4, 8, 128, 384, 64),  # 3 K tiles: an odd number through the 2-slot ring
    (2, 3, 200, 260, 128),  # tails: Sq = 128 + 72, Sk = 2 x 128 + 4
    (1, 2, 1, 4, 128),  # one query, four keys
    (2, 2, 1000, 1000, 64),
]


def run_qk(q, k, scale=None):
    return verify.run_with_deadline(
        lambda: blackwell.qk(q, k, scale), seconds=120, what="stage 2 blackwell qk"
    )


def check_qk(q, k, s, scale=None):
    # Products of bf16/fp16 values are exact in fp32 and S is stored in fp32: the only error is
    # the tensor core's fp32 accumulation over D terms (its own order and truncation, around
    # 1e-7 to 1e-6 relative). 1e-4 leaves margin yet fails S rounded to bf16 (~2e-3 relative)
    # or a scale off by 1% (~1e-2). PyTorch's bf16 matmul rounds S to bf16, so its error is no
    # yardstick here.
    B, H, Sq, D = q.shape
    assert s.shape == (B, H, Sq, k.shape[2]) and s.dtype == torch.float32
    return verify.check_close("S", s, reference.qk_ref(q, k, scale), rtol=1e-4)


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_qk_matches_fp64_reference(shape, dtype):
    B, H, Sq, Sk, D = shape
    q, k, _ = inputs.attention_inputs(B, H, Sq, Sk, D, dtype, seed=B + H + Sq + Sk + D)
    check_qk(q, k, run_qk(q, k))


@pytest.mark.gpu_blackwell
def test_qk_explicit_scale():
    q, k, _ = inputs.attention_inputs(2, 2, 256, 256, 64, torch.bfloat16, seed=11)
    check_qk(q, k, run_qk(q, k, 0.3), 0.3)


@pytest.mark.gpu_blackwell
def test_qk_reads_transposed_bshd_views():
    # Q, K stored as (B, S, H, D) and passed as (B, H, S, D) views: S stride H * D, H stride D.
    B, H, Sq, Sk, D = 2, 3, 256, 384, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q_bshd = torch.randn(B, Sq, H, D, generator=g, device="cuda").to(torch.bfloat16)
    k_bshd = torch.randn(B, Sk, H, D, generator=g, device="cuda").to(torch.bfloat16)
    q, k = q_bshd.transpose(1, 2), k_bshd.transpose(1, 2)
    assert not q.is_contiguous() and q.stride(-1) == 1
    check_qk(q, k, run_qk(q, k))


@pytest.mark.gpu_blackwell
def test_qk_writes_nothing_outside_s():
    # The last Q tile and the last K tile stick out of S. Launched on S as the corner of a NaN
    # buffer 128 rows and 4 columns larger per (b, h), the kernel must leave the rest NaN.
    B, H, Sq, Sk, D = 2, 3, 200, 260, 64
    q, k, _ = inputs.attention_inputs(B, H, Sq, Sk, D, torch.bfloat16, seed=12)
    big = torch.full((B, H, Sq + 128, Sk + 4), float("nan"), device=q.device)
    s = big[:, :, :Sq, :Sk]
    args = [to_cute(t, dynamic=True) for t in (q, k, s)] + [D**-0.5, current_stream()]
    kernel = blackwell.Sm100Kernel(cute_dtype(q.dtype), D)
    verify.run_with_deadline(lambda: cached_compile(kernel, *args)(*args), seconds=120)
    check_qk(q, k, s)
    assert torch.isnan(big[:, :, Sq:]).all() and torch.isnan(big[:, :, :Sq, Sk:]).all()


@pytest.mark.gpu_blackwell
def test_stage_package_dispatches_to_blackwell():
    from stages.stage2_qk import qk

    q, k, _ = inputs.attention_inputs(1, 2, 256, 256, 128, torch.bfloat16, seed=3)
    check_qk(q, k, verify.run_with_deadline(lambda: qk(q, k), seconds=120))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", attention_cases.BAD_QK_INPUTS)
def test_rejects_bad_input(case):
    case.check(blackwell.qk)


@needs_cuda
def test_rejects_sk_that_breaks_16_byte_rows():
    with pytest.raises(ValueError, match=r"Sk = k.shape\[2\] = 130 must be a multiple of 4"):
        blackwell.qk(*attention_cases.qkv(Sk=130)[:2])
