"""Stage 9 (Blackwell): ping-pong - two Q tiles per CTA, two softmax warpgroups taking turns on
the tensor core, a correction warpgroup for both, on sm_100a.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch mode and packed: 16 warps
  (.reqntid 512, .minnctapersm 1); setmaxnreg.inc to 184 for the two softmax warpgroups,
  .dec to 96 for the correction warpgroup and to 48 for the MMA, TMA and idle warps; stage 8's
  MMAs for each Q tile (QK, QK, PV, PV), each GEMM's k-blocks as one tcgen05.mma in a loop,
  and twice stage 8's exp2 count (a softmax warpgroup per tile); no spill (ptxas of CUDA 13.0,
  2026-12-06; every configuration: the ones here and no mask, a window, pack-GQA packed or
  not); TMEM: one tcgen05.alloc of 512 columns, freed after every warpgroup's fence and the
  barrier of the 384 softmax and correction threads; the tcgen05 fences at the TMEM hand-offs
  counted, every path fenced (tests/blackwell_ptx.py); O and LSE of both tiles by predicated
  thread stores, no TMA store; the K/V ring's slots (4 at D = 128, 8 at D = 64) and shared
  memory within the 227 KiB of an SM.
- CPU: the schedule checker's model of all five roles and their hand-offs (common/tools/
  schedule.py, cta_schedule_correction with two Q tiles) finds no hang and no unbalanced
  barrier for ranges of 1-5 KV tiles, ranges that start past tile 0 and empty ranges, and
  catches the near misses: the correction warpgroup waiting for O at the first tile, waiting
  for the last O on an empty range, a softmax warpgroup not handing over its final row sum,
  the MMA warp not waiting for the rescale. Every operation of that model is one barrier site
  of the PTX (tcgen05.commit, mbarrier.arrive and mbarrier.try_wait counted), stages 9 and 10,
  D = 64 and 128, batch and packed (their arrival counts: tests/test_stage8_blackwell.py).
- GPU tests (marker gpu_blackwell) mirror stage 7's: GQA / MQA with masks against the fp64
  reference, packed sequences per sequence, NaN planted outside a sequence, empty sequences,
  pack-GQA; O and LSE equal to stage 8's bit for bit (each row's arithmetic is stage 8's: only
  which warpgroup does it, and when, changes), on shapes with odd tile counts (one CTA with a
  Q tile past Sq) and ring wraps. Each launch has a 120 s deadline. As of 2026-12-04 no sm_100
  GPU was available: these tests have not run.
"""

import importlib
import re

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from blackwell_ptx import (
    FENCE_BEFORE,
    PV_MMA,
    QK_MMA,
    SPILL_CONFIGS,
    assert_no_spill,
    assert_no_spill_in,
    assert_tcgen05_fences,
    global_stores,
)
from ptxas_checks import ptxas_ran
from test_stage7 import (
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

from common.tools import inputs, schedule, verify
from common.tools.ptx import compile_for_arch, compile_only, count_ptx, tcgen05_mma_order
from stages.stage8_warp_specialized import blackwell as stage8
from stages.stage9_pingpong import blackwell

SHAPE = (2, 8, 512, 1024, 128)
TMA_STORE = re.compile(r"^\s*cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")


def compile_stage9(dtype, D, resources=True, **options):
    return compile_only(
        9, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), resources=resources, **options
    )


def statements(ptx, pattern):
    return [s.strip() for s in ptx.splitlines() if re.match(pattern, s.strip())]


# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_compiles_with_five_roles(varlen, D, dtype):
    report = compile_stage9(dtype, D, kv_heads=2, varlen=varlen, causal=True)
    eight = compile_only(
        8, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), resources=False, varlen=varlen
    )
    ptx, counts = report.ptx, report.counts
    assert ".reqntid 512, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert statements(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+184;") != []
    assert len(statements(ptx, r"setmaxnreg\.inc")) == 2  # one per softmax warpgroup
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+96;")) == 1
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+48;")) == 3
    # QK and PV for each of the two Q tiles: stage 8's unrolled D / 16 and 8 k-blocks, here
    # one tcgen05.mma per GEMM in a loop that is not unrolled
    assert len(QK_MMA.findall(eight.ptx)) == D // 16 and len(PV_MMA.findall(eight.ptx)) == 8
    eight_runs = tcgen05_mma_order(eight.ptx).replace("Q" * (D // 16), "Q").replace("P" * 8, "P")
    assert eight_runs == "QP" and tcgen05_mma_order(ptx) == "QQPP"
    nounroll = r"\.pragma\s+\"nounroll\";"
    assert len(re.findall(nounroll, ptx)) >= len(re.findall(nounroll, eight.ptx)) + 4
    # the exponentials of a row, once per softmax warpgroup (stage 8: one)
    assert counts["ex2.approx"] == 2 * eight.counts["ex2.approx"]
    assert statements(ptx, r"tcgen05\.alloc\.cta_group::1\.sync\.aligned\.shared::cta\.b32")
    assert (
        len(statements(ptx, r"tcgen05\.alloc")) == 1
        and len(statements(ptx, r"tcgen05\.dealloc")) == 1
    )
    # tcgen05 fences (common/tmem.py): stage 8's per Q tile, the TMEM-free one of the correction
    # warpgroup once: before 2 x 5 + 1, after 2 x 6
    assert_tcgen05_fences(ptx, before=11, after=12)
    # per-row predicated 16-byte stores of both tiles' O, and LSE, by the correction warps
    stores = [ln for ln in ptx.splitlines() if TMA_STORE.match(ln)]
    assert stores == [] and "cp.async.bulk.commit_group" not in ptx
    assert global_stores(ptx) == (["st.global.v4.b32"] * (D // 8) + ["st.global.b32"]) * 2
    assert report.shared_memory_bytes <= 227 * 1024
    if ptxas_ran(report.resources, "sm_100a"):
        # 128 at launch (65536 / 512 threads); the counts after setmaxnreg are the PTX's.
        # ptxas of CUDA 13.0 (2026-12-06): no spill (168 / 80 / 96 with the k-blocks unrolled
        # spilled 8-236 bytes across the configurations of test_no_spill_in_any_configuration).
        assert_no_spill(report, registers=128)


@pytest.mark.parametrize("config", list(SPILL_CONFIGS))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_no_spill_in_any_configuration(dtype, D, config):
    """168 / 80 / 96 with each GEMM's k-blocks unrolled spilled 8-236 bytes here (ptxas of CUDA
    13.0, 2026-12-06), in the MMA warp, the softmax warpgroups (fp16), the correction warpgroup and
    before the warps split."""
    assert_no_spill_in(9, dtype, D, config)


def test_tmem_freed_after_every_warpgroups_fence():
    ptx = compile_stage9(torch.bfloat16, 128, resources=False).ptx
    lines = ptx.splitlines()

    def where(pattern):
        return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]

    fences = where(FENCE_BEFORE.pattern)
    (dealloc,) = where(r"tcgen05\.dealloc")
    # 11 (the per-tile ones with them: test_compiles_with_five_roles), all before tcgen05.dealloc
    assert len(fences) == 11 and max(fences) < dealloc
    assert max(where(r"tcgen05\.(ld|st)\.")) < max(fences)
    # each softmax warpgroup and the correction warpgroup: fence, then the barrier of 384, with
    # no tcgen05 operation between
    arrives = where(r"\bbar(rier)?\.arrive\s+1,\s*384;")
    syncs = where(r"\bbar(rier)?\.sync\s+1,\s*384;")
    assert len(arrives) == 2 and len(syncs) == 1
    tcgen05_ops = where(r"tcgen05\.(ld|st|mma)\.")
    for barrier in (*arrives, syncs[0]):
        fence = max(f for f in fences if f < barrier)
        assert not any(fence < i < barrier for i in tcgen05_ops)
    assert syncs[0] < dealloc


def test_ring_depth_and_tmem_columns():
    for D, slots in ((128, 4), (64, 8)):
        kernel, _ = blackwell.compile_args(torch.bfloat16, (1, 1, 256, 256, D))
        assert kernel.kv_slots == slots
        assert kernel.tmem_s_offset == (0, 128)
        assert kernel.tmem_o_offset == (256, 256 + D)
        assert kernel.tmem_o_offset[-1] + D <= kernel.num_tmem_alloc_cols == 512
        # (2 x softmax + correction + the MMA/TMA warpgroup) x 128 threads = the register file
        regs = 2 * kernel.softmax_registers + kernel.correction_registers
        assert (regs + kernel.other_registers) * 128 == 65536


def test_one_kernel_for_every_head_count_and_packing():
    a = compile_stage9(torch.bfloat16, 128, resources=False, kv_heads=8)
    b = compile_stage9(torch.bfloat16, 128, resources=False, kv_heads=1, causal=True)
    assert a.ptx == b.ptx


# ---------------------------------------------------------------- the schedule, on the CPU


def traced_kernel(D=128):
    kernel, args = blackwell.compile_args(torch.bfloat16, (1, 2, 512, 1024, D))
    compile_for_arch(kernel, args, "sm_100a")
    return kernel


RANGES = ((0, 1), (0, 2), (0, 3), (0, 5), (2, 5), (0, 0), (3, 3))


@pytest.mark.parametrize("D", [64, 128])
def test_five_roles_have_no_hang_and_balanced_hand_offs(D):
    kernel = traced_kernel(D)
    assert schedule.check_cta(kernel, ranges=RANGES) == []
    assert schedule.check_kernel(kernel) == []
    pipes, programs = schedule.cta_schedule(kernel)
    assert set(programs) == {"TMA", "MMA", "softmax0", "softmax1", "correction"}
    assert len(pipes) == 2 + 4 * kernel.q_tiles


@pytest.mark.parametrize("stage", [9, 10])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_model_has_the_barrier_sites_of_the_ptx(stage, D, varlen):
    # Every operation of the five roles' model is one barrier site in the kernel's PTX: the MMA
    # warp's arrives are tcgen05.commit, every other role's an mbarrier.arrive (the TMA warp's
    # with expect_tx), every wait one mbarrier.try_wait. A hand-off in the code that the model
    # lacks, or one the model has that the code dropped, changes a count.
    mod = blackwell if stage == 9 else importlib.import_module("stages.stage10_overlap.blackwell")
    kernel, args = mod.compile_args(torch.bfloat16, (1, 2, 512, 1024, D), varlen=varlen)
    ptx, _ = compile_for_arch(kernel, args, "sm_100a")
    pipes, programs = schedule.cta_schedule(kernel)
    arrives, waits = ("commit", "release"), ("acquire", "peek_empty", "wait")
    counts = count_ptx(ptx)
    assert (
        len(schedule.barrier_sites(pipes, programs, "MMA", arrives)) == counts["tcgen05.commit"]
    ), counts
    others = sum(
        len(schedule.barrier_sites(pipes, programs, r, arrives)) for r in programs if r != "MMA"
    )
    assert others == counts["mbarrier.arrive"], counts
    all_waits = sum(len(schedule.barrier_sites(pipes, programs, r, waits)) for r in programs)
    assert all_waits == counts["mbarrier.try_wait"], counts


def _replace(program, old, new):
    """The program with every operation equal to `old` replaced by `new` (None: removed), also
    inside PerTile, NotFirst and IfNonEmpty."""
    out = []
    for item in program:
        if isinstance(item, (schedule.PerTile, schedule.NotFirst, schedule.IfNonEmpty)):
            out.append(type(item)(_replace(item.ops, old, new)))
        elif item == old:
            if new is not None:
                out.append(new)
        else:
            out.append(item)
    return tuple(out)


def _flat_replace(program, cls, new_items):
    """The program with each item of type `cls` replaced by new_items(item)."""
    out = []
    for item in program:
        if isinstance(item, schedule.PerTile):
            out.append(schedule.PerTile(_flat_replace(item.ops, cls, new_items)))
        elif isinstance(item, cls):
            out += new_items(item)
        else:
            out.append(item)
    return tuple(out)


def test_model_catches_the_near_misses():
    kernel = traced_kernel()
    pipes, programs = schedule.cta_schedule(kernel)

    def violations(role, program, ranges=((0, 1), (0, 3), (0, 0))):
        faulty = dict(programs, **{role: program})
        return schedule.check_cta(kernel, ranges=ranges, programs=faulty)

    # The correction warpgroup waits for O at the first KV tile too (no O exists yet): a hang.
    eager = _flat_replace(programs["correction"], schedule.NotFirst, lambda item: item.ops)
    assert any("hang" in v for v in violations("correction", eager))
    # It waits for the last O on an empty range, where no MMA commits it: a hang there only.
    always = _flat_replace(programs["correction"], schedule.IfNonEmpty, lambda item: item.ops)
    found = violations("correction", always)
    assert any("[KV tiles [0, 0)] hang" in v for v in found), found
    assert not any("[0, 3)" in v for v in found)
    # Softmax warpgroup 1 does not hand over its final row sum and max: the epilogue hangs.
    final = schedule.Op("stats1", "commit", "row sum and max")
    lost = _replace(programs["softmax1"], final, None)
    assert any("hang" in v for v in violations("softmax1", lost))
    # The TMA warp skips both Q tiles for an empty range (stage 10's does, with its MMA warp)
    # while this MMA warp still waits for them: a hang there only.
    skip_q = (schedule.IfNonEmpty(programs["TMA"][:4]), *programs["TMA"][4:])
    found = violations("TMA", skip_q)
    hang = "[KV tiles [0, 0)] hang"
    assert any(hang in v and "the MMA warp waiting at Q.wait" in v for v in found), found
    assert not any("[0, 3)" in v for v in found), found
    # The MMA warp does not wait for the rescale of O_0 before P_0 V_j: O_0's hand-off is
    # unbalanced (commits nobody acquired).
    no_wait = _replace(programs["MMA"], schedule.Op("O0", "acquire"), None)
    assert any("O0" in v for v in violations("MMA", no_wait))


# ---------------------------------------------------------------- numerics on an sm_100 GPU


def run(fn):
    return verify.run_with_deadline(fn, seconds=120, what="stage 9 blackwell")


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


SAME_AS_STAGE8 = [
    # (B, H, Hkv, Sq, Sk, D, dtype, causal, window)
    # 4 CTAs of 256 rows, the last half empty
    (2, 8, 2, 1000, 1000, 128, torch.bfloat16, True, None),
    (1, 4, 4, 4096, 4096, 64, torch.bfloat16, False, None),  # 32 KV tiles: the 8-slot ring wraps
    (1, 4, 1, 2048, 2048, 128, torch.float16, True, None),
    (2, 4, 2, 700, 1500, 64, torch.float16, False, (300, 0)),
    (1, 2, 2, 129, 3000, 128, torch.bfloat16, False, (None, 10)),
]


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("case", SAME_AS_STAGE8, ids=lambda c: "x".join(map(str, c[:6])))
def test_equals_stage8_bit_for_bit(case):
    B, H, Hkv, Sq, Sk, D, dtype, causal, window = case
    q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=Sq + D)
    _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, D, dtype, seed=Sk + D)
    kw = dict(causal=causal, window=window, return_lse=True)
    o9, lse9 = run(lambda: blackwell.attention(q, k, v, **kw))
    o8, lse8 = run(lambda: stage8.attention(q, k, v, **kw))
    assert torch.equal(o9, o8), f"max |O9 - O8| = {(o9.float() - o8.float()).abs().max()}"
    assert torch.equal(lse9, lse8), f"max |LSE9 - LSE8| = {(lse9 - lse8).abs().max()}"


@pytest.mark.gpu_blackwell
def test_ctas_with_an_empty_range_store_zeros():
    # causal, Sq - Sk = 896: the CTAs of rows 0-767 see no key and store O = 0 without waiting
    # for any MMA
    q, k, v = inputs.attention_inputs(1, 2, 1024, 128, 128, seed=41)
    o, lse = run(lambda: blackwell.attention(q, k, v, causal=True, return_lse=True))
    gqa_reference_check("O", o, lse, q, k, v, True, None)
    assert (o[:, :, :768] == 0).all() and (lse[:, :, :768] == float("-inf")).all()


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
    from stages.stage9_pingpong import attention

    q, k, v = inputs.attention_inputs(1, 4, 200, 200, 64, seed=8)
    o = run(lambda: attention(q, k[:, :2], v[:, :2], causal=True))
    gqa_reference_check("O", o, None, q, k[:, :2], v[:, :2], True, None)


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("case", PACK_GQA_CASES, ids=pack_case_id)
def test_pack_gqa_matches_reference_and_unpacked(case):
    check_pack_gqa(blackwell, case)


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("D", [64, 128])
def test_pack_gqa_packed_sequences_with_nan_around(D):
    check_pack_gqa_varlen(blackwell, D)


# ---------------------------------------------------------------- bad input


SHARED = [c for c in attention_cases.BAD_ATTENTION_INPUTS if c.id != "heads_mismatch"]


@pytest.mark.parametrize("case", SHARED)
def test_rejects_bad_input(case):
    case.check(blackwell.attention)


@attention_cases.needs_cuda
@pytest.mark.parametrize("name, change, error, match", BAD_PACKED, ids=[c[0] for c in BAD_PACKED])
def test_rejects_bad_packed_input(name, change, error, match):
    q, k, v, cu_q, cu_k = _packed()
    args = change(dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    with pytest.raises(error, match=match):
        blackwell.attention_varlen(**args)
