"""The single source of notebooks/stage*.ipynb (nbformat 4, committed without outputs).

Edit the stageN.py files here, then `make notebooks-source` (python notebooks/source/gen.py) to
rewrite the notebooks; tests/test_notebooks.py checks that the committed notebooks are exactly what
this generates, so the two never drift.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common_cells import HOW_TO_RUN, NB, blackwell_intro, setup  # noqa: E402
from stage1 import stage1  # noqa: E402
from stage2 import stage2  # noqa: E402
from stage3 import stage3  # noqa: E402
from stage4 import stage4  # noqa: E402
from stage5 import stage5  # noqa: E402

NAMES = {
    1: "stage1_gemm",
    2: "stage2_qk",
    3: "stage3_softmax",
    4: "stage4_kv_interleave",
    5: "stage5_online_softmax",
}


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for n, build in ((1, stage1), (2, stage2), (3, stage3), (4, stage4), (5, stage5)):
        nb = NB(n)
        build(nb, setup=setup, how_to_run=HOW_TO_RUN, blackwell_intro=blackwell_intro)
        path = os.path.join(out_dir, f"{NAMES[n]}.ipynb")
        nb.write(path)
        print(f"wrote {path}: {len(nb.cells)} cells")


if __name__ == "__main__":
    main(
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )
