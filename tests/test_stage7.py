"""Stage 7, both tracks: GQA / MQA and packed variable-length sequences, against fp64 references,
and the argument checks.

Every test runs on each track (tests/tracks.py), with the same cases: the Hopper params carry the
marker gpu_hopper, the Blackwell ones gpu_blackwell. The PTX checks of each track are in
tests/test_stage7_hopper.py and tests/test_stage7_blackwell.py. Stages 8 and 9 reuse the packs,
the pack-GQA cases and their checks from here.

- GPU tests against fp64 references computed per sequence with the stage 6 mask: GQA group sizes
  1, 2, 4, 8 and MQA, causal and windows, decode-like GQA; packed batches with one long and many
  short sequences, zero-length and single-token ones, lengths that are not tile multiples,
  Sq != Sk per sequence, both dtypes, D = 64 and 128, LSE. NaN planted in every row outside one
  sequence must not reach that sequence's output (no tile is read or written across a sequence
  boundary); packed equal to batch mode. Outputs are poisoned with NaN before each launch, and
  each launch has a 120 s deadline. As of 2026-12-01 no sm_100 GPU was available: the Blackwell
  params have not run yet.
- Pack-GQA (the G query heads of a KV head in one Q tile's rows): on the GPU, decode-like and
  short shapes (G = 2 ... 32, causal and window, ragged row counts) against the fp64 reference
  and equal to the unpacked kernel bit for bit; packed sequences with NaN planted around each;
  the choice rule on the CPU. Every test here runs on each later stage too (8-12: the same entries
  and features, only the schedule changes; tests/tracks.py, on_gpu_stages).
- Bad input: every check of the packed entry, the head-count rule, pack_gqa's values,
  compile_args' options.
"""

import inspect

import attention_cases
import pytest
import torch
from attention_cases import DTYPES, check_packed, dtype_id, gqa_reference_check, packed_inputs
from tracks import on_cpu_stages, on_gpu_stages, stage_module, stage_package

from common import pack_gqa
from common.tools import inputs, reference, verify

# ---------------------------------------------------------------- GQA / MQA


def stage7(track):
    """The kernel module of "track:stage": stage 7's, or a later stage's (tests/tracks.py)."""
    return stage_module(track)


def run(track, fn):
    return verify.run_with_deadline(fn, seconds=120, what=f"stage {track}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "H, Hkv", [(8, 8), (8, 4), (8, 2), (16, 2), (8, 1)], ids=["mha", "g2", "g4", "g8", "mqa"]
)
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (100, 0))])
@pytest.mark.parametrize("track", on_gpu_stages())
def test_gqa_matches_fp64_reference(track, H, Hkv, dtype, causal, window):
    q, _, _ = inputs.attention_inputs(2, H, 300, 300, 128, dtype, seed=H + Hkv)
    _, k, v = inputs.attention_inputs(2, Hkv, 300, 700, 128, dtype, seed=H * Hkv)
    o, lse = run(
        track,
        lambda: stage7(track).attention(q, k, v, causal=causal, window=window, return_lse=True),
    )
    gqa_reference_check("O", o, lse, q, k, v, causal, window)


@pytest.mark.parametrize("track", on_gpu_stages())
def test_gqa_d64_decode_like(track):
    # Sq = 1 per head, 32 query heads on 8 KV heads, a long cache.
    q, _, _ = inputs.attention_inputs(4, 32, 1, 1, 64, seed=3)
    _, k, v = inputs.attention_inputs(4, 8, 1, 4000, 64, seed=4)
    o, lse = run(track, lambda: stage7(track).attention(q, k, v, causal=True, return_lse=True))
    gqa_reference_check("O", o, lse, q, k, v, True, None)


@pytest.mark.parametrize("track", on_gpu_stages())
def test_gqa_needs_no_expanded_copy(track):
    # The same answer as K, V expanded to H heads by stride-0 views (stage 6's way).
    q, _, _ = inputs.attention_inputs(2, 8, 256, 256, 64, seed=5)
    _, k, v = inputs.attention_inputs(2, 2, 256, 512, 64, seed=6)
    o = run(track, lambda: stage7(track).attention(q, k, v, causal=True))
    ke, ve = (t[:, :, None].expand(2, 2, 4, 512, 64).reshape(2, 8, 512, 64) for t in (k, v))
    assert torch.equal(o, run(track, lambda: stage7(track).attention(q, ke, ve, causal=True)))


# ---------------------------------------------------------------- packed sequences

