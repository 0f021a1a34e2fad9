"""Argument checks shared by every entry point. Each error names the argument, what it got and
what is allowed, so that bad input never turns into a wrong answer or a hang."""

import weakref

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


def remember(cache, keep, key, value):
    """cache[key] = value, first dropping the oldest entry once `keep` are held. Safe when
    threads share the cache: another thread may drop the same oldest entry, or insert, between
    the two steps (the entry is then gone already, or the next insert drops one)."""
    if len(cache) >= keep:
        try:
            cache.pop(next(iter(cache)), None)
        except (StopIteration, RuntimeError):  # emptied, or changed while read
            pass
    cache[key] = value


def _dtype_names(dtypes):
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name, t, *, rank, dtypes=HALF_DTYPES, contiguous_last=True, broadcast_dims=()):
    """A CUDA tensor of the given rank and dtype whose last dimension is contiguous and whose
    base address and other strides allow 16-byte TMA transfers. A stride of 0 (a tensor made by
    .expand) is allowed only in `broadcast_dims` (K and V over batch and heads), where the
    kernel is compiled with that 0 folded in (common/compile.py)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(
            f"argument '{name}': dtype {str(t.dtype).replace('torch.', '')} is not supported; "
            f"allowed: {_dtype_names(dtypes)}"
        )
    if t.dim() != rank:
        raise ValueError(
            f"argument '{name}': expected a rank-{rank} tensor, got shape {tuple(t.shape)}"
        )
    if not t.is_cuda:
        raise ValueError(f"argument '{name}': must be a CUDA tensor, got device '{t.device}'")
    if contiguous_last and t.stride(-1) != 1:
        raise ValueError(
            f"argument '{name}': the last dimension must be contiguous (stride 1), got strides "
            f"{tuple(t.stride())}; call .contiguous() first"
        )
    for d, (n, s) in enumerate(zip(t.shape, t.stride())):
        if s == 0 and n > 1 and d not in broadcast_dims:
            allowed = (
                f"only dimension(s) {', '.join(map(str, broadcast_dims))} may be broadcast"
                if broadcast_dims
                else "this argument may not be broadcast"
            )
            raise ValueError(
                f"argument '{name}': dimension {d} has stride 0 (a broadcast, e.g. from .expand); "
                f"{allowed}; call .contiguous() first"
            )
    esize = t.element_size()
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"argument '{name}': data pointer must be 16-byte aligned for TMA")
    for d, s in enumerate(t.stride()[:-1]):
        if (s * esize) % 16 != 0 and t.shape[d] > 1:
            raise ValueError(
                f"argument '{name}': stride {s} of dimension {d} is not a multiple of 16 bytes, "
                "which TMA requires; call .contiguous() or pad the last dimension"
            )
    return t


def check_aligned(name, t):
    """An int32 argument the kernel reads (cu_seqlens, seqused_k, page_table): the compiled
    function assumes a 16-byte aligned base, as for every tensor it takes, and its TVM-FFI entry
    refuses any other (common/compile.py); refused here first, by the argument's name."""
    if t.data_ptr() % 16 != 0:
        raise ValueError(
            f"argument '{name}': data pointer must be 16-byte aligned (a view that starts inside "
            "another tensor may not be); pass a fresh tensor or .clone() it"
        )


def check_same_dtype(names, tensors):
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        got = ", ".join(
            f"{n}: {str(t.dtype).replace('torch.', '')}" for n, t in zip(names, tensors)
        )
        raise TypeError(
            f"arguments {', '.join(repr(n) for n in names)} must share one dtype, got {got}"
        )


