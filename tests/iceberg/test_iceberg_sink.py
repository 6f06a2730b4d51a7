"""The Iceberg sink's fence and table contract, without NATS: a stale writer of the SAME
partition is fenced, a stale writer of ANOTHER partition is retried and lands, concurrent
writers of different partitions all land; lineage, empty commits, markers, partitioning,
merge, state reads, maintenance bound. The fence runs on every backend."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from pyiceberg.expressions import EqualTo
from pyiceberg.transforms import IdentityTransform

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.base import FenceConflictError, MaintainedSink, TableSink
from cg_pipelines.sinks.iceberg import IcebergSink, iceberg_s3_properties
from tests.iceberg.conftest import BACKENDS, Backend

SCHEMA = pa.schema([("key", pa.string()), ("v", pa.int64()), ("seq", pa.int64()),
                    ("_partition", pa.int64())])


def rows(p: int, keys: list[str], seq0: int) -> pa.Table:
    n = len(keys)
    return pa.table({"key": keys, "v": [seq0 * 10 + i for i in range(n)],
                     "seq": list(range(seq0, seq0 + n)), "_partition": [p] * n}, schema=SCHEMA)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_stale_same_partition_is_fenced_other_partition_retried(backend: Backend) -> None:
    live, zombie, other = backend.sink(), backend.sink(), backend.sink()
    assert live.watermark("s/g/0") == 0
    live.commit(rows(0, ["a", "b"], 1), {"s/g/0": (0, 2)}, lineage={"stream": "s", "first_seq": 1})
    assert zombie.watermark("s/g/0") == 2 and other.watermark("s/g/1") == 0
    live.commit(rows(0, ["c"], 3), {"s/g/0": (2, 3)})      # the zombie's snapshot is now stale
    with pytest.raises(FenceConflictError) as e:
        zombie.commit(rows(0, ["zz"], 3), {"s/g/0": (2, 3)})
    assert e.value.found == 3
    other.commit(rows(1, ["q"], 1), {"s/g/1": (0, 1)})     # stale too, but another partition
    assert other.commit_retries_used >= 1
    got = live.read().sort_by("seq")
    assert sorted(got["key"].to_pylist()) == ["a", "b", "c", "q"]
    assert live.watermarks(["s/g/0", "s/g/1"]) == {"s/g/0": 3, "s/g/1": 1}
    summary = live.history()[0]
    assert summary["cg.watermark"] == "2" and summary["cg.stream"] == "s"
    assert summary["cg.first_seq"] == "1" and summary["cg.operation"] == "append"


def test_pyiceberg_alone_lets_a_stale_append_land(tmp_path) -> None:
    """Why the fence is ours (DESIGN §9): pyiceberg refreshes and retries a stale handle's
    append. With the sink, the same race is a FenceConflictError (test above)."""
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("x", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}")
    cat.create_namespace("n")
    t = cat.create_table("n.t", schema=SCHEMA)
    stale = cat.load_table("n.t")
    t.append(rows(0, ["a"], 1))
    stale.append(rows(0, ["a"], 1))  # the zombie's duplicate lands
    assert cat.load_table("n.t").scan().to_arrow().num_rows == 2


@pytest.mark.parametrize("backend", ["sqlite-local", "postgres-local"], indirect=True)
def test_concurrent_partitions_all_land(backend: Backend) -> None:
    """4 threads (one sink each, as 4 processes), 6 commits each, racing on one table: every
    commit lands once (lost races retried), no fence conflict."""
    backend.sink().ensure_table(SCHEMA)
    errors: list[BaseException] = []

    def run(p: int) -> None:
        s = backend.sink()
        try:
            wm = s.watermark(f"s/g/{p}")
            for _ in range(6):
                s.commit(rows(p, [f"k{p}"], wm + 1), {f"s/g/{p}": (wm, wm + 1)})
                wm += 1
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    s = backend.sink()
    assert s.watermarks([f"s/g/{p}" for p in range(4)]) == {f"s/g/{p}": 6 for p in range(4)}
    assert s.read().num_rows == 24
    assert s.stats(2).partition_rows == 6 and s.stats().rows == 24


def test_table_shape_empty_commit_markers_and_state(tmp_path, request) -> None:
    from tests.iceberg.conftest import make_backend

    b = make_backend("sqlite-local", request, tmp_path)
    s = b.sink(schema=SCHEMA)
    assert isinstance(s, TableSink) and isinstance(s, MaintainedSink)
    s.watermark("s/g/0")
    # an empty batch creates the table
    s.commit(None, {"s/g/0": (0, 5)}, markers={"s/g/0@origin": 17})
    assert s.watermark("s/g/0") == 5 and s.watermark("s/g/0@origin") == 17
    tbl = s.load()
    assert tbl is not None
    assert [(f.name, type(f.transform)) for f in tbl.spec().fields] == [
        ("_partition", IdentityTransform)]
    assert tbl.properties["commit.retry.num-retries"] == "0"
    assert s.history()[-1]["cg.operation"] == "empty"
    s.commit(rows(0, ["a", "b", "a"], 6), {"s/g/0": (5, 8)})
    st = s.last_rows("key", ["a", "b", "x"], ["v"], "seq", partition=0)
    assert st.to_pylist() == [{"key": "a", "v": 62, "seq": 8}, {"key": "b", "v": 61, "seq": 7}]
    assert s.last_rows("key", ["a"], ["v"], "seq", partition=1).num_rows == 0
    with pytest.raises(ValueError, match="expected < version"):
        s.commit(None, {"s/g/0": (8, 8)})
    # DeltaSink's read(columns, filter=<pyarrow expression>), as the reconcile check calls it
    import pyarrow.compute as pc

    from cg_pipelines.jetstream.reconcile import sink_table_seqs

    assert s.read(columns=["seq"], filter=pc.field("v") > 60)["seq"].to_pylist() in (
        [7, 8], [8, 7])
    assert sorted(sink_table_seqs(s, "seq")(7, 8).to_pylist()) == [7, 8]


def test_merge_composite_key_and_maintenance_bound(tmp_path, request) -> None:
    from tests.iceberg.conftest import make_backend

    b = make_backend("sqlite-local", request, tmp_path)
    schema = pa.schema([("site", pa.string()), ("dev", pa.string()), ("op", pa.string()),
                        ("_seq", pa.int64()), ("_partition", pa.int64())])
    s = b.sink(Merge(key=("site", "dev"), delete_when=("op", "del")), keep_snapshots=3)

    def batch(evs: list[tuple[str, str, str]], seq0: int) -> pa.Table:
        return pa.table({"site": [e[0] for e in evs], "dev": [e[1] for e in evs],
                         "op": [e[2] for e in evs], "_seq": list(range(seq0, seq0 + len(evs))),
                         "_partition": [0] * len(evs)}, schema=schema)

    s.watermark("a")
    s.commit(batch([("x", "1", "up"), ("x", "2", "up"), ("y", "1", "up")], 1), {"a": (0, 3)})
    s.commit(batch([("x", "1", "del"), ("y", "1", "up"), ("x", "1", "up")], 4), {"a": (3, 6)})
    s.commit(batch([("x", "2", "del")], 7), {"a": (6, 7)})
    got = sorted((r["site"], r["dev"], r["_seq"]) for r in s.read().to_pylist())
    assert got == [("x", "1", 6), ("y", "1", 5)]
    for i in range(8, 14):
        s.commit(None, {"a": (i - 1, i)})
    assert len(s.load().snapshots()) > 3
    figures = s.maintain(0, "a")
    assert "error" not in figures, figures
    assert figures["iceberg_snapshots"] == 3 and len(s.load().snapshots()) == 3
    assert s.maintain(0, "a")["iceberg_snapshots_expired"] == 0  # nothing more to expire
    assert s.watermark("a") == 13 and len(s.read().to_pylist()) == 2


def test_s3_properties_and_repr_hide_secrets() -> None:
    props = iceberg_s3_properties({"AWS_ENDPOINT_URL": "http://h:1", "AWS_ACCESS_KEY_ID": "id",
                                   "AWS_SECRET_ACCESS_KEY": "sekrit", "AWS_REGION": "r",
                                   "AWS_ALLOW_HTTP": "true"})
    assert props == {"s3.endpoint": "http://h:1", "s3.access-key-id": "id",
                     "s3.secret-access-key": "sekrit", "s3.region": "r"}
    s = IcebergSink("n.t", catalog={"type": "sql", "uri": "sqlite:///:memory:",
                                    "warehouse": "file:///tmp", "init_catalog_tables": "true",
                                    **props})
    assert "sekrit" not in repr(s)
    with pytest.raises(ConfigError, match=r"AWS_ENDPOINT_ULR \(did you mean AWS_ENDPOINT_URL"):
        iceberg_s3_properties({"AWS_ENDPOINT_ULR": "http://h:1", "s3.region": "r"})
    with pytest.raises(ValueError, match="namespace"):
        IcebergSink("t", catalog=s.catalog)


def test_merge_of_many_keys_rewrites_the_partition_and_keeps_others(tmp_path, request) -> None:
    """More keys in a batch than pyiceberg prunes by: the partition is rewritten whole (one
    file), other partitions untouched, the result equals a plain-dict reference."""
    import random

    from cg_pipelines.sinks.iceberg import IN_PRUNE_LIMIT
    from tests.iceberg.conftest import make_backend

    b = make_backend("sqlite-local", request, tmp_path)
    s = b.sink(Merge(key="key", delete_when=("op", "del")))
    schema = pa.schema([("key", pa.string()), ("op", pa.string()), ("v", pa.int64()),
                        ("_seq", pa.int64()), ("_partition", pa.int64())])
    rnd = random.Random(4)
    ref: dict[tuple[int, str], int] = {}
    seq = {0: 0, 1: 0}
    for rnd_i in range(4):
        for p in (0, 1):
            n = 3 * IN_PRUNE_LIMIT if p == 0 else 20  # p0: whole rewrite; p1: IN filter
            evs = [(f"k{rnd.randrange(2 * n)}", "del" if rnd.random() < 0.2 else "up",
                    rnd_i * 1000 + i) for i in range(n)]
            for k, op, v in evs:
                if op == "del":
                    ref.pop((p, k), None)
                else:
                    ref[(p, k)] = v
            t = pa.table({"key": [e[0] for e in evs], "op": [e[1] for e in evs],
                          "v": [e[2] for e in evs],
                          "_seq": list(range(seq[p] + 1, seq[p] + n + 1)),
                          "_partition": [p] * n}, schema=schema)
            s.watermark(f"a/{p}")
            s.commit(t, {f"a/{p}": (seq[p], seq[p] + n)})
            seq[p] += n
    got = {(r["_partition"], r["key"]): r["v"] for r in s.read().to_pylist()}
    assert got == ref and s.read().num_rows == len(ref)
    assert len(s.data_files(row_filter=EqualTo("_partition", 0))) == 1


def test_a_table_created_elsewhere_gets_pyiceberg_retry_off_and_is_fenced(tmp_path) -> None:
    """A table the sink did not create (pyiceberg's default: 4 blind retries) is switched to
    ``commit.retry.num-retries=0`` by the sink's first commit, and the fence holds on it."""
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("x", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}")
    cat.create_namespace("n")
    cat.create_table("n.t", schema=SCHEMA)
    live, zombie = IcebergSink("n.t", catalog=cat), IcebergSink("n.t", catalog=cat)
    live.watermark("a")
    live.commit(rows(0, ["a"], 1), {"a": (0, 1)})
    assert cat.load_table("n.t").properties["commit.retry.num-retries"] == "0"
    zombie.watermark("a")
    live.commit(rows(0, ["b"], 2), {"a": (1, 2)})
    with pytest.raises(FenceConflictError):
        zombie.commit(rows(0, ["b"], 2), {"a": (1, 2)})
    assert live.read().num_rows == 2


def test_importing_the_delta_sink_never_imports_pyiceberg() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, cg_pipelines.sinks, cg_pipelines.sinks.delta, cg_pipelines.dagster; "
            "assert 'pyiceberg' not in sys.modules; "
            "from cg_pipelines.sinks import IcebergSink; assert 'pyiceberg' in sys.modules")
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
