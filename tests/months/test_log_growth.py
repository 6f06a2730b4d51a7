"""What a commit pays for the Delta log (issue 28): commits never run delta-rs' expired-log
cleanup (it lists the whole ``_delta_log`` after every checkpoint); ``maintain()`` does, once
per ``vacuum_interval_s``, so the log of a table older than its retention holds a bounded
number of entries; tables the sink creates carry a bounded ``delta.logRetentionDuration`` no
shorter than the vacuum retention; a held snapshot that is reloaded still fences."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.delta import DeltaSink, Maintenance
from cg_pipelines.sinks.deltahandle import SNAPSHOT_RELOAD_VERSIONS
from cg_pipelines.sinks.storage import table_filesystem

SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64()), ("_partition", pa.int32())])
RETENTION_S = 1.0


def batch(i: int) -> pa.Table:
    return pa.table([[f"k{i}"], [i], [0]], schema=SCHEMA)


def log_commits(uri: str, options: dict[str, str] | None) -> list[int]:
    """Versions whose commit JSON is in ``_delta_log``, sorted."""
    import pyarrow.fs as pafs

    fs = table_filesystem(uri, options or {})
    assert fs is not None
    names = [i.base_name for i in fs.get_file_info(pafs.FileSelector("_delta_log"))]
    return sorted(int(n.split(".")[0]) for n in names if n.endswith(".json")
                  and not n.startswith("_"))


def commit_n(sink: DeltaSink, app: str, n: int) -> None:
    wm = sink.watermark(app)
    for i in range(n):
        sink.commit(batch(wm + i + 1), {app: (wm + i, wm + i + 1)})


def test_created_table_log_retention_is_bounded_and_covers_the_vacuum_retention(
        tmp_path: Path) -> None:
    def log_retention(m: Maintenance) -> str:
        uri = str(tmp_path / f"t{len(list(tmp_path.iterdir()))}")
        DeltaSink(uri, schema=SCHEMA, maintenance=m).ensure_table(SCHEMA)
        return DeltaTable(uri).metadata().configuration["delta.logRetentionDuration"]

    assert log_retention(Maintenance()) == f"interval {168 * 3600} seconds"
    assert log_retention(Maintenance(vacuum_retention_hours=720)) == \
        f"interval {720 * 3600} seconds"
    assert log_retention(Maintenance.off()) == f"interval {168 * 3600} seconds"
    assert log_retention(Maintenance(log_retention_hours=200)) == \
        f"interval {200 * 3600} seconds"
    with pytest.raises(ValueError, match="log_retention_hours.*vacuum_retention_hours"):
        Maintenance(vacuum_retention_hours=168, log_retention_hours=24)


@pytest.mark.parametrize("store", ["local", "s3"])
def test_commits_never_clean_up_the_log_maintain_bounds_it(
        store: str, tmp_path: Path, s3_bucket: tuple[str, dict[str, str]]) -> None:
    if store == "s3":
        uri, options = f"s3://{s3_bucket[0]}/t", s3_bucket[1]
    else:
        uri, options = str(tmp_path / "t"), {}
    # the window's floor and time travel both expire; no cap: no cursor holds nothing
    policy = Maintenance(vacuum_retention_hours=0, vacuum_interval_s=0,
                         log_retention_hours=RETENTION_S / 3600, log_floor_s=RETENTION_S,
                         log_max_versions=None)
    sink = DeltaSink(uri, storage_options=options or None, schema=SCHEMA, maintenance=policy)
    commit_n(sink, "a/0", 12)  # versions 0..12, a checkpoint at 10
    time.sleep(RETENTION_S + 0.2)  # all of them expire
    commit_n(sink, "a/0", 10)  # 13..22: a checkpoint at 20 (delta-rs used to clean up there)
    assert log_commits(uri, options or None) == list(range(23))
    time.sleep(RETENTION_S + 0.2)  # 13..22 expire too
    out = sink.maintain(0, "a/0")
    assert out.get("log_cleanup") == "done", out
    kept = log_commits(uri, options or None)
    # expired and made unnecessary by the checkpoint at 20: all before it
    assert kept and min(kept) >= 19, kept
    assert DeltaSink(uri, storage_options=options or None).watermark("a/0") == 22


def test_maintenance_off_keeps_delta_rs_cleanup_on_commit(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    off = Maintenance(compact=False, vacuum_retention_hours=None, snapshots=False,
                      log_cleanup=False, log_retention_hours=RETENTION_S / 3600)
    sink = DeltaSink(uri, schema=SCHEMA, maintenance=off)
    commit_n(sink, "a/0", 12)
    time.sleep(RETENTION_S + 0.2)  # all of them expire
    commit_n(sink, "a/0", 10)  # the checkpoint at 20 cleans up what it makes unnecessary
    assert min(log_commits(uri, None)) >= 9  # delta-rs keeps the one before a checkpoint


def test_a_reloaded_snapshot_still_fences(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    holder = DeltaSink(uri, schema=SCHEMA)
    n = SNAPSHOT_RELOAD_VERSIONS + 3  # the holder's snapshot gets reloaded on the way
    commit_n(holder, "a/0", n)
    zombie = DeltaSink(uri)
    assert zombie.watermark("a/0") == n
    zombie.commit(batch(n + 1), {"a/0": (n, n + 1)})
    with pytest.raises(FenceConflictError):
        holder.commit(batch(n + 1), {"a/0": (n, n + 1)})
    assert DeltaTable(uri).to_pyarrow_table().num_rows == n + 1