def check_same_device(names, tensors):
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        got = ", ".join(f"{n}: {t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"arguments must be on one device, got {got}")


def check_dim_eq(name_a, a, dim_a, name_b, b, dim_b, what):
    if a.shape[dim_a] != b.shape[dim_b]:
        raise ValueError(
            f"{what}: '{name_a}'.shape[{dim_a}] = {a.shape[dim_a]} must equal "
            f"'{name_b}'.shape[{dim_b}] = {b.shape[dim_b]}"
        )


def check_multiple(name, value, multiple, why):
    if value % multiple != 0:
        raise ValueError(f"{name} = {value} must be a multiple of {multiple} ({why})")


def check_max(name, value, limit, why):
    if value > limit:
        raise ValueError(f"{name} = {value} is larger than {limit} ({why})")


def check_positive(name, value):
    if value <= 0:
        raise ValueError(f"{name} = {value} must be positive")


def check_choice(name, value, allowed, why=""):
    if value not in allowed:
        extra = f" ({why})" if why else ""
        raise ValueError(
            f"{name} = {value} is not supported; allowed: {', '.join(map(str, allowed))}{extra}"
        )


def check_scale_type(scale):
    """A bool or a string is not a scale, though float() takes both (True as 1.0, "0.5")."""
    if isinstance(scale, (bool, str, bytes)):
        raise TypeError(f"argument 'scale': expected a float or None, got {type(scale).__name__}")


def check_optional_int(name, value):
    """An int or None (a bool is not one, though it is an int to Python)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"argument '{name}': expected an int or None, got {type(value).__name__}")


def check_scale(scale, head_dim):
    """scale defaults to 1/sqrt(D); an explicit one must be a finite positive float."""
    if scale is None:
        return head_dim**-0.5
    check_scale_type(scale)
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise TypeError(
            f"argument 'scale': expected a float or None, got {type(scale).__name__}"
        ) from None
    except OverflowError:
        raise ValueError(
            f"argument 'scale': must be a finite positive number, got {scale}"
        ) from None
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"argument 'scale': must be a finite positive number, got {scale}")
    return scale


def check_inference_only(names, tensors, what):
    """The kernels are forward-only: with autograd on, an input that requires grad would get an
    output silently detached from the graph (training would see no gradient through it)."""
    if not torch.is_grad_enabled():
        return
    for n, t in zip(names, tensors):
        if t.requires_grad:
            raise RuntimeError(
                f"argument '{n}' requires grad and autograd is on, but {what} is forward-only: "
                "its output would come back detached and no gradient would flow through it. "
                "Call it under torch.no_grad() or torch.inference_mode() for inference; for "
                "training use torch.nn.functional.scaled_dot_product_attention (or torch.matmul)."
            )


# K and V may be broadcast over batch (0) and heads (1): K.expand(B, H, Sk, D) of a (B, 1, Sk, D)
# tensor, as GQA / MQA written with expand produces.
KV_BROADCAST_DIMS = (0, 1)


def check_attention_args(
    q, k, v=None, *, head_dims=(64, 128), kv_broadcast_dims=KV_BROADCAST_DIMS, kv_heads=False
):
    """Common checks for stages 2-7: (B, H, S, D) tensors in one dtype and device, matching B, H
    and D, a supported head dim, no input that requires grad under autograd. Returns
    (B, H, Sq, Sk, D). kv_heads=True (stage 7 on): K and V may have Hkv heads, H % Hkv == 0."""
    check_tensor("q", q, rank=4)
    check_tensor("k", k, rank=4, broadcast_dims=kv_broadcast_dims)
    names, ts = ["q", "k"], [q, k]
    if v is not None:
        check_tensor("v", v, rank=4, broadcast_dims=kv_broadcast_dims)
        names.append("v")
        ts.append(v)
    check_same_dtype(names, ts)
    check_same_device(names, ts)
    check_inference_only(names, ts, "this attention kernel")
    for d, what in ((0, "batch"), (1, "heads"), (3, "head dim")):
        if d == 1 and kv_heads:
            check_head_groups(q.shape[1], k.shape[1])
            continue
        check_dim_eq("q", q, d, "k", k, d, what)
    if v is not None:
        for d, what in ((0, "batch"), (1, "heads"), (2, "key length"), (3, "head dim")):
            check_dim_eq("k", k, d, "v", v, d, what)
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    check_choice(
        "head dim D",
        D,
        head_dims,
        "the last dimension of q, k and v; the tile configuration is specialised per head dim",
    )
    check_positive("B = q.shape[0]", B)
    check_positive("H = q.shape[1]", H)
    check_positive("Sq = q.shape[2]", Sq)
    check_positive("Sk = k.shape[2]", Sk)
    return B, H, Sq, Sk, D


def check_options(options, allowed):
    """Keyword options of compile_args / compile_only that a stage knows (stage 6's causal and
    window, stage 7's head counts); any other name is an error, not silently ignored."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)}; this stage takes "
            + (", ".join(allowed) if allowed else "none")
        )


def check_head_groups(H, Hkv):
    """GQA / MQA: every KV head serves the same number of query heads."""
    if Hkv <= 0 or H % Hkv != 0:
        raise ValueError(
            f"heads: H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads "
            "(query head h reads KV head h // (H // Hkv))"
        )


def check_varlen_args(q, k, v, *, head_dims=(64, 128)):
    """Packed sequences: q (total_q, H, D), k and v (total_k, Hkv, D), one dtype and device,
    H % Hkv == 0, a supported head dim. Returns (total_q, H, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, rank=3)
    check_same_dtype(("q", "k", "v"), (q, k, v))
    check_same_device(("q", "k", "v"), (q, k, v))
    check_inference_only(("q", "k", "v"), (q, k, v), "this attention kernel")
    check_positive("H = q.shape[1]", q.shape[1])
    check_head_groups(q.shape[1], k.shape[1])
    check_dim_eq("q", q, 2, "k", k, 2, "head dim")
    for d, what in ((0, "key tokens"), (1, "KV heads"), (2, "head dim")):
        check_dim_eq("k", k, d, "v", v, d, what)
    check_choice(
        "head dim D",
        q.shape[2],
        head_dims,
        "the last dimension of q, k and v; the tile configuration is specialised per head dim",
    )
    return tuple(q.shape)


# Validated cu_seqlens pairs: (id(cu_q), id(cu_k)) -> (weak references to both, their version
# counters, the token counts they were checked against, the longest lengths). A few entries: a
# model reuses one pair for every layer of a batch.
_CU_SEQLENS_SEEN = {}
_CU_SEQLENS_KEEP = 8


def capturing(t):
    """Whether t's stream is being captured into a CUDA graph (nothing may be read to the host
    then). Only asked for CUDA tensors: a CPU-only torch cannot answer."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _untracked(*tensors):
    """Tensors made under torch.inference_mode() carry no version counter (reading _version
    raises): an in-place write to them could not be seen, so they are validated every call."""
    for t in tensors:
        if torch.is_inference(t):
            return True
    return False


