"""The sink conformance suite: every format (:data:`tests.sinks.formats.FORMATS`: Delta on the
local disk, Iceberg on a SQLite catalog, :class:`~cg_pipelines.testing.MemorySink`) honours the
one contract, :class:`~cg_pipelines.sinks.base.TableSink`, alike: the fence on every side of a
commit, empty commits, markers, N sides in one commit, partition replaces, a stale zombie
refused, watermarks and per-key state read back, both write modes."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.base import (
    FenceConflictError,
    MaintainedSink,
    TableSink,
    app_id_for,
    commit_one,
    origin_marker,
)
from tests.sinks.formats import FORMATS, Format

SCHEMA = pa.schema([("key", pa.string()), ("seq", pa.int64()), ("op", pa.string()),
                    ("_partition", pa.int64())])
A, B, C = (app_id_for("S", "g", 0), app_id_for("T", "h", 0), app_id_for("U", "i", 0))
MERGE = Merge(key="key", order_by="seq", delete_when=("op", "delete"))


def rows(p: int, seqs: range | list[int], key: str | None = None, op: str = "set") -> pa.Table:
    """Rows of partition ``p``, one per sequence (key ``k<seq>``, or ``key`` for all)."""
    seqs = list(seqs)
    return pa.table({"key": [key or f"k{s}" for s in seqs], "seq": seqs, "op": [op] * len(seqs),
                     "_partition": [p] * len(seqs)}, schema=SCHEMA)


def seqs(table: pa.Table) -> list[int]:
    return sorted(table["seq"].to_pylist())


@pytest.fixture(params=FORMATS, ids=lambda f: f.name)
def fmt(request: pytest.FixtureRequest) -> Format:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def sink(fmt: Format, tmp_path: Path) -> TableSink:
    return fmt.make(tmp_path, schema=SCHEMA)


def test_a_new_sink_is_a_table_sink_with_nothing_committed(fmt: Format, sink: TableSink) -> None:
    assert isinstance(sink, TableSink)
    assert sink.table_format == fmt.name
    assert not sink.exists() and sink.versions_written == [] and sink.last_rows_written is None
    assert sink.watermark(A) == 0 and sink.watermarks([A, B]) == {A: 0, B: 0}
    assert sink.read_partitions().num_rows == 0
    assert sink.last_rows("key", ["k1"], ["key", "seq"], "seq", 0).num_rows == 0
    assert isinstance(sink, MaintainedSink) == (fmt.name != "memory")  # the one capability


def test_commits_move_watermarks_and_read_back(sink: TableSink) -> None:
    sink.watermark(A)
    sink.commit(rows(0, range(1, 4)), {A: (0, 3)}, lineage={"stream": "S", "partition": 0})
    sink.commit(rows(0, range(4, 6)), {A: (3, 5)})  # batch after batch, no re-read
    p1 = app_id_for("S", "g", 1)
    commit_one(sink, rows(1, [1, 2]), p1, 2, 0)  # the one-input helper
    assert sink.exists() and len(sink.versions_written) == 3
    assert sink.watermark(A) == 5 and sink.watermarks([A, p1, B]) == {A: 5, p1: 2, B: 0}
    assert seqs(sink.read_partitions()) == [1, 1, 2, 2, 3, 4, 5]
    assert seqs(sink.read_partitions([1])) == [1, 2] and sink.read_partitions([]).num_rows == 0
    stats = sink.stats(1)
    assert (stats.rows, stats.partition_rows) == (7, 2)
    assert set(stats.schema.names) == set(SCHEMA.names)


def test_a_one_input_commit_is_the_one_fence_case(sink: TableSink) -> None:
    """:func:`commit_one` (the one-input call) is ``commit`` with one fence; the positional
    form of before the fences contract is refused by Python itself, nothing written."""
    commit_one(sink, rows(0, [1, 2]), A, 2, 0)
    commit_one(sink, None, A, 3, 2, {origin_marker(A): 30})
    assert sink.watermarks([A, origin_marker(A)]) == {A: 3, origin_marker(A): 30}
    with pytest.raises(FenceConflictError):
        commit_one(sink, None, A, 4, 2)
    with pytest.raises(TypeError):
        sink.commit(rows(0, [4]), A, 4, 3)  # type: ignore[call-arg, arg-type, misc]
    assert sink.watermark(A) == 3


def test_a_stale_zombie_is_refused_and_writes_nothing(fmt: Format, sink: TableSink) -> None:
    zombie = fmt.reopen(sink)
    assert zombie.watermark(A) == 0  # the zombie read its watermark ...
    sink.watermark(A)
    sink.commit(rows(0, range(1, 4)), {A: (0, 3)})  # ... then a newer holder committed
    with pytest.raises(FenceConflictError) as err:
        zombie.commit(rows(0, range(1, 6)), {A: (0, 5)})
    assert (err.value.app_id, err.value.expected) == (A, 0)
    with pytest.raises(FenceConflictError):  # an empty commit is fenced the same
        zombie.commit(None, {A: (0, 5)})
    late = fmt.reopen(sink)  # a holder that never read the watermark is fenced too
    with pytest.raises(FenceConflictError):
        late.commit(rows(0, [9]), {A: (2, 9)})
    assert sink.watermark(A) == 3 and seqs(sink.read_partitions()) == [1, 2, 3]
    zombie.watermark(A)  # a holder that re-reads goes on from the watermark
    zombie.commit(rows(0, [4]), {A: (3, 4)})
    assert sink.watermark(A) == 4


@pytest.mark.parametrize("moved", [A, B, C])
def test_the_fence_holds_on_every_side(fmt: Format, sink: TableSink, moved: str) -> None:
    sink.watermark(A)
    sink.commit(rows(0, range(1, 4)), {A: (0, 5), B: (0, 3), C: (0, 7)})
    other = fmt.reopen(sink)
    other.watermark(A)
    before = {A: 5, B: 3, C: 7}
    other.commit(None, {a: (v, v + 1 if a == moved else v) for a, v in before.items()})
    sink.watermark(A)
    with pytest.raises(FenceConflictError) as err:  # based on the old watermarks
        sink.commit(rows(0, [8]), {A: (5, 9), B: (3, 3), C: (7, 7)})
    assert (err.value.app_id, err.value.expected, err.value.found) == (moved, before[moved],
                                                                      before[moved] + 1)
    assert sink.watermarks(before) == {a: v + (a == moved) for a, v in before.items()}
    assert seqs(sink.read_partitions()) == [1, 2, 3]


def test_n_sides_commit_once_and_a_side_that_does_not_move_keeps_its_watermark(
        sink: TableSink) -> None:
    sink.watermark(A)
    sink.commit(rows(0, range(1, 4)), {A: (0, 5), B: (0, 3), C: (0, 0)},
                markers={origin_marker(A): 50})
    assert len(sink.versions_written) == 1
    sink.commit(rows(0, [6]), {A: (5, 6), B: (3, 3), C: (0, 2)})
    assert sink.watermarks([A, B, C, origin_marker(A)]) == {A: 6, B: 3, C: 2,
                                                            origin_marker(A): 50}
    assert len(sink.versions_written) == 2 and seqs(sink.read_partitions()) == [1, 2, 3, 6]


def test_empty_commits_move_the_watermark_only(sink: TableSink) -> None:
    sink.watermark(A)
    sink.commit(None, {A: (0, 4)})  # the first commit: the table is made from the schema
    sink.commit(SCHEMA.empty_table(), {A: (4, 6)})
    assert sink.exists() and sink.watermark(A) == 6 and sink.read_partitions().num_rows == 0
    assert len(sink.versions_written) == 2


def test_a_first_empty_commit_without_a_schema_is_refused(fmt: Format, tmp_path: Path) -> None:
    bare = fmt.make(tmp_path)
    with pytest.raises(UsageError, match="schema"):
        bare.commit(None, {A: (0, 1)})
    assert not bare.exists()


def test_markers_are_recorded_with_the_commit_and_not_fenced(sink: TableSink) -> None:
    sink.watermark(A)
    sink.commit(rows(0, [1]), {A: (0, 1)}, markers={origin_marker(A): 10, "x": 3})
    sink.commit(rows(0, [2]), {A: (1, 2)}, markers={origin_marker(A): 20, "x": 1})
    assert sink.watermark(origin_marker(A)) == 20  # a marker may move any way
    assert sink.watermarks(["x", A]) == {"x": 1, A: 2}


@pytest.mark.parametrize("fences", [{}, {A: (3, 2)}, {A: (2, 2), B: (1, 1)}, {A: (-1, 2)}])
def test_bad_fences_are_refused_before_anything_is_written(
        sink: TableSink, fences: dict[str, tuple[int, int]]) -> None:
    with pytest.raises(UsageError):
        sink.commit(rows(0, [1]), fences)
    assert not sink.exists()


def test_replace_partition_keeps_the_watermarks_and_is_fenced(fmt: Format,
                                                               sink: TableSink) -> None:
    p1 = app_id_for("S", "g", 1)
    sink.watermark(A)
    sink.commit(rows(0, range(1, 4)), {A: (0, 3), B: (0, 2)})
    sink.watermark(p1)
    sink.commit(rows(1, [1, 2]), {p1: (0, 2)})
    wm = sink.watermark(A)
    zombie = fmt.reopen(sink)
    zombie.watermark(A)
    replay = pa.RecordBatchReader.from_batches(SCHEMA, rows(0, [1, 3]).to_batches())
    before = sink.replace_partition(replay, 0, A, wm, {origin_marker(A): 30},
                                    lineage={"stream": "S"}, fenced={B: 2})
    assert before == 3 and sink.last_rows_written == 2
    assert sink.watermarks([A, B, p1, origin_marker(A)]) == {A: 3, B: 2, p1: 2,
                                                             origin_marker(A): 30}
    assert seqs(sink.read_partitions([0])) == [1, 3] and seqs(sink.read_partitions([1])) == [1, 2]
    sink.watermark(A)
    sink.commit(rows(0, [4]), {A: (3, 4)})  # the next holder goes on ...
    again = pa.RecordBatchReader.from_batches(SCHEMA, rows(0, [1]).to_batches())
    with pytest.raises(FenceConflictError):  # ... so the stale replace is refused
        zombie.replace_partition(again, 0, A, wm)
    other = pa.RecordBatchReader.from_batches(SCHEMA, rows(0, [1]).to_batches())
    sink.watermark(A)
    with pytest.raises(FenceConflictError):  # a kept side's watermark is fenced too
        sink.replace_partition(other, 0, A, 4, fenced={B: 1})
    assert seqs(sink.read_partitions([0])) == [1, 3, 4]


def test_per_key_state_is_the_last_committed_row(sink: TableSink) -> None:
    sink.watermark(A)
    sink.commit(pa.concat_tables([rows(0, [1, 2], key="a"), rows(0, [3], key="b")]),
                {A: (0, 3)})
    sink.commit(rows(0, [4], key="a", op="late"), {A: (3, 4)})
    p1 = app_id_for("S", "g", 1)
    sink.watermark(p1)
    sink.commit(rows(1, [9], key="a"), {p1: (0, 9)})
    got = sink.last_rows("key", ["a", "b", "zz"], ["key", "seq", "op"], "seq", 0, app_id=A)
    assert got.select(["key", "seq", "op"]).to_pylist() == [
        {"key": "a", "seq": 4, "op": "late"}, {"key": "b", "seq": 3, "op": "set"}]
    assert sink.last_rows("key", ["a"], ["key", "seq"], "seq")["seq"].to_pylist() == [9]
    assert sink.last_rows("key", [], ["key", "seq"], "seq", 0).num_rows == 0


def test_merge_mode_keeps_each_keys_last_row(fmt: Format, tmp_path: Path) -> None:
    sink = fmt.make(tmp_path, schema=SCHEMA, write=MERGE)
    assert sink.write == MERGE
    sink.watermark(A)
    sink.commit(pa.concat_tables([rows(0, [1, 3], key="a"), rows(0, [2], key="b"),
                                  rows(0, [4], key="c")]), {A: (0, 4)})
    sink.commit(pa.concat_tables([rows(0, [5], key="b", op="delete"),
                                  rows(0, [6], key="c", op="again"),
                                  rows(0, [7], key="d", op="delete")]), {A: (4, 7)})
    p1 = app_id_for("S", "g", 1)
    sink.watermark(p1)
    sink.commit(rows(1, [1], key="a"), {p1: (0, 1)})  # the same key in another partition
    got = sorted((r["key"], r["seq"], r["_partition"]) for r in sink.read_partitions().to_pylist())
    assert got == [("a", 1, 1), ("a", 3, 0), ("c", 6, 0)]
    history = pa.RecordBatchReader.from_batches(
        SCHEMA, pa.concat_tables([rows(0, [1], key="a"), rows(0, [2], key="a", op="delete"),
                                  rows(0, [3], key="e")]).to_batches())
    assert sink.replace_partition(history, 0, A, 7) == 2
    assert sink.last_rows_written == 1
    assert [(r["key"], r["seq"]) for r in sink.read_partitions([0]).to_pylist()] == [("e", 3)]
