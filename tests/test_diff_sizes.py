"""common/tools/diff_sizes.py on the CPU: the count of a small diff, docstring lines told apart
from code, and a row for every consecutive pair of stages of each track."""

import pytest

from common.tools import diff_sizes, stage_table

OLD = '''"""Module docstring,
two lines."""


def f(x):
    """Adds one."""
    return x + 1
'''

NEW = '''"""Module docstring,
two lines, the second changed."""


def f(x):
    """Adds two."""
    y = x + 2
    return y
'''


def test_counts_added_removed_and_docstring_lines(tmp_path):
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(OLD)
    new.write_text(NEW)
    # Removed: line 2 and 6 (docstrings), 7 (code); added: 2 and 6 (docstrings), 7 and 8 (code).
    assert diff_sizes.docstring_lines(str(old)) == {1, 2, 6}
    assert diff_sizes.diff_size(str(old), str(new)) == (7, 4)
    assert diff_sizes.diff_size(str(old), str(old)) == (0, 0)


def test_a_row_per_consecutive_pair_of_each_track():
    for track in ("hopper", "blackwell"):
        rows = diff_sizes.table(track)
        have = [n for n in sorted(stage_table.BY_NUMBER) if stage_table.available(n, track)]
        assert [n for n, *_ in rows] == [n for n in have if n >= 2 and n - 1 in have]
        assert all(lines > 0 and 0 <= doc <= lines for _, lines, doc, _ in rows)


PARTS_OLD = '''"""Doc."""
import os


class K:
    """K."""

    def a(self):
        return 1

    def b(self):
        return 2
'''

PARTS_NEW = '''"""Doc."""
import os


class K:
    """K."""

    def a(self):
        return 10

    # c comes before b now
    @staticmethod
    def c():
        return 3

    def b(self):
        return 2
'''


def test_each_changed_line_falls_in_its_method(tmp_path):
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(PARTS_OLD)
    new.write_text(PARTS_NEW)
    names = diff_sizes.owners(str(new))
    # The blank line, the comment and the decorator above `def c` belong to K.c, the blank
    # line after it to K.b.
    assert [names[i] for i in (10, 11, 12, 13, 14)] == ["K.c"] * 5 and names[15] == "K.b"
    assert names[1] == "module" and names[6] == "K" and names[9] == "K.a"
    rows = diff_sizes.method_sizes(str(old), str(new))
    assert rows == [("K.a", 1, 1), ("K.c", 5, 0)]
    assert sum(a + r for _, a, r in rows) == diff_sizes.diff_size(str(old), str(new))[0]


def test_the_map_of_every_diff_adds_up_to_its_size():
    for track in ("hopper", "blackwell"):
        for n, lines, _, _ in diff_sizes.table(track):
            old = stage_table.stage(n - 1).package
            new = stage_table.stage(n).package
            rows = diff_sizes.method_sizes(
                f"{diff_sizes.ROOT}/stages/{old}/{track}.py",
                f"{diff_sizes.ROOT}/stages/{new}/{track}.py",
            )
            assert sum(a + r for _, a, r in rows) == lines, (track, n)


def test_the_map_on_the_command_line(capsys):
    diff_sizes.main(["--map", "8", "--track", "hopper"])
    out = capsys.readouterr().out
    assert "make diff-8" in out and "Sm90Kernel.kernel" in out and "Sm90Kernel.mma_tile" in out
    with pytest.raises(SystemExit, match="no stages 0 and 1"):
        diff_sizes.main(["--map", "1", "--track", "hopper"])


def test_schedule_stages_keep_their_bounds():
    """Stages 8-12 teach one schedule technique each: every such diff stays within 400 lines, at
    most 60 of them docstring, on both tracks (the bounds in diff_sizes.LIMITS)."""
    # The bounds are checked on the counts themselves, not only through table()'s own `over`
    # flag (a flag computed wrongly would pass every diff), and every schedule stage is reached.
    assert (diff_sizes.LIMITS["lines"], diff_sizes.LIMITS["docstring"]) == (400, 60)
    assert diff_sizes.LIMITS["stages"] == range(8, 13)
    for track in ("hopper", "blackwell"):
        checked = []
        for n, lines, doc, over in diff_sizes.table(track):
            if n in diff_sizes.LIMITS["stages"]:
                checked.append(n)
                assert lines <= 400 and doc <= 60 and not over, (
                    f"{track} diff-{n}: {lines} lines, {doc} of them docstring; the bounds are "
                    f"{diff_sizes.LIMITS['lines']} and {diff_sizes.LIMITS['docstring']}"
                )
        assert checked == list(range(8, 13)), (track, checked)