PACKS = {
    # one long sequence and many short ones, zero-length and single-token ones, ragged lengths
    "long-and-short": ([1000, 3, 1, 130, 0, 257, 64, 1], [1000, 3, 1, 130, 0, 257, 64, 1]),
    "sq-ne-sk": ([5, 128, 300, 1, 0], [700, 128, 200, 900, 50]),
    "empty-keys": ([64, 10, 200], [0, 300, 0]),
    "one": ([513], [513]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (77, None))])
@pytest.mark.parametrize("track", on_gpu_stages())
def test_packed_sequences_match_per_sequence_reference(track, pack, D, dtype, causal, window):
    lens_q, lens_k = PACKS[pack]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, D, dtype, seed=len(pack) + D)
    o, lse = run(
        track,
        lambda: stage7(track).attention_varlen(
            q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True
        ),
    )
    assert o.shape == q.shape and lse.shape == (4, q.shape[0])
    check_packed(o, lse, q, k, v, cu_q, cu_k, causal, window)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("track", on_gpu_stages())
def test_nan_outside_a_sequence_never_reaches_it(track, D):
    # Every row of Q, K and V outside sequence b is NaN: sequence b's O and LSE must be exactly
    # what they are alone. Its last Q and KV tiles end inside the neighbours' rows, so a tile
    # read or written across the boundary shows here (on Blackwell: a Q row, a K column, masked
    # by a select, or a V row, zeroed in shared memory before P @ V).
    lens_q, lens_k = [200, 77, 300, 1], [130, 190, 129, 260]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, D, torch.bfloat16, seed=9)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        qn, kn, vn = q.clone(), k.clone(), v.clone()
        for t, c in ((qn, cq), (kn, ck), (vn, ck)):
            t[: c[b]] = float("nan")
            t[c[b + 1] :] = float("nan")
        o, lse = run(
            track, lambda: stage7(track).attention_varlen(qn, kn, vn, cu_q, cu_k, return_lse=True)
        )
        check_packed(o, lse, q, k, v, cu_q, cu_k, False, None, only=b)


@pytest.mark.parametrize("track", on_gpu_stages())
def test_packed_equals_batch_mode_on_equal_lengths(track):
    B, H, S, D = 3, 4, 300, 64
    q, k, v = inputs.attention_inputs(B, H, S, S, D, seed=12)
    o = run(track, lambda: stage7(track).attention(q, k, v, causal=True))
    pack = lambda t: t.transpose(1, 2).reshape(B * S, H, D)  # noqa: E731
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
    op = run(
        track,
        lambda: stage7(track).attention_varlen(pack(q), pack(k), pack(v), cu, cu, causal=True),
    )
    assert torch.equal(op, pack(o))


@pytest.mark.parametrize("track", on_gpu_stages())
def test_all_empty_and_given_max_seqlen(track):
    q, k, v, cu_q, cu_k = packed_inputs([0, 0], [5, 0], 4, 4, 64, torch.bfloat16, seed=1)
    o, lse = run(
        track, lambda: stage7(track).attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    )
    assert o.shape == (0, 4, 64) and lse.shape == (4, 0)
    q, k, v, cu_q, cu_k = packed_inputs([100, 30], [40, 260], 4, 4, 64, torch.bfloat16, seed=2)
    o, lse = run(
        track,
        lambda: stage7(track).attention_varlen(
            q, k, v, cu_q, cu_k, max_seqlen_q=512, max_seqlen_k=300, return_lse=True
        ),
    )
    check_packed(o, lse, q, k, v, cu_q, cu_k, False, None)


@pytest.mark.parametrize("track", on_gpu_stages())
def test_stage_package_dispatches_to_the_track(track):
    attention, attention_varlen = (
        stage_package(track).attention,
        stage_package(track).attention_varlen,
    )
    q, k, v = inputs.attention_inputs(1, 4, 200, 200, 64, seed=8)
    o = run(track, lambda: attention(q, k[:, :2], v[:, :2], causal=True))
    gqa_reference_check("O", o, None, q, k[:, :2], v[:, :2], True, None)
    q, k, v, cu_q, cu_k = packed_inputs([10, 20], [10, 20], 4, 2, 64, torch.bfloat16, seed=3)
    o, lse = run(track, lambda: attention_varlen(q, k, v, cu_q, cu_k, return_lse=True))
    # Against the per-sequence fp64 reference, not only finite: a dispatch to the wrong kernel
    # (or one that ignores cu_seqlens) gives finite but wrong values.
    check_packed(o, lse, q, k, v, cu_q, cu_k, False, None)


# ---------------------------------------------------------------- bad input


SHARED = [c for c in attention_cases.BAD_ATTENTION_INPUTS if c.id != "heads_mismatch"]


