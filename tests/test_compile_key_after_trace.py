"""A kernel object's compile key must not change because it was compiled: tracing sets
attributes on it (Hopper: shared_storage, whose repr holds an address, and shared_memory_bytes),
and common/compile.py's key reads every attribute. A split-KV LaunchPlan compiles its SplitLaunch
twice - the variant that returns LSE in make_plan, the one that keeps LSE in the partials' buffer
at the first call that returns none - so the second compile of the plan whose first compile
traced it saw a key no other plan has: the same code compiled again for the next plan of that
configuration (another Sk), and a dead entry in the cache. On the CPU, compiled for sm_90a."""

import types

import pytest
import torch

from common import attention_host as AH
from common import compile as compile_cache
from common.compile import ffi_compile_key


@pytest.fixture
def sm90a_compiles(monkeypatch):
    """cached_compile_ffi as it is, each cute.compile it makes done for sm_90a on the CPU and
    counted; the compiled functions are never called (CPU tensors)."""
    pytest.importorskip("tvm_ffi")
    from common.tools.ptx import _ArchOverride

    real = compile_cache.cute
    compiled = types.SimpleNamespace(kernels=[], keys=[])

    def compile_for_sm90a(kernel, *args, options=""):
        compiled.kernels.append(kernel)
        with _ArchOverride("sm_90a"):
            return real.compile(kernel, *args, options=f"{options} --gpu-arch sm_90a")

    shim = types.SimpleNamespace(compile=compile_for_sm90a)
    monkeypatch.setattr(compile_cache, "cute", shim)

    def no_launch(kernel, *args):
        compiled.keys.append((kernel, args, ffi_compile_key(kernel, args)))
        compile_cache.cached_compile_ffi(kernel, *args)
        return lambda *call_args: None

    monkeypatch.setattr(AH, "cached_compile_ffi", no_launch)
    compile_cache.clear_cache()
    yield compiled
    compile_cache.clear_cache()


def split_plan(Sk):
    from stages.stage13_split_kv import hopper

    q = torch.randn(1, 32, 1, 128).bfloat16()
    k = v = torch.randn(1, 8, Sk, 128).bfloat16()
    o, lse = torch.empty_like(q), torch.empty(1, 32, 1)
    plan = AH.make_plan(
        hopper.Sm90Kernel, q, k, v, o, lse, None, None, 1, Sk, True, None, None, None, 16
    )
    return plan, (q, k, v)


def test_compiling_a_launcher_leaves_its_key_as_it_was(sm90a_compiles):
    split_plan(8192)
    # make_plan compiled its SplitLaunch (a cache miss: the object was traced)
    assert len(sm90a_compiles.kernels) == 1
    kernel, args, key = sm90a_compiles.keys[0]
    assert ffi_compile_key(kernel, args) == key


def test_the_lse_in_buffer_variant_compiles_once_per_configuration(sm90a_compiles):
    for Sk in (8192, 8320):  # two plans, one kernel configuration (16 splits, decode tile)
        plan, (q, k, v) = split_plan(Sk)
        o, lse, buffer = plan.outputs(torch.bfloat16, "cpu", False)
        assert lse is None
        plan.run(q, k, v, o, lse, None, None, 1, 0.1, None, buffer=buffer)
    # the variant that returns LSE and the one that keeps it in the buffer: one compile each
    assert len(sm90a_compiles.kernels) == 2


@pytest.mark.parametrize("track", ["hopper", "blackwell"])
@pytest.mark.parametrize("stage", range(7, 15))
def test_every_launched_kernel_object_copies_with_its_key(stage, track):
    """cached_compile_ffi traces a deep copy of the kernel object: every stage that launches
    through it (7-14, both tracks) must copy, and the copy must have the original's key."""
    import copy

    from common.compile import kernel_config
    from common.tools import stage_table

    mod = stage_table.track_module(stage, track)
    kernel, _ = mod.compile_args(torch.bfloat16, (1, 1, 128, 128, 128))
    twin = copy.deepcopy(kernel)
    assert type(twin) is type(kernel) and twin is not kernel
    assert kernel_config(twin) == kernel_config(kernel)


def test_the_same_tunings_in_another_order_give_the_same_key():
    from common.compile import _config_value, kernel_config
    from stages.stage12_last_percent import hopper

    # Sets whose order of iteration differs for certain (0 and 8 share a slot of an 8-slot table,
    # so insertion order decides), whatever the string hash seed of this process does below.
    assert repr(frozenset((8, 0))) != repr(frozenset((0, 8)))
    assert _config_value(frozenset((8, 0))) == _config_value(frozenset((0, 8)))

    names = sorted(hopper.Sm90Kernel.TUNINGS)
    one, two = (hopper.Sm90Kernel(hopper.cutlass.BFloat16, 128, 1) for _ in range(2))
    one.tunings, two.tunings = frozenset(names), frozenset(reversed(names))
    assert kernel_config(one) == kernel_config(two)
