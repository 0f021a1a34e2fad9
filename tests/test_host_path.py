"""common/attention_host.py's fast path, on the CPU: the launch is replaced by a recorder, so what
is checked, planned and launched at each call of a sequence can be seen without a GPU.

A call whose tensors have the dtypes, devices, shapes and strides of an earlier call, with the same
options of the same types, reuses that call's checked sizes, scale and LaunchPlan. These tests
pin down that such a call still launches with its own tensors and fresh outputs, that what can
differ between two calls of one shape is still checked (alignment, seqused_k, page-table values),
that an option equal in value but not in type (causal=1 after causal=True) goes through the
checks again, that clearing the compile cache forgets the remembered calls, and that a plan
views each call's tensors with the canonical strides it keeps (and is keyed by every stride). The GPU tests of
stages 13 and 14 run the same sequences with the kernels (test_fast_path_checks_what_can_change,
test_rejects_bad_paged_input, test_check_values_false)."""

import math

import pytest
import torch

from common import attention_host as AH
from common import checks
from common import compile as compile_cache

CHECK_SEQUSED_K = checks.check_seqused_k  # the real one, before the fixture stands in for it


class Recorder:
    """Stands in for make_plan (counted) and for the LaunchPlans it returns (each run recorded)."""

    def __init__(self):
        self.plans_made = 0
        self.runs = []
        self.buffers = []

    def make_plan(self, *args, **kwargs):
        self.plans_made += 1
        self.seqused_compiled = args[13]  # what the kernel would be compiled with
        rec = self

        layouts = [AH.output_layout(tuple(t.shape)) for t in args[4:6]]  # O and LSE

        class Plan:
            def outputs(self, dtype, device, return_lse):  # as an unsplit LaunchPlan's
                o, lse = (
                    AH.new_output(lo, dt, device) for lo, dt in zip(layouts, (dtype, torch.float32))
                )
                # a stand-in for a split launch's buffer: the launch must pass it on to run
                buffer = ("buffer", len(rec.runs), return_lse)
                rec.buffers.append(buffer)
                return o, lse, buffer

            def run(
                self, q, k, v, o, lse, cu_q, cu_k, max_seqlen_q, scale, seqused_k, pages=None,
                buffer=None,
            ):  # fmt: skip
                rec.runs.append(
                    dict(
                        q=q, k=k, v=v, o=o, lse=lse, scale=scale, pages=pages, seqused=seqused_k,
                        buffer=buffer,
                    )
                )  # fmt: skip

        return Plan()


class Kernel:  # a kernel class as the entries see it (stage 14's attributes)
    takes_splits = True
    takes_pages = True


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    checked = []

    def dims(q, k, v):  # checks.check_attention_args without its CUDA-device check
        checked.append(q)
        B, H, Sq, D = q.shape
        if q.data_ptr() % 16:
            raise ValueError("argument 'q': data pointer must be 16-byte aligned for TMA")
        return B, H, Sq, k.shape[2], D

    def paged_dims(q, k_cache, v_cache, page_table):
        checked.append(q)
        return (*q.shape, k_cache.shape[1])

    def cuda_free_seqused(seqused_k, q, key_counts, read_values=True, known_layout=False):
        if not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32:
            raise TypeError("argument 'seqused_k': expected an int32 tensor")
        if read_values:
            for b, (n, c) in enumerate(zip(seqused_k.tolist(), key_counts)):
                if not 0 <= n <= c:
                    raise ValueError(f"argument 'seqused_k': seqused_k[{b}] = {n}")

    monkeypatch.setattr(AH, "make_plan", r.make_plan)
    monkeypatch.setattr(AH, "checked_dims", dims)
    monkeypatch.setattr(AH, "checked_paged_dims", paged_dims)
    monkeypatch.setattr(checks, "check_seqused_k", cuda_free_seqused)
    AH._CALLS.clear()
    AH._PLANS.clear()
    r.checked = checked
    yield r
    AH._CALLS.clear()
    AH._PLANS.clear()


