"""Stage 14, both tracks: a paged KV cache, against the unpaged kernel and fp64 references.

Stage 7's whole test set also runs on stage 14's attention and attention_varlen (tests/tracks.py,
KERNEL_STAGES), and tests/test_stage_chain.py checks stage 14 equal to stage 13 bit for bit. Here:
- attention_paged against stage 14's own unpaged attention with seqused_k, bit for bit (the same
  arithmetic per KV tile, only the addresses differ), and against the fp64 reference: page sizes
  16, 32, 64, 128 and 256, pages in random order, key counts that are not page or tile multiples
  (1 key, a page and one key, ...), decode (Sq = 1) and speculative (Sq = 4, causal) steps, GQA
  and MQA, both dtypes and head dims, the launch's split count and forced ones;
- NaN in every page no sequence uses, in the rows past seqused_k of each sequence's last page, and
  -1 in every page_table entry past a sequence's pages: none may reach an output;
- calls alternating page sizes, paged and unpaged, in one process; a paged decode step captured in
  a CUDA graph and replayed as the cache grows (a new page, a longer seqused_k);
- bad input: page_table's dtype, shape and entries, seqused_k missing or longer than the pages,
  page sizes the kernel cannot take, k_cache and v_cache that differ.
Outputs poisoned with NaN before every launch; each launch has a 120 s deadline.
"""

import pytest
import torch
from attention_cases import gqa_reference_check
from tracks import on_gpu_stages, stage_module

from common import attention_host
from common.tools import verify

STAGES = (14,)


def run(track, fn):
    return verify.run_with_deadline(fn, seconds=120, what=f"stage {track}")


