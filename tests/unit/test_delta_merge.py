"""Merge write mode of the Delta sink on real Delta tables (local disk; S3 in
tests/integration/test_merge_mode.py): upserts and deletes equal a pandas reference wherever
batches split, the fence refuses a stale writer, lineage is on every version, a rebuild-style
replace of a merge partition equals the drained table. No mocks."""

from __future__ import annotations

import random

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from cg_pipelines import __version__
from cg_pipelines.core.state import KeyedState
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.delta import DeltaSink

OPS = Merge(key="k", delete_when=("op", "del"))


def events(n: int, n_keys: int, seed: int, p_del: float = 0.15) -> pd.DataFrame:
    """Stream-ordered events: key, value, op (``up``/``del``), sequence; some exact re-sends
    (same key and value again, a later sequence) included."""
    rnd = random.Random(seed)
    rows = []
    for seq in range(1, n + 1):
        if rows and rnd.random() < 0.05:  # re-sent message
            k, v, op = rows[-1][:3]
        else:
            k = f"k{rnd.randrange(n_keys)}"
            op = "del" if rnd.random() < p_del else "up"
            v = rnd.randrange(1_000_000)
        rows.append((k, v, op, seq))
    return pd.DataFrame(rows, columns=["k", "v", "op", "_seq"])


def reference(df: pd.DataFrame) -> pd.DataFrame:
    """Independent pandas reference: each key's last event by sequence, deleted keys gone."""
    last = df.sort_values("_seq").drop_duplicates("k", keep="last")
    return (last[last["op"] != "del"][["k", "v", "_seq"]]
            .sort_values("k").reset_index(drop=True))


def arrow(df: pd.DataFrame, partition: int = 0) -> pa.Table:
    t = pa.Table.from_pandas(df[["k", "v", "op", "_seq"]], preserve_index=False)
    return t.append_column("_partition", pa.array([partition] * len(df), pa.int64()))


def got(sink: DeltaSink, partition: int | None = None) -> pd.DataFrame:
    t = sink.read()
    if partition is not None:
        t = t.filter(pc.equal(t["_partition"], partition))
    return t.select(["k", "v", "_seq"]).to_pandas().sort_values("k").reset_index(drop=True)


def drain(sink: DeltaSink, df: pd.DataFrame, cuts: list[int], app: str = "s/g/0",
          partition: int = 0) -> None:
    """Commit ``df`` in batches cut at ``cuts`` (shuffled within each batch: the sink must
    order by ``_seq``, not by row order)."""
    bounds = [0, *cuts, len(df)]
    wm = sink.watermark(app)
    for a, b in zip(bounds, bounds[1:], strict=False):
        if a == b:
            continue
        part = df.iloc[a:b].sample(frac=1.0, random_state=a)
        last = int(df["_seq"].iloc[b - 1])
        sink.commit(arrow(part, partition), {app: (wm, last)},
                    lineage={"stream": "s", "group": "g", "partition": partition,
                             "first_seq": int(df["_seq"].iloc[a]), "last_seq": last})
        wm = last


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_merge_equals_pandas_reference_wherever_batches_split(tmp_path, seed: int) -> None:
    df = events(3000, 200, seed)
    rnd = random.Random(seed)
    cuts = sorted(rnd.sample(range(1, len(df)), 12))
    sink = DeltaSink(str(tmp_path / "t"), write=OPS)
    drain(sink, df, cuts)
    want = reference(df)
    assert len(want) > 50 and (df["op"] == "del").sum() > 100  # the case is not trivial
    pd.testing.assert_frame_equal(got(sink), want, check_dtype=False)
    # one row per key: the table is the current state, not the history
    assert sink.read().num_rows == len(want)
    assert sink.watermark("s/g/0") == 3000


def test_merge_one_batch_equals_many_batches(tmp_path) -> None:
    df = events(1500, 40, 7)
    one = DeltaSink(str(tmp_path / "one"), write=OPS)
    many = DeltaSink(str(tmp_path / "many"), write=OPS)
    drain(one, df, [])
    drain(many, df, list(range(7, 1500, 7)))
    pd.testing.assert_frame_equal(got(one), got(many))
    pd.testing.assert_frame_equal(got(one), reference(df), check_dtype=False)


