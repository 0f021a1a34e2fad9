"""Stage 10 (Blackwell): QK of the next KV tile issued right behind the PV of the last one (FA4's
MMA order), and the conditional rescale of O, on sm_100a.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch mode and packed: stage 9's roles,
  setmaxnreg counts, TMEM allocation and stores; at D = 64, where P has TMEM columns of its
  own, the MMAs in FA4's order (a prologue of the first tile's two QKs, a loop of PV, QK, PV,
  QK, an epilogue of two PVs); at D = 128, where P lies over S and a QK must wait for the last
  PV to complete, stage 9's order (QK, QK, PV, PV); the threshold (8.0) compared in the
  softmax and the correction warps' vote (vote.sync.any) around their rescale; the tcgen05
  fences at the TMEM hand-offs counted, every path fenced (tests/blackwell_ptx.py); no spill
  (ptxas of CUDA 13.0, 2026-12-06), here and in stage 9's other configurations.
- CPU: the schedule checker's model of both orders finds no hang and no unbalanced barrier
  for every range, and no S written over a P that a P @ V may still read; it catches FA4's
  order with P over S and no waits (an overwrite from the second KV tile on). A model of the
  per-row arithmetic of the conditional rescale (the kernel's rule, in torch, P rounded to
  bf16 / fp16) checks the error bound the stage file states: P never above 2^8, the error no
  larger than with threshold 0, also for a max that creeps up by just under the threshold per
  tile over 300 tiles, and no fp16 overflow.
- GPU tests (marker gpu_blackwell): stage 9's numerical tests on stage 10, plus rows whose max
  grows across tiles (rescaled and skipped). Not run: no sm_100 GPU was available (2026-12-01).
"""

import math
import re

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from blackwell_ptx import (
    SPILL_CONFIGS,
    assert_no_spill,
    assert_no_spill_in,
    assert_tcgen05_fences,
)
from ptxas_checks import ptxas_ran
from test_stage7 import (
    PACK_GQA_CASES,
    PACKS,
    check_pack_gqa,
    check_packed,
    gqa_reference_check,
    pack_case_id,
    packed_inputs,
)

from common.tools import inputs, schedule, verify
from common.tools.ptx import compile_for_arch, compile_only, tcgen05_mma_order
from stages.stage10_overlap import blackwell

SHAPE = (2, 8, 512, 1024, 128)


def compile_stage10(dtype, D, resources=True, **options):
    return compile_only(
        10, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), resources=resources, **options
    )


def statements(ptx, pattern):
    return [s.strip() for s in ptx.splitlines() if re.match(pattern, s.strip())]


def mma_order(ptx):
    return tcgen05_mma_order(ptx)


# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_compiles_in_fa4_order(varlen, D, dtype):
    report = compile_stage10(dtype, D, kv_heads=2, varlen=varlen, causal=True)
    nine = compile_only(
        9, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), resources=False, varlen=varlen
    )
    ptx = report.ptx
    # each GEMM's k-blocks: one tcgen05.mma in a loop (stage 9's)
    q, p = "Q", "P"
    assert mma_order(nine.ptx) == q + q + p + p
    if D == 64:
        # FA4's order: a prologue (QK_0, QK_1), the loop (PV_0, QK_0, PV_1, QK_1), an epilogue
        assert mma_order(ptx) == (q + q) + (p + q + p + q) + (p + p)
    else:
        # P over S: stage 9's order, whose waits for a PV's completion have work queued
        assert mma_order(ptx) == q + q + p + p
    assert ".reqntid 512, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert len(statements(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+184;")) == 2
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+96;")) == 1
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+48;")) == 3
    # the correction warps' vote before each of the two tiles' rescale
    assert len(statements(ptx, r"vote\.sync\.any\.pred")) == 2
    # tcgen05 fences (common/tmem.py): stage 9's (11 before, 12 after), the fence after the
    # waits in issue_qk and issue_pv once per call: D = 64 issues each GEMM in the prologue or
    # epilogue and in the loop, 4 more after-fences than stage 9's order
    assert_tcgen05_fences(ptx, before=11, after=16 if D == 64 else 12)
    # the threshold: (m_new - m_ref) * scale_log2 <= 8.0 in each softmax warpgroup
    assert len(re.findall(r"setp\.le\.f32\s+%p\d+,\s*%\w+,\s*0f41000000;", ptx)) >= 2
    assert report.counts["ex2.approx"] == nine.counts["ex2.approx"]
    # O by threads' rows, as stage 9 (stage 12 stores it by TMA)
    assert not statements(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")
    if ptxas_ran(report.resources, "sm_100a"):
        # ptxas of CUDA 13.0 (2026-12-06): no spill
        assert_no_spill(report, registers=128)


@pytest.mark.parametrize("config", list(SPILL_CONFIGS))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_no_spill_in_any_configuration(dtype, D, config):
    """ptxas of CUDA 13.0 (2026-12-06): no spill store or load, as stage 9 (168 / 80 / 96 with
    the k-blocks unrolled: 4-236 bytes)."""
    assert_no_spill_in(10, dtype, D, config)


def test_where_p_lives():
    k64, _ = blackwell.compile_args(torch.bfloat16, (1, 1, 256, 256, 64))
    assert k64.p_own_columns and k64.tmem_p_offset == (384, 448)
    assert k64.tmem_p_offset[-1] + 64 == k64.num_tmem_alloc_cols
    k128, _ = blackwell.compile_args(torch.bfloat16, (1, 1, 256, 256, 128))
    assert not k128.p_own_columns and k128.tmem_p_offset == k128.tmem_s_offset == (0, 128)


# ---------------------------------------------------------------- the schedule, on the CPU


def traced_kernel(D):
    kernel, args = blackwell.compile_args(torch.bfloat16, (1, 2, 512, 1024, D))
    compile_for_arch(kernel, args, "sm_100a")
    return kernel


RANGES = ((0, 1), (0, 2), (0, 3), (0, 5), (2, 5), (0, 0), (3, 3))


@pytest.mark.parametrize("D", [64, 128])
def test_new_order_has_no_hang_and_no_early_overwrite(D):
    kernel = traced_kernel(D)
    assert schedule.check_cta(kernel, ranges=RANGES) == []
    assert schedule.check_kernel(kernel) == []


def _mark_over_p(program):
    """The program with each S_s commit marked as written over P_s (as if P lived over S)."""
    out = []
    for item in program:
        if isinstance(item, (schedule.PerTile, schedule.NotFirst, schedule.IfNonEmpty)):
            out.append(type(item)(_mark_over_p(item.ops)))
        elif (
            isinstance(item, schedule.Op) and item.pipe.startswith("S") and item.action == "commit"
        ):
            out.append(schedule.Op(item.pipe, "commit", f"over P{item.pipe[1:]}"))
        else:
            out.append(item)
    return tuple(out)


def test_model_catches_fa4_order_over_p_without_waits():
    # D = 64's FA4 order has no wait for P's columns, which is right only because P has columns
    # of its own: with P over S (D = 128's placement) the same order overwrites P while a PV
    # may still read it, from the second KV tile on.
    kernel = traced_kernel(64)
    assert kernel.qk_behind_pv and kernel.p_own_columns
    pipes, programs = schedule.cta_schedule(kernel)
    faulty = dict(programs, MMA=_mark_over_p(programs["MMA"]))
    found = schedule.check_cta(kernel, ranges=((0, 1), (0, 3)), programs=faulty)
    assert any("S0 of KV tile 1 overwrites P0" in v for v in found), found
    assert not any("[KV tiles [0, 1)]" in v for v in found), found
    # D = 128 keeps stage 9's order and its waits
    k128 = traced_kernel(128)
    assert not k128.qk_behind_pv and schedule.check_cta(k128, ranges=((0, 3),)) == []


# ------------------------------------------- the conditional rescale's arithmetic, modelled


def conditional_softmax_pv(s, v, scale, threshold, p_dtype, bN=128):
    """The kernel's per-row arithmetic over KV tiles of bN keys, in torch: S (rows, keys) fp32,
    V (keys, D). The reference max moves only when the row max grew by more than `threshold`
    log2 units; P = exp2(scale_log2 (S - m_ref)) rounded to p_dtype; O and the row sum in fp32,
    rescaled when m_ref moves. Returns (O, LSE, largest P, rescales per row)."""
    scale_log2 = scale * math.log2(math.e)
    rows = s.shape[0]
    m = torch.full((rows,), -math.inf, dtype=torch.float32)
    row_sum = torch.zeros(rows)
    o = torch.zeros(rows, v.shape[1])
    p_max = torch.tensor(0.0)
    moves = torch.zeros(rows, dtype=torch.int64)
    for j in range(0, s.shape[1], bN):
        t = s[:, j : j + bN]
        m_new = torch.maximum(m, t.max(dim=1).values)
        grow = (m_new - m) * scale_log2 > threshold  # NaN (both -inf) is False
        m_new = torch.where(grow, m_new, m)
        safe = torch.where(torch.isinf(m_new) & (m_new < 0), torch.zeros_like(m_new), m_new)
        factor = torch.where(m_new != m, torch.exp2((m - safe) * scale_log2), torch.ones_like(m))
        p = torch.exp2(t * scale_log2 - (safe * scale_log2)[:, None])
        p_max = torch.maximum(p_max, p.max())
        row_sum = row_sum * factor + p.sum(dim=1)
        o = o * factor[:, None] + p.to(p_dtype).float() @ v[j : j + bN].float()
        moves += (m_new != m).long()
        m = m_new
    lse = m * scale + torch.log(row_sum)
    return o / row_sum[:, None], lse, p_max, moves


def _reference(s, v, scale):
    w = torch.softmax(s.double() * scale, dim=1)
    return w @ v.double(), torch.logsumexp(s.double() * scale, dim=1)


@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("kind", ["random", "creeping", "jumps"])
def test_conditional_rescale_error_bound(kind, p_dtype):
    g = torch.Generator().manual_seed(7)
    rows, keys, D, scale = 64, 128 * 300, 64, 1 / 8
    s = torch.randn(rows, keys, generator=g) * 4
    if kind == "creeping":
        # each tile's max 7.9 log2 units above the last: the reference moves only when the
        # growth since it passed 8 (every other tile), and P comes close to 2^8 in between
        step = 7.9 / (scale * math.log2(math.e))
        ramp = torch.arange(keys // 128).repeat_interleave(128).float() * step
        s = torch.randn(rows, keys, generator=g) + (ramp - ramp[-1])
        # (the ramp ends at 0: logits from -300 x 7.9 log2 units up to 0)
    elif kind == "jumps":
        s[:, 128 * 50 :] += 200.0  # a jump far above the threshold: the reference must move
    v = torch.randn(keys, D, generator=g)
    ref_o, ref_lse = _reference(s, v, scale)
    o8, lse8, p_max8, moves8 = conditional_softmax_pv(s, v, scale, 8.0, p_dtype)
    o0, lse0, p_max0, moves0 = conditional_softmax_pv(s, v, scale, 0.0, p_dtype)
    err8 = ((o8.double() - ref_o).norm() / ref_o.norm()).item()
    err0 = ((o0.double() - ref_o).norm() / ref_o.norm()).item()
    assert torch.isfinite(o8).all() and torch.isfinite(lse8).all()
    # P never above 2^threshold (with threshold 0, never above 1)
    assert p_max8 <= 2.0**8 and p_max0 <= 1.0
    # Rounding P to 16 bits is relative: the same error with or without the threshold. The
    # bound is bf16's / fp16's relative step (2^-8 / 2^-11) averaged over the keys: both runs
    # stay within it, and the threshold costs at most 5% more than rescaling every time.
    bound = 2.0**-8 if p_dtype == torch.bfloat16 else 2.0**-11
    assert err0 < bound and err8 < bound, (err0, err8)
    assert err8 <= 1.05 * err0 + 1e-6, (err0, err8)
    assert (lse8.double() - ref_lse).abs().max() < 1e-4
    if kind == "creeping":
        # threshold 0 rescales on (nearly) every tile, 8 on about every other one; P reaches
        # above 2^7 on the tiles in between (the bound is approached, not only respected)
        assert (moves0 >= 290).all() and (moves8 <= 0.6 * moves0).all(), (moves0, moves8)
        assert p_max8 > 2.0**7
    if kind == "jumps":
        assert (moves8 >= 2).all()


def test_threshold_leaves_fp16_headroom():
    # P <= 2^8: fp16's largest finite value (65504) is 2^15.99; 16 would be the limit.
    kernel, _ = blackwell.compile_args(torch.float16, (1, 1, 128, 128, 64))
    assert 2.0**kernel.rescale_threshold < torch.finfo(torch.float16).max


# ---------------------------------------------------------------- numerics on an sm_100 GPU


def run(fn):
    return verify.run_with_deadline(fn, seconds=120, what="stage 10 blackwell")


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H, Hkv", [(8, 8), (8, 2), (8, 1)], ids=["mha", "g4", "mqa"])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (100, 0))])
def test_gqa_matches_fp64_reference(H, Hkv, D, dtype, causal, window):
    q, _, _ = inputs.attention_inputs(2, H, 300, 300, D, dtype, seed=H + Hkv + D)
    _, k, v = inputs.attention_inputs(2, Hkv, 300, 700, D, dtype, seed=H * Hkv + D)
    o, lse = run(
        lambda: blackwell.attention(q, k, v, causal=causal, window=window, return_lse=True)
    )
    gqa_reference_check("O", o, lse, q, k, v, causal, window)


@pytest.mark.gpu_blackwell
def test_ctas_with_an_empty_range_store_zeros():
    # causal, Sq - Sk = 896: the CTAs of rows 0-767 see no key and store O = 0 without waiting
    # for any MMA; no Q is loaded for them
    q, k, v = inputs.attention_inputs(1, 2, 1024, 128, 128, seed=41)
    o, lse = run(lambda: blackwell.attention(q, k, v, causal=True, return_lse=True))
    gqa_reference_check("O", o, lse, q, k, v, True, None)
    assert (o[:, :, :768] == 0).all() and (lse[:, :, :768] == float("-inf")).all()


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("D", [64, 128])
def test_row_max_growing_across_tiles(D):
    # keys whose logits grow tile by tile (some by less than the threshold, some by more), many
    # tiles: the rescale taken and skipped, and the ring wrapped
    B, H, S = 1, 4, 4096
    q, k, v = inputs.attention_inputs(B, H, S, S, D, seed=31)
    ramp = torch.linspace(0, 6, S, device="cuda")[None, None, :, None]
    k = (k.float() * (1 + ramp)).to(k.dtype)
    o, lse = run(lambda: blackwell.attention(q, k, v, return_lse=True))
    gqa_reference_check("O", o, lse, q, k, v, False, None)


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("pack", list(PACKS))
def test_packed_sequences_match_per_sequence_reference(pack, D, dtype):
    lens_q, lens_k = PACKS[pack]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, D, dtype, seed=len(pack) + D)
    for causal, window in ((False, None), (True, None), (True, (77, None))):
        o, lse = run(
            lambda: blackwell.attention_varlen(
                q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True
            )
        )
        check_packed(o, lse, q, k, v, cu_q, cu_k, causal, window)


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("D", [64, 128])
def test_nan_outside_a_sequence_never_reaches_it(D):
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
@pytest.mark.parametrize("case", PACK_GQA_CASES, ids=pack_case_id)
def test_pack_gqa_matches_reference_and_unpacked(case):
    check_pack_gqa(blackwell, case)


# ---------------------------------------------------------------- bad input


SHARED = [c for c in attention_cases.BAD_ATTENTION_INPUTS if c.id != "heads_mismatch"]


@pytest.mark.parametrize("case", SHARED)
def test_rejects_bad_input(case):
    case.check(blackwell.attention)
