"""`make bench`: each stage against its baselines, all timed in the same run on the same GPU.

Stage 1: bf16 GEMM at 4096^3 and 8192^3 against cuBLAS (torch.matmul).
Stage 2: QK^T against batched cuBLAS.
Stage 3: attention with Sk = one KV tile against torch SDPA (flash and cuDNN backends).
Stages 4 and 5: the FlashAttention paper shapes (B*S = 16k tokens, H*D = 2048, S = 512 ... 16k,
D = 64 and 128, non-causal) against SDPA flash, SDPA cuDNN and FA4 when importable.
Stage 6: the same shapes causal (FLOPs halved) against the same baselines run causal, and against
stage 6 and stage 5 without a mask.
Stage 7 (with stage 12 beside it): GQA 32/8 against its own MHA, FA4 and cuDNN; packed
sequences against FA4's varlen and a padded SDPA batch; decode-like steps.
Stage 12: the ablation stage 5 -> 7 -> 8 -> ... -> 12 at the paper shapes, causal and not, against
FA4 and cuDNN (--dtype fp16 for the fp16 rows); --tunings adds stage 12's tunings one by one.
Stage 13: decode steps (Sq = 1) in GB/s of K and V against stage 12, FA4 and SDPA's backends;
--decode-sweep adds B = 1 ... 64 x Sk = 4k ... 256k.
Writes results/bench_<gpu>_<date>.{md,json} and its figures, attention_, causal_, stage7_,
ablation_ and decode_<gpu>_<date>.png, as the run's rows allow (--out picks another folder;
results/ is not tracked by git, docs/results/ holds the published runs; `python -m
common.tools.plots RUN.json` draws a run's ablation and decode figures again)."""

import argparse
import json
import os
import sys
import time

import torch

from common import arch
from common.outputs import no_poison
from common.tools import stage_table, timing
from common.tools.workloads import make_case

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


# Said under the paper-shape table: its rows and the ablation's are timed in different rounds.
ATTN_TABLE_NOTE = (
    "The kernels of a row here are timed in their own interleaved rounds; the ablation table "
    "(when the run has one) times all its kernels of a row together, at other moments of the "
    "run. The same kernel at the same shape can read several percent apart in the two tables "
    "(the clocks step by 5-10% under sustained load): compare kernels within one table."
)


def paper_shape(S, D):
    return (16384 // S, 2048 // D, S, S, D)


def _rotated_sets(case):
    n_sets = timing.rotation_count(sum(t.numel() * t.element_size() for t in case.args))
    return [case.args] + [tuple(t.clone() for t in case.args) for _ in range(n_sets - 1)]


def measure(case, names=None, gpu=None, also=()):
    """{label: (ms, TFLOP/s)} for the kernel and each baseline, all on the same inputs, timed
    between CUDA events in interleaved rounds (timing.interleaved: every callable of the row in
    turn, so that the GPU's clock steps fall on all of them alike). also: more cases whose
    stage kernels (not their baselines) join the same rounds, each on its own inputs and FLOPs.
    gpu: a dict to fill with {label: (ms, TFLOP/s)} of GPU time alone (timing.gpu_ms: the
    kernels' durations, without the host work between them)."""
    sets = _rotated_sets(case)
    timed, flops = {}, {}
    with no_poison():
        for c in (case, *also):
            entry = c.fn or getattr(
                stage_table.track_module(c.stage, arch.track()), stage_table.stage(c.stage).entry
            )
            c_sets = sets if c is case else _rotated_sets(c)
            entry(*c.args)  # compile outside the timed region
            timed[f"stage {c.stage}"] = (entry, c_sets)
            flops[f"stage {c.stage}"] = c.flops
        for name, fn in case.baselines.items():
            if names is not None and name not in names:
                continue
            try:
                bargs = sets
                if name == "FA4":  # FA4 takes (B, S, H, D)
                    bargs = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in sets]
                fn(*bargs[0])
            except Exception as e:  # a backend that cannot run this shape is reported, not fatal
                print(
                    f"    {name}: not available for this shape ({type(e).__name__}: {str(e)[:80]})",
                    flush=True,
                )
                continue
            timed[name] = (fn, bargs)
            flops[name] = case.flops
        res = timing.interleaved(timed, gpu=gpu is not None)
    ev, gp = res if gpu is not None else (res, {})
    for label, ms in gp.items():
        gpu[label] = (ms, timing.tflops(flops[label], ms))
    return {label: (ms, timing.tflops(flops[label], ms)) for label, ms in ev.items()}


