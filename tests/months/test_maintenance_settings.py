"""Where maintenance is configured: per warehouse (DeltaWarehouseResource fields), per group
(ConsumerGroupAsset.maintenance), and the Delta properties of tables the sink creates."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.dagster import ConsumerGroupAsset, DeltaWarehouseResource
from cg_pipelines.sinks.delta import DeltaSink, Maintenance
from tests.support import keyed


def test_warehouse_and_group_settings(tmp_path: Path) -> None:
    wh = DeltaWarehouseResource(root=str(tmp_path), compact_min_files=4, target_file_size_mb=8,
                                vacuum_retention_hours=None)
    m = wh.sink("t").maintenance
    assert (m.compact, m.compact_min_files, m.target_size, m.vacuum_retention_hours) == (
        True, 4, 8 * 1024 * 1024, None)
    assert wh.sink("t", maintenance=Maintenance.off()).maintenance == Maintenance.off()
    assert DeltaWarehouseResource(root=str(tmp_path)).sink("t").maintenance == Maintenance()
    spec = ConsumerGroupAsset("a", "S", "g", 2, keyed.processor(),
                              maintenance=Maintenance(compact_min_files=3))
    assert spec.maintenance == Maintenance(compact_min_files=3)
    with pytest.raises(ConfigError, match="maintenance"):
        ConsumerGroupAsset("a", "S", "g", 2, keyed.processor(), maintenance="on")  # type: ignore[arg-type]


def test_created_tables_carry_the_retention_properties(tmp_path: Path) -> None:
    schema = pa.schema([("k", pa.string()), ("_partition", pa.int32())])
    DeltaSink(str(tmp_path / "a"), schema=schema).ensure_table(schema)
    conf = DeltaTable(str(tmp_path / "a")).metadata().configuration
    # tombstones: the log window's floor (one hour), not the 7-day vacuum retention
    assert conf["delta.deletedFileRetentionDuration"] == "interval 3600 seconds"
    # bounded by default: the vacuum retention (Delta's own default would be 30 days)
    assert conf["delta.logRetentionDuration"] == f"interval {168 * 3600} seconds"
    DeltaSink(str(tmp_path / "b"), maintenance=Maintenance(
        vacuum_retention_hours=24, log_retention_hours=48)).ensure_table(schema)
    conf = DeltaTable(str(tmp_path / "b")).metadata().configuration
    # time travel asked for: the files removed within it keep their tombstones as long
    assert conf["delta.deletedFileRetentionDuration"] == f"interval {48 * 3600} seconds"
    assert conf["delta.logRetentionDuration"] == f"interval {48 * 3600} seconds"
    DeltaSink(str(tmp_path / "c"), maintenance=Maintenance(
        tombstone_retention_hours=1)).ensure_table(schema)
    conf = DeltaTable(str(tmp_path / "c")).metadata().configuration
    assert conf["delta.deletedFileRetentionDuration"] == "interval 3600 seconds"
    DeltaSink(str(tmp_path / "d"), maintenance=Maintenance(
        vacuum_retention_hours=0, tombstone_retention_hours=None)).ensure_table(schema)
    conf = DeltaTable(str(tmp_path / "d")).metadata().configuration
    assert conf["delta.deletedFileRetentionDuration"] == "interval 0 seconds"
    assert Maintenance(log_floor_s=7200).tombstone_retention() == 2.0
    assert Maintenance(tombstone_retention_hours=168).tombstone_retention() == 168
    with pytest.raises(ConfigError, match="tombstone_retention_hours"):
        Maintenance(tombstone_retention_hours=-1)


@pytest.mark.parametrize("tombstone_hours", [None, 0])
def test_vacuum_keeps_an_old_file_removed_within_the_tombstone_retention(
        tmp_path: Path, tombstone_hours: float | None) -> None:
    """The default tombstone retention (the log window's hour) still protects a file written
    long before the vacuum retention and removed just now (a compaction) from VACUUM (full);
    with none, such a file goes at once (files written within the vacuum retention stay
    either way)."""
    schema = pa.schema([("k", pa.string()), ("_partition", pa.int32())])
    sink = DeltaSink(str(tmp_path), schema=schema, maintenance=Maintenance(
        compact_min_files=2, vacuum_interval_s=0, tombstone_retention_hours=tombstone_hours))
    for i in range(1, 3):
        sink.commit(pa.table({"k": [f"k{i}"], "_partition": [0]}, schema=schema), {"a": (i - 1, i)})
    old = [u.removeprefix("file://") for u in sink.file_uris()]
    assert len(old) == 2 and all(os.path.exists(p) for p in old)
    eight_days_ago = time.time() - 8 * 86_400
    for path in old:
        os.utime(path, (eight_days_ago, eight_days_ago))
    figures = sink.maintain(0, "a")  # compaction: both removed now
    assert figures["compact"] == "done", figures
    # delta-rs keeps the tombstones of the commits after the last checkpoint whatever their
    # age: the retention decides from the next checkpoint on
    DeltaTable(str(tmp_path)).create_checkpoint()
    figures = sink.maintain(0, "a")
    assert figures["vacuum"] == "done", figures
    assert len(sink.file_uris()) == 1 and sink.read().num_rows == 2
    kept = [os.path.exists(p) for p in old]
    assert kept == ([True, True] if tombstone_hours is None else [False, False])
