"""The Dagster integration's modules import one way: a partition run (``dagster/run.py``, the
asset op's body and the one call into the engine) is built on by the asset builder
(``asset.py``) alone; the triggers (sensors, schedule, backlog tick) and the checks take what
they share with it (the spec, tick errors, asset keys, run tags) from ``spec.py`` and ``history.py``
(issue 33), and nothing below the builder imports it (issue 50)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DAGSTER_DIR = Path(__file__).resolve().parents[2] / "cg_pipelines" / "dagster"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module}


@pytest.mark.parametrize("name", ["triggers.py", "reading.py", "checks.py", "history.py",
                                  "spec.py", "resources.py", "io_manager.py"])
def test_shared_dagster_modules_do_not_import_the_run_or_the_builder(name: str) -> None:
    imported = imported_modules(DAGSTER_DIR / name)
    assert not imported & {"cg_pipelines.dagster.run", "cg_pipelines.dagster.asset"}


def test_only_the_builder_imports_the_run() -> None:
    importers = sorted(p.name for p in DAGSTER_DIR.glob("*.py")
                       if "cg_pipelines.dagster.run" in imported_modules(p))
    assert importers == ["asset.py"]


def test_only_the_run_calls_the_engines_run_entry_points() -> None:
    entry = {"cg_pipelines.engine.runner", "cg_pipelines.engine.rebuild",
             "cg_pipelines.engine.join_rebuild"}
    importers = sorted(p.name for p in DAGSTER_DIR.glob("*.py") if imported_modules(p) & entry)
    assert importers == ["run.py"]