@pytest.mark.parametrize("case", SHARED)
@pytest.mark.parametrize("track", on_cpu_stages())
def test_rejects_bad_input(track, case):
    case.check(stage7(track).attention)


@attention_cases.needs_cuda
@pytest.mark.parametrize("track", on_cpu_stages())
def test_rejects_heads_that_do_not_divide(track):
    q, k, v = attention_cases.qkv("cuda", H=6)
    with pytest.raises(ValueError, match=r"H = 6 query heads must be a multiple of Hkv = 4"):
        stage7(track).attention(q, k[:, :4], v[:, :4])


def _packed(device="cuda"):
    q = torch.randn(30, 4, 64, device=device).bfloat16()
    k = torch.randn(40, 2, 64, device=device).bfloat16()
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 25, 40], dtype=torch.int32, device=device)
    return q, k, k.clone(), cu_q, cu_k


BAD_PACKED = [
    (
        "cu_q_int64",
        lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()},
        TypeError,
        "argument 'cu_seqlens_q': dtype must be int32, got int64",
    ),
    (
        "cu_q_on_cpu",
        lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].cpu()},
        ValueError,
        "argument 'cu_seqlens_q': must be on q's device",
    ),
    (
        "cu_k_rank_2",
        lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][None]},
        ValueError,
        "argument 'cu_seqlens_k': expected a rank-1 tensor",
    ),
    (
        "cu_q_not_from_0",
        lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"] + 1},
        ValueError,
        "argument 'cu_seqlens_q': must start at 0",
    ),
    (
        "cu_k_decreasing",
        lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][[0, 2, 1]]},
        ValueError,
        r"argument 'cu_seqlens_k': offsets must be non-decreasing",
    ),
    (
        "cu_q_wrong_total",
        lambda a: {**a, "q": a["q"][:29]},
        ValueError,
        r"argument 'cu_seqlens_q': the last offset 30 must equal the number of tokens 29",
    ),
    (
        "batch_counts_differ",
        lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][[0, 2]]},
        ValueError,
        "must describe the same number of sequences, got 2 and 1",
    ),
    (
        "max_seqlen_too_small",
        lambda a: {**a, "max_seqlen_q": 19},
        ValueError,
        r"argument 'max_seqlen_q' = 19 is smaller than the longest sequence \(20\)",
    ),
    (
        "max_seqlen_float",
        lambda a: {**a, "max_seqlen_k": 25.0},
        TypeError,
        "argument 'max_seqlen_k': expected an int or None",
    ),
    (
        "heads_do_not_divide",
        lambda a: {**a, "q": a["q"][:, :3]},
        ValueError,
        "H = 3 query heads must be a multiple of Hkv = 2",
    ),
    (
        "q_rank_4",
        lambda a: {**a, "q": a["q"][None]},
        ValueError,
        "argument 'q': expected a rank-3 tensor",
    ),
    (
        "cu_not_a_tensor",
        lambda a: {**a, "cu_seqlens_q": [0, 10, 30]},
        TypeError,
        "argument 'cu_seqlens_q': expected a torch.Tensor",
    ),
]


