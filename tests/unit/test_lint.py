"""The style the project keeps: ruff's linter and formatter as configured in pyproject.toml
([tool.ruff]), and plain ``if`` blocks where conditional expressions would pack several decisions
into one line (rlhf/ and stages/).

ruff is a dev dependency (pyproject.toml [dev], pinned in requirements/constraints.txt): when it is
missing these tests fail rather than skip. Fix a failure with ``python -m ruff check --fix`` and
``python -m ruff format``, or by hand where ruff cannot.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

# rlhf/ and stages/: at most this many conditional expressions (``a if c else b``) per 1,000 lines
MAX_PER_1000_LINES = 12
SCANNED = ("rlhf", "stages")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    assert importlib.util.find_spec("ruff") is not None, (
        f"ruff is not installed in {sys.executable}: it is a dev dependency (pip install "
        "-e '.[dev]' "
        f"-c requirements/constraints.txt, or scripts/test.sh, which installs it)"
    )
    # the paths are the configuration's ([tool.ruff] include); no cache written into the tree
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _failure(proc: subprocess.CompletedProcess, fix: str) -> str:
    version = subprocess.run(
        [sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True
    ).stdout
    return f"{proc.stdout}{proc.stderr}\n({version.strip()}; {fix})"


def test_ruff_check_passes():
    proc = _ruff("check")
    assert proc.returncode == 0, _failure(proc, "python -m ruff check --fix fixes the safe ones")


def test_ruff_format_leaves_the_tree_as_it_is():
    proc = _ruff("format", "--check")
    assert proc.returncode == 0, _failure(proc, "python -m ruff format rewrites them")


def _sources(root: Path = ROOT):
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            yield path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")


def _units(tree: ast.AST):
    """(node, its conditional expressions): every statement with the conditional expressions of its
    own expressions (not those of the statements in its body), and every lambda with those of its
    body (not counted in the statement that holds the lambda)."""
    todo = [tree]
    while todo:
        unit = todo.pop()
        found = []
        stack = [unit.body] if isinstance(unit, ast.Lambda) else list(ast.iter_child_nodes(unit))
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.stmt, ast.Lambda)):
                todo.append(node)
                continue
            if isinstance(node, ast.IfExp):
                found.append(node)
            stack.extend(ast.iter_child_nodes(node))
        if found:
            yield unit, found


def conditional_expressions(sources) -> dict:
    """What the checks below read: every conditional expression (``file:line``), those with another
    inside them, the statements (or lambdas) with more than one, and the number of lines scanned."""
    every, nested, packed, lines = [], [], [], 0
    for name, src in sources:
        tree = ast.parse(src, filename=name)
        lines += len(src.splitlines())
        for node in ast.walk(tree):
            if isinstance(node, ast.IfExp):
                every.append(f"{name}:{node.lineno}")
                if any(
                    isinstance(inner, ast.IfExp) for inner in ast.walk(node) if inner is not node
                ):
                    nested.append(f"{name}:{node.lineno}")
        for unit, found in _units(tree):
            if len(found) > 1:
                packed.append(f"{name}:{unit.lineno} ({len(found)})")
    return {"every": every, "nested": nested, "packed": packed, "lines": lines}


@pytest.fixture(scope="module")
def found():
    return conditional_expressions(_sources())


def test_the_counts_see_what_they_count():
    src = (
        "x = a if c else b\n"
        "y = (a if c else b) if d else e\n"
        "z = f(a if c else b, d if e else g)\n"
        "if a if c else b:\n"
        "    w = 1 if c else 2\n"
        "h = lambda: a if c else b\n"
        "def f(p=a if c else b):\n"
        "    return 1\n"
    )
    got = conditional_expressions([("m.py", src)])
    assert len(got["every"]) == 9 and got["lines"] == 8
    assert got["nested"] == ["m.py:2"]
    # the if statement's test and its body's statement count apart, as do the lambda and its
    # statement
    assert sorted(got["packed"]) == ["m.py:2 (2)", "m.py:3 (2)"]


def test_no_conditional_expression_inside_another(found):
    assert not found["nested"], (
        "a conditional expression inside another (write the decisions as an if/elif/else block): "
        + ", ".join(found["nested"])
    )


def test_one_conditional_expression_per_statement_at_most(found):
    assert not found["packed"], (
        "statements with several conditional expressions (name the values with if blocks first): "
        + ", ".join(found["packed"])
    )


def test_conditional_expressions_stay_rare(found):
    count, lines = len(found["every"]), found["lines"]
    per_1000 = 1000 * count / max(lines, 1)
    by_file: dict = {}
    for where in found["every"]:
        name, line = where.rsplit(":", 1)
        by_file.setdefault(name, []).append(line)
    densest = sorted(by_file.items(), key=lambda kv: -len(kv[1]))[:10]
    assert per_1000 <= MAX_PER_1000_LINES, (
        f"{count} conditional expressions in {lines} lines of {' and '.join(SCANNED)}/ "
        f"({per_1000:.1f} per 1,000 "
        f"lines, at most {MAX_PER_1000_LINES}): write the longer ones as if blocks. Most in: "
        + "; ".join(f"{name}:{','.join(lines_)}" for name, lines_ in densest)
    )
