"""Stage 8 (Blackwell): warp specialisation - a TMA warp, an MMA warp, one softmax warpgroup and
a correction warpgroup on one Q tile per CTA, on sm_100a.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch mode and packed, causal: 12 warps
  (.reqntid 384, .minnctapersm 1); 168 registers per thread at launch, setmaxnreg.inc to 208
  for the softmax warpgroup, .dec to 152 for the correction warpgroup and to 144 for the MMA,
  TMA and idle warps, and no spills (ptxas of CUDA 13.0, 2026-12-04); stage 7's MMAs and
  exp2 count (one Q tile); TMEM: one tcgen05.alloc of 256 columns, freed after both
  warpgroups' fences and the barrier of their 256 threads; the tcgen05 fences at the TMEM
  hand-offs counted, every path fenced (tests/blackwell_ptx.py); the correction warps store O
  and LSE by predicated thread stores (16 bytes for O), as stage 7, and issue no TMA store;
  the K/V ring's slots (5 at D = 128, 8 at D = 64) and shared memory within the 227 KiB of an
  SM.
- CPU: the schedule checker's model of the four roles and their hand-offs (common/tools/
  schedule.py, cta_schedule_correction) finds no hang and no unbalanced barrier for ranges of
  1-5 KV tiles, ranges that start past tile 0 and empty ranges. Every operation of that model
  is one barrier site of the PTX (tcgen05.commit, mbarrier.arrive and mbarrier.try_wait
  counted), and the arrival count of every barrier in the model is the one the PTX's
  mbarrier.init gives it (stages 8-10). The model catches the near misses: a lost arrive, a
  skipped wait, an arrival count that does not match the arriving threads, a commit to the
  wrong barrier, the correction warpgroup waiting for O at the first tile or for the last O on
  an empty range, Q skipped for an empty range while the MMA warp waits for it.
- GPU tests (marker gpu_blackwell) mirror stage 7's: GQA / MQA with masks against the fp64
  reference, packed sequences per sequence, NaN planted outside a sequence, empty sequences,
  pack-GQA; O and LSE equal to stage 7's bit for bit (each row's arithmetic is stage 7's: only
  which warps do it changes). Each launch has a 120 s deadline. As of 2026-12-04 no sm_100
  GPU was available: these tests have not run.
"""

import dataclasses
import re

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from blackwell_ptx import FENCE_BEFORE, PV_MMA, QK_MMA, assert_tcgen05_fences, global_stores
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

from common.tools import inputs, schedule, stage_table, verify
from common.tools.ptx import compile_for_arch, compile_only, count_ptx
from stages.stage7_gqa_varlen import blackwell as stage7
from stages.stage8_warp_specialized import blackwell

SHAPE = (2, 8, 512, 1024, 128)
TMA_STORE = re.compile(r"^\s*cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")
# Shared memory per CTA (bytes): Q, the K/V ring, 1 KiB of barriers and row statistics
SMEM_BYTES = {64: 16384 * (1 + 8) + 2048, 128: 32768 * (1 + 5) + 2048}


def compile_stage8(dtype, D, resources=True, **options):
    return compile_only(
        8, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), resources=resources, **options
    )


def statements(ptx, pattern):
    return [s.strip() for s in ptx.splitlines() if re.match(pattern, s.strip())]


