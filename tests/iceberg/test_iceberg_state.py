"""Per-partition state snapshots of an append-mode Iceberg table (issue 40,
``sinks/iceberg_state``): ``last_rows`` of a partition reads only the files committed since
its snapshot, stays exact across compaction, a new process, a re-created table and a torn
snapshot file, and is not used where it cannot be exact (merge mode, a table not partitioned
on ``_partition``)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyiceberg.catalog import load_catalog

from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.iceberg import IcebergSink
from cg_pipelines.sinks.iceberg_state import state_filesystem
from cg_pipelines.sinks.maintenance import Maintenance
from cg_pipelines.sinks.partstate import PartitionStates
from cg_pipelines.sinks.statesnapshot import STATE_DIR
from tests.iceberg.conftest import Backend

SCHEMA = pa.schema([("key", pa.string()), ("v", pa.int64()), ("seq", pa.int64()),
                    ("_partition", pa.int64())])
POLICY = Maintenance(compact_min_files=4)
KEYS = [f"k{i}" for i in range(6)]


def rows(p: int, keys: list[str], seq0: int) -> pa.Table:
    return pa.table({"key": keys, "v": [seq0 * 10 + i for i in range(len(keys))],
                     "seq": list(range(seq0, seq0 + len(keys))), "_partition": [p] * len(keys)},
                    schema=SCHEMA)


def truth(s: IcebergSink, p: int, keys: list[str]) -> list[dict[str, object]]:
    """Each key's last row of partition ``p``, from the whole table (no snapshot)."""
    got = s.read(columns=["key", "seq", "v", "_partition"])
    mine = got.filter(pa.compute.equal(got["_partition"], p)).select(["key", "seq", "v"])
    last = last_per_key(mine, "key", "seq")
    last = last.filter(pa.compute.is_in(last["key"], value_set=pa.array(keys)))
    return last.sort_by("key").to_pylist()


def state_read(s: IcebergSink, p: int, keys: list[str] = KEYS) -> list[dict[str, object]]:
    got = s.last_rows("key", keys, ["v"], "seq", p, app_id=f"s/g/{p}")
    return got.select(["key", "seq", "v"]).to_pylist()


def states_of(s: IcebergSink) -> PartitionStates:
    tbl = s.load()
    assert tbl is not None and s._reader.states is not None
    states = s._reader.states.states(tbl)
    assert states is not None
    return states


def commit_many(s: IcebergSink, p: int, start: int, n: int) -> int:
    """``n`` commits of partition ``p`` from watermark ``start`` (two keys each, keys
    repeating); returns the new watermark."""
    for i in range(start + 1, start + n + 1):
        s.commit(rows(p, [KEYS[i % 6], KEYS[(i * 5) % 6]], 2 * i), {f"s/g/{p}": (i - 1, i)})
    return start + n


@pytest.mark.parametrize("backend", ["sqlite-local", "sqlite-s3"], indirect=True)
def test_state_read_costs_the_new_files_and_stays_exact(backend: Backend) -> None:
    s = backend.sink(maintenance=POLICY)
    wm = commit_many(s, 0, 0, 3)
    commit_many(s, 1, 0, 2)
    assert state_read(s, 0) == truth(s, 0, KEYS)  # first read: the partition whole, stored
    states = states_of(s)
    assert (states.full_reads, states.files_read) == (1, 3)
    wm = commit_many(s, 0, wm, 1)
    assert state_read(s, 0) == truth(s, 0, KEYS)
    assert (states.full_reads, states.files_read) == (1, 4)  # only the new file read
    assert state_read(s, 0, ["k1", "nope"]) == truth(s, 0, ["k1", "nope"])
    assert state_read(s, 1) == truth(s, 1, KEYS)  # another partition: its own state
    assert states.full_reads == 2


