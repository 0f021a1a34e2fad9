"""The host side of stages 7-14 on both tracks: one copy of the argument checks, the views
that give packed sequences the kernels' (B, H, S, D) shape, the pack-GQA choice, the compile cache
and the launch. Each stage file keeps its kernel class and its documented entry points, which pass
the class here: `attention(Sm90Kernel, q, k, v, ...)`. The launch goes through TVM-FFI (the torch
tensors passed as they are; common/compile.py, cached_compile_ffi). The kernel class is built as
kernel_class(cutlass dtype, D, pack, **options) - options from its `launch_options` for the
launch's sizes and mask where it has one (Hopper stages 12-14; kernel_options), none otherwise -
and called with (q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale_log2,
window_left, window_right, stream); a kernel object with `uses_tile_counter` (stages 11 on: the
dynamic tile scheduler) takes one more tensor before the stream, tile_counter (one int32, zero
at each call where the kernel reads it). A kernel class with `takes_splits` (stage 13 on:
split-KV) also takes seqused_k (or None) and num_splits; with more than one split it is built
with split_kv=True, writes fp32 partial outputs with a leading split mode, and
common/combine.py merges them into O and LSE. One with `takes_pages` (stage 14) takes
page_table after those (the stream stays last)."""

import contextlib
import math

import torch

