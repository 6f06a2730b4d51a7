"""Version 0 of a table the sink creates carries the library's lineage (``cg.*``), like every
later version (issue 30, point 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.version import __version__

SCHEMA = pa.schema([("k", pa.string()), ("_seq", pa.int64()), ("_partition", pa.int64())])


def test_version_0_names_the_operation_mode_version_and_caller_metadata(tmp_path: Path) -> None:
    sink = DeltaSink(str(tmp_path / "t"), write=Merge(key="k"),
                     commit_metadata={"dagster_run_id": "run-1"})
    assert sink.ensure_table(SCHEMA)
    (v0,) = DeltaTable(str(tmp_path / "t")).history()
    assert v0["version"] == 0
    want = {"cg.operation": "create", "cg.write_mode": "merge",
            "cg.library_version": __version__, "cg.dagster_run_id": "run-1"}
    assert {k: v0.get(k) for k in want} == want
    assert json.loads(v0["userMetadata"]) == {k[3:]: v for k, v in want.items()}
    # no partition facts: the table is created for every partition
    assert "cg.app_id" not in v0 and "cg.watermark" not in v0


def test_a_second_creator_writes_nothing(tmp_path: Path) -> None:
    first, second = DeltaSink(str(tmp_path / "t")), DeltaSink(str(tmp_path / "t"))
    assert first.ensure_table(SCHEMA) and not second.ensure_table(SCHEMA)
    assert [h["version"] for h in DeltaTable(str(tmp_path / "t")).history()] == [0]