@pytest.mark.parametrize("backend", ["sqlite-local", "sqlite-s3"], indirect=True)
def test_compaction_carries_the_snapshot_to_a_new_process(backend: Backend) -> None:
    s = backend.sink(maintenance=POLICY)
    wm = commit_many(s, 0, 0, 5)
    assert state_read(s, 0) == truth(s, 0, KEYS)
    wm = commit_many(s, 0, wm, 1)  # not yet read: the compaction catches the state up
    figures = s.maintain(0, "s/g/0")
    assert figures["iceberg_compaction"] == "done" and figures["snapshots_written"] == 1, figures
    fresh = backend.sink(maintenance=POLICY)  # a new run's process
    wm = commit_many(fresh, 0, wm, 1)
    assert state_read(fresh, 0) == truth(fresh, 0, KEYS)
    states = states_of(fresh)
    assert (states.full_reads, states.files_read) == (0, 1)  # the stored snapshot + 1 file


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
def test_torn_or_foreign_snapshots_are_not_used(backend: Backend) -> None:
    s = backend.sink(maintenance=POLICY)
    commit_many(s, 0, 0, 2)
    before = truth(s, 0, KEYS)
    assert state_read(s, 0) == before
    tbl = s.load()
    assert tbl is not None
    fs = state_filesystem(tbl)
    assert fs is not None
    stored = states_of(s).store.path("key", "seq", 0)
    with fs.open_output_stream(stored) as out:
        out.write(b"PAR1 torn")
    fresh = backend.sink(maintenance=POLICY)
    assert state_read(fresh, 0) == before
    assert states_of(fresh).full_reads == 1
    # The table dropped and created again at the same location: the old snapshot (written
    # again above) names another table's files and must not be used.
    cat = load_catalog("cg", **backend.catalog)
    cat.drop_table(backend.identifier)
    again = backend.sink(maintenance=POLICY)
    again.commit(rows(0, ["k1"], 99), {"s/g/0": (0, 1)})
    assert again.load().location() == tbl.location()  # type: ignore[union-attr]
    assert fs.get_file_info(stored).size > 0  # the old table's snapshot is still there
    assert state_read(again, 0) == [{"key": "k1", "seq": 99, "v": 990}]
    assert states_of(again).full_reads == 1


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
def test_no_snapshots_where_they_cannot_be_exact(backend: Backend) -> None:
    merge = backend.sink(Merge(key="key", order_by="seq"), maintenance=POLICY)
    commit_many(merge, 0, 0, 3)
    assert merge._reader.states is None
    assert state_read(merge, 0) == truth(merge, 0, KEYS)
    tbl = merge.load()
    assert tbl is not None
    fs = state_filesystem(tbl)
    assert fs is not None and fs.get_file_info(STATE_DIR).type.name == "NotFound"
    # A table not partitioned on _partition: its files may hold several partitions' rows.
    cat = load_catalog("cg", **backend.catalog)
    cat.create_table("cg.flat", schema=SCHEMA)
    flat = IcebergSink("cg.flat", catalog=dict(backend.catalog), maintenance=POLICY)
    flat.commit(pa.concat_tables([rows(0, ["k1"], 1), rows(1, ["k1"], 2)]), {"s/g/0": (0, 1)})
    got = flat.last_rows("key", ["k1"], ["v"], "seq", 0, app_id="s/g/0")
    assert got.select(["key", "seq"]).to_pylist() == [{"key": "k1", "seq": 1}]
    ftbl = flat.load()
    assert ftbl is not None and flat._reader.states is not None
    assert flat._reader.states.states(ftbl) is None


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
def test_files_of_an_earlier_spec_are_not_snapshotted(backend: Backend) -> None:
    """A file written before the table got its ``_partition`` spec holds several partitions'
    rows: while one is live, a partition's state is read from the table (rows filtered)."""
    cat = load_catalog("cg", **backend.catalog)
    cat.create_namespace_if_not_exists("cg")
    tbl = cat.create_table("cg.evolved", schema=SCHEMA)
    tbl.append(pa.concat_tables([rows(0, ["k1"], 1), rows(1, ["k2"], 2)]).cast(
        tbl.schema().as_arrow()))
    with tbl.update_spec() as spec:
        spec.add_identity("_partition")
    s = IcebergSink("cg.evolved", catalog=dict(backend.catalog), maintenance=POLICY)
    s.commit(rows(0, ["k3"], 3), {"s/g/0": (0, 1)})
    got = s.last_rows("key", ["k1", "k2", "k3"], ["v"], "seq", 0, app_id="s/g/0")
    assert got.select(["key", "seq"]).to_pylist() == [{"key": "k1", "seq": 1},
                                                      {"key": "k3", "seq": 3}]
    assert states_of(s).files_read == 0  # the snapshot path gave up; the scan answered