def tmem_alloc_columns(ptx):
    """The column count of each tcgen05.alloc: an immediate, or the register a mov.b32 set."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    out = []
    for i, ln in enumerate(lines):
        m = re.match(r"tcgen05\.alloc\.\S+\s+\[[^\]]+\],\s*(%r\d+|\d+);", ln)
        if m:
            n = m.group(1)
            if n.startswith("%"):
                sets = [
                    int(s.group(1))
                    for s in (
                        re.match(rf"mov\.b32\s+{re.escape(n)},\s*(\d+);", x) for x in lines[:i]
                    )
                    if s
                ]
                n = sets[-1]
            out.append(int(n))
    return out


# ---------------------------------------------------------------- compile-only (no GPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_compiles_with_four_roles(varlen, D, dtype):
    report = compile_stage8(dtype, D, kv_heads=2, varlen=varlen, causal=True)
    seven = compile_only(
        7, "blackwell", dtype=dtype, shape=(*SHAPE[:4], D), resources=False, varlen=varlen
    )
    ptx, counts = report.ptx, report.counts
    assert ".reqntid 384, 1, 1" in ptx and ".minnctapersm 1" in ptx
    # one setmaxnreg per branch: the softmax warpgroup up, the correction warpgroup down, and
    # the TMA, MMA and idle warps of the third warpgroup down
    assert len(statements(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+208;")) == 1
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+152;")) == 1
    assert len(statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+144;")) == 3
    assert len(statements(ptx, r"setmaxnreg")) == 5
    # One Q tile: stage 7's MMAs (QK and PV) and its exponentials per row
    assert len(QK_MMA.findall(ptx)) == D // 16 and len(PV_MMA.findall(ptx)) == 8
    assert counts["ex2.approx"] == seven.counts["ex2.approx"]
    assert tmem_alloc_columns(ptx) == [256]
    assert len(statements(ptx, r"tcgen05\.dealloc")) == 1
    # tcgen05 fences (common/tmem.py). After a wait: in issue_qk ((a), (d)) and issue_pv ((b),
    # (c)); the softmax warpgroup's before the load of S and the store of P ((d)); the correction
    # warpgroup's in rescale_o and before the epilogue's loads of O ((d)). Before an arrive: the
    # release of S ((a)), the hand-over of P ((b)), the end of rescale_o ((c)), the epilogue's
    # release of O, and each warpgroup's before the barrier that frees TMEM.
    assert_tcgen05_fences(ptx, before=6, after=6)
    # Q, the ring and per Q tile S, P, O, the row statistics: a full and an empty barrier each
    kernel, _ = blackwell.compile_args(dtype, (1, 1, 128, 128, D))
    assert counts["mbarrier.init"] == 2 * (1 + kernel.kv_slots + 4)
    # per-row predicated 16-byte stores of O, and LSE, by the correction warps (stage 12 stores
    # O by TMA)
    stores = [ln for ln in ptx.splitlines() if TMA_STORE.match(ln)]
    assert stores == [] and "cp.async.bulk.commit_group" not in ptx
    assert global_stores(ptx) == ["st.global.v4.b32"] * (D // 8) + ["st.global.b32"]
    assert report.shared_memory_bytes == SMEM_BYTES[D] <= 227 * 1024
    if ptxas_ran(report.resources, "sm_100a"):
        # 168 at launch (65536 / 384 threads, rounded down to a multiple of 8); the counts
        # after setmaxnreg are the PTX's. ptxas of CUDA 13.0 (2026-12-04): no spills.
        assert report.resources["registers"] == 168, report.summary()
        assert report.resources["spill_stores"] == 0, report.summary()
        assert report.resources["spill_loads"] == 0, report.summary()


def test_tmem_freed_after_every_warpgroups_fence():
    ptx = compile_stage8(torch.bfloat16, 128, resources=False).ptx
    lines = ptx.splitlines()

    def where(pattern):
        return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]

    fences = where(FENCE_BEFORE.pattern)
    (dealloc,) = where(r"tcgen05\.dealloc")
    # 6 (the per-tile ones with them: test_compiles_with_four_roles), all before tcgen05.dealloc
    assert len(fences) == 6 and max(fences) < dealloc
    assert max(where(r"tcgen05\.(ld|st)\.")) < max(fences)
    # the softmax warpgroup and the correction warpgroup: fence, then the barrier of 256, with no
    # tcgen05 operation between
    arrives = where(r"\bbar(rier)?\.arrive\s+1,\s*256;")
    syncs = where(r"\bbar(rier)?\.sync\s+1,\s*256;")
    assert len(arrives) == 1 and len(syncs) == 1
    tcgen05_ops = where(r"tcgen05\.(ld|st|mma)\.")
    for barrier in (arrives[0], syncs[0]):
        fence = max(f for f in fences if f < barrier)
        assert not any(fence < i < barrier for i in tcgen05_ops)
    assert syncs[0] < dealloc
    # the TMEM allocation handshake: the MMA warp, the softmax and the correction warpgroup
    assert len(where(r"\bbar(rier)?\.sync\s+2,\s*288;")) == 3


def test_ring_depth_tmem_columns_and_registers():
    for D, slots in ((128, 5), (64, 8)):
        kernel, _ = blackwell.compile_args(torch.bfloat16, (1, 1, 256, 256, D))
        assert kernel.q_tiles == 1 and kernel.cta_rows == 128
        assert kernel.kv_slots == slots
        assert kernel.tmem_s_offset == kernel.tmem_p_offset == (0,)
        assert kernel.tmem_o_offset == (128,)
        assert kernel.tmem_o_offset[-1] + D <= kernel.num_tmem_alloc_cols == 256
        # setmaxnreg raises the softmax warpgroup and lowers the other two from the launch
        # count, 168; the three warpgroups x 128 threads hold what the 384 threads held.
        launch = 65536 // kernel.threads_per_cta // 8 * 8
        assert kernel.threads_per_cta == 384 and launch == 168
        assert kernel.correction_registers <= launch <= kernel.softmax_registers
        assert kernel.other_registers <= launch
        regs = kernel.softmax_registers + kernel.correction_registers + kernel.other_registers
        assert regs * 128 == launch * 384 == 64512 <= 65536


def test_one_kernel_for_every_head_count_and_packing():
    a = compile_stage8(torch.bfloat16, 128, resources=False, kv_heads=8)
    b = compile_stage8(torch.bfloat16, 128, resources=False, kv_heads=1, causal=True)
    assert a.ptx == b.ptx


# ---------------------------------------------------------------- the schedule, on the CPU


def traced_kernel(D=128, module=blackwell, varlen=False):
    kernel, args = module.compile_args(torch.bfloat16, (1, 2, 512, 1024, D), varlen=varlen)
    ptx, _ = compile_for_arch(kernel, args, "sm_100a")
    return kernel, ptx


RANGES = ((0, 1), (0, 2), (0, 3), (0, 5), (2, 5), (0, 0), (3, 3))


@pytest.mark.parametrize("D", [64, 128])
def test_four_roles_have_no_hang_and_balanced_hand_offs(D):
    kernel, _ = traced_kernel(D)
    assert schedule.check_cta(kernel, ranges=RANGES) == []
    assert schedule.check_kernel(kernel) == []
    pipes, programs = schedule.cta_schedule(kernel)
    assert set(programs) == {"TMA", "MMA", "softmax0", "correction"}
    assert [p.name for p in pipes] == ["Q", "K/V", "S0", "P0", "O0", "stats0"]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_model_has_the_barrier_sites_of_the_ptx(D, varlen):
    # Every operation of the four roles' model is one barrier site in the kernel's PTX: the MMA
    # warp's arrives are tcgen05.commit, every other role's an mbarrier.arrive (the TMA warp's
    # with expect_tx), every wait one mbarrier.try_wait. A hand-off in the code that the model
    # lacks, or one the model has that the code dropped, changes a count.
    kernel, ptx = traced_kernel(D, varlen=varlen)
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


@pytest.mark.parametrize("stage", [8, 9, 10])
@pytest.mark.parametrize("D", [64, 128])
def test_model_has_the_arrival_counts_of_the_ptx(stage, D):
    # The model's barriers, in the order of the kernel's shared memory (Q, the ring, then per
    # hand-off one barrier per Q tile), each with the count mbarrier.init gives it in the PTX:
    # 1 where the TMA warp or a tcgen05.commit arrives, 128 where a warpgroup's threads do.
    kernel, ptx = traced_kernel(D, module=stage_table.track_module(stage, "blackwell"))
    pipes, _ = schedule.cta_schedule(kernel)
    inits = schedule.mbarrier_init_counts(ptx)
    assert [offset for offset, _ in inits] == list(range(0, 8 * len(inits), 8))
    assert [count for _, count in inits] == schedule.barrier_counts(pipes)
    assert sorted(set(schedule.barrier_counts(pipes))) == [1, 128]


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


NEAR_MISSES = [
    "lost_arrive",
    "skipped_wait",
    "arrival_count",
    "wrong_barrier",
    "o_wait_at_first_tile",
    "o_wait_on_empty_range",
    "q_load_on_empty_range",
]


@pytest.mark.parametrize("change", NEAR_MISSES)
def test_model_catches_the_near_misses(change):
    kernel, _ = traced_kernel()
    pipes, programs = schedule.cta_schedule(kernel)
    ranges = ((0, 1), (0, 3), (0, 0))
    if change == "lost_arrive":
        # The softmax warpgroup does not hand over its final row sum and max: the epilogue
        # waits forever.
        final = schedule.Op("stats0", "commit", "row sum and max")
        assert final in programs["softmax0"]
        programs = dict(programs, softmax0=_replace(programs["softmax0"], final, None))
        found = schedule.check_cta(kernel, ranges=ranges, programs=programs)
        assert any("hang" in v and "stats0.wait (row sum and max)" in v for v in found), found
    elif change == "skipped_wait":
        # The MMA warp does not wait for the rescale of O before P @ V_j: O's hand-off is
        # unbalanced (commits nobody acquired).
        programs = dict(programs, MMA=_replace(programs["MMA"], schedule.Op("O0", "acquire"), None))
        found = schedule.check_cta(kernel, ranges=ranges, programs=programs)
        assert any("O0: unbalanced hand-off" in v for v in found), found
        assert not any("[KV tiles [0, 0)]" in v for v in found), found
    elif change == "arrival_count":
        # P's full barrier initialised for two warpgroups' threads (256) while one warpgroup's
        # 128 arrive: its phase never completes, the MMA warp waits forever at the first P.
        pipes = tuple(
            dataclasses.replace(p, full_count=256) if p.name == "P0" else p for p in pipes
        )
        found = []
        for tiles in ranges:
            found += schedule.simulate_cta(pipes, programs, tiles)
        assert any("hang" in v and "the MMA warp waiting at P0.wait" in v for v in found), found
        # and 64 (half a warpgroup): each handover completes two phases at once
        halved = tuple(
            dataclasses.replace(p, full_count=64) if p.name == "P0" else p for p in pipes
        )
        found = schedule.simulate_cta(halved, programs, (0, 3))
        # (two phases per handover: the parity the MMA warp waits for never comes)
        assert any("hang" in v and "the MMA warp waiting at P0.wait" in v for v in found), found
    elif change == "wrong_barrier":
        # The MMA warp's tcgen05.commit after P @ V_j arrives on S's barrier instead of O's:
        # the softmax warpgroup would read an S that is not there, and O never comes.
        wrong = _replace(programs["MMA"], schedule.Op("O0", "commit"), schedule.Op("S0", "commit"))
        programs = dict(programs, MMA=wrong)
        found = schedule.check_cta(kernel, ranges=ranges, programs=programs)
        assert any(
            "the commit of S0 entry 2 (KV tile 0) comes before its acquire" in v for v in found
        )
        assert any("hang" in v and "waiting at O0.wait" in v for v in found), found
    elif change == "o_wait_at_first_tile":
        # The correction warpgroup waits for O at the first KV tile too (no O exists yet).
        eager = _flat_replace(programs["correction"], schedule.NotFirst, lambda item: item.ops)
        found = schedule.check_cta(kernel, ranges=ranges, programs=dict(programs, correction=eager))
        assert any("hang" in v and "correction warpgroup waiting at O0.wait" in v for v in found)
    elif change == "o_wait_on_empty_range":
        # It waits for the last O on an empty range, where no MMA commits it: a hang there only.
        always = _flat_replace(programs["correction"], schedule.IfNonEmpty, lambda item: item.ops)
        found = schedule.check_cta(
            kernel, ranges=ranges, programs=dict(programs, correction=always)
        )
        assert any("[KV tiles [0, 0)] hang" in v for v in found), found
        assert not any("[0, 3)" in v for v in found), found
    else:
        # The TMA warp skips Q for an empty range (stage 10's does, with its MMA warp) while
        # this MMA warp still waits for it: a hang there only.
        skip_q = (schedule.IfNonEmpty(programs["TMA"][:2]), *programs["TMA"][2:])
        found = schedule.check_cta(kernel, ranges=ranges, programs=dict(programs, TMA=skip_q))
        hang = "[KV tiles [0, 0)] hang"
        assert any(hang in v and "the MMA warp waiting at Q.wait" in v for v in found), found
        assert not any("[0, 3)" in v for v in found), found


# ---------------------------------------------------------------- numerics on an sm_100 GPU


def run(fn):
    return verify.run_with_deadline(fn, seconds=120, what="stage 8 blackwell")


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


SAME_AS_STAGE7 = [
    # (B, H, Hkv, Sq, Sk, D, dtype, causal, window)
    (2, 8, 2, 1000, 1000, 128, torch.bfloat16, True, None),  # the last Q tile part empty
    (1, 4, 4, 4096, 4096, 64, torch.bfloat16, False, None),  # 32 KV tiles: the 8-slot ring wraps
    (1, 4, 1, 2048, 2048, 128, torch.float16, True, None),  # 16 KV tiles: the 5-slot ring wraps
    (2, 4, 2, 700, 1500, 64, torch.float16, False, (300, 0)),
    (1, 2, 2, 129, 3000, 128, torch.bfloat16, False, (None, 10)),
]


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("case", SAME_AS_STAGE7, ids=lambda c: "x".join(map(str, c[:6])))
def test_equals_stage7_bit_for_bit(case):
    B, H, Hkv, Sq, Sk, D, dtype, causal, window = case
    q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=Sq + D)
    _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, D, dtype, seed=Sk + D)
    kw = dict(causal=causal, window=window, return_lse=True)
    o8, lse8 = run(lambda: blackwell.attention(q, k, v, **kw))
    o7, lse7 = run(lambda: stage7.attention(q, k, v, **kw))
    assert torch.equal(o8, o7), f"max |O8 - O7| = {(o8.float() - o7.float()).abs().max()}"
    assert torch.equal(lse8, lse7), f"max |LSE8 - LSE7| = {(lse8 - lse7).abs().max()}"


@pytest.mark.gpu_blackwell
def test_ctas_with_an_empty_range_store_zeros():
    # causal, Sq - Sk = 896: the CTAs of rows 0-895 see no key and store O = 0 without waiting
    # for any MMA
    q, k, v = inputs.attention_inputs(1, 2, 1024, 128, 128, seed=41)
    o, lse = run(lambda: blackwell.attention(q, k, v, causal=True, return_lse=True))
    gqa_reference_check("O", o, lse, q, k, v, True, None)
    assert (o[:, :, :896] == 0).all() and (lse[:, :, :896] == float("-inf")).all()


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
    from stages.stage8_warp_specialized import attention

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
