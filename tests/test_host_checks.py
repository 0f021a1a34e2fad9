"""The host path's argument checks on the CPU (common/attention_host.py, common/checks.py,
common/ops.py): a value refused once is refused whatever ran before, and the op path refuses what
the direct path refuses. The launch is stood in for as in tests/test_host_path.py, except that
make_plan itself runs here (with a kernel class that compiles nothing and a compile step that only
records), so that what make_plan checks is seen too."""

import re

import numpy as np
import pytest
import torch

from common import attention_host as AH
from common import checks, ops
from tests.test_host_path import qkv  # the same seeded (q, k, v)


class FakeKernel:
    """A kernel class as the entries and make_plan see it (stage 14's attributes): building it
    compiles nothing; cached_compile_ffi is replaced by a recorder below."""

    takes_splits = True
    takes_pages = True

    def __init__(self, dtype, D, pack, **options):
        self.pack, self.options = pack, options
        self.uses_tile_counter = True


@pytest.fixture
def real_plans(monkeypatch):
    """The entries with the real launch and make_plan; only the compile (a recorder, also of a
    split launch's SplitLaunch) and the CUDA-only shape checks are stood in for."""
    launches = []

    def compile_ffi(kernel, *args):
        return lambda *call_args: launches.append((kernel, call_args))

    def dims(q, k, v):  # checks.check_attention_args without its CUDA-device check
        B, H, Sq, D = q.shape
        return B, H, Sq, k.shape[2], D

    def paged_dims(q, k_cache, v_cache, page_table):
        return (*q.shape, k_cache.shape[1])

    monkeypatch.setattr(AH, "cached_compile_ffi", compile_ffi)
    monkeypatch.setattr(AH, "checked_dims", dims)
    monkeypatch.setattr(AH, "checked_paged_dims", paged_dims)
    AH._CALLS.clear()
    AH._PLANS.clear()
    yield launches
    AH._CALLS.clear()
    AH._PLANS.clear()


# --------------------------------------------------------------------------- pack_gqa


@pytest.mark.parametrize("bad", [1, 1.0, np.True_], ids=["int", "float", "numpy-bool"])
def test_pack_gqa_type_is_checked_also_when_a_plan_exists(real_plans, bad):
    """pack_gqa is checked (a bool or None) inside make_plan (choose_pack), and 1, 1.0 and
    numpy.True_ are equal dictionary keys to True: plan_key holds pack_gqa with its type, so a
    plan made for True does not take them past the check. Whether a bad value is refused does
    not depend on what was called before."""
    q, k, v = qkv(0)  # G = 4
    with pytest.raises(TypeError, match="pack_gqa"):
        AH.attention(FakeKernel, q, k, v, pack_gqa=bad)  # fresh caches: refused
    AH.attention(FakeKernel, q, k, v, pack_gqa=True)
    with pytest.raises(TypeError, match="pack_gqa"):
        AH.attention(FakeKernel, q, k, v, pack_gqa=bad)  # after a plan for True too


