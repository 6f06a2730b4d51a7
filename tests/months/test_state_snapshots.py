"""State reads through per-partition snapshots, compaction, vacuum and rebuild, on a real Delta
table (local disk and moto S3): the state read always equals an independent reference (the last
row of each key over every row ever committed to the partition), and stays cheap with age."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from deltalake import DeltaTable

from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.delta import DeltaSink, Maintenance
from cg_pipelines.sinks.statesnapshot import STATE_DIR, SnapshotStore

SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64()), ("_seq", pa.int64()),
                    ("_partition", pa.int32())])
COLS = ["k", "_seq", "v"]
KEYS = [f"k{i}" for i in range(40)]
EAGER = Maintenance(compact_min_files=3, vacuum_retention_hours=0, vacuum_interval_s=0)


def sink_at(where: tuple[str, dict[str, str]], **kw: object) -> DeltaSink:
    return DeltaSink(where[0], storage_options=where[1] or None, schema=SCHEMA, **kw)  # type: ignore[arg-type]


class Writer:
    """Commits random batches to partitions 0 and 1 and keeps every row (the reference)."""

    def __init__(self, sink: DeltaSink, seed: int) -> None:
        self.sink, self.rnd = sink, random.Random(seed)
        self.rows: dict[int, list[pa.Table]] = {0: [], 1: []}
        self.seq = {0: 0, 1: 0}

    def commit(self, p: int, n: int = 15) -> None:
        first = self.seq[p] + 1
        self.seq[p] += n
        t = pa.table([[self.rnd.choice(KEYS) for _ in range(n)],
                      [self.rnd.randrange(1000) for _ in range(n)],
                      list(range(first, self.seq[p] + 1)), [p] * n], schema=SCHEMA)
        app = f"s/g/{p}"
        self.sink.commit(t, {app: (self.sink.watermark(app), self.seq[p])})
        self.rows[p].append(t)

    def reference(self, p: int) -> pa.Table:
        return last_per_key(pa.concat_tables(self.rows[p]).select(COLS), "k", "_seq")


def state(sink: DeltaSink, p: int) -> pa.Table:
    return sink.last_rows("k", KEYS, COLS, "_seq", p)


def test_state_equals_the_reference_through_compaction_vacuum_and_rebuild(where) -> None:
    sink = sink_at(where, maintenance=EAGER)
    w = Writer(sink, seed=1)
    compactions = 0
    for i in range(24):
        p = i % 2
        w.commit(p)
        assert state(sink, p).equals(w.reference(p)), i
        if i % 4 == 3:
            for q in (0, 1):
                figs = sink.maintain(q, f"s/g/{q}")
                assert "error" not in figs, figs
                compactions += figs["compact"] == "done"
    assert compactions >= 4
    # a new sink (another process) starts from the stored snapshot and reads few files
    fresh = sink_at(where, maintenance=EAGER)
    for p in (0, 1):
        assert state(fresh, p).equals(w.reference(p))
    states = fresh._handle.partition_states()
    assert states is not None and states.full_reads == 0 and states.files_read == 0
    # rebuild: partition 0 replaced by fewer rows (its last 2 batches only); the stored
    # snapshot covered the replaced files, so it must not be used
    keep = w.rows[0][-2:]
    sink.watermark("s/g/0")
    sink.replace_partition(pa.concat_tables(keep).to_reader(), 0, "s/g/0", w.seq[0])
    w.rows[0] = keep
    for s in (sink, fresh, sink_at(where)):
        assert state(s, 0).equals(w.reference(0))
        assert state(s, 1).equals(w.reference(1))
    assert "error" not in sink.maintain(0, "s/g/0")
    w.commit(0)
    assert state(sink_at(where), 0).equals(w.reference(0))
    # the table itself is unchanged by all this upkeep: same rows as committed
    for p in (0, 1):
        got = sink.read(columns=["k", "v", "_seq", "_partition"]).filter(
            pa.compute.field("_partition") == p).sort_by("_seq")
        assert got.select(["k", "v", "_seq"]).equals(
            pa.concat_tables(w.rows[p]).select(["k", "v", "_seq"]).sort_by("_seq"))
        assert sink.watermark(f"s/g/{p}") == w.seq[p]


def test_stale_torn_and_foreign_snapshots_never_change_the_state(where) -> None:
    sink = sink_at(where, maintenance=EAGER)
    w = Writer(sink, seed=2)
    for _ in range(3):
        w.commit(0)
    assert state(sink, 0).equals(w.reference(0))  # a run reads state, then maintains
    assert "error" not in sink.maintain(0, "s/g/0")
    fs = sink._handle.filesystem()
    assert fs is not None
    store = SnapshotStore(fs)
    path = store.path("k", "_seq", 0)
    with fs.open_input_stream(path) as f:
        old = f.read()  # a snapshot as a zombie would hold it
    for _ in range(4):
        w.commit(0)
    assert "error" not in sink.maintain(0, "s/g/0")  # compacts: the old snapshot's files go
    with fs.open_output_stream(path) as f:
        f.write(old)  # the zombie writes its stale snapshot late
    assert state(sink_at(where), 0).equals(w.reference(0))
    with fs.open_output_stream(path) as f:
        f.write(old[: len(old) // 2])  # torn
    assert state(sink_at(where), 0).equals(w.reference(0))
    # a table re-created at the same URI never uses the old table's snapshot
    with fs.open_input_stream(path) as f:
        current = f.read()
    w.commit(0)
    assert state(sink_at(where), 0).equals(w.reference(0))
    with fs.open_output_stream(path) as f:
        f.write(current)  # older than the table: only its covered files are used
    assert state(sink_at(where), 0).equals(w.reference(0))


def test_compaction_racing_a_zombie_and_a_merge(tmp_path: Path) -> None:
    """A holder compacts while a zombie (stale snapshot, same app id) commits: the zombie is
    fenced, the compaction changes no row. A merge that loses its race to a compaction of the
    same partition (watermark unchanged) is retried, not failed nor fenced."""
    uri = str(tmp_path / "t")
    holder = DeltaSink(uri, schema=SCHEMA, maintenance=EAGER)
    zombie = DeltaSink(uri, schema=SCHEMA)
    w = Writer(holder, seed=3)
    for _ in range(4):
        w.commit(0)
    zombie.watermark("s/g/0")  # the zombie read the watermark before the holder's commit
    w.commit(0)
    assert holder.maintain(0, "s/g/0")["compact"] == "done"
    t = pa.table([["k1"], [1], [999], [0]], schema=SCHEMA)
    with pytest.raises(FenceConflictError):
        zombie.commit(t, {"s/g/0": (w.seq[0] - 15, 999)})
    assert state(DeltaSink(uri), 0).equals(w.reference(0))
    assert holder.watermark("s/g/0") == w.seq[0]

    muri = str(tmp_path / "m")
    merge = Merge(key="k")
    a = DeltaSink(muri, schema=SCHEMA, write=merge,
                  maintenance=Maintenance(compact_min_files=2, vacuum_retention_hours=None))
    for i in range(1, 5):  # one new key a merge: one file each
        a.commit(pa.table([[f"k{i}"], [i], [i], [0]], schema=SCHEMA),
                 {"m/0": (a.watermark("m/0"), i)})
    b = DeltaSink(muri, schema=SCHEMA, write=merge)
    expected = b.watermark("m/0")  # b's snapshot is older than the compaction below
    assert a.maintain(0, "m/0")["compact"] == "done"
    # without the retry: CommitFailedError "a concurrent transactions added new data"
    b.commit(pa.table([["k1"], [77], [9], [0]], schema=SCHEMA), {"m/0": (expected, 9)})
    rows = DeltaSink(muri).read(columns=["k", "v"]).sort_by("k").to_pylist()
    assert rows == [{"k": "k1", "v": 77}] + [{"k": f"k{i}", "v": i} for i in range(2, 5)]
    assert b.watermark("m/0") == 9


def test_vacuum_keeps_what_the_current_version_and_the_window_need(where) -> None:
    sink = sink_at(where, maintenance=Maintenance(compact_min_files=3,
                                                  vacuum_retention_hours=1,
                                                  vacuum_interval_s=0))
    w = Writer(sink, seed=4)
    for _ in range(4):
        w.commit(0)
    before = DeltaTable(where[0], storage_options=where[1] or None).version()
    figs = sink.maintain(0, "s/g/0")
    assert figs["compact"] == "done" and figs["vacuum"] == "done", figs
    assert figs["files_vacuumed"] == 0  # the compacted files were removed < 1 hour ago
    old = DeltaTable(where[0], storage_options=where[1] or None, version=before)
    fs = sink._handle.filesystem()
    assert fs is not None
    old_rows = old.to_pyarrow_dataset(filesystem=fs).to_table()
    assert old_rows.num_rows == 60  # time travel inside the window still reads
    # retention 0: the compacted files go, the current version and the snapshots stay
    zero = sink_at(where, maintenance=Maintenance(compact_min_files=3, vacuum_retention_hours=0,
                                                  vacuum_interval_s=0))
    def data_files() -> set[str]:
        sel = pafs.FileSelector("_partition=0", recursive=True)
        return {i.path for i in fs.get_file_info(sel) if i.path.endswith(".parquet")}

    assert len(data_files()) == 5  # 4 compacted away + 1 live
    figs = zero.maintain(0, "s/g/0")
    # (on S3 the count may include the empty directory marker object of the table root)
    assert figs["files_vacuumed"] in (4, 5), figs
    live = {u.split("/t/", 1)[1] for u in sink_at(where).file_uris()}
    assert data_files() == live and len(live) == 1
    assert sink_at(where).read().num_rows == 60
    assert state(sink_at(where), 0).equals(w.reference(0))
    assert fs.get_file_info(f"{STATE_DIR}/").type.name == "Directory"
    h = [v for v in range(before, DeltaTable(where[0], storage_options=where[1] or None
                                              ).version() + 1)]
    ops = []
    for v in h[1:]:
        with fs.open_input_stream(f"_delta_log/{v:020d}.json") as f:
            text = f.read().decode()
        ops.append(("cg.operation\":\"compact" in text, "cg.operation\":\"vacuum" in text))
    assert ops[0] == (True, False) and all(any(o) for o in ops)  # every upkeep commit tagged


def test_vacuum_runs_at_most_every_interval(tmp_path: Path) -> None:
    sink = DeltaSink(str(tmp_path / "t"), schema=SCHEMA, maintenance=Maintenance(
        vacuum_retention_hours=0, vacuum_interval_s=3600))
    w = Writer(sink, seed=5)
    w.commit(0)
    assert sink.maintain(0, "s/g/0")["vacuum"] == "done"
    w.commit(0)
    assert sink.maintain(0, "s/g/0")["vacuum"] == "no"
    off = DeltaSink(str(tmp_path / "t"), maintenance=Maintenance.off())
    w.commit(0)
    figs = off.maintain(0, "s/g/0")
    assert (figs["compact"], figs["vacuum"]) == ("no", "no")
    with pytest.raises(ValueError, match="compact_min_files"):
        Maintenance(compact_min_files=1)
    with pytest.raises(ValueError, match="maintenance"):
        DeltaSink(str(tmp_path / "x"), maintenance=object())  # type: ignore[arg-type]
