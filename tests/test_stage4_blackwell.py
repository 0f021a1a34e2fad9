"""Stage 4 (Blackwell): O = softmax(scale * Q K^T) V for any Sk, K and V through one shared ring,
exact two-pass softmax, on sm_100a.

- Compile-only tests need no GPU and run in CI: the sm_100a PTX must hold the QK tcgen05.mma
  (A and B from shared memory) of both passes and the PV tcgen05.mma with A = P from TMEM
  (`tcgen05.mma... [d_tmem], [a_tmem], b_desc`), TMEM allocation, tcgen05.ld of S (twice) and
  O, tcgen05.st of P, TMA loads of Q, K (twice) and V, each arming its own tile's bytes (the
  faulty ring of its docstring armed Q + K), and mbarrier waits. The ring schedule itself is
  checked in tests/test_schedule.py.
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
  tests/test_stage4.py.
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
from stages.stage4_kv_interleave import blackwell

# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 512, 1024, 128), (2, 4, 512, 1024, 64), (1, 2, 256, 300, 128), (1, 2, 200, 300, 64)],
    ids=shape_id,
)
def test_compiles_for_sm100a(dtype, shape):
    B, H, Sq, Sk, D = shape
    report = compile_only(4, "blackwell", dtype=dtype, shape=shape)
    counts, ptx = report.counts, report.ptx
    assert ".target sm_100a" in ptx
    assert counts["wgmma.mma_async"] == 0
    # S = Q @ K^T in pass 1 and again in pass 2 (two loops over the KV tiles): D / 16 MMAs each,
    # A (Q) and B (K) from shared memory.
    assert len(QK_MMA.findall(ptx)) == 2 * (D // 16), report.summary()
    # O += P @ V in pass 2: 8 MMAs 128 x D x 16, A = P read from TMEM.
    assert len(PV_MMA.findall(ptx)) == 128 // 16, report.summary()
    assert counts["tcgen05.mma"] == 2 * (D // 16) + 8, report.summary()
    assert counts["tcgen05.alloc"] == 1 and counts["tcgen05.dealloc"] == 1, report.summary()
    assert_tmem_freed_after_fence(ptx)
    # tcgen05 fences (common/tmem.py): stage 3's, with the QK MMAs' and the loads and release of
    # S in both passes: after a wait, before QK (2), PV, the loads of S (2) and O and the store
    # of P; before the release of S (2) and O, the hand-over of P, the barrier that frees TMEM.
    assert_tcgen05_fences(ptx, before=5, after=7)
    # tcgen05.ld: S in each pass (4 loads of 32 columns) and O once (D / 32), each waited for.
    assert counts["tcgen05.ld"] == 2 * (128 // 32) + D // 32, report.summary()
    assert "tcgen05.ld.sync.aligned.32x32b.x32.b32" in ptx
    assert ptx.count("tcgen05.wait::ld") == 2 + D // 32
    # tcgen05.st: P in pass 2, 2 stores of 32 cells, then wait::st.
    assert counts["tcgen05.st"] == 2 and "tcgen05.st.sync.aligned.32x32b.x32.b32" in ptx, (
        report.summary()
    )
    assert ptx.count("tcgen05.wait::st") == 1
    # tcgen05.commit: pass 1 S full and K free; pass 2 S full, K free, P free, V free; Q free; O full.
    assert counts["tcgen05.commit"] == 8, report.summary()
    # TMA: Q, K (pass 1), K and V (pass 2), D / 64 boxes each.
    assert re.search(r"cp\.async\.bulk\.tensor\.[34]d\.shared::cta\.global", ptx)
    assert counts["cp.async.bulk.tensor (load)"] == 4 * (D // 64), report.summary()
    # Each load site arms exactly its own tile: 128 x D x 2 bytes (a faulty ring armed Q + K).
    assert expect_tx_immediates(ptx) == [128 * D * 2] * 4
    # Barriers: full + empty for Q (1), the K/V ring (2 slots), S, P and O (1 each).
    assert counts["mbarrier.init"] == 2 * (1 + 2 + 1 + 1 + 1), report.summary()
    assert counts["mbarrier.try_wait"] >= 8, report.summary()
    # exp2 of every score in each pass, plus the row_sum rescale of pass 1
    assert counts["ex2.approx"] >= 2 * 128 + 1, report.summary()
    # O leaves in predicated 16-byte stores, none narrower: D / 32 loads of 32 values, 4 stores
    # each (D / 8 in all).
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8), report.summary()
    # Q + 2 ring slots, 128 x D x 2 bytes each, plus 1 KiB for the barriers, whatever Sk is.
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
    whole = compile_only(4, "blackwell", dtype=dtype, shape=(2, 4, 512, 1024, D))
    ragged = compile_only(4, "blackwell", dtype=dtype, shape=(3, 5, 200, 300, D))
    assert ragged.ptx == whole.ptx
    if ragged.resources is None:
        pytest.skip("ptxas is not installed: the register count is not checked")
    if ragged.resources.get("ptxas_too_old"):
        pytest.skip(ragged.resources["error"])
    assert "registers" in ragged.resources, ragged.resources
    # Before (static layouts, one compile per shape, the mask compiled into every KV tile when
    # Sk % 128 != 0): 167 registers; now 189-190 (bf16) / 195 (fp16) for every Sk, the mask
    # behind a run-time branch (ptxas of CUDA 13.0, 2026-12-01). 200 leaves margin for another
    # ptxas.
    assert ragged.resources["registers"] <= 200, ragged.summary()
    assert ragged.resources["spill_stores"] == 0, ragged.summary()


def test_launch_layouts_store_o_in_16_byte_vectors():
    # attention() wraps real tensors with to_cute(dynamic=True), whose strides carry no
    # divisibility; the kernel states it (rows_of_16_bytes) and must store O as with the fake
    # tensors. CPU tensors have the same layouts, and compiling needs no GPU.
    B, H, Sq, Sk, D = 2, 3, 200, 300, 64
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
    B, H, Sq, Sk, D = 2, 3, 200, 260, 128
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, torch.bfloat16, seed=12)
    big = torch.full((B, H, Sq + 128, D), float("nan"), dtype=q.dtype, device=q.device)
    o = big[:, :, :Sq]
    args = [to_cute(t, dynamic=True) for t in (q, k, v, o)]
    args += [D**-0.5 * math.log2(math.e), current_stream()]
    kernel = blackwell.Sm100Kernel(cute_dtype(q.dtype), D)
    verify.run_with_deadline(lambda: cached_compile(kernel, *args)(*args), seconds=120)
    verify.check_attention("O", o, q, k, v)
    assert torch.isnan(big[:, :, Sq:]).all()
