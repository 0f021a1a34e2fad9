"""Stage 7 (Blackwell): GQA / MQA and packed variable-length sequences, on sm_100a.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch mode and packed, with KV heads
  and a mask: stage 6's loop body (the same counts of MMAs, TMEM loads and stores, commits,
  TMA loads, arrives and exp2), its mask behind the edge branch, its epilogue that reads O only
  after an MMA; tcgen05.dealloc after the fence; stage 6's tcgen05 fences at the TMEM
  hand-offs, every path fenced (tests/blackwell_ptx.py); O in predicated 16-byte stores; no
  spills, within 224 registers. Packed only: the MMA warp zeroes the keys of V past the sequence in
  shared memory (st.shared behind a branch: the sequence's last KV tile), then
  fence.proxy.async.shared::cta and bar.warp.sync, all after the QK MMAs and before the first PV
  MMA; batch mode has none of it. One kernel for every head count (GQA groups are run-time
  values) and every packing.
- The numerics against the fp64 references (marker gpu_blackwell), pack-GQA on the GPU and the
  bad-input tests run on both tracks, with the same cases, in tests/test_stage7.py.
"""

import re

import pytest
import torch
from attention_cases import DTYPES, dtype_id
from blackwell_ptx import (
    PV_MMA,
    QK_MMA,
    assert_tcgen05_fences,
    assert_tmem_freed_after_fence,
    global_stores,
)
from ptxas_checks import ptxas_ran
from test_stage6_blackwell import (
    BRANCH,
    LOOP_FAMILIES,
    assert_mask_behind_the_edge_branch,
    epilogue_o_loads,
    skipped_by_branch,
)

from common.tools.ptx import compile_only

SHAPE = (2, 8, 512, 1024, 128)


def compile_stage7(dtype, D, resources=True, **options):
    return compile_only(
        7, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), resources=resources, **options
    )


# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_compiles_with_stage6_loop_body(varlen, D, dtype):
    report = compile_stage7(dtype, D, kv_heads=2, varlen=varlen, causal=True)
    six = compile_only(6, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), resources=False)
    ptx, counts = report.ptx, report.counts
    assert len(QK_MMA.findall(ptx)) == D // 16 and len(PV_MMA.findall(ptx)) == 8
    for family in LOOP_FAMILIES:
        assert counts[family] == six.counts[family], (family, counts[family], six.counts[family])
    assert_mask_behind_the_edge_branch(ptx, selects_per_score=2)
    lines, loads = epilogue_o_loads(ptx, D)
    assert all(skipped_by_branch(lines, i, i) for i in loads), loads
    assert_tmem_freed_after_fence(ptx)
    # tcgen05 fences (common/tmem.py): stage 5's, 4 before and 5 after
    assert_tcgen05_fences(ptx, before=4, after=5)
    # O by threads in 16-byte stores, each predicated on the sequence's rows; LSE one per row.
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8) + ["st.global.b32"]
    assert report.shared_memory_bytes == six.shared_memory_bytes
    if ptxas_ran(report.resources, "sm_100a"):
        # bf16 168; fp16 212 (batch) and 208 / 210 (packed, D = 64 / 128) (ptxas of CUDA 13.0,
        # 2026-12-01; stage 6: 168 and 209).
        assert report.resources["registers"] <= 224, report.summary()
        assert report.resources["spill_stores"] == 0, report.summary()
        assert report.resources["spill_loads"] == 0, report.summary()


ZERO_STORE = re.compile(r"^\s*st\.shared(\.v\d)?\.b(16|32|64)\s+\[[^\]]+\],\s*(0x0+|0|\{[0, ]+\});")


@pytest.mark.parametrize("D", [64, 128])
def test_packed_zeroes_v_past_the_sequence_before_pv(D):
    packed = compile_stage7(torch.bfloat16, D, resources=False, varlen=True, causal=True)
    batch = compile_stage7(torch.bfloat16, D, resources=False, causal=True)
    lines = packed.ptx.splitlines()

    def where(pattern):
        return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]

    stores = [i for i, ln in enumerate(lines) if ZERO_STORE.match(ln)]
    # 8 elements (16 bytes) of a key's row of V per lane and step, in a loop
    assert len(stores) == 8, stores
    assert not [i for i in where(r"^\s*st\.shared") if i not in stores]
    (fence,) = where(r"fence\.proxy\.async\.shared::cta")
    (warp_sync,) = where(r"bar\.warp\.sync")
    qk, pv = where(QK_MMA.pattern), where(PV_MMA.pattern)
    # in the MMA warp, after S = Q K^T and before O += P V: zero, fence, warp barrier, PV
    assert max(qk) < min(stores) and max(stores) < fence < warp_sync < min(pv)
    # only in the last KV tile of a sequence: the loop of stores, the fence and the warp
    # barrier inside one branch (a conditional jump from before them to after them)
    targets = [m.group(1) + ":" for m in (BRANCH.match(ln) for ln in lines[: min(stores)]) if m]
    after = {ln.strip() for ln in lines[warp_sync + 1 : min(pv)]}
    assert any(t in after for t in targets)
    # batch mode: TMA zero-fills beyond Sk, nothing to zero
    assert not re.search(r"^\s*st\.shared", batch.ptx, re.M)
    assert "fence.proxy.async" not in batch.ptx


def test_one_kernel_for_every_head_count_and_packing():
    # GQA group sizes are run-time values (the head extents of Q and K); so are the sequences.
    a = compile_stage7(torch.bfloat16, 128, resources=False, kv_heads=8)
    b = compile_stage7(torch.bfloat16, 128, resources=False, kv_heads=1, causal=True)
    assert a.ptx == b.ptx
    c = compile_stage7(torch.bfloat16, 64, resources=False, varlen=True, kv_heads=2)
    d = compile_only(
        7, "blackwell", shape=(5, 4, 100, 300, 64), resources=False, varlen=True, window=(30, 0)
    )
    assert c.ptx == d.ptx


# ---------------------------------------------------------------- pack-GQA


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_compiles_with_pack_gqa(varlen, D):
    # 4 query heads per Q tile: the loop body and the stores are the unpacked kernel's; only Q's,
    # O's and LSE's addressing and the row -> position map of the masks change.
    report = compile_stage7(
        torch.bfloat16, D, kv_heads=2, varlen=varlen, causal=True, pack_gqa=True
    )
    plain = compile_stage7(
        torch.bfloat16, D, resources=False, kv_heads=2, varlen=varlen, causal=True
    )
    assert report.ptx != plain.ptx
    for family in LOOP_FAMILIES:
        assert report.counts[family] == plain.counts[family], family
    assert len(QK_MMA.findall(report.ptx)) == D // 16 and len(PV_MMA.findall(report.ptx)) == 8
    assert global_stores(report.ptx) == ["st.global.v4.b32"] * (D // 8) + ["st.global.b32"]
    assert_tmem_freed_after_fence(report.ptx)
    # tcgen05 fences (common/tmem.py): stage 5's, 4 before and 5 after
    assert_tcgen05_fences(report.ptx, before=4, after=5)
    if ptxas_ran(report.resources, "sm_100a"):
        assert report.resources["spill_stores"] == 0, report.summary()
