"""The host side of stages 7-12 on both tracks: one copy of the argument checks, the views
that give packed sequences the kernels' (B, H, S, D) shape, the pack-GQA choice, the compile cache
and the launch. Each stage file keeps its kernel class and its documented entry points, which pass
the class here: `attention(Sm90Kernel, q, k, v, ...)`. The launch goes through TVM-FFI (the torch
tensors passed as they are; common/compile.py, cached_compile_ffi). The kernel class is built as
kernel_class(cutlass dtype, D, pack, **options) - options from its `launch_options` for the
launch's sizes and mask where it has one (Hopper stage 12; kernel_options), none otherwise - and
called with (q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale_log2, window_left,
window_right, stream); a kernel object with `uses_tile_counter` (Hopper stages 11-12: the dynamic tile
scheduler) takes one more tensor before the stream, tile_counter (one int32, zero at each call where the kernel reads it)."""

import math

import torch

from common import checks, masks
from common.compile import cached_compile_ffi
from common.cute_interop import canonical_strides, cute_dtype, fake_stream, fake_tensor
from common.outputs import empty_output
from common.pack_gqa import choose_pack


def tile_rows(kernel_class, dtype, D, kernel=None):
    """Query rows per Q tile of a kernel class at head dim D: its kernel object's `tile_rows`
    (Hopper stage 12: 192 at D = 64 with its default options, 128 under a short mask), 128 where
    it has none. Pack-GQA needs G to divide them.
    (Building the object compiles nothing; `kernel`: an object of the class built with pack 1,
    to read instead of building one.)"""
    kernel = kernel if kernel is not None else kernel_class(cute_dtype(dtype), D, 1)
    return getattr(kernel, "tile_rows", 128)


def kernel_options(kernel_class, D, window_left, window_right, Sq, Sk, group, packed):
    """Keyword options for kernel_class(dtype, D, pack, ...) at one launch's head dim, resolved
    window, lengths (packed: the longest) and G = H / Hkv: the class's `launch_options` (Hopper
    stage 12: two consumer warpgroups at D = 64 under a short mask), {} where it has none. They
    become attributes of the kernel object, so the compile cache keys on them."""
    options = getattr(kernel_class, "launch_options", None)
    return options(D, window_left, window_right, Sq, Sk, group, packed) if options else {}


