"""``SplitRead.split`` (``engine/reads.py``): one read of a work queue becomes each side's
records by the subject's first token, exactly: stream order kept, the ``<p>.`` prefix cut off,
nothing past a side's ``start_last``, other partitions' messages dropped (``"1"`` is not a
prefix of ``"10.x"``), every side covered up to the read's end or its ``start_last``."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa

from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.engine.reads import SplitRead


def _side(p: int, start_last: int) -> SimpleNamespace:
    return SimpleNamespace(name=f"S/g/{p}", start_last=start_last,
                           ctx=SimpleNamespace(partition=p))


def _read(subjects: list[str]) -> pa.Table:
    n = len(subjects)
    return pa.table({
        "seq": pa.array(range(1, n + 1), pa.int64()),
        "subject": subjects,
        "time": pa.array([0] * n, pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
        "headers": pa.array([None] * n, pa.string()),
        "data": [f"m{i}".encode() for i in range(1, n + 1)],
        "origin_seq": pa.array(range(101, n + 101), pa.int64()),
    }).cast(RECORD_SCHEMA)


def test_split_by_partition_in_order() -> None:
    sides = [_side(1, 100), _side(10, 100), _side(3, 7)]
    split = SplitRead(sides)  # type: ignore[arg-type]
    table = _read(["10.a.x", "1.b", "3.c", "2.d", "1.e.f", "10.g", "3.h", "3.i", "1x.j",
                   "1.k"])
    w = split.split(table, 10)
    got = {p: (w.tables[f"S/g/{p}"]["seq"].to_pylist(),
               w.tables[f"S/g/{p}"]["subject"].to_pylist()) for p in (1, 10, 3)}
    assert got == {1: ([2, 5, 10], ["b", "e.f", "k"]),
                   10: ([1, 6], ["a.x", "g"]),
                   3: ([3, 7], ["c", "h"])}  # 8 is past partition 3's start_last
    assert w.tables["S/g/1"]["data"].to_pylist() == [b"m2", b"m5", b"m10"]
    assert w.tables["S/g/1"]["origin_seq"].to_pylist() == [102, 105, 110]
    assert w.through == {"S/g/1": 10, "S/g/10": 10, "S/g/3": 7} and w.end == 10
    assert w.rows == 7
    assert all(t.schema == RECORD_SCHEMA for t in w.tables.values())


def test_split_of_an_empty_read() -> None:
    sides = [_side(0, 50), _side(1, 5)]
    w = SplitRead(sides).split(_read([]), 9)  # type: ignore[arg-type]
    assert w.rows == 0 and w.through == {"S/g/0": 9, "S/g/1": 5}
    assert all(t.schema == RECORD_SCHEMA for t in w.tables.values())


def test_split_of_other_partitions_only() -> None:
    w = SplitRead([_side(0, 50), _side(1, 50)]).split(  # type: ignore[arg-type]
        _read(["2.a", "3.b", "12.c"]), 3)
    assert w.rows == 0 and w.through == {"S/g/0": 3, "S/g/1": 3}