def qkv(seed, B=2, H=8, Hkv=2, Sq=1, Sk=256, D=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g).bfloat16()
    k = torch.randn(B, Hkv, Sk, D, generator=g).bfloat16()
    return q, k, k.clone()


def test_same_shape_reuses_the_plan_with_its_own_tensors(rec):
    outs = []
    for seed in range(3):
        q, k, v = qkv(seed)
        outs.append(AH.attention(Kernel, q, k, v, causal=True))
        run = rec.runs[-1]
        assert run["q"] is q and run["k"] is k and run["v"] is v and run["o"] is outs[-1]
        assert run["scale"] == 64**-0.5
    assert rec.plans_made == 1 and len(rec.runs) == 3
    assert len(rec.checked) == 1  # only the first call ran the shape checks
    # the fast path's calls launch with the outputs and the buffer their plan allocated
    assert [r["buffer"] for r in rec.runs] == [None, ("buffer", 1, False), ("buffer", 2, False)]
    assert len({id(o) for o in outs}) == 3  # fresh outputs each call
    # Another shape, another mask: each a new plan; another scale: the same plan (the scale is
    # a launch argument), launched with that scale.
    AH.attention(Kernel, *qkv(0, Sk=512), causal=True)
    AH.attention(Kernel, *qkv(0), causal=False)
    AH.attention(Kernel, *qkv(0), causal=True, scale=0.5)
    assert rec.plans_made == 3 and rec.runs[-1]["scale"] == 0.5
    AH.attention(Kernel, *qkv(1), causal=True, scale=0.5)
    assert rec.runs[-1]["scale"] == 0.5 and len(rec.checked) == 4


