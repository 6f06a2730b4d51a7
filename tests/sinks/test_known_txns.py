"""``known_txn`` (``sinks/deltahandle.py``): a snapshot's application transaction versions,
remembered per snapshot version so that a commit fencing 32 partitions does not ask delta-rs
32 times (about 0.3 ms a call) for what its own last commit wrote. Remembered values equal
delta-rs's, a snapshot that moves to another version is asked again, and an entry goes with its
snapshot (nothing grows with the snapshots a long-running process loads)."""

from __future__ import annotations

import gc
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from cg_pipelines.sinks import deltahandle
from cg_pipelines.sinks.deltahandle import known_txn, known_txns


def _commit(uri: str | DeltaTable, version: int, apps: range) -> None:
    write_deltalake(uri, pa.table({"x": [version]}), mode="append",
                    commit_properties=CommitProperties(
                        app_transactions=[Transaction(f"s/g/{p}", version) for p in apps]))


def test_remembered_values_are_delta_rs_s_and_follow_the_version(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    _commit(uri, 1, range(4))
    dt = DeltaTable(uri)
    assert [known_txn(dt, f"s/g/{p}") for p in range(5)] == [1, 1, 1, 1, 0]
    _commit(dt, 2, range(2))  # advances dt in place to the next version
    assert [known_txn(dt, f"s/g/{p}") for p in range(5)] == [
        dt.transaction_version(f"s/g/{p}") or 0 for p in range(5)] == [2, 2, 1, 1, 0]


def test_what_a_commit_wrote_is_remembered_at_its_version_only(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    _commit(uri, 1, range(2))
    dt = DeltaTable(uri)
    known_txns(dt, dt.version(), {"s/g/0": 1})
    known_txns(dt, dt.version() + 1, {"s/g/1": 99})  # another version: ignored
    assert known_txn(dt, "s/g/0") == 1 and known_txn(dt, "s/g/1") == 1


def test_an_entry_goes_with_its_snapshot(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    _commit(uri, 1, range(2))
    gc.collect()  # earlier tests' snapshots gone first
    before = len(deltahandle._TXNS)
    snaps = [DeltaTable(uri) for _ in range(20)]
    for dt in snaps:
        known_txn(dt, "s/g/0")
    keys = {id(dt) for dt in snaps}
    assert keys <= set(deltahandle._TXNS)
    del snaps, dt
    gc.collect()
    assert len(deltahandle._TXNS) <= before
