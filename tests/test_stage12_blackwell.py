"""Stage 12 (Blackwell): the last percent - FA4's tunings of the softmax's arithmetic, of the
register split and of O's store over stage 11, each switchable (TUNINGS, with_tunings), on
sm_100a.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch and packed: with every tuning,
  stage 11's roles and barriers, O's staging buffers and a TMA store per Q tile in batch mode
  (tuning 4); setmaxnreg 176 / 112 / 48 (tuning 3); 226 ex2.approx (stage 11: 258) beside the
  emulation's f32x2 instructions; stage 11's MMA order (each GEMM's k-blocks in a loop); the
  tcgen05 fences on every path; no spill in any configuration (no mask, causal, window,
  packed, pack-GQA; ptxas of CUDA 13.0, 2026-12-06).
  with_tunings(()) compiles to stage 11's PTX; each tuning alone compiles and shows its
  technique in the PTX; unknown names are refused.
- CPU: the emulated exp2's arithmetic, on a numpy copy of exp2_emulated: within 8.8e-5 of 2^x,
  exactly 0 at -inf. The schedule checker replays the five roles over several work tiles
  (common/tools/schedule.py): the tunings leave the schedule as stage 11's.
- GPU tests (marker gpu_blackwell): register_split and o_tma_store leave O and LSE bit for bit
  against stage 11; ex2_emulation, packed_f32x2 and all four within the bound of the
  fp64 reference check; stage 7's numerical tests run on this stage from tests/test_stage7.py.
  Not run: no sm_100 GPU was available (2026-12-04).
"""

import re

import numpy as np
import pytest
import torch
from attention_cases import DTYPES, dtype_id, gqa_reference_check
from blackwell_ptx import (
    SPILL_CONFIGS,
    assert_no_spill,
    assert_no_spill_in,
    assert_tcgen05_fences,
)
from ptxas_checks import ptxas_ran
from test_stage11_blackwell import WORK, statements

from common import attention_host
from common.tools import inputs, schedule, verify
from common.tools.ptx import code_only, compile_for_arch, compile_only, tcgen05_mma_order
from stages.stage11_persistent import blackwell as stage11
from stages.stage12_last_percent import blackwell

SHAPE = (2, 8, 512, 1024, 128)


def count(ptx, pattern):
    return len(statements(ptx, pattern))