def test_what_can_change_is_checked_again(rec):
    q, k, v = qkv(0)
    used = torch.tensor([100, 256], dtype=torch.int32)
    AH.attention(Kernel, q, k, v, causal=True, seqused_k=used)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 257"):
        AH.attention(Kernel, q, k, v, causal=True, seqused_k=used + 1)
    with pytest.raises(TypeError, match="seqused_k"):
        AH.attention(Kernel, q, k, v, causal=True, seqused_k=used.long())
    base = torch.empty(q.numel() + 8, dtype=q.dtype)
    q_off = base[1 : 1 + q.numel()].view(q.shape)  # same shape and strides, 2 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        AH.attention(Kernel, q_off, k, v, causal=True, seqused_k=used)
    AH.attention(Kernel, q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal"):  # equal to True, but not a bool
        AH.attention(Kernel, q, k, v, causal=1)
    with pytest.raises(TypeError, match="return_lse"):
        AH.attention(Kernel, q, k, v, causal=True, return_lse=1)
    assert rec.plans_made == 2  # with and without seqused_k


def test_one_sequence_seqused_k_goes_with_stride_1(rec, monkeypatch):
    """B = 1: seqused_k of one entry may carry any stride (a column of a larger tensor, say); the
    plan is made and each launch made with the same byte at stride 1, whatever the first call's
    stride was, so the compiled kernel is one and is never handed a stride it was not built for."""
    q, k, v = qkv(0, B=1)
    table = torch.tensor([[256, 7, 7], [3, 5, 9]], dtype=torch.int32)
    strided = table[:1, 0]  # (1,), stride 3
    assert strided.stride() == (3,)
    for used in (strided, torch.tensor([256], dtype=torch.int32), strided):
        AH.attention(Kernel, q, k, v, causal=True, seqused_k=used)
        run = rec.runs[-1]["seqused"]
        assert run.stride() == (1,) and run.data_ptr() == used.data_ptr()
    assert rec.plans_made == 1 and rec.seqused_compiled.stride() == (1,)
    monkeypatch.setattr(checks, "check_page_table", lambda *a: None)  # needs CUDA
    kc = torch.zeros(4, 64, 2, 64, dtype=torch.bfloat16)
    pages = torch.arange(4, dtype=torch.int32).view(1, 4)
    AH.attention_paged(Kernel, q, kc, kc, pages, table[1:, 1])  # 5 keys, stride 3
    assert rec.plans_made == 2 and rec.seqused_compiled.stride() == (1,)
    AH.attention_paged(Kernel, q, kc, kc, pages, table[1:, 2])  # the fast path
    assert rec.runs[-1]["seqused"].stride() == (1,) and rec.plans_made == 2


def test_paged_calls_recheck_values_unless_told_not_to(rec, monkeypatch):
    q, _, _ = qkv(0)
    kc = torch.zeros(12, 64, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    used = torch.tensor([100, 300], dtype=torch.int32)
    reads = []
    monkeypatch.setattr(checks, "check_page_table", lambda *a: reads.append(a))
    for _ in range(2):
        AH.attention_paged(Kernel, q, kc, kc, table, used)
    assert len(reads) == 2 and rec.plans_made == 1  # the values at every call, one plan
    assert rec.runs[-1]["pages"] is table
    # The cache as it is, (num_pages, page_size, Hkv, D): no permuted view per call
    assert rec.runs[-1]["k"] is kc
    AH.attention_paged(Kernel, q, kc, kc, table, used, check_values=False)
    assert len(reads) == 2 and len(rec.runs) == 3
    with pytest.raises(TypeError, match="seqused_k"):
        AH.attention_paged(Kernel, q, kc, kc, table, None)
    with pytest.raises(TypeError, match="check_values"):
        AH.attention_paged(Kernel, q, kc, kc, table, used, check_values=0)


def test_clearing_the_compile_cache_forgets_calls(rec):
    q, k, v = qkv(0)
    AH.attention(Kernel, q, k, v)
    compile_cache.clear_cache()
    AH.attention(Kernel, q, k, v)
    assert rec.plans_made == 2


def test_unhashable_options_take_the_checked_path(rec):
    q, k, v = qkv(0)
    AH.attention(Kernel, q, k, v, window=[16, 0])
    AH.attention(Kernel, q, k, v, window=[16, 0])  # a list: keyed as its values
    assert rec.plans_made == 1 and len(rec.runs) == 2
    assert AH.call_key(("x", {}), (q,)) is None  # a dict cannot be a key: the slow path


def test_a_tensor_scale_is_read_at_every_call(rec):
    # A 0-dim tensor as the scale is accepted (float(scale)) but may be written in place between
    # two calls of one shape: each call must launch with the value it holds then.
    q, k, v = qkv(0)
    scale = torch.tensor(0.5)
    AH.attention(Kernel, q, k, v, scale=scale)
    scale.fill_(0.25)
    AH.attention(Kernel, q, k, v, scale=scale)
    kc = torch.zeros(12, 64, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    used = torch.tensor([100, 300], dtype=torch.int32)
    AH.attention_paged(Kernel, q, kc, kc, table, used, scale=scale, check_values=False)
    scale.fill_(0.125)
    AH.attention_paged(Kernel, q, kc, kc, table, used, scale=scale, check_values=False)
    assert [r["scale"] for r in rec.runs] == [0.5, 0.25, 0.25, 0.125]
    # A plain float still takes the fast path.
    AH.attention(Kernel, q, k, v, scale=0.5)
    AH.attention(Kernel, q, k, v, scale=0.5)
    assert len(rec.checked) == 5 and rec.runs[-1]["scale"] == 0.5


def test_int32_arguments_must_be_aligned():
    # The compiled function assumes a 16-byte aligned base for every tensor it takes, seqused_k,
    # cu_seqlens and page_table too (its TVM-FFI entry refuses others): the checks refuse them
    # first, by name.
    q, _, _ = qkv(0)
    pool = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="'seqused_k': data pointer must be 16-byte aligned"):
        checks.check_seqused_k(pool[1:3], q, [256, 256], read_values=False)
    checks.check_seqused_k(pool[4:6], q, [256, 256], read_values=False)  # 16 bytes in: fine
    cu = torch.tensor([0, 0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="'cu_seqlens_q': data pointer must be 16-byte aligned"):
        checks.check_cu_seqlens(q[0, 0], q[0, 0], cu[1:], cu[:3].clone(), None, None)


def test_a_misaligned_page_table_leaves_the_fast_path(rec):
    q, _, _ = qkv(0)
    kc = torch.zeros(12, 64, 2, 64, dtype=torch.bfloat16)
    tables = torch.arange(21, dtype=torch.int32).view(3, 7) % 12
    used = torch.tensor([100, 300], dtype=torch.int32)
    AH.attention_paged(Kernel, q, kc, kc, tables[:2], used, check_values=False)
    AH.attention_paged(Kernel, q, kc, kc, tables[:2].clone(), used, check_values=False)
    assert len(rec.checked) == 1 and rec.plans_made == 1
    # One row into the table: 28 bytes in, the same shape and strides - the checks again.
    AH.attention_paged(Kernel, q, kc, kc, tables[1:], used, check_values=False)
    assert len(rec.checked) == 2


def test_a_remembered_call_still_checks_seqused_k_alignment_and_values(rec, monkeypatch):
    """seqused_k's dtype, device, shape and strides are in the fast path's key; its alignment and
    values are not, so a call that hits the key still checks both (the real check_seqused_k,
    which runs on the CPU), and one of another shape misses the key and meets every check."""
    monkeypatch.setattr(checks, "check_seqused_k", CHECK_SEQUSED_K)
    q, k, v = qkv(0)
    pool = torch.tensor([100, 256, 7, 9, 11, 13, 200, 100], dtype=torch.int32)
    AH.attention(Kernel, q, k, v, causal=True, seqused_k=pool[0:2])
    AH.attention(Kernel, q, k, v, causal=True, seqused_k=pool[4:6])  # 16 bytes in: fast path
    assert len(rec.checked) == 1 and len(rec.runs) == 2
    assert rec.runs[-1]["seqused"].data_ptr() == pool[4:6].data_ptr()
    with pytest.raises(ValueError, match="'seqused_k': data pointer must be 16-byte aligned"):
        AH.attention(Kernel, q, k, v, causal=True, seqused_k=pool[1:3])
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 300 is outside 0 \.\. 256"):
        AH.attention(
            Kernel, q, k, v, causal=True, seqused_k=torch.tensor([300, 1], dtype=torch.int32)
        )
    assert len(rec.checked) == 1 and len(rec.runs) == 2  # both refused on the fast path
    with pytest.raises(ValueError, match=r"expected shape \(2,\)"):
        AH.attention(Kernel, q, k, v, causal=True, seqused_k=pool[0:3])
    # The paged entry, values unchecked (check_values=False): the alignment still is.
    kc = torch.zeros(12, 64, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    AH.attention_paged(Kernel, q, kc, kc, table, pool[0:2], check_values=False)
    AH.attention_paged(Kernel, q, kc, kc, table, pool[4:6], check_values=False)
    assert rec.runs[-1]["seqused"].data_ptr() == pool[4:6].data_ptr()
    with pytest.raises(ValueError, match="'seqused_k': data pointer must be 16-byte aligned"):
        AH.attention_paged(Kernel, q, kc, kc, table, pool[1:3], check_values=False)
    with pytest.raises(ValueError, match=r"expected shape \(2,\)"):
        AH.attention_paged(Kernel, q, kc, kc, table, pool[0:3], check_values=False)


def test_remembered_calls_survive_threads():
    """The entries' caches drop their oldest entry when full (checks.remember). Between finding
    that entry and dropping it another thread may have dropped it already: the second drop is
    then a no-op, not a KeyError in the caller's attention call."""

    class Racy(dict):  # another thread drops the oldest entry while this one reads it
        def __iter__(self):
            oldest = next(super().__iter__())
            del self[oldest]
            return iter([oldest])

    racy = Racy(a=1, b=2)
    checks.remember(racy, 2, "c", 3)
    assert dict(racy) == {"b": 2, "c": 3}
    checks.remember({}, 0, "x", 1)  # full when empty: nothing to drop

    import threading

    cache, errors = {}, []

    def fill(t):
        try:
            for i in range(20000):
                checks.remember(cache, 4, (t, i), i)
        except Exception as e:  # noqa: BLE001 - any error is the failure
            errors.append(e)

    threads = [threading.Thread(target=fill, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and 1 <= len(cache) <= 4 + len(threads)


def test_a_plan_views_every_call_with_the_strides_it_keeps():
    # A LaunchPlan keeps the canonical strides of its inputs (worked out once, in make_plan) and
    # views each call's own tensors with them: the same strides canonical_strides gives, on the
    # call's own memory, for every call of a sequence.
    from common.cute_interop import canonical_strides

    def layouts(seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(4, 1, 64, generator=g).unsqueeze(0)  # (1, 4, 1, 64): B = Sq = 1
        k, v = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(2))
        o, lse = torch.randn(1, 4, 1, 64, generator=g), torch.randn(1, 4, 1, generator=g)
        return q, k, v, o, lse

    first = layouts(0)
    kept = tuple(
        None if canonical_strides(t) is t else canonical_strides(t).stride() for t in first
    )
    assert kept[0] is not None  # q's size-1 modes get the span of its other modes
    launched = []
    plan = AH.LaunchPlan(lambda *a: launched.append(a), (256, 1), 1, kept, None, False, None, None)
    for seed in range(3):
        tensors = layouts(seed)
        plan.run(*tensors, None, None, 1, 0.125, None)
        for t, a in zip(tensors, launched[-1][:5]):
            c = canonical_strides(t)
            assert (a.shape, a.stride(), a.data_ptr()) == (t.shape, c.stride(), t.data_ptr())
            assert torch.equal(a, t)


def test_plan_key_tells_apart_the_strides_of_size_one_modes():
    # The kept strides are right only for tensors of the strides the plan was made for: the
    # plan's key holds every input's strides, size-1 modes included.
    k = v = torch.empty(1, 2, 256, 64)
    o, lse = torch.empty(1, 4, 1, 64), torch.empty(1, 4, 1)
    q1 = torch.empty(1, 4, 1, 64)
    q2 = torch.empty(4, 1, 1, 64).permute(1, 0, 2, 3)  # the same shape, B's stride differs
    assert q1.shape == q2.shape and q1.stride() != q2.stride()
    keys = [
        AH.plan_key(Kernel, q, k, v, o, lse, None, None, 1, 256, True, None, None, None)
        for q in (q1, q2)
    ]
    assert keys[0] != keys[1]


# ------------------------------------------------------------- what a call allocates


def test_scratch_views_fit_their_buffer_and_outlive_its_growth(monkeypatch):
    # scratch_output: each view lies inside the buffer it was made from (its last element
    # included, strided and size-0 layouts too); a larger layout gets a new buffer and the
    # earlier views keep the old one (a captured CUDA graph may still write through them).
    monkeypatch.setattr(AH, "_SCRATCH", {})
    layouts = [
        AH.output_layout((1, 32, 1)),
        AH.output_layout((2, 4, 0)),
        ((3, 5, 7), (1, 3 * 7 * 9, 3)),  # not contiguous, gaps between rows
        AH.output_layout((8, 64, 1024)),
        AH.output_layout((1, 32, 1)),
        ((4,), (200_000,)),  # spans 600,001: more than the buffer, less than twice it
        ((2, 3), (1, 1_200_000)),  # spans 2,400,002: more than twice the buffer
    ]
    views = [AH.scratch_output(layout, "cpu") for layout in layouts]
    for view, (shape, stride) in zip(views, layouts):
        assert view.shape == shape and view.stride() == stride and view.dtype == torch.float32
        if view.numel():
            last = sum((n - 1) * st for n, st in zip(shape, stride))
            assert last < view.untyped_storage().nbytes() // 4
            view.fill_(1.0)  # writable, in bounds
    kept = AH._SCRATCH["cpu"]
    # the size a buffer gets: 4096 elements at least, twice the last one's, or the layout's span
    assert [t.numel() for t in kept] == [4096, 8 * 64 * 1024, 2 * 8 * 64 * 1024, 2_400_002]
    owner = [0, 0, 0, 1, 1, 2, 3]  # the buffer each view was made from
    for view, i in zip(views, owner):
        assert view.untyped_storage().data_ptr() == kept[i].data_ptr()


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("splits", [1, 2, 3, 16])
@pytest.mark.parametrize("shape", [(1, 32, 1, 128), (3, 5, 7, 64), (1, 1, 1, 64)])
def test_plan_outputs_look_fresh_and_the_split_lse_leads_the_partials(shape, splits, return_lse):
    # LaunchPlan.outputs allocates O and LSE with the strides canonical_strides would give them
    # (the launch then passes them as they are). A split launch that does not return its LSE
    # allocates none: the compiled launch (common/combine.py's SplitLaunch) writes it into the
    # partials' buffer, at offset 0, the partials 256-byte aligned behind it, no two views
    # overlapping (partials_layout states SplitLaunch's views in torch's terms). A returned LSE
    # has its own storage (a view would keep the whole buffer alive); an unsplit call's LSE
    # that is not returned is a view of the device's scratch (scratch_output), the same view at
    # every call of the plan.
    from common.combine import partial_offsets
    from common.cute_interop import canonical_strides

    lse_shape = shape[:3]
    partials = AH.partials_layout(splits, shape, lse_shape) if splits > 1 else None
    plan = AH.LaunchPlan(
        None, (0, 0), splits, (None,) * 5, None, True, None, partials,
        outputs=(AH.output_layout(shape), AH.output_layout(lse_shape)),
    )  # fmt: skip
    o, lse, buffer = plan.outputs(torch.bfloat16, "cpu", return_lse)
    in_buffer = splits > 1 and not return_lse
    assert o.shape == shape and (lse is None) == in_buffer
    for t in (o,) if in_buffer else (o, lse):
        assert canonical_strides(t) is t and t.is_contiguous()
        # What opcheck's fake-tensor check compares against the custom op's fake outputs
        # (fresh contiguous tensors, common/ops.py): the strides of modes longer than 1 and the
        # storage offset.
        fresh = torch.empty(t.shape, dtype=t.dtype)
        same, mode = torch._prims_common.check_significant_strides(t, fresh, only_cuda=False)
        assert same, (t.stride(), fresh.stride(), mode)
        assert t.storage_offset() == fresh.storage_offset() == 0
    if not in_buffer:
        assert buffer is None and lse.dtype == torch.float32 and lse.shape == lse_shape
        if return_lse:
            assert lse._base is None and lse.untyped_storage().nbytes() == 4 * lse.numel()
        else:
            assert any(lse.untyped_storage().data_ptr() == s.data_ptr() for s in AH._SCRATCH["cpu"])
            _, again, _ = plan.outputs(torch.bfloat16, "cpu", return_lse)
            assert again is lse
        return
    elements, o_view, lse_view, lse_final = partials
    assert buffer.dtype == torch.float32 and buffer.numel() == elements
    rows = math.prod(lse_shape)
    assert (o_view[2], lse_view[2], elements) == partial_offsets(splits, rows, shape[-1])
    assert lse_final[2] == 0
    assert o_view[2] % 64 == 0 and lse_view[2] % 64 == 0  # fp32 elements: 256 bytes
    # every element of the buffer belongs to at most one of the three views
    owner = torch.zeros(elements, dtype=torch.int32)
    for i, view in enumerate((o_view, lse_view, lse_final)):
        idx = torch.arange(elements, dtype=torch.int32).as_strided(*view)
        assert idx.unique().numel() == idx.numel()  # no element twice within a view
        assert (owner[idx.flatten().long()] == 0).all(), f"view {i} overlaps an earlier one"
        owner[idx.flatten().long()] = i + 1
    assert o_view[0] == (splits, *shape) and lse_view[0] == (splits, *lse_shape)
