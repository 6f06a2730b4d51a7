"""What an Iceberg table the sink writes keeps as it ages (issue 40): the manifest list stays
bounded across commits (pyiceberg's merge append, ``MANIFEST_MERGE``, set on created tables and
on tables first written to; a table's own setting is kept), the table metadata keeps at most
``keep_snapshots`` (+ half as many between two expiries) snapshots and ``metadata_versions``
metadata-log entries, and a commit is built on a view of the table without the old snapshots
(``iceberg_view.commit_view``) that drops none of them and is fenced the same."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.iceberg import MANIFEST_MERGE, IcebergSink
from cg_pipelines.sinks.iceberg_expire import expiry_slack
from cg_pipelines.sinks.iceberg_view import commit_view
from cg_pipelines.sinks.maintenance import Maintenance
from tests.iceberg.conftest import Backend

SCHEMA = pa.schema([("key", pa.string()), ("v", pa.int64()), ("seq", pa.int64()),
                    ("_partition", pa.int64())])
NO_COMPACTION = Maintenance(compact=False)
MIN_COUNT = int(MANIFEST_MERGE["commit.manifest.min-count-to-merge"])


def rows(p: int, seq: int) -> pa.Table:
    return pa.table({"key": [f"k{seq}"], "v": [seq], "seq": [seq], "_partition": [p]},
                    schema=SCHEMA)


def drive(s: IcebergSink, commits: int, parts: int = 4) -> None:
    """``commits`` one-row commits per partition, round robin, each one file."""
    for i in range(1, commits + 1):
        for p in range(parts):
            s.watermark(f"a/{p}")
            s.commit(rows(p, i), {f"a/{p}": (i - 1, i)})


def manifests(s: IcebergSink) -> int:
    tbl = s.load()
    assert tbl is not None and tbl.current_snapshot() is not None
    return len(tbl.current_snapshot().manifests(tbl.io))


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
def test_manifests_stay_bounded_without_compaction(backend: Backend) -> None:
    s = backend.sink(maintenance=NO_COMPACTION)
    drive(s, 10)  # 40 commits, 40 data files, no compaction
    tbl = s.load()
    assert tbl is not None
    assert {k: tbl.properties.get(k) for k in MANIFEST_MERGE} == MANIFEST_MERGE
    assert manifests(s) <= MIN_COUNT  # a fast append would have 40
    assert s.read().num_rows == 40
    assert [s.watermark(f"a/{p}") for p in range(4)] == [10] * 4


def test_a_table_written_to_first_gets_merge_append_unless_it_says_otherwise(tmp_path) -> None:
    cat = SqlCatalog("x", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}")
    cat.create_namespace("n")
    cat.create_table("n.plain", schema=SCHEMA)
    cat.create_table("n.own", schema=SCHEMA,
                     properties={"commit.manifest-merge.enabled": "false"})
    plain = IcebergSink("n.plain", catalog=cat, maintenance=NO_COMPACTION)
    own = IcebergSink("n.own", catalog=cat, maintenance=NO_COMPACTION)
    drive(plain, 5)
    drive(own, 5)
    assert cat.load_table("n.plain").properties["commit.manifest-merge.enabled"] == "true"
    assert manifests(plain) <= MIN_COUNT
    props = cat.load_table("n.own").properties
    assert props["commit.manifest-merge.enabled"] == "false"  # the table's own setting kept
    assert props["commit.retry.num-retries"] == "0"  # the fence's setting all the same
    assert manifests(own) == 20  # fast append: one manifest per commit
    zombie = IcebergSink("n.plain", catalog=cat)
    zombie.watermark("a/0")
    plain.commit(rows(0, 6), {"a/0": (5, 6)})
    with pytest.raises(FenceConflictError):  # merge append is fenced as before
        zombie.commit(rows(0, 6), {"a/0": (5, 6)})
    assert plain.read().num_rows == 21


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
def test_the_metadata_a_commit_copies_stays_bounded(backend: Backend) -> None:
    s = backend.sink(maintenance=NO_COMPACTION)
    drive(s, 8)  # 32 commits, a snapshot each: more than 20 + 10, so expired down to 20
    figures = s.maintain(0, "a/0")
    assert "error" not in figures, figures
    tbl = s.load()
    assert tbl is not None
    assert len(tbl.snapshots()) == 20 and len(tbl.metadata.snapshot_log) <= 20
    assert len(tbl.metadata.metadata_log) <= 20
    assert s.read().num_rows == 32


@pytest.mark.parametrize("backend", ["sqlite-local", "postgres-local"], indirect=True)
def test_commits_on_the_view_keep_every_snapshot_and_are_fenced(backend: Backend) -> None:
    s = backend.sink(maintenance=NO_COMPACTION, keep_snapshots=100)
    drive(s, 3)  # 12 commits
    tbl = s.load()
    assert tbl is not None
    view = commit_view(tbl)
    assert [x.snapshot_id for x in view.snapshots()] == [tbl.current_snapshot().snapshot_id]
    assert len(tbl.snapshots()) == 12  # the view left the table's own state alone
    assert view.metadata.metadata_log == tbl.metadata.metadata_log
    zombie = backend.sink(maintenance=NO_COMPACTION)
    assert zombie.watermark("a/1") == 3
    s.watermark("a/1")
    s.commit(rows(1, 4), {"a/1": (3, 4)})
    with pytest.raises(FenceConflictError):  # built on the view, refused all the same
        zombie.commit(rows(1, 4), {"a/1": (3, 4)})
    for p in (0, 2, 3):
        s.watermark(f"a/{p}")
        s.commit(rows(p, 4), {f"a/{p}": (3, 4)})
    tbl = s.load()
    assert tbl is not None
    assert len(tbl.snapshots()) == 16  # every commit's snapshot is kept
    assert [x.snapshot_id for x in tbl.snapshots()] == [e.snapshot_id
                                                         for e in tbl.metadata.snapshot_log]
    assert len(tbl.metadata.metadata_log) <= 20
    assert s.read().num_rows == 16 and [s.watermark(f"a/{p}") for p in range(4)] == [4] * 4


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
def test_expiry_waits_for_the_slack(backend: Backend) -> None:
    s = backend.sink(maintenance=NO_COMPACTION, keep_snapshots=4)
    assert expiry_slack(4) == 2
    drive(s, 6, parts=1)  # 6 snapshots: not more than 4 + 2
    assert s.maintain(0, "a/0")["iceberg_snapshots_expired"] == 0
    s.commit(rows(0, 7), {"a/0": (6, 7)})  # 7
    figures = s.maintain(0, "a/0")
    assert figures["iceberg_snapshots_expired"] == 3 and figures["iceberg_snapshots"] == 4
    tbl = s.load()
    assert tbl is not None and len(tbl.snapshots()) == 4
