"""Pack-GQA: the query heads of one KV head share one Q tile's rows (FlashAttention's pack_gqa).

With G = H / Hkv query heads per KV head, a Q tile of bM rows normally holds bM positions of one
head. Packed, it holds bM / G positions of all G heads of a group: tile row r is position r // G
of query head kv_head * G + r % G. Every row of the tile reads the same K and V, so a decode step
(Sq = 1) fills G rows of the tile instead of one, and each K/V tile is loaded once per group
instead of once per head.

The kernels see this only as a layout: pack_heads views a (S, D, H, B) tensor as
((G, S), D, H / G, B), whose mode 0 is the packed row, (g, position), and whose mode 2 is the KV
head. TMA, local_tile and the predicated stores walk that nested mode like any other."""

import cutlass.cute as cute


def pack_heads(t, pack, head_mode):
    """(S, ..., H, ...) -> ((pack, S), ..., H / pack, ...): mode 0 becomes (g, s) with g the head
    within its group (stride: one head) and s the position; mode `head_mode` counts groups
    (stride: pack heads). pack = 1 returns t unchanged."""
    if pack == 1:
        return t
    shape, stride = list(t.shape), list(t.stride)
    shape[0], stride[0] = (pack, shape[0]), (stride[head_mode], stride[0])
    shape[head_mode], stride[head_mode] = shape[head_mode] // pack, stride[head_mode] * pack
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


def choose_pack(H, Hkv, max_seqlen_q, tile_rows=128, pack_gqa=None):
    """How many query heads share a Q tile: G = H / Hkv or 1. pack_gqa=None decides by tile use
    (FlashAttention-3's rule): pack when the unpacked tiles' share of real rows,
    Sq / round_up(Sq, bM), is below 0.9 of the packed tiles', G Sq / round_up(G Sq, bM): always
    for Sq short against a tile (decode steps), and for longer Sq whose last tile is mostly empty
    (G = 4: Sq = 1-96, 129-224, 257-320, ...), never when Sq fills whole tiles. True / False force it; packing needs
    G to divide the tile's rows."""
    group = H // Hkv
    fits = group > 1 and tile_rows % group == 0
    if pack_gqa is not None:
        if not isinstance(pack_gqa, bool):
            raise TypeError(
                f"argument 'pack_gqa': expected a bool or None, got {type(pack_gqa).__name__}"
            )
        if pack_gqa and not fits:
            raise ValueError(
                f"argument 'pack_gqa': packing needs H / Hkv > 1 dividing the tile's "
                f"{tile_rows} rows, got H / Hkv = {H} / {Hkv}"
            )
        return group if pack_gqa else 1
    if not fits or max_seqlen_q == 0:
        return 1

    def used(rows):
        return rows / (-(-rows // tile_rows) * tile_rows)

    return group if used(max_seqlen_q) < 0.9 * used(group * max_seqlen_q) else 1
