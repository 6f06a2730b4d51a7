"""Process control for development lives in ``cg_pipelines.local`` only (``cg_pipelines.testing``
holds the test-only topology and fixtures, and re-exports none of it), and nothing outside the
tests' own package imports ``cg_pipelines.testing``."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import cg_pipelines.local as local
import cg_pipelines.local.nats_server as local_nats
import cg_pipelines.local.postgres as local_postgres
import cg_pipelines.local.spark_cluster as local_spark
import cg_pipelines.testing as testing

ROOT = Path(__file__).resolve().parents[2]


def test_local_processes_have_one_home() -> None:
    # no re-export of cg_pipelines.local from cg_pipelines.testing, no old module paths
    assert not set(testing.__all__) & set(local.__all__)
    assert not any(hasattr(testing, name) for name in local.__all__)
    for old in ("nats_server", "spark_cluster"):
        assert importlib.util.find_spec(f"cg_pipelines.testing.{old}") is None, old
    assert set(local.__all__) == (set(local_nats.__all__) | set(local_spark.__all__)
                                  | set(local_postgres.__all__))


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _outside_testing() -> list[Path]:
    lib = [p for p in (ROOT / "cg_pipelines").rglob("*.py")
           if not p.is_relative_to(ROOT / "cg_pipelines" / "testing")]
    return sorted([*lib, *(ROOT / "mainjob").rglob("*.py")])


@pytest.mark.parametrize("path", _outside_testing(), ids=lambda p: str(p.relative_to(ROOT)))
def test_library_cli_and_example_driver_do_not_import_testing(path: Path) -> None:
    found = sorted(m for m in _imports(path)
                   if m == "cg_pipelines.testing" or m.startswith("cg_pipelines.testing."))
    assert found == [], f"{path.relative_to(ROOT)} imports {found}"
