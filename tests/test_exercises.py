"""The exercises that edit a kernel (common/tools/exercises.py), on the CPU: each check must say
"not yet" on the stage file as committed and "done" once the exercise's own solution is applied
to a copy, and every solution must still apply (its text found exactly once). Compile-only: the
checks read PTX, shared memory and the schedule model, so they run in CI."""

import pytest

from common.tools import exercises

IDS = sorted(exercises.EXERCISES)


def test_every_stage_from_2_to_7_has_an_exercise_that_edits_its_kernel():
    stages = {e.stage for e in exercises.EXERCISES.values()}
    assert set(range(2, 8)) <= stages, sorted(stages)


@pytest.mark.parametrize("id", IDS)
def test_check_says_not_yet_on_the_committed_file(id):
    r = exercises.check(id, show=False)
    assert not r.done, r
    assert "does not compile" not in r.message, r


@pytest.mark.parametrize("id", IDS)
def test_check_says_done_with_the_solution(id):
    ex = exercises.EXERCISES[id]
    r = exercises.check(id, edits=ex.solution, show=False)
    assert r.done, r


def test_a_broken_edit_is_reported_not_raised():
    ex = exercises.EXERCISES[IDS[0]]
    r = exercises.check(ex.id, edits=((ex.solution[0][0], "this is not python ("),), show=False)
    assert not r.done and "does not compile" in r.message, r


def test_a_solution_that_no_longer_applies_names_the_file():
    with pytest.raises(ValueError, match="occurs 0 times"):
        exercises.load_stage_file(2, "hopper", edits=(("no such text in any kernel", ""),))