def _cu_seqlens_lookup(cu_q, cu_k, totals):
    """The longest lengths of a pair validated before, or None. The same pair means the same two
    tensor objects, still alive (weak references: a freed tensor's id and address can come back
    with other contents), unmodified since (torch bumps a tensor's _version on every in-place
    write through it or a view of it) and checked against the same token counts."""
    if _untracked(cu_q, cu_k):
        return None
    hit = _CU_SEQLENS_SEEN.get((id(cu_q), id(cu_k)))
    if hit is None:
        return None
    refs, versions, seen_totals, longest = hit
    if refs[0]() is not cu_q or refs[1]() is not cu_k:
        return None
    if versions != (cu_q._version, cu_k._version) or seen_totals != totals:
        return None
    return longest


def check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """cu_seqlens_q and cu_seqlens_k: int32 CUDA tensors on q's device, rank 1, the same length
    batch + 1 >= 2, starting at 0, non-decreasing, ending at q's and k's token counts; a given
    max_seqlen must be an int at least the longest sequence. Returns (max_seqlen_q,
    max_seqlen_k).

    The values are read to the host (a small copy and a synchronisation with the GPU) the first
    time a pair of tensors is seen; a later call with the same two tensor objects, not written
    in place since (their _version), skips the copy. So a model that passes one pair to every
    layer pays it once per batch. (A write that bypasses torch's version counter - through
    .data, or by a kernel given the raw pointer - is not seen: pass new tensors after one.
    Tensors made under torch.inference_mode() have no version counter: they are read every
    call.)"""
    totals = (q.shape[0], k.shape[0])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(
                f"argument '{name}': dtype must be int32, got {str(cu.dtype).replace('torch.', '')}"
            )
        if cu.dim() != 1:
            raise ValueError(
                f"argument '{name}': expected a rank-1 tensor, got shape {tuple(cu.shape)}"
            )
        if cu.device != q.device:
            raise ValueError(
                f"argument '{name}': must be on q's device {q.device}, got {cu.device}"
            )
        if cu.shape[0] < 2:
            raise ValueError(f"argument '{name}': needs batch + 1 >= 2 offsets, got {cu.shape[0]}")
        if cu.stride(0) != 1:
            raise ValueError(f"argument '{name}': must be contiguous, got stride {cu.stride(0)}")
        check_aligned(name, cu)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"arguments 'cu_seqlens_q' and 'cu_seqlens_k' must describe the same number of "
            f"sequences, got {cu_seqlens_q.shape[0] - 1} and {cu_seqlens_k.shape[0] - 1}"
        )
    longest = _cu_seqlens_lookup(cu_seqlens_q, cu_seqlens_k, totals)
    read = longest is None
    if read and capturing(cu_seqlens_q):
        # Reading the offsets would synchronise with a stream that is being captured.
        raise RuntimeError(
            "arguments 'cu_seqlens_q' and 'cu_seqlens_k': their values are checked on the host, "
            "which cannot happen while a CUDA graph is being captured. Call once with these two "
            "tensors before the capture (a warm-up); the capture then reuses that check, as long "
            "as they are not written in place in between. (Tensors made under "
            "torch.inference_mode() carry no version counter and are checked at every call: "
            "make them outside it.)"
        )
    if read:
        longest = []
        for name, cu, total in (
            ("cu_seqlens_q", cu_seqlens_q, totals[0]),
            ("cu_seqlens_k", cu_seqlens_k, totals[1]),
        ):
            host = cu.tolist()
            if host[0] != 0:
                raise ValueError(f"argument '{name}': must start at 0, got {host[0]}")
            steps = [b - a for a, b in zip(host, host[1:])]
            if min(steps) < 0:
                i = steps.index(min(steps))
                raise ValueError(
                    f"argument '{name}': offsets must be non-decreasing, but {name}[{i + 1}] = "
                    f"{host[i + 1]} < {name}[{i}] = {host[i]}"
                )
            if host[-1] != total:
                raise ValueError(
                    f"argument '{name}': the last offset {host[-1]} must equal the number of "
                    f"tokens {total} ({'q' if name.endswith('q') else 'k'}.shape[0])"
                )
            longest.append(max(steps))
        longest = tuple(longest)
    if read and not _untracked(cu_seqlens_q, cu_seqlens_k):
        remember(
            _CU_SEQLENS_SEEN,
            _CU_SEQLENS_KEEP,
            (id(cu_seqlens_q), id(cu_seqlens_k)),
            (
                (weakref.ref(cu_seqlens_q), weakref.ref(cu_seqlens_k)),
                (cu_seqlens_q._version, cu_seqlens_k._version),
                totals,
                longest,
            ),
        )
    out = []
    for name, given, most in (
        ("max_seqlen_q", max_seqlen_q, longest[0]),
        ("max_seqlen_k", max_seqlen_k, longest[1]),
    ):
        if given is None:
            out.append(most)
            continue
        check_optional_int(name, given)
        if given < most:
            raise ValueError(
                f"argument '{name}' = {given} is smaller than the longest sequence ({most})"
            )
        out.append(given)
    return tuple(out)


