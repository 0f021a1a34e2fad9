"""Stage 12 (Hopper): the last percent - seven tunings over stage 11, each switchable
(TUNINGS, with_tunings), none changing the arithmetic.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch and packed: with every tuning,
  three consumer warpgroups at D = 64 (512 threads, 24 / 160, a 192-row tile; two under a mask
  of at most 1024 keys per row), the loop's program order, no spills, no wgmma serialised; at
  D = 128 the wait for PV_{j-1} behind the always-true, warp-uniform test after the row max, at
  D = 64 the PTX order. with_tunings(()) compiles to stage 11's PTX; every tuning alone
  compiles; unknown names are refused.
- CPU: stage 10's turn protocol with three consumer warpgroups (turns going round 1, 2, 3) and
  its near misses; pack-GQA's group sizes against the tile rows (192 at D = 64) and the rows per
  pass of the O store; the launch options (short masks take two warpgroups at D = 64, the
  mask-free kernel only where nothing is masked), also as the launch itself builds them.
- GPU tests (marker gpu_hopper): two and three warpgroups agree bit for bit, the kernels with
  and without the mask code agree bit for bit in alternating launches, pack-GQA groups that
  only the 192-row tile packs, every stage 7-12 launching on the caller's stream; stage 7's
  numerical tests run here from tests/test_stage7.py, and tests/test_stage_chain.py checks O and
  LSE bit for bit against stage 11 with all tunings and with each alone.
"""

import re

import cutlass
import pytest
import torch
from attention_cases import DTYPES, dtype_id
from ptxas_checks import ptxas_ran
from test_stage7 import (
    check_pack_gqa,
    check_packed,
    gqa_reference_check,
    pack_case_id,
    packed_inputs,
)
from test_stage9_hopper import check_turn_barriers_are_distinct_and_go_round, turn_kernel
from test_stage10_hopper import check_overlap_model_catches_near_misses, check_overlap_protocol
from test_stage11_hopper import compile_stage, ptxas_log, statements

from common import attention_host, masks
from common.pack_gqa import choose_pack
from common.tools import inputs, stage_table, verify
from common.tools.turns import schedule_string
from stages.stage7_gqa_varlen import hopper as stage7
from stages.stage11_persistent import hopper as stage11
from stages.stage12_last_percent import hopper


def run(fn):
    return verify.run_with_deadline(fn, seconds=120, what="stage 12 hopper")


