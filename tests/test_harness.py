"""Tests of the harness itself: the checker must fail wrong or unwritten results, the argument
checks must name the argument, the PTX counter must count, and the GPU deadline must fire."""

import math

import pytest
import torch

from common import arch, checks, outputs
from common.tools import ptx as ptx_tools
from common.tools import reference, stage_table, verify


def _ref_and_out(seed=0):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(64, 48, generator=g, dtype=torch.float64)
    return ref, ref.to(torch.bfloat16)


def test_checker_passes_a_correct_low_precision_result():
    ref, out = _ref_and_out()
    r = verify.check_close("out", out, ref, rtol=1e-2)
    assert r.passed and r.rel_err < 5e-3  # bf16 rounding alone: about 2^-9 relative


def test_checker_fails_a_wrong_result_and_names_the_worst_element():
    ref, out = _ref_and_out()
    wrong = out.clone()
    wrong[17, 5] += 4.0
    with pytest.raises(AssertionError, match=r"worst element at \(17, 5\)"):
        verify.check_close("out", wrong, ref, rtol=1e-2)


def test_checker_fails_an_unwritten_element():
    ref, out = _ref_and_out()
    partly = outputs.poison(torch.empty_like(out))
    partly[:, :-1] = out[:, :-1]  # the last column was never written: still NaN
    r = verify.compare("out", partly, ref, rtol=1e-2)
    assert not r.passed and r.nonfinite == 64
    with pytest.raises(AssertionError, match="non-finite"):
        verify.check_close("out", partly, ref, rtol=1e-2)


def test_checker_never_passes_nan_or_inf_even_with_a_huge_tolerance():
    ref, out = _ref_and_out()
    for bad in (float("nan"), float("inf")):
        o = out.clone()
        o[0, 0] = bad
        assert not verify.compare("out", o, ref, rtol=1e9).passed


def test_checker_holds_kernels_to_a_multiple_of_pytorchs_error():
    ref, out = _ref_and_out()
    worse = (out.double() * (1 + 2e-2)).to(torch.bfloat16)  # 2% off: inside rtol=5e-2 ...
    r = verify.compare("out", worse, ref, rtol=5e-2, torch_lowp=out)
    assert not r.passed  # ... but far more than 3x PyTorch's own bf16 error
    assert r.torch_rel_err is not None and r.bound < 2e-2


def test_check_attention_holds_o_to_pytorchs_error_and_lse_to_fp32():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, S, 64, generator=g).to(torch.bfloat16) for S in (32, 48, 48))
    o_ref, lse_ref = reference.attention_ref(q, k, v)
    o_res, lse_res = verify.check_attention(
        "O", o_ref.to(torch.bfloat16), q, k, v, lse=lse_ref.float()
    )
    assert o_res.torch_rel_err is not None and o_res.bound < 1e-2 and lse_res.rel_err < 1e-6
    with pytest.raises(
        AssertionError, match="O: rel err"
    ):  # 1% off: more than 3x PyTorch's bf16 error
        verify.check_attention("O", (o_ref * 1.01).to(torch.bfloat16), q, k, v)
    with pytest.raises(
        AssertionError, match="LSE of O: rel err"
    ):  # log2 in place of the natural log
        verify.check_attention(
            "O", o_ref.to(torch.bfloat16), q, k, v, lse=(lse_ref / math.log(2)).float()
        )
    with pytest.raises(AssertionError, match="non-finite"):
        verify.check_attention("O", outputs.poison(torch.empty_like(q)), q, k, v)


def test_check_attention_floor_applies_when_pytorch_is_exact():
    # One key: O = V exactly, PyTorch's error is 0, so the bound is the floor (one bf16 rounding).
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, S, 64, generator=g).to(torch.bfloat16) for S in (16, 1, 1))
    r, _ = verify.check_attention("O", v.expand_as(q).contiguous(), q, k, v)
    assert r.torch_rel_err == 0 and r.bound == 2.0**-8
    off = (v.double() * (1 + 2.0**-6)).to(torch.bfloat16).expand_as(q).contiguous()
    with pytest.raises(AssertionError, match=r"bound 3\.906e-03"):
        verify.check_attention("O", off, q, k, v)


def test_expect_tx_immediates_reads_the_armed_byte_counts():
    ptx = """
    mov.b32 %r11, 32768;
    mbarrier.arrive.expect_tx.shared.b64 %rd4, [%r9], %r11;
    mbarrier.arrive.expect_tx.shared.b64 %rd5, [%r10+8], %r12;
    """
    assert ptx_tools.expect_tx_immediates(ptx) == [32768, None]


