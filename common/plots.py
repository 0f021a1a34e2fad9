"""Plotting helpers for notebooks and benchmarks (matplotlib only)."""
import matplotlib

matplotlib.use("Agg") if matplotlib.get_backend().lower() in ("", "agg") else None
import matplotlib.pyplot as plt  # noqa: E402


def plot_attention_bench(curves, title, path=None):
    """curves: {(D, label): [(S, tflops), ...]} -> one panel per head dim, TFLOP/s against S."""
    dims = sorted({d for d, _ in curves})
    fig, axes = plt.subplots(1, len(dims), figsize=(6 * len(dims), 4), squeeze=False)
    for ax, D in zip(axes[0], dims):
        for (d, label), pts in sorted(curves.items(), key=lambda kv: kv[0][1]):
            if d != D:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=label, linewidth=2.5 if label.startswith("stage") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"D = {D}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
