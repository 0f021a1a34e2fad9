"""Cell builders shared by the notebook generators."""

import json
import textwrap


class NB:
    def __init__(self, stage):
        self.stage = stage
        self.cells = []

    def md(self, text):
        self.cells.append(("markdown", textwrap.dedent(text).strip("\n")))

    def code(self, text):
        self.cells.append(("code", textwrap.dedent(text).strip("\n")))

    def write(self, path):
        cells = []
        for i, (kind, src) in enumerate(self.cells):
            lines = src.splitlines(keepends=True)
            cell = {
                "cell_type": kind,
                "id": f"stage{self.stage}-{i:02d}",
                "metadata": {},
                "source": lines,
            }
            if kind == "code":
                cell["execution_count"] = None
                cell["outputs"] = []
            cells.append(cell)
        nb = {
            "cells": cells,
            "metadata": {
                "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                "language_info": {"name": "python", "pygments_lexer": "ipython3"},
            },
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        with open(path, "w") as f:
            json.dump(nb, f, indent=1, ensure_ascii=False)
            f.write("\n")


def setup(nb, stage):
    nb.code(f"""
        # Setup: this notebook lives in notebooks/; the repository root holds `common` and `stages`.
        import os
        import sys

        ROOT = os.path.abspath("..")
        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)

        import torch

        from common import notebook as nb, plots

        nb.start({stage})
        """)


HOW_TO_RUN = """
Run it from `notebooks/` in Jupyter, or headless with `make notebooks` (the same cells, executed in
order by `common/nbrun.py`). On a machine with an H100/H200 the cells under *Run and verify* and
*Measure* launch the kernel and check it; anywhere else they say they are skipped and show what the
compiler produced instead (every stage compiles for sm_90a and sm_100a without a GPU).
"""


def blackwell_intro(nb, sub, pkg, extra=""):
    extra = (
        textwrap.indent(textwrap.dedent(extra).strip(), " " * 8).lstrip() + "\n" if extra else ""
    )
    nb.md(f"""
        ### 5.{sub} The same stage on Blackwell

        `stages/{pkg}/blackwell.py` computes the same thing on sm_100a (B200, GB200) with a different
        machine model:

        - **Registers -> tensor memory.** The accumulator of `tcgen05.mma` lives in TMEM, 128 lanes x 512
          columns of 32 bits per SM, not in the registers of the threads that issued the MMA. Threads
          reach it with `tcgen05.ld` / `tcgen05.st`; a warp may touch only its quarter of the lanes
          (warp w % 4 owns lanes 32 (w % 4) ... 32 (w % 4) + 31), so row r of a 128-row tile belongs to
          one thread.
        - **One thread issues the MMA.** On Hopper a whole warpgroup issues `wgmma` and owns its result;
          on Blackwell one thread of the MMA warp issues `tcgen05.mma` for the whole 128-row tile and
          `tcgen05.commit` makes an mbarrier fire when the MMAs are done.
        - **Warp roles.** 6 warps, 192 threads: warps 0-3 softmax and epilogue (one TMEM lane, i.e. one
          row, per thread), warp 4 issues the MMAs, warp 5 issues the TMA loads. They hand work to
          each other only through mbarriers.
        {extra}
        **Blackwell kernels are compile-checked here, not run on hardware.** This project has an H200; the
        Blackwell files are compiled for sm_100a with fake tensors and their PTX is checked for the
        `tcgen05` instructions. Their numerics are tested only where an sm_100 GPU exists.
        """)
