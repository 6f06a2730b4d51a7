"""The Dagster integration's modules import one way: a partition run (``dagster/run.py``, the
asset op's body and the one call into the engine) is built on by the asset builder
(``asset.py``) alone; the triggers (sensors, schedule, backlog tick) and the checks take what
they share with it (the spec, tick errors, asset keys, run tags) from ``spec.py`` and ``history.py``
(issue 33), and nothing below the builder imports it (issue 50). The run and the Airflow drain
task call the engine through the same function (``engine.inputs.run_inputs``)."""

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


RUN_ENTRY_POINTS = {"run_inputs", "run_partition", "run_partitions", "run_copartitioned",
                    "rebuild_partition", "rebuild_copartitioned"}
"""The engine's run functions (``run_inputs`` is the one both orchestrators call)."""


def imported_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("cg_pipelines.engine") for alias in node.names}


def test_only_the_run_calls_the_engines_run_entry_points() -> None:
    importers = {p.name: imported_names(p) & RUN_ENTRY_POINTS
                 for p in DAGSTER_DIR.glob("*.py")}
    assert {k: v for k, v in importers.items() if v} == {"run.py": {"run_inputs"}}


def test_the_airflow_drain_calls_the_same_entry_point() -> None:
    airflow = DAGSTER_DIR.parent / "airflow"
    importers = {p.name: imported_names(p) & RUN_ENTRY_POINTS for p in airflow.glob("*.py")}
    assert {k: v for k, v in importers.items() if v} == {"tasks.py": {"run_inputs"}}
