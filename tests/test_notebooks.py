"""The notebooks: committed without outputs, in the fixed order of STYLE.md, importing (never
pasting) the kernels, and executable end to end by common/nbrun.py.

Without a GPU (CI) every notebook runs in compile-only mode: its stage is compiled for sm_90a and
sm_100a and the GPU cells say they are skipped. On an H100/H200 the same test runs the notebooks in
GPU mode, where the "Run and verify" cell must launch the Hopper kernel and pass the checker, and
the "Measure" cell must time it."""

import json
import os
import re

import pytest

from common import arch, stages
from common.nbrun import run_notebook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = {
    1: "stage1_gemm.ipynb",
    2: "stage2_qk.ipynb",
    3: "stage3_softmax.ipynb",
    4: "stage4_kv_interleave.ipynb",
    5: "stage5_online_softmax.ipynb",
}
# STYLE.md rule 7: the fixed order of the sections (level-2 headings).
SECTIONS = (
    "Objectives",
    "Previous stage recap",
    "The math",
    "What changes",
    "Walkthrough",
    "Run and verify",
    "Measure",
    "Exercises",
)


def load(name):
    with open(os.path.join(NB_DIR, name)) as f:
        return json.load(f)


def test_every_stage_has_a_notebook():
    assert set(NOTEBOOKS.values()) <= set(os.listdir(NB_DIR))
    assert sorted(s.number for s in stages.STAGES) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(NB_DIR) if f.endswith(".ipynb")))
def test_committed_without_outputs(name):
    nb = load(name)
    assert nb["nbformat"] == 4
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], (
                f"{name} cell {i} has outputs: clear them before committing"
            )
            assert cell.get("execution_count") is None, f"{name} cell {i} has an execution count"


@pytest.mark.parametrize("stage", sorted(NOTEBOOKS))
def test_structure(stage):
    nb = load(NOTEBOOKS[stage])
    md = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    headings = [re.sub(r"^\d+\.\s*", "", h).strip() for h in re.findall(r"^## (.+)$", md, re.M)]
    found = [h for h in headings if any(h.startswith(s) for s in SECTIONS)]
    assert [next(s for s in SECTIONS if h.startswith(s)) for h in found] == list(SECTIONS), (
        f"sections of {NOTEBOOKS[stage]} must be, in order: {', '.join(SECTIONS)}; found {headings}"
    )
    assert "Blackwell" in md and "compile-checked here, not run on hardware" in md
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        # Cells run under a plain exec runner: no IPython magics or shell escapes.
        assert not re.search(r"^\s*[%!]", src, re.M), (
            f"cell {i} uses an IPython magic or shell escape"
        )
        # Notebooks import and display the stage code; they never paste kernels.
        assert "@cute.kernel" not in src and "@cute.jit" not in src, f"cell {i} pastes kernel code"
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for call in (
        f"nb.start({stage})",
        f"nb.run_and_verify({stage}",
        f"nb.measure({stage}",
        f'nb.compile_summary({stage}, "blackwell")',
        f"nb.show_cross_track_diff({stage}",
    ):
        assert call in code, f"{NOTEBOOKS[stage]} never calls {call}...)"
    if stage > 1:
        assert f'nb.show_diff({stage}, "hopper")' in code


@pytest.mark.parametrize("stage", sorted(NOTEBOOKS))
def test_notebook_runs(stage, capsys):
    from common import notebook as nb

    run_notebook(os.path.join(NB_DIR, NOTEBOOKS[stage]), verbose=False)
    log = nb.LOG
    assert log["stage"] == stage
    assert not log["errors"], "the notebook reported problems:\n" + "\n".join(
        map(str, log["errors"])
    )
    gpu_track = arch.track() if nb.MODE == "gpu" else None
    for track in arch.TRACKS:
        # In GPU mode the GPU's own track is compiled by the real launch (checked as 'verified'
        # below); every other track must show its compile-only summary.
        if stages.available(stage, track) and track != gpu_track:
            assert (stage, track) in log["compiled"], (
                f"stage {stage} ({track}) was not compiled by its notebook"
            )
    if nb.MODE == "gpu":
        track = arch.track()
        if stages.available(stage, track):
            assert any(v[0] == stage and v[1] == track for v in log["verified"]), (
                f"GPU mode: the notebook did not run and check stage {stage} on {track}"
            )
            assert (stage, track) in log["measured"], (
                f"GPU mode: the notebook did not measure stage {stage}"
            )
    else:
        out = capsys.readouterr().out
        assert "Run and verify skipped" in out and "Measure skipped" in out


