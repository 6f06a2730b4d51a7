"""The suite collects on a clean checkout: pytest's default import mode (``prepend``) imports
each test file by its basename, and the test directories are not packages, so two test files
with one basename fail collection ("import file mismatch") when both land on one worker — CI
failed so once (tests/integration and tests/dagster both had ``test_range_runs.py``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if "__pycache__" not in path.parts:
            by_name[path.name].append(str(path.relative_to(TESTS)))
    assert len(by_name) > 100
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"test files sharing a basename (rename one): {clashes}"
