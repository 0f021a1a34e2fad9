"""Stage 15: the ring schedule and the merge of context parallelism, with the ranks as threads
of one process (FakeRing).

On the CPU, an fp64 attention in place of the kernel:
- the cut (Chunks, chunk_of): any S over any N, pieces in order that differ by at most one token,
  torch.tensor_split's sizes, empty pieces when S < N (zig-zag: 2N);
- the schedule (step_work) covers every (query, key) pair the mask allows exactly once and no
  other, for 1-8 ranks, S from 1 token to uneven lengths, causal and not, contiguous and
  zig-zag; zig-zag gives every rank the same work at every step after the first when S splits
  evenly;
- attention_cp over 1-5 ranks equals one attention over the whole sequence (O and LSE, fp64
  inputs: only the fp32 merge rounds) for S = 1, N - 1, 2N - 1, primes and long uneven lengths,
  GQA and MQA; the kernel is never called with no queries or no keys and computes exactly the
  pairs the mask allows (the causal skips); seqlen given or gathered around the ring;
- the merge of -inf LSEs (rows that saw no key yet), a world of 1 returning the kernel's output,
  a rank that fails stopping the others, bad arguments refused with the argument's name;
- the launcher on 2 CPU processes (torch.distributed on gloo) and its one-device mode.

On one GPU (the track's marker; skipped elsewhere with the reason): N virtual ranks of FakeRing
call stage 14's kernel itself on CUDA tensors, bf16 and fp16, D = 64 and 128, causal and not,
contiguous and zig-zag, S up to 16k, empty chunks included; the ranks' O and LSE put back in
sequence order are checked against the fp64 reference (tests/attention_cases.py
gqa_reference_check: relative error, bound by PyTorch's own low-precision error, the worst
element's coordinates). The kernel's outputs are NaN-poisoned before every launch
(tests/conftest.py); the ring's own O and LSE start at 0 and -inf as merge accumulators, so every
LSE must come back finite (each query sees at least its own key) - a row no step merged would
stay at -inf. The ring rounds each step's O to the input dtype (the kernel's output) and the
merged O once more, two roundings where one call has one; the CPU tests, whose emulated kernel
rounds its output exactly, hold that under the suite's bound of 3x PyTorch's error.
The multi-GPU run (NCCL) is `make cp GPUS=N` (common/tools/cp_run.py)."""

import pytest
import torch
from attention_cases import gqa_reference_check
from tracks import on_gpu, per_track

from common.tools import verify
from common.tools.reference import attention_gqa_ref as fp64_attention
from stages.stage15_context_parallel import (
    Chunks,
    FakeRing,
    attention_cp,
    chunk_of,
    default_attention,
    merge,
    step_work,
)

LAYOUTS = [pytest.param(False, id="contiguous"), pytest.param(True, id="zigzag")]
MASKS = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


def lengths(world):
    """S = 1, N - 1, 2N - 1, 2N + 1, two primes and a long uneven length (S >= 1)."""
    return sorted({1, world - 1, 2 * world - 1, 2 * world + 1, 13, 31, 97 * world + 3} - {0})


