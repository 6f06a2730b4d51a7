"""A stale writer whose snapshot the log window cut away is refused (issue 40): what decides how
low ``Maintenance.log_max_versions`` may go. delta-rs 1.6.6 (local disk): a commit from a
snapshot whose following log entries were deleted (:func:`cg_pipelines.sinks.logwindow.
clean_log`) fails (``DeltaError: Invalid table version``, or ``Kernel error: File not found``
through the sink) and writes nothing, whether the commit carries the zombie's application
transaction, another one or none (append or merge); while the entries are there, the usual
conflict check refuses it. A held snapshot at a deleted version is still brought up to date."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import DeltaError

from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.deltawrite import COMMIT_HOOKS, cut_snapshot
from cg_pipelines.sinks.logwindow import clean_log, list_log

SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64()), ("_partition", pa.int32())])


def batch(i: int) -> pa.Table:
    return pa.table([[f"k{i}"], [i], [0]], schema=SCHEMA)


def txn(app: str, version: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(app, version)])


def commit_to(uri: str, first: int, last: int, app: str = "a/0") -> None:
    """Commits ``first..last`` (watermark = the batch number) with the sink's hooks
    (a checkpoint every 10 versions: 9, 19, ...)."""
    for i in range(first, last + 1):
        write_deltalake(uri, batch(i), mode="append", commit_properties=txn(app, i),
                        post_commithook_properties=COMMIT_HOOKS,
                        configuration={"delta.checkpointInterval": "10"} if i == 1 else None)


def cut(uri: str, keep: int) -> int:
    fs = pafs.SubTreeFileSystem(uri, pafs.LocalFileSystem())
    return clean_log(fs, list_log(fs), keep)


@pytest.mark.parametrize("op", ["same app", "other app", "no txn", "merge"])
def test_a_commit_from_a_snapshot_the_log_window_cut_is_refused(tmp_path: Path, op: str
                                                                ) -> None:
    uri = str(tmp_path / "t")
    commit_to(uri, 1, 6)  # versions 0..5
    zombie = DeltaTable(uri)
    assert zombie.version() == 5
    commit_to(uri, 7, 46)  # versions 6..45, checkpoints at 9, 19, 29, 39
    assert cut(uri, 40) > 0  # versions 0..38 gone: the checkpoint at 39 is the oldest entry
    with pytest.raises(DeltaError, match="Invalid table version") as refused:
        if op == "merge":
            zombie.merge(batch(999), "s.k = t.k", source_alias="s", target_alias="t",
                         commit_properties=txn("a/0", 7), post_commithook_properties=COMMIT_HOOKS
                         ).when_matched_update_all().when_not_matched_insert_all().execute()
        else:
            props = None if op == "no txn" else txn("a/0" if op == "same app" else "b/0", 7)
            write_deltalake(zombie, batch(999), mode="append", commit_properties=props,
                            post_commithook_properties=COMMIT_HOOKS)
    assert cut_snapshot(refused.value)
    fresh = DeltaTable(uri)
    assert fresh.version() == 45 and fresh.transaction_version("a/0") == 46
    assert 999 not in fresh.to_pyarrow_table()["v"].to_pylist()


def test_the_sink_refuses_a_zombie_whose_versions_were_cut(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    commit_to(uri, 1, 6)
    zombie = DeltaSink(uri)
    assert zombie.watermark("a/0") == 6  # remembers the snapshot at version 5
    commit_to(uri, 7, 46)
    assert cut(uri, 40) > 0
    # the held snapshot is cut (delta-rs cannot read its transactions): the latest decides
    with pytest.raises(FenceConflictError) as refused:
        zombie.commit(batch(999), {"a/0": (6, 7)})
    assert (refused.value.expected, refused.value.found) == (6, 46)
    # entries still there (the cut at the checkpoint of 29 keeps 29..45): the fence refuses it
    uri2 = str(tmp_path / "t2")
    commit_to(uri2, 1, 32)
    zombie2 = DeltaSink(uri2)
    assert zombie2.watermark("a/0") == 32
    commit_to(uri2, 33, 46)
    assert cut(uri2, 35) > 0
    with pytest.raises(FenceConflictError) as fenced:
        zombie2.commit(batch(999), {"a/0": (32, 33)})
    assert not cut_snapshot(fenced.value)
    for u in (uri, uri2):
        fresh = DeltaTable(u)
        assert fresh.version() == 45 and fresh.transaction_version("a/0") == 46
        assert 999 not in fresh.to_pyarrow_table()["v"].to_pylist()


def test_a_held_snapshot_at_a_cut_version_is_brought_up_to_date(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    commit_to(uri, 1, 6)
    held = DeltaTable(uri)
    commit_to(uri, 7, 46)
    assert cut(uri, 40) > 0
    held.update_incremental()
    assert held.version() == 45 and held.transaction_version("a/0") == 46


@pytest.mark.parametrize("replace", [False, True])
def test_a_holder_whose_snapshot_was_cut_still_commits(tmp_path: Path, replace: bool) -> None:
    """The rightful holder of ``a/0`` read its watermark, then 40 commits of another app id
    (``b/0``) landed and the log window cut its snapshot's versions: its commit (or its
    partition replace) is decided on the latest snapshot and goes through, once."""
    uri = str(tmp_path / "t")
    commit_to(uri, 1, 6)
    holder = DeltaSink(uri)
    assert holder.watermark("a/0") == 6
    commit_to(uri, 1, 40, app="b/0")  # versions 6..45: partition b only
    assert cut(uri, 40) > 0
    if replace:
        holder.replace_partition(batch(7).to_reader(), 0, "a/0", 6)
        rows = 1
    else:
        holder.commit(batch(7), {"a/0": (6, 7)})
        rows = 6 + 40 + 1
    fresh = DeltaTable(uri)
    assert fresh.version() == 46
    assert fresh.transaction_version("a/0") == (6 if replace else 7)
    assert fresh.to_pyarrow_table().num_rows == rows
    assert holder.versions_written == [46]