def paged_case(B, H, Hkv, Sq, used, page_size, D, dtype, seed, spare_pages=3):
    """Random q and contiguous k, v (B, Hkv, max(used), D), and the same keys in a paged cache:
    each sequence's pages drawn in random order from a pool with spare pages; NaN in every page
    nobody uses and in the rows past seqused_k of each last page, -1 in page_table past a
    sequence's pages. Returns (q, k, v, k_cache, v_cache, page_table, seqused_k)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    Sk = max(used)
    q = torch.randn(B, H, Sq, D, generator=g, device="cuda").to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g, device="cuda").to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g, device="cuda").to(dtype)
    pages_of = [-(-n // page_size) for n in used]
    max_pages = max(pages_of) + 1
    num_pages = sum(pages_of) + spare_pages
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    k_cache = torch.full((num_pages, page_size, Hkv, D), float("nan"), device="cuda", dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(used):
        for i in range(pages_of[b]):
            page = order[nxt]
            nxt += 1
            table[b, i] = page
            rows = min(page_size, n - i * page_size)
            k_cache[page, :rows] = k[b, :, i * page_size : i * page_size + rows].transpose(0, 1)
            v_cache[page, :rows] = v[b, :, i * page_size : i * page_size + rows].transpose(0, 1)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    return q, k, v, k_cache, v_cache, table.cuda(), seqused


def used_check(name, o, lse, q, k, v, used, causal):
    for b, n in enumerate(used):
        ob, lb = o[b : b + 1], lse[b : b + 1]
        if n == 0:
            assert (ob == 0).all() and (lb == float("-inf")).all(), f"{name} sequence {b}"
            continue
        kb, vb = (t[b : b + 1, :, :n] for t in (k, v))
        gqa_reference_check(f"{name} sequence {b}", ob, lb, q[b : b + 1], kb, vb, causal, None)


# (B, H, Hkv, Sq, used, D, dtype, causal)
CASES = [
    (3, 16, 4, 1, [1, 1000, 333], 128, torch.bfloat16, False),
    (2, 32, 8, 1, [4097, 2049], 128, torch.bfloat16, True),
    (4, 8, 1, 1, [17, 129, 0, 640], 64, torch.float16, True),  # MQA, an empty sequence
    (2, 16, 4, 4, [300, 1025], 64, torch.bfloat16, True),  # speculative: 4 query tokens
    (1, 8, 8, 3, [5000], 128, torch.float16, True),
]


def case_id(c):
    return f"B{c[0]}-H{c[1]}-{c[2]}-Sq{c[3]}-D{c[5]}" + ("-causal" if c[7] else "")


@pytest.mark.parametrize("num_splits", [None, 1, 5], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_paged_equals_unpaged_and_reference(track, case, page_size, num_splits):
    B, H, Hkv, Sq, used, D, dtype, causal = case
    q, k, v, k_cache, v_cache, table, seqused = paged_case(
        B, H, Hkv, Sq, used, page_size, D, dtype, seed=page_size + sum(used)
    )
    mod = stage_module(track)
    kw = dict(causal=causal, return_lse=True, num_splits=num_splits)
    o, lse = run(track, lambda: mod.attention_paged(q, k_cache, v_cache, table, seqused, **kw))
    if num_splits is not None:  # the same split count: the same arithmetic, bit for bit
        # (with None, the launches see different longest lengths and may split differently)
        o1, lse1 = run(track, lambda: mod.attention(q, k, v, seqused_k=seqused, **kw))
        assert torch.equal(o, o1), f"max |O paged - O| = {(o.float() - o1.float()).abs().max()}"
        assert torch.equal(lse, lse1), f"max |LSE paged - LSE| = {(lse - lse1).abs().max()}"
    used_check(f"paged {page_size}", o, lse, q, k, v, used, causal)


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_long_paged_decode(track):
    q, k, v, k_cache, v_cache, table, seqused = paged_case(
        1, 32, 8, 1, [32768 + 5], 64, 128, torch.bfloat16, seed=1
    )
    o, lse = run(
        track,
        lambda: stage_module(track).attention_paged(
            q, k_cache, v_cache, table, seqused, return_lse=True
        ),
    )
    used_check("32k keys, pages of 64", o, lse, q, k, v, [32768 + 5], False)


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_call_sequence_alternating_page_sizes(track):
    mod = stage_module(track)
    for rnd in range(2):
        for page_size in (16, 256, 64, 128):
            used = [rnd * 100 + 700, 129]
            q, k, v, kc, vc, table, seqused = paged_case(
                2, 8, 2, 1, used, page_size, 64, torch.bfloat16, seed=rnd * 7 + page_size
            )
            o, lse = run(
                track,
                lambda: mod.attention_paged(
                    q, kc, vc, table, seqused, causal=True, return_lse=True
                ),
            )
            used_check(f"page {page_size}", o, lse, q, k, v, used, True)
            o, lse = run(track, lambda: mod.attention(q, k, v, return_lse=True))
            gqa_reference_check("unpaged", o, lse, q, k, v, False, None)


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_paged_decode_step_in_a_cuda_graph(track):
    # A cache that grows: capture one step, then append a key (and a page) and replay.
    mod = stage_module(track)
    page_size, D = 64, 128
    q, k, v, kc, vc, table, seqused = paged_case(
        2, 32, 8, 1, [640, 1000], page_size, D, torch.bfloat16, seed=3, spare_pages=8
    )

    def step():
        return mod.attention_paged(q, kc, vc, table, seqused, causal=True, return_lse=True)

    run(track, step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            o_graph, lse_graph = step()
    torch.cuda.synchronize()
    # sequence 0 had exactly 10 pages: its 641st key opens a new page (a spare one)
    used_pages = set(table[table >= 0].tolist())
    spare = next(p for p in range(kc.shape[0]) if p not in used_pages)
    g = torch.Generator(device="cuda").manual_seed(9)
    new_k = torch.randn(8, D, generator=g, device="cuda").bfloat16()
    new_v = torch.randn(8, D, generator=g, device="cuda").bfloat16()
    kc[spare, 0], vc[spare, 0] = new_k, new_v
    table[0, 10] = spare
    seqused[0] = 641
    q.copy_(torch.randn(q.shape, generator=g, device="cuda").bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    o_eager, lse_eager = run(track, step)
    assert torch.equal(o_graph, o_eager) and torch.equal(lse_graph, lse_eager)
    k2 = torch.cat([k[:1, :, :640], new_k[None, :, None]], dim=2)
    v2 = torch.cat([v[:1, :, :640], new_v[None, :, None]], dim=2)
    used_check("graph, grown", o_graph[:1], lse_graph[:1], q[:1], k2, v2, [641], True)
    used_check("graph, same", o_graph[1:], lse_graph[1:], q[1:], k[1:], v[1:], [1000], True)


def bad_paged(change):
    q, _, _, kc, vc, table, seqused = paged_case(2, 8, 2, 1, [100, 300], 64, 64, torch.bfloat16, 0)
    args = dict(q=q, k_cache=kc, v_cache=vc, page_table=table, seqused_k=seqused)
    change(args)
    return args


BAD = [
    ("page_table dtype", lambda a: a.update(page_table=a["page_table"].long()), TypeError, "'page_table': dtype"),
    ("page_table rows", lambda a: a.update(page_table=a["page_table"][:1]), ValueError, "'page_table': expected shape"),
    ("page_table entry", lambda a: a["page_table"].__setitem__((1, 2), 10_000), ValueError, r"page_table\[1, 2\] = 10000"),
    ("negative entry", lambda a: a["page_table"].__setitem__((0, 0), -1), ValueError, r"page_table\[0, 0\] = -1"),
    ("seqused_k missing", lambda a: a.update(seqused_k=None), TypeError, "'seqused_k': required"),
    ("seqused_k too long", lambda a: a["seqused_k"].__setitem__(0, 10_000), ValueError, r"seqused_k\[0\] = 10000"),
    ("page size 48", lambda a: a.update(k_cache=a["k_cache"][:, :48], v_cache=a["v_cache"][:, :48]), ValueError, "page_size"),
    ("v_cache shape", lambda a: a.update(v_cache=a["v_cache"][:-1]), ValueError, "same shape"),
    ("k_cache dtype", lambda a: a.update(k_cache=a["k_cache"].half()), TypeError, "dtype"),
    # The same shapes and strides, 24 and 4 bytes into a larger tensor (a view of a pool, say)
    ("page_table misaligned", lambda a: a.update(page_table=torch.cat([a["page_table"][:1], a["page_table"]])[1:]), ValueError, "'page_table': data pointer must be 16-byte aligned"),
    ("seqused_k misaligned", lambda a: a.update(seqused_k=torch.cat([a["seqused_k"][:1], a["seqused_k"]])[1:]), ValueError, "'seqused_k': data pointer must be 16-byte aligned"),
]  # fmt: skip


@pytest.mark.parametrize("name, change, error, match", BAD, ids=[c[0] for c in BAD])
@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))  # the good call launches
def test_rejects_bad_paged_input(track, name, change, error, match):
    # A good call with the same shapes first: the bad one then meets the fast path, which must
    # check what can differ between calls of one shape (the table's and seqused_k's values).
    mod = stage_module(track)
    good = bad_paged(lambda a: None)
    run(track, lambda: mod.attention_paged(**good))
    args = bad_paged(change)
    with pytest.raises(error, match=match):
        mod.attention_paged(**args)


@pytest.mark.parametrize("track", on_gpu_stages(stages=STAGES))
def test_check_values_false(track, monkeypatch):
    """check_values=False: the same answer bit for bit with nothing read to the host; a page
    index out of range then reads zeros (TMA's fill outside the cache), never memory outside it."""
    from common import checks

    mod = stage_module(track)
    q, k, v, kc, vc, table, seqused = paged_case(2, 8, 2, 1, [100, 300], 64, 64, torch.bfloat16, 3)
    o1, lse1 = run(track, lambda: mod.attention_paged(q, kc, vc, table, seqused, return_lse=True))

    def no_read(*args, **kw):
        raise AssertionError("check_values=False read page_table to the host")

    monkeypatch.setattr(checks, "check_page_table", no_read)
    # check_values is no part of the fast path's key: forget the call above, so that the first
    # call here takes the slow path
    attention_host._CALLS.clear()
    for _ in range(2):  # the slow path, then the fast one
        o, lse = run(
            track,
            lambda: mod.attention_paged(
                q, kc, vc, table, seqused, return_lse=True, check_values=False
            ),
        )
        assert torch.equal(o, o1) and torch.equal(lse, lse1)
    # A forced split: with its LSE returned (its own tensor), then without (LaunchPlan.outputs
    # puts it in the partials' buffer), each by the slow path, then the fast one: the same O.
    split = dict(num_splits=2, check_values=False)
    for _ in range(2):
        o2, lse2 = run(
            track, lambda: mod.attention_paged(q, kc, vc, table, seqused, return_lse=True, **split)
        )
        used_check("2 splits", o2, lse2, q, k, v, [100, 300], False)
    for _ in range(2):
        o = run(track, lambda: mod.attention_paged(q, kc, vc, table, seqused, **split))
        assert torch.equal(o, o2)
    bad = table.clone()
    bad[1, 1] = kc.shape[0] + 1000  # a page past the cache's end
    o = run(track, lambda: mod.attention_paged(q, kc, vc, bad, seqused, check_values=False))
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()  # zeros for that page's keys, no fault, no NaN
    with pytest.raises(TypeError, match="'check_values'"):
        mod.attention_paged(q, kc, vc, table, seqused, check_values=None)