# ---------------------------------------------------------------- compile-only


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize(
    "D, Sk", [(64, 2048), (128, 2048), (64, 1024)], ids=["64", "128", "64-short"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_compiles_with_every_tuning(dtype, D, Sk, varlen):
    kernel, ptx, counts, res = compile_stage(
        hopper, dtype, D, Sk, kv_heads=2, varlen=varlen, causal=True
    )
    # Stage 11's warp roles and register split at D = 128 (a producer and two consumer
    # warpgroups, 24 / 240 registers); at D = 64 three consumer warpgroups (24 / 160), two
    # under a causal mask over at most 1024 keys (launch_options: Sk = 1024 here).
    wgs, regs = {64: (3, 160), 128: (2, 240)}[D] if Sk > 1024 else (2, 240)
    assert (kernel.mma_warpgroups, kernel.cta_tile) == (wgs, (64 * wgs, 128, D))
    assert f".reqntid {128 * (1 + wgs)}, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert 128 * kernel.load_registers + kernel.mma_threads * kernel.mma_registers <= 65536
    assert statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;") != []
    assert statements(ptx, rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{regs};") != []
    log = ptxas_log(ptx)
    if log is not None:
        assert "C7508" not in log and "setmaxnreg' ignored" not in log, log
        # C7512: wgmma serialised for want of registers (the fill of acc_S before each tile).
        assert "C7512" not in log and "serialized" not in log, log
    # QK^T in the prologue and in the loop, PV in the loop and after it: each GEMM's wgmma
    # twice (D / 16 for QK^T, 128 / 16 = 8 for PV); the softmax (64 exponentials of P and 2 of
    # row_scale per thread) in the prologue and in the loop.
    assert counts["wgmma.mma_async"] == 2 * (D // 16 + 8)
    assert counts["ex2.approx"] == 2 * (64 + 2)
    assert counts["cp.async.bulk.tensor (load)"] == (3 if D == 64 else 6)
    assert counts["cp.async.bulk.tensor (store)"] == 0
    # Program order. Producer: setmaxnreg.dec, the loads. Consumers: setmaxnreg.inc; the
    # prologue (turn 0: warpgroup 2 waits, QK issued, passed, waited); the loop (turn wait, QK
    # and PV issued as two groups, passed, wait_group 1 = QK done, wait_group 0 = PV done);
    # zero_rows when packed; the last PV (turn wait, issued, warpgroup 1's pass, waited); the
    # epilogue's two barriers.
    expected = r"0dL+iTGCPW" + r"TGCGCPwW" + ("B" if varlen else "") + r"TGCPWBB"
    assert re.fullmatch(expected, schedule_string(ptx)), schedule_string(ptx)
    # Q and O (bM x D each) and the ring in 227 KiB: 2 x 24 KiB + 11 x 16 KiB at D = 64 (192-row
    # tile; 2 x 16 KiB + 12 x 16 KiB with 128 rows), 2 x 32 KiB + 5 x 32 KiB at D = 128; 225 KiB
    # with the barriers either way.
    assert kernel.kv_slots == {(64, 3): 11, (64, 2): 12, (128, 2): 5}[D, wgs]
    tile_bytes = 128 * D * 2
    assert kernel.shared_memory_bytes == 1024 + 2 * 64 * wgs * D * 2 + kernel.kv_slots * tile_bytes
    assert kernel.shared_memory_bytes == 230400
    if ptxas_ran(res, "sm_90a"):
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res


@pytest.mark.parametrize(
    "D, Sk", [(64, 2048), (128, 2048), (64, 1024)], ids=["64", "128", "64-short"]
)
def test_wait_for_pv_stands_after_the_row_max(D, Sk):
    """D = 128: in the loop, the wait for PV_{j-1} (wait_group 0) comes behind the warp-uniform
    always-true test after the row max (the vote.any of always_true_after), so that ptxas,
    which moves a wgmma wait to the top of its block, cannot put it ahead of the row max: between
    wait_group 1 and the vote only row_scale's 2 exponentials, P's 64 after the wait. D = 64
    keeps the PTX order: all 66 before the wait, no vote."""
    kernel, ptx, _, _ = compile_stage(hopper, torch.bfloat16, D, Sk, kv_heads=2, causal=True)
    lines = [re.sub(r"^@!?%p\d+\s+", "", ln.strip()) for ln in ptx.splitlines()]

    def first(pattern, start=0):
        return next(i for i in range(start, len(lines)) if re.match(pattern, lines[i]))

    qk_done = first(r"wgmma\.wait_group\.sync\.aligned\s+1;")  # the loop's only wait_group 1
    pv_done = first(r"wgmma\.wait_group\.sync\.aligned\s+0;", qk_done)
    last_turn = first(r"bar\.sync\s+(%r\d+|3), 256;", pv_done)  # the last PV's, after the loop

    def ex2(a, b):
        return sum(ln.startswith("ex2.approx") for ln in lines[a:b])

    votes = [i for i, ln in enumerate(lines) if "vote.sync.any.pred" in ln]
    assert kernel.max_before_wait == (D == 128)
    if D == 128:
        assert len(votes) == 1 and qk_done < votes[0] < pv_done, (qk_done, votes, pv_done)
        assert (ex2(qk_done, votes[0]), ex2(votes[0], pv_done), ex2(pv_done, last_turn)) == (
            2,
            0,
            64,
        )
    else:
        assert votes == []
        assert (ex2(qk_done, pv_done), ex2(pv_done, last_turn)) == (66, 0)


# ---------------------------------------------------------------- the tunings as switches


def ptx_of(kernel_class, D, **options):
    from common.tools.ptx import code_only, compile_for_arch

    kernel, args = attention_host.compile_args(
        kernel_class, torch.bfloat16, (2, 8, 512, 2048, D), **options
    )
    ptx, _ = compile_for_arch(kernel, args, "sm_90a")
    return code_only(ptx)  # the entry's name carries the class's: compare the code only


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"varlen": True}], ids=str)
def test_no_tunings_is_stage_11(D, options):
    assert ptx_of(hopper.with_tunings(()), D, **options) == ptx_of(stage11.Sm90Kernel, D, **options)


@pytest.mark.parametrize("name", hopper.TUNINGS)
def test_each_tuning_alone_changes_the_code_where_it_applies(name):
    # A tuning that applies at a head dim changes the PTX there (it is not a dead switch);
    # elsewhere the kernel is stage 11's.
    applies = {
        "three_warpgroups": (64,),
        "mask_free_kernel": (64,),
        "fmax_chains": (128,),
        "wait_after_row_max": (128,),
    }.get(name, (64, 128))
    for D in (64, 128):
        opts = {"causal": True} if name == "interval_mask" else {}
        one = ptx_of(hopper.with_tunings([name]), D, **opts)
        none = ptx_of(hopper.with_tunings(()), D, **opts)
        assert (one != none) == (D in applies), (name, D)


def test_with_tunings_checks_its_names_and_keeps_one_class_per_set():
    assert hopper.with_tunings(hopper.TUNINGS) is hopper.Sm90Kernel
    a = hopper.with_tunings(["slot_first", "fmax_chains"])
    assert a is hopper.with_tunings(("fmax_chains", "slot_first"))  # order does not matter
    assert a.TUNINGS == ("slot_first", "fmax_chains") and issubclass(a, hopper.Sm90Kernel)
    with pytest.raises(ValueError, match="argument 'names'.*unknown tunings.*fmax_chain"):
        hopper.with_tunings(["fmax_chain"])
    with pytest.raises(TypeError, match="argument 'names'"):
        hopper.with_tunings("slot_first")
    assert hopper.with_tunings(()).warpgroups_for(64) == 2
    assert hopper.with_tunings(()).launch_options(64, 10**9, 10**9, 512, 512, 1, False) == {}


# ---------------------------------------------------------------- the turn protocol (CPU)


@pytest.mark.parametrize("n", [2, 3], ids=["2wg", "3wg"])
@pytest.mark.parametrize("zero_rows", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("steps", range(7))
def test_turn_protocol_has_no_deadlock_and_alternates(steps, zero_rows, n):
    check_overlap_protocol(turn_kernel(n, hopper), steps, zero_rows)


def test_turn_barriers_are_distinct_and_go_round():
    check_turn_barriers_are_distinct_and_go_round(hopper, ns=(2, 3))


@pytest.mark.parametrize("n,wg", [(2, 1), (2, 2), (3, 1), (3, 2), (3, 3)])
@pytest.mark.parametrize("change", ["extra_wait", "extra_pass", "lost_pass", "pv_before_qk"])
def test_turn_protocol_model_catches_near_misses(wg, change, n):
    check_overlap_model_catches_near_misses(turn_kernel(n, hopper), wg, change)


# ---------------------------------------------------------------- the 192-row tile of D = 64


# Groups that only the 192-row tile of D = 64 packs (G = 3, 6, 12: 128 % G != 0) or whose store
# takes 32-row passes instead of 48 (G = 64; G = 32 is in stage 7's cases), and a G = 3 group
# of 2 KV heads with a window.
PACK_GQA_192_CASES = [
    (2, 12, 4, 5, 700, 64, torch.bfloat16, True, None),
    (1, 6, 1, 50, 333, 64, torch.float16, True, None),
    (2, 24, 2, 1, 257, 64, torch.bfloat16, True, None),
    (1, 64, 1, 2, 200, 64, torch.bfloat16, False, None),
    (2, 6, 2, 40, 300, 64, torch.bfloat16, False, (60, 0)),
]


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("case", PACK_GQA_192_CASES, ids=pack_case_id)
def test_pack_gqa_on_the_192_row_tile(case):
    check_pack_gqa(hopper, case)


def check_pack_gqa_groups_follow_the_tile_rows(module):
    """Pack-GQA needs G to divide the Q tile's rows: 192 at D = 64 (G = 3 packs, G = 128 does
    not), 128 at D = 128 (G = 3 does not). attention() takes the rows from the kernel object.
    (Stage 12.)"""
    kernel_class = module.Sm90Kernel
    rows = {d: attention_host.tile_rows(kernel_class, torch.bfloat16, d) for d in (64, 128)}
    assert rows == {64: 192, 128: 128}
    assert choose_pack(12, 4, 1, rows[64]) == 3 and choose_pack(12, 4, 1, rows[128]) == 1
    assert choose_pack(128, 1, 1, rows[64]) == 1 and choose_pack(128, 1, 1, rows[128]) == 128
    for G in (3, 6, 12, 24, 32, 48, 64, 96):
        kernel = kernel_class(cutlass.BFloat16, 64, G)
        r = kernel.store_rows_per_pass()
        assert 192 % r == 0 and (r % G == 0 or G % r == 0), (G, r)
        assert r * 8 <= kernel.mma_threads
    with pytest.raises(ValueError, match="pack_gqa"):
        choose_pack(12, 4, 1, rows[128], pack_gqa=True)


def test_pack_gqa_groups_follow_the_tile_rows():
    check_pack_gqa_groups_follow_the_tile_rows(hopper)


# ---------------------------------------------------------------- two warpgroups for short masks


def check_short_masks_take_two_warpgroups_at_d64(module):
    """launch_options: at D = 64 a causal or window mask that leaves no query row more than
    1024 keys gets the 128-row tile (two consumer warpgroups), everything else the default (three
    at D = 64, two at D = 128). The boundary both ways, and the compile_args of CI's checks
    building the same object as a launch. (Stage 12.)"""

    def wgs(D, Sq, Sk, causal=False, window=None, H=8, Hkv=8):
        left, right = masks.resolve_window(causal, window, Sq, Sk)
        opts = attention_host.kernel_options(
            module.Sm90Kernel, D, left, right, Sq, Sk, H // Hkv, False
        )
        kernel, _ = module.compile_args(
            torch.bfloat16, (2, H, Sq, Sk, D), causal=causal, window=window, kv_heads=Hkv
        )
        assert kernel.mma_warpgroups == opts.get("mma_warpgroups", kernel.warpgroups_for(D))
        return kernel.mma_warpgroups

    assert wgs(64, 1024, 1024, causal=True) == 2  # every row sees at most 1024 keys
    assert wgs(64, 1025, 1025, causal=True) == 3
    assert wgs(64, 1, 1024, causal=True) == 2 and wgs(64, 1, 1025, causal=True) == 3
    assert wgs(64, 4096, 4096, window=(256, 0)) == 2  # 257 keys per row
    assert (
        wgs(64, 4096, 4096, window=(511, 512)) == 2 and wgs(64, 4096, 4096, window=(512, 512)) == 3
    )
    assert wgs(64, 4096, 4096, window=(None, 0)) == 3  # causal-like, 4096 keys
    assert wgs(64, 512, 512) == 3  # no mask: the 192-row tile at every length
    assert wgs(64, 512, 2000, window=(3000, 3000)) == 3  # a window wider than the keys: no mask
    assert wgs(128, 512, 512, causal=True) == 2  # D = 128: two in any case
    # G = H / Hkv must divide 64, so that pack-GQA's choices do not change with the tile.
    assert wgs(64, 512, 512, causal=True, H=8, Hkv=2) == 2
    assert wgs(64, 512, 512, causal=True, H=6, Hkv=2) == 3  # G = 3
    assert wgs(64, 512, 512, causal=True, H=128, Hkv=1) == 3  # G = 128


def check_two_and_three_warpgroups_agree(module, dtype):
    """The short-mask launches at D = 64 (two consumer warpgroups, a 128-row tile) against the
    fp64 reference, and bit for bit against the same launches pinned to three warpgroups (the
    same arithmetic per row in either tile): causal, a window, GQA, a ragged Sq, and packed
    sequences causal; calls of both kernels interleaved in one process. (Stage 12.)"""

    class three(module.Sm90Kernel):  # the default tile at every length
        launch_options = staticmethod(lambda *a: {})

    for B, H, Hkv, Sq, Sk, causal, window in [
        (2, 4, 4, 700, 700, True, None),
        (2, 8, 2, 300, 1000, False, (100, 0)),
        (1, 4, 1, 1000, 1024, True, None),
        (3, 2, 2, 129, 513, False, (60, 40)),
    ]:
        left, right = masks.resolve_window(causal, window, Sq, Sk)
        opts = attention_host.kernel_options(
            module.Sm90Kernel, 64, left, right, Sq, Sk, H // Hkv, False
        )
        assert opts == {"mma_warpgroups": 2}, (Sq, Sk, causal, window)
        q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, 64, dtype, seed=Sq + Sk)
        _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, 64, dtype, seed=Sk)
        o2, lse2 = run(
            lambda: module.attention(q, k, v, causal=causal, window=window, return_lse=True)
        )
        gqa_reference_check("O", o2, lse2, q, k, v, causal, window)
        o3, lse3 = run(
            lambda: attention_host.attention(three, q, k, v, None, causal, window, True, None)
        )
        assert torch.equal(o2, o3), (Sq, Sk, (o2.float() - o3.float()).abs().max())
        assert torch.equal(lse2, lse3), (Sq, Sk)
    lens_q, lens_k = [700, 1, 0, 300], [700, 64, 10, 1000]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 64, dtype, seed=11)
    o2, lse2 = run(
        lambda: module.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    )
    check_packed(o2, lse2, q, k, v, cu_q, cu_k, True, None)
    o3, lse3 = run(
        lambda: attention_host.attention_varlen(
            three, q, k, v, cu_q, cu_k, None, None, None, True, None, True, None
        )
    )
    assert torch.equal(o2, o3) and torch.equal(lse2, lse3)


