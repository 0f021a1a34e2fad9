"""The host-side twin of stage 6's masks (common/masks.py), on the CPU: the argument rules, and
the tile range and edge test against the boolean mask they are derived from. The kernels use
the same formulas (Sm90Kernel.kv_tile_range, crosses_mask_edge), so a mistake here is a
mistake there; the GPU tests then hold the kernels to the fp64 reference."""

import itertools
import random

import pytest
import torch

from common import masks


def test_resolve_window_convention():
    Sq, Sk = 300, 500
    assert masks.resolve_window(False, None, Sq, Sk) == (Sk, Sq)  # unbounded: sees every key
    assert masks.resolve_window(True, None, Sq, Sk) == (Sk, 0)
    assert masks.resolve_window(True, (64, None), Sq, Sk) == (64, 0)
    assert masks.resolve_window(True, (64, 0), Sq, Sk) == (64, 0)
    assert masks.resolve_window(False, (None, 7), Sq, Sk) == (Sk, 7)
    assert masks.resolve_window(False, (10**9, 10**9), Sq, Sk) == (Sk, Sq)  # clamped, same mask


@pytest.mark.parametrize(
    "causal, window, error, match",
    [
        (False, (-1, 0), ValueError, "argument 'window': the left bound must be >= 0"),
        (False, (0, -3), ValueError, "argument 'window': the right bound must be >= 0"),
        (False, (1.5, 0), TypeError, "the left bound must be an int or None, got float"),
        (False, (True, 0), TypeError, "the left bound must be an int or None, got bool"),
        (False, 128, TypeError, "argument 'window': expected None or a pair"),
        (False, (1, 2, 3), TypeError, "argument 'window': expected None or a pair"),
        ("yes", None, TypeError, "argument 'causal': expected a bool, got str"),
        (True, (4, 2), ValueError, "causal=True means right = 0, but window gives right = 2"),
    ],
)
def test_resolve_window_rejects(causal, window, error, match):
    with pytest.raises(error, match=match):
        masks.resolve_window(causal, window, 128, 128)


def test_visible_is_bottom_right_aligned():
    # Sq = 2, Sk = 4, causal: the last query sees every key, the first all but the last.
    v = masks.visible(2, 4, *masks.resolve_window(True, None, 2, 4))
    assert v.tolist() == [[True, True, True, False], [True, True, True, True]]
    # SDPA's is_causal is top-left: row i sees j <= i. Equal only when Sq == Sk.
    top_left = torch.ones(2, 4, dtype=torch.bool).tril()
    assert not torch.equal(v, top_left)
    sq = masks.visible(4, 4, *masks.resolve_window(True, None, 4, 4))
    assert torch.equal(sq, torch.ones(4, 4, dtype=torch.bool).tril())


def _cases():
    rng = random.Random(0)
    out = []
    for Sq, Sk in [(128, 128), (1, 1000), (300, 1000), (1000, 300), (256, 256), (129, 385)]:
        for causal, window in [
            (False, None),
            (True, None),
            (False, (64, 64)),
            (True, (128, None)),
            (True, (127, None)),
            (False, (0, 0)),
            (False, (None, 5)),
        ]:
            out.append((Sq, Sk, causal, window))
    for _ in range(40):
        Sq, Sk = rng.randint(1, 700), rng.randint(1, 700)
        w = (rng.choice([None, rng.randint(0, 400)]), rng.choice([None, rng.randint(0, 400)]))
        out.append((Sq, Sk, rng.random() < 0.5 and w[1] in (None, 0), w))
    return out


@pytest.mark.parametrize("Sq, Sk, causal, window", _cases())
@pytest.mark.parametrize("bM, bN", [(128, 128), (64, 128)])
def test_tile_range_and_edges_match_the_boolean_mask(Sq, Sk, causal, window, bM, bN):
    left, right = masks.resolve_window(causal, window, Sq, Sk)
    vis = masks.visible(Sq, Sk, left, right)
    for m in range((Sq + bM - 1) // bM):
        rows = vis[m * bM : (m + 1) * bM]
        lo, hi = masks.kv_tile_range(m, Sq, Sk, left, right, bM, bN)
        seen_tiles = {j // bN for j in rows.any(0).nonzero().flatten().tolist()}
        # Exactly the tiles holding a seen key, as one contiguous range (empty when none).
        assert set(range(lo, hi)) == seen_tiles, (m, lo, hi, sorted(seen_tiles))
        for n in range(lo, hi):
            block = rows[:, n * bN : (n + 1) * bN]
            whole = block.shape[1] == bN and bool(block.all())
            # A tile the kernel leaves unmasked must be seen whole by every row; a tile it masks
            # must really have a pair that is not seen.
            assert masks.crosses_edge(m, n, Sq, Sk, left, right, bM, bN) == (not whole), (m, n)


def test_causal_tile_counts_at_8k():
    # The numbers stage 6's docstring quotes: 128 x 128 tiles, Sq = Sk = 8192.
    c = masks.tile_counts(8192, 8192, *masks.resolve_window(True, None, 8192, 8192))
    assert c == {"skipped": 2016, "partial": 64, "full": 2016, "all": 4096}
    nc = masks.tile_counts(8192, 8192, *masks.resolve_window(False, None, 8192, 8192))
    assert nc == {"skipped": 0, "partial": 0, "full": 4096, "all": 4096}


def test_reference_rows_without_keys():
    from common.tools import reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 8, dtype=torch.float64, generator=g) for n in (4, 2, 2))
    mask = masks.visible(4, 2, *masks.resolve_window(True, None, 4, 2))  # rows 0, 1 see nothing
    o, lse = reference.attention_ref(q, k, v, mask=mask)
    assert (o[0, 0, :2] == 0).all() and (lse[0, 0, :2] == float("-inf")).all()
    assert torch.isfinite(o).all() and torch.isfinite(lse[0, 0, 2:]).all()
    full, _ = reference.attention_ref(q[:, :, 3:], k, v)
    torch.testing.assert_close(o[:, :, 3:], full)


@pytest.mark.parametrize("Sq, Sk", list(itertools.product([1, 5, 128], [1, 7, 128])))
def test_unbounded_window_is_everything(Sq, Sk):
    assert masks.visible(Sq, Sk, *masks.resolve_window(False, None, Sq, Sk)).all()