def computed_pairs(calls):
    """The (query, key) pairs a list of kernel calls (Sq, Sk, causal) computed (Sq = Sk when
    causal: the lower triangle)."""
    return sum(sq * (sq + 1) // 2 if causal else sq * sk for sq, sk, causal in calls)


def visible_pairs(S, causal):
    return S * (S + 1) // 2 if causal else S * S


def recording(attention, calls):
    """The kernel, with every call's (Sq, Sk, causal) appended to `calls`; a call with no
    queries or no keys, or a causal one with Sq != Sk, fails (the kernel refuses the first; the
    ring's causal blocks are square)."""

    def call(q, k, v, causal):
        sq, sk = q.shape[2], k.shape[2]
        assert sq > 0 and sk > 0, f"a kernel call with Sq = {sq}, Sk = {sk}"
        assert not causal or sq == sk, f"a causal call with Sq = {sq} != Sk = {sk}"
        calls.append((sq, sk, causal))
        return attention(q, k, v, causal)

    return call


def in_sequence_order(results, S, world, zigzag):
    """The ranks' (O, LSE) put back in sequence order: (B, H, S, D) and (B, H, S)."""
    chunks = Chunks(S, world, zigzag)
    o0, lse0 = results[0]
    # NaN where no rank's chunk lands: a position no rank covers fails the check.
    nan = float("nan")
    o = torch.full((*o0.shape[:2], S, o0.shape[3]), nan, dtype=o0.dtype, device=o0.device)
    lse = torch.full((*lse0.shape[:2], S), nan, dtype=lse0.dtype, device=lse0.device)
    for r, (o_r, lse_r) in enumerate(results):
        pos = chunks.positions(r).to(o.device)
        assert o_r.shape[2] == lse_r.shape[2] == len(pos), (r, o_r.shape, len(pos))
        o[:, :, pos], lse[:, :, pos] = o_r, lse_r
    return o, lse


def ring_run(q, k, v, world, causal, zigzag, attention, seqlen="S", timeout=120):
    """attention_cp on `world` thread ranks, each with its chunk_of; returns (results by rank,
    the kernel calls)."""
    S = q.shape[2]
    ring, calls = FakeRing(world, timeout=timeout), []
    kernel = ring.one_at_a_time(recording(attention, calls))

    def rank_fn(r):
        chunks = [chunk_of(t, r.rank, world, zigzag) for t in (q, k, v)]
        return attention_cp(
            *chunks, group=r, causal=causal, zigzag=zigzag, attention=kernel, return_lse=True,
            seqlen=S if seqlen == "S" else seqlen,
        )  # fmt: skip

    return ring.run(rank_fn), calls


# ---------------------------------------------------------------- the cut and the schedule


@pytest.mark.parametrize("zigzag", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_cut_is_tensor_split_in_sequence_order(world, zigzag):
    for S in range(0, 4 * world + 3):
        chunks = Chunks(S, world, zigzag)
        count = 2 * world if zigzag else world
        sizes = [len(p) for p in torch.arange(S).tensor_split(count)]
        pieces = sorted(p for r in range(world) for p in chunks.pieces[r])
        assert [b - a for a, b in pieces] == sizes, (S, pieces)
        assert [a for a, _ in pieces] == [0] + [b for _, b in pieces[:-1]], (S, pieces)
        lens = [chunks.length(r) for r in range(world)]
        assert sum(lens) == S and max(lens) - min(lens) <= 1, (S, lens)
        for r in range(world):
            pos = chunks.positions(r)
            assert torch.equal(chunk_of(torch.arange(S), r, world, zigzag, dim=0), pos)
            assert bool((pos[1:] > pos[:-1]).all()), (S, r, pos)  # a chunk keeps the order


@pytest.mark.parametrize("zigzag", LAYOUTS)
@pytest.mark.parametrize("causal", MASKS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_schedule_covers_each_visible_pair_once(world, causal, zigzag):
    for S in sorted({1, world - 1, 2 * world - 1, 2 * world + 3, 4 * world * 3} - {0}):
        chunks = Chunks(S, world, zigzag)
        seen = torch.zeros(S, S, dtype=torch.int64)
        work = torch.zeros(world, world, dtype=torch.int64)  # (step, rank) -> pairs computed
        for rank in range(world):
            qpos = chunks.positions(rank)
            for step in range(world):
                src = (rank - step) % world
                w = step_work(chunks, rank, src, causal)
                if w is None:
                    continue
                q_rows, kv_rows, step_causal = w
                qi, ki = qpos[q_rows], chunks.positions(src)[kv_rows]
                assert len(qi) and len(ki), (S, rank, src, w)
                vis = torch.ones(len(qi), len(ki), dtype=torch.bool)
                if step_causal:
                    assert len(qi) == len(ki)
                    vis = torch.tril(vis)
                for a, i in enumerate(qi.tolist()):
                    for b, j in enumerate(ki.tolist()):
                        if vis[a, b]:
                            seen[i, j] += 1
                            work[step, rank] += 1
        want = torch.tril(torch.ones(S, S)) if causal else torch.ones(S, S)
        assert torch.equal(seen, want.to(torch.int64)), f"S = {S}: a pair missed, twice or masked"
        if causal and zigzag and S % (2 * world) == 0:
            for step in range(1, world):
                assert len(set(work[step].tolist())) == 1, (S, step, work[step].tolist())


# ---------------------------------------------------------------- the ring on the CPU


@pytest.mark.parametrize("zigzag", LAYOUTS)
@pytest.mark.parametrize("causal", MASKS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_ring_equals_one_attention_over_the_sequence(world, causal, zigzag):
    for i, S in enumerate(lengths(world)):
        g = torch.Generator().manual_seed(100 * world + S)
        B, H, Hkv, D = (2, 4, 2, 16) if i % 2 else (1, 4, 1, 8)  # GQA and MQA
        q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
        o_ref, lse_ref = fp64_attention(q, k, v, causal)
        results, calls = ring_run(q, k, v, world, causal, zigzag, fp64_attention)
        o, lse = in_sequence_order(results, S, world, zigzag)
        assert bool(torch.isfinite(lse).all()), f"S = {S}: a row no step merged"
        err_o, err_lse = (
            (a.double() - b).abs().max().item() for a, b in ((o, o_ref), (lse, lse_ref))
        )
        assert err_o < 1e-5 and err_lse < 1e-5, (S, err_o, err_lse)
        assert computed_pairs(calls) == visible_pairs(S, causal), (S, calls)


@pytest.mark.parametrize("zigzag", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 5])
def test_seqlen_gathered_around_the_ring(world, zigzag):
    # seqlen=None: the ranks pass their chunk lengths around the ring and add them up.
    for S in (1, 2 * world + 1, 50):
        g = torch.Generator().manual_seed(10 * world + S)
        q, k, v = (torch.randn(1, 2, S, 8, dtype=torch.float64, generator=g) for _ in range(3))
        results, _ = ring_run(q, k, v, world, True, zigzag, fp64_attention, seqlen=None)
        o, lse = in_sequence_order(results, S, world, zigzag)
        o_ref, lse_ref = fp64_attention(q, k, v, True)
        assert (o - o_ref).abs().max() < 1e-5 and (lse - lse_ref).abs().max() < 1e-5, S


def test_merge_of_rows_that_saw_no_key():
    inf = float("-inf")
    out = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [2.0, 4.0], [1.0, 1.0]]])
    lse = torch.tensor([[inf, inf, 0.5, 0.0]])
    o_i = torch.tensor([[[1.0, 2.0], [3.0, 5.0], [7.0, 7.0], [3.0, 3.0]]], dtype=torch.bfloat16)
    lse_i = torch.tensor([[inf, 1.5, inf, 0.0]])
    merge(out, lse, o_i, lse_i)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert out[0, 0].tolist() == [0.0, 0.0] and lse[0, 0] == inf  # no key on either side
    assert out[0, 1].tolist() == [3.0, 5.0] and lse[0, 1] == 1.5  # the new chunk alone
    assert out[0, 2].tolist() == [2.0, 4.0] and lse[0, 2] == 0.5  # the new chunk saw none
    assert torch.allclose(out[0, 3], torch.tensor([2.0, 2.0]))  # two equal weights
    assert torch.allclose(lse[0, 3], torch.log(torch.tensor(2.0)))