def test_poisoned_outputs_are_nan_unless_a_benchmark_turns_it_off(monkeypatch):
    assert torch.isnan(outputs.empty_output((4, 4), torch.float32, "cpu")).all()
    calls = []
    real_poison = outputs.poison

    def counting_poison(t):
        calls.append(t)
        return real_poison(t)

    monkeypatch.setattr(outputs, "poison", counting_poison)
    with outputs.no_poison():
        outputs.empty_output((4, 4), torch.float32, "cpu")
    assert len(calls) == 0  # no NaN fill inside no_poison(): a benchmark does not time it
    out = outputs.empty_output((4, 4), torch.bfloat16, "cpu")
    assert len(calls) == 1 and torch.isnan(out).all()  # poisoning is back on after the block


def test_references_agree_with_the_definitions():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    o, lse = reference.attention_ref(q, k, v)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(8)
    assert torch.allclose(lse, torch.logsumexp(s, -1))
    assert torch.allclose(o, torch.softmax(s, -1) @ v.double())
    a, b = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    assert torch.allclose(reference.gemm_ref(a, b), a.double() @ b.double().T)


def test_argument_checks_name_the_argument():
    x = torch.zeros(2, 3, 4, 64, dtype=torch.float32)
    with pytest.raises(
        TypeError, match="argument 'q': dtype float32 is not supported; allowed: bfloat16, float16"
    ):
        checks.check_tensor("q", x, rank=4)
    with pytest.raises(ValueError, match="argument 'q': expected a rank-4 tensor"):
        checks.check_tensor("q", x[0].bfloat16(), rank=4)
    with pytest.raises(ValueError, match="argument 'q': must be a CUDA tensor"):
        checks.check_tensor("q", x.bfloat16(), rank=4)
    with pytest.raises(ValueError, match="head dim D = 96 is not supported"):
        checks.check_choice("head dim D", 96, (64, 128))
    with pytest.raises(ValueError, match="argument 'scale'"):
        checks.check_scale(-1.0, 64)
    assert checks.check_scale(None, 64) == 0.125
    q, k = torch.zeros(1, 2, 8, 64), torch.zeros(1, 4, 8, 64, dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"heads: 'q'\.shape\[1\] = 2 must equal 'k'\.shape\[1\] = 4"
    ):
        checks.check_dim_eq("q", q, 1, "k", k, 1, "heads")
    with pytest.raises(
        TypeError, match=r"arguments 'q', 'k' must share one dtype, got q: float32, k: float16"
    ):
        checks.check_same_dtype(["q", "k"], [q, k])


def test_track_mapping():
    assert arch.track_of_capability((9, 0)) == "hopper"
    assert arch.track_of_capability((10, 0)) == "blackwell"
    assert arch.track_of_capability((10, 3)) == "blackwell"
    assert arch.track_of_capability((8, 0)) is None
    assert arch.track_of_capability((12, 0)) is None
    if arch.compute_capability() is None:
        with pytest.raises(arch.UnsupportedGPUError, match="no CUDA GPU"):
            arch.track()


def test_ptx_counter_counts_statements_and_ignores_comments():
    ptx = """
    // wgmma.mma_async in a comment does not count
    wgmma.fence.sync.aligned;
    wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 0;
    @%p3 wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 0;
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd3, {%r2, %r3}], [%r4];
    cp.async.bulk.tensor.4d.shared::cta.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%r1], [%rd3, {%r2, %r3, %r2, %r3}], [%r4], %rd9;
    cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%rd3, {%r2, %r3}], [%r1];
    mbarrier.try_wait.parity.shared::cta.b64 %p1, [%r5], %r6;
    """
    c = ptx_tools.count_ptx(ptx)
    assert c["wgmma.mma_async"] == 2 and c["wgmma.fence"] == 1
    assert (
        c["cp.async.bulk.tensor (load)"] == 2
        and c["cp.async.bulk.tensor (store)"] == 1
        and c["mbarrier.try_wait"] == 1
    )
    assert c["tcgen05.mma"] == 0


def test_stage_table_is_consistent():
    assert [s.number for s in stage_table.STAGES] == list(range(1, 15))
    # Every stage has its file on both tracks: the parametrisations that run only where a file
    # exists (tests/tracks.py on_gpu_stages / on_cpu_stages, test_layouts, test_notebooks) would
    # otherwise drop a missing one's cases without a word.
    missing = [
        (s.number, track)
        for s in stage_table.STAGES
        for track in ("hopper", "blackwell")
        if not stage_table.available(s.number, track)
    ]
    assert missing == [], f"stage files missing: {missing}"
    with pytest.raises(ValueError, match="stage 15 does not exist"):
        stage_table.stage(15)