@attention_cases.needs_cuda
@pytest.mark.parametrize("name, change, error, match", BAD_PACKED, ids=[c[0] for c in BAD_PACKED])
@pytest.mark.parametrize("track", on_cpu_stages())
def test_rejects_bad_packed_input(track, name, change, error, match):
    q, k, v, cu_q, cu_k = _packed()
    args = change(dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    with pytest.raises(error, match=match):
        stage7(track).attention_varlen(**args)


def test_reference_helpers_are_exact_on_cpu():
    # The per-sequence reference with GQA equals the expanded-head reference (fp64, CPU).
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64, generator=g)
    k = torch.randn(1, 2, 7, 8, dtype=torch.float64, generator=g)
    o, _ = reference.attention_ref(q, k.repeat_interleave(2, 1), k.repeat_interleave(2, 1))
    o2 = torch.cat(
        [
            reference.attention_ref(
                q[:, h : h + 1], k[:, h // 2 : h // 2 + 1], k[:, h // 2 : h // 2 + 1]
            )[0]
            for h in range(4)
        ],
        1,
    )
    torch.testing.assert_close(o, o2)


def test_packed_check_passes_the_right_answer_and_fails_wrong_ones_on_cpu():
    """check_packed and gqa_reference_check, the oracle of every packed and GQA test on the GPU,
    on CPU tensors: the per-sequence answer (fp64, rounded to bf16 as a kernel's O) passes; a
    query head reading KV head h % Hkv instead of h // G, attention across sequence boundaries,
    one NaN in O, and a sequence without keys whose O is not 0 each fail."""
    from common import masks

    g = torch.Generator().manual_seed(1)
    lens_q, lens_k, H, Hkv, D = [5, 0, 130, 7], [9, 3, 140, 0], 4, 2, 64
    q = torch.randn(sum(lens_q), H, D, generator=g).bfloat16()
    k, v = (torch.randn(sum(lens_k), Hkv, D, generator=g).bfloat16() for _ in range(2))
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
        for n in (lens_q, lens_k)
    )

    def answer(heads_of, across=False):
        """(O, LSE) per sequence in fp64 (all sequences as one if `across`); query head h reads
        KV head heads_of[h]."""
        o = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full((H, q.shape[0]), float("-inf"), dtype=torch.float64)
        spans = [(0, q.shape[0], 0, k.shape[0])] if across else [
            (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]) for b in range(len(lens_q))
        ]  # fmt: skip
        for q0, q1, k0, k1 in spans:
            if q1 == q0 or k1 == k0:
                continue
            qb = q[q0:q1].transpose(0, 1)[None]
            kb, vb = (t[k0:k1].transpose(0, 1)[None][:, heads_of] for t in (k, v))
            mask = masks.visible(int(q1 - q0), int(k1 - k0), *masks.resolve_window(
                True, None, int(q1 - q0), int(k1 - k0)))  # fmt: skip
            ob, lb = reference.attention_ref(qb, kb, vb, mask=mask)
            o[q0:q1], lse[:, q0:q1] = ob[0].transpose(0, 1), lb[0]
        return o.bfloat16(), lse.float()

    right = [h // (H // Hkv) for h in range(H)]
    o, lse = answer(right)
    check_packed(o, lse, q, k, v, cu_q, cu_k, True, None)
    wrong = {
        "head h % Hkv": answer([h % Hkv for h in range(H)]),
        "across sequences": answer(right, across=True),
    }
    nan_o = o.clone()
    nan_o[100, 3, 17] = float("nan")  # in sequence 2
    wrong["one NaN"] = (nan_o, lse)
    no_keys = o.clone()
    no_keys[cu_q[3] : cu_q[4]] = 1.0  # sequence 3 has no key: O must be 0
    wrong["O != 0 without keys"] = (no_keys, lse)
    for what, (o_bad, lse_bad) in wrong.items():
        with pytest.raises(AssertionError):
            check_packed(o_bad, lse_bad, q, k, v, cu_q, cu_k, True, None)
            pytest.fail(f"check_packed passed {what}")


# ---------------------------------------------------------------- pack-GQA


def test_pack_gqa_choice():
    # Packed when a head's rows fill a 128-row tile much worse than the group's rows do.
    assert pack_gqa.choose_pack(32, 8, 1) == 4  # decode: 1 of 128 rows, packed 4 of 128
    assert pack_gqa.choose_pack(32, 8, 16) == 4
    assert pack_gqa.choose_pack(32, 8, 40) == 4  # 40/128 < 0.9 * 160/256
    assert pack_gqa.choose_pack(32, 8, 100) == 1  # 100/128 = 400/512: nothing gained
    assert pack_gqa.choose_pack(32, 8, 128) == 1  # a full tile already
    assert pack_gqa.choose_pack(32, 8, 2048) == 1
    assert pack_gqa.choose_pack(32, 32, 1) == 1  # MHA: nothing to pack
    assert pack_gqa.choose_pack(6, 2, 1) == 1  # G = 3 does not divide 128 rows
    assert pack_gqa.choose_pack(32, 1, 1) == 32  # MQA
    assert pack_gqa.choose_pack(32, 8, 2048, pack_gqa=True) == 4
    assert pack_gqa.choose_pack(32, 8, 1, pack_gqa=False) == 1


@pytest.mark.parametrize(
    "H, Hkv, value, error, match",
    [
        (8, 2, "yes", TypeError, "argument 'pack_gqa': expected a bool or None, got str"),
        (8, 8, True, ValueError, "argument 'pack_gqa': packing needs H / Hkv > 1"),
        (6, 2, True, ValueError, "H / Hkv = 6 / 2"),
    ],
)
def test_rejects_bad_pack_gqa(H, Hkv, value, error, match):
    with pytest.raises(error, match=match):
        pack_gqa.choose_pack(H, Hkv, 1, pack_gqa=value)


# (B, H, Hkv, Sq, Sk, D, dtype, causal, window): decode steps, speculative-decoding widths, and
# row counts that leave the last packed tile ragged.
PACK_GQA_CASES = [
    (4, 32, 8, 1, 1000, 128, torch.bfloat16, True, None),
    (2, 32, 8, 16, 777, 64, torch.float16, True, None),
    (2, 8, 2, 100, 300, 128, torch.bfloat16, False, (50, 0)),
    (1, 32, 1, 3, 129, 64, torch.bfloat16, True, None),
    (2, 16, 2, 37, 37, 128, torch.float16, True, None),
    (3, 4, 2, 70, 200, 64, torch.bfloat16, False, (None, 5)),
]


def pack_case_id(c):
    return "x".join(map(str, c[:6])) + ("-causal" if c[7] else "") + ("-window" if c[8] else "")


def check_pack_gqa(mod, case):
    """mod.attention with pack_gqa forced on: the fp64 reference, and the unpacked kernel's O
    and LSE bit for bit (each row's arithmetic is the same; a tile's extra, fully masked KV
    tiles add exact zeros)."""
    B, H, Hkv, Sq, Sk, D, dtype, causal, window = case
    q, _, _ = inputs.attention_inputs(B, H, Sq, Sq, D, dtype, seed=Sq + H)
    _, k, v = inputs.attention_inputs(B, Hkv, Sk, Sk, D, dtype, seed=Sk + Hkv)
    kw = dict(causal=causal, window=window, return_lse=True)
    what = f"{mod.__name__} pack-GQA"
    o, lse = verify.run_with_deadline(
        lambda: mod.attention(q, k, v, pack_gqa=True, **kw), seconds=120, what=what
    )
    gqa_reference_check("O packed", o, lse, q, k, v, causal, window)
    # Split-KV stages (13 on) cut a packed and an unpacked tile's KV ranges differently: the
    # bit-for-bit comparison is of the unsplit kernels.
    if "num_splits" in inspect.signature(mod.attention).parameters:
        kw["num_splits"] = 1
        o, lse = verify.run_with_deadline(
            lambda: mod.attention(q, k, v, pack_gqa=True, **kw), seconds=120, what=what
        )
    o1, lse1 = verify.run_with_deadline(
        lambda: mod.attention(q, k, v, pack_gqa=False, **kw), seconds=120, what=what
    )
    assert torch.equal(o, o1), f"max |O packed - O| = {(o.float() - o1.float()).abs().max()}"
    assert torch.equal(lse, lse1), f"max |LSE packed - LSE| = {(lse - lse1).abs().max()}"


def check_pack_gqa_varlen(mod, D):
    """Packed sequences with pack_gqa forced on, NaN planted in every row outside sequence b:
    sequence b's O and LSE as alone (the packed rows of a tile end inside the neighbours)."""
    lens_q, lens_k = [3, 0, 40, 1, 17], [130, 5, 100, 260, 17]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 8, 2, D, torch.bfloat16, seed=D)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        qn, kn, vn = q.clone(), k.clone(), v.clone()
        for t, c in ((qn, cq), (kn, ck), (vn, ck)):
            t[: c[b]] = float("nan")
            t[c[b + 1] :] = float("nan")
        o, lse = verify.run_with_deadline(
            lambda: mod.attention_varlen(
                qn, kn, vn, cu_q, cu_k, causal=True, return_lse=True, pack_gqa=True
            ),
            seconds=120,
            what=f"{mod.__name__} pack-GQA",
        )
        check_packed(o, lse, q, k, v, cu_q, cu_k, True, None, only=b)


