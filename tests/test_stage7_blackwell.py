"""Stage 7 (Blackwell): GQA / MQA and packed variable-length sequences, on sm_100a.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch mode and packed, with KV heads
  and a mask: stage 6's loop body (the same counts of MMAs, TMEM loads and stores, commits,
  TMA loads, arrives and exp2), its mask behind the edge branch, its epilogue that reads O only
  after an MMA; tcgen05.dealloc after the fence; O in predicated 16-byte stores; no spills,
  within 224 registers. Packed only: the MMA warp zeroes the keys of V past the sequence in
  shared memory (st.shared behind a branch: the sequence's last KV tile), then
  fence.proxy.async.shared::cta and bar.warp.sync, all after the QK MMAs and before the first PV
  MMA; batch mode has none of it. One kernel for every head count (GQA groups are run-time
  values) and every packing.
- GPU tests (marker gpu_blackwell) mirror the Hopper stage 7 tests with the same per-sequence
  fp64 references, packed inputs and packs (tests/test_stage7_hopper.py): GQA group sizes 1,
  2, 4, 8 and MQA, causal and windows, decode-like GQA; packed batches with one long and many
  short sequences, zero-length and single-token ones, ragged lengths, Sq != Sk per sequence,
  both dtypes, D = 64 and 128, LSE; NaN planted in every row outside one sequence must not
  reach it (V rows past seqlen_k are zeroed before P @ V); packed equal to batch mode. Each
  launch has a 120 s deadline. As of 2026-12-01 no sm_100 GPU was available: these tests have
  not run yet.
- Bad input: every check of the packed entry, and the head-count rule.
"""

import re

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from test_stage5_blackwell import PV_MMA, QK_MMA, assert_tmem_freed_after_fence, global_stores
from test_stage6_blackwell import (
    BRANCH,
    LOOP_FAMILIES,
    assert_mask_behind_the_edge_branch,
    epilogue_o_loads,
    skipped_by_branch,
)
from test_stage7_hopper import (
    BAD_PACKED,
    PACK_GQA_CASES,
    PACKS,
    _packed,
    check_pack_gqa,
    check_pack_gqa_varlen,
    check_packed,
    gqa_reference_check,
    pack_case_id,
    packed_inputs,
)

from common.tools import inputs, verify
from common.tools.ptx import compile_only
from stages.stage7_gqa_varlen import blackwell

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
    # O by threads in 16-byte stores, each predicated on the sequence's rows; LSE one per row.
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8) + ["st.global.b32"]
    assert report.shared_memory_bytes == six.shared_memory_bytes
    if report.resources and "registers" in report.resources:
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


def test_compile_args_rejects_unknown_options():
    with pytest.raises(TypeError, match="unknown option"):
        blackwell.compile_args(torch.bfloat16, (1, 1, 128, 128, 64), split_kv=2)


# ---------------------------------------------------------------- numerics on an sm_100 GPU


def run(fn):
    return verify.run_with_deadline(fn, seconds=120, what="stage 7 blackwell")


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "H, Hkv", [(8, 8), (8, 4), (8, 2), (16, 2), (8, 1)], ids=["mha", "g2", "g4", "g8", "mqa"]
)
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (100, 0))])
def test_gqa_matches_fp64_reference(H, Hkv, dtype, causal, window):
    q, _, _ = inputs.attention_inputs(2, H, 300, 300, 128, dtype, seed=H + Hkv)
    _, k, v = inputs.attention_inputs(2, Hkv, 300, 700, 128, dtype, seed=H * Hkv)
    o, lse = run(
        lambda: blackwell.attention(q, k, v, causal=causal, window=window, return_lse=True)
    )
    gqa_reference_check("O", o, lse, q, k, v, causal, window)


@pytest.mark.gpu_blackwell
def test_gqa_d64_decode_like():
    # Sq = 1 per head, 32 query heads on 8 KV heads, a long cache.
    q, _, _ = inputs.attention_inputs(4, 32, 1, 1, 64, seed=3)
    _, k, v = inputs.attention_inputs(4, 8, 1, 4000, 64, seed=4)
    o, lse = run(lambda: blackwell.attention(q, k, v, causal=True, return_lse=True))
    gqa_reference_check("O", o, lse, q, k, v, True, None)