@pytest.mark.gpu_any
def test_deadline_turns_a_kernel_that_never_finishes_into_an_error():
    # torch.cuda._sleep spins one GPU thread for a number of clock cycles: ~10 s at ~2 GHz stands
    # in for a deadlocked kernel. The deadline (1 s) must fire long before it ends.
    import time

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="deadlock"):
        verify.run_with_deadline(
            lambda: torch.cuda._sleep(20_000_000_000), seconds=1.0, what="spin"
        )
    assert time.monotonic() - t0 < 5
    torch.cuda.synchronize()  # drain the spinning kernel before the next test
    out = verify.run_with_deadline(lambda: torch.ones(4, device="cuda") * 2, seconds=10.0)
    assert out.sum().item() == 8


# ---------------------------------------------------------------- cu_seqlens validation cache


def test_cu_seqlens_validated_once_per_pair_and_again_after_a_write(monkeypatch):
    from common import checks

    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    q, k = torch.empty(30, 2, 64), torch.empty(50, 2, 64)
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 50], dtype=torch.int32)
    assert checks.check_cu_seqlens(q, k, cu_q, cu_k, None, None) == (20, 30)
    assert len(reads) == 2
    # The same two tensors, unchanged: no read, the same answer, max_seqlen still checked.
    assert checks.check_cu_seqlens(q, k, cu_q, cu_k, 25, None) == (25, 30)
    assert len(reads) == 2
    with pytest.raises(ValueError, match="'max_seqlen_k' = 29 is smaller than the longest"):
        checks.check_cu_seqlens(q, k, cu_q, cu_k, None, 29)
    # Written in place (through a view, too): read and refused again.
    cu_q[1:2].fill_(31)
    with pytest.raises(ValueError, match="non-decreasing"):
        checks.check_cu_seqlens(q, k, cu_q, cu_k, None, None)
    cu_q[1] = 10
    assert checks.check_cu_seqlens(q, k, cu_q, cu_k, None, None) == (20, 30)
    # Other token counts than the ones checked against: read again.
    n = len(reads)
    with pytest.raises(ValueError, match="must equal the number of tokens 31"):
        checks.check_cu_seqlens(torch.empty(31, 2, 64), k, cu_q, cu_k, None, None)
    assert len(reads) > n
    # Equal values in new tensor objects are read (another pair, nothing known about it).
    n = len(reads)
    checks.check_cu_seqlens(q, k, cu_q.clone(), cu_k.clone(), None, None)
    assert len(reads) == n + 2


def test_cu_seqlens_made_in_inference_mode_are_read_every_call(monkeypatch):
    # Inference tensors have no version counter (reading _version raises): never cached.
    from common import checks

    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    with torch.inference_mode():
        q, k = torch.empty(30, 2, 64), torch.empty(50, 2, 64)
        cu_q = torch.tensor([0, 10, 30], dtype=torch.int32)
        cu_k = torch.tensor([0, 20, 50], dtype=torch.int32)
        for _ in range(2):
            assert checks.check_cu_seqlens(q, k, cu_q, cu_k, None, None) == (20, 30)
        cu_q[1] = 31
        with pytest.raises(ValueError, match="non-decreasing"):
            checks.check_cu_seqlens(q, k, cu_q, cu_k, None, None)
    assert len(reads) == 2 + 2 + 1  # the third call stops at cu_seqlens_q


def test_interleaved_timing_rotates_the_order_and_takes_each_fns_median(monkeypatch):
    """timing.interleaved: every round times each fn once, the first fn of a round moves on by
    one each round, all event rounds come before the GPU-time rounds, and a fn's result is the
    median of its rounds (so one slow round does not move it)."""
    from common.tools import timing

    log = []
    samples = {"a": iter([5.0, 1.0, 1.0]), "b": iter([2.0, 2.0, 9.0]), "c": iter([3.0] * 3)}
    gpu = {"a": iter([0.5] * 3), "b": iter([0.25] * 3), "c": iter([0.75] * 3)}

    def fake_time_ms(fn, sets, warmup=0, reps=0):
        log.append(("event", fn()))
        return next(samples[fn()])

    def fake_gpu_ms(fn, sets, reps=0):
        log.append(("gpu", fn()))
        return next(gpu[fn()])

    monkeypatch.setattr(timing, "time_ms", fake_time_ms)
    monkeypatch.setattr(timing, "gpu_ms", fake_gpu_ms)
    fns = {n: ((lambda n=n: n), [()]) for n in "abc"}
    ev, gp = timing.interleaved(fns, rounds=3, gpu=True)
    assert ev == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert gp == {"a": 0.5, "b": 0.25, "c": 0.75}
    order = "".join(n for _, n in log)
    assert order == "abcbcacab" * 2
    assert [k for k, _ in log] == ["event"] * 9 + ["gpu"] * 9