def check_num_splits(num_splits):
    """num_splits: None (the launch chooses) or an int 1 .. MAX_NUM_SPLITS."""
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(
            f"argument 'num_splits': expected an int or None, got {type(num_splits).__name__}"
        )
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(
            f"argument 'num_splits': must be in 1 .. {MAX_NUM_SPLITS}, got {num_splits}"
        )


MAX_NUM_SPLITS = 256

_SEQUSED_SEEN = {}
# A decode loop passes a new seqused_k (and page table) each step, a benchmark cycles a few sets:
# remember more of them than of cu_seqlens pairs.
_LENGTHS_KEEP = 64


def check_seqused_k(seqused_k, q, key_counts, read_values=True, known_layout=False):
    """seqused_k: an int32 CUDA tensor on q's device, rank 1, one entry per sequence, each in
    0 .. that sequence's key count (key_counts: a list of ints, or cu_seqlens_k). The values
    are read to the host (a copy and a synchronisation) once per tensor and version (and, packed,
    per cu_seqlens_k object and version), as cu_seqlens are (check_cu_seqlens). While a CUDA graph is being captured nothing can be read:
    the values are not checked then, and the kernel clamps each to 0 .. the sequence's key count
    (it never reads past it). read_values=False: the same without the values. known_layout=True
    (the launch path's fast path, whose call key holds seqused_k's dtype, device, shape and
    strides, checked at an earlier call): only the alignment and the values."""
    name = "seqused_k"
    if known_layout:
        check_aligned(name, seqused_k)
        if read_values:
            _check_seqused_values(seqused_k, key_counts)
        return
    if not isinstance(seqused_k, torch.Tensor):
        raise TypeError(
            f"argument '{name}': expected a torch.Tensor, got {type(seqused_k).__name__}"
        )
    if seqused_k.dtype != torch.int32:
        raise TypeError(
            f"argument '{name}': dtype must be int32, got "
            f"{str(seqused_k.dtype).replace('torch.', '')}"
        )
    batch = len(key_counts) if isinstance(key_counts, list) else key_counts.shape[0] - 1
    if seqused_k.dim() != 1 or seqused_k.shape[0] != batch:
        raise ValueError(
            f"argument '{name}': expected shape ({batch},), one entry per sequence, got "
            f"{tuple(seqused_k.shape)}"
        )
    if seqused_k.device != q.device:
        raise ValueError(
            f"argument '{name}': must be on q's device {q.device}, got {seqused_k.device}"
        )
    if seqused_k.stride(0) != 1 and batch > 1:
        raise ValueError(f"argument '{name}': must be contiguous, got stride {seqused_k.stride(0)}")
    check_aligned(name, seqused_k)
    if read_values:
        _check_seqused_values(seqused_k, key_counts)


