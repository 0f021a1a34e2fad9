"""common.tools.clock_probe's CPU side: parsing nvidia-smi's samples and the statistics of a window."""

from datetime import datetime

from common.tools.clock_probe import parse_samples, window_stats


def _ts(s):
    return datetime.strptime(s, "%Y/%m/%d %H:%M:%S.%f").timestamp()


LINES = [
    "timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu, clocks_event_reasons.active\n",
    "2026/12/03 08:00:00.000, 1980, 300.5, 40, 0x0000000000000000\n",
    "2026/12/03 08:00:00.500, 1755, 690.0, 55, 0x0000000000000004\n",
    "2026/12/03 08:00:00.520, 1740, 699.0, 56, 0x0000000000000004\n",
    "2026/12/03 08:00:00.540, 1800, 650.0, 56, 0x0000000000000000\n",
    "2026/12/03 08:00:00.56",  # cut off when nvidia-smi was stopped
]


def test_parse_samples_skips_the_header_and_a_cut_off_line():
    s = parse_samples(LINES)
    assert len(s) == 4
    assert s[1] == (_ts("2026/12/03 08:00:00.500"), 1755.0, 690.0, 55.0, "0x0000000000000004")


def test_window_stats_takes_medians_inside_the_window_after_settling():
    s = parse_samples(LINES)
    t0 = _ts("2026/12/03 08:00:00.000")
    # the first sample falls in the settling time and is left out
    clk, pw, n, reasons = window_stats(t0, _ts("2026/12/03 08:00:00.540"), s, settle_s=0.3)
    assert (clk, pw, n) == (1755.0, 690.0, 3)
    assert reasons == ["0x0000000000000000", "0x0000000000000004"]
    assert window_stats(t0, t0 + 0.1, s, settle_s=0.3) == (None, None, 0, [])


def test_without_a_gpu_it_says_so():
    import pytest
    import torch

    from common.tools.clock_probe import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the probe would run")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--out", "/tmp/clock_probe_test.json"])
