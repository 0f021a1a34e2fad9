"""Stage 14 (Hopper), compile-only checks on the CPU: the paged kernel compiles for sm_90a at
every page size (16, 32, 64, 128, 256), split and not, masks, GQA, both dtypes and head dims,
without a spill; a KV tile is page_size-row TMA boxes (page_size < 128: a loop of 128 /
page_size boxes into one slot) or one box; the unpaged kernel is stage 13's."""

import re

import pytest
import torch
from test_stage11_hopper import check_no_spills, compile_stage

from common.tools import stage_table

h14 = stage_table.track_module(14, "hopper")

CONFIGS = [
    dict(page_size=16),
    dict(page_size=32, num_splits=8),
    dict(page_size=64, num_splits=16, kv_heads=1),
    dict(page_size=128, causal=True, kv_heads=2),
    dict(page_size=256, num_splits=4, window=(64, 0)),
    dict(num_splits=16),
    dict(),
]


def config_id(c):
    return "-".join(f"{k}={v}" for k, v in c.items()) or "default"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_compiles_without_spills(config, D, dtype):
    kernel, ptx, counts, res = compile_stage(h14, dtype, D, **config)
    check_no_spills(kernel, ptx, res)
    page = config.get("page_size")
    assert kernel.page_size == page
    assert kernel.page_rows == (None if page is None else min(page, 128))
    # the TMA box of K and V: page_rows x 64 elements (128-byte rows of the 128B swizzle)
    boxes = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", ptx)
    assert boxes, "no TMA load"
