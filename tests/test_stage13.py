"""Stage 13, both tracks: split-KV (FlashDecoding), against fp64 references.

Stage 7's whole test set also runs on stage 13 (tests/tracks.py, KERNEL_STAGES), where the launch
splits wherever the work tiles leave SMs idle (most of those shapes: B x H x Q tiles < 0.8 x SMs),
and tests/test_stage_chain.py checks num_splits=1 equal to stage 12 bit for bit. Here:
- decode steps (Sq = 1) and speculative decoding (Sq = 2-8, causal bottom-right) over key counts
  from 1 to 256k, including counts that are not tile multiples; GQA groups 1, 4, 8 and MQA; both
  dtypes and head dims; the launch's split count and forced ones (1, 3, 16, 64);
- every split count 1 ... 64 on one input, each against the fp64 reference, and splits that get
  no key (more splits than KV tiles);
- seqused_k, batch mode and packed sequences, with NaN planted in every key and value past each
  sequence's used length: none may reach an output;
- a sequence of calls in one process alternating split and unsplit launches, shapes and modes;
- a decode step captured in a CUDA graph and replayed on new inputs (equal to eager calls), one
  with the LSE returned and one without (its LSE in the device's scratch, grown between replays);
- the combine kernel alone against its fp64 formula, including rows no split saw;
- bad input: num_splits and seqused_k checks (errors naming the argument), and the split-count
  rule on the CPU.
Outputs (and the partial buffers) are poisoned with NaN before every launch; each launch has a
120 s deadline.
"""

import re

import pytest
import torch
from attention_cases import DTYPES, dtype_id, gqa_reference_check, packed_inputs
from tracks import on_cpu_stages, on_gpu_stages, stage_module

from common import attention_host
from common.tools import inputs, verify

STAGES = (13,)
needs_cuda = pytest.mark.gpu_any  # skipped without CUDA (conftest.py)


def run(track, fn):
    return verify.run_with_deadline(fn, seconds=120, what=f"stage {track}")


def decode_inputs(B, H, Hkv, Sq, Sk, D, dtype, seed, device="cuda"):
    q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=seed, device=device)
    _, k, v = inputs.attention_inputs(B, Hkv, Sq, Sk, D, dtype, seed=seed + 1, device=device)
    return q, k, v


# (B, H, Hkv, Sq, Sk, D, dtype, causal)
DECODE = [
    (1, 32, 8, 1, 1, 128, torch.bfloat16, False),  # one key
    (1, 32, 8, 1, 127, 128, torch.bfloat16, True),
    (1, 32, 8, 1, 8192, 128, torch.bfloat16, True),  # the decode step of an 8-KV-head model
    (1, 32, 8, 1, 32768 + 77, 128, torch.float16, False),
    (2, 8, 8, 1, 3000, 64, torch.bfloat16, False),  # group 1
    (3, 16, 4, 1, 1025, 64, torch.float16, True),  # group 4
    (1, 16, 1, 1, 5000, 128, torch.bfloat16, True),  # MQA, group 16
    (4, 64, 8, 1, 700, 128, torch.bfloat16, True),  # group 8
    (1, 32, 8, 4, 4097, 128, torch.bfloat16, True),  # speculative decoding: 4 query tokens
    (2, 8, 2, 8, 999, 64, torch.float16, True),
    (1, 8, 8, 2, 300, 128, torch.bfloat16, True),
    (8, 32, 8, 1, 2048, 64, torch.bfloat16, False),
]


def decode_id(c):
    return "x".join(map(str, c[:6])) + ("-causal" if c[7] else "") + "-" + dtype_id(c[6])


