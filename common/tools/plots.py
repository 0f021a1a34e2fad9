"""Figures the tools draw (matplotlib only, no GPU needed): the error heat map, the bar charts and
TMEM column maps of common.tools.notebook, and the benchmark plots of common.tools.bench. The
notebooks' own figures are in notebooks/figures/, one module per notebook; the palette and the
drawing helpers are common.tools.draw's.
"""

import matplotlib.pyplot as plt
from matplotlib.colors import LogNorm

from common.tools.draw import FIG_WIDTH, KERNEL_COLORS, C, box, finish, kernel_color


def error_heatmap(out, ref, title="|out - ref|", max_side=256, path=None):
    """|out - ref| over one 2-D slice (the last two dims), log colour scale, the worst element
    circled. For a batched output (B, H, rows, cols) the slice shown is the (b, h) that holds the
    worst element of the whole tensor, named in the title, so that the circle and the checker's
    'worst element' are the same element. Large slices are max-pooled down to max_side."""
    import torch

    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    full = (o - r).abs()
    full = torch.where(torch.isfinite(full), full, torch.full_like(full, float("inf")))
    worst = tuple(
        int(i) for i in torch.unravel_index(torch.argmax(full.nan_to_num(posinf=1e300)), full.shape)
    )
    lead = worst[:-2]
    where = ""
    if lead:
        names = ("b", "h")[: len(lead)] if len(lead) <= 2 else [f"d{i}" for i in range(len(lead))]
        where = (
            "slice "
            + ", ".join(f"{n} = {v}" for n, v in zip(names, lead))
            + f" of {' x '.join(str(s) for s in full.shape[:-2])} (the one holding the worst element)"
        )
    err = full[lead] if lead else full
    rows, cols = err.shape
    f = max(1, -(-max(rows, cols) // max_side))
    if f > 1:
        pooled = torch.nn.functional.max_pool2d(
            err[None, None].nan_to_num(posinf=1e30), f, ceil_mode=True
        )[0, 0]
    else:
        pooled = err
    fig, ax = plt.subplots(figsize=(7.5, min(7.5, max(3.6, 6.0 * rows / max(cols, 1)))))
    finite = pooled[torch.isfinite(pooled) & (pooled > 0)]
    hi = float(finite.max()) if finite.numel() else 1.0
    lo = max(float(finite.min()), hi * 1e-4) if finite.numel() else hi * 1e-4
    im = ax.imshow(
        pooled.clamp(min=lo).numpy(),
        norm=LogNorm(vmin=lo, vmax=max(hi, lo * 10)),
        cmap="viridis",
        aspect="auto",
        extent=(0, cols, rows, 0),
        interpolation="nearest",
    )
    wr, wc = worst[-2], worst[-1]
    ax.plot(wc + 0.5, wr + 0.5, marker="o", mfc="none", mec="red", ms=14, mew=2)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("absolute error", fontsize=10)
    cb.ax.tick_params(labelsize=9)
    ax.set_xlabel("column", fontsize=10)
    ax.set_ylabel("row", fontsize=10)
    ax.tick_params(labelsize=9)
    pooled_note = f" (max-pooled {f}x{f})" if f > 1 else ""
    ax.set_title(
        f"{title}{pooled_note}\n"
        + (where + "\n" if where else "")
        + f"worst at {worst}: {float(full[worst]):.3e} (circled)",
        fontsize=10,
    )
    return finish(fig, path)


def bench_bars(results, title, path=None):
    """results: {shape label: {name: TFLOP/s}} -> grouped bars, the stage's own bars first. Every
    kernel has the colour of KERNEL_COLORS in every notebook; a variant of a stage is hatched."""
    shapes = list(results)
    names = []
    for res in results.values():
        for k in res:
            if k not in names:
                names.append(k)
    names = [k for k in names if k.startswith("stage")] + [
        k for k in names if not k.startswith("stage")
    ]
    fig, ax = plt.subplots(
        figsize=(min(FIG_WIDTH, max(6.5, 1.1 * len(shapes) * len(names) + 2)), 4.3)
    )
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [si + i * width for si in range(len(shapes))]
        ys = [results[s].get(name, 0.0) for s in shapes]
        variant = name.startswith("stage") and name not in KERNEL_COLORS
        bars = ax.bar(
            xs,
            ys,
            width,
            label=name,
            color=kernel_color(name),
            hatch="//" if variant else None,
            edgecolor="white" if variant else None,
        )
        for x, v in zip(xs, ys):
            if v:
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
        if name.startswith("stage"):
            for b in bars:
                b.set_edgecolor("black")
                b.set_linewidth(1.5)
    ax.set_xticks([si + 0.4 - width / 2 for si in range(len(shapes))], shapes, fontsize=9)
    ax.set_ylabel("TFLOP/s", fontsize=10)
    ax.tick_params(axis="y", labelsize=9)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return finish(fig, path)


def tmem_columns(
    regions=(("S", 0, 128, "fp32"), ("P", 32, 64, "bf16 x2"), ("O", 128, 128, "fp32")),
    alloc_cols=256,
    total_cols=512,
    lanes=128,
    title=None,
    path=None,
):
    """Tensor memory of one SM: 128 lanes x 512 columns of 32 bits. A row of a 128-row tile lives
    in one lane; warp w (w % 4 within its warpgroup) may access lanes 32 (w % 4) .. 32 (w % 4) + 31
    only, so softmax warps 0-3 own rows 0-31, ..., 96-127, one row per thread. An fp32 tile of N
    columns uses N columns; bf16 P packs two values per column (N/2 columns) and is written over
    S, which it replaces. regions: (name, first column, number of columns, what)."""
    colors = {"S": C["s"], "P": C["p"], "O": C["o"], "C": C["c"], "acc": C["c"]}
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 3.9))
    box(ax, 0, 0, total_cols, lanes, "#FAFAFA", lw=0.8)
    box(ax, 0, 0, alloc_cols, lanes, "#F0F0F0", lw=0.8)
    for w in range(4):
        ax.plot([0, total_cols], [32 * w, 32 * w], color="#999999", lw=0.5)
        ax.text(
            -4,
            32 * w + 16,
            f"warp {w}\nlanes {32 * w}-{32 * w + 31}",
            ha="right",
            va="center",
            fontsize=9,
        )
    overlays = [(s, s + w) for n, s, w, _ in regions if n == "P"]
    for name, start, width, what in regions:
        overlay = name == "P"
        box(
            ax,
            start,
            0,
            width,
            lanes,
            colors.get(name, "#999999"),
            alpha=0.45 if overlay else 0.75,
            hatch="///" if overlay else None,
            lw=1.5 if overlay else 0.8,
        )
        # the label goes over the widest part of the region that P does not cover
        a, b = start, start + width
        if not overlay:
            for pa, pb in overlays:
                if pa <= a < pb:
                    a = min(pb, b)
                elif a < pa < b and pa - a < b - pb:
                    a = min(pb, b)
                elif a < pa < b:
                    b = pa
        ax.text(
            (a + b) / 2,
            lanes * (0.3 if overlay else 0.7),
            f"{name}\ncols {start}-{start + width - 1}\n{what}",
            ha="center",
            va="center",
            fontsize=9.5,
            color="black",
            fontweight="bold",
        )
    ax.text(
        alloc_cols + (total_cols - alloc_cols) / 2,
        lanes / 2,
        f"not allocated\n(tcgen05.alloc takes a power\nof 2 >= 32 columns: {alloc_cols})",
        ha="center",
        va="center",
        fontsize=9,
        color="#555555",
    )
    ax.set_xlim(-80, total_cols + 5)
    ax.set_ylim(lanes + 5, -5)
    ax.set_xticks([0, 64, 128, 192, 256, 320, 384, 448, 512])
    ax.tick_params(labelsize=9)
    ax.set_xlabel("TMEM column (32 bits each)", fontsize=10)
    ax.set_yticks([])
    ax.set_title(
        title or "Tensor memory (TMEM): 128 lanes x 512 columns x 32 bit = 256 KiB per SM",
        fontsize=10,
    )
    return finish(fig, path)


