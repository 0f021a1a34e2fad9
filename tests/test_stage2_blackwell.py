"""Stage 2 (Blackwell): S = scale * Q @ K^T per (batch, head) on sm_100a, Q resident, K streaming.

- Compile-only tests need no GPU: the sm_100a PTX must hold the rank-4 TMA loads, the
  tcgen05.mma of one S tile (D / 16 of them), TMEM allocation and the tcgen05.ld epilogue, its
  stores 16-byte vectors only (predicated at the edges of S), and tcgen05.dealloc after
  tcgen05.fence::before_thread_sync and the softmax warps' barrier. Dynamic layouts: Sq and Sk
  that are not tile multiples compile to the very same PTX, and so do the layouts qk() launches
  with (to_cute of real tensors, here CPU ones). They run in CI.
- tcgen05 fences at the TMEM hand-offs (common/tmem.py): their exact count, and every path from
  an mbarrier wait to a tcgen05 op, or from tcgen05.wait::ld to an arrive, fenced
  (tests/blackwell_ptx.py).
- GPU test (marker gpu_blackwell): S launched as the corner of a larger NaN buffer, through the
  kernel class itself, so that a store past Sq or Sk fails. As of 2026-12-01 no sm_100 GPU was
  available: it has not run yet.
- The numerics against the fp64 reference and the bad-input tests run on both tracks in
  tests/test_stage2.py.
"""

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id, shape_id
from blackwell_ptx import assert_tcgen05_fences, assert_tmem_freed_after_fence, global_stores
from ptxas_checks import ptxas_ran
from test_stage2 import check_s

from common.compile import cached_compile
from common.cute_interop import current_stream, cute_dtype, fake_stream, to_cute
from common.tools import inputs, verify
from common.tools.ptx import compile_for_arch, compile_only
from stages.stage2_qk import blackwell

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
    # tcgen05 fences (common/tmem.py): after the MMA warp's wait for S to be read ((a)) and the
    # softmax warps' wait for S complete ((d)); before their release of S ((a)) and before the
    # barrier that frees TMEM.
    assert_tcgen05_fences(ptx, before=2, after=2)
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
    if ptxas_ran(report.resources, "sm_100a"):
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
    check_s(s, q, k)
    assert torch.isnan(big[:, :, Sq:]).all() and torch.isnan(big[:, :, :Sq, Sk:]).all()
