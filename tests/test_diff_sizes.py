"""common/tools/diff_sizes.py on the CPU: the count of a small diff, docstring lines told apart
from code, and a row for every consecutive pair of stages of each track."""

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