def test_world_of_one_returns_the_kernels_output():
    q, k, v = (torch.randn(1, 2, 32, 16, dtype=torch.float64) for _ in range(3))
    got = {}

    def kernel(q, k, v, causal):
        got["out"] = fp64_attention(q, k, v, causal)
        return got["out"]

    o, lse = FakeRing(1).run(
        lambda ring: attention_cp(
            q, k, v, group=ring, causal=True, attention=kernel, return_lse=True
        )
    )[0]
    assert o is got["out"][0] and lse is got["out"][1]


def test_a_failing_rank_stops_the_ring():
    def rank_fn(ring):
        if ring.rank == 1:
            raise RuntimeError("rank 1 failed")
        q = torch.randn(1, 1, 8, 8, dtype=torch.float64)
        return attention_cp(q, q, q, group=ring, attention=fp64_attention)

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        FakeRing(3).run(rank_fn)


def x(S, heads=2, D=8):
    """A chunk of S tokens, (1, heads, S, D), fp64."""
    return torch.randn(1, heads, S, D, dtype=torch.float64)


BAD = [
    # (what, world, q, k, v, keyword arguments, the message: the argument's name first)
    ("packed q", 2, torch.zeros(8, 2, 8), x(8), x(8), {}, "'q'.*packed"),
    ("k of another length", 2, x(8), x(9), x(8), {}, "'k'.*same tokens"),
    ("v of another head dim", 2, x(8), x(8), x(8, D=16), {}, "'v'"),
    ("3 query heads over 2 KV heads", 2, x(8, heads=3), x(8), x(8), {}, "'k'.*multiple"),
    ("seqlen 0", 2, x(0), x(0), x(0), {"seqlen": 0}, "'seqlen'.*at least one"),
    ("seqlen not this cut", 2, x(5), x(5), x(5), {"seqlen": 9}, "'seqlen'.*rank"),
    ("every chunk empty", 2, x(0), x(0), x(0), {}, "'q'.*empty"),
    ("lengths not a cut", 3, x(4), x(4), x(4), {"lengths": [4, 4, 2]}, "'q'.*not a cut"),
]


