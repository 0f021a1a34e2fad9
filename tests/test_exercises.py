"""The exercises that edit a kernel (common/tools/exercises.py), on the CPU: each check must say
"not yet" on the stage file as committed and "done" once the exercise's own solution is applied
to a copy, and every solution must still apply (its text found exactly once). Compile-only: the
checks read PTX, shared memory and the schedule model, so they run in CI."""

import os
import re

import pytest

from common.tools import exercises

IDS = sorted(exercises.EXERCISES)


def test_every_stage_from_2_to_15_has_an_exercise_that_edits_its_kernel():
    stages = {e.stage for e in exercises.EXERCISES.values()}
    assert set(range(2, 16)) <= stages, sorted(stages)


@pytest.mark.parametrize("id", IDS)
def test_check_says_not_yet_on_the_committed_file(id):
    r = exercises.check(id, show=False)
    assert not r.done, str(r)
    assert "does not compile" not in r.message, str(r)


@pytest.mark.parametrize("id", IDS)
def test_check_says_done_with_the_solution(id):
    ex = exercises.EXERCISES[id]
    r = exercises.check(id, edits=ex.solution, show=False)
    assert r.done, str(r)


def test_a_broken_edit_is_reported_not_raised():
    ex = exercises.EXERCISES[IDS[0]]
    r = exercises.check(ex.id, edits=((ex.solution[0][0], "this is not python ("),), show=False)
    assert not r.done and "does not compile" in r.message, str(r)


def test_a_dsl_error_is_one_plain_line_with_the_place_of_the_edit():
    """An edit the DSL refuses at compile time (a name that does not exist) is reported without
    the DSL's terminal colours, with the line of the edited file and its text."""
    old = "        self.issue_qk(qk_mma, acc_S, tSrQ, tSrK, k_state.index)\n        # ... and O"
    new = old.replace("acc_S,", "acc_S_typo,")
    r = exercises.check("10a", edits=((old, new),), show=False)
    assert not r.done and "does not compile" in r.message, str(r)
    assert "\x1b" not in r.message, str(r)
    assert "name 'acc_S_typo' is not defined" in r.message, str(r)
    assert "of the edited file: `self.issue_qk(qk_mma, acc_S_typo," in r.message, str(r)


def test_a_solution_that_no_longer_applies_names_the_file():
    with pytest.raises(ValueError, match="occurs 0 times"):
        exercises.load_stage_file(2, "hopper", edits=(("no such text in any kernel", ""),))


# On an H200: what each edited Hopper kernel does to its output, as the exercises' tasks say.
# The committed kernels are right everywhere; with each solution applied:
GPU_EXPECTED = {
    "2a": ("S is right",),  # a 64-key tile changes the schedule, not the answer
    "4a": ("O is right",),  # a third slot changes the schedule, not the answer
    "5a": ("O is wrong",),  # O is no longer rescaled when a row max grows
    "6a": ("finite inputs: O is right", "no query sees: O holds NaN"),  # 0 x NaN = NaN
    "7a": ("O is wrong",),  # every query head reads K/V head h, past the 8 that exist
    # The edits of the barriers run in a process of their own, with a deadline:
    "8a": ("hangs",),  # kv_empty never completes a phase: the producer waits forever
    "9a": ("hangs",),  # warpgroup 2 waits for its last turn, warpgroup 1 at barrier 1
    "10a": ("O is right",),  # ptxas serialises the wgmma: right, but nothing overlaps
    "11a": ("O is right",),  # another order of the same tiles
    "12a": ("O is right",),  # the same fmax in one chain
}


@pytest.mark.gpu_hopper
@pytest.mark.parametrize("id", sorted(GPU_EXPECTED))
def test_edited_kernel_on_the_gpu_does_what_the_task_says(id, monkeypatch):
    # The kernels of 8a and 9a run in a process of their own, which does not run
    # tests/conftest.py: POISON_OUTPUTS=1 (inherited) fills its outputs with NaN before the launch.
    monkeypatch.setenv("POISON_OUTPUTS", "1")
    ex = exercises.EXERCISES[id]
    assert ex.track == "hopper" and ex.gpu_check is not None
    committed = exercises.check(id, show=False)
    assert "On this GPU" in committed.message, committed
    gpu_part = committed.message.split("On this GPU")[1]
    assert "wrong" not in gpu_part and "NaN" not in gpu_part.split("no query sees")[-1], committed
    assert "hang" not in gpu_part and "failed" not in gpu_part, committed
    edited = exercises.check(id, edits=ex.solution, show=False)
    gpu_part = edited.message.split("On this GPU")[1]
    for words in GPU_EXPECTED[id]:
        assert words in gpu_part, edited


