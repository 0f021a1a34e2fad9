"""Figures of notebook 9 (overlap): persistent CTAs, consumer warpgroups and dynamic tiles against
S; the schedule model, timelines, TMEM and MMA issue orders of notebook 8.
"""

from common.tools.draw import kernel_color
from notebooks.figures.stage8 import Deadlock as Deadlock
from notebooks.figures.stage8 import attention_schedule as attention_schedule
from notebooks.figures.stage8 import hopper_unit_times as hopper_unit_times
from notebooks.figures.stage8 import mma_issue_orders as mma_issue_orders
from notebooks.figures.stage8 import pingpong_timelines as pingpong_timelines
from notebooks.figures.stage8 import tflops_against_s
from notebooks.figures.stage8 import tmem_two_tiles as tmem_two_tiles


def persistent_ctas(rows, title=None, path=None):
    """Stage 9's persistent CTAs as measured (rows of docs/results/
    bench_h200_2026-12-01_persistent.json: D, S, causal and TFLOP/s per variant): one panel per
    (D, causal), TFLOP/s against S for the kernel before the tile loop ("before"), with it
    ("persistent": capped grid where tiles have equal work), the capped grid forced on causal
    ("forced persistent") and FA4."""
    keys = sorted({(r["D"], bool(r["causal"])) for r in rows}, key=lambda p: (-p[0], p[1]))
    panels = [
        (
            f"D = {D}, {'causal' if causal else 'non-causal'} "
            f"({'one CTA per tile' if causal else 'grid capped'})",
            [r for r in rows if (r["D"], bool(r["causal"])) == (D, causal)],
        )
        for D, causal in keys
    ]
    styles = {
        "before": ("one CTA per tile (before the loop)", "#8C8C8C", 2.0),
        "persistent": ("stage 9 with the tile loop", kernel_color("stage 9"), 2.5),
        "forced persistent": ("capped grid forced on", "#C44E52", 1.5),
        "FA4": ("FA4", kernel_color("FA4"), 1.2),
    }
    return tflops_against_s(
        panels, styles, title or "Stage 9 with and without persistent CTAs", path, 4.2
    )


def dynamic_tiles(rows, title=None, path=None):
    """Stage 9's dynamic tile scheduler as measured (rows of docs/results/
    dynamic_h200_2026-12-01.json: D, S, causal and TFLOP/s per variant): one panel per D, causal
    rows only, TFLOP/s against S for one CTA per tile, the dynamic scheduler and FA4."""
    mine = [r for r in rows if r["causal"]]
    panels = [
        (f"D = {D}, causal", [r for r in mine if r["D"] == D])
        for D in sorted({r["D"] for r in mine}, reverse=True)
    ]
    styles = {
        "one CTA per tile": ("one CTA per tile (before)", "#8C8C8C", 2.0),
        "dynamic": ("dynamic scheduler (stage 9 now)", kernel_color("stage 9"), 2.5),
        "FA4": ("FA4", kernel_color("FA4"), 1.2),
    }
    default = "Stage 9 causal: one CTA per tile against the dynamic tile scheduler"
    return tflops_against_s(panels, styles, title or default, path)


def consumer_warpgroups(rows, title=None, path=None):
    """Stage 9 at D = 64 with three consumer warpgroups (192-row Q tile) and two (128 rows), as
    measured (rows of docs/results/bench_h200_2026-12-01_3wg.json: D, S, causal, dtype and
    TFLOP/s per kernel, "3wg", "2wg", "stage8", "FA4"): one panel per causal setting, bf16 and
    D = 64 only, TFLOP/s against S."""
    mine = [r for r in rows if r["D"] == 64 and r.get("dtype", "bfloat16") == "bfloat16"]
    panels = [
        (
            f"D = 64, {'causal' if causal else 'non-causal'}",
            [r for r in mine if bool(r["causal"]) == causal],
        )
        for causal in sorted({bool(r["causal"]) for r in mine})
    ]
    styles = {
        "3wg": ("stage 9, three consumer warpgroups (192 rows)", kernel_color("stage 9"), 2.5),
        "2wg": ("stage 9, two (128 rows)", "#8C8C8C", 2.0),
        "stage8": ("stage 8", kernel_color("stage 8"), 1.2),
        "FA4": ("FA4", kernel_color("FA4"), 1.2),
    }
    default = "Stage 9 at D = 64: three consumer warpgroups against two"
    legend = dict(fontsize=7, loc="lower right")
    return tflops_against_s(panels, styles, title or default, path, legend=legend)