@pytest.mark.parametrize("case", PACK_GQA_CASES, ids=pack_case_id)
@pytest.mark.parametrize("track", on_gpu_stages())
def test_pack_gqa_matches_reference_and_unpacked(track, case):
    check_pack_gqa(stage7(track), case)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("track", on_gpu_stages())
def test_pack_gqa_packed_sequences_with_nan_around(track, D):
    check_pack_gqa_varlen(stage7(track), D)


@pytest.mark.parametrize("track", on_gpu_stages(["hopper"]))  # Blackwell has no such case yet
def test_decode_like_unpacked_still_right(track):
    # The heuristic packs Sq = 1; the unpacked kernel on it must stay right too.
    q, _, _ = inputs.attention_inputs(2, 32, 1, 1, 128, seed=5)
    _, k, v = inputs.attention_inputs(2, 8, 1, 900, 128, seed=6)
    o, lse = run(track, lambda: stage7(track).attention(q, k, v, return_lse=True, pack_gqa=False))
    gqa_reference_check("O", o, lse, q, k, v, False, None)


@pytest.mark.parametrize("track", on_cpu_stages())
def test_compile_args_rejects_unknown_options(track):
    with pytest.raises(TypeError, match="unknown option"):
        stage7(track).compile_args(torch.bfloat16, (1, 1, 128, 128, 64), split_kv=2)