@pytest.mark.parametrize("num_splits", [None, 1, 3, 16, 64], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("case", DECODE, ids=decode_id)
@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_decode_matches_fp64_reference(track, case, num_splits):
    B, H, Hkv, Sq, Sk, D, dtype, causal = case
    q, k, v = decode_inputs(B, H, Hkv, Sq, Sk, D, dtype, seed=Sk + H)
    o, lse = run(
        track,
        lambda: stage_module(track).attention(
            q, k, v, causal=causal, return_lse=True, num_splits=num_splits
        ),
    )
    gqa_reference_check(f"O splits={num_splits}", o, lse, q, k, v, causal, None)


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_long_context_decode(track):
    # 256k keys at batch 1, where the split matters most.
    q, k, v = decode_inputs(1, 16, 2, 1, 262144, 64, torch.bfloat16, seed=11)
    o, lse = run(track, lambda: stage_module(track).attention(q, k, v, return_lse=True))
    gqa_reference_check("O 256k keys", o, lse, q, k, v, False, None)


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_every_split_count_gives_the_same_answer(track):
    # 2,000 keys = 16 KV tiles: counts above 16 leave splits with no key.
    q, k, v = decode_inputs(1, 8, 2, 3, 2000, 128, torch.bfloat16, seed=5)
    mod = stage_module(track)
    o1, lse1 = run(track, lambda: mod.attention(q, k, v, causal=True, return_lse=True))
    for splits in range(1, 65):
        o, lse = run(
            track,
            lambda: mod.attention(q, k, v, causal=True, return_lse=True, num_splits=splits),
        )
        gqa_reference_check(f"O splits={splits}", o, lse, q, k, v, True, None)
        # Against the unsplit kernel: the same P per key, summed in another order.
        assert (o.float() - o1.float()).abs().max() <= 2 * torch.finfo(o.dtype).eps, splits
        assert torch.allclose(lse, lse1, rtol=1e-5, atol=1e-5), splits


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_more_splits_than_key_tiles_and_windows(track):
    mod = stage_module(track)
    q, k, v = decode_inputs(2, 8, 4, 5, 130, 64, torch.float16, seed=7)  # 2 KV tiles
    for window in [None, (3, 0), (0, 0), (200, 2)]:
        o, lse = run(
            track,
            lambda: mod.attention(q, k, v, window=window, return_lse=True, num_splits=64),
        )
        gqa_reference_check(f"O window={window}", o, lse, q, k, v, False, window)


def used_reference_check(name, o, lse, q, k, v, used, causal):
    """Sequence b against the reference over its first used[b] keys (none: O = 0, LSE = -inf)."""
    for b, n in enumerate(used):
        ob, lb = o[b : b + 1], lse[b : b + 1]
        if n == 0:
            assert (ob == 0).all() and (lb == float("-inf")).all(), f"{name} sequence {b}"
            continue
        kb, vb = (t[b : b + 1, :, :n] for t in (k, v))
        gqa_reference_check(f"{name} sequence {b}", ob, lb, q[b : b + 1], kb, vb, causal, None)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_seqused_k_never_reads_past_the_used_keys(track, num_splits, D):
    used = [0, 1, 129, 1000, 640]
    for Sq, causal in ((1, False), (5, True)):
        q, k, v = decode_inputs(len(used), 16, 4, Sq, 1000, D, torch.bfloat16, seed=D + Sq)
        kn, vn = k.clone(), v.clone()
        for b, n in enumerate(used):
            kn[b, :, n:] = float("nan")
            vn[b, :, n:] = float("nan")
        seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
        o, lse = run(
            track,
            lambda: stage_module(track).attention(
                q,
                kn,
                vn,
                causal=causal,
                return_lse=True,
                num_splits=num_splits,
                seqused_k=seqused,
            ),
        )
        used_reference_check(f"Sq={Sq}", o, lse, q, k, v, used, causal)


@pytest.mark.parametrize("num_splits", [None, 5])
@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_packed_sequences_with_seqused_k_and_nan_past_it(track, num_splits):
    lens_q, lens_k = [1, 1, 3, 0, 2, 4], [500, 1, 300, 40, 129, 2000]
    used = [400, 1, 0, 40, 100, 1999]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 8, 2, 128, torch.bfloat16, seed=3)
    kn, vn = k.clone(), v.clone()
    ck = cu_k.tolist()
    for b, n in enumerate(used):
        kn[ck[b] + n : ck[b + 1]] = float("nan")
        vn[ck[b] + n : ck[b + 1]] = float("nan")
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    o, lse = run(
        track,
        lambda: stage_module(track).attention_varlen(
            q,
            kn,
            vn,
            cu_q,
            cu_k,
            causal=True,
            return_lse=True,
            num_splits=num_splits,
            seqused_k=seqused,
        ),
    )
    cq = cu_q.tolist()
    for b, n in enumerate(used):
        q0, q1 = cq[b], cq[b + 1]
        if q1 == q0:
            continue
        ob = o[q0:q1].transpose(0, 1).unsqueeze(0)
        lb = lse[:, q0:q1].unsqueeze(0)
        if n == 0:
            assert (ob == 0).all() and (lb == float("-inf")).all(), f"sequence {b}"
            continue
        qb = q[q0:q1].transpose(0, 1).unsqueeze(0)
        kb, vb = (t[ck[b] : ck[b] + n].transpose(0, 1).unsqueeze(0) for t in (k, v))
        gqa_reference_check(f"sequence {b}", ob, lb, qb, kb, vb, True, None)


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_call_sequence_alternating_split_and_unsplit(track):
    # One process, one compile cache: every launch must get the kernel built for its own
    # arguments, and nothing left by one launch (tile counter, partial buffers) may reach the next.
    mod = stage_module(track)
    lens_q, lens_k = [1, 2, 1], [3000, 50, 900]
    packed = packed_inputs(lens_q, lens_k, 8, 2, 64, torch.float16, seed=9)
    for rnd in range(2):
        for B, H, Hkv, Sq, Sk, D, dtype, causal in DECODE[2:4] + DECODE[4:6]:
            q, k, v = decode_inputs(B, H, Hkv, Sq, Sk, D, dtype, seed=rnd + Sk)
            o, lse = run(track, lambda: mod.attention(q, k, v, causal=causal, return_lse=True))
            gqa_reference_check("decode", o, lse, q, k, v, causal, None)
            # A prefill-sized call between: no split.
            q, k, v = decode_inputs(2, 8, 2, 512, 512, D, dtype, seed=rnd)
            o, lse = run(track, lambda: mod.attention(q, k, v, causal=True, return_lse=True))
            gqa_reference_check("prefill", o, lse, q, k, v, True, None)
        q, k, v, cu_q, cu_k = packed
        o, lse = run(
            track,
            lambda: mod.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, num_splits=4),
        )
        from attention_cases import check_packed

        check_packed(o, lse, q, k, v, cu_q, cu_k, False, None, label="packed ")


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_decode_step_in_a_cuda_graph(track):
    # Capture one step (seqused_k as the cache length), replay it on new contents of the same
    # tensors, compare with eager calls on those contents.
    mod = stage_module(track)
    B, H, Hkv, Sk, D = 2, 32, 8, 4096, 128
    q, k, v = decode_inputs(B, H, Hkv, 1, Sk, D, torch.bfloat16, seed=1)
    seqused = torch.tensor([1000, 4096], dtype=torch.int32, device="cuda")

    def step():
        return mod.attention(q, k, v, causal=True, return_lse=True, seqused_k=seqused)

    run(track, step)  # compiles; the graph must launch nothing new
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            o_graph, lse_graph = step()
    torch.cuda.synchronize()
    for seed, lengths in ((2, [1, 3000]), (3, [4096, 2222])):
        q2, k2, v2 = decode_inputs(B, H, Hkv, 1, Sk, D, torch.bfloat16, seed=seed)
        for dst, src in ((q, q2), (k, k2), (v, v2)):
            dst.copy_(src)
        seqused.copy_(torch.tensor(lengths, dtype=torch.int32))
        for b, n in enumerate(lengths):  # keys past the used length: NaN
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        o_eager, lse_eager = run(track, step)
        assert torch.equal(o_graph, o_eager) and torch.equal(lse_graph, lse_eager), lengths
        used_reference_check("graph", o_graph, lse_graph, q, k2, v2, lengths, True)


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_unreturned_lse_scratch_under_a_cuda_graph_and_growth(track, monkeypatch):
    # An unsplit call that returns no LSE has its kernel write the LSE into the device's
    # scratch (attention_host.scratch_output). Capture such a step in a CUDA graph, forget every
    # launch plan (then only the scratch list keeps the buffer the graph writes to), grow the
    # scratch with calls of a larger layout (a new buffer), then replay on new inputs: O equal
    # to an eager call's, the LSE the replay wrote into the captured buffer equal to the one an
    # eager call returns, both against the fp64 reference, and memory allocated after the
    # growth left untouched by the replays.
    import gc

    for name in ("_SCRATCH", "_PLANS", "_CALLS"):  # no plan made before holds a scratch view
        monkeypatch.setattr(attention_host, name, {})
    mod = stage_module(track)
    B, H, Hkv, Sk, D = 2, 32, 8, 2048, 128
    q, k, v = decode_inputs(B, H, Hkv, 1, Sk, D, torch.bfloat16, seed=11)

    def step():
        return mod.attention(q, k, v, causal=True, num_splits=1)

    run(track, step)  # compiles (fresh LSE)
    run(track, step)  # the remembered call: the scratch LSE
    scratch = attention_host._SCRATCH[q.device]
    (plan,) = attention_host._PLANS.values()
    view = plan.scratch_lse[q.device]
    assert len(scratch) == 1 and view.untyped_storage().data_ptr() == scratch[0].data_ptr()
    layout = (view.shape, view.stride())
    del plan, view
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            o_graph = step()
    torch.cuda.synchronize()
    attention_host._PLANS.clear()
    attention_host._CALLS.clear()
    bq, bk, bv = decode_inputs(4, 64, 8, 300, 600, 64, torch.float16, seed=12)
    for _ in range(2):  # the second call takes the fast path and grows the scratch
        o_big = run(track, lambda: mod.attention(bq, bk, bv, causal=True, num_splits=1))
    assert len(scratch) == 2
    gqa_reference_check("larger call", o_big, None, bq, bk, bv, True, None)
    gc.collect()
    torch.cuda.empty_cache()
    canaries = [torch.full((4096,), 7.0, device=q.device) for _ in range(64)]
    for seed in (13, 14):
        q2, k2, v2 = decode_inputs(B, H, Hkv, 1, Sk, D, torch.bfloat16, seed=seed)
        for dst, src in ((q, q2), (k, k2), (v, v2)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        o_eager, lse_eager = run(
            track, lambda: mod.attention(q, k, v, causal=True, num_splits=1, return_lse=True)
        )
        lse_graph = scratch[0].as_strided(*layout)  # what the replay wrote
        assert torch.equal(o_graph, o_eager) and torch.equal(lse_graph, lse_eager), seed
        gqa_reference_check(f"graph replay {seed}", o_graph, lse_graph, q, k, v, True, None)
        assert all(bool((c == 7.0).all()) for c in canaries), "a replay wrote to freed memory"


@pytest.mark.parametrize("splits", [2, 9, 33, 200])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@needs_cuda
def test_combine_matches_its_formula(dtype, D, splits):
    from common.combine import combine, combine_reference
    from common.outputs import empty_output

    g = torch.Generator(device="cuda").manual_seed(D + splits)
    B, H, S = 2, 3, 5
    o_part = torch.randn(splits, B, H, S, D, generator=g, device="cuda")
    lse_part = 20 * torch.randn(splits, B, H, S, generator=g, device="cuda")
    lse_part[min(3, splits - 1)] = float("-inf")  # a split that saw no key for any row
    lse_part[:, 1, 2, 4] = float("-inf")  # a row no split saw
    o_part[:, 1, 2, 4] = 0.0
    lse_part[:, 0, 0, 0] = 1e4  # large equal values: no overflow
    if splits > 32:
        # Splits with no key in whole blocks of 16: a row whose first 16 splits saw no key,
        # and one whose middle 16 saw none.
        lse_part[:16, 0, 2, 1:] = float("-inf")
        lse_part[16:32, 1, 0, :] = float("-inf")
    o = empty_output((B, H, S, D), dtype, "cuda")
    lse = empty_output((B, H, S), torch.float32, "cuda")
    # A combine that deadlocks (its barriers) fails within the deadline instead of hanging.
    verify.run_with_deadline(lambda: combine(o_part, lse_part, o, lse), seconds=120, what="combine")
    o_ref, lse_ref = combine_reference(o_part, lse_part)
    assert (o[1, 2, 4] == 0).all() and lse[1, 2, 4] == float("-inf")
    finite = torch.isfinite(lse_ref)
    verify.check_close("combined O", o, o_ref, rtol=2 * verify.unit_roundoff(dtype))
    assert torch.allclose(lse[finite].double(), lse_ref[finite], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "lse-in-buffer"])
