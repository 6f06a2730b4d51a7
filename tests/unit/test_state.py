"""Per-key state: the declared spec, last row per key, attaching state to a batch, and the
per-run cache (reads each key from the sink once; a rebuild never reads)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cg_pipelines.core.state import KeyedState, attach_state, keys_of, last_per_key, merge_last
from cg_pipelines.engine.state import KeyStateCache

SPEC = KeyedState("k", ("total", "n"))


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"key": "", "columns": ("a",)}, "non-empty"),
    ({"key": "k", "columns": ("a", "")}, "non-empty"),
    ({"key": "k", "columns": ("k",)}, "cannot also be a state column"),
    ({"key": "k", "columns": ("a", "a")}, "duplicate"),
    ({"key": "k", "columns": ("a",), "order_by": ""}, "non-empty"),
])
def test_bad_specs_are_rejected(kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        KeyedState(**kwargs)


def test_spec_names() -> None:
    assert SPEC.read_columns == ["k", "_seq", "total", "n"]
    assert SPEC.attached_names == ["last_total", "last_n"]
    assert KeyedState("k", ("seq",), order_by="seq").read_columns == ["k", "seq"]
    typed = KeyedState("k", ("v",), schema=pa.schema([("k", pa.string()), ("v", pa.int64())]))
    assert typed.empty().schema.field("v").type == pa.int64()
    assert typed.empty().schema.field("_seq").type == pa.null()


@pytest.mark.parametrize(("rows", "want"), [
    ([], []),
    ([("a", 1, 10)], [("a", 1, 10)]),
    ([("a", 5, 50), ("b", 2, 20), ("a", 9, 90), ("a", 1, 10)], [("a", 9, 90), ("b", 2, 20)]),
    # ties on the order column: the later row of the input wins
    ([("a", 3, 1), ("a", 3, 2)], [("a", 3, 2)]),
])
def test_last_per_key(rows: list[tuple], want: list[tuple]) -> None:
    t = pa.table({"k": [r[0] for r in rows], "_seq": pa.array([r[1] for r in rows], pa.int64()),
                  "v": pa.array([r[2] for r in rows], pa.int64())})
    got = last_per_key(t, "k", "_seq")
    assert list(zip(*[got[c].to_pylist() for c in ("k", "_seq", "v")], strict=True)) == want


def test_last_per_key_missing_column() -> None:
    with pytest.raises(KeyError, match="_seq"):
        last_per_key(pa.table({"k": ["a"]}), "k", "_seq")


def test_attach_state_keeps_row_order_and_nulls_unknown_keys() -> None:
    batch = pa.table({"k": ["b", "a", "c", "a"], "x": [1, 2, 3, 4]})
    state = pa.table({"k": ["a", "b"], "_seq": [7, 3], "total": [70.0, 30.0], "n": [2, 1]})
    got = attach_state(batch, state, SPEC)
    assert got.column_names == ["k", "x", "last_total", "last_n"]
    assert got["x"].to_pylist() == [1, 2, 3, 4]
    assert got["last_total"].to_pylist() == [30.0, 70.0, None, 70.0]
    assert got["last_n"].to_pylist() == [1, 2, None, 2]


def test_attach_empty_state_is_typed_from_the_state_table() -> None:
    batch = pa.table({"k": ["a"]})
    empty = pa.table({"k": pa.array([], pa.string()), "total": pa.array([], pa.float64()),
                      "n": pa.array([], pa.int64())})
    got = attach_state(batch, empty, SPEC)
    assert got.schema.field("last_total").type == pa.float64()
    assert got["last_n"].to_pylist() == [None]


def test_attach_state_rejects_clashes_and_missing_key() -> None:
    state = pa.table({"k": ["a"], "total": [1.0], "n": [1]})
    with pytest.raises(ValueError, match="clash"):
        attach_state(pa.table({"k": ["a"], "last_n": [0]}), state, SPEC)
    with pytest.raises(KeyError, match="state key"):
        attach_state(pa.table({"x": [1]}), state, SPEC)


def test_merge_last_prefers_newer_rows_and_unifies_null_types() -> None:
    known = SPEC.empty()  # null-typed before any commit
    new = pa.table({"k": ["a", "a", "b"], "_seq": [1, 2, 3], "total": [1.0, 3.0, 5.0],
                    "n": [1, 2, 1], "extra": [0, 0, 0]})
    merged = merge_last(known, new, SPEC)
    assert merged.to_pylist() == [{"k": "a", "_seq": 2, "total": 3.0, "n": 2},
                                  {"k": "b", "_seq": 3, "total": 5.0, "n": 1}]
    newer = pa.table({"k": ["b"], "_seq": [9], "total": [6.0], "n": [2]})
    assert merge_last(merged, newer, SPEC)["total"].to_pylist() == [3.0, 6.0]


def test_keys_of_drops_nulls() -> None:
    assert sorted(keys_of(pa.table({"k": ["a", None, "a", "b"]}), "k")) == ["a", "b"]


class CountingReader:
    def __init__(self, committed: pa.Table) -> None:
        self.committed, self.calls = committed, []

    def __call__(self, keys: list) -> pa.Table:
        self.calls.append(sorted(keys))
        rows = self.committed.filter(pa.compute.is_in(self.committed["k"],
                                                      value_set=pa.array(keys)))
        return last_per_key(rows, "k", "_seq")


def test_cache_reads_each_key_once_and_follows_commits() -> None:
    committed = pa.table({"k": ["a", "b", "a"], "_seq": [1, 2, 3], "total": [1.0, 2.0, 4.0],
                          "n": [1, 1, 2]})
    reader = CountingReader(committed)
    cache = KeyStateCache(SPEC, reader)
    got = cache.lookup(["a", "z"])
    assert got.to_pylist() == [{"k": "a", "_seq": 3, "total": 4.0, "n": 2}]
    # a second batch: only the new key is read; an absent key is not read again
    cache.lookup(["a", "b", "z"])
    assert reader.calls == [["a", "z"], ["b"]]
    # a commit updates the cache without a read
    cache.update(pa.table({"k": ["z", "a"], "_seq": [10, 11], "total": [9.0, 5.0], "n": [1, 3],
                           "_partition": [0, 0]}))
    got = {r["k"]: r["total"] for r in cache.lookup(["a", "b", "z"]).to_pylist()}
    assert got == {"a": 5.0, "b": 2.0, "z": 9.0}
    assert reader.calls == [["a", "z"], ["b"]] and cache.sink_reads == 3


def test_rebuild_cache_starts_empty_and_never_reads() -> None:
    cache = KeyStateCache(SPEC, None)
    assert cache.lookup(["a"]).num_rows == 0
    cache.update(pa.table({"k": ["a"], "_seq": [1], "total": [1.0], "n": [1]}))
    assert cache.lookup(["a"])["n"].to_pylist() == [1]
    assert cache.sink_reads == 0
