"""Every module of the package has its tests named: ``tests/unit/test_<name>.py``, or a row of
tests/unit/README.md whose test files exist (the table a newcomer reads to find where a test goes)."""

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


def test_every_module_has_its_tests_named():
    rows = table()
    modules = [p for top in ("rlhf", "stages") for p in sorted((ROOT / top).rglob("*.py")) if p.name != "__init__.py"]
    unnamed = []
    for path in modules:
        rel = str(path.relative_to(ROOT))
        if rel not in rows and not (ROOT / "tests" / "unit" / f"test_{path.stem}.py").exists():
            unnamed.append(rel)
    assert not unnamed, f"modules with no test file of their name and no row in tests/unit/README.md: {unnamed}"
    missing = [f"{m}: {t}" for m, tests in rows.items() for t in tests if not (ROOT / "tests" / t).exists()]
    gone = [m for m in rows if not (ROOT / m).exists()]
    assert not missing, f"rows naming test files that do not exist: {missing}"
    assert not gone, f"rows of modules that no longer exist: {gone}"