@pytest.mark.parametrize("what, world, q, k, v, kw, match", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_name_the_argument(what, world, q, k, v, kw, match):
    kw = dict(kw)
    per_rank = kw.pop("lengths", None)

    def rank_fn(ring):
        qr, kr, vr = q, k, v
        if per_rank is not None:  # each rank its own chunk length
            qr, kr, vr = (t[:, :, : per_rank[ring.rank]] for t in (qr, kr, vr))
        return attention_cp(qr, kr, vr, group=ring, causal=True, attention=fp64_attention, **kw)

    with pytest.raises(ValueError, match=match):
        FakeRing(world).run(rank_fn)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"seqlen": 8.0}, "'seqlen'.*int"),
        ({"causal": 1}, "'causal'"),
        ({"zigzag": "yes"}, "'zigzag'"),
    ],
    ids=["seqlen-float", "causal-int", "zigzag-str"],
)
def test_arguments_of_the_wrong_type(kw, match):
    q = x(4)
    with pytest.raises(TypeError, match=match):
        FakeRing(2).run(lambda r: attention_cp(q, q, q, group=r, attention=fp64_attention, **kw))


# ---------------------------------------------------------------- the launcher


def test_torchrun_launcher_on_cpu_processes():
    # The torch.distributed path itself (TorchRing: batch_isend_irecv on gloo), 2 processes,
    # an S that gives the ranks chunks of different lengths.
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "common.tools.cp_run", "--cpu", "--seqlen", "131", "--heads", "2"]
    cmd += ["--kv-heads", "1", "--head-dim", "16", "--causal", "--reps", "1"]
    env = {**os.environ, "PYTHONPATH": root, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    err = float(re.search(r"sequence\| = (\S+)", p.stdout).group(1))
    assert err < 1e-5, p.stdout


def test_launcher_with_virtual_ranks_on_the_cpu(capsys):
    import re

    from common.tools import cp_run

    args = ["--virtual-ranks", "3", "--cpu", "--seqlen", "101", "--heads", "4"]
    cp_run.main(args + ["--kv-heads", "2", "--head-dim", "16", "--causal", "--reps", "1"])
    out = capsys.readouterr().out
    assert len(re.findall(r"step \d/3: ranks", out)) == 3, out
    for what in ("O", "LSE"):
        err = float(
            re.search(rf"\|{what} - {what} of one call over the sequence\| = (\S+)", out)[1]
        )
        assert err < 1e-5, out
    assert "no measure of the kernel's speed-up" in out and "(ideal 3x" not in out, out


def test_launcher_on_the_cpu_defaults_to_a_short_sequence(capsys):
    """Without --seqlen the CPU run takes S = 1024: the fp64 stand-in holds a chunk's whole score
    matrix, which at the GPU's default of 32k tokens does not fit in memory."""
    from common.tools import cp_run

    args = ["--virtual-ranks", "2", "--cpu", "--heads", "2", "--kv-heads", "1"]
    cp_run.main(args + ["--head-dim", "16", "--reps", "1"])
    out = capsys.readouterr().out
    assert "S = 1024," in out, out


# ---------------------------------------------------------------- the kernel on one GPU

# (world, B, H, Hkv, S, D, dtype, causal, zigzag)
GPU_CASES = [
    (4, 1, 4, 2, 16384, 128, torch.bfloat16, True, True),  # long, causal balanced
    (2, 1, 4, 1, 16381, 64, torch.float16, True, True),  # a prime S, MQA
    (8, 1, 8, 2, 8197, 128, torch.bfloat16, True, True),  # 8 ranks, uneven
    (3, 2, 8, 2, 4099, 128, torch.float16, True, False),  # contiguous causal: skipped chunks
    (5, 1, 8, 8, 3001, 64, torch.bfloat16, False, True),
    (3, 1, 4, 2, 5000, 128, torch.float16, False, True),
    (4, 2, 4, 2, 1000, 64, torch.float16, False, False),
    (4, 1, 4, 2, 7, 64, torch.bfloat16, True, True),  # S < 2N: empty zig-zag pieces
    (5, 1, 2, 1, 3, 128, torch.float16, True, False),  # S < N: empty chunks
]


def gpu_case_id(c):
    world, B, H, Hkv, S, D, dtype, causal, zigzag = c
    dt = "bf16" if dtype == torch.bfloat16 else "fp16"
    mask = "causal" if causal else "full"
    return f"N{world}-B{B}-H{H}x{Hkv}-S{S}-D{D}-{dt}-{mask}-{'zigzag' if zigzag else 'contiguous'}"


@pytest.mark.parametrize(
    "track, case", per_track({"hopper": GPU_CASES, "blackwell": GPU_CASES}, gpu_case_id)
)
def test_ring_of_virtual_ranks_on_one_gpu(track, case):
    world, B, H, Hkv, S, D, dtype, causal, zigzag = case
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(B, H, S, D, generator=g, device="cuda").to(dtype)
    k, v = (torch.randn(B, Hkv, S, D, generator=g, device="cuda").to(dtype) for _ in range(2))
    kernel = default_attention(track)
    results, calls = verify.run_with_deadline(
        lambda: ring_run(q, k, v, world, causal, zigzag, kernel, timeout=900),
        seconds=120,
        what=f"stage 15 on {world} virtual ranks",
    )
    for o_r, lse_r in results:
        assert o_r.dtype == dtype and lse_r.dtype == torch.float32
    o, lse = in_sequence_order(results, S, world, zigzag)
    if not torch.isfinite(lse).all():
        row = tuple(int(x) for x in (~torch.isfinite(lse)).nonzero()[0])
        raise AssertionError(f"LSE not finite at (b, h, row) = {row}: a row no step merged")
    name = f"stage 15, {world} virtual ranks, {gpu_case_id(case)}"
    gqa_reference_check(name, o, lse, q, k, v, causal, None)
    # The causal skips, in the kernel calls themselves: exactly the pairs the mask allows.
    assert computed_pairs(calls) == visible_pairs(S, causal), calls
    chunks = Chunks(S, world, zigzag)
    steps = sum(
        step_work(chunks, r, (r - s) % world, causal) is not None
        for r in range(world)
        for s in range(world)
    )
    assert len(calls) == steps, (len(calls), steps)


@pytest.mark.parametrize("track", on_gpu())
def test_world_of_one_on_the_gpu_is_the_kernel_bit_for_bit(track):
    g = torch.Generator(device="cuda").manual_seed(1000)
    q = torch.randn(1, 8, 1000, 128, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(1, 2, 1000, 128, generator=g, device="cuda").bfloat16() for _ in range(2))
    kernel = default_attention(track)
    o_want, lse_want = verify.run_with_deadline(lambda: kernel(q, k, v, True), seconds=120)
    o, lse = verify.run_with_deadline(
        lambda: FakeRing(1, timeout=900).run(
            lambda r: attention_cp(q, k, v, group=r, causal=True, attention=kernel, return_lse=True)
        )[0],
        seconds=120,
    )
    assert torch.equal(o, o_want) and torch.equal(lse, lse_want)
