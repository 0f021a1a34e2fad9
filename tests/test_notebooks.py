"""The notebooks: one jupytext source each, committed without outputs, in one fixed order of
sections (SECTIONS below), importing (never pasting) the kernels, and executable end to end - by common/tools/nbrun.py
(in process, the way the GPU machine runs them) and through a real Jupyter kernel (nbclient + ipykernel, the way a
reader runs them, which takes common.tools.notebook's IPython branch).

Without a GPU (CI) every notebook runs in compile-only mode: its stage is compiled for sm_90a and
sm_100a and the GPU cells say they are skipped. On an H100/H200 the in-process run is in GPU mode,
where the "Run and verify" cell must launch the Hopper kernel and pass the checker, and the
"Measure" cell must time it. The executed copies under docs/notebooks/ (written on a GPU
machine by `python -m common.tools.nbrun --execute-to docs/notebooks`) must carry exactly the sources' code."""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from ptxas_checks import ptxas_ran

from common import arch
from common.tools import nbrun, stage_table
from common.tools.nbrun import run_notebook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "notebooks")
SRC_DIR = os.path.join(NB_DIR, "source")
EXECUTED_DIR = os.path.join(ROOT, "docs", "notebooks")
NOTEBOOKS = {
    1: "stage1_gemm.ipynb",
    2: "stage2_qk.ipynb",
    3: "stage3_softmax.ipynb",
    4: "stage4_kv_interleave.ipynb",
    5: "stage5_online_softmax.ipynb",
    6: "stage6_masks.ipynb",
    7: "stage7_gqa_varlen.ipynb",
    8: "stage8_warp_specialized.ipynb",
    9: "stage9_pingpong.ipynb",
    10: "stage10_overlap.ipynb",
    11: "stage11_persistent.ipynb",
    12: "stage12_last_percent.ipynb",
    13: "stage13_split_kv.ipynb",
    14: "stage14_paged_kv.ipynb",
    15: "stage15_context_parallel.ipynb",
}
# Stage 15 has no kernel of its own (stages/stage15_context_parallel/ring.py runs stage 14's on
# every rank, and is not in the stage table): its notebook starts, compiles, checks and times
# stage 14's kernel, and shows ring.py's functions where the others show their kernel diff.
KERNEL_OF = {15: 14}
# The fixed order of every notebook's sections (level-2 headings).
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
# Words that point outside the repository: the notebooks describe things by what they do.
FOREIGN_WORDS = (r"\bseed draft\b", r"\bthe user's\b", r"\banchors?\b", r"\.\./shared")
# The executed copies of all the notebooks together stay below this (figures at 80 dpi; the eight
# of stages 1-8 took 2.3 MiB in compile-only mode, 2026-12-01).
EXECUTED_MAX_BYTES = 4 * 1024 * 1024


def load(name):
    with open(os.path.join(NB_DIR, name)) as f:
        return json.load(f)


def cell_text(cell):
    return "".join(cell["source"])


@pytest.mark.parametrize("stage", [s.number for s in stage_table.STAGES])
def test_every_stage_has_a_notebook(stage):
    have = glob.glob(os.path.join(NB_DIR, f"stage{stage}_*.ipynb"))
    if not have and stage > max(NOTEBOOKS):
        pytest.xfail(
            f"stage {stage} has no notebook yet (a new notebook follows the structure checked here)"
        )
    assert have, f"stage {stage} has no notebook notebooks/stage{stage}_*.ipynb"
    if stage in NOTEBOOKS:
        assert os.path.basename(have[0]) == NOTEBOOKS[stage]


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
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.reads(json.dumps(nb), as_version=4))


