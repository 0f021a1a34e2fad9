"""The palette and drawing helpers every figure shares: the notebooks' (notebooks/figures/) and
the tools' (common/tools/plots.py). matplotlib only, no GPU needed.

Each figure function returns its matplotlib Figure. Figures are at most FIG_WIDTH inches wide and
no label is smaller than MIN_FONT points, so that they stay readable at notebook size (a notebook
shows a figure about 8-10 inches wide; the executed copies store them at 80 dpi).
"""

from matplotlib.patches import FancyArrowPatch, Rectangle

FIG_WIDTH = 11.0
MIN_FONT = 9.0
MONO = "monospace"

# One palette for all pictures: the same thing has the same colour everywhere.
C = {
    "q": "#4C72B0",
    "k": "#DD8452",
    "v": "#55A868",
    "s": "#C44E52",
    "p": "#8172B3",
    "o": "#937860",
    "a": "#4C72B0",
    "b": "#DD8452",
    "c": "#C44E52",
    "load": "#64B5CD",
    "resident": "#D6EAF8",
    "mma": "#DD8452",
    "softmax": "#8172B3",
    "wait": "#BBBBBB",
    "race": "#E41A1C",
    "free": "#FFFFFF",
    "grid": "#444444",
    "desc": "#F2C14E",
}
WARP_COLORS = ("#FBE3D6", "#DCEAF7", "#E2F0D9", "#EDE1F5")
LANE_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")

# One colour per kernel across every notebook and benchmark plot: a baseline keeps its colour
# whichever stage it is timed against.
KERNEL_COLORS = {
    "stage 1": "#E377C2",
    "stage 2": "#BCBD22",
    "stage 3": "#17BECF",
    "stage 4": "#9467BD",
    "stage 5": "#D62728",
    "stage 6": "#B07AA1",
    "stage 7": "#EDC948",
    "stage 8": "#17344F",
    "stage 9": "#8C1D40",
    "stage 10": "#E15759",
    "stage 11": "#59A14F",
    "stage 12": "#000000",
    "stage 13": "#6A3D9A",
    "stage 14": "#76B7B2",
    "stage 7 MHA": "#F5DE8A",
    "stage 7 unpacked": "#C9A227",
    "padded SDPA cuDNN": "#98DF8A",
    "SDPA": "#66C2A5",
    "cuBLAS (torch.matmul)": "#7F7F7F",
    "SDPA flash": "#1F77B4",
    "SDPA cuDNN": "#2CA02C",
    "FA4": "#FF7F0E",
}


def kernel_color(name):
    """The colour of a kernel in every bar chart and curve: its own, or its stage's for a variant
    ("stage 1 (ab_buffers=2)" is drawn in stage 1's colour, hatched)."""
    if name in KERNEL_COLORS:
        return KERNEL_COLORS[name]
    for key, col in KERNEL_COLORS.items():
        if name.startswith(key + " "):
            return col
    return "#8C564B"


def fs(size):
    """A font size no smaller than MIN_FONT."""
    return max(MIN_FONT, size)


def box(
    ax,
    x,
    y,
    w,
    h,
    fc,
    ec="black",
    lw=0.8,
    text=None,
    fontsize=MIN_FONT,
    alpha=1.0,
    hatch=None,
    tc="black",
    **kw,
):
    """A rectangle with its lower-left corner at (x, y), optionally labelled in its centre."""
    ax.add_patch(
        Rectangle(
            (x, y), w, h, facecolor=fc, edgecolor=ec, linewidth=lw, alpha=alpha, hatch=hatch, **kw
        )
    )
    if text is not None:
        ax.text(
            x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs(fontsize), color=tc
        )


def finish(fig, path=None, rect=None):
    """Lay the figure out, save it to `path` if given, and return it."""
    if rect is None:
        fig.tight_layout()
    else:
        fig.tight_layout(rect=rect)
    if path:
        fig.savefig(path, dpi=100)
    return fig


def arrow(ax, a, b, text=None, style="->", color="black", lw=1.2, fontsize=MIN_FONT, dy=0.0, **kw):
    """An arrow from a to b, optionally labelled at its middle (raised by dy)."""
    ax.add_patch(
        FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=13, lw=lw, color=color, **kw)
    )
    if text:
        ax.text(
            (a[0] + b[0]) / 2,
            (a[1] + b[1]) / 2 + dy,
            text,
            fontsize=fs(fontsize),
            ha="center",
            va="center",
            color=color,
            bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85),
        )