def _check_seqused_values(seqused_k, key_counts):
    """check_seqused_k's values: each seqused_k[b] in 0 .. key_counts[b]. Not while a CUDA
    graph is being captured (the kernel clamps them then)."""
    name = "seqused_k"
    # Remembered per (seqused_k, key counts): the counts themselves, or cu_seqlens_k's object and
    # version (a packed call), as check_cu_seqlens remembers its pair. The lookup comes first: a
    # hit needs neither the capture query nor the inference-mode test (about 1.5 us and 0.3 us
    # of host time per call under cProfile, NVIDIA H100 80GB HBM3, 2026-12-06). A hit's weak
    # references are to these very tensors, which were tracked when remembered, so reading
    # their _version is safe.
    counted_by = [] if isinstance(key_counts, list) else [key_counts]
    key = (id(seqused_k), tuple(key_counts) if not counted_by else ("cu", id(key_counts)))
    hit = _SEQUSED_SEEN.get(key)
    if hit is not None and all(
        ref() is t and version == t._version
        for (ref, version), t in zip(hit, [seqused_k, *counted_by])
    ):
        return
    if capturing(seqused_k):
        return
    tracked = not _untracked(seqused_k, *counted_by)
    # The versions before the read: a write after it makes the next call read again.
    stamp = tuple((weakref.ref(t), t._version) for t in [seqused_k, *counted_by]) if tracked else ()
    counts = (
        key_counts
        if isinstance(key_counts, list)
        else [b - a for a, b in zip(key_counts.tolist(), key_counts.tolist()[1:])]
    )
    for b, (used, count) in enumerate(zip(seqused_k.tolist(), counts)):
        if not 0 <= used <= count:
            raise ValueError(
                f"argument '{name}': seqused_k[{b}] = {used} is outside 0 .. {count}, the keys "
                f"sequence {b} has"
            )
    if tracked:
        remember(_SEQUSED_SEEN, _LENGTHS_KEEP, key, stamp)