# ---------------------------------------------------------------- kernels without the mask code


def check_mask_code_only_where_something_is_masked(module, head_dims):
    """launch_options: at the head dims `head_dims`, a launch that masks no element - no causal
    or window cut, batch mode, Sk a multiple of the 128-key tile - gets the kernel compiled
    without the element-mask code (edge_masks=False); a cut, a ragged Sk or packed sequences (a
    sequence's last tile may end inside it) keep it, and so does every launch at the other head
    dims. The compile_args of CI's checks build the same object as a launch. (Stage 12 drops it at D = 64 only.)"""

    def edge_masks(D, Sq, Sk, causal=False, window=None, varlen=False):
        left, right = masks.resolve_window(causal, window, Sq, Sk)
        opts = attention_host.kernel_options(module.Sm90Kernel, D, left, right, Sq, Sk, 1, varlen)
        kernel, _ = module.compile_args(
            torch.bfloat16, (2, 4, Sq, Sk, D), causal=causal, window=window, varlen=varlen
        )
        assert kernel.edge_masks == opts.get("edge_masks", True), (D, Sq, Sk, causal, window)
        return kernel.edge_masks

    for D in (64, 128):
        free = D in head_dims
        assert edge_masks(D, 1024, 1024) != free
        assert edge_masks(D, 1000, 2048) != free  # a ragged Sq masks no key
        assert edge_masks(D, 1, 128) != free
        assert edge_masks(D, 1024, 1000)  # the last KV tile reaches past Sk
        assert edge_masks(D, 1024, 1152 + 1)
        assert edge_masks(D, 1024, 1024, causal=True)
        assert edge_masks(D, 1024, 1024, window=(100, 100))
        assert edge_masks(D, 1024, 1024, window=(1023, None))  # left < Sk counts as a cut
        assert edge_masks(D, 512, 2048, window=(3000, 3000)) != free  # wider than the keys
        assert edge_masks(D, 1024, 1024, varlen=True)