def test_append_stays_the_default_and_keeps_history(tmp_path) -> None:
    df = events(400, 10, 4)
    sink = DeltaSink(str(tmp_path / "t"))
    assert isinstance(sink.write, Append)
    drain(sink, df, [100, 250])
    assert sink.read().num_rows == 400


def test_delete_by_expression_and_composite_key(tmp_path) -> None:
    mode = Merge(key=("site", "dev"), delete_when=pc.field("gone"))
    sink = DeltaSink(str(tmp_path / "t"), write=mode)
    sink.watermark("a")

    def rows(site, dev, v, gone, seq):
        return pa.table({"site": site, "dev": dev, "v": v, "gone": gone,
                         "_seq": pa.array(seq, pa.int64()),
                         "_partition": pa.array([0] * len(seq), pa.int64())})

    sink.commit(rows(["a", "a", "b"], ["x", "y", "x"], [1, 2, 3], [False, False, False],
                     [1, 2, 3]), {"a": (0, 3)})
    # (a, x) deleted, (b, x) updated, (a, y) untouched; a null marker does not delete
    sink.commit(rows(["a", "b", "b"], ["x", "x", "x"], [0, 30, 31], [True, None, None],
                     [4, 5, 6]), {"a": (3, 6)})
    out = sorted((r["site"], r["dev"], r["v"]) for r in sink.read().to_pylist())
    assert out == [("a", "y", 2), ("b", "x", 31)]


def test_delete_then_reinsert_in_one_batch_keeps_the_last(tmp_path) -> None:
    sink = DeltaSink(str(tmp_path / "t"), write=OPS)
    sink.watermark("a")
    df = pd.DataFrame([("k1", 1, "up", 1), ("k1", 0, "del", 2), ("k1", 3, "up", 3),
                       ("k2", 4, "up", 4), ("k2", 0, "del", 5)], columns=["k", "v", "op", "_seq"])
    sink.commit(arrow(df), {"a": (0, 5)})
    assert got(sink).values.tolist() == [["k1", 3, 3]]


def test_merge_that_changes_nothing_still_moves_the_watermark(tmp_path) -> None:
    sink = DeltaSink(str(tmp_path / "t"), write=OPS)
    sink.watermark("a")
    sink.commit(arrow(pd.DataFrame([("k1", 1, "up", 1)], columns=["k", "v", "op", "_seq"])),
                {"a": (0, 1)})
    before = DeltaTable(sink.uri).version()
    # deletes a key that is not there: delta-rs' MERGE writes no version for that
    sink.commit(arrow(pd.DataFrame([("zz", 0, "del", 2)], columns=["k", "v", "op", "_seq"])),
                {"a": (1, 2)})
    assert sink.watermark("a") == 2
    assert DeltaTable(sink.uri).version() == before + 1
    assert sink.versions_written == [before, before + 1]
    assert got(sink).values.tolist() == [["k1", 1, 1]]


def test_stale_merge_writer_is_fenced_and_changes_nothing(tmp_path) -> None:
    uri = str(tmp_path / "t")
    first = events(200, 20, 5, p_del=0.0)
    owner, zombie = DeltaSink(uri, write=OPS), DeltaSink(uri, write=OPS)
    drain(owner, first, [100])
    assert zombie.watermark("s/g/0") == 200
    nxt = events(300, 20, 6).iloc[200:].copy()
    owner.commit(arrow(nxt.iloc[:50]), {"s/g/0": (200, 250)})
    state = got(owner)
    version = DeltaTable(uri).version()
    # the zombie read watermark 200 and commits the same range with other values
    stale = nxt.iloc[:50].copy()
    stale["v"] = -1
    with pytest.raises(FenceConflictError):
        zombie.commit(arrow(stale), {"s/g/0": (200, 250)})
    # a zombie whose merge would change nothing is refused too (its empty commit is fenced)
    noop = pd.DataFrame([("nobody", 0, "del", 250)], columns=["k", "v", "op", "_seq"])
    z2 = DeltaSink(uri, write=OPS)
    z2.watermark("s/g/0")
    owner.commit(arrow(nxt.iloc[50:60]), {"s/g/0": (250, 260)})
    with pytest.raises(FenceConflictError):
        z2.commit(arrow(noop), {"s/g/0": (250, 260)})
    assert DeltaTable(uri).version() == version + 1
    assert (got(owner)["v"] >= 0).all() and len(got(owner)) >= len(state) - 10
    assert owner.watermark("s/g/0") == 260