from common import checks, masks
from common import compile as compile_cache
from common.arch import device_sm_count
from common.combine import Combine, SplitLaunch, partial_offsets
from common.compile import cached_compile_ffi
from common.cute_interop import (
    canonical_strides,
    cute_dtype,
    fake_stream,
    fake_tensor,
    output_layout,
)
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
    False: as attention's); for a class with takes_splits also num_splits (default 1; more:
    the split_kv kernel) and seqused_k (True: with the seqused_k tensor); with more than one
    split, split_launch=True gives the whole launch as a call compiles it (a SplitLaunch: the split
    kernel, then the combine, on O, LSE and the partials' buffer; return_lse=False: LSE in that
    buffer)."""
    allowed = ("causal", "window", "kv_heads", "varlen", "pack_gqa")
    if getattr(kernel_class, "takes_splits", False):
        allowed += ("num_splits", "seqused_k", "split_launch", "return_lse")
    if getattr(kernel_class, "takes_pages", False):
        allowed += ("page_size",)
    checks.check_options(options, allowed=allowed)
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
    seqused = options.get("seqused_k", False) or bool(options.get("page_size"))
    opts = kernel_options(
        kernel_class, D, window_left, window_right, Sq, Sk, H // Hkv, varlen or seqused
    )
    rows = tile_rows(kernel_class, dtype, D, kernel_class(cute_dtype(dtype), D, 1, **opts))
    pack = choose_pack(H, Hkv, Sq, rows, options.get("pack_gqa"))
    splits = options.get("num_splits", 1)
    split_launch = splits > 1 and options.get("split_launch", False)
    if splits > 1:
        opts["split_kv"] = True
    if split_launch:
        elements = partials_layout(splits, (B, H, Sq, D), (B, H, Sq))[0]
        buffer = fake_tensor(torch.float32, (elements,), dynamic=True)
        lse = lse if options.get("return_lse", True) else None
    elif splits > 1:
        o = fake_tensor(torch.float32, (splits, B, H, Sq, D), dynamic=True)
        lse = fake_tensor(torch.float32, (splits, B, H, Sq), dynamic=True)
    page_size = options.get("page_size")
    if page_size:
        # A paged cache: (num_pages, page_size, Hkv, D) with seqused_k and a page table
        opts["page_size"] = page_size
        k, v = (fake_tensor(dtype, (B * 8, page_size, Hkv, D), dynamic=True) for _ in range(2))
    kernel = kernel_class(cute_dtype(dtype), D, pack, **opts)
    args = [q, k, v, o, lse] + ([buffer] if split_launch else [])
    args += [cu_q, cu_k, Sq, checks.check_scale(scale, D) * math.log2(math.e)]
    args += [window_left, window_right]
    if getattr(kernel, "uses_tile_counter", False):
        args.append(fake_tensor(torch.int32, (1,), dynamic=True))
    if getattr(kernel, "takes_splits", False):
        args += [fake_tensor(torch.int32, (B,), dynamic=True) if seqused else None, splits]
    if getattr(kernel, "takes_pages", False):
        args.append(fake_tensor(torch.int32, (B, 64), dynamic=True) if page_size else None)
    elif split_launch:
        args.append(None)  # SplitLaunch's page_table
    if split_launch:
        kernel = SplitLaunch(kernel, Combine(cute_dtype(dtype), D, Combine.lanes_for(splits, D)))
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
    seqused_k=None,
    num_splits=None,
    page_table=None,
):
    """Both entries: (B, H, S, D)-shaped views (packed sequences as B = 1; a paged cache as
    (num_pages, page_size, Hkv, D) as the caller holds it, with page_table, stage 14 on), launch. Split-KV
    (kernel classes with takes_splits): num_splits (None: splits_for's choice), the partial
    outputs, then the combine.

    Everything decided from the launch's types, shapes and options - the kernel object, its
    compiled function, pack-GQA, the split count, the mask bounds - is a LaunchPlan, made once
    per plan_key and kept: a later call with the same key only allocates and launches (host
    work per call: docs/notes/stage13.md)."""
    seqused_k = one_entry_unit_stride(seqused_k)
    key = plan_key(
        kernel_class, q, k, v, o, lse, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
        causal, window, pack, num_splits, page_table,
    )  # fmt: skip
    plan = _PLANS.get(key)
    device = q.device
    switch = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if switch else contextlib.nullcontext():
        if plan is None:
            plan = make_plan(
                kernel_class, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, causal, window, pack, seqused_k, num_splits, page_table,
            )  # fmt: skip
            checks.remember(_PLANS, _PLANS_KEEP, key, plan)
        plan.run(
            q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, seqused_k, page_table
        )
    return plan


_PLANS = {}
_PLANS_KEEP = 256
compile_cache.CLEAR_WITH_CACHE.append(_PLANS.clear)


def plan_key(
    kernel_class, q, k, v, o, lse, cu_q, seqused_k, max_seqlen_q, max_seqlen_k, causal, window,
    pack, num_splits, page_table=None,
):  # fmt: skip
    """What a LaunchPlan depends on: the kernel class, the tensors' dtype, device, shapes and
    strides (the compiled code's assumptions follow from them, common/compile.py), packed or
    not (and how many sequences), seqused_k given or not, the longest lengths, the mask and
    the options. pack_gqa goes in with its type: 1 is an equal key to True, and only make_plan
    checks it (a bool or None), so a plan made for True must not take 1 past that check."""
    return (
        kernel_class,
        q.dtype,
        q.device,
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        o.stride(),
        lse.stride(),
        None if cu_q is None else cu_q.shape[0],
        seqused_k is None,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        window if window is None else tuple(window),
        (type(pack), pack),
        num_splits,
        None if page_table is None else (page_table.shape, page_table.stride()),
    )


class LaunchPlan:
    """One launch configuration, decided once: `fn` the compiled kernel (TVM-FFI), the mask
    bounds, the split count, the canonical strides of the inputs that need them, the tile counter (None: the
    kernel takes none; else tile_counter's arguments: a fresh zeroed one per call where the
    dynamic scheduler reads it, the device's unread one otherwise). A split launch's `fn` is a
    compiled SplitLaunch (common/combine.py): the split kernel and the combine in one call."""

    def __init__(
        self, fn, window, splits, strides, counter, takes_splits, launcher, partials,
        takes_pages=False, outputs=None,
    ):  # fmt: skip
        self.fn = fn
        self.window_left, self.window_right = window
        self.splits = splits
        # strides, per input (q, k, v, O, LSE): None (passed as it is) or the strides
        # canonical_strides gives it. A plan serves only tensors of the strides it was made for
        # (plan_key), so the views are worked out once, here, as (index, stride) pairs of the
        # inputs that take one, not at every call.
        self.viewed = tuple((i, st) for i, st in enumerate(strides) if st is not None)
        self.counter = counter
        self.takes_splits = takes_splits
        self.takes_pages = takes_pages
        # Split launches: partials_layout's (elements, then the views' (shape, stride, offset)),
        # and the SplitLaunch whose compiled function `fn` is, for a call that returns its LSE;
        # the one for a call that does not (the combine writes its LSE into the buffer) is
        # compiled at the first such call.
        self.partials = partials
        self.launcher = launcher
        self.fn_lse_in_buffer = None
        # Per device, the scratch LSE of an unsplit call that returns none (scratch_output).
        self.scratch_lse = {}
        # output_layout of O and of LSE (for outputs: batch mode and paged caches)
        self.o_layout, self.lse_layout = outputs or (None, None)

    def outputs(self, dtype, device, return_lse):
        """A call's O and LSE, and the fp32 buffer of its split partials (None: no split).
        A split launch whose LSE the caller does not take has it in that buffer, ahead of the
        partials (LSE None here: the compiled launch makes the view): two allocations per call
        instead of three. An LSE that is returned gets its own (a view would keep the whole
        buffer alive with it: splits x B x H x Sq x (D + 1) x 4 bytes, 258 KiB at the decode
        step of stage 13's docstring, for 128 bytes of LSE). An unsplit call's LSE that is not
        returned goes to the device's scratch (scratch_output), one view per plan."""
        o = new_output(self.o_layout, dtype, device)
        if return_lse:
            return o, new_output(self.lse_layout, torch.float32, device), None
        if self.splits == 1:
            lse = self.scratch_lse.get(device)
            if lse is None:
                lse = self.scratch_lse[device] = scratch_output(self.lse_layout, device)
            return o, lse, None
        return o, None, empty_output((self.partials[0],), torch.float32, device)

    def run(
        self, q, k, v, o, lse, cu_q, cu_k, max_seqlen_q, scale, seqused_k, page_table=None,
        buffer=None,
    ):  # fmt: skip
        """Allocate what the call needs (split partials unless `buffer` holds them, a zeroed tile
        counter) and launch, on the current stream. lse None: a split call that returns no LSE
        (outputs)."""
        args = [q, k, v, o, lse]
        # A tensor autograd tracks cannot be handed over (DLPack); the kernel only reads q, k,
        # v and writes outputs made without a graph.
        if q.requires_grad or k.requires_grad or v.requires_grad:
            args[:3] = [t.detach() for t in args[:3]]
        for i, stride in self.viewed:
            if args[i] is not None:
                args[i] = args[i].as_strided(args[i].shape, stride)
        if self.splits > 1:
            if buffer is None:
                buffer = empty_output((self.partials[0],), torch.float32, q.device)
            args.append(buffer)
        # exp(scale * x) = exp2(scale_log2 * x): the kernel takes the folded multiplier.
        args += [cu_q, cu_k, max_seqlen_q, scale * LOG2_E, self.window_left, self.window_right]
        if self.counter is not None:
            args.append(tile_counter(*self.counter, q.device))
        if self.takes_splits:
            args += [seqused_k, self.splits]
        if self.takes_pages:
            args.append(page_table)
        elif self.splits > 1:
            args.append(None)  # SplitLaunch's page_table
        fn = self.fn
        if lse is None:
            fn = self.fn_lse_in_buffer
            if fn is None:
                fn = self.fn_lse_in_buffer = cached_compile_ffi(self.launcher, *args)
        fn(*args)


def new_output(layout, dtype, device):
    """An output of output_layout's (shape, stride)."""
    return empty_output(layout[0], dtype, device, stride=layout[1])


_SCRATCH = {}


def scratch_output(layout, device):
    """An fp32 (shape, stride) view for a kernel to write and nobody to read (the LSE of an
    unsplit call that returns none): a view of the device's scratch buffer, one allocation less
    per call (its host time: docs/notes/stage13.md). The buffers are never freed: a CUDA graph
    that captured a call holds the address. A larger layout gets a buffer twice the
    size of the last one (or its own size, if larger), and the views made before keep theirs.
    Two launches on two streams may write the same elements; no launch reads them."""
    shape, stride = layout
    size = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
    kept = _SCRATCH.setdefault(device, [])
    if not kept or kept[-1].numel() < size:
        grown = max(size, 2 * kept[-1].numel() if kept else 4096)
        kept.append(torch.empty(grown, dtype=torch.float32, device=device))
    return kept[-1].as_strided(shape, stride)


LOG2_E = math.log2(math.e)
_UNREAD_COUNTERS = {}


def unread_counter(device):
    """The tile-counter argument of a launch whose kernel never reads it (batch mode, no mask
    cut: the fixed share), one per device."""
    t = _UNREAD_COUNTERS.get(device)
    if t is None:
        t = _UNREAD_COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


def reads_tile_counter(batch_mode, window_left, window_right, Sq, Sk):
    """Whether a kernel with a dynamic tile scheduler (Hopper stages 11 on) draws from the tile
    counter: packed sequences, and batch mode under a causal or window cut (left < Sk or
    right < Sq, the kernel's own test)."""
    return not batch_mode or window_left < Sk or window_right < Sq


def tile_counter(batch_mode, window_left, window_right, Sq, Sk, device):
    """The counter a launch passes: zero where the kernel reads it (reads_tile_counter), the
    device's unread one otherwise (no fill kernel where none is needed)."""
    if reads_tile_counter(batch_mode, window_left, window_right, Sq, Sk):
        return torch.zeros(1, dtype=torch.int32, device=device)
    return unread_counter(device)


def make_plan(
    kernel_class, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    causal, window, pack, seqused_k, num_splits, page_table=None,
):  # fmt: skip
    """The LaunchPlan of a launch (see launch), compiling what it needs."""
    D = q.shape[3]
    window_left, window_right = masks.resolve_window(causal, window, max_seqlen_q, max_seqlen_k)
    # A bound that cuts no row is written as none: a left bound of at least Sk - 1 lets the
    # last row see key 0 (and every row before it too), a right bound of at least Sq - 1 lets
    # row 0 see key Sk - 1 (packed: of the longest sequences, which covers every shorter one).
    # Sq = 1 under causal is then no mask at all: no tile scheduler, and only a KV tile that
    # reaches past Sk masks (its keys beyond Sk), as without causal.
    if window_left >= max_seqlen_k - 1:
        window_left = max_seqlen_k
    if window_right >= max_seqlen_q - 1:
        window_right = max_seqlen_q
    # Kernel objects read the current device (Hopper stages 11 on: the SM count), so they are
    # built here; the one built for the tile rows serves unpacked launches (the common case).
    # Options for this launch's sizes and mask (Hopper stage 12 on: the consumer warpgroups at
    # D = 64), the same in the unpacked and the packed object.
    # k: (B, Hkv, Sk, D), or a paged cache (num_pages, page_size, Hkv, D)
    H, Hkv = q.shape[1], k.shape[1] if page_table is None else k.shape[2]
    packed = cu_seqlens_q is not None
    # Per-sequence key counts (packed, seqused_k): no mask-free kernel (launch_options).
    opts = kernel_options(
        kernel_class,
        D,
        window_left,
        window_right,
        max_seqlen_q,
        max_seqlen_k,
        H // Hkv,
        packed or seqused_k is not None,
    )
    unpacked = kernel_class(cute_dtype(q.dtype), D, 1, **opts)
    rows = tile_rows(kernel_class, q.dtype, D, unpacked)
    pack = choose_pack(H, Hkv, max_seqlen_q, rows, pack)
    splits = 1
    takes_splits = getattr(kernel_class, "takes_splits", False)
    if takes_splits:
        sequences = q.shape[0] if not packed else cu_seqlens_q.shape[0] - 1
        # A work tile's query rows: Blackwell's CTA takes two Q tiles (cta_rows = 256).
        work_rows = getattr(unpacked, "cta_rows", rows)
        tiles = -(-max_seqlen_q * pack // work_rows) * (H // pack) * sequences
        splits = num_splits or splits_for(tiles, -(-max_seqlen_k // 128), device_sm_count())
    if splits > 1:
        opts = {**opts, "split_kv": True}
    takes_pages = getattr(kernel_class, "takes_pages", False)
    if page_table is not None:
        opts = {**opts, "page_size": k.shape[1]}
    if pack == 1 and splits == 1 and page_table is None:
        kernel = unpacked
    else:
        kernel = kernel_class(cute_dtype(q.dtype), D, pack, **opts)
    # Dynamic shapes and strides: one compile per (dtype, D, batch or packed, kernel options)
    # serves every shape and head count. The torch tensors go to the compiled function as they
    # are (TVM-FFI, common/compile.py), on the current stream; size-1 modes get canonical
    # strides. Split-KV: a SplitLaunch, the split kernel writing each split's O and LSE in fp32
    # into one flat buffer (partials_layout), then the combine, in one compiled function.
    tensors = [t.detach() for t in (q, k, v, o, lse)]
    args = [canonical_strides(t) for t in tensors]
    strides = tuple(None if a is t else a.stride() for a, t in zip(args, tensors))
    launcher = partials = None
    if splits > 1:
        partials = partials_layout(splits, tuple(o.shape), tuple(lse.shape))
        args.append(torch.empty(partials[0], dtype=torch.float32, device=q.device))
        combine = Combine(cute_dtype(q.dtype), D, Combine.lanes_for(splits, D))
        launcher = SplitLaunch(kernel, combine)
    args += [cu_seqlens_q, cu_seqlens_k, max_seqlen_q, 1.0, window_left, window_right]
    counter = None
    if getattr(kernel, "uses_tile_counter", False):
        # Zeroed where the kernel reads it (its dynamic scheduler): packed sequences, and batch
        # mode under a causal or window cut (left < Sk or right < Sq, the kernel's own test).
        # (batch mode, left, right, Sq, Sk) for tile_counter at each call
        counter = (not packed, window_left, window_right, max_seqlen_q, max_seqlen_k)
        args.append(torch.zeros(1, dtype=torch.int32, device=q.device))
    if takes_splits:
        args += [seqused_k, splits]
    if takes_pages:
        args.append(page_table)
    elif splits > 1:
        args.append(None)  # SplitLaunch's page_table
    fn = cached_compile_ffi(launcher or kernel, *args)
    return LaunchPlan(
        fn,
        (window_left, window_right),
        splits,
        strides,
        counter,
        takes_splits,
        launcher,
        partials,
        takes_pages,
        (output_layout(tuple(o.shape)), output_layout(tuple(lse.shape))),
    )


def partials_layout(splits, o_shape, lse_shape):
    """A split launch's fp32 buffer: (elements, then (shape, stride, offset) of O_partial
    (splits, *O's shape), of LSE_partial (splits, *LSE's shape) and of LSE), offsets as
    common/combine.py's partial_offsets, where SplitLaunch makes the same views at compile time
    (this is their statement in torch's terms, for tests and for reading). LSE, for a call that
    returns none, comes first at offset 0; the partials follow at the next 256 bytes (the kernel
    and the combine take their tensors at least 16-byte aligned)."""
    rows, D = math.prod(lse_shape), o_shape[-1]
    o_at, lse_at, elements = partial_offsets(splits, rows, D)
    return (
        elements,
        (*output_layout((splits, *o_shape)), o_at),
        (*output_layout((splits, *lse_shape)), lse_at),
        (*output_layout(lse_shape), 0),
    )


# splits_for: no split once the work tiles fill this share of the SMs (one wave is then mostly
# full already; a split only adds partial outputs and the combine), nor of a KV range of
# UNSPLIT_KV_TILES tiles or fewer (a second launch and the partials cost more than the few
# tiles' loads they spread: docs/notes/stage13.md).
FILLED_SHARE = 0.8
UNSPLIT_KV_TILES = 4
MAX_SPLITS = 64


def splits_for(tiles, kv_tiles, sm_count):
    """How many splits a launch of `tiles` work tiles, each over at most kv_tiles KV tiles,
    gets on sm_count SMs: 1 when the tiles fill FILLED_SHARE of the SMs or kv_tiles is at most
    UNSPLIT_KV_TILES; else as many as fit in one wave, sm_count // tiles, at most one per KV
    tile and at most MAX_SPLITS (stage 13's docstring). B = 1, Hkv = 8 (packed heads), Sk = 32k
    on 132 SMs: 132 // 8 = 16."""
    if tiles == 0 or tiles >= FILLED_SHARE * sm_count or kv_tiles <= UNSPLIT_KV_TILES:
        return 1
    return max(1, min(sm_count // tiles, kv_tiles, MAX_SPLITS))


_CHECKED = {}

# The entries' fast path: a call whose tensors have the types, devices, shapes and strides of a
# call made before, with the same options (and option types), reuses that call's checked sizes,
# scale and LaunchPlan; only what can differ between such calls is looked at again (the data
# pointers' 16-byte alignment, page_table's and seqused_k's included, and their values). Host
# time per call: docs/notes/stage13.md.
_CALLS = {}
_CALLS_KEEP = 256
compile_cache.CLEAR_WITH_CACHE.append(_CALLS.clear)


def call_key(options, tensors):
    """The fast path's key: options (a tuple of the entry's non-tensor arguments, with their
    types; None: no key) and each tensor's dtype, device, shape and strides, and whether autograd
    would track the call. None when an argument cannot be a key (the slow path then checks it)."""
    if options is None:
        return None
    try:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        key = (options, grad) + tuple([(t.dtype, t.device, t.shape, t.stride()) for t in tensors])
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def options_key(kernel_class, scale, causal, window, return_lse, pack_gqa, num_splits, *more):
    """The option part of call_key, each value with its type (True and 1 are equal keys, but the
    checks accept only one of them). None (no fast path) for a scale that is not a plain number:
    a tensor (0-dim, say) can be written in place between two calls, and the remembered float
    would then launch with the old value."""
    if scale is not None and not isinstance(scale, (int, float)):
        return None
    if window is not None:
        window = tuple((type(w), w) for w in window) if isinstance(window, (tuple, list)) else []
    values = (scale, causal, return_lse, pack_gqa, num_splits) + more
    return (kernel_class, window, values, tuple(map(type, values)))


def remember_call(key, entry):
    if key is not None:
        checks.remember(_CALLS, _CALLS_KEEP, key, entry)


def one_entry_unit_stride(seqused_k):
    """seqused_k with stride 1. Only a tensor of one entry (B = 1) may have another stride
    (check_seqused_k): its stride moves no address, and the kernel is compiled with stride 1,
    so a stray stride neither compiles again nor reaches a kernel compiled for another."""
    if seqused_k is None or seqused_k.stride(0) == 1:
        return seqused_k
    return seqused_k.as_strided((1,), (1,))


def run_plan(plan, q, k, v, o, lse, max_seqlen_q, scale, seqused_k, page_table=None, buffer=None):
    """A remembered plan's launch, on q's device (batch mode and paged caches); buffer: the
    split partials' buffer of plan.outputs."""
    seqused_k = one_entry_unit_stride(seqused_k)
    device = q.device
    args = (q, k, v, o, lse, None, None, max_seqlen_q, scale, seqused_k, page_table, buffer)
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            plan.run(*args)
    else:
        plan.run(*args)


def checked_dims(q, k, v):
    """checks.check_attention_args(q, k, v, kv_heads=True), remembered: everything it checks
    but the data pointers' alignment follows from the tensors' types, shapes, strides, devices
    and whether autograd would track them, so a call with the same ones as a checked call only
    checks the alignment again (16 bytes, for TMA). Returns (B, H, Sq, Sk, D)."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = (q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, grad)
    key += (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride())
    dims = _CHECKED.get(key)
    if dims is None or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        dims = checks.check_attention_args(q, k, v, kv_heads=True)
        if len(_CHECKED) >= 1024:
            _CHECKED.clear()
        _CHECKED[key] = dims
    return dims


def split_args(kernel_class, num_splits, seqused_k):
    """Split-KV's arguments are refused by a kernel class without takes_splits (stages 7-12)."""
    if not getattr(kernel_class, "takes_splits", False):
        if num_splits is not None or seqused_k is not None:
            raise TypeError("num_splits and seqused_k need a split-KV stage (13 on)")
        return
    checks.check_num_splits(num_splits)


def attention(
    kernel_class,
    q,
    k,
    v,
    scale=None,
    causal=False,
    window=None,
    return_lse=False,
    pack_gqa=None,
    num_splits=None,
    seqused_k=None,
):
    """Batch mode (stage 7's attention): checks, outputs (poisoned under test), launch. Stage 13
    on: num_splits, seqused_k. A call like one made before takes the fast path (call_key)."""
    # seqused_k's dtype, device, shape and strides are in the key too: a call that hits it
    # checks only seqused_k's alignment and values.
    key = call_key(
        options_key(
            kernel_class, scale, causal, window, return_lse, pack_gqa, num_splits, seqused_k is None
        ),
        (q, k, v) if seqused_k is None else (q, k, v, seqused_k),
    )
    hit = _CALLS.get(key) if key is not None else None
    if hit is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        (B, H, Sq, Sk, D), scale, plan = hit
        if seqused_k is not None:
            checks.check_seqused_k(seqused_k, q, [Sk] * B, known_layout=True)
        o, lse, buffer = plan.outputs(q.dtype, q.device, return_lse)
        run_plan(plan, q, k, v, o, lse, Sq, scale, seqused_k, buffer=buffer)
        return (o, lse) if return_lse else o
    if not isinstance(return_lse, bool):
        raise TypeError(f"argument 'return_lse': expected a bool, got {type(return_lse).__name__}")
    masks.check_mask_args(causal, window)
    B, H, Sq, Sk, D = checked_dims(q, k, v)
    scale = checks.check_scale(scale, D)
    split_args(kernel_class, num_splits, seqused_k)
    if seqused_k is not None:
        checks.check_seqused_k(seqused_k, q, [Sk] * B)
    o = new_output(output_layout((B, H, Sq, D)), q.dtype, q.device)
    lse = new_output(output_layout((B, H, Sq)), torch.float32, q.device)
    plan = launch(
        kernel_class,
        q,
        k,
        v,
        o,
        lse,
        None,
        None,
        Sq,
        scale,
        causal,
        window,
        Sk,
        pack_gqa,
        seqused_k,
        num_splits,
    )
    remember_call(key, ((B, H, Sq, Sk, D), scale, plan))
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
    num_splits=None,
    seqused_k=None,
):
    """Packed sequences (stage 7's attention_varlen): checks (cu_seqlens read to the host once
    per pair, common/checks.py), outputs, the (1, H, total, D) views, launch. Stage 13 on:
    num_splits, seqused_k."""
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
    split_args(kernel_class, num_splits, seqused_k)
    if seqused_k is not None:
        checks.check_seqused_k(seqused_k, q, cu_seqlens_k)
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
        seqused_k,
        num_splits,
    )
    return (o, lse) if return_lse else o


def checked_paged_dims(q, k_cache, v_cache, page_table):
    """checks.check_paged_args, remembered as checked_dims does: only the data pointers'
    alignment (page_table's too) is checked again for tensors of the types, shapes and strides
    of a checked call."""
    ts = (q, k_cache, v_cache, page_table)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return checks.check_paged_args(*ts)
    grad = torch.is_grad_enabled() and (
        q.requires_grad or k_cache.requires_grad or v_cache.requires_grad
    )
    key = ("paged", grad) + tuple((t.dtype, t.device, t.shape, t.stride()) for t in ts)
    dims = _CHECKED.get(key)
    ptrs = q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | page_table.data_ptr()
    if dims is None or ptrs % 16:
        dims = checks.check_paged_args(*ts)
        if len(_CHECKED) >= 1024:
            _CHECKED.clear()
        _CHECKED[key] = dims
    return dims


def attention_paged(
    kernel_class,
    q,
    k_cache,
    v_cache,
    page_table,
    seqused_k,
    scale=None,
    causal=False,
    window=None,
    return_lse=False,
    pack_gqa=None,
    num_splits=None,
    check_values=True,
):
    """A paged KV cache (stage 14 on): checks, outputs, launch with the cache as it is and
    page_table. A call like one made before takes the fast path
    (call_key).

    check_values: read page_table and seqused_k to the host and check every page a sequence
    uses is a page of the cache and every seqused_k[b] fits its pages (common/checks.py). The
    read is a copy and a synchronisation, made once per tensor and version - which in a decode
    loop, whose table and lengths change every step, is once per step. check_values=False skips
    it (for a caller whose own allocator wrote the table): a page index out of range then reads
    zeros (TMA fills what lies outside the cache with zeros) and seqused_k is clamped to the
    table's pages - never a read outside the cache, but a wrong answer for wrong input."""
    if not isinstance(check_values, bool):
        raise TypeError(
            f"argument 'check_values': expected a bool, got {type(check_values).__name__}"
        )
    # seqused_k in the key too (None: no key, and the checks below refuse it).
    key = call_key(
        options_key(kernel_class, scale, causal, window, return_lse, pack_gqa, num_splits),
        (q, k_cache, v_cache, page_table, seqused_k),
    )
    hit = _CALLS.get(key) if key is not None else None
    if hit is not None:
        ptrs = q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | page_table.data_ptr()
    if hit is not None and not ptrs % 16:
        (B, H, Sq, D, page_size), scale, plan = hit
        checked_lengths(
            seqused_k, q, page_table, page_size, k_cache.shape[0], check_values, known_layout=True
        )
        o, lse, buffer = plan.outputs(q.dtype, q.device, return_lse)
        run_plan(plan, q, k_cache, v_cache, o, lse, Sq, scale, seqused_k, page_table, buffer)
        return (o, lse) if return_lse else o
    if not getattr(kernel_class, "takes_pages", False):
        raise TypeError("a paged KV cache needs a paged stage (14 on)")
    if not isinstance(return_lse, bool):
        raise TypeError(f"argument 'return_lse': expected a bool, got {type(return_lse).__name__}")
    masks.check_mask_args(causal, window)
    B, H, Sq, D, page_size = checked_paged_dims(q, k_cache, v_cache, page_table)
    scale = checks.check_scale(scale, D)
    checks.check_num_splits(num_splits)
    max_seqlen_k = page_table.shape[1] * page_size
    checked_lengths(seqused_k, q, page_table, page_size, k_cache.shape[0], check_values)
    o = new_output(output_layout((B, H, Sq, D)), q.dtype, q.device)
    lse = new_output(output_layout((B, H, Sq)), torch.float32, q.device)
    # The cache goes to the kernel as it is, (num_pages, page_size, Hkv, D): the kernel's
    # compiled layout sees it as its (B, H, S, D) with the page as B (stage 14's __call__).
    plan = launch(
        kernel_class,
        q,
        k_cache,
        v_cache,
        o,
        lse,
        None,
        None,
        Sq,
        scale,
        causal,
        window,
        max_seqlen_k,
        pack_gqa,
        seqused_k,
        num_splits,
        page_table,
    )
    remember_call(key, ((B, H, Sq, D, page_size), scale, plan))
    return (o, lse) if return_lse else o


def checked_lengths(
    seqused_k, q, page_table, page_size, num_pages, check_values, known_layout=False
):
    """seqused_k of a paged call: its type, dtype, shape and device (unless known_layout: the
    fast path's key holds them) and alignment always (no host read); with check_values its
    values and page_table's (common/checks.py)."""
    if seqused_k is None:
        raise TypeError(
            "argument 'seqused_k': required with a paged cache (int32 (B,), the keys of each "
            "sequence)"
        )
    max_seqlen_k = page_table.shape[1] * page_size
    checks.check_seqused_k(
        seqused_k, q, [max_seqlen_k] * q.shape[0], read_values=check_values,
        known_layout=known_layout,
    )  # fmt: skip
    if check_values:
        checks.check_page_table(page_table, seqused_k, page_size, num_pages)