def check_kernels_with_and_without_mask_code_agree(module, dtype, D, head_dims):
    """Launches alternating, in one process, between shapes that take the kernel without the
    mask code (Sk a multiple of 128, no cut) and shapes that need the one with it (a ragged Sk,
    causal, GQA): each against the fp64 reference, and the mask-free ones bit for bit against
    the same launches pinned to the kernel with the mask code (the same arithmetic: no tile
    crosses an edge there). A kernel reused on a launch it was not compiled for fails here:
    without the mask, the keys TMA fills with zeros past a ragged Sk would count as S = 0.
    head_dims: where the stage drops the mask code (elsewhere every launch keeps it). (Stage 12.)"""

    class with_mask_code(module.Sm90Kernel):
        launch_options = staticmethod(lambda *a: {"edge_masks": True})

    sequence = [  # (B, H, Hkv, Sq, Sk, causal): mask code needed?
        ((2, 4, 4, 1024, 1024, False), False),
        ((2, 4, 4, 1024, 1000, False), True),
        ((1, 8, 2, 333, 1024, False), False),
        ((2, 4, 4, 1024, 1024, True), True),
        ((2, 4, 4, 700, 1025, False), True),
        ((2, 4, 4, 1024, 1024, False), False),
    ]
    for (B, H, Hkv, Sq, Sk, causal), needed in sequence:
        left, right = masks.resolve_window(causal, None, Sq, Sk)
        opts = attention_host.kernel_options(
            module.Sm90Kernel, D, left, right, Sq, Sk, H // Hkv, False
        )
        needed = needed or D not in head_dims
        assert opts.get("edge_masks", True) == needed, (Sq, Sk, causal)
        q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=Sq + Sk + D)
        _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, D, dtype, seed=Sk + D)
        o, lse = run(lambda: module.attention(q, k, v, causal=causal, return_lse=True))
        gqa_reference_check("O", o, lse, q, k, v, causal, None)
        if not needed:
            o_m, lse_m = run(
                lambda: attention_host.attention(
                    with_mask_code, q, k, v, None, causal, None, True, None
                )
            )
            assert torch.equal(o, o_m), (Sq, Sk, (o.float() - o_m.float()).abs().max())
            assert torch.equal(lse, lse_m), (Sq, Sk)


