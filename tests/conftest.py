"""GPU tests carry a marker naming the track they need (gpu_hopper, gpu_blackwell; gpu_any for
a CUDA GPU of either track); on any other machine they are skipped with the reason, so the
compile-only and harness tests still run in CI. A GPU run selects them with
-m "gpu_hopper or gpu_any" (make test-gpu: all three)."""

import os

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
os.environ.setdefault("MPLBACKEND", "Agg")

from common import outputs  # noqa: E402
from common.arch import gpu_description, gpu_track_available  # noqa: E402

# Every output an entry point allocates is filled with NaN before its launch (common/outputs.py):
# an element a kernel fails to write fails the check.
outputs.set_poison(True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu_any" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (any)"))
        for track, marker in (("hopper", "gpu_hopper"), ("blackwell", "gpu_blackwell")):
            if marker in item.keywords and not gpu_track_available(track):
                need = (
                    "an sm_90 GPU (H100/H200)"
                    if track == "hopper"
                    else "an sm_100/sm_103 GPU (B200/GB200/B300)"
                )
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"{track} GPU test: needs {need}, this machine has {gpu_description()}"
                    )
                )


def pytest_report_header(config):
    return f"GPU: {gpu_description()}"