def compile_args(kernel_class, dtype, shape, scale=None, **options):
    """(kernel, args) for cute.compile with fake tensors, shape = (B, H, Sq, Sk, D); options
    causal, window, kv_heads (Hkv, default H), varlen (True: packed sequences, B of them,
    through cu_seqlens; the tensors are then (1, H, B * S, D) views) and pack_gqa (None, True,
    False: as attention's)."""
    checks.check_options(options, allowed=("causal", "window", "kv_heads", "varlen", "pack_gqa"))
    B, H, Sq, Sk, D = shape
    Hkv = options.get("kv_heads", H)
    varlen = options.get("varlen", False)
    window_left, window_right = masks.resolve_window(
        options.get("causal", False), options.get("window"), Sq, Sk
    )
    q, o = (fake_tensor(dtype, (B, H, Sq, D), dynamic=True) for _ in range(2))
    k, v = (fake_tensor(dtype, (B, Hkv, Sk, D), dynamic=True) for _ in range(2))
    lse = fake_tensor(torch.float32, (B, H, Sq), dynamic=True)
    cu_q = cu_k = None
    if varlen:
        cu_q, cu_k = (fake_tensor(torch.int32, (B + 1,), dynamic=True) for _ in range(2))
    opts = kernel_options(kernel_class, D, window_left, window_right, Sq, Sk, H // Hkv, varlen)
    rows = tile_rows(kernel_class, dtype, D, kernel_class(cute_dtype(dtype), D, 1, **opts))
    pack = choose_pack(H, Hkv, Sq, rows, options.get("pack_gqa"))
    kernel = kernel_class(cute_dtype(dtype), D, pack, **opts)
    args = [q, k, v, o, lse, cu_q, cu_k, Sq, checks.check_scale(scale, D) * math.log2(math.e)]
    args += [window_left, window_right]
    if getattr(kernel, "uses_tile_counter", False):
        args.append(fake_tensor(torch.int32, (1,), dynamic=True))
    return kernel, (*args, fake_stream())


def launch(
    kernel_class,
    q,
    k,
    v,
    o,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    scale,
    causal,
    window,
    max_seqlen_k,
    pack=None,
):
    """Both entries: (B, H, S, D)-shaped views (packed sequences as B = 1), launch."""
    D = q.shape[3]
    window_left, window_right = masks.resolve_window(causal, window, max_seqlen_q, max_seqlen_k)
    # exp(scale * x) = exp2(scale_log2 * x): the kernel takes the folded multiplier.
    scale_log2 = scale * math.log2(math.e)
    with torch.cuda.device(q.device):
        # Kernel objects read the current device (Hopper stages 11-12: the SM count), so they are
        # built here; the one built for the tile rows serves unpacked launches (the common case).
        # Options for this launch's sizes and mask (Hopper stage 12: the consumer warpgroups at
        # D = 64), the same in the unpacked and the packed object.
        H, Hkv = q.shape[1], k.shape[1]
        packed = cu_seqlens_q is not None
        opts = kernel_options(
            kernel_class, D, window_left, window_right, max_seqlen_q, max_seqlen_k, H // Hkv, packed
        )
        unpacked = kernel_class(cute_dtype(q.dtype), D, 1, **opts)
        rows = tile_rows(kernel_class, q.dtype, D, unpacked)
        pack = choose_pack(H, Hkv, max_seqlen_q, rows, pack)
        kernel = unpacked if pack == 1 else kernel_class(cute_dtype(q.dtype), D, pack, **opts)
        # Dynamic shapes and strides: one compile per (dtype, D, batch or packed, kernel
        # options) serves every shape and head count. The torch tensors go to the compiled
        # function as they are (TVM-FFI, common/compile.py), on the current stream; size-1 modes
        # get canonical strides.
        args = [canonical_strides(t.detach()) for t in (q, k, v, o, lse)]
        args += [cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale_log2, window_left, window_right]
        if getattr(kernel, "uses_tile_counter", False):
            batch_mode = cu_seqlens_q is None
            args.append(
                tile_counter(
                    batch_mode, window_left, window_right, max_seqlen_q, max_seqlen_k, q.device
                )
            )
        cached_compile_ffi(kernel, *args)(*args)


def tile_counter(batch_mode, window_left, window_right, Sq, Sk, device):
    """The counter a dynamic tile scheduler draws tickets from (Hopper stages 11-12): zero when the
    kernel reads it - packed sequences, and batch mode under a causal or window cut (left < Sk
    or right < Sq, the kernel's own test) - and left unset otherwise (no fill kernel where none
    is needed)."""
    if not batch_mode or window_left < Sk or window_right < Sq:
        return torch.zeros(1, dtype=torch.int32, device=device)
    return torch.empty(1, dtype=torch.int32, device=device)


def attention(
    kernel_class, q, k, v, scale=None, causal=False, window=None, return_lse=False, pack_gqa=None
):
    """Batch mode (stage 7's attention): checks, outputs (poisoned under test), launch."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"argument 'return_lse': expected a bool, got {type(return_lse).__name__}")
    masks.check_mask_args(causal, window)
    B, H, Sq, Sk, D = checks.check_attention_args(q, k, v, kv_heads=True)
    scale = checks.check_scale(scale, D)
    o = empty_output((B, H, Sq, D), q.dtype, q.device)
    lse = empty_output((B, H, Sq), torch.float32, q.device)
    launch(kernel_class, q, k, v, o, lse, None, None, Sq, scale, causal, window, Sk, pack_gqa)
    return (o, lse) if return_lse else o


def attention_varlen(
    kernel_class,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    scale=None,
    causal=False,
    window=None,
    return_lse=False,
    pack_gqa=None,
):
    """Packed sequences (stage 7's attention_varlen): checks (cu_seqlens read to the host once
    per pair, common/checks.py), outputs, the (1, H, total, D) views, launch."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"argument 'return_lse': expected a bool, got {type(return_lse).__name__}")
    masks.check_mask_args(causal, window)
    total_q, H, D = checks.check_varlen_args(q, k, v)
    choose_pack(
        H, k.shape[1], 1, tile_rows(kernel_class, q.dtype, D), pack_gqa
    )  # checked, also when empty
    max_seqlen_q, max_seqlen_k = checks.check_cu_seqlens(
        q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    scale = checks.check_scale(scale, D)
    o = empty_output((total_q, H, D), q.dtype, q.device)
    lse = empty_output((H, total_q), torch.float32, q.device)
    if total_q == 0 or k.shape[0] == 0:
        # No query, or no key for any query (TMA cannot describe an empty tensor): every row
        # sees nothing.
        o.zero_()
        lse.fill_(float("-inf"))
        return (o, lse) if return_lse else o
    # (total, H, D) -> (1, H, total, D): the kernel's (B, H, S, D) with one packed batch entry.
    as_bhsd = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    launch(
        kernel_class,
        as_bhsd(q),
        as_bhsd(k),
        as_bhsd(v),
        as_bhsd(o),
        lse.unsqueeze(0),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        scale,
        causal,
        window,
        max_seqlen_k,
        pack_gqa,
    )
    return (o, lse) if return_lse else o