# ---------------------------------------------------------------- launching on the caller's stream


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("stage", [7, 8, 9, 10, 11, 12])
def test_launches_on_the_current_stream(stage):
    """Stages 7-12 launch through TVM-FFI, which takes the stream from the caller's context. On a
    side stream: a 50 ms sleep, then the inputs are written (they are NaN before), then the call;
    a kernel launched on any other stream would run before the inputs exist and read NaN."""
    mod = stage_table.track_module(stage, "hopper")
    B, H, S, D = 2, 4, 512, 128
    q_ref, k_ref, v_ref = inputs.attention_inputs(B, H, S, S, D, torch.bfloat16, seed=3)
    q, k, v = (torch.full_like(t, float("nan")) for t in (q_ref, k_ref, v_ref))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # about 50 ms of GPU cycles at ~1 GHz
        for t, ref in ((q, q_ref), (k, k_ref), (v, v_ref)):
            t.copy_(ref)
        o = mod.attention(q, k, v)
    side.synchronize()
    o_ref = stage7.attention(q_ref, k_ref, v_ref)
    torch.cuda.synchronize()
    assert not o.isnan().any(), "the kernel read its inputs before the side stream wrote them"
    # Stages 7-12 give the same O bit for bit (tests/test_stage_chain.py).
    assert torch.equal(o, o_ref), (o.float() - o_ref.float()).abs().max()