def test_a_kernel_that_hangs_runs_in_a_process_of_its_own(tmp_path):
    """gpu_attention_in_subprocess, without a GPU: a stand-in stage file that never gets past its
    import is reported as a hang once the deadline has passed, and its process is ended; one
    that fails is reported as a failure. Nothing of it runs in the test's own process."""
    import types

    stuck = tmp_path / "_stuck_stage.py"
    stuck.write_text("import time\n\ntime.sleep(600)\n")
    msg = exercises.gpu_attention_in_subprocess(
        types.SimpleNamespace(__file__=str(stuck)), seconds=1, compile_seconds=5
    )
    assert "hangs" in msg and "ended" in msg, msg
    broken = tmp_path / "_broken_stage.py"
    broken.write_text("raise RuntimeError('no kernel here')\n")
    msg = exercises.gpu_attention_in_subprocess(
        types.SimpleNamespace(__file__=str(broken)), seconds=1, compile_seconds=60
    )
    assert "failed" in msg and "no kernel here" in msg, msg


def test_13a_split_reads_on_the_committed_and_the_edited_split_range():
    """Exercise 13a on the CPU, the numbers its task and notebook 13 state: the committed
    split_range reads each KV tile of a range once and none past it (65 tiles cut 16 ways: 3
    empty splits; 8 cut 16 ways: 8), and the solution's reads 15 tiles past 65 cut 16 ways and 8
    past 8 cut 16 ways, with no empty split."""
    import torch

    ex = exercises.EXERCISES["13a"]
    for edits, want in (((), {(65, 16): (0, 3), (8, 16): (0, 8)}),
                        (ex.solution, {(65, 16): (15, 0), (8, 16): (8, 0)})):  # fmt: skip
        mod = exercises.load_stage_file(13, "hopper", edits)
        kernel = mod.compile_args(torch.bfloat16, (1, 32, 1, 8269, 128), kv_heads=8, num_splits=16)[
            0
        ]
        split_range = type(kernel).split_range.__wrapped__
        for (tiles, num_splits), (past, empty) in want.items():
            _, outside, not_once, got_empty = exercises.split_reads(
                split_range, kernel, tiles, num_splits
            )
            assert (outside, got_empty, not_once) == (past, empty, 0), (edits, tiles, num_splits)