@pytest.mark.parametrize("stage", sorted(NOTEBOOKS))
def test_structure(stage):
    nb = load(NOTEBOOKS[stage])
    md = "\n".join(cell_text(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    headings = [re.sub(r"^\d+\.\s*", "", h).strip() for h in re.findall(r"^## (.+)$", md, re.M)]
    found = [h for h in headings if any(h.startswith(s) for s in SECTIONS)]
    assert [next(s for s in SECTIONS if h.startswith(s)) for h in found] == list(SECTIONS), (
        f"sections of {NOTEBOOKS[stage]} must be, in order: {', '.join(SECTIONS)}; found {headings}"
    )
    assert "Blackwell" in md and "compile-checked here, not run on hardware" in md
    for i, cell in enumerate(nb["cells"]):
        src = cell_text(cell)
        for word in FOREIGN_WORDS:
            assert not re.search(word, src, re.I), (
                f"{NOTEBOOKS[stage]} cell {i} uses {word!r}, a reference outside the repository"
            )
        if cell["cell_type"] != "code":
            continue
        # Cells run under a plain exec runner: no IPython magics or shell escapes.
        assert not re.search(r"^\s*[%!]", src, re.M), (
            f"cell {i} uses an IPython magic or shell escape"
        )
        # Notebooks import and display the stage code; they never paste kernels.
        assert "@cute.kernel" not in src and "@cute.jit" not in src, f"cell {i} pastes kernel code"
    code = "\n".join(cell_text(c) for c in nb["cells"] if c["cell_type"] == "code")
    kernel = KERNEL_OF.get(stage, stage)
    for fn, args in (
        ("start", f"{kernel}(\\)|, heading=)"),
        ("run_and_verify", f"{kernel}\\b"),
        ("measure", f"{kernel}\\b"),
        # the compile summary of both tracks, in both modes
        ("compile_summary", f'{kernel}, "hopper"\\)'),
        ("compile_summary", f'{kernel}, "blackwell"\\)'),
    ) + ((("cross_track_table", f"{stage}\\)"),) if stage not in KERNEL_OF else ()):
        assert re.search(rf"nb\.{fn}\(\s*{args}", code), (
            f"{NOTEBOOKS[stage]} never calls nb.{fn}({kernel}, ...)"
        )
    assert "show_cross_track_diff" not in code, "a concept table replaces the cross-track diff"
    if stage in KERNEL_OF:
        assert "nb.show_function(" in code, f"{NOTEBOOKS[stage]} never shows its stage's code"
    elif stage > 1:
        assert re.search(rf'nb\.show_diff\(\s*{stage}, "hopper"[,)]', code)


@pytest.mark.parametrize("stage", sorted(NOTEBOOKS))
def test_answers_are_collected_after_the_exercises(stage):
    """No answer cell directly under an exercise: after the Exercises heading, code cells come
    only after an 'Answers' heading, and text answers sit in collapsed <details> blocks."""
    cells = load(NOTEBOOKS[stage])["cells"]
    start = next(
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "markdown" and re.search(r"^## \d+\. Exercises", cell_text(c), re.M)
    )
    answers_seen = False
    for i in range(start, len(cells)):
        c = cells[i]
        if c["cell_type"] == "markdown":
            text = cell_text(c)
            if re.search(r"^### Answers", text, re.M):
                answers_seen = True
                assert "<details>" in text.split("### Answers", 1)[1], (
                    f"{NOTEBOOKS[stage]}: the answers are not in <details> blocks"
                )
        else:
            assert answers_seen, (
                f"{NOTEBOOKS[stage]} cell {i}: a code cell between the exercises and the answers"
            )
    assert answers_seen, f"{NOTEBOOKS[stage]} has no Answers part after its exercises"
    if stage == 5:
        # Exercise 3 asks for the online update: its answer must not fall back on logsumexp.
        answers = "\n".join(cell_text(c) for c in cells[start:] if c["cell_type"] == "code")
        assert "online_attention(" in answers and "logsumexp" not in answers


def _check_log(stage, log, mode):
    stage = KERNEL_OF.get(stage, stage)  # the stage whose kernel the notebook compiles and runs
    assert log["stage"] == stage
    assert not log["errors"], "the notebook reported problems:\n" + "\n".join(
        map(str, log["errors"])
    )
    for track in arch.TRACKS:
        # The compile summary of both tracks is shown in both modes.
        if stage_table.available(stage, track):
            assert [stage, track] in [list(x) for x in log["compiled"]], (
                f"stage {stage} ({track}) was not compiled by its notebook ({mode} mode)"
            )


@pytest.mark.parametrize("stage", sorted(NOTEBOOKS))
def test_notebook_runs(stage, capsys):
    from common.tools import notebook as nb

    run_notebook(os.path.join(NB_DIR, NOTEBOOKS[stage]), verbose=False)
    _check_log(stage, nb.LOG, nb.MODE)
    if nb.MODE == "gpu":
        track, kernel = arch.track(), KERNEL_OF.get(stage, stage)
        if stage_table.available(kernel, track):
            assert any(v[0] == kernel and v[1] == track for v in nb.LOG["verified"]), (
                f"GPU mode: the notebook did not run and check stage {kernel} on {track}"
            )
            assert (kernel, track) in nb.LOG["measured"], (
                f"GPU mode: the notebook did not measure stage {kernel}"
            )
    else:
        out = capsys.readouterr().out
        assert "Run and verify skipped" in out and "Measure skipped" in out


@pytest.mark.parametrize("stage", sorted(NOTEBOOKS))
def test_notebook_runs_in_a_jupyter_kernel(stage, tmp_path, monkeypatch):
    """Every notebook through a real Jupyter kernel (nbclient + ipykernel), compile-only mode:
    any cell error fails, and the outputs must come from common.tools.notebook's IPython branch
    (display(Markdown), display(Code)) and the inline figure backend."""
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nbformat = pytest.importorskip("nbformat")

    nb = nbformat.read(os.path.join(NB_DIR, NOTEBOOKS[stage]), as_version=4)
    # One more cell reports what the run did (common.tools.notebook.LOG) from inside the kernel.
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "import json\nprint('NBLOG' + json.dumps(nb.LOG, default=list))", id="test-log"
        )
    )
    # A kernel spec for this very interpreter (JUPYTER_PATH comes first in Jupyter's search), so
    # that no other "python3" kernel installed on the machine is picked up.
    spec = tmp_path / "kernels" / "tutorial-python"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "tutorial (test)",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    env = dict(os.environ, TUTORIAL_NB_MODE="compile-only")
    env.pop("MPLBACKEND", None)  # the kernel's own inline backend, as a reader gets it
    client = nbclient.NotebookClient(
        nb,
        timeout=900,
        kernel_name="tutorial-python",
        resources={"metadata": {"path": NB_DIR}},
    )
    client.execute(env=env)  # raises CellExecutionError, naming the cell, on any error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    kinds = {k for o in outputs if o.get("output_type") == "display_data" for k in o["data"]}
    assert "text/markdown" in kinds, "no display(Markdown(...)): the IPython branch did not run"
    assert "text/html" in kinds, "no display(Code(...)): the IPython branch did not run"
    assert "image/png" in kinds, "no figure was displayed"
    markdown = "\n".join(
        "".join(o["data"]["text/markdown"])
        for o in outputs
        if o.get("output_type") == "display_data" and "text/markdown" in o["data"]
    )
    assert "Run and verify skipped" in markdown and "Measure skipped" in markdown
    text = "".join(
        "".join(o.get("text", "")) for o in nb.cells[-1].outputs if o.get("output_type") == "stream"
    )
    log = json.loads(text.split("NBLOG", 1)[1])
    _check_log(stage, log, "compile-only, Jupyter kernel")


def test_executed_copies_are_written(tmp_path):
    """`python -m common.tools.nbrun --execute-to DIR` (what the GPU machine's run uses) writes valid notebooks
    with a header naming GPU, mode and date, the sources' cells, and their outputs: text,
    Markdown from the helpers, PNG figures."""
    nbformat = pytest.importorskip("nbformat")
    name = NOTEBOOKS[2]
    env = dict(os.environ, TUTORIAL_NB_MODE="compile-only")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "common.tools.nbrun",
            "--execute-to",
            str(tmp_path),
            f"notebooks/{name}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    executed = nbformat.read(str(tmp_path / name), as_version=4)
    nbformat.validate(executed)
    _check_executed_copy(name, executed)
    kinds = {
        k
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "display_data"
        for k in o.data
    }
    assert {"text/markdown", "image/png"} <= kinds
    assert any(
        o.output_type == "stream"
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.outputs
    )