# ---------------------------------------------------------------- two warpgroups for short masks


def test_short_masks_take_two_warpgroups_at_d64():
    check_short_masks_take_two_warpgroups_at_d64(hopper)


def test_launch_builds_what_launch_options_ask_for(monkeypatch):
    """The launch itself, not only compile_args, builds the kernel with launch_options' choice: a
    spy in place of the compile cache records the kernel object of each launch (CPU tensors;
    nothing is compiled or run). Batch and packed, with and without pack-GQA, both sides of the
    1024-key cut, and a class without the hook (stage 7) built as before."""
    import contextlib

    built = []

    def spy(kernel, *args):
        built.append(kernel)
        return lambda *a: None

    monkeypatch.setattr(attention_host, "cached_compile_ffi", spy)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    cases = [  # (varlen, H, Hkv, Sq, Sk, causal, window, D) -> (warpgroups, pack)
        ((False, 4, 4, 700, 700, True, None, 64), (2, 1)),
        ((False, 4, 4, 1100, 1100, True, None, 64), (3, 1)),
        ((False, 4, 4, 700, 700, False, None, 64), (3, 1)),
        ((False, 4, 4, 4000, 4000, False, (200, 0), 64), (2, 1)),
        # decode-like: causal at Sq = 1 cuts nothing (the launch drops it), pack-GQA, 192 rows
        ((False, 8, 2, 1, 900, True, None, 64), (3, 4)),
        ((False, 8, 2, 1, 900, False, (100, 0), 64), (2, 4)),  # a window: 128 rows
        ((False, 8, 2, 1, 2000, True, None, 64), (3, 4)),
        ((False, 4, 4, 700, 700, True, None, 128), (2, 1)),
        ((True, 4, 2, 600, 1000, True, None, 64), (2, 1)),  # packed: the longest sequence
        ((True, 4, 2, 600, 1300, True, None, 64), (3, None)),  # 192 rows: pack-GQA packs 2
    ]
    for (varlen, H, Hkv, Sq, Sk, causal, window, D), (wgs, pack) in cases:
        B = 1 if varlen else 2
        q, o = (torch.randn(B, H, Sq, D).bfloat16() for _ in range(2))
        k, v = (torch.randn(B, Hkv, Sk, D).bfloat16() for _ in range(2))
        lse = torch.empty(B, H, Sq)
        cu_q = torch.tensor([0, Sq], dtype=torch.int32) if varlen else None
        cu_k = torch.tensor([0, Sk], dtype=torch.int32) if varlen else None
        attention_host.launch(
            hopper.Sm90Kernel, q, k, v, o, lse, cu_q, cu_k, Sq, 0.125, causal, window, Sk
        )
        # pack: as choose_pack decides for the tile's rows (None: not asserted beyond that)
        pack = pack if pack is not None else choose_pack(H, Hkv, Sq, 64 * wgs)
        got = (built[-1].mma_warpgroups, built[-1].pack_gqa)
        assert got == (wgs, pack), ((varlen, H, Hkv, Sq, Sk, causal, window, D), got)
    q = torch.randn(2, 4, 700, 64).bfloat16()
    attention_host.launch(
        stage7.Sm90Kernel, q, q, q, q.clone(), torch.empty(2, 4, 700), None, None, 700, 0.125,
        True, None, 700,
    )  # fmt: skip
    assert type(built[-1]) is stage7.Sm90Kernel and built[-1].cta_tile[0] == 128


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_short_masks_at_d64_two_and_three_warpgroups_agree(dtype):
    check_two_and_three_warpgroups_agree(hopper, dtype)


# ---------------------------------------------------------------- kernels without the mask code


def test_mask_code_only_where_something_is_masked():
    check_mask_code_only_where_something_is_masked(hopper, head_dims=(64,))


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_kernels_with_and_without_mask_code_agree(dtype, D):
    check_kernels_with_and_without_mask_code_agree(hopper, dtype, D, head_dims=(64,))