def test_results_files_are_tagged_by_gpu_name():
    from common.tools.timing import file_tag

    assert file_tag("NVIDIA H200") == "h200"
    assert file_tag("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"


def test_a_pinned_sdpa_call_is_timed_inside_its_backend_choice_entered_once():
    """timing.pinned: called directly, the call runs inside sdpa_kernel(backend) (here flash
    only: math off); what time_ms and gpu_ms time is the bare call, and the context they enter
    around it is that same choice, so a back-to-back time leaves out the context's own work."""
    import torch
    from torch.nn.attention import SDPBackend

    from common.tools import timing

    def enabled():
        return torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()

    before = enabled()
    run = timing.pinned(SDPBackend.FLASH_ATTENTION, enabled)
    assert run() == (True, False)
    assert enabled() == before  # left as it was
    call, context = timing._unpinned(run)
    assert call is enabled  # the bare call: no context entered per launch
    with context:
        assert call() == (True, False)
    assert enabled() == before
    plain = lambda: 1  # noqa: E731
    call, context = timing._unpinned(plain)
    assert call is plain
    with context:
        assert call() == 1


def test_time_ms_and_gpu_ms_time_a_pinned_call_inside_its_context(monkeypatch):
    """time_ms and gpu_ms (with CUDA's events, synchronize and the profiler stood in for on the
    CPU) call the bare call of a pinned SDPA callable, never its per-call wrapper, and every call
    they make runs inside the backend's context."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend

    from common.tools import timing

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    class Profile:
        def events(self):
            return []

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(
        "torch.profiler.profile", lambda **kw: contextlib.nullcontext(Profile()), raising=True
    )
    seen = []

    def bare():
        seen.append(
            (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
        )

    run = timing.pinned(SDPBackend.FLASH_ATTENTION, bare)
    wrapper_calls = []
    inner = run.timed
    run.timed = inner

    def counting_wrapper(*args):  # what a per-call pin would cost: must not be called
        wrapper_calls.append(args)
        return inner(*args)

    counting_wrapper.timed = inner
    counting_wrapper.outer_context = run.outer_context
    assert timing.time_ms(counting_wrapper, [()], warmup=2, reps=3) == 1.0
    assert len(seen) == 5 and set(seen) == {(True, False)}
    seen.clear()
    timing.gpu_ms(counting_wrapper, [()], reps=3)
    assert len(seen) == 4 and set(seen) == {(True, False)}
    assert wrapper_calls == []


def test_ptxas_report_is_checked_unless_ptxas_cannot_read_the_ptx(monkeypatch):
    """tests/ptxas_checks.py: the spill and register checks of the compile-only tests are left out
    only where ptxas is missing, too old for the PTX or without the target; PTX that ptxas
    rejects fails the test (a report with no spill count must not pass those checks unseen)."""
    from ptxas_checks import ptxas_ran

    from common.tools import notebook

    fatal = {"error": "ptxas fatal   : Ptx assembly aborted due to errors"}
    assert ptxas_ran(None, "sm_90a") is False
    assert ptxas_ran({**fatal, "ptxas_too_old": True}, "sm_90a") is False
    ran = {"registers": 160, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0}
    assert ptxas_ran(ran, "sm_90a") is True
    targets = ["sm_80", "sm_90", "sm_90a"]  # a CUDA 12.x ptxas: no sm_100a
    monkeypatch.setattr(
        notebook, "ptxas_info", lambda: {"path": "ptxas", "release": "12.4", "targets": targets}
    )
    assert ptxas_ran(fatal, "sm_100a") is False
    with pytest.raises(AssertionError, match="ptxas rejected the PTX for sm_90a"):
        ptxas_ran(fatal, "sm_90a")
    with pytest.raises(AssertionError):
        ptxas_ran({"registers": 160}, "sm_90a")  # no spill count in a report ptxas gave