def test_slim_outputs_shrinks_figures_and_keeps_markdown():
    """common.tools.nbrun.slim_outputs (run on every executed copy): a figure becomes a smaller palette
    PNG of the same pixel size and nearly the same colours; a long text/plain twin of a Markdown
    output becomes a placeholder while the Markdown stays as it was; other outputs are kept."""
    import base64
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    Image = pytest.importorskip("PIL.Image")
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot(np.sin(np.linspace(0, 6, 200)), label="sin")
    ax.imshow(np.random.default_rng(0).random((32, 32)), extent=(0, 200, -1, 1), aspect="auto")
    ax.set_title("a title")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    png = buf.getvalue()
    table = "| a | b |\n|---|---|\n" + "".join(f"| {i} | {i * i} |\n" for i in range(40))
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": ["hello\n"]},
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {"text/markdown": nbrun._lines(table), "text/plain": nbrun._lines(table)},
        },
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {"text/markdown": ["**short**"], "text/plain": ["short"]},
        },
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {
                "image/png": base64.b64encode(png).decode("ascii"),
                "text/plain": ["<Figure size 400x300 with 1 Axes>"],
            },
        },
    ]
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": 1,
                "id": "c1",
                "metadata": {},
                "outputs": outputs,
                "source": ["print('hello')"],
            }
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    assert nbrun.slim_outputs(nb) > len(table)
    stream, md, short, figure = nb["cells"][0]["outputs"]
    assert stream["text"] == ["hello\n"]
    assert "".join(md["data"]["text/markdown"]) == table
    assert md["data"]["text/plain"] == [nbrun.PLAIN_PLACEHOLDERS["text/markdown"]]
    assert short["data"] == {"text/markdown": ["**short**"], "text/plain": ["short"]}
    assert figure["data"]["text/plain"] == ["<Figure size 400x300 with 1 Axes>"]
    small = base64.b64decode(figure["data"]["image/png"])
    assert len(small) < len(png)
    before, after = Image.open(io.BytesIO(png)), Image.open(io.BytesIO(small))
    assert after.mode == "P" and after.size == before.size
    diff = np.abs(
        np.asarray(after.convert("RGB"), dtype=int) - np.asarray(before.convert("RGB"), dtype=int)
    )
    assert diff.max() <= 32 and diff.mean() < 4, (diff.max(), diff.mean())
    assert nbrun.slim_outputs(nb) == 0, "slimming twice must change nothing more"
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.reads(json.dumps(nb), as_version=4))


def _check_executed_copy(name, executed):
    source = load(name)
    header = executed.cells[0]
    assert header.cell_type == "markdown" and "Executed copy" in header.source
    assert re.search(r"\*\*\d{4}-\d\d-\d\d\*\*", header.source), "the header names no date"
    assert "mode" in header.source and "run on **" in header.source, "the header names no GPU"
    src_code = [(c["id"], cell_text(c)) for c in source["cells"] if c["cell_type"] == "code"]
    got_code = [(c.id, c.source) for c in executed.cells[1:] if c.cell_type == "code"]
    assert got_code == src_code, (
        f"docs/notebooks/{name}: its code cells are not exactly those of notebooks/{name} "
        "(re-run `python -m common.tools.nbrun --execute-to docs/notebooks notebooks/*.ipynb`)"
    )


@pytest.mark.skipif(not os.path.isdir(EXECUTED_DIR), reason="docs/notebooks/ not written yet")
def test_executed_copies_match_their_sources():
    nbformat = pytest.importorskip("nbformat")
    names = sorted(f for f in os.listdir(EXECUTED_DIR) if f.endswith(".ipynb"))
    assert names == sorted(NOTEBOOKS.values()), (
        f"docs/notebooks/ holds {names}; expected an executed copy of each notebook"
    )
    total = 0
    for name in names:
        path = os.path.join(EXECUTED_DIR, name)
        total += os.path.getsize(path)
        executed = nbformat.read(path, as_version=4)
        nbformat.validate(executed)
        _check_executed_copy(name, executed)
    assert total <= EXECUTED_MAX_BYTES, f"executed copies take {total / 2**20:.1f} MiB"


# The pictures must be correct to the hardware: their layouts are checked against CuTe's own.


