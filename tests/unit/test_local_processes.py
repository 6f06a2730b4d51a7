"""Process control for development lives in ``cg_pipelines.local``; ``cg_pipelines.testing``
(and its old module paths) re-export the same objects, and nothing outside the tests' own
package imports ``cg_pipelines.testing``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cg_pipelines.local as local
import cg_pipelines.local.nats_server as local_nats
import cg_pipelines.local.postgres as local_postgres
import cg_pipelines.local.spark_cluster as local_spark
import cg_pipelines.testing as testing
import cg_pipelines.testing.nats_server as old_nats
import cg_pipelines.testing.spark_cluster as old_spark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("old", "new"), [(old_nats, local_nats), (old_spark, local_spark)],
                         ids=["nats_server", "spark_cluster"])
def test_old_module_paths_re_export_the_same_objects(old: object, new: object) -> None:
    assert old.__all__ == new.__all__  # type: ignore[attr-defined]
    for name in new.__all__:  # type: ignore[attr-defined]
        assert getattr(old, name) is getattr(new, name), name


def test_packages_export_the_same_objects() -> None:
    for name in ("NatsServer", "NatsServerError", "NatsServerNotFoundError", "find_nats_server",
                 "SparkConnectServer", "SparkStandaloneCluster"):
        assert getattr(testing, name) is getattr(local, name), name
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