# The pictures must be correct to the hardware: their layouts are checked against CuTe's own.


def test_wgmma_fragments_match_cute_atoms():
    """plots draws the wgmma m64nNk16 accumulator and register-A fragments from thread-value
    layouts; they must be the ones CuTe DSL builds for sm_90a (traced on the CPU, no GPU)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from common import plots

    got = {}

    @cute.jit
    def trace():
        for n in (64, 128, 256):
            mma = sm90_utils.make_trivial_tiled_mma(
                cutlass.BFloat16,
                cutlass.BFloat16,
                OperandMajorMode.K,
                OperandMajorMode.K,
                cutlass.Float32,
                (1, 1, 1),
                tiler_mn=(64, n),
            )
            got[n] = str(mma.tv_layout_C)
        mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16,
            cutlass.BFloat16,
            OperandMajorMode.K,
            OperandMajorMode.MN,
            cutlass.Float32,
            (1, 1, 1),
            tiler_mn=(64, 128),
            a_source=warpgroup.OperandSource.RMEM,
        )
        got["a"] = str(mma.tv_layout_A)

    cute.compile(trace, options="--gpu-arch sm_90a")
    for n in (64, 128, 256):
        assert got[n] == plots.layout_str(*plots.wgmma_c_tv(n))
    assert got["a"] == plots.layout_str(*plots.wgmma_a_rs_tv())
    # The PTX ISA's rule: thread t of warp w holds rows 16 w + t / 4 (+ 8), columns 2 (t % 4) + 8 i + {0, 1}.
    for t in range(128):
        w, lane = divmod(t, 32)
        want = {
            (16 * w + lane // 4 + 8 * h, 2 * (lane % 4) + 8 * i + e)
            for i in range(16)
            for h in (0, 1)
            for e in (0, 1)
        }
        assert {(r, c) for _, r, c in plots.wgmma_c_coords(t, 128)} == want


def test_swizzle_is_tma_128b():
    from common import plots

    for r in range(16):
        for c in range(8):
            assert plots.swizzle_128b_chunk(r, c) == c ^ (r % 8)
    # chunk c of 8 consecutive rows lands in 8 different chunks: all 32 banks, no conflict
    for c in range(8):
        assert sorted(plots.swizzle_128b_chunk(r, c) for r in range(8)) == list(range(8))


def test_ring_model_finds_the_race():
    from common import plots

    for slot_per in ("tile", "entry"):
        for two_pass in (True, False):
            loads, ops, wait = plots.kv_ring_schedule(4, 2, two_pass, True, slot_per)
            assert plots.simulate_ring(loads, ops, wait_for_release=wait)["races"] == []
    loads, ops, wait = plots.kv_ring_schedule(3, 2, True, v_waits_for_release=False)
    assert plots.simulate_ring(loads, ops, wait_for_release=wait)["races"]
    # A consumer waiting for a tile the producer can never load is reported, not hung on.
    with pytest.raises(plots.Deadlock):
        plots.simulate_ring(
            [("A", 0), ("B", 0)], [("MMA", "x", 1.0, ["B"], []), ("MMA", "y", 1.0, ["A"], ["A"])]
        )


def test_committed_notebooks_are_what_their_source_generates(tmp_path):
    """notebooks/source/*.py is the single source of the notebooks: regenerate and compare."""
    import subprocess
    import sys

    gen = os.path.join(NB_DIR, "source", "gen.py")
    subprocess.run([sys.executable, gen, str(tmp_path)], check=True, capture_output=True)
    for name in sorted(NOTEBOOKS.values()):
        with open(os.path.join(NB_DIR, name), "rb") as a, open(tmp_path / name, "rb") as b:
            assert a.read() == b.read(), (
                f"{name} differs from notebooks/source: edit the source, then `make notebooks-source`"
            )