def test_wgmma_fragments_match_cute_atoms():
    """The figures draw the wgmma m64nNk16 accumulator and register-A fragments from thread-value
    layouts (notebooks/figures/layouts.py); they must be the ones CuTe DSL builds for sm_90a
    (traced on the CPU, no GPU)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from notebooks.figures import layouts

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
        assert got[n] == layouts.layout_str(*layouts.wgmma_c_tv(n))
    assert got["a"] == layouts.layout_str(*layouts.wgmma_a_rs_tv())
    # The PTX ISA's rule: thread t of warp w holds rows 16 w + t / 4 (+ 8), columns 2 (t % 4) + 8 i + {0, 1}.
    for t in range(128):
        w, lane = divmod(t, 32)
        want = {
            (16 * w + lane // 4 + 8 * h, 2 * (lane % 4) + 8 * i + e)
            for i in range(16)
            for h in (0, 1)
            for e in (0, 1)
        }
        assert {(r, c) for _, r, c in layouts.wgmma_c_coords(t, 128)} == want


def test_swizzle_is_tma_128b():
    from notebooks.figures import layouts

    for r in range(16):
        for c in range(8):
            assert layouts.swizzle_128b_chunk(r, c) == c ^ (r % 8)
    # chunk c of 8 consecutive rows lands in 8 different chunks: all 32 banks, no conflict
    for c in range(8):
        assert sorted(layouts.swizzle_128b_chunk(r, c) for r in range(8)) == list(range(8))


def test_ring_model_finds_the_race():
    from notebooks.figures import stage4, timelines

    for slot_per in ("tile", "entry"):
        for two_pass in (True, False):
            loads, ops, wait = stage4.kv_ring_schedule(4, 2, two_pass, True, slot_per)
            assert timelines.simulate_ring(loads, ops, wait_for_release=wait)["races"] == []
    loads, ops, wait = stage4.kv_ring_schedule(3, 2, True, v_waits_for_release=False)
    assert timelines.simulate_ring(loads, ops, wait_for_release=wait)["races"]
    # A consumer waiting for a tile the producer can never load is reported, not hung on.
    with pytest.raises(timelines.Deadlock):
        timelines.simulate_ring(
            [("A", 0), ("B", 0)], [("MMA", "x", 1.0, ["B"], []), ("MMA", "y", 1.0, ["A"], ["A"])]
        )


def _figures():
    import torch

    from common.tools import plots
    from notebooks.figures import (
        stage1,
        stage2,
        stage3,
        stage4,
        stage5,
        stage6,
        stage7,
        stage8,
        stage9,
        stage10,
        stage12,
        stage14,
        stage15,
    )

    out = torch.zeros(2, 3, 64, 64, dtype=torch.float64)
    out[1, 2, 17, 40] = 1.0  # the worst element, in slice (b, h) = (1, 2)
    results = {
        "(2, 16, 8192, 8192, 128)": {"stage 5": 524.0, "stage 4": 366.0, "SDPA flash": 345.0}
    }
    return {
        "gemm_tiling": lambda: stage1.gemm_tiling(),
        "attention_grid": lambda: stage2.attention_grid(),
        "swizzle_128b": lambda: stage1.swizzle_128b(),
        "prepare_views": lambda: stage1.prepare_views(),
        "barrier_phases": lambda: stage1.barrier_phases(),
        "gemm_pipeline_timeline": lambda: stage1.gemm_pipeline_timeline(ab_buffers=(2, 4)),
        "kv_slot_timeline racy": lambda: stage4.kv_slot_timeline(2, 2, True, False),
        "kv_slot_timelines": lambda: stage4.kv_slot_timelines(
            [dict(two_pass=True), dict(two_pass=False)]
        ),
        "wgmma_accumulator_layout": lambda: stage1.wgmma_accumulator_layout(),
        "quad_reduction": lambda: stage3.quad_reduction(),
        "p_register_path": lambda: stage3.p_register_path(),
        "vt_operand": lambda: stage3.vt_operand(),
        "tmem_columns": lambda: plots.tmem_columns(),
        "blackwell_warp_roles": lambda: stage1.blackwell_warp_roles(3),
        "o_rescale_handoff": lambda: stage5.o_rescale_handoff(),
        "online_softmax_trace": lambda: stage5.online_softmax_trace(
            [0.1, 2.0, -1.0, 0.3, 2.5, 0.1]
        ),
        "error_heatmap": lambda: plots.error_heatmap(out, torch.zeros_like(out)),
        "bench_bars": lambda: plots.bench_bars(results, "t"),
        "mask_tile_maps": lambda: stage6.mask_tile_maps(
            [
                ("causal", 1024, 1024, True, None),
                ("window (256, 0)", 1024, 1024, False, (256, 0)),
                ("causal, Sq < Sk", 512, 1024, True, None),
                ("causal, Sq > Sk", 1024, 640, True, None),
            ]
        ),
        "mask_alignment": lambda: stage6.mask_alignment(),
        "gqa_head_map": lambda: stage7.gqa_head_map(32, 8),
        "varlen_cta_map": lambda: stage7.varlen_cta_map([300, 77, 0, 520, 1], causal=True),
        "packed_rows": lambda: stage7.packed_rows([200, 77, 300, 1]),
        "warp_specialized_roles": lambda: stage8.warp_specialized_roles(),
        "warp_specialized_roles D=64": lambda: stage8.warp_specialized_roles(
            kv_slots=13, cta_tile=(128, 128, 64)
        ),
        "ring_timelines": lambda: stage8.ring_timelines(),
        "step_against_s": lambda: stage9.step_against_s(
            _results("ablation_h200_2026-12-04.json"), "stage 8", "stage 9", "t"
        ),
        "pingpong_timelines": lambda: stage9.pingpong_timelines(),
        "pingpong_timelines wait for PV": lambda: stage9.pingpong_timelines(
            compare="wait for PV", wait_latency=30
        ),
        "pingpong_timelines overlap": lambda: stage9.pingpong_timelines(compare="overlap"),
        "mma_issue_orders": lambda: stage9.mma_issue_orders(
            [("stage 8", "QQPP" * 2), ("stage 9", "QQQQPPPP" * 2)], {"Q": 2, "P": 2}
        ),
        "register_sets": lambda: stage10.register_sets(
            [("stage 9", 64, 0, 64, 240), ("stage 10", 64, 32, 64, 240)]
        ),
        "overlap_timelines": lambda: stage10.overlap_timelines(head_dim=64),
        "measured_ratios": lambda: stage10.measured_ratios(
            _results("ablation_h200_2026-12-04.json"),
            [("stage 12", "FA4"), ("stage 12", "SDPA cuDNN")],
            "t",
        ),
        "tunings_cumulative": lambda: stage12.tunings_cumulative(
            _results("tunings_h200_2026-12-04.json"),
            ["none"] + [f"+1-{k}" if k > 1 else "+1" for k in range(1, 8)],
            "t",
        ),
        "against_s": lambda: stage12.against_s(
            _results("ablation_h200_2026-12-04.json"), ["stage 12", "FA4", "SDPA cuDNN"], "t"
        ),
        "page_table_map": lambda: stage14.page_table_map(
            [40, 75, 18],
            16,
            [[5, 12, 3, -1, -1, -1], [11, 10, 9, 0, 6, -1], [4, 2, -1, -1, -1, -1]],
            13,
        ),
        "tile_boxes": lambda: stage14.tile_boxes(
            [
                ("pages of 16", 16, 1100, [(8, c, min(64 + c, 68), 0, 0) for c in range(8)], 69),
                ("pages of 64, one box past", 64, 1040, [(8, 0, 16, 0, 0), (8, 1, 17, 0, 0)], 17),
                ("pages of 256", 256, 1100, [(3, 0, 1, 0, 128)], 5),
            ]
        ),
        "decode_sweep": lambda: plots.plot_decode(
            _results("decode_h100_2026-12-07_sweep.json"), "t"
        ),
        "paged_ratios": lambda: stage14.paged_ratios(
            _results("decode_h200_2026-12-04.json"), (16, 64, 128, 256), "t"
        ),
        "schedule_grids": lambda: stage15.schedule_grids(32, 4, title="t"),
        "schedule_grids N=2": lambda: stage15.schedule_grids(8, 2),
        "hop_timelines": lambda: stage15.hop_timelines(
            [
                ("a", [12840.0, 13250.0, 13250.0, 13250.0], [298.0] * 3),
                ("b", [75.8, 51.5, 51.5, 51.5], [74.6] * 3),
            ],
            title="t",
        ),
        "uneven_chunks": lambda: stage15.uneven_chunks(
            [(10, 4, False), (10, 4, True), (5, 4, True), (3, 5, False)], title="t"
        ),
    }


def _results(name):
    """The rows of a measured result file of docs/results/."""
    with open(os.path.join(ROOT, "docs", "results", name)) as f:
        return json.load(f)["rows"]


@pytest.mark.parametrize("name", sorted(_figures()))
def test_figures_are_readable_at_notebook_size(name):
    """No label below draw.MIN_FONT points, no figure wider than draw.FIG_WIDTH inches (a
    notebook shows about 8-10 inches; wider figures are shrunk, and their labels with them)."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from common.tools import draw

    fig = _figures()[name]()
    try:
        assert fig.get_size_inches()[0] <= draw.FIG_WIDTH + 1e-9
        small = [
            (t.get_text()[:30], t.get_fontsize())
            for t in fig.findobj(Text)
            if t.get_text().strip() and t.get_visible() and t.get_fontsize() < draw.MIN_FONT
        ]
        assert not small, f"labels below {draw.MIN_FONT} pt: {small[:5]}"
        if name == "error_heatmap":
            title = fig.axes[0].get_title()
            assert "b = 1, h = 2" in title and "(1, 2, 17, 40)" in title, title
    finally:
        plt.close(fig)