def check_paged_args(q, k_cache, v_cache, page_table, *, head_dims=(64, 128)):
    """A paged cache: q (B, H, Sq, D); k_cache and v_cache (num_pages, page_size, Hkv, D) in q's
    dtype and device, H % Hkv == 0; page_size 16, 32, 64 or a multiple of 128; page_table an
    int32 (B, max_pages) tensor on q's device, rows contiguous. Returns (B, H, Sq, D,
    page_size). The values of page_table are checked by check_page_table."""
    check_tensor("q", q, rank=4)
    check_tensor("k_cache", k_cache, rank=4)
    check_tensor("v_cache", v_cache, rank=4)
    check_same_dtype(["q", "k_cache", "v_cache"], [q, k_cache, v_cache])
    check_same_device(["q", "k_cache", "v_cache"], [q, k_cache, v_cache])
    check_inference_only(
        ["q", "k_cache", "v_cache"], [q, k_cache, v_cache], "this attention kernel"
    )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"arguments 'k_cache' and 'v_cache' must have the same shape (num_pages, page_size, "
            f"Hkv, D), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    B, H, Sq, D = q.shape
    num_pages, page_size, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"argument 'k_cache': head dim {Dk} != q's {D}")
    check_choice(
        "head dim D",
        D,
        head_dims,
        "the last dimension of q, k_cache and v_cache; the tile configuration is specialised per "
        "head dim",
    )
    check_head_groups(H, Hkv)
    check_positive("B = q.shape[0]", B)
    check_positive("H = q.shape[1]", H)
    check_positive("Sq = q.shape[2]", Sq)
    check_positive("num_pages = k_cache.shape[0]", num_pages)
    if not (page_size in (16, 32, 64) or (page_size > 0 and page_size % 128 == 0)):
        raise ValueError(
            f"argument 'k_cache': page_size = k_cache.shape[1] = {page_size}; allowed: 16, 32, 64 "
            "or a multiple of 128 (a KV tile of 128 keys is loaded as whole pages or whole tiles)"
        )
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(
            f"argument 'page_table': expected a torch.Tensor, got {type(page_table).__name__}"
        )
    if page_table.dtype != torch.int32:
        raise TypeError(
            f"argument 'page_table': dtype must be int32, got "
            f"{str(page_table.dtype).replace('torch.', '')}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != B or page_table.shape[1] < 1:
        raise ValueError(
            f"argument 'page_table': expected shape ({B}, max_pages >= 1), one row per sequence, "
            f"got {tuple(page_table.shape)}"
        )
    if page_table.device != q.device:
        raise ValueError(
            f"argument 'page_table': must be on q's device {q.device}, got {page_table.device}"
        )
    if page_table.stride(1) != 1:
        raise ValueError(
            f"argument 'page_table': rows must be contiguous, got strides {page_table.stride()}"
        )
    check_aligned("page_table", page_table)
    return B, H, Sq, D, page_size


_PAGES_SEEN = {}


def check_page_table(page_table, seqused_k, page_size, num_pages):
    """Every page a sequence uses - the first ceil(seqused_k[b] / page_size) entries of row b -
    is a page of the cache, 0 .. num_pages - 1. The entries after them are never read (they may
    hold anything, -1 say). Read to the host once per pair of tensors and versions (as
    check_cu_seqlens); not while a CUDA graph is being captured, when nothing can be read: a page
    index out of range then reads zeros (TMA fills what lies outside the cache with zeros)."""
    # The lookup first, as in _check_seqused_values: a hit asks neither whether the stream is
    # being captured nor whether the tensors are inference tensors.
    key = (id(page_table), id(seqused_k), page_size, num_pages)
    hit = _PAGES_SEEN.get(key)
    if (
        hit is not None
        and hit[0]() is page_table
        and hit[1]() is seqused_k
        and hit[2] == (page_table._version, seqused_k._version)
    ):
        return
    if capturing(page_table):
        return
    tracked = not _untracked(page_table, seqused_k)
    rows, used = page_table.tolist(), seqused_k.tolist()
    for b, (row, n) in enumerate(zip(rows, used)):
        for i in range(-(-n // page_size)):
            if not 0 <= row[i] < num_pages:
                raise ValueError(
                    f"argument 'page_table': page_table[{b}, {i}] = {row[i]} is not a page of the "
                    f"cache (0 .. {num_pages - 1}); sequence {b} uses its first "
                    f"{-(-n // page_size)} entries (seqused_k[{b}] = {n})"
                )
    if tracked:
        remember(
            _PAGES_SEEN,
            _LENGTHS_KEEP,
            key,
            (
                weakref.ref(page_table),
                weakref.ref(seqused_k),
                (page_table._version, seqused_k._version),
            ),
        )