def test_merges_of_two_partitions_do_not_conflict(tmp_path) -> None:
    uri = str(tmp_path / "t")
    a, b = DeltaSink(uri, write=OPS), DeltaSink(uri, write=OPS)
    df0, df1 = events(300, 30, 8), events(300, 30, 9)
    drain(a, df0.iloc[:100], [], app="s/g/0", partition=0)
    drain(b, df1.iloc[:100], [], app="s/g/1", partition=1)
    # both read their watermark from the same version, then commit one after the other
    a.watermark("s/g/0")
    b.watermark("s/g/1")
    a.commit(arrow(df0.iloc[100:], 0), {"s/g/0": (100, 300)})
    b.commit(arrow(df1.iloc[100:], 1), {"s/g/1": (100, 300)})
    pd.testing.assert_frame_equal(got(a, 0), reference(df0), check_dtype=False)
    pd.testing.assert_frame_equal(got(a, 1), reference(df1), check_dtype=False)


def test_lineage_on_every_commit(tmp_path) -> None:
    uri = str(tmp_path / "t")
    sink = DeltaSink(uri, write=OPS, commit_metadata={"dagster_run_id": "run-1"})
    df = events(100, 10, 10)
    drain(sink, df, [60])
    sink.commit(None, {"s/g/0": (100, 120)}, lineage={"first_seq": 101, "last_seq": 120})
    app = DeltaSink(uri)  # append mode on the same table
    app.watermark("s/g/9")
    app.commit(arrow(df.iloc[:5], 9), {"s/g/9": (0, 5)}, lineage={"stream": "s", "partition": 9})
    hist = {h["version"]: h for h in DeltaTable(uri).history()}
    mine = [hist[v] for v in sink.versions_written]
    assert [h["cg.last_seq"] for h in mine] == ["60", "100", "120"]
    assert [h["cg.operation"] for h in mine] == ["merge", "merge", "empty"]
    for h in mine:
        assert h["cg.operation"] == "empty" or h["cg.stream"] == "s"
        assert h["cg.app_id"] == "s/g/0" and h["cg.dagster_run_id"] == "run-1"
        assert h["cg.library_version"] == __version__ and h["cg.write_mode"] == "merge"
        assert '"app_id":"s/g/0"' in h["userMetadata"]
    assert mine[0]["cg.first_seq"] == "1" and mine[0]["cg.partition"] == "0"
    (last,) = [hist[v] for v in app.versions_written]
    assert (last["cg.write_mode"], last["cg.operation"], last["cg.partition"]) == (
        "append", "append", "9")
    assert "cg.dagster_run_id" not in last


def test_replace_partition_in_merge_mode_equals_the_drain(tmp_path) -> None:
    df = events(2000, 100, 11)
    sink = DeltaSink(str(tmp_path / "t"), write=OPS)
    drain(sink, df, [500, 1200])
    drained = got(sink)
    other = events(50, 5, 12)
    drain(sink, other, [], app="s/g/1", partition=1)
    # corrupt partition 0, then rebuild it from the whole history, streamed in batches
    DeltaTable(sink.uri).update({"v": "-1"}, predicate="_partition = 0")
    history = arrow(df)
    schema = pa.schema(DeltaTable(sink.uri).schema().to_arrow())
    reader = pa.RecordBatchReader.from_batches(
        schema, history.select(schema.names).cast(schema).to_batches(max_chunksize=300))
    sink.watermark("s/g/0")
    replaced = sink.replace_partition(reader, 0, "s/g/0", 2000, lineage={"stream": "s"})
    assert replaced == len(drained)
    assert sink.last_rows_written == len(drained)
    pd.testing.assert_frame_equal(got(sink, 0), drained)
    pd.testing.assert_frame_equal(got(sink, 1), reference(other), check_dtype=False)
    assert sink.watermark("s/g/0") == 2000
    h = DeltaTable(sink.uri).history(1)[0]
    assert h["cg.operation"] == "replace_partition" and h["cg.partition"] == "0"