def test_pingpong_model_follows_the_kernel():
    """The schedule model behind stage 9's timelines (notebooks/figures/stage9.py) replays the
    kernel's order of wait_turn and pass_turn: the tensor cores take the turns of the
    docstring's picture - the order of the turn model built from the kernel object
    (common/tools/turns.py, checked against the PTX in tests/test_stage9_hopper.py) - named
    barrier 2 completes `steps` times and barrier 3 `steps + 1`, no arrive is left over, and a
    lost arrive (warpgroup 1's last pass) is a deadlock, not a finished schedule. Stage 8's
    warpgroups, in step, take no turns."""
    from common.tools import turns
    from notebooks.figures import stage9, timelines

    for steps in range(0, 6):
        r = stage9.attention_schedule(True, steps)
        assert r["turns"] == {2: steps, 3: steps + 1 if steps else 0}, r["turns"]
        assert r["pending"] == {2: 0, 3: 0}
        lock = stage9.attention_schedule(False, steps)
        assert lock["turns"] == {2: 0, 3: 0} and lock["pending"] == {2: 0, 3: 0}
    order = []
    for _, _, wg, label in stage9.attention_schedule(True, 2)["tc"]:
        if (wg, label) not in order:
            order.append((wg, label))
    assert order == [
        (1, "QK0"),
        (2, "QK0"),
        (1, "PV0"),
        (1, "QK1"),
        (2, "PV0"),
        (2, "QK1"),
        (1, "PV1"),
        (2, "PV1"),
    ]
    assert [f"{w}: {label}" for w, label in order] == turns.pingpong_order(2)
    with pytest.raises(timelines.Deadlock, match="warpgroup 2"):
        stage9.attention_schedule(True, 3, final_pass=False)
    # Ping-pong keeps the tensor cores busier than stage 8 in step, with the kernel's unit times.
    qk, sm, pv = stage9.hopper_unit_times(128)
    assert (
        stage9.attention_schedule(True, 4, qk, sm, pv)["end"]
        < stage9.attention_schedule(False, 4, qk, sm, pv)["end"]
    )


def test_pingpong_model_back_to_back_against_waiting_for_pv():
    """Stage 9's order (PV_j and QK_(j+1) back to back, one wait) against the wait for PV_j
    before QK_(j+1) (FlashAttention-3's warp-specialised order): the same turns and tensor-core
    order, no arrive left over; with a cost per wait the back-to-back order finishes first and
    keeps the tensor cores busier; without one the two differ by the model's time step only."""
    from notebooks.figures import stage9

    qk, sm, pv = stage9.hopper_unit_times(128)
    for steps in (1, 2, 5):
        for lat in (0.0, 30.0):
            a = stage9.attention_schedule(
                True, steps, qk, sm, pv, wait_for_pv=True, wait_latency=lat
            )
            b = stage9.attention_schedule(True, steps, qk, sm, pv, wait_latency=lat)
            assert a["turns"] == b["turns"] == {2: steps, 3: steps + 1}
            assert a["pending"] == b["pending"] == {2: 0, 3: 0}
            # The tensor cores start the same GEMMs in the same order (each GEMM once).
            starts = [list(dict.fromkeys((w, lab) for _, _, w, lab in r["tc"])) for r in (a, b)]
            assert starts[0] == starts[1], starts
            if lat:
                assert b["end"] < a["end"] and b["tc_busy"] > a["tc_busy"], (
                    steps,
                    a["end"],
                    b["end"],
                )
            else:
                assert abs(a["end"] - b["end"]) <= 0.02 * b["end"], (steps, a["end"], b["end"])
    # A cost per wait also reaches the waits that stand alone: more latency, a later end.
    ends = [
        stage9.attention_schedule(True, 4, qk, sm, pv, wait_latency=x)["end"] for x in (0, 30, 60)
    ]
    assert ends == sorted(ends) and ends[0] < ends[-1]