@pytest.mark.parametrize("track", on_cpu_stages(stages=(13, 14)))
def test_split_launch_is_one_module_with_both_kernels(track, return_lse):
    """A split call is one compiled function (common/combine.py's SplitLaunch): the split kernel,
    then the combine, the partials' views made from O's run-time shape at compile time.
    Compile-only, both tracks: two kernels in one module, the split kernel's global loads and
    stores those of the kernel compiled alone, the combine's loads of O_s 16 bytes wide."""
    from common.tools.ptx import compile_only

    t, stage = track.split(":")
    kw = dict(shape=(1, 32, 1, 8192, 128), resources=False, causal=True, kv_heads=8)
    if stage == "14":
        kw["page_size"] = 64
    kw["num_splits"] = 16
    whole = compile_only(int(stage), t, split_launch=True, return_lse=return_lse, **kw).ptx
    alone = compile_only(int(stage), t, **kw).ptx
    entries = re.findall(r"\.entry\s+(\w+)", whole)
    assert len(entries) == 2 and "Combine" in entries[1], entries
    at = whole.index(entries[1])
    split_part, combine_part = whole[:at], whole[at:]
    memory = lambda ptx: sorted(re.findall(r"(?:ld|st)\.global\S*", ptx))  # noqa: E731
    assert memory(split_part) == memory(alone)
    wide = re.findall(r"ld\.global\.(?:v4\.b32|v4\.f32|v2\.b64)", combine_part)
    assert len(wide) >= 8, memory(combine_part)