@pytest.mark.parametrize(("mode", "why"), [
    (lambda: Merge(key=""), "key must be"),
    (lambda: Merge(key=("a", "a")), "duplicate key"),
    (lambda: Merge(key="a", order_by="a"), "cannot be a key"),
    (lambda: Merge(key="a", delete_when="op"), "delete_when must be"),
    (lambda: Merge(key="a", delete_when=("a", 1)), "delete column"),
])
def test_invalid_merge_configs_are_rejected_with_the_reason(mode, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        mode()


def test_bad_outputs_are_rejected_with_the_reason(tmp_path) -> None:
    sink = DeltaSink(str(tmp_path / "t"), write=OPS)
    sink.watermark("a")
    ok = arrow(pd.DataFrame([("k1", 1, "up", 1)], columns=["k", "v", "op", "_seq"]))
    with pytest.raises(ValueError, match=r"needs the output columns \['_seq'\]"):
        sink.commit(ok.drop_columns(["_seq"]), {"a": (0, 1)})
    with pytest.raises(ValueError, match="null value"):
        sink.commit(ok.set_column(0, "k", pa.array([None], pa.string())), {"a": (0, 1)})
    sink.commit(ok, {"a": (0, 1)})
    with pytest.raises(ValueError, match=r"not in the table: \['extra'\]"):
        sink.commit(ok.append_column("extra", pa.array([1])), {"a": (1, 2)})
    with pytest.raises(ValueError, match="write must be"):
        DeltaSink(str(tmp_path / "u"), write="merge")  # type: ignore[arg-type]
    assert sink.watermark("a") == 1


def test_state_cache_forgets_deleted_keys() -> None:
    spec = KeyedState("k", ("v",), order_by="_seq")
    cache = KeyStateCache(spec, None, OPS)
    t = pa.table({"k": ["a", "b", "a", "b"], "v": [1, 2, 3, 0], "op": ["up", "up", "up", "del"],
                  "_seq": pa.array([1, 2, 3, 4], pa.int64())})
    cache.update(t)
    assert cache.lookup(["a", "b"]).to_pylist() == [{"k": "a", "_seq": 3, "v": 3}]
    cache.update(pa.table({"k": ["b", "a"], "v": [5, 0], "op": ["up", "del"],
                           "_seq": pa.array([5, 6], pa.int64())}))
    assert cache.lookup(["a", "b"]).to_pylist() == [{"k": "b", "_seq": 5, "v": 5}]
    # append mode keeps the marker row as the state (the history's last row)
    plain = KeyStateCache(spec, None)
    plain.update(t)
    assert sorted(plain.lookup(["a", "b"])["v"].to_pylist()) == [0, 3]


def test_reads_and_state_lookups_filter_merge_written_files(tmp_path) -> None:
    """delta-rs' MERGE writes strings as string_view, whose statistics pyarrow cannot compare
    with a string literal: filtered reads and last_rows must still answer."""
    sink = DeltaSink(str(tmp_path / "t"), write=OPS)
    df = events(300, 30, 13, p_del=0.0)
    drain(sink, df, [100])
    want = reference(df)
    k = want["k"][3]
    got_row = sink.read(filter=pc.field("k") == k).to_pylist()
    assert [(r["k"], r["v"]) for r in got_row] == [(k, int(want["v"][3]))]
    last = sink.last_rows("k", [k, "absent"], ["v"], "_seq", partition=0)
    assert last.to_pylist() == [{"k": k, "_seq": int(want["_seq"][3]), "v": int(want["v"][3])}]