def test_overlap_model_follows_the_kernel():
    """Notebook 10's timelines (attention_schedule with overlap=True) replay stage 10's turns:
    the tensor cores take the GEMMs in the order of the turn model built from the kernel object
    (common/tools/turns.py: 1: QK0, 2: QK0, 1: QK1, 1: PV0, ...), barrier 2 completes `steps`
    times and barrier 3 `steps + 1`, no arrive is left over; with unit durations and with the
    kernel's at both head dims."""
    from common.tools import turns
    from notebooks.figures import stage10

    for D in (None, 64, 128):
        times = () if D is None else (*stage10.hopper_unit_times(D), D // 16, 8)
        for steps in range(0, 6):
            r = stage10.attention_schedule(True, steps, *times, overlap=True)
            order = list(dict.fromkeys(f"{w}: {label}" for _, _, w, label in r["tc"]))
            assert order == turns.overlap_order(steps), (D, steps, order)
            assert r["turns"] == {2: steps, 3: steps + 1 if steps else 0}, r["turns"]
            assert r["pending"] == {2: 0, 3: 0}


def test_varlen_helpers_match_the_benchmark_batch():
    """nb.varlen_lengths() is make bench's packed batch (common/tools/bench.py draws it with the
    CPU generator, seed 2026, 16 lengths in [64, 2048))."""
    import torch

    from common.tools import notebook as nb

    g = torch.Generator().manual_seed(2026)
    assert nb.varlen_lengths() == torch.randint(64, 2048, (16,), generator=g).tolist()


def test_gpu_mode_helpers_run_with_cpu_stand_ins(monkeypatch, capsys):
    """The GPU cells of stages 6-8 (run_and_verify_cases, run_and_verify_varlen, measure_masks,
    measure_varlen, measure_calls, measure with FA4) end to end on the CPU: the stage entries
    replaced by the fp64 reference, timing by a wall clock. A slip in their indexing, shapes or
    bookkeeping shows here, not first on the H200. (The kernels themselves are checked by the
    stage tests on the GPU.)"""
    import time

    import torch

    from common import masks
    from common.tools import inputs, reference, timing, verify
    from common.tools import notebook as nb

    def attention(q, k, v, scale=None, causal=False, window=None, return_lse=False):
        Sq, Sk, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
        mask = masks.visible(Sq, Sk, *masks.resolve_window(causal, window, Sq, Sk))
        o, lse = reference.attention_ref(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale, mask=mask
        )
        return (o.to(q.dtype), lse.float()) if return_lse else o.to(q.dtype)

    def attention_varlen(
        q, k, v, cu_q, cu_k, max_q=None, max_k=None, causal=False, window=None, return_lse=False
    ):
        o = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for b in range(len(cq) - 1):
            (q0, q1), (k0, k1) = cq[b : b + 2], ck[b : b + 2]
            if q1 > q0 and k1 > k0:
                t = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
                ob, lb = attention(
                    t(q[q0:q1]), t(k[k0:k1]), t(v[k0:k1]), None, causal, window, return_lse=True
                )
                o[q0:q1], lse[:, q0:q1] = ob[0].transpose(0, 1), lb[0]
        return (o, lse) if return_lse else o

    def wall_ms(fn, sets, warmup=1, reps=1):
        t0 = time.perf_counter()
        fn(*sets[0])
        return (time.perf_counter() - t0) * 1e3

    attention_inputs = inputs.attention_inputs
    monkeypatch.setattr(nb, "MODE", "gpu")
    monkeypatch.setattr(nb, "DEVICE", "cpu")
    monkeypatch.setattr(arch, "track", lambda: "hopper")
    monkeypatch.setattr(
        inputs,
        "attention_inputs",
        lambda *a, device=None, **k: attention_inputs(*a[:7], device="cpu", **k),
    )
    monkeypatch.setattr(verify, "run_with_deadline", lambda fn, seconds=60, what="": fn())
    monkeypatch.setattr(timing, "time_ms", wall_ms)
    for st in (5, 6, 7, 8):
        mod = stage_table.track_module(st, "hopper")
        monkeypatch.setattr(mod, "attention", attention)
        if st >= 7:
            monkeypatch.setattr(mod, "attention_varlen", attention_varlen)

    nb.start(8)
    assert len(nb.run_and_verify_cases(6)) == len(nb.MASK_CASES)
    nb.run_and_verify_cases(7, [("GQA 8 / 2", (1, 8, 130, 300, 64), dict(kv_heads=2, causal=True))])
    rows = nb.run_and_verify_varlen(8, [200, 0, 1], [130, 5, 260], heads=2, kv_heads=1, causal=True)
    assert [r[-1] for r in rows] == ["pass", "no rows", "pass"]
    assert all(r[-2].startswith("pass") for r in rows if r[-1] == "pass")
    res = nb.measure_masks(
        6,
        [(1, 2, 256, 256, 64)],
        mask_options={"causal": dict(causal=True), "window (64, 0)": dict(window=(64, 0))},
    )
    assert {"stage 6 (no mask)", "stage 6 (causal)", "stage 6 (window (64, 0))"} <= set(
        res["(1, 2, 256, 256, 64)"]
    )
    res = nb.measure_varlen(7, [100, 300], heads=2, head_dim=64, causal=(True,))
    assert {"stage 7 packed", "stage 7 padded batch"} <= set(res["causal"])
    nb.measure_calls(8, {"a": (lambda: None, 1e9), "b": (lambda: None, 2e9)})
    nb.measure(8, [(1, 2, 128, 128, 64)], also_stages=(5, 7), with_fa4=True)
    assert not nb.LOG["errors"], nb.LOG["errors"]
    assert (8, "hopper") in nb.LOG["measured"] and (6, "hopper") in nb.LOG["measured"]
    assert ("varlen", (200, 0, 1), (130, 5, 260)) in [v[2] for v in nb.LOG["verified"]]
    capsys.readouterr()


def test_bench_colours_are_one_per_kernel():
    from common.tools import draw

    assert draw.kernel_color("SDPA flash") == draw.KERNEL_COLORS["SDPA flash"]
    assert draw.kernel_color("stage 1 (ab_buffers=2)") == draw.KERNEL_COLORS["stage 1"]
    assert len(set(draw.KERNEL_COLORS.values())) == len(draw.KERNEL_COLORS)


@pytest.mark.parametrize("stage", sorted(NOTEBOOKS))
def test_notebook_figures_are_in_its_figures_module(stage):
    """Notebook N draws with `figures.<name>` from notebooks/figures/stageN.py, imported as
    `from notebooks.figures import stageN as figures`: every name it uses is there."""
    import importlib

    src = "".join(cell_text(c) for c in load(NOTEBOOKS[stage])["cells"])
    assert f"from notebooks.figures import stage{stage} as figures" in src
    module = importlib.import_module(f"notebooks.figures.stage{stage}")
    missing = sorted({n for n in re.findall(r"\bfigures\.(\w+)", src) if not hasattr(module, n)})
    assert not missing, f"notebooks/figures/stage{stage}.py has no {missing}"


# The notebook helpers that make every exercise doable.


def test_kernel_settings_override_build_a_new_kernel():
    import torch

    from common.compile import compile_key
    from common.tools import notebook as nb

    mod = stage_table.track_module(1, "hopper")
    kernel, args = mod.compile_args(torch.bfloat16, (256, 256, 256))
    with nb.kernel_settings(1, "hopper", ab_buffers=2):
        changed, _ = mod.compile_args(torch.bfloat16, (256, 256, 256))
        assert changed.ab_buffers == 2
        with pytest.raises(AttributeError, match="no_such_setting"):
            with nb.kernel_settings(1, "hopper", no_such_setting=1):
                mod.compile_args(torch.bfloat16, (256, 256, 256))
    assert compile_key(changed, args) != compile_key(kernel, args)
    again, _ = mod.compile_args(torch.bfloat16, (256, 256, 256))
    assert again.ab_buffers == kernel.ab_buffers and "__setattr__" not in type(again).__dict__


def test_kernel_settings_reach_derived_settings(monkeypatch):
    """The override happens as __init__ assigns, so attributes __init__ derives follow it."""
    from common.tools import notebook as nb

    class Kernel:
        def __init__(self):
            self.ab_buffers = 4
            self.kv_slots = self.ab_buffers

    monkeypatch.setattr(nb, "_kernel_class", lambda stage, track: Kernel)
    with nb.kernel_settings(1, "blackwell", ab_buffers=2):
        k = Kernel()
    assert (k.ab_buffers, k.kv_slots) == (2, 2)
    assert (Kernel().ab_buffers, Kernel().kv_slots) == (4, 4)


def test_kernel_settings_are_not_served_a_plan_made_without_them(monkeypatch):
    """A call inside kernel_settings must build its kernel with the settings even when the same
    call was made just before the block (the launch plans are keyed by the kernel class, not by
    its settings), and a call after the block must not get the plan made inside it. The plan is
    a stand-in that records the setting of the kernel object it was made from; nothing runs."""
    import torch

    from common import attention_host
    from common.tools import notebook as nb

    cls = nb._kernel_class(11, "hopper")

    class Plan:
        def __init__(self, kernel_class, q, *rest):
            self.persistent = kernel_class(
                attention_host.cute_dtype(q.dtype), q.shape[-1], 1
            ).persistent

        def run(self, *args):
            pass

    monkeypatch.setattr(attention_host, "make_plan", Plan)
    q = torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(1, 2, 128)

    def call():
        return attention_host.launch(cls, q, q, q, o, lse, None, None, 128, 1.0, False, None, 128)

    try:
        default = call().persistent
        with nb.kernel_settings(11, "hopper", persistent=not default):
            assert call().persistent == (not default)
            assert call().persistent == (not default)
        assert call().persistent == default
        # The remembered calls (the entries' fast path) go on entry and on exit too.
        attention_host._CALLS["stand-in"] = "a remembered call"
        with nb.kernel_settings(11, "hopper", persistent=not default):
            assert "stand-in" not in attention_host._CALLS
            attention_host._CALLS["stand-in"] = "a call remembered inside the block"
        assert "stand-in" not in attention_host._CALLS
    finally:  # no stand-in plan or call outlives the test
        attention_host._PLANS.clear()
        attention_host._CALLS.clear()


def test_reload_stage_gives_a_new_kernel_class():
    import torch

    from common.compile import compile_key
    from common.tools import notebook as nb

    before, args = stage_table.track_module(1, "hopper").compile_args(
        torch.bfloat16, (256, 256, 256)
    )
    nb.reload_stage(1, "hopper")
    after, _ = stage_table.track_module(1, "hopper").compile_args(torch.bfloat16, (256, 256, 256))
    assert type(after) is not type(before)
    assert compile_key(after, args) != compile_key(before, args)


def test_an_old_ptxas_is_named_not_a_bare_fatal_line(tmp_path, monkeypatch):
    """On the H200 the system ptxas (CUDA 12.x before 12.8) cannot assemble sm_100a and
    common.tools.ptx.ptxas_resources returns only its last line, 'ptxas fatal : Ptx assembly aborted
    due to errors'. The summary must say which ptxas it is and that it cannot assemble sm_100a."""
    from common.tools import notebook as nb

    fake = tmp_path / "ptxas"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --version) echo 'Cuda compilation tools, release 12.4, V12.4.131';;\n"
        "  --help) printf -- '--gpu-name <gpu name>\\n   Allowed values for this option:  "
        "'\"'\"'sm_80'\"'\"','\"'\"'sm_90'\"'\"','\"'\"'sm_90a'\"'\"'\\n\\n';;\n"
        "  *) echo 'ptxas fatal   : Ptx assembly aborted due to errors' >&2; exit 255;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    nb.ptxas_info.cache_clear()
    try:
        msg = nb.ptxas_problem(
            {"error": "ptxas fatal   : Ptx assembly aborted due to errors"}, "sm_100a"
        )
        assert "12.4" in msg and str(fake) in msg and "cannot assemble sm_100a" in msg, msg
        assert "sm_90a" in msg and "fatal" not in msg, msg
    finally:
        nb.ptxas_info.cache_clear()