# ---------------------------------------------------------------- compile-only, every tuning


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_compiles_with_every_tuning(varlen, D, dtype):
    shape = (*SHAPE[:4], D)
    report = compile_only(
        12, "blackwell", dtype=dtype, shape=shape, kv_heads=2, varlen=varlen, causal=True
    )
    eleven = compile_only(
        11,
        "blackwell",
        dtype=dtype,
        shape=shape,
        kv_heads=2,
        varlen=varlen,
        causal=True,
        resources=False,
    )
    ptx = report.ptx
    assert ".reqntid 512, 1, 1" in ptx and ".minnctapersm 1" in ptx
    # Tuning 3: 176 for each softmax warpgroup, 112 for the correction warpgroup, 48 for the
    # idle, TMA and MMA warps: (2 x 176 + 112 + 48) x 128 = 65536
    assert count(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+176;") == 2
    assert count(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+112;") == 1
    assert count(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+48;") == 3
    # Tuning 1: per softmax warpgroup 112 of P's 128 exp2 and row_scale's on MUFU (stage 11:
    # 2 x 129); the 16 others as 8 pairs of add.rm.f32x2 and 3 fma.rn.f32x2. Tuning 2: 64
    # fma.rn.f32x2 for the scale-and-subtract, 63 add.f32x2 for the row sum.
    assert report.counts["ex2.approx"] == 2 * (112 + 1) == eleven.counts["ex2.approx"] - 32
    assert count(ptx, r"add\.rm\.f32x2") == 2 * 8
    assert count(ptx, r"fma\.rn\.f32x2") == 2 * (64 + 3 * 8)
    assert count(ptx, r"add\.rn\.f32x2") == 2 * 63
    # stage 11's order of MMAs, each GEMM's k-blocks one tcgen05.mma in a loop
    order = tcgen05_mma_order(ptx)
    assert order == tcgen05_mma_order(eleven.ptx) == ("QQPQPQPP" if D == 64 else "QQPP")
    # stage 11's tile scheduler, hand-over (32 and 416 arrivals) and fences, every path fenced
    assert count(ptx, r"atom\.global\.add") == 1
    counts = [c for _, c in schedule.mbarrier_init_counts(ptx)]
    assert counts.count(416) == 1 and 32 in counts
    assert_tcgen05_fences(ptx, before=11, after=16 if D == 64 else 12)
    # Tuning 4: O's own buffers next to Q and the ring; in batch mode a TMA store per Q tile
    kernel = blackwell.compile_args(dtype, shape)[0]
    assert (kernel.o_buffers, kernel.kv_slots) == {64: (2, 8), 128: (1, 3)}[D]
    tma_stores = count(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")
    assert tma_stores == (0 if varlen else 2 * D // 64)
    assert report.shared_memory_bytes <= 227 * 1024
    if ptxas_ran(report.resources, "sm_100a"):
        assert_no_spill(report)


@pytest.mark.parametrize("config", list(SPILL_CONFIGS))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_no_spill_in_any_configuration(dtype, D, config):
    """ptxas of CUDA 13.0 (2026-12-06): no spill with every tuning, as stage 11 without them;
    tuning 4 without tuning 3 (stage 11's 184 / 96 / 48) spills 16-112 bytes at D = 64 in batch
    mode."""
    assert_no_spill_in(12, dtype, D, config)


# ---------------------------------------------------------------- the tunings as switches


def ptx_of(kernel_class, D, **options):
    kernel, args = attention_host.compile_args(
        kernel_class, torch.bfloat16, (*SHAPE[:4], D), **options
    )
    ptx, _ = compile_for_arch(kernel, args, "sm_100a")
    return code_only(ptx)  # the entry's name carries the class's: compare the code only


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"varlen": True}], ids=str)
def test_no_tunings_is_stage_11(D, options):
    assert ptx_of(blackwell.with_tunings(()), D, **options) == ptx_of(
        stage11.Sm100Kernel, D, **options
    )


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", blackwell.TUNINGS)
def test_each_tuning_alone_shows_its_technique(name, D):
    one, none = ptx_of(blackwell.with_tunings([name]), D), ptx_of(blackwell.with_tunings(()), D)
    assert one != none

    def n(ptx, pattern):
        return count(ptx, pattern)

    ex2, fma2, mma = r"ex2\.approx", r"fma\.rn\.f32x2", r"tcgen05\.mma"
    if name == "ex2_emulation":
        # 2 x 16 exp2 move from MUFU to the FMA pipe: 2 x 8 pairs of 3 fma.rn.f32x2
        assert (n(none, ex2), n(one, ex2)) == (258, 226)
        assert (n(none, fma2), n(one, fma2)) == (0, 2 * 3 * 8)
        assert n(one, r"add\.rm\.f32x2") == 2 * 8
    elif name == "packed_f32x2":
        # the scale-and-subtract: 2 x 128 mul.f32 and sub.f32 -> 2 x 64 fma.rn.f32x2; the row
        # sum: 2 x 128 add.f32 -> 2 x 63 add.f32x2
        assert n(one, ex2) == n(none, ex2) == 258
        assert (n(none, fma2), n(one, fma2)) == (0, 2 * 64)
        assert n(none, r"mul\.f32\s") - n(one, r"mul\.f32\s") == 2 * 128
        assert (n(none, r"add\.f32\s"), n(one, r"add\.f32\s")) == (2 * 128, 2)
        assert n(one, r"add\.rn\.f32x2") == 2 * 63
        # O's rescale and normalisation are mul.f32x2 in both (the DSL packs them)
        assert n(one, r"mul\.f32x2") == n(none, r"mul\.f32x2") > 0
    elif name == "register_split":
        regs = r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);"
        assert sorted(map(int, re.findall(regs, none))) == [48, 48, 48, 96, 184, 184]
        assert sorted(map(int, re.findall(regs, one))) == [48, 48, 48, 112, 176, 176]
        # the MMAs as stage 11's: each GEMM's k-blocks one tcgen05.mma in a loop (4 QK and 4
        # PV sites at D = 64, 2 and 2 at D = 128)
        assert n(one, mma) == n(none, mma) == {64: 8, 128: 4}[D]
        assert tcgen05_mma_order(one) == tcgen05_mma_order(none)
    else:  # o_tma_store
        # stage 11: each Q tile's O by threads' 16-byte stores; tuning 4: staged in shared
        # memory, one TMA store per 64-column box of each Q tile, a bulk group per Q tile
        tma = r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta"
        assert (n(none, tma), n(one, tma)) == (0, 2 * D // 64)
        assert n(one, r"cp\.async\.bulk\.commit_group") == 2
        assert (n(none, r"st\.global\.v4\.b32"), n(one, r"st\.global\.v4\.b32")) == (2 * D // 8, 0)


def test_with_tunings_checks_its_names_and_keeps_one_class_per_set():
    assert blackwell.with_tunings(blackwell.TUNINGS) is blackwell.Sm100Kernel
    a = blackwell.with_tunings(["o_tma_store", "register_split"])
    assert a is blackwell.with_tunings(("register_split", "o_tma_store"))  # order does not matter
    assert a.TUNINGS == ("register_split", "o_tma_store") and issubclass(a, blackwell.Sm100Kernel)
    with pytest.raises(ValueError, match="argument 'names'.*unknown tunings.*ex2_emulate"):
        blackwell.with_tunings(["ex2_emulate"])
    with pytest.raises(TypeError, match="argument 'names'"):
        blackwell.with_tunings("register_split")
    import cutlass

    none = blackwell.with_tunings(())(cutlass.BFloat16, 128, sm_count=1)
    assert (none.softmax_registers, none.correction_registers, none.other_registers) == (
        184,
        96,
        48,
    )
    full = blackwell.Sm100Kernel(cutlass.BFloat16, 128, sm_count=1)
    assert (
        128 * (2 * full.softmax_registers + full.correction_registers + full.other_registers)
        == 65536
    )


# ---------------------------------------------------------------- the emulated exp2 (CPU)


def exp2_emulated(x):
    """exp2_emulated's arithmetic in numpy fp32: n = floor(x) from x + 1.5 x 2^23 rounded down,
    2^f from the cubic, n added to its exponent bits."""
    x = np.maximum(np.asarray(x, np.float32), np.float32(-127.0))
    n = np.floor(x)
    f = (x - n).astype(np.float32)
    c0, c1, c2, c3 = (np.float32(c) for c in blackwell.EX2_CUBIC)
    p = ((c3 * f + c2) * f + c1) * f + c0
    # x + 1.5 x 2^23 rounded down holds n in its low mantissa bits: its bits are those of
    # 1.5 x 2^23 plus n, and shifted left by 23 only n's (mod 2^9) stay.
    low = (np.float32(1.5 * 2**23) + n).astype(np.float32).view(np.int32)
    bits = (
        p.astype(np.float32).view(np.int32).astype(np.int64) + (low.astype(np.int64) << 23)
    ) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(np.float32)


def test_emulated_exp2_within_its_bound_and_exactly_zero_when_masked():
    x = np.linspace(-126.0, 8.0, 400_001, dtype=np.float32)
    got, want = exp2_emulated(x).astype(np.float64), np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / want - 1.0)) < 8.8e-5
    # the cubic is exact at f = 0: integer x gives 2^x exactly
    ints = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(exp2_emulated(ints), np.exp2(ints))
    # S = -inf (masked) and anything at or below -127: P = 0.0 exactly, as ex2.approx.ftz
    assert np.array_equal(exp2_emulated([-np.inf, -127.0, -1e30]), np.zeros(3, np.float32))


def test_cubic_is_below_the_rounding_of_p():
    f = np.linspace(0.0, 1.0, 100_001)
    c0, c1, c2, c3 = blackwell.EX2_CUBIC
    err = np.max(np.abs((((c3 * f + c2) * f + c1) * f + c0) / np.exp2(f) - 1.0))
    # bf16 keeps 8 significant bits (rounding error up to 2^-8), fp16 11 (2^-11)
    assert 8.7e-5 < err < 8.8e-5 < 2.0**-11 < 2.0**-8


# ---------------------------------------------------------------- the schedule, on the CPU


def traced_kernel(D):
    kernel, args = blackwell.compile_args(torch.bfloat16, (1, 2, 512, 1024, D))
    compile_for_arch(kernel, args, "sm_100a")
    return kernel


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("work", WORK, ids=str)
def test_phases_run_on_across_work_tiles(D, work):
    pipes, programs = schedule.cta_schedule(traced_kernel(D))
    assert schedule.simulate_cta(pipes, programs, list(work)) == []


# ---------------------------------------------------------------- GPU (sm_100)


def outputs(kernel_class, D, dtype, causal):
    q, _, _ = inputs.attention_inputs(2, 8, 700, 700, D, dtype, seed=D)
    _, k, v = inputs.attention_inputs(2, 2, 700, 1500, D, dtype, seed=D + 1)
    o, lse = verify.run_with_deadline(
        lambda: attention_host.attention(kernel_class, q, k, v, None, causal, None, True, None),
        seconds=120,
        what=f"stage 12 blackwell {kernel_class.__name__}",
    )
    return (q, k, v), o, lse


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", ["register_split", "o_tma_store"])
def test_schedule_tunings_leave_o_bit_for_bit(name, D, causal):
    _, o, lse = outputs(blackwell.with_tunings([name]), D, torch.bfloat16, causal)
    _, o11, lse11 = outputs(stage11.Sm100Kernel, D, torch.bfloat16, causal)
    assert torch.equal(o, o11) and torch.equal(lse, lse11), name


@pytest.mark.gpu_blackwell
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize(
    "names", [["ex2_emulation"], ["packed_f32x2"], list(blackwell.TUNINGS)], ids=str
)
def test_arithmetic_tunings_match_the_reference(names, D, dtype):
    (q, k, v), o, lse = outputs(blackwell.with_tunings(names), D, dtype, True)
    gqa_reference_check("O", o, lse, q, k, v, True, None)
