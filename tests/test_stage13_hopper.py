"""Stage 13 (Hopper), compile-only checks on the CPU: the split-KV kernel and the unsplit one
compile for sm_90a in every mode (batch and packed, with and without seqused_k, masks, GQA,
pack-GQA, both dtypes and head dims) without a spill and with setmaxnreg kept; the split kernel
stores O in fp32 from registers (no stmatrix, no shared-memory O) and reads seqused_k; the
combine kernel compiles for sm_90a and sm_100a."""

import pytest
import torch
from test_stage11_hopper import check_no_spills, compile_stage, statements

from common.tools import stage_table

h13 = stage_table.track_module(13, "hopper")

CONFIGS = [
    dict(num_splits=16),
    dict(num_splits=16, kv_heads=1),
    dict(num_splits=4, causal=True, kv_heads=2),
    dict(num_splits=4, varlen=True, seqused_k=True),
    dict(num_splits=3, window=(64, 0)),
    dict(num_splits=1, seqused_k=True),
    dict(),
]


def config_id(c):
    return "-".join(f"{k}={v}" for k, v in c.items()) or "default"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_compiles_without_spills(config, D, dtype):
    kernel, ptx, counts, res = compile_stage(h13, dtype, D, **config)
    check_no_spills(kernel, ptx, res)
    assert kernel.split_kv == (config.get("num_splits", 1) > 1)
    stmatrix = statements(ptx, r"stmatrix")
    f32_stores = statements(ptx, r"st\.global(\.v\d)?\.(f32|b32)")
    if kernel.split_kv:
        # O_partial from registers: fp32 global stores, no stmatrix into a shared O tile.
        assert f32_stores and not stmatrix
    else:
        assert stmatrix


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("D", [64, 128])
def test_combine_compiles(arch, D):
    from common.combine import Combine
    from common.cute_interop import cute_dtype, fake_stream, fake_tensor
    from common.tools.ptx import compile_for_arch

    kernel = Combine(cute_dtype(torch.bfloat16), D)
    args = (
        fake_tensor(torch.float32, (4, 2, 8, 1, D), dynamic=True),
        fake_tensor(torch.float32, (4, 2, 8, 1), dynamic=True),
        fake_tensor(torch.bfloat16, (2, 8, 1, D), dynamic=True),
        fake_tensor(torch.float32, (2, 8, 1), dynamic=True),
        fake_stream(),
    )
    ptx, cubin = compile_for_arch(kernel, args, arch)
    assert cubin and "ex2.approx" in ptx and "lg2.approx" in ptx
    # Both loops over the splits unrolled 16 ways (a decode row's combine is bound by its loads'
    # latency): 16 LSE loads in the max loop, 16 x (LSE + 4 columns of O_s) in the sum loop, plus
    # the remainders' single iterations; rolled, the kernel has 6.
    loads = [ln for ln in ptx.splitlines() if ln.strip().startswith("ld.global")]
    assert len(loads) >= 16 + 16 * 5, len(loads)
