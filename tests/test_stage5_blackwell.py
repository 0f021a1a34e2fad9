"""Stage 5 (Blackwell): online softmax, O = softmax(scale * Q K^T) V in one pass over the KV
tiles with O rescaled in TMEM, plus LSE, on sm_100a.

- Compile-only tests need no GPU and run in CI: the sm_100a PTX must hold the QK tcgen05.mma
  (shared-memory A and B) once per KV tile and the PV tcgen05.mma with A = P from TMEM
  (`tcgen05.mma... [d_tmem], [a_tmem], b_desc`), TMEM allocation, tcgen05.ld of S and of O
  (rescale and epilogue), tcgen05.st of P and of the rescaled O, TMA loads of Q, K and V (K
  once, not twice: half of stage 4's QK MMAs), each arming its own tile's bytes, the LSE
  (lg2 and a 32-bit store per row), and mbarrier waits. The ring schedule itself is checked in
  tests/test_schedule.py.
- Compile-only, shapes and layouts: Sq and Sk that are not multiples of 128 compile to the very
  same PTX as tile multiples (dynamic layouts, one compile per (dtype, D)), within 200 ptxas
  registers (checked when ptxas is installed); the layouts attention() launches with (to_cute
  of real tensors, here CPU ones, K and V also .expand-ed over batch and heads) store O in the same 16-byte vectors as the fake tensors;
  tcgen05.dealloc comes after tcgen05.fence::before_thread_sync and the softmax warps' barrier.
- tcgen05 fences at the TMEM hand-offs (common/tmem.py): their exact count, and every path from
  an mbarrier wait to a tcgen05 op, or from tcgen05.wait::ld / ::st to an arrive, fenced
  (tests/blackwell_ptx.py).
- GPU test (marker gpu_blackwell): O and LSE launched as the first Sq rows of longer NaN
  buffers, through the kernel class itself, so that a store past Sq fails. As of 2026-12-01 no
  sm_100 GPU was available: it has not run yet.
- The numerics against the fp64 reference and the bad-input tests run on both tracks in
  tests/test_stage5.py.
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
from stages.stage5_online_softmax import blackwell

# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 512, 1024, 128), (2, 4, 512, 1024, 64), (1, 2, 256, 300, 64), (1, 2, 200, 300, 128)],
    ids=shape_id,
)
def test_compiles_for_sm100a(dtype, shape):
    B, H, Sq, Sk, D = shape
    report = compile_only(5, "blackwell", dtype=dtype, shape=shape)
    counts, ptx = report.counts, report.ptx
    assert ".target sm_100a" in ptx
    assert counts["wgmma.mma_async"] == 0
    # One loop over the KV tiles: S = Q @ K^T (D / 16 MMAs, A and B from shared memory), then
    # O += P @ V (8 MMAs 128 x D x 16, A = P read from TMEM).
    assert len(QK_MMA.findall(ptx)) == D // 16, report.summary()
    assert len(PV_MMA.findall(ptx)) == 128 // 16, report.summary()
    assert counts["tcgen05.mma"] == D // 16 + 8, report.summary()
    assert counts["tcgen05.alloc"] == 1 and counts["tcgen05.dealloc"] == 1, report.summary()
    assert_tmem_freed_after_fence(ptx)
    # tcgen05 fences (common/tmem.py): after a wait, before QK ((a), (d)), PV ((b), (c)), the
    # loads of S and O, and P's store with O's rescale ((d)); before the release of S ((a)) and
    # of O, the hand-over of P and O ((b), (c)), the barrier that frees TMEM.
    assert_tcgen05_fences(ptx, before=4, after=5)
    # tcgen05.ld: S (4 loads of 32 columns), O for the rescale (D / 32) and O for the epilogue
    # (D / 32), each waited for.
    assert counts["tcgen05.ld"] == 128 // 32 + 2 * (D // 32), report.summary()
    assert "tcgen05.ld.sync.aligned.32x32b.x32.b32" in ptx
    assert ptx.count("tcgen05.wait::ld") == 1 + 2 * (D // 32)
    # tcgen05.st: P (2 stores of 32 cells) and the rescaled O (D / 32 stores), one wait::st for both.
    assert counts["tcgen05.st"] == 2 + D // 32, report.summary()
    assert "tcgen05.st.sync.aligned.32x32b.x32.b32" in ptx
    assert ptx.count("tcgen05.wait::st") == 1
    # tcgen05.commit: S full, K free, P free, V free (per tile); Q free; O full.
    assert counts["tcgen05.commit"] == 6, report.summary()
    # TMA: Q, K and V once each, D / 64 boxes each.
    assert re.search(r"cp\.async\.bulk\.tensor\.[34]d\.shared::cta\.global", ptx)
    assert counts["cp.async.bulk.tensor (load)"] == 3 * (D // 64), report.summary()
    assert expect_tx_immediates(ptx) == [128 * D * 2] * 3
    assert counts["mbarrier.init"] == 2 * (1 + 2 + 1 + 1 + 1), report.summary()
    assert counts["mbarrier.try_wait"] >= 6, report.summary()
    # exp2 of every score, plus row_scale; log2 of row_sum for LSE, stored as one fp32 per row.
    assert counts["ex2.approx"] >= 128 + 1, report.summary()
    assert "lg2.approx" in ptx
    assert re.search(r"st\.global\.[bf]32\s", ptx)
    # O leaves in predicated 16-byte stores, none narrower: D / 32 loads of 32 values, 4 stores
    # each (D / 8 in all); LSE is one 32-bit store per row.
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8) + ["st.global.b32"], (
        report.summary()
    )
    assert report.shared_memory_bytes == 3 * 128 * D * 2 + 1024, report.summary()
    if ptxas_ran(report.resources, "sm_100a"):
        assert report.resources["spill_stores"] == 0 and report.resources["spill_loads"] == 0, (
            report.summary()
        )


def test_one_pass_halves_the_qk_work_of_stage_4():
    # The same problem compiled for stage 4 and stage 5: K is loaded and multiplied once, not twice.
    shape = (2, 4, 512, 1024, 128)
    s4 = compile_only(4, "blackwell", shape=shape)
    s5 = compile_only(5, "blackwell", shape=shape)
    assert 2 * len(QK_MMA.findall(s5.ptx)) == len(QK_MMA.findall(s4.ptx))
    assert len(PV_MMA.findall(s5.ptx)) == len(PV_MMA.findall(s4.ptx))
    assert (
        4 * s5.counts["cp.async.bulk.tensor (load)"] == 3 * s4.counts["cp.async.bulk.tensor (load)"]
    )
    assert s5.counts["ex2.approx"] < s4.counts["ex2.approx"]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_every_shape_compiles_to_one_kernel_within_200_registers(dtype, D):
    # Dynamic layouts: B, H, Sq, Sk are run-time values, so tile multiples and ragged Sq, Sk
    # compile to the same PTX, one compile per (dtype, D). The keys beyond Sk are masked only in
    # the KV tile that crosses Sk, behind a run-time branch.
    whole = compile_only(5, "blackwell", dtype=dtype, shape=(2, 4, 512, 1024, D))
    ragged = compile_only(5, "blackwell", dtype=dtype, shape=(3, 5, 200, 300, D))
    assert ragged.ptx == whole.ptx
    if ragged.resources is None:
        pytest.skip("ptxas is not installed: the register count is not checked")
    if ragged.resources.get("ptxas_too_old"):
        pytest.skip(ragged.resources["error"])
    assert "registers" in ragged.resources, ragged.resources
    # Before (static layouts, one compile per shape, the mask compiled into every KV tile when
    # Sk % 128 != 0): at D = 64, 237 (bf16) / 255 (fp16) registers with Sk = 300 against 161 /
    # 187 with Sk = 1024; now 163 / 192 for every Sk and both D, the mask behind a run-time
    # branch taken by the last KV tile only (ptxas of CUDA 13.0, 2026-12-01). 200 leaves margin
    # for another ptxas.
    assert ragged.resources["registers"] <= 200, ragged.summary()
    assert ragged.resources["spill_stores"] == 0, ragged.summary()


@pytest.mark.parametrize("expanded_kv", [False, True], ids=["kv", "kv_expanded"])
def test_launch_layouts_store_o_in_16_byte_vectors(expanded_kv):
    # attention() wraps real tensors with to_cute(dynamic=True), whose strides carry no
    # divisibility; the kernel states it (rows_of_16_bytes) and must store O as with the fake
    # tensors. CPU tensors have the same layouts, and compiling needs no GPU.
    B, H, Sq, Sk, D = 2, 3, 200, 300, 64
    q, k, v = attention_cases.qkv("cpu", B=B, H=H, Sq=Sq, Sk=Sk, D=D)
    if expanded_kv:
        # K and V of one head and batch, .expand-ed over both: strides 0 (a static 0 in the layout)
        k, v = (t[:1, :1].expand(B, H, Sk, D) for t in (k, v))
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Sq)
    args = [to_cute(t, dynamic=True) for t in (q, k, v, o, lse)] + [0.18, fake_stream()]
    ptx, _ = compile_for_arch(blackwell.Sm100Kernel(cute_dtype(q.dtype), D), args, "sm_100a")
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8) + ["st.global.b32"]


# ---------------------------------------------------------------- numerics on an sm_100 GPU


@pytest.mark.gpu_blackwell
def test_attention_writes_nothing_outside_o():
    # The last Q tile sticks out of Sq. Launched on O and LSE as the first Sq rows of NaN buffers
    # 128 rows longer per (b, h), the kernel must leave the other rows NaN.
    B, H, Sq, Sk, D = 2, 3, 200, 260, 128
    q, k, v = inputs.attention_inputs(B, H, Sq, Sk, D, torch.bfloat16, seed=12)
    big = torch.full((B, H, Sq + 128, D), float("nan"), dtype=q.dtype, device=q.device)
    big_lse = torch.full((B, H, Sq + 128), float("nan"), device=q.device)
    o, lse = big[:, :, :Sq], big_lse[:, :, :Sq]
    args = [to_cute(t, dynamic=True) for t in (q, k, v, o, lse)]
    args += [D**-0.5 * math.log2(math.e), current_stream()]
    kernel = blackwell.Sm100Kernel(cute_dtype(q.dtype), D)
    verify.run_with_deadline(lambda: cached_compile(kernel, *args)(*args), seconds=120)
    verify.check_attention("O", o, q, k, v, lse=lse)
    assert torch.isnan(big[:, :, Sq:]).all() and torch.isnan(big_lse[:, :, Sq:]).all()