# ---------------------------------------------------------------- the split count, bad input


def test_splits_for_fills_one_wave():
    f = attention_host.splits_for
    assert f(8, 256, 132) == 16  # B = 1, 8 KV heads, 32k keys
    assert f(8, 6, 132) == 6  # at most one split per KV tile
    assert f(8, 4, 132) == 1  # no split of UNSPLIT_KV_TILES KV tiles or fewer
    assert f(8, 5, 132) == 5
    assert f(1, 10_000, 132) == 64  # at most MAX_SPLITS
    assert f(106, 64, 132) == 1  # 0.8 of the SMs busy already
    assert f(50, 64, 132) == 2
    assert f(0, 0, 132) == 1


BAD = [
    ("num_splits", {"num_splits": 0}, ValueError, "argument 'num_splits'"),
    ("num_splits", {"num_splits": 257}, ValueError, "argument 'num_splits'"),
    ("num_splits", {"num_splits": 2.0}, TypeError, "argument 'num_splits'"),
    ("num_splits", {"num_splits": True}, TypeError, "argument 'num_splits'"),
    ("seqused_k", {"seqused_k": [3, 3]}, TypeError, "argument 'seqused_k'"),
    ("seqused_k", {"seqused_k": ("int64", [3, 3])}, TypeError, "argument 'seqused_k'"),
    ("seqused_k", {"seqused_k": ("int32", [3, 3, 3])}, ValueError, r"shape \(2,\)"),
    ("seqused_k", {"seqused_k": ("int32", [3, 257])}, ValueError, r"seqused_k\[1\] = 257"),
    ("seqused_k", {"seqused_k": ("int32", [-1, 3])}, ValueError, r"seqused_k\[0\] = -1"),
]