def stage7_rows(track, dtype, record):
    """GQA 32 query / 8 KV heads (D = 128, B x S = 16k) on stages 7 and 12 against each one's
    own MHA at the same shape (stages 7 and 9), FA4 and SDPA cuDNN with enable_gqa; packed
    sequences (16 of 64-2047 tokens, fixed seed, H = 16, D = 128, FLOPs of the real tokens
    only) on stages 7 and 12 against FA4's varlen and the same batch padded to the longest
    sequence through SDPA cuDNN. Each row is event-timed and, for the `GPU` ratios, timed from
    GPU time alone (timing.gpu_ms: the varlen rows' kernels are about as short as a call's host
    work)."""
    from common.tools import inputs, reference

    mods = {
        n: stage_table.track_module(n, track) for n in (7, 12) if stage_table.available(n, track)
    }
    mod = mods[7]
    fa4 = None
    try:
        import flash_attn.cute as fa

        fa4 = fa
    except Exception:
        pass
    from torch.nn.attention import SDPBackend

    def cudnn(causal, mask=None):
        """SDPA pinned to cuDNN (timing.pinned: timed inside the pin, entered once)."""
        return timing.pinned(
            SDPBackend.CUDNN_ATTENTION,
            lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
            ),
        )

    def timed(todo, name, fn, sets):
        """Run fn once (compiles it; a backend that cannot run raises here) and queue it for
        the row's interleaved rounds."""
        fn(*sets[0])
        torch.cuda.synchronize()
        todo[name] = (fn, sets)

    later = [n for n in (12,) if n in mods]
    cols = ["stage 7 GQA"] + [f"stage {n} GQA" for n in later] + ["stage 7 MHA"]
    cols += ["stage 12 MHA"] if 12 in mods else []
    lines = [
        "## Stages 7 and 12: GQA (32 query / 8 KV heads, D = 128, B*S = 16k), TFLOP/s",
        "",
        "`7 GQA / MHA` = stage 7 GQA over stage 7 with 32 KV heads at the same shape (goal >= "
        "0.95), `12 GQA / MHA` the same for stage 12; `12 / FA4` and `12 / cuDNN` from event time, "
        "`GPU` from GPU time alone.",
        "",
        "| S | causal | "
        + " | ".join(cols)
        + " | 7 GQA / MHA | 9 GQA / MHA | FA4 | SDPA cuDNN | 9 / FA4 | 9 / cuDNN | 9 / FA4 GPU |",
        "|" + " --- |" * (len(cols) + 9),
    ]
    with no_poison():
        for S in (2048, 8192):
            B, H, Hkv, D = 16384 // S, 32, 8, 128
            for causal in (False, True):
                print(f"GQA rows: S = {S}, causal = {causal} ...", flush=True)
                q, _, _ = inputs.attention_inputs(B, H, S, S, D, dtype, seed=1)
                _, k, v = inputs.attention_inputs(B, Hkv, S, S, D, dtype, seed=2)
                _, kf, vf = inputs.attention_inputs(B, H, S, S, D, dtype, seed=3)
                flops = reference.attention_flops(B, H, S, S, D, causal)
                todo = {}
                for n, m in mods.items():
                    fn = lambda q, k, v, m=m: m.attention(q, k, v, causal=causal)  # noqa: E731
                    timed(todo, f"stage {n} GQA", fn, [(q, k, v)])
                    if n in (7, 12):
                        timed(todo, f"stage {n} MHA", fn, [(q, kf, vf)])
                if fa4 is not None:
                    t = [tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))]
                    timed(
                        todo,
                        "FA4",
                        lambda q, k, v: fa4.flash_attn_func(q, k, v, causal=causal),
                        t,
                    )
                try:
                    timed(todo, "SDPA cuDNN", cudnn(causal), [(q, k, v)])
                except Exception as e:
                    print(f"    SDPA cuDNN GQA: not available ({type(e).__name__})", flush=True)
                row, gpu = timing.interleaved(todo, gpu=True)
                tf = {name: timing.tflops(flops, ms) for name, ms in row.items()}
                tg = {name: timing.tflops(flops, ms) for name, ms in gpu.items()}
                record("7 gqa", (B, H, Hkv, S, D, causal), {k: (row[k], tf[k]) for k in row})
                record(
                    "7 gqa GPU time", (B, H, Hkv, S, D, causal), {k: (gpu[k], tg[k]) for k in gpu}
                )
                g = lambda n: f"{tf[n]:.0f}" if n in tf else "-"  # noqa: E731
                r = lambda t, a, b: f"{t[a] / t[b]:.2f}" if a in t and b in t else "-"  # noqa: E731
                lines.append(
                    f"| {S} | {causal} | "
                    + " | ".join(g(c) for c in cols)
                    + f" | {r(tf, 'stage 7 GQA', 'stage 7 MHA')} | {r(tf, 'stage 12 GQA', 'stage 12 MHA')}"
                    f" | {g('FA4')} | {g('SDPA cuDNN')} | {r(tf, 'stage 12 GQA', 'FA4')}"
                    f" | {r(tf, 'stage 12 GQA', 'SDPA cuDNN')} | {r(tg, 'stage 12 GQA', 'FA4')} |"
                )
                print("  " + lines[-1], flush=True)
        vcols = [f"stage {n}" for n in mods]
        lines += [
            "",
            "## Stages 7 and 12: packed sequences (16 of 64-2047 tokens, H = 16, D = 128), useful TFLOP/s",
            "",
            "FLOPs of the real tokens only; `padded SDPA` runs the same batch padded to the longest "
            "sequence (B = 16) through SDPA cuDNN with a key-padding mask (goal: stage 7 >= 2x it). "
            "`GPU` ratios from GPU time alone.",
            "",
            "| causal | "
            + " | ".join(vcols)
            + " | FA4 varlen | padded SDPA cuDNN | 7 / padded | 9 / FA4 | 9 / FA4 GPU | 9 / padded GPU |",
            "|" + " --- |" * (len(vcols) + 7),
        ]
        g = torch.Generator().manual_seed(2026)
        lens = torch.randint(64, 2048, (16,), generator=g).tolist()
        H, D = 16, 128
        total, longest = sum(lens), max(lens)
        cu = torch.tensor(
            [0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda"
        )
        q, k, v = (torch.randn(total, H, D, device="cuda").to(dtype) for _ in range(3))
        padded = [torch.zeros(16, H, longest, D, device="cuda", dtype=dtype) for _ in range(3)]
        keep = torch.zeros(16, longest, dtype=torch.bool, device="cuda")
        for b, n in enumerate(lens):
            for t, src in zip(padded, (q, k, v)):
                t[b, :, :n] = src[cu[b] : cu[b] + n].transpose(0, 1)
            keep[b, :n] = True
        for causal in (False, True):
            print(f"packed-sequence rows: causal = {causal} ...", flush=True)
            flops = sum(reference.attention_flops(1, H, n, n, D, causal) for n in lens)
            todo = {}
            for n, m in mods.items():
                timed(
                    todo,
                    f"stage {n}",
                    lambda q, k, v, m=m: m.attention_varlen(
                        q, k, v, cu, cu, longest, longest, causal=causal
                    ),
                    [(q, k, v)],
                )
            if fa4 is not None:
                try:
                    timed(
                        todo,
                        "FA4",
                        lambda q, k, v: fa4.flash_attn_varlen_func(
                            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal
                        ),
                        [(q, k, v)],
                    )
                except Exception as e:
                    print(
                        f"    FA4 varlen: not available ({type(e).__name__}: {str(e)[:100]})",
                        flush=True,
                    )
            qi = torch.arange(longest, device="cuda")
            mask = keep[:, None, None, :]
            if causal:
                mask = mask & (qi[None, :] <= qi[:, None])[None, None]
            # cuDNN pinned by timing.pinned: the timers enter its context once, around the calls.
            try:
                timed(
                    todo,
                    "padded",
                    cudnn(False, mask),
                    [tuple(padded)],
                )
            except Exception as e:
                # cuDNN without the padding mask does the same padded work (the pad rows'
                # results are discarded); is_causal is its own causal mask.
                print(
                    f"    padded SDPA cuDNN with a mask: {type(e).__name__}; timing it without",
                    flush=True,
                )
                timed(todo, "padded", cudnn(causal), [tuple(padded)])
            row, gpu = timing.interleaved(todo, gpu=True)
            tf = {name: timing.tflops(flops, ms) for name, ms in row.items()}
            tg = {name: timing.tflops(flops, ms) for name, ms in gpu.items()}
            record("7 varlen", (16, H, total, D, causal), {k: (row[k], tf[k]) for k in row})
            record(
                "7 varlen GPU time", (16, H, total, D, causal), {k: (gpu[k], tg[k]) for k in gpu}
            )
            gg = lambda n: f"{tf[n]:.0f}" if n in tf else "-"  # noqa: E731
            r = lambda t, a, b: f"{t[a] / t[b]:.2f}" if a in t and b in t else "-"  # noqa: E731
            lines.append(
                f"| {causal} | "
                + " | ".join(gg(c) for c in vcols)
                + f" | {gg('FA4')} | {gg('padded')} | {r(tf, 'stage 7', 'padded')}"
                f" | {r(tf, 'stage 12', 'FA4')} | {r(tg, 'stage 12', 'FA4')} | {r(tg, 'stage 12', 'padded')} |"
            )
            print("  " + lines[-1], flush=True)
    lines += decode_rows(mod, fa4, dtype, record, later=mods.get(12))
    lines.append("")
    return lines


def decode_rows(mod, fa4, dtype, record, later=None):
    """Decode-like shapes (B = 32, 32 query / 8 KV heads, Sk = 8192, D = 128, Sq = 1, 16, 128):
    stage 7 with pack-GQA (its default there) and without, `later` (stage 12's module, where it
    exists) with its default, FA4 and SDPA, in microseconds and in TB/s of K and V read (the
    memory bound of a decode step)."""
    from common import masks
    from common.tools import inputs

    lines = [
        "",
        "## Stage 7 (and 12): decode-like shapes (B = 32, H = 32, Hkv = 8, Sk = 8192, D = 128), us",
        "",
        "`packed` = stage 7 with pack-GQA (4 query heads per Q tile, what it picks here), "
        "`unpacked` = pack_gqa=False, `stage 12` = stage 12 with its default (pack-GQA here too); "
        "TB/s = bytes of K and V (1.07 GB) / time, for stage 7 packed.",
        "",
        "| Sq | stage 7 packed | stage 7 unpacked | stage 12 | FA4 | SDPA | packed TB/s "
        "| packed / unpacked |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    B, H, Hkv, Sk, D = 32, 32, 8, 8192, 128
    _, k, v = inputs.attention_inputs(B, Hkv, 1, Sk, D, dtype, seed=7)
    kv_bytes = 2 * k.numel() * k.element_size()
    kt, vt = (t.transpose(1, 2).contiguous() for t in (k, v))
    with no_poison():
        for Sq in (1, 16, 128):
            q, _, _ = inputs.attention_inputs(B, H, Sq, 1, D, dtype, seed=Sq)
            visible = masks.visible(Sq, Sk, *masks.resolve_window(True, None, Sq, Sk), "cuda")
            fns = {
                "packed": (lambda q: mod.attention(q, k, v, causal=True), [(q,)]),
                "unpacked": (
                    lambda q: mod.attention(q, k, v, causal=True, pack_gqa=False),
                    [(q,)],
                ),
            }
            if later is not None:
                fns["stage 12"] = (lambda q: later.attention(q, k, v, causal=True), [(q,)])
            if fa4 is not None:
                qt = q.transpose(1, 2).contiguous()
                fns["FA4"] = (lambda q: fa4.flash_attn_func(q, kt, vt, causal=True), [(qt,)])
            # SDPA's is_causal is top-left aligned; a decode step is bottom-right (every key
            # visible when Sq = 1). Time SDPA without a mask at Sq = 1 and with the
            # bottom-right mask otherwise.
            fns["SDPA"] = (
                lambda q, mask=None if Sq == 1 else visible: (
                    torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, enable_gqa=True
                    )
                ),
                [(q,)],
            )
            for fn, sets in fns.values():
                fn(*sets[0])  # compile and warm up before the rounds
            # All kernels of a row in the same interleaved rounds (timing.interleaved).
            row = timing.interleaved(fns)
            record("7 decode", (B, H, Hkv, Sq, Sk, D), {n: (ms, 0.0) for n, ms in row.items()})
            us = lambda n: f"{row[n] * 1e3:.0f}" if n in row else "-"  # noqa: E731
            lines.append(
                f"| {Sq} | {us('packed')} | {us('unpacked')} | {us('stage 12')} | {us('FA4')} "
                f"| {us('SDPA')} "
                f"| {kv_bytes / (row['packed'] * 1e-3) / 1e12:.2f} "
                f"| {row['unpacked'] / row['packed']:.2f}x faster |"
            )
            print("  " + lines[-1], flush=True)
    return lines


# Stage 13: decode steps, (B, query heads, KV heads, Sk); Sq = 1, D = 128.
SPLIT_KV_ROWS = [
    (1, 32, 8, 8192),
    (1, 32, 8, 32768),
    (1, 32, 8, 131072),
    (1, 32, 32, 32768),
    (8, 32, 8, 32768),
    (32, 32, 8, 8192),
]
SPLIT_KV_SWEEP = [(B, 32, 8, Sk) for B in (1, 4, 16, 64) for Sk in (4096, 16384, 65536, 262144)]


PAGE_SIZES = (16, 64, 128, 256)


def paged_copy(k, v, page_size, seed=0):
    """k, v (B, Hkv, Sk, D) as a paged cache: (k_cache, v_cache, page_table, seqused_k), the
    pages of all sequences in one random order."""
    B, Hkv, Sk, D = k.shape
    per_seq = -(-Sk // page_size)
    order = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(seed))
    table = order.view(B, per_seq).to(torch.int32).cuda()
    k_cache = torch.empty(B * per_seq, page_size, Hkv, D, device=k.device, dtype=k.dtype)
    v_cache = torch.empty_like(k_cache)
    pad = per_seq * page_size - Sk
    for src, dst in ((k, k_cache), (v, v_cache)):
        pages = torch.nn.functional.pad(src, (0, 0, 0, pad)).view(B, Hkv, per_seq, page_size, D)
        dst[table.long().flatten()] = pages.permute(0, 2, 3, 1, 4).reshape(-1, page_size, Hkv, D)
    seqused = torch.full((B,), Sk, dtype=torch.int32, device=k.device)
    return k_cache, v_cache, table, seqused


def split_kv_rows(dtype, record, sweep=False):
    """Decode steps (Sq = 1, D = 128) with stages 12 and 13, FA4 and SDPA's backends, all in the
    same interleaved rounds, inputs rotated past L2: GB/s of K and V read per call (the bound of
    a decode step: the H200's HBM gives about 4,800). sweep: also B = 1, 4, 16, 64 x Sk = 4k ...
    256k (rows above 4 GB of K and V skipped)."""
    from torch.nn.attention import SDPBackend

    from common.tools import inputs

    s12 = stage_table.track_module(12, arch.track())
    s13 = stage_table.track_module(13, arch.track())
    s14 = None
    if stage_table.available(14, arch.track()):
        s14 = stage_table.track_module(14, arch.track())
    fa4 = timing.fa4_fn(False)
    names = ["stage 12", "stage 13"]
    names += [f"14 p{p}" for p in PAGE_SIZES] if s14 is not None else []
    names += ["FA4", "SDPA cuDNN", "SDPA flash", "SDPA efficient"]
    head = [
        "| B | heads q/kv | Sk | splits | " + " | ".join(names) + " | 13 / cuDNN |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- |",
    ]
    lines = [
        "",
        "## Stage 13: decode steps (Sq = 1, D = 128), GB/s of K and V read",
        "",
        "GB/s = 2 Sk Hkv D 2 bytes B / time, inputs rotated past L2; `splits` = the number stage "
        "13's launch chose; `14 pN` = stage 14 on a paged cache of N keys per page, pages in "
        "random order. First by the calls' time back to back between CUDA events (what a "
        "model sees, host work included), then by GPU time alone (the kernels' durations as "
        "the profiler records them: what the kernels do with the memory). SDPA runs inside its "
        "backend's context, entered once around each timer's calls (timing.pinned).",
        "",
        "### Calls back to back (CUDA events)",
        "",
        *head,
    ]
    gpu_lines = ["", "### GPU time alone", "", *head]
    backends = {
        "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION,
        "SDPA flash": SDPBackend.FLASH_ATTENTION,
        "SDPA efficient": SDPBackend.EFFICIENT_ATTENTION,
    }

    def sdpa(backend):
        return timing.pinned(
            backend,
            lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, enable_gqa=True
            ),
        )

    rows = SPLIT_KV_ROWS + ([r for r in SPLIT_KV_SWEEP if r not in SPLIT_KV_ROWS] if sweep else [])
    D = 128
    with no_poison():
        for B, H, Hkv, Sk in rows:
            kv_bytes = 2 * B * Hkv * Sk * D * 2
            if kv_bytes > 4e9:
                continue
            q, k, v = inputs.attention_inputs(B, Hkv, 1, Sk, D, dtype, seed=Sk + B)
            q = torch.randn(B, H, 1, D, device="cuda", dtype=dtype)
            n_sets = timing.rotation_count(kv_bytes)
            sets = [(q, k, v)] + [(q.clone(), k.clone(), v.clone()) for _ in range(n_sets - 1)]
            fns = {
                "stage 12": (lambda q, k, v: s12.attention(q, k, v), sets),
                "stage 13": (lambda q, k, v: s13.attention(q, k, v), sets),
            }
            if s14 is not None:
                for p in PAGE_SIZES:
                    paged = [
                        (st[0], *paged_copy(st[1], st[2], p, seed=i)) for i, st in enumerate(sets)
                    ]
                    fns[f"14 p{p}"] = (s14.attention_paged, paged)
            if fa4 is not None:
                bshd = [tuple(t.transpose(1, 2).contiguous() for t in st) for st in sets]
                fns["FA4"] = (fa4, bshd)
            for name, backend in backends.items():
                fns[name] = (sdpa(backend), sets)
            for name in list(fns):
                fn, st = fns[name]
                try:
                    fn(*st[0])
                except Exception as e:  # a backend that cannot run this shape: reported
                    print(f"    {name}: not available ({type(e).__name__}: {str(e)[:60]})")
                    del fns[name]
            torch.cuda.synchronize()
            row, gpu_row = timing.interleaved(fns, gpu=True)
            from common import attention_host
            from common.arch import device_sm_count

            splits = attention_host.splits_for(Hkv * B, -(-Sk // 128), device_sm_count())
            for out, times, label in (
                (lines, row, "13 decode"),
                (gpu_lines, gpu_row, "13 decode GPU"),
            ):
                gbs = {n: kv_bytes / (ms * 1e-3) / 1e9 for n, ms in times.items()}
                record(label, (B, H, Hkv, 1, Sk, D), {n: (ms, gbs[n]) for n, ms in times.items()})
                cells = [f"{gbs[n]:,.0f}" if n in gbs else "-" for n in names]
                cudnn = gbs.get("SDPA cuDNN", float("nan"))
                out.append(
                    f"| {B} | {H}/{Hkv} | {Sk // 1024}k | {splits} | "
                    + " | ".join(cells)
                    + f" | {gbs['stage 13'] / cudnn:.2f} |"
                )
                print("  " + out[-1], flush=True)
    return lines + gpu_lines


ABLATION_STAGES = (5, 7, 8, 9, 10, 11, 12)


def ablation_rows(track, dtype, headdims, seqlens, record):
    """The FlashAttention-3 paper's ablation on this tutorial's stages: stage 5 (no
    specialisation) and stage 7 (its masks, GQA and packed sequences) -> 8 (warp
    specialisation) -> 9 (ping-pong) -> 10 (overlap inside the loop) -> 11 (persistent CTAs) ->
    12 (the last percent), non-causal and causal, with FA4 and SDPA cuDNN timed next to them."""
    stages = [n for n in ABLATION_STAGES if stage_table.available(n, track)]
    cols = [f"stage {n}" for n in stages] + ["FA4", "SDPA cuDNN"]
    lines = [
        "## The ablation, stages "
        + " -> ".join(map(str, stages))
        + " (paper shapes, B*S = 16k, H*D = 2048), TFLOP/s",
        "",
        "Causal rows: every stage from 7 on and the baselines causal (FLOPs halved); stage 5 has "
        "no mask, so it is left out there. `12 / FA4` and `12 / cuDNN` are stage 12 over the "
        "baseline in the same row (goals: >= 1.0 from S = 2k to 16k). The TFLOP/s are event-timed "
        "per call (host work included where it is longer than the kernel), all kernels of a row "
        "in the same interleaved rounds; the `GPU` columns are the same ratios from GPU time "
        "alone (CUPTI kernel durations, timing.gpu_ms).",
        "",
        "| D | causal | S | "
        + " | ".join(cols)
        + " | 12 / FA4 | 12 / cuDNN | 12 / FA4 GPU | 12 / cuDNN GPU |",
        "|" + " --- |" * (len(cols) + 7),
    ]
    last = f"stage {stages[-1]}"
    for D in headdims:
        for causal in (False, True):
            for S in seqlens:
                shape = paper_shape(S, D)
                print(f"ablation: {shape} causal={causal} ...", flush=True)
                gpu = {}
                also = [
                    make_case(n, track, shape, dtype, causal=causal)
                    for n in stages[:-1]
                    if n >= 7 or not causal
                ]
                row = measure(
                    make_case(stages[-1], track, shape, dtype, with_fa4=True, causal=causal),
                    names=("FA4", "SDPA cuDNN"),
                    gpu=gpu,
                    also=also,
                )
                record("ablation", (*shape, causal), row)
                record("ablation GPU time", (*shape, causal), gpu)
                tg = {k: v[1] for k, v in gpu.items()}
                rg = lambda a, b: f"{tg[a] / tg[b]:.2f}" if a in tg and b in tg else "-"  # noqa: E731
                tf = {k: v[1] for k, v in row.items()}
                g = lambda k: f"{tf[k]:.0f}" if k in tf else "-"  # noqa: E731
                r = lambda a, b: f"{tf[a] / tf[b]:.2f}" if a in tf and b in tf else "-"  # noqa: E731
                lines.append(
                    f"| {D} | {causal} | {S} | "
                    + " | ".join(g(c) for c in cols)
                    + f" | {r(last, 'FA4')} | {r(last, 'SDPA cuDNN')} "
                    f"| {rg(last, 'FA4')} | {rg(last, 'SDPA cuDNN')} |"
                )
                print("  " + lines[-1], flush=True)
    lines.append("")
    return lines


def tuning_rows(track, dtype, headdims, seqlens, record):
    """Stage 12's tunings one at a time, cumulative in TUNINGS' order: stage 11 (none), +1,
    +1-2, ..., +1-7 (stage 12), each a kernel of its own (with_tunings), all timed in the same
    interleaved rounds with FA4, at the paper shapes, causal and not."""
    from common import attention_host

    mod = stage_table.track_module(12, track)
    names = mod.TUNINGS
    labels = ["none"] + [f"+1-{i}" if i > 1 else "+1" for i in range(1, len(names) + 1)]
    lines = [
        "## Stage 12's tunings, cumulative (paper shapes), TFLOP/s",
        "",
        "`none` is stage 12 with no tuning (stage 11's code); `+1-k` has tunings 1 to k of "
        + ", ".join(f"{i + 1}. {n}" for i, n in enumerate(names))
        + ". All in the same interleaved rounds with FA4 (event time). `gain` is +1-7 over none.",
        "",
        "| D | causal | S | " + " | ".join(labels) + " | FA4 | gain |",
        "|" + " --- |" * (len(labels) + 5),
    ]
    for D in headdims:
        for causal in (False, True):
            for S in seqlens:
                shape = paper_shape(S, D)
                print(f"tunings: {shape} causal={causal} ...", flush=True)
                base = make_case(12, track, shape, dtype, with_fa4=True, causal=causal)
                cases = []
                for i, label in enumerate(labels):
                    cls = mod.with_tunings(names[:i])

                    def fn(q, k, v, cls=cls):
                        return attention_host.attention(
                            cls, q, k, v, None, causal, None, False, None
                        )

                    c = make_case(12, track, shape, dtype, causal=causal)
                    c.stage, c.fn = f"12 {label}", fn
                    cases.append(c)
                first = cases[0]
                first.baselines = base.baselines
                row = measure(first, names=("FA4",), also=cases[1:])
                record("tunings", (*shape, causal), row)
                tf = {k: v[1] for k, v in row.items()}
                g = lambda k: f"{tf[k]:.0f}" if k in tf else "-"  # noqa: E731
                gain = tf[f"stage 12 {labels[-1]}"] / tf["stage 12 none"]
                lines.append(
                    f"| {D} | {causal} | {S} | "
                    + " | ".join(g(f"stage 12 {lb}") for lb in labels)
                    + f" | {g('FA4')} | {gain:.3f} |"
                )
                print("  " + lines[-1], flush=True)
    lines.append("")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stages", default="1,2,3,4,5,6,7,12,13", help="comma-separated stage numbers")
    ap.add_argument(
        "--tunings",
        action="store_true",
        help="also stage 12's tunings, cumulative (--tuning-seqlens)",
    )
    ap.add_argument("--tuning-seqlens", default="2048,8192,16384")
    ap.add_argument(
        "--decode-sweep",
        action="store_true",
        help="stage 13: also B = 1, 4, 16, 64 x Sk = 4k ... 256k",
    )
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="time each stage 4/5 row this many times (spread check)",
    )
    ap.add_argument(
        "--out",
        default="results",
        help="folder of the .md, .json and .png (default results/, not tracked by git; docs/results holds the published runs)",
    )
    args = ap.parse_args(argv)
    track = arch.track()
    gpu, date = timing.gpu_and_date()
    want = [int(s) for s in args.stages.split(",") if s]
    seqlens = [int(s) for s in args.seqlens.split(",")]
    headdims = [int(d) for d in args.headdims.split(",")]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    t0 = time.time()
    state = timing.gpu_state()
    results = {"gpu": gpu, "date": date, "track": track, "torch": torch.__version__, "rows": []}
    results["gpu state at start"] = state
    lines = [
        f"# Benchmarks on {gpu}, {date} ({args.dtype})",
        "",
        f"torch {torch.__version__}; medians of CUDA-event timings after warm-up, inputs rotated past L2; "
        "every number in a table was timed in the same run, the kernels of a row in interleaved "
        "rounds (timing.interleaved: the GPU's clocks step by 5-10% under sustained load, and "
        "rounds put the same steps on every kernel of the row).",
        "",
        f"GPU at the start: {state or 'not read (no nvidia-smi)'}.",
        "",
    ]

    def record(stage, shape, res):
        results["rows"].append(
            {
                "stage": stage,
                "shape": list(shape),
                "tflops": {k: v[1] for k, v in res.items()},
                "ms": {k: v[0] for k, v in res.items()},
            }
        )

    for n in want:
        if not stage_table.available(n, track):
            print(f"stage {n}: not written yet for {track}, skipped", flush=True)
            continue
        if n == 1:
            lines += [
                "## Stage 1: GEMM (C = A @ B^T), TFLOP/s",
                "",
                "| M=N=K | stage 1 | cuBLAS | ratio |",
                "| --- | --- | --- | --- |",
            ]
            for sz in (4096, 8192):
                print(f"stage 1: {sz}^3 ...", flush=True)
                res = measure(make_case(1, track, (sz, sz, sz), dtype))
                record(1, (sz, sz, sz), res)
                s, c = res["stage 1"][1], res["cuBLAS (torch.matmul)"][1]
                lines.append(f"| {sz} | {s:.0f} | {c:.0f} | {s / c:.2f}x |")
                print(
                    f"  stage 1 {s:.0f} TFLOP/s, cuBLAS {c:.0f} TFLOP/s, ratio {s / c:.2f}",
                    flush=True,
                )
            lines.append("")
        elif n == 2:
            lines += [
                "## Stage 2: S = scale * Q K^T in fp32, TFLOP/s",
                "",
                "| (B, H, Sq, Sk, D) | stage 2 | cuBLAS batched | ratio |",
                "| --- | --- | --- | --- |",
            ]
            for D in headdims:
                shape = (4, 2048 // D, 2048, 2048, D)
                print(f"stage 2: {shape} ...", flush=True)
                res = measure(make_case(2, track, shape, dtype))
                record(2, shape, res)
                s, c = res["stage 2"][1], res["cuBLAS (torch.matmul)"][1]
                lines.append(f"| {shape} | {s:.0f} | {c:.0f} | {s / c:.2f}x |")
            lines.append("")
        elif n == 3:
            lines += [
                "## Stage 3: attention with Sk = one KV tile (128), TFLOP/s",
                "",
                "| (B, H, Sq, Sk, D) | stage 3 | SDPA flash | SDPA cuDNN |",
                "| --- | --- | --- | --- |",
            ]
            for D in headdims:
                shape = (16, 2048 // D, 4096, 128, D)
                print(f"stage 3: {shape} ...", flush=True)
                res = measure(make_case(3, track, shape, dtype))
                record(3, shape, res)
                g = lambda k: f"{res[k][1]:.0f}" if k in res else "-"
                lines.append(
                    f"| {shape} | {g('stage 3')} | {g('SDPA flash')} | {g('SDPA cuDNN')} |"
                )
            lines.append("")
    attn = [n for n in want if n in (4, 5, 12) and stage_table.available(n, track)]
    curves = {}
    if attn:
        lines += [
            ("## Stage " if len(attn) == 1 else "## Stages ")
            + ", ".join(map(str, attn))
            + ": attention forward, FlashAttention paper shapes (B*S = 16k, H*D = 2048, non-causal), TFLOP/s",
            "",
            ATTN_TABLE_NOTE,
            "",
        ]
        for D in headdims:
            cols = [f"stage {n}" for n in attn] + ["SDPA flash", "SDPA cuDNN", "FA4"]
            lines += [
                f"### D = {D}",
                "",
                "| S | " + " | ".join(cols) + " |",
                "|" + " --- |" * (len(cols) + 1),
            ]
            for S in seqlens:
                shape = paper_shape(S, D)
                for rep in range(args.repeat):
                    row = {}
                    for i, n in enumerate(attn):
                        print(f"stage {n}: {shape} ...", flush=True)
                        res = measure(
                            make_case(n, track, shape, dtype, with_fa4=(i == 0)),
                            names=None if i == 0 else (),
                        )
                        row.update(res)
                    record("4/5", shape, row)
                    if rep == 0:
                        for k, v in row.items():
                            curves.setdefault((D, k), []).append((S, v[1]))
                    lines.append(
                        f"| {S} | "
                        + " | ".join(f"{row[c][1]:.0f}" if c in row else "-" for c in cols)
                        + " |"
                    )
                    print("  " + ", ".join(f"{k} {v[1]:.0f}" for k, v in row.items()), flush=True)
            lines.append("")
    causal_curves = {}
    if 6 in want and stage_table.available(6, track):
        lines += [
            "## Stage 6: causal attention with tile skipping, paper shapes (B*S = 16k, H*D = 2048), "
            "TFLOP/s (causal FLOPs halved)",
            "",
            "Every column is causal except `stage 6 full` and `stage 5 full` (no mask, same shape). "
            "`own` = stage 6 causal / stage 6 full (goal >= 0.9 from S = 4k: tile skipping "
            "works); `vs flash` = stage 6 causal / SDPA flash causal (goal >= 1.3).",
            "",
        ]
        for D in headdims:
            cols = ["stage 6", "stage 6 full", "stage 5 full", "SDPA flash", "SDPA cuDNN", "FA4"]
            lines += [
                f"### D = {D}",
                "",
                "| S | " + " | ".join(cols) + " | own | vs flash |",
                "|" + " --- |" * (len(cols) + 3),
            ]
            for S in seqlens:
                shape = paper_shape(S, D)
                print(f"stage 6: {shape} causal ...", flush=True)
                row = measure(make_case(6, track, shape, dtype, with_fa4=True, causal=True))
                full6 = measure(make_case(6, track, shape, dtype), names=())
                row["stage 6 full"] = full6["stage 6"]
                if stage_table.available(5, track):
                    full5 = measure(make_case(5, track, shape, dtype), names=())
                    row["stage 5 full"] = full5["stage 5"]
                record("6", shape, row)
                for key, v in row.items():
                    causal_curves.setdefault((D, key), []).append((S, v[1]))
                own = row["stage 6"][1] / row["stage 6 full"][1]
                vs = (
                    row["stage 6"][1] / row["SDPA flash"][1]
                    if "SDPA flash" in row
                    else float("nan")
                )
                lines.append(
                    f"| {S} | "
                    + " | ".join(f"{row[c][1]:.0f}" if c in row else "-" for c in cols)
                    + f" | {own:.2f} | {vs:.2f} |"
                )
                print("  " + ", ".join(f"{k} {v[1]:.0f}" for k, v in row.items()), flush=True)
            lines.append("")
    if 7 in want and stage_table.available(7, track):
        lines += stage7_rows(track, dtype, record)
    if 12 in want and stage_table.available(12, track):
        lines += ablation_rows(track, dtype, headdims, seqlens, record)
    if 13 in want and stage_table.available(13, track):
        lines += split_kv_rows(dtype, record, sweep=args.decode_sweep)
    if args.tunings and stage_table.available(12, track):
        tuning_seqlens = [int(x) for x in args.tuning_seqlens.split(",")]
        lines += tuning_rows(track, dtype, headdims, tuning_seqlens, record)
    state = timing.gpu_state()
    results["gpu state at end"] = state
    lines += [f"GPU at the end: {state or 'not read (no nvidia-smi)'}.", ""]
    os.makedirs(args.out, exist_ok=True)
    tag = f"{timing.file_tag(gpu)}_{date}" + ("" if args.dtype == "bf16" else f"_{args.dtype}")
    with open(os.path.join(args.out, f"bench_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"bench_{tag}.json"), "w") as f:
        json.dump(results, f, indent=1)
    if curves:
        from common.tools.plots import plot_attention_bench

        plot_attention_bench(
            curves,
            f"Attention forward on {gpu}, {date} ({args.dtype}, non-causal)",
            os.path.join(args.out, f"attention_{tag}.png"),
        )
    if any(str(r["stage"]).startswith("7 ") for r in results["rows"]):
        from common.tools.plots import plot_stage7_bench

        plot_stage7_bench(
            results["rows"],
            f"GQA, packed sequences, decode-like steps on {gpu}, {date} ({args.dtype})",
            os.path.join(args.out, f"stage7_{tag}.png"),
        )
    if any(r["stage"] == "ablation" for r in results["rows"]):
        from common.tools.plots import plot_ablation

        plot_ablation(
            results["rows"],
            f"Stages 5, 7 -> 12 on {gpu}, {date} ({args.dtype}, paper shapes)",
            os.path.join(args.out, f"ablation_{tag}.png"),
        )
    if any(r["stage"] == "13 decode" for r in results["rows"]):
        from common.tools.plots import plot_decode

        fig = plot_decode(
            results["rows"], f"Decode steps (Sq = 1, D = 128) on {gpu}, {date} ({args.dtype})"
        )
        if fig is not None:
            fig.savefig(os.path.join(args.out, f"decode_{tag}.png"), dpi=100)
    if causal_curves:
        from common.tools.plots import plot_attention_bench

        plot_attention_bench(
            causal_curves,
            f"Causal attention forward on {gpu}, {date} ({args.dtype}; stage 6/5 full: no mask)",
            os.path.join(args.out, f"causal_{tag}.png"),
        )
    print("\n".join(lines))
    print(
        f"\nwritten to {args.out}/bench_{tag}.md (+ .json{', attention_' + tag + '.png' if curves else ''}); "
        f"took {time.time() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
