"""CuTe layouts evaluated in plain Python, for the register and shared-memory pictures of notebooks 1
and 3 (tests/test_notebooks.py checks them against cute's own atoms):
  - wgmma_c_coords / wgmma_a_coords: the register fragments of wgmma m64nNk16, from their
    thread-value layouts;
  - swizzle: CuTe's Swizzle<B, M, S> on byte addresses (S<3,4,3> is TMA's 128-byte swizzle).
"""

import math


def _flat(t):
    if isinstance(t, (tuple, list)):
        out = []
        for x in t:
            out.extend(_flat(x))
        return out
    return [t]


def layout_eval(shape, stride, index):
    """Offset of a 1-D index under a (nested) CuTe layout shape:stride, column-major
    (colexicographic: the leftmost mode varies fastest), as cute evaluates it."""
    off = 0
    for size, st in zip(_flat(shape), _flat(stride)):
        off += (index % size) * st
        index //= size
    return off


def layout_str(shape, stride):
    """The layout printed the way cute prints it, e.g. '((4,8,4),(2,2,16)):((128,1,16),(64,8,512))'."""

    def f(t):
        return "(" + ",".join(f(x) for x in t) + ")" if isinstance(t, (tuple, list)) else str(t)

    return f"{f(shape)}:{f(stride)}"


def wgmma_c_tv(n):
    """Thread-value layout of the fp32 accumulator of wgmma m64nNk16 over a 64 x N tile stored
    column-major (offset = row + 64 * col). Thread t = t0 + 4 t1 + 32 w (t0 = lane % 4,
    t1 = lane // 4, w = warp of the warpgroup); value v = v0 + 2 v1 + 4 i.
    Row = 16 w + t1 + 8 v1, col = 2 t0 + v0 + 8 i: each row is spread over the 4 threads of a quad."""
    return ((4, 8, 4), (2, 2, n // 8)), ((128, 1, 16), (64, 8, 512))


def wgmma_a_rs_tv():
    """Thread-value layout of a register-sourced A operand (bf16/fp16) of wgmma m64nNk16 over a
    64 x 16 tile (offset = row + 64 * k): the same pattern as the accumulator's first 16 columns."""
    return ((4, 8, 4), (2, 2, 2)), ((128, 1, 16), (64, 8, 512))


def _tv_coords(tv, thread, m=64):
    (ts, vs), (tst, vst) = tv
    base = layout_eval(ts, tst, thread)
    nv = math.prod(_flat(vs))
    out = []
    for v in range(nv):
        off = base + layout_eval(vs, vst, v)
        out.append((v, off % m, off // m))
    return out


def wgmma_c_coords(thread, n):
    """[(register index, row, col)] of the 64 x n accumulator held by `thread` (0..127) of the
    warpgroup. Register v is d{v} in the PTX ISA's wgmma fragment figures."""
    return _tv_coords(wgmma_c_tv(n), thread)


def wgmma_a_coords(thread):
    """[(value index, row, k)] of a 64 x 16 register A operand held by `thread` (0..127)."""
    return _tv_coords(wgmma_a_rs_tv(), thread)


def swizzle(offset, bits=3, base=4, shift=3):
    """CuTe's Swizzle<B, M, S>: XOR the B bits at [M + S, M + S + B) into the bits at [M, M + B).
    Applied to byte addresses, Swizzle<3,4,3> is TMA's and wgmma's 128-byte swizzle: the 16-byte
    chunk index (address bits 4-6) is XORed with the row index mod 8 (bits 7-9)."""
    mask = ((1 << bits) - 1) << (base + shift)
    return offset ^ ((offset & mask) >> shift)


def swizzle_128b_chunk(row, chunk):
    """Where logical 16-byte chunk `chunk` (0..7) of 128-byte row `row` lands: chunk ^ (row % 8)."""
    return (swizzle(row * 128 + chunk * 16) % 128) // 16
