"""The Dagster integration's modules import one way: the asset op (``dagster/assets.py``) is a
leaf that only ``definitions.py`` builds on; sensors, checks and the reconcile check take what
they share with it (the spec, tick errors, asset keys, run tags) from ``spec.py`` and
``history.py`` (issue 33: sensors borrowed ``TICK_ERRORS``, ``load_group_config``,
``asset_key_of`` and ``MODE_TAG`` from the asset module)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DAGSTER_DIR = Path(__file__).resolve().parents[2] / "cg_pipelines" / "dagster"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module}


@pytest.mark.parametrize("name", ["sensors.py", "checks.py", "reconcile.py", "history.py",
                                  "spec.py", "resources.py", "io_manager.py"])
def test_shared_dagster_modules_do_not_import_the_asset_op(name: str) -> None:
    assert "cg_pipelines.dagster.assets" not in imported_modules(DAGSTER_DIR / name)


def test_only_definitions_imports_the_asset_op() -> None:
    importers = sorted(p.name for p in DAGSTER_DIR.glob("*.py")
                       if "cg_pipelines.dagster.assets" in imported_modules(p))
    assert importers == ["definitions.py"]
