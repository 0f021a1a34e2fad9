"""Masks of stage 6 on the host: the convention, the argument checks, and the pure-Python twins
of the kernel's tile range and edge test (tested on the CPU against the boolean mask).

Convention (FlashAttention's, bottom-right aligned): query row i sees key j when

    i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right,   0 <= j < Sk,

with window = (left, right), None on a side for unbounded, and causal=True meaning right = 0.
In terms of the diagonal offset d = j - i: band_lo <= d <= band_hi with band_lo = Sk - Sq - left
and band_hi = Sk - Sq + right. With Sq == Sk, causal is SDPA's is_causal=True; with Sq != Sk,
SDPA aligns the mask top-left (row i sees j <= i) and the two differ.

An unbounded side is stored as the bound that already admits every key (left = Sk, right = Sq),
and larger bounds are clamped to those, so the kernel takes two plain int32 values and one
compiled kernel serves every mask."""

import torch


def check_mask_args(causal, window):
    """Raises with the argument's name unless causal is a bool and window is None or a pair of
    non-negative ints or None (and, with causal=True, its right bound None or 0). Needs no
    tensor, so the entry points call it before anything else."""
    resolve_window(causal, window, 1, 1)


def resolve_window(causal, window, Sq, Sk):
    """(left, right) for the kernel from the user's causal and window: non-negative ints, left
    <= Sk and right <= Sq (unbounded sides and larger bounds become exactly those). Raises with
    the argument's name on bad values."""
    if not isinstance(causal, bool):
        raise TypeError(f"argument 'causal': expected a bool, got {type(causal).__name__}")
    if window is None:
        left, right = None, None
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(
                f"argument 'window': expected None or a pair (left, right) of ints or None, "
                f"got {window!r}"
            )
        left, right = window
        for side, value in (("left", left), ("right", right)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"argument 'window': the {side} bound must be an int or None, got "
                    f"{type(value).__name__} {value!r}"
                )
            if value < 0:
                raise ValueError(
                    f"argument 'window': the {side} bound must be >= 0 (keys it reaches on that "
                    f"side of the diagonal), got {value}"
                )
    if causal:
        if right not in (None, 0):
            raise ValueError(
                f"arguments 'causal' and 'window': causal=True means right = 0, but window "
                f"gives right = {right}; pass window=(left, None) or causal=False"
            )
        right = 0
    left = Sk if left is None else min(left, Sk)
    right = Sq if right is None else min(right, Sq)
    return left, right


def visible(Sq, Sk, left, right, device="cpu"):
    """The boolean mask (Sq, Sk): True where query row i sees key j."""
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)[None, :]
    d = j - i
    return (d >= Sk - Sq - left) & (d <= Sk - Sq + right)


def kv_tile_range(q_tile, Sq, Sk, left, right, bM=128, bN=128):
    """[lo, hi): the KV tiles holding a key some row of Q tile q_tile sees (hi == lo: none). The
    kernels' kv_tile_range (Sm90Kernel's and Sm100Kernel's) computes the same, with the same
    formulas."""
    band_lo, band_hi = Sk - Sq - left, Sk - Sq + right
    first_row = q_tile * bM
    last_row = min(first_row + bM, Sq) - 1
    first_key = max(first_row + band_lo, 0)
    end_key = max(min(last_row + band_hi + 1, Sk), 0)
    lo = first_key // bN
    hi = max((end_key + bN - 1) // bN, lo)
    return lo, hi


def crosses_edge(q_tile, kv_tile, Sq, Sk, left, right, bM=128, bN=128):
    """Whether tile (q_tile, kv_tile) holds a key some row of the Q tile must not see (beyond Sk,
    right of the band or left of it): only such tiles get the element mask."""
    band_lo, band_hi = Sk - Sq - left, Sk - Sq + right
    first_row = q_tile * bM
    last_row = min(first_row + bM, Sq) - 1
    first_key, last_key = kv_tile * bN, kv_tile * bN + bN - 1
    return last_key >= Sk or last_key - first_row > band_hi or first_key - last_row < band_lo


SKIPPED, PARTIAL, FULL = 0, 1, 2


def tile_map(Sq, Sk, left, right, bM=128, bN=128):
    """(Q tiles, KV tiles) int tensor: SKIPPED (neither loaded nor multiplied), PARTIAL (loaded,
    element mask applied) or FULL (the stage 5 loop body, no mask), as the kernel decides."""
    q_tiles, kv_tiles = -(-Sq // bM), -(-Sk // bN)
    out = torch.full((q_tiles, kv_tiles), SKIPPED, dtype=torch.int8)
    for m in range(q_tiles):
        lo, hi = kv_tile_range(m, Sq, Sk, left, right, bM, bN)
        for n in range(lo, hi):
            out[m, n] = PARTIAL if crosses_edge(m, n, Sq, Sk, left, right, bM, bN) else FULL
    return out


def tile_counts(Sq, Sk, left, right, bM=128, bN=128):
    """{'skipped', 'partial', 'full', 'all'}: how many (Q tile, KV tile) pairs fall in each class."""
    t = tile_map(Sq, Sk, left, right, bM, bN)
    return {
        "skipped": int((t == SKIPPED).sum()),
        "partial": int((t == PARTIAL).sum()),
        "full": int((t == FULL).sum()),
        "all": t.numel(),
    }


def visible_pairs(Sq, Sk, left, right):
    """The number of (query, key) pairs that are seen: the FLOPs that the mask keeps, over
    4 D per pair."""
    return int(visible(Sq, Sk, left, right).sum())