@pytest.mark.parametrize(
    "name, kw, error, match", BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD)]
)
@pytest.mark.parametrize("track", on_cpu_stages(stages=STAGES))
@needs_cuda
def test_rejects_bad_split_arguments(track, name, kw, error, match):
    q, k, v = decode_inputs(2, 8, 2, 1, 256, 64, torch.bfloat16, seed=0)
    kw = dict(kw)
    if isinstance(kw.get("seqused_k"), tuple):
        dt, vals = kw["seqused_k"]
        kw["seqused_k"] = torch.tensor(vals, dtype=getattr(torch, dt), device="cuda")
    with pytest.raises(error, match=match):
        stage_module(track).attention(q, k, v, **kw)


@pytest.fixture
def shape_checks_on_cpu(monkeypatch):
    """The entries with check_attention_args stood in for by its shape part (its first check,
    that q is a CUDA tensor, is the only one CPU tensors fail) and no call remembered, so that
    the split-KV checks after it run on the CPU, in CI (as tests/test_host_path.py does)."""

    def dims(q, k, v):
        B, H, Sq, D = q.shape
        return B, H, Sq, k.shape[2], D

    monkeypatch.setattr(attention_host, "checked_dims", dims)
    for name in ("_CALLS", "_PLANS"):
        monkeypatch.setattr(attention_host, name, {})


