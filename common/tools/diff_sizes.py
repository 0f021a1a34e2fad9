"""How big each stage's diff is: for every pair of consecutive stages of a track, the lines that
`make diff-N` shows added or removed, and how many of them fall inside docstrings (a module's,
a class's or a function's).

    python -m common.tools.diff_sizes [--track hopper|blackwell] [--map N]

The schedule stages (8-12) aim at a diff of at most 400 lines, at most 60 of them docstring:
one technique per stage, explained in the file and measured in docs/. Pairs over either bound
are marked."""

import argparse
import ast
import os
import re
import subprocess

from common.tools import stage_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMITS = {"lines": 400, "docstring": 60, "stages": range(8, 13)}


def docstring_lines(path):
    """The 1-based line numbers of every docstring in the file."""
    with open(path) as f:
        tree = ast.parse(f.read())
    lines = set()
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def diff_size(old, new):
    """(lines added + removed, of which docstring lines) of `git diff --no-index old new`."""
    removed, added = _diff_lines(old, new)
    doc_old, doc_new = docstring_lines(old), docstring_lines(new)
    doc = sum(i in doc_old for i in removed) + sum(i in doc_new for i in added)
    return len(removed) + len(added), doc


def _diff_lines(old, new):
    """(removed, added): the 1-based line numbers of old's lines that `git diff --no-index -U0`
    removes and of new's lines that it adds."""
    out = subprocess.run(
        ["git", "diff", "--no-index", "-U0", old, new], capture_output=True, text=True
    ).stdout
    removed, added = [], []
    for line in out.splitlines():
        hunk = re.match(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@", line)
        if hunk:
            at_old, at_new = int(hunk.group(1)), int(hunk.group(2))
        elif line.startswith(("---", "+++")):
            continue
        elif line.startswith("-"):
            removed.append(at_old)
            at_old += 1
        elif line.startswith("+"):
            added.append(at_new)
            at_new += 1
    return removed, added


def owners(path):
    """The part of the file each 1-based line belongs to: `Class.method`, a module-level
    `function`, `Class` (its docstring and attributes) or `module` (docstring, imports,
    constants). Decorators and the blank lines and comments right above a definition belong to
    it."""
    with open(path) as f:
        text = f.read()
    count = text.count("\n") + 1
    spans = []  # (first line, last line, name), outer before inner
    for node in ast.parse(text).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans.append((first, node.end_lineno, node.name))
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    first = min([item.lineno] + [d.lineno for d in item.decorator_list])
                    spans.append((first, item.end_lineno, f"{node.name}.{item.name}"))
    names = ["module"] * (count + 1)
    for first, last, name in spans:  # inner spans come later and overwrite
        for i in range(first, last + 1):
            names[i] = name
    lines = text.split("\n")
    # Blank and comment lines between two parts belong to the part below them.
    for i in range(count - 1, 0, -1):
        if lines[i - 1].strip() in ("",) or lines[i - 1].strip().startswith("#"):
            if i + 1 <= count and names[i] != names[i + 1] and names[i + 1] != "module":
                names[i] = names[i + 1]
    return names


def method_sizes(old, new):
    """Where the lines of `git diff --no-index old new` fall: [(part, added, removed)] for every
    part (owners) with a changed line, in the order of the new file, then the parts only the old
    file has. The counts add up to diff_size's."""
    removed, added = _diff_lines(old, new)
    own_old, own_new = owners(old), owners(new)
    counts = {}
    for i in added:
        counts.setdefault(own_new[i], [0, 0])[0] += 1
    for i in removed:
        counts.setdefault(own_old[i], [0, 0])[1] += 1
    order = list(dict.fromkeys(own_new[1:])) + list(dict.fromkeys(own_old[1:]))
    seen = []
    for name in order:
        if name in counts and name not in seen:
            seen.append(name)
    return [(name, *counts[name]) for name in seen]


def table(track):
    """[(N, lines, docstring lines, over a bound)] for each stage N of the track after the first."""
    rows = []
    for st in stage_table.STAGES:
        n = st.number
        if n < 2 or not stage_table.available(n, track) or not stage_table.available(n - 1, track):
            continue
        old = os.path.join(ROOT, "stages", stage_table.stage(n - 1).package, f"{track}.py")
        new = os.path.join(ROOT, "stages", st.package, f"{track}.py")
        lines, doc = diff_size(old, new)
        over = n in LIMITS["stages"] and (lines > LIMITS["lines"] or doc > LIMITS["docstring"])
        rows.append((n, lines, doc, over))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--track", choices=("hopper", "blackwell"), action="append")
    ap.add_argument(
        "--map", type=int, metavar="N", help="where make diff-N's lines fall, method by method"
    )
    args = ap.parse_args(argv)
    if args.map is not None:
        for track in args.track or ("hopper", "blackwell"):
            n = args.map
            if n < 2 or not all(stage_table.available(m, track) for m in (n - 1, n)):
                raise SystemExit(f"--map {n}: no stages {n - 1} and {n} on {track}")
            old, new = (
                os.path.join(ROOT, "stages", stage_table.stage(m).package, f"{track}.py")
                for m in (n - 1, n)
            )
            print(f"{track}: make diff-{n}, lines added and removed per part of the file")
            for name, added, removed in method_sizes(old, new):
                print(f"  {name:40s} +{added:<4d} -{removed}")
        return
    for track in args.track or ("hopper", "blackwell"):
        print(f"{track}: stage N-1 -> N, lines added + removed (docstring lines)")
        for n, lines, doc, over in table(track):
            mark = "  over the schedule stages' bound" if over else ""
            print(f"  {n - 1:2d} -> {n:2d}  {lines:5d}  ({doc}){mark}")


if __name__ == "__main__":
    main()