@pytest.mark.gpu_blackwell
def test_gqa_needs_no_expanded_copy():
    # The same answer as K, V expanded to H heads by stride-0 views (stage 6's way).
    q, _, _ = inputs.attention_inputs(2, 8, 256, 256, 64, seed=5)
    _, k, v = inputs.attention_inputs(2, 2, 256, 512, 64, seed=6)
    o = run(lambda: blackwell.attention(q, k, v, causal=True))
    ke, ve = (t[:, :, None].expand(2, 2, 4, 512, 64).reshape(2, 8, 512, 64) for t in (k, v))
    assert torch.equal(o, run(lambda: blackwell.attention(q, ke, ve, causal=True)))


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (77, None))])
def test_packed_sequences_match_per_sequence_reference(pack, D, dtype, causal, window):
    lens_q, lens_k = PACKS[pack]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, D, dtype, seed=len(pack) + D)
    o, lse = run(
        lambda: blackwell.attention_varlen(
            q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True
        )
    )
    assert o.shape == q.shape and lse.shape == (4, q.shape[0])
    check_packed(o, lse, q, k, v, cu_q, cu_k, causal, window)


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("D", [64, 128])
def test_nan_outside_a_sequence_never_reaches_it(D):
    # Every row of Q, K and V outside sequence b is NaN: its last Q and KV tiles end inside the
    # neighbours' rows, so a Q row, a K column (masked by a select) or a V row (zeroed in shared
    # memory before P @ V) read across the boundary shows here.
    lens_q, lens_k = [200, 77, 300, 1], [130, 190, 129, 260]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, D, torch.bfloat16, seed=9)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        qn, kn, vn = q.clone(), k.clone(), v.clone()
        for t, c in ((qn, cq), (kn, ck), (vn, ck)):
            t[: c[b]] = float("nan")
            t[c[b + 1] :] = float("nan")
        o, lse = run(lambda: blackwell.attention_varlen(qn, kn, vn, cu_q, cu_k, return_lse=True))
        check_packed(o, lse, q, k, v, cu_q, cu_k, False, None, only=b)


@pytest.mark.gpu_blackwell
def test_packed_equals_batch_mode_on_equal_lengths():
    B, H, S, D = 3, 4, 300, 64
    q, k, v = inputs.attention_inputs(B, H, S, S, D, seed=12)
    o = run(lambda: blackwell.attention(q, k, v, causal=True))
    pack = lambda t: t.transpose(1, 2).reshape(B * S, H, D)  # noqa: E731
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
    op = run(lambda: blackwell.attention_varlen(pack(q), pack(k), pack(v), cu, cu, causal=True))
    assert torch.equal(op, pack(o))


@pytest.mark.gpu_blackwell
def test_all_empty_and_given_max_seqlen():
    q, k, v, cu_q, cu_k = packed_inputs([0, 0], [5, 0], 4, 4, 64, torch.bfloat16, seed=1)
    o, lse = run(lambda: blackwell.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True))
    assert o.shape == (0, 4, 64) and lse.shape == (4, 0)
    q, k, v, cu_q, cu_k = packed_inputs([100, 30], [40, 260], 4, 4, 64, torch.bfloat16, seed=2)
    o, lse = run(
        lambda: blackwell.attention_varlen(
            q, k, v, cu_q, cu_k, max_seqlen_q=512, max_seqlen_k=300, return_lse=True
        )
    )
    check_packed(o, lse, q, k, v, cu_q, cu_k, False, None)


@pytest.mark.gpu_blackwell
def test_stage_package_dispatches_to_blackwell():
    from stages.stage7_gqa_varlen import attention, attention_varlen

    q, k, v = inputs.attention_inputs(1, 4, 200, 200, 64, seed=8)
    o = run(lambda: attention(q, k[:, :2], v[:, :2], causal=True))
    gqa_reference_check("O", o, None, q, k[:, :2], v[:, :2], True, None)
    q, k, v, cu_q, cu_k = packed_inputs([10, 20], [10, 20], 4, 2, 64, torch.bfloat16, seed=3)
    o = run(lambda: attention_varlen(q, k, v, cu_q, cu_k))
    assert torch.isfinite(o).all()


# ---------------------------------------------------------------- bad input


SHARED = [c for c in attention_cases.BAD_ATTENTION_INPUTS if c.id != "heads_mismatch"]


@pytest.mark.parametrize("case", SHARED)
def test_rejects_bad_input(case):
    case.check(blackwell.attention)


@attention_cases.needs_cuda
def test_rejects_heads_that_do_not_divide():
    q, k, v = attention_cases.qkv("cuda", H=6)
    with pytest.raises(ValueError, match=r"H = 6 query heads must be a multiple of Hkv = 4"):
        blackwell.attention(q, k[:, :4], v[:, :4])


@attention_cases.needs_cuda
@pytest.mark.parametrize("name, change, error, match", BAD_PACKED, ids=[c[0] for c in BAD_PACKED])
def test_rejects_bad_packed_input(name, change, error, match):
    q, k, v, cu_q, cu_k = _packed()
    args = change(dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    with pytest.raises(error, match=match):
        blackwell.attention_varlen(**args)


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
    if report.resources and "registers" in report.resources:
        assert report.resources["spill_stores"] == 0, report.summary()


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("case", PACK_GQA_CASES, ids=pack_case_id)
def test_pack_gqa_matches_reference_and_unpacked(case):
    check_pack_gqa(blackwell, case)


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("D", [64, 128])
def test_pack_gqa_packed_sequences_with_nan_around(D):
    check_pack_gqa_varlen(blackwell, D)