@pytest.mark.parametrize(
    "name, kw, error, match", BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD)]
)
@pytest.mark.parametrize("track", on_cpu_stages(stages=STAGES))
def test_rejects_bad_split_arguments_on_cpu(track, name, kw, error, match, shape_checks_on_cpu):
    """test_rejects_bad_split_arguments's cases, run in CI: each refused by name before any
    compile or launch."""
    q, k, v = decode_inputs(2, 8, 2, 1, 256, 64, torch.bfloat16, seed=0, device="cpu")
    kw = dict(kw)
    if isinstance(kw.get("seqused_k"), tuple):
        dt, vals = kw["seqused_k"]
        kw["seqused_k"] = torch.tensor(vals, dtype=getattr(torch, dt))
    with pytest.raises(error, match=match):
        stage_module(track).attention(q, k, v, **kw)


def test_stage12_refuses_split_arguments_on_cpu(shape_checks_on_cpu):
    from common.tools import stage_table

    q, k, v = decode_inputs(1, 8, 2, 1, 256, 64, torch.bfloat16, seed=0, device="cpu")
    for track in ("hopper", "blackwell"):
        cls = getattr(stage_table.track_module(12, track), "Sm90Kernel", None) or getattr(
            stage_table.track_module(12, track), "Sm100Kernel"
        )
        for kw in ({"num_splits": 2}, {"seqused_k": torch.tensor([256], dtype=torch.int32)}):
            with pytest.raises(TypeError, match="split-KV stage"):
                attention_host.attention(cls, q, k, v, **kw)


@pytest.mark.parametrize("num_splits", [None, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_fast_path_checks_what_can_change(track, num_splits):
    """A call with the types, shapes and options of an earlier call takes attention_host's fast
    path (that call's checked sizes and launch plan). New tensors of the same shapes must give
    their own answers, and what can differ between such calls must still be checked: the data
    pointers' alignment, seqused_k's values, an option of another type. 256 keys are not split
    unless num_splits says so (3: one split gets no key); a split call that returns no LSE
    keeps its LSE in the partials' buffer (LaunchPlan.outputs), and must give the same O."""
    mod = stage_module(track)
    used = torch.tensor([100, 256], dtype=torch.int32, device="cuda")
    kw = dict(causal=True, num_splits=num_splits)
    for seed in (0, 1, 2):  # the first call takes the slow path, the others the fast one
        q, k, v = decode_inputs(2, 8, 2, 1, 256, 64, torch.bfloat16, seed=seed)
        o, lse = run(track, lambda: mod.attention(q, k, v, return_lse=True, **kw))
        gqa_reference_check(f"O seed {seed}", o, lse, q, k, v, True, None)
        o_only = run(track, lambda: mod.attention(q, k, v, **kw))
        assert torch.equal(o_only, o), seed
        o, lse = run(track, lambda: mod.attention(q, k, v, return_lse=True, seqused_k=used, **kw))
        for b, n in enumerate(used.tolist()):
            gqa_reference_check(
                f"O seed {seed} sequence {b}",
                o[b : b + 1],
                lse[b : b + 1],
                q[b : b + 1],
                k[b : b + 1, :, :n],
                v[b : b + 1, :, :n],
                True,
                None,
            )
    # The same shape and strides one element off a 16-byte boundary.
    base = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    q_off = base[1 : 1 + q.numel()].view(q.shape).copy_(q)
    with pytest.raises(ValueError, match="'q': data pointer must be 16-byte aligned"):
        mod.attention(q_off, k, v, causal=True, return_lse=True)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 257"):
        mod.attention(q, k, v, causal=True, return_lse=True, seqused_k=used + 1)
    with pytest.raises(TypeError, match="causal"):
        mod.attention(q, k, v, causal=1, return_lse=True)


@needs_cuda
def test_stage12_refuses_split_arguments():
    from common.tools import stage_table

    q, k, v = decode_inputs(1, 8, 2, 1, 256, 64, torch.bfloat16, seed=0)
    cls = stage_table.track_module(12, "hopper").Sm90Kernel
    with pytest.raises(TypeError, match="split-KV stage"):
        attention_host.attention(cls, q, k, v, num_splits=2)
