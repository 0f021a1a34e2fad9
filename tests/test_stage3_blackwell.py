"""Stage 3 (Blackwell): O = softmax(scale * Q K^T) V for one KV tile (Sk <= 128) on sm_100a.

- Compile-only tests need no GPU and run in CI: the sm_100a PTX must hold both forms of
  tcgen05.mma (QK with A and B from shared memory, PV with A = P from TMEM:
  `tcgen05.mma... [d_tmem], [a_tmem], b_desc`), TMEM allocation, the tcgen05.ld of S and O, the
  tcgen05.st of P, TMA loads of Q, K and V with their byte counts, and mbarrier waits.
- Compile-only, shapes and layouts: Sq and Sk that are not multiples of 128 compile to the very
  same PTX as tile multiples (dynamic layouts, one compile per (dtype, D)), within 200 ptxas
  registers (checked when ptxas is installed); the layouts attention() launches with (to_cute
  of real tensors, here CPU ones) store O in the same 16-byte vectors as the fake tensors;
  tcgen05.dealloc comes after tcgen05.fence::before_thread_sync and the softmax warps' barrier.
- tcgen05 fences at the TMEM hand-offs (common/tmem.py): their exact count, and every path from
  an mbarrier wait to a tcgen05 op, or from tcgen05.wait::ld / ::st to an arrive, fenced
  (tests/blackwell_ptx.py).
- GPU test (marker gpu_blackwell): O launched as the first Sq rows of a longer NaN buffer,
  through the kernel class itself, so that a store past Sq fails. As of 2026-12-01 no sm_100 GPU
  was available: it has not run yet.
- The numerics against the fp64 reference and the bad-input tests run on both tracks in
  tests/test_stage3.py.
"""

import math
import re

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id, shape_id
from blackwell_ptx import (
    PV_MMA,
    QK_MMA,
    assert_tcgen05_fences,
    assert_tmem_freed_after_fence,
    global_stores,
)
from ptxas_checks import ptxas_ran

from common.compile import cached_compile
from common.cute_interop import current_stream, cute_dtype, fake_stream, to_cute
from common.tools import inputs, verify
from common.tools.ptx import compile_for_arch, compile_only, expect_tx_immediates
from stages.stage3_softmax import blackwell

# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 512, 128, 128), (2, 4, 512, 128, 64), (1, 2, 256, 100, 128), (1, 2, 200, 100, 64)],
    ids=shape_id,
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
    assert_tmem_freed_after_fence(ptx)
    # tcgen05 fences (common/tmem.py). After a wait: the MMA warp's, before QK ((a)) and PV
    # ((b)); the softmax warps', before the loads of S and O and the store of P ((d)). Before an
    # arrive: the release of S ((a)) and of O, the hand-over of P ((b)), the barrier that frees
    # TMEM.
    assert_tcgen05_fences(ptx, before=4, after=5)
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
    # O leaves in predicated 16-byte stores, none narrower: D / 32 loads of 32 values, 4 stores
    # each (D / 8 in all).
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8), report.summary()
    # Q + K + V, 128 x D x 2 bytes each, plus 1 KiB for the barriers.
    assert report.shared_memory_bytes == 3 * 128 * D * 2 + 1024, report.summary()
    if ptxas_ran(report.resources, "sm_100a"):
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_every_shape_compiles_to_one_kernel_within_200_registers(dtype, D):
    # Dynamic layouts: B, H, Sq, Sk are run-time values, so tile multiples and ragged Sq, Sk
    # compile to the same PTX, one compile per (dtype, D). The keys beyond Sk are masked only in
    # the KV tile that crosses Sk, behind a run-time branch.
    whole = compile_only(3, "blackwell", dtype=dtype, shape=(2, 4, 512, 128, D))
    ragged = compile_only(3, "blackwell", dtype=dtype, shape=(3, 5, 200, 100, D))
    assert ragged.ptx == whole.ptx
    if ragged.resources is None:
        pytest.skip("ptxas is not installed: the register count is not checked")
    if ragged.resources.get("ptxas_too_old"):
        pytest.skip(ragged.resources["error"])
    assert "registers" in ragged.resources, ragged.resources
    # Before (static layouts, one compile per shape, the mask compiled in when Sk % 128 != 0):
    # 155 (bf16) / 190 (fp16) registers at Sk = 128 and 153 / 153 at Sk = 100; now 157 / 188 for
    # every Sk (ptxas of CUDA 13.0, 2026-12-01). 200 leaves margin for another ptxas.
    assert ragged.resources["registers"] <= 200, ragged.summary()
    assert ragged.resources["spill_stores"] == 0, ragged.summary()


def test_launch_layouts_store_o_in_16_byte_vectors():
    # attention() wraps real tensors with to_cute(dynamic=True), whose strides carry no
    # divisibility; the kernel states it (rows_of_16_bytes) and must store O as with the fake
    # tensors. CPU tensors have the same layouts, and compiling needs no GPU.
    B, H, Sq, Sk, D = 2, 3, 200, 100, 64
    q, k, v = attention_cases.qkv("cpu", B=B, H=H, Sq=Sq, Sk=Sk, D=D)
    o = torch.empty_like(q)
    args = [to_cute(t, dynamic=True) for t in (q, k, v, o)] + [0.18, fake_stream()]
    ptx, _ = compile_for_arch(blackwell.Sm100Kernel(cute_dtype(q.dtype), D), args, "sm_100a")
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8)


# ---------------------------------------------------------------- numerics on an sm_100 GPU


@pytest.mark.gpu_blackwell
def test_attention_writes_nothing_outside_o():
    # The last Q tile sticks out of Sq. Launched on O as the first Sq rows of NaN buffers
    # 128 rows longer per (b, h), the kernel must leave the other rows NaN.
    B, H, Sq, Sk, D = 2, 3, 200, 77, 128
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, torch.bfloat16, seed=12)
    big = torch.full((B, H, Sq + 128, D), float("nan"), dtype=q.dtype, device=q.device)
    o = big[:, :, :Sq]
    args = [to_cute(t, dynamic=True) for t in (q, k, v, o)]
    args += [D**-0.5 * math.log2(math.e), current_stream()]
    kernel = blackwell.Sm100Kernel(cute_dtype(q.dtype), D)
    verify.run_with_deadline(lambda: cached_compile(kernel, *args)(*args), seconds=120)
    verify.check_attention("O", o, q, k, v)
    assert torch.isnan(big[:, :, Sq:]).all()