def test_paged_pack_gqa_type_is_checked_also_when_a_plan_exists(real_plans):
    q, _, _ = qkv(0)
    kc = torch.zeros(12, 64, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    used = torch.tensor([100, 300], dtype=torch.int32)
    call = lambda p: AH.attention_paged(  # noqa: E731
        FakeKernel, q, kc, kc, table, used, pack_gqa=p, check_values=False
    )
    with pytest.raises(TypeError, match="pack_gqa"):
        call(1)
    call(True)
    with pytest.raises(TypeError, match="pack_gqa"):
        call(1)


# --------------------------------------------------------------------------- ops: op vs direct


def test_op_path_refuses_max_seqlen_types_the_direct_path_refuses(monkeypatch):
    """ops.attention_varlen checks the options' types before either path (_check_options): the
    op's schema (`int?`) would turn max_seqlen_k=True into 1 and numpy.int64(3) into 3, which the
    direct path (the stage's check_cu_seqlens) refuses with a TypeError naming the argument."""
    q = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(3, 1, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    for bad in (True, np.int64(3)):  # what the direct path (the stage's own check) does
        with pytest.raises(TypeError, match="argument 'max_seqlen_k'"):
            checks.check_cu_seqlens(q, k, cu, cu, None, bad)

    class Stage:  # the stage's attention_varlen: its argument checks, no launch
        def attention_varlen(self, q, k, v, cu_q, cu_k, max_seqlen_q=None, max_seqlen_k=None,
                             **kwargs):  # fmt: skip
            checks.check_cu_seqlens(q, k, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
            return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(ops, "_stage", Stage)
    assert not ops.eager_direct((q, k, k, cu, cu))  # CPU tensors: the op path
    for bad in (True, np.int64(3)):
        with pytest.raises(TypeError, match="argument 'max_seqlen_k'"):
            ops.attention_varlen(q, k, k, cu, cu, max_seqlen_k=bad)


# --------------------------------------------------------------------------- scale


@pytest.mark.parametrize("bad", [True, "0.5", 10**400], ids=["bool", "str", "huge-int"])
def test_scale_refuses_what_is_not_a_number(bad):
    """check_scale: an explicit scale is a finite positive number. float() would take True (as
    1.0; every other option refuses a bool) and the string '0.5', and an int too large for a
    float raises OverflowError: each is refused naming the argument."""
    with pytest.raises((TypeError, ValueError), match="argument 'scale'"):
        checks.check_scale(bad, 64)


# --------------------------------------------------------------------------- empty batch or heads


@pytest.mark.parametrize("shape", [(0, 8, 4, 64), (2, 0, 4, 64)], ids=["B=0", "H=0"])
def test_no_batch_or_no_heads_is_refused_by_name(monkeypatch, shape):
    """B = 0 or H = 0 would reach the compile and TMA, which cannot describe an empty tensor: the
    shape checks refuse it by name, as they refuse Sq = 0 and Sk = 0 (the CUDA-device check is
    stood in for)."""
    monkeypatch.setattr(checks, "check_tensor", lambda *a, **k: None)
    q = torch.zeros(shape, dtype=torch.bfloat16)
    k = torch.zeros(shape[0], 2 if shape[1] else 1, 16, 64, dtype=torch.bfloat16)
    name = "B = q.shape[0]" if shape[0] == 0 else "H = q.shape[1]"
    with pytest.raises(ValueError, match=re.escape(f"{name} = 0 must be positive")):
        checks.check_attention_args(q, k, k, kv_heads=True)
    kc = torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16)
    table = torch.zeros(shape[0], 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(f"{name} = 0 must be positive")):
        checks.check_paged_args(q, kc, kc, table)


# ------------------------------------------------------------- values read to the host


def test_packed_seqused_k_is_read_once_per_version_of_both_tensors(monkeypatch):
    """Packed calls check seqused_k against cu_seqlens_k's sequence lengths. The values are read
    once for a (seqused_k, cu_seqlens_k) pair and version, as in batch mode: a decode loop that
    passes the same tensors each step pays no copy after the first. An in-place write to either
    tensor is seen (a now-invalid count is refused)."""
    q = torch.zeros(9, 4, 64, dtype=torch.bfloat16)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)
    used = torch.tensor([3, 5], dtype=torch.int32)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or tolist(t))
    checks._SEQUSED_SEEN.clear()
    checks.check_seqused_k(used, q, cu_k)
    first = len(reads)
    assert first > 0
    checks.check_seqused_k(used, q, cu_k)
    assert len(reads) == first, "the second call of the same pair read the values again"
    cu_k[1] = 2  # sequence 0 now has 2 keys: seqused_k[0] = 3 no longer fits
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 3 is outside 0 .. 2"):
        checks.check_seqused_k(used, q, cu_k)
    cu_k[1] = 4
    checks.check_seqused_k(used, q, cu_k)
    used[1] = 6  # sequence 1 has 5 keys
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 6 is outside 0 .. 5"):
        checks.check_seqused_k(used, q, cu_k)
    other = cu_k.clone()  # another tensor object with the same values is read again
    used[1] = 5
    checks.check_seqused_k(used, q, cu_k)
    before = len(reads)
    checks.check_seqused_k(used, q, other)
    assert len(reads) > before
    checks._SEQUSED_SEEN.clear()


def test_cu_seqlens_first_seen_during_a_capture_is_refused_by_name(monkeypatch):
    """The offsets are checked on the host, which a CUDA graph capture forbids: a pair first seen
    during a capture gets an error that says what to do (a warm-up call before the capture); a
    pair checked before the capture passes without a read."""
    q = torch.zeros(9, 4, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)
    checks._CU_SEQLENS_SEEN.clear()
    monkeypatch.setattr(checks, "capturing", lambda t: True)
    with pytest.raises(RuntimeError, match="cu_seqlens_q.*warm-up"):
        checks.check_cu_seqlens(q, q, cu_q, cu_k, None, None)
    monkeypatch.setattr(checks, "capturing", lambda t: False)
    assert checks.check_cu_seqlens(q, q, cu_q, cu_k, None, None) == (5, 5)
    monkeypatch.setattr(checks, "capturing", lambda t: True)
    assert checks.check_cu_seqlens(q, q, cu_q, cu_k, None, None) == (5, 5)
    checks._CU_SEQLENS_SEEN.clear()