def test_14a_box_reads_on_the_committed_and_the_edited_load_tiles():
    """Exercise 14a on the CPU, the numbers its task and notebook 14 state: the committed
    load_tiles reads no page_table entry past a sequence's pages (a box past the last page reads
    the last page again), and the solution's reads entries 69-71 for 1,100 keys in pages of 16,
    entry 17 for 1,040 keys in pages of 64, entries 33-35 past a full row of 33 pages of 32, and
    entries 1-7 for one key; pages of 256 read the same either way. An edit that loads the
    wrong rows of the right page is reported as wrong, not as done."""
    import torch

    ex = exercises.EXERCISES["14a"]
    want_edited = {
        (1100, 16, 72): (0, 3, 0),
        (1040, 64, 20): (0, 1, 0),
        (1056, 32, 33): (0, 0, 3),
        (1, 16, 4): (0, 3, 4),
        (1100, 256, 5): (0, 0, 0),
    }
    assert set(want_edited) == set(exercises.PAGE_CASES)
    for edits, want in (((), {c: (0, 0, 0) for c in want_edited}), (ex.solution, want_edited)):
        mod = exercises.load_stage_file(14, "hopper", edits)
        for (seqused_k, page_size, max_pages), counts in want.items():
            kernel = mod.compile_args(
                torch.bfloat16, (1, 8, 1, max_pages * page_size, 128), page_size=page_size
            )[0]
            used = -(-seqused_k // page_size)
            row = list(range(used)) + [-1] * (max_pages - used)
            reads = exercises.box_reads(kernel, seqused_k, row)
            assert len(reads) == -(-seqused_k // 128) * (128 // min(page_size, 128))
            got = exercises.page_reads_summary(reads, seqused_k, page_size, max_pages)
            assert got == counts, (bool(edits), seqused_k, page_size, got)
    wrong_rows = (("tXgX[None, (key % self.page_size) // r, page]", "tXgX[None, 0, page]"),)
    r = exercises.check("14a", edits=ex.solution + wrong_rows, show=False)
    assert not r.done and "wrong page or rows" in r.message, str(r)


def test_15a_schedule_on_the_committed_and_the_swapped_pieces():
    """Exercise 15a on the CPU, the numbers notebook 15 states: ring.py as committed covers every
    pair the causal mask allows once and no other, on zig-zag chunks of RING_CASES, and its ring
    equals one attention over the sequence to 1e-5; with each rank's two pieces swapped, 24 of
    the 36 pairs of 8 tokens over 2 ranks are missed and 24 forbidden ones computed (448 of 528
    at 32 tokens over 4 ranks), none twice, and O is wrong; contiguous chunks (one piece each)
    are untouched. An edit that cuts other pieces is reported as not the exercise's."""
    ex = exercises.EXERCISES["15a"]
    assert ex.path.endswith("stages/stage15_context_parallel/ring.py")
    want_edited = {(8, 2): (24, 0, 24), (32, 4): (448, 0, 448), (37, 3): (570, 0, 570)}
    want_edited[(5, 4)] = (10, 0, 10)
    assert set(want_edited) == set(exercises.RING_CASES)
    for edits, want in (((), {c: (0, 0, 0) for c in want_edited}), (ex.solution, want_edited)):
        mod = exercises.load_stage_file(15, None, edits, path=ex.path)
        for (seqlen, world), counts in want.items():
            got = exercises.schedule_coverage(mod, seqlen, world, True, True)
            assert got == counts, (bool(edits), seqlen, world, got)
            assert exercises.schedule_coverage(mod, seqlen, world, True, False) == (0, 0, 0)
        err_o, err_lse = exercises.ring_error(mod, *exercises.RING_RUN)
        if edits:
            assert err_o > 0.5 and err_lse > 0.5, (err_o, err_lse)
        else:
            assert err_o < 1e-5 and err_lse < 1e-5, (err_o, err_lse)
    other = (("[piece[r], piece[count - 1 - r]] if zigzag", "[piece[r], piece[r]] if zigzag"),)
    r = exercises.check("15a", edits=other, show=False)
    assert not r.done and "neither" in r.message, str(r)


def test_a_result_is_echoed_without_its_message_again():
    # check() prints the message; Jupyter and the REPL then echo the returned Result's repr,
    # which must not print it a second time. str() keeps the whole message.
    r = exercises.Result(False, "8 wgmma per K tile")
    assert repr(r) == "Result(done=False)"
    assert str(r) == "not yet: 8 wgmma per K tile"


def test_the_command_line_lists_shows_hints_and_rejects_an_unknown_id(capsys, monkeypatch):
    assert exercises.main([]) == 0
    listing = capsys.readouterr().out
    for id in IDS:  # every exercise on a line of its own, with the file it edits
        ex = exercises.EXERCISES[id]
        line = re.search(rf"^{id}\s.*$", listing, re.M)
        assert line and os.path.relpath(ex.path, exercises.ROOT) in line.group(0), id
    assert exercises.main(["4a"]) == 0
    assert exercises.EXERCISES["4a"].task in capsys.readouterr().out
    assert exercises.main(["4a", "--hint"]) == 0
    assert capsys.readouterr().out.strip() == exercises.EXERCISES["4a"].hint.strip()
    with pytest.raises(SystemExit) as e:
        exercises.main(["zz"])
    assert e.value.code == 2 and "'zz' does not exist" in capsys.readouterr().err
    assert exercises.main(["2a", "--check"]) == 1  # the committed file: not yet
    assert "exercise 2a: not yet" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        exercises.main(["--hint"])  # a hint of which exercise?
    assert e.value.code == 2 and "need an exercise id" in capsys.readouterr().err
    # The exit status follows the check's verdict: 0 once the edit is done.
    monkeypatch.setattr(exercises, "check", lambda id: exercises.Result(True, "done"))
    assert exercises.main(["2a", "--check"]) == 0