def _curve(ax, xs, ys, name, drawn=None, stage_width=2.5, **style):
    """One kernel's curve: in its KERNEL_COLORS colour (that of `drawn`, if given), the stages
    thick and the baselines thin."""
    drawn = drawn or name
    width = stage_width if drawn.startswith("stage") else 1.2
    ax.plot(xs, ys, marker="o", label=name, color=kernel_color(drawn), linewidth=width, **style)


def _log2_axes(ax, xlabel, ylabel, title, title_size=11):
    """A panel of curves against a length on a log-2 axis."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    ax.set_title(title, fontsize=title_size)
    ax.grid(alpha=0.3)


def plot_attention_bench(curves, title, path=None):
    """curves: {(D, label): [(S, tflops), ...]} -> one panel per head dim, TFLOP/s against S, each
    kernel in its KERNEL_COLORS colour."""
    dims = sorted({d for d, _ in curves})
    fig, axes = plt.subplots(
        1, len(dims), figsize=(min(FIG_WIDTH * 1.2, 6 * len(dims)), 4), squeeze=False
    )
    for ax, D in zip(axes[0], dims):
        for (d, label), pts in sorted(curves.items(), key=lambda kv: kv[0][1]):
            if d != D:
                continue
            _curve(ax, *zip(*pts), label)
        _log2_axes(ax, "sequence length S", "TFLOP/s", f"D = {D}")
        ax.legend(fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def plot_ablation(rows, title, path=None):
    """The stage 5, 7 -> 12 ablation of `make bench` (rows of stage "ablation": shape (B, H, S,
    S, D, causal) and TFLOP/s per kernel; stage 7 where the run has it): one panel per (D,
    causal), TFLOP/s against S, the
    stages thick and the baselines (FA4, SDPA cuDNN) thin."""
    rows = [r for r in rows if r["stage"] == "ablation"]
    panels = sorted({(r["shape"][4], bool(r["shape"][5])) for r in rows})
    fig, axes = plt.subplots(
        1, len(panels), figsize=(min(FIG_WIDTH * 1.4, 4.2 * len(panels)), 3.8), squeeze=False
    )
    names = tuple(f"stage {n}" for n in (5, 7, 8, 9, 10, 11, 12)) + ("FA4", "SDPA cuDNN")
    for ax, (D, causal) in zip(axes[0], panels):
        mine = sorted(
            (r for r in rows if (r["shape"][4], bool(r["shape"][5])) == (D, causal)),
            key=lambda r: r["shape"][2],
        )
        for name in names:
            pts = [(r["shape"][2], r["tflops"][name]) for r in mine if name in r["tflops"]]
            if not pts:
                continue
            _curve(ax, *zip(*pts), name)
        masked = "causal" if causal else "non-causal"
        _log2_axes(ax, "sequence length S", "TFLOP/s", f"D = {D}, {masked}")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def plot_decode(rows, title, path=None):
    """Stage 13's decode steps of `make bench` (rows "13 decode" and "13 decode GPU": shape (B,
    H, Hkv, Sq, Sk, D) and GB/s of K and V per kernel): GB/s against Sk for each batch size with
    at least three lengths, heads 32/8, calls back to back (top) and GPU time alone (bottom).
    Stage 14's page sizes ("14 pN") are drawn in stage 14's colour, one dash pattern each."""
    kinds = [("13 decode", "calls back to back"), ("13 decode GPU", "GPU time alone")]
    heads = [r for r in rows if r["stage"] in dict(kinds) and tuple(r["shape"][1:3]) == (32, 8)]
    batches = sorted(
        b
        for b in {r["shape"][0] for r in heads}
        if len({r["shape"][4] for r in heads if r["shape"][0] == b}) >= 3
    )
    kinds = [k for k in kinds if any(r["stage"] == k[0] for r in heads)]
    if not batches or not kinds:
        return None
    fig, axes = plt.subplots(
        len(kinds),
        len(batches),
        figsize=(min(FIG_WIDTH, max(7.5, 5.5 * len(batches))), 3.6 * len(kinds)),
        squeeze=False,
    )
    dashes = {"14 p16": (1, 1), "14 p64": (4, 2), "14 p128": (6, 2, 1, 2), "14 p256": (8, 3)}
    for row_axes, (kind, label) in zip(axes, kinds):
        for ax, B in zip(row_axes, batches):
            mine = sorted(
                (r for r in heads if r["stage"] == kind and r["shape"][0] == B),
                key=lambda r: r["shape"][4],
            )
            names = []
            for r in mine:
                names += [n for n in r["tflops"] if n not in names]
            for name in names:
                pts = [(r["shape"][4], r["tflops"][name]) for r in mine if name in r["tflops"]]
                drawn = "stage 14" if name.startswith("14 p") else name
                _curve(ax, *zip(*pts), name, drawn, 2.2, markersize=3, dashes=dashes.get(name, ()))
            panel = f"B = {B}, heads 32/8: {label}"
            _log2_axes(ax, "keys per sequence Sk", "GB/s of K and V", panel, title_size=10)
    legend = {}  # every panel's kernels, in the order they first appear
    for ax in axes.flat:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=5, fontsize=9)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.18 / len(kinds), 1, 1))  # the legend's two lines: 0.65 inch
    if path:
        fig.savefig(path, dpi=100)
    return fig


def plot_stage7_bench(rows, title, path=None):
    """Stage 7's rows of a `make bench` run (the json's "rows"; stage 12 beside stage 7
    where the run has them): GQA against MHA and the
    baselines (TFLOP/s), packed sequences against FA4's varlen and the padded batch (useful
    TFLOP/s), decode-like steps with and without pack-GQA (microseconds). One panel each."""
    gqa = [r for r in rows if r["stage"] == "7 gqa"]
    var = [r for r in rows if r["stage"] == "7 varlen"]
    dec = [r for r in rows if r["stage"] == "7 decode"]
    panels = [p for p in (gqa, var, dec) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)

    def bars(ax, groups, labels, values, ylabel, title_):
        width = 0.8 / len(labels)
        for i, lab in enumerate(labels):
            ys = [v.get(lab, 0.0) for v in values]
            xs = [g + (i - (len(labels) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, ys, width, label=lab, color=kernel_color(lab))
        ax.set_xticks(range(len(groups)), groups, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=10)
        ax.set_title(title_, fontsize=11)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)

    it = iter(axes[0])
    if gqa:
        groups = [f"S={r['shape'][3]}" + (" causal" if r["shape"][5] else "") for r in gqa]
        names = ("stage 7 GQA", "stage 12 GQA", "stage 7 MHA", "stage 12 MHA", "FA4", "SDPA cuDNN")
        labels = [n for n in names if n in gqa[0]["tflops"]]
        bars(next(it), groups, labels, [r["tflops"] for r in gqa], "TFLOP/s", "GQA 32/8, D = 128")
    if var:
        groups = ["causal" if r["shape"][4] else "non-causal" for r in var]
        names = {f"stage {n}": f"stage {n} varlen" for n in (7, 12)}
        names |= {"FA4": "FA4 varlen", "padded": "padded SDPA cuDNN"}
        names = {k: n for k, n in names.items() if k in var[0]["tflops"]}
        vals = [{names[k]: v for k, v in r["tflops"].items() if k in names} for r in var]
        bars(next(it), groups, list(names.values()), vals, "useful TFLOP/s", "16 packed sequences")
    if dec:
        groups = [f"Sq={r['shape'][3]}" for r in dec]
        names = {
            "packed": "stage 7 pack-GQA",
            "unpacked": "stage 7 unpacked",
            "stage 12": "stage 12",
            "FA4": "FA4",
            "SDPA": "SDPA",
        }
        names = {k: n for k, n in names.items() if k in dec[0]["ms"]}
        vals = [{names[k]: v * 1e3 for k, v in r["ms"].items() if k in names} for r in dec]
        bars(
            next(it),
            groups,
            list(names.values()),
            vals,
            "microseconds (lower is better)",
            "decode-like, Sk = 8192",
        )
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def main(argv=None):
    """Draw a run's figures again from its .json: python -m common.tools.plots RUN.json
    [OUT_DIR] (OUT_DIR: RUN.json's folder unless given). ablation_X.json draws ablation_X.png
    and decode_X.json decode_X.png, the names docs/results/ gives them; any other RUN.json
    (bench_*, tunings_*) draws ablation_RUN.png and decode_RUN.png, so that no run's figure
    takes the name of another run's. Each where the run has those rows."""
    import json
    import os
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(main.__doc__)
        return 2
    path = argv[0]
    out = argv[1] if len(argv) > 1 else os.path.dirname(path) or "."
    with open(path) as f:
        run = json.load(f)
    rows = run.get("rows") if isinstance(run, dict) else None
    if not isinstance(rows, list):
        print(f"{path}: not a `make bench` run (no list of rows)")
        return 1
    rows = [r for r in rows if isinstance(r, dict) and {"stage", "shape", "tflops"} <= set(r)]
    stem = os.path.splitext(os.path.basename(path))[0]

    def name(kind):
        return os.path.join(
            out, (stem if stem.startswith(kind + "_") else f"{kind}_{stem}") + ".png"
        )

    about = f"{run.get('gpu', '?')}, {run.get('date', '?')}"
    # make bench's --dtype: bf16, or fp16 with the tag _fp16 (the .json does not say)
    dtype = "fp16" if "fp16" in stem.split("_") else "bf16"
    written = []
    if any(r["stage"] == "ablation" for r in rows):
        written.append(name("ablation"))
        plot_ablation(rows, f"Stages 5, 7 -> 12 on {about} ({dtype}, paper shapes)", written[-1])
    fig = plot_decode(rows, f"Decode steps (Sq = 1, D = 128) on {about} ({dtype})")
    if fig is not None:
        written.append(name("decode"))
        fig.savefig(written[-1], dpi=100)
    if not written:
        print(f"{path}: no ablation rows, nor decode rows of 3 lengths or more at one B")
        return 1
    print("written: " + ", ".join(written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
