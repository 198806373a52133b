"""Every module of the package has its tests named: ``tests/unit/test_<name>.py``, or a row of
tests/unit/README.md whose test files exist (the table a newcomer reads to find where a test
goes)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def table() -> dict:
    rows = {}
    for line in (ROOT / "tests" / "unit" / "README.md").read_text().splitlines():
        m = re.match(r"\| `([^`]+\.py)` \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
    return rows


def mirrored(module: Path) -> Path:
    """Where a module's own test file lives: ``rlhf/<folder>/.../<name>.py`` →
    ``tests/unit/<folder>/test_<name>.py``, ``rlhf/<name>.py`` → ``tests/unit/test_<name>.py``,
    ``stages/<name>.py`` → ``tests/unit/stages/test_<name>.py``."""
    parts = module.relative_to(ROOT).parts
    folder = parts[1:2] if parts[0] == "rlhf" and len(parts) > 2 else parts[:1]
    if parts[0] == "rlhf" and len(parts) == 2:
        folder = ()
    return ROOT / "tests" / "unit" / Path(*folder) / f"test_{module.stem}.py"


def test_the_unit_tests_mirror_the_package():
    """tests/unit/<folder>/ for each folder of rlhf/ (bench/ and faults/ for the repository's own),
    the project-wide checks and the package root's modules' tests at tests/unit/ itself."""
    for folder in sorted(p for p in (ROOT / "tests" / "unit").iterdir() if p.is_dir()):
        if folder.name == "__pycache__":
            continue
        mirrors = (ROOT / "rlhf" / folder.name).is_dir() or folder.name in ("bench", "faults")
        assert mirrors, f"tests/unit/{folder.name}/ mirrors no folder of rlhf/"
        assert (folder / "__init__.py").exists(), f"tests/unit/{folder.name}/ has no __init__.py"
        for test in folder.glob("test_*.py"):
            assert not (ROOT / "tests" / "unit" / test.name).exists(), f"two {test.name}"


def test_every_module_has_its_tests_named():
    rows = table()
    modules = [
        p
        for top in ("rlhf", "stages")
        for p in sorted((ROOT / top).rglob("*.py"))
        if p.name != "__init__.py"
    ]
    unnamed = []
    for path in modules:
        rel = str(path.relative_to(ROOT))
        if rel not in rows and not mirrored(path).exists():
            unnamed.append(rel)
    assert not unnamed, (
        f"modules with no test file of their name and no row in tests/unit/README.md: {unnamed}"
    )
    missing = [
        f"{m}: {t}" for m, tests in rows.items() for t in tests if not (ROOT / "tests" / t).exists()
    ]
    gone = [m for m in rows if not (ROOT / m).exists()]
    assert not missing, f"rows naming test files that do not exist: {missing}"
    assert not gone, f"rows of modules that no longer exist: {gone}"


def test_each_recipe_reads_in_one_screen():
    """stages/*.py: run() at most 120 lines, with no function defined inside it (setup → loop →
    export; the parts live in functions and objects of their own)."""
    import ast

    for path in sorted((ROOT / "stages").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "run":
                lines = node.end_lineno - node.lineno + 1
                assert lines <= 120, f"{path.name}: run() is {lines} lines"
                inner = [
                    n.name
                    for n in ast.walk(node)
                    if isinstance(n, ast.FunctionDef) and n is not node
                ]
                assert not inner, f"{path.name}: run() defines {inner}"


def test_the_front_door_and_the_performance_page_stay_references():
    """The README at most 12 KB (its two commands on the first screen), docs/performance.md at most
    30 KB of today's figures (the history in docs/history.md), docs/contract.md at most 40 KB."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12_000, len(readme.encode())
    assert (
        "scripts/run_all.sh" in "\n".join(readme.splitlines()[:25])
        and "scripts/test.sh" in readme[:2500]
    )
    assert len((ROOT / "docs" / "performance.md").read_bytes()) <= 30_000
    assert len((ROOT / "docs" / "contract.md").read_bytes()) <= 40_000  # every key: docs/keys.md


def test_comments_mostly_on_their_own_lines_and_no_line_over_100():
    """rlhf/ and stages/: at most a quarter of the comments trail code (a comment explaining a block
    stands above it); no line of the Python sources over 100 characters (ruff's line-length)."""
    import io
    import tokenize

    trailing = own = 0
    for top in ("rlhf", "stages"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
                if tok.type == tokenize.COMMENT:
                    if tok.line.strip().startswith("#"):
                        own += 1
                    else:
                        trailing += 1
    assert trailing <= 0.25 * (trailing + own), (
        f"{trailing} of {trailing + own} comments trail code"
    )
    long = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("rlhf", "stages", "tests", "bench", "scripts")
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if len(line) > 100
    ]
    assert not long, f"lines over 100 characters: {long[:10]}"
