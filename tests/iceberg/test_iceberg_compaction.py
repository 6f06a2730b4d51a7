"""Iceberg compaction under the partition's lease (issue 40, ``sinks/iceberg_compact``): a
partition with ``compact_min_files`` small files is rewritten into one in one transaction, rows
and watermarks unchanged, other partitions untouched; a compaction that loses to a newer
holder's commit is fenced (nothing lost, nothing doubled), one that loses to another
partition's commit is tried again; append and merge tables."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.iceberg import IcebergSink
from cg_pipelines.sinks.iceberg_compact import compact_partition, partition_files
from cg_pipelines.sinks.maintenance import Maintenance
from tests.iceberg.conftest import Backend

SCHEMA = pa.schema([("key", pa.string()), ("v", pa.int64()), ("seq", pa.int64()),
                    ("_partition", pa.int64())])
POLICY = Maintenance(compact_min_files=4)


def rows(p: int, keys: list[str], seq0: int) -> pa.Table:
    return pa.table({"key": keys, "v": [seq0 * 10 + i for i in range(len(keys))],
                     "seq": list(range(seq0, seq0 + len(keys))), "_partition": [p] * len(keys)},
                    schema=SCHEMA)


def content(s: IcebergSink) -> list[tuple[object, ...]]:
    return sorted(tuple(r.values()) for r in s.read().to_pylist())


@pytest.mark.parametrize("backend", ["sqlite-local", "sqlite-s3"], indirect=True)
@pytest.mark.parametrize("mode", ["append", "merge"])
def test_small_files_compacted_rows_and_watermarks_kept(backend: Backend, mode: str) -> None:
    s = backend.sink(Merge(key="key", order_by="seq") if mode == "merge" else None,
                     maintenance=POLICY)
    for i in range(1, 7):  # six commits of partition 0 (keys repeat: merge rewrites them)
        s.commit(rows(0, [f"k{i % 4}", f"j{i}"], 2 * i - 1), {"s/g/0": (i - 1, i)})
    s.commit(rows(1, ["q"], 1), {"s/g/1": (0, 1)})
    s.commit(rows(1, ["r"], 2), {"s/g/1": (1, 2)})
    before = content(s)
    tbl = s.load()
    assert tbl is not None and len(partition_files(tbl, 0)) >= POLICY.compact_min_files
    figures = s.maintain(0, "s/g/0")
    assert "error" not in figures, figures
    assert figures["iceberg_compaction"] == "done", figures
    assert figures["iceberg_files_live"] == 1
    tbl = s.load()
    assert tbl is not None and len(partition_files(tbl, 0)) == 1
    assert len(partition_files(tbl, 1)) == 2  # another partition's files untouched
    assert content(s) == before
    assert (s.watermark("s/g/0"), s.watermark("s/g/1")) == (6, 2)
    assert s.maintain(0, "s/g/0")["iceberg_compaction"] == "no"  # one file: nothing due
    s.commit(rows(0, ["k9"], 13), {"s/g/0": (6, 7)})  # the holder goes on after its compaction
    assert s.watermark("s/g/0") == 7 and len(content(s)) == len(before) + 1


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
def test_compaction_losing_to_a_newer_holder_is_fenced(backend: Backend) -> None:
    old, newer = backend.sink(maintenance=POLICY), backend.sink(maintenance=POLICY)
    for i in range(1, 6):
        old.commit(rows(0, [f"k{i}"], i), {"s/g/0": (i - 1, i)})
    raced: list[str] = []

    def summary_then_race(wm: int) -> dict[str, str]:
        if not raced:  # between the compaction's read and its commit: a newer holder commits
            raced.append("x")
            newer.commit(rows(0, ["late"], 6), {"s/g/0": (5, 6)})
        return {"cg.operation": "compact", "cg.watermark": str(wm)}

    out: dict[str, int | float | str] = {}
    assert not compact_partition(old._reader.require, 0, POLICY,  # the sink's loader
                                 lambda t: int(t.properties.get("cg.watermark.s/g/0", 0)),
                                 summary_then_race, out)
    assert out["iceberg_compaction"] == "fenced", out
    assert [r["key"] for r in sorted(old.read().to_pylist(), key=lambda r: r["seq"])] == \
        ["k1", "k2", "k3", "k4", "k5", "late"]
    assert old.watermark("s/g/0") == 6
    # another partition's commit in between: tried again, and done
    other_raced: list[str] = []

    def summary_other(wm: int) -> dict[str, str]:
        if not other_raced:
            other_raced.append("x")
            newer.commit(rows(1, ["p1"], 1), {"s/g/1": (0, 1)})
        return {"cg.operation": "compact", "cg.watermark": str(wm)}

    out = {}
    assert compact_partition(old._reader.require, 0, POLICY,
                             lambda t: int(t.properties.get("cg.watermark.s/g/0", 0)),
                             summary_other, out)
    assert out["iceberg_compaction"] == "done" and out["iceberg_files_live"] == 1, out
    assert len(old.read().to_pylist()) == 7 and old.watermark("s/g/0") == 6