def test_cubin_register_count_is_ptxas_count():
    """Where ptxas cannot help, the summary reads the registers from the cubin the DSL built."""
    from common.tools import notebook as nb
    from common.tools.ptx import compile_only

    r = compile_only(1, "hopper")
    regs = nb.cubin_registers(r.cubin)
    assert isinstance(regs, int) and 16 <= regs <= 255
    if ptxas_ran(r.resources, "sm_90a"):
        assert regs == r.resources["registers"]


# One source per notebook: the jupytext percent files under notebooks/source.


def _gen():
    spec = importlib.util.spec_from_file_location("nb_gen", os.path.join(SRC_DIR, "gen.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_notebooks_are_what_their_source_generates():
    """notebooks/source/stageN_*.py (jupytext percent format) is the single source of each
    notebook: the committed .ipynb must be exactly what `make notebooks-source` writes."""
    pytest.importorskip("jupytext")
    gen = _gen()
    srcs = {os.path.basename(s)[: -len(".py")] + ".ipynb": s for s in gen.sources()}
    assert sorted(srcs) == sorted(f for f in os.listdir(NB_DIR) if f.endswith(".ipynb")), (
        "every notebook needs a source in notebooks/source and every source a notebook"
    )
    for name, src in sorted(srcs.items()):
        with open(os.path.join(NB_DIR, name)) as f:
            assert f.read() == gen.build(src), (
                f"{name} differs from {os.path.relpath(src, ROOT)}: edit the source, then "
                "`make notebooks-source`"
            )


def test_sources_are_percent_scripts():
    """Each source parses as Python and starts with a jupytext header and a Markdown title."""
    import ast

    pytest.importorskip("jupytext")  # gen.py imports it (the H200 machine has no jupytext)

    for src in _gen().sources():
        with open(src) as f:
            text = f.read()
        ast.parse(text)
        assert text.startswith("# ---\n# jupyter:\n") and "# %% [markdown]\n# # Stage" in text, src


def _relative_links(nb_json):
    """The relative targets of Markdown links and images in the Markdown cells (and of Markdown
    outputs) of a notebook: no scheme, no in-page anchor."""
    texts = [cell_text(c) for c in nb_json["cells"] if c["cell_type"] == "markdown"]
    for c in nb_json["cells"]:
        for o in c.get("outputs", []):
            if "text/markdown" in o.get("data", {}):
                texts.append("".join(o["data"]["text/markdown"]))
    for text in texts:
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:|#", target):
                yield target.split("#")[0]


def test_relative_links_of_notebooks_and_executed_copies_resolve():
    """A link written for notebooks/ (../docs/results/x.png) must still resolve in the executed
    copy one folder deeper (nbrun.rebase_links), and every link of either must name a file."""
    folders = [os.path.join(ROOT, "notebooks")]
    if os.path.isdir(EXECUTED_DIR):
        folders.append(EXECUTED_DIR)
    checked = 0
    for folder in folders:
        for name in sorted(NOTEBOOKS.values()):
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                continue
            with open(path) as f:
                nb_json = json.load(f)
            for target in _relative_links(nb_json):
                checked += 1
                resolved = os.path.normpath(os.path.join(folder, target))
                assert os.path.exists(resolved), (
                    f"{os.path.relpath(path, ROOT)}: link {target!r} resolves to "
                    f"{os.path.relpath(resolved, ROOT)}, which does not exist"
                )
    assert checked > 0, "no relative link found: the link pattern matched nothing"


def test_rebase_links_moves_relative_links_one_folder_down():
    text = "![fig](../docs/results/a.png) [nb](stage8.ipynb) [web](https://x.org/../y)"
    assert nbrun.rebase_links(text) == (
        "![fig](../../docs/results/a.png) [nb](stage8.ipynb) [web](https://x.org/../y)"
    )


def test_a_ptxas_older_than_the_ptx_is_explained_not_shown_as_an_error(tmp_path, monkeypatch):
    """The H200 machine's ptxas (CUDA 13.0) cannot read the DSL's PTX (ISA 9.4) for any arch: the
    compile summary must say so in words (registers still come from the DSL's cubin), not show
    ptxas's error line as if the kernel had failed."""
    from common.tools import notebook as nb

    fake = tmp_path / "ptxas"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --version) echo 'Cuda compilation tools, release 13.0, V13.0.48';;\n"
        "  --help) printf -- '--gpu-name <gpu name>\\n   Allowed values for this option:  "
        "'\"'\"'sm_90a'\"'\"','\"'\"'sm_100a'\"'\"'\\n\\n';;\n"
        '  *) echo "ptxas $3, line 5; fatal   : Unsupported .version 9.4; current version is '
        "'9.0'\" >&2; echo 'ptxas fatal   : Ptx assembly aborted due to errors' >&2; exit 255;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    nb.ptxas_info.cache_clear()
    try:
        ptx = ".version 9.4\n.target sm_90a\n"
        msg = nb.spill_note({"error": "ptxas fatal   : Ptx assembly aborted"}, "sm_90a", ptx)
        assert "13.0" in msg and "9.4" in msg and "older" in msg, msg
        assert "fatal" not in msg and "Unsupported" not in msg, msg
        assert "no ptxas on PATH" in nb.spill_note(None, "sm_90a", ptx)
    finally:
        nb.ptxas_info.cache_clear()
