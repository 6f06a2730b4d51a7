"""DeltaSink on a local directory, against real deltalake (delta-rs): fencing, races, empty
commits, reads, secrets."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from cg_pipelines.engine.processor import Record, records_to_arrow
from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.delta import DeltaSink
from tests.support.race import race

SCHEMA = pa.schema([("key", pa.string()), ("seq", pa.int64()), ("tag", pa.string())])


def rows(first: int, n: int, tag: str = "t", key: str = "k") -> pa.Table:
    """``n`` rows with seq ``first .. first+n-1``."""
    return pa.table(
        {"key": [key] * n, "seq": list(range(first, first + n)), "tag": [tag] * n}, schema=SCHEMA
    )


def delta_version(uri: str) -> int:
    return DeltaTable(uri).version()


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return str(tmp_path / "table")


def test_watermark_starts_at_zero_and_creates_nothing(uri: str) -> None:
    sink = DeltaSink(uri)
    assert sink.watermark("s/g/0") == 0
    assert not sink.exists()
    assert not Path(uri).exists()
    assert sink.read().num_rows == 0
    assert sink.read(columns=["key"]).column_names == ["key"]


def test_commit_advances_watermark_and_consecutive_commits(uri: str) -> None:
    sink = DeltaSink(uri)
    assert sink.watermark("a") == 0
    sink.commit(rows(1, 3), {"a": (0, 3)})
    assert sink.exists()
    assert sink.watermark("a") == 3
    # A run commits batch after batch without re-reading the watermark.
    sink.commit(rows(4, 2), {"a": (3, 5)})
    sink.commit(None, {"a": (5, 6)})
    sink.commit(rows(7, 1), {"a": (6, 7)})
    assert sink.watermark("a") == 7
    assert DeltaSink(uri).watermark("a") == 7  # seen by a fresh reader
    assert DeltaSink(uri).watermark("other") == 0
    assert sorted(sink.read().column("seq").to_pylist()) == [1, 2, 3, 4, 5, 7]


def test_commit_without_prior_watermark_loads_a_snapshot(uri: str) -> None:
    DeltaSink(uri).commit(rows(1, 1), {"a": (0, 1)})
    sink = DeltaSink(uri)
    with pytest.raises(FenceConflictError) as ei:
        sink.commit(rows(2, 1), {"a": (0, 2)})
    assert (ei.value.expected, ei.value.found) == (0, 1)
    sink.commit(rows(2, 1), {"a": (1, 2)})
    assert sink.watermark("a") == 2


def test_stale_expected_is_refused_and_writes_nothing(uri: str) -> None:
    sink = DeltaSink(uri)
    sink.watermark("a")
    sink.commit(rows(1, 5), {"a": (0, 5)})
    version = delta_version(uri)
    with pytest.raises(FenceConflictError) as ei:
        sink.commit(rows(6, 5), {"a": (3, 10)})
    assert (ei.value.app_id, ei.value.expected, ei.value.found) == ("a", 3, 5)
    assert sink.watermark("a") == 5
    assert sink.read().num_rows == 5
    assert delta_version(uri) == version


def test_zombie_with_stale_snapshot_is_fenced_by_delta_conflict_checker(uri: str) -> None:
    DeltaSink(uri).ensure_table(SCHEMA)
    zombie, owner = DeltaSink(uri), DeltaSink(uri)
    assert zombie.watermark("a") == 0
    assert owner.watermark("a") == 0
    owner.commit(rows(1, 4, "owner"), {"a": (0, 4)})
    # An unrelated partition commits too: the zombie's snapshot is two versions behind.
    DeltaSink(uri).commit(rows(1, 1, "b"), {"b": (0, 1)})
    version = delta_version(uri)
    # The zombie's own snapshot still says 0, so only delta-rs' conflict check can stop it.
    with pytest.raises(FenceConflictError) as ei:
        zombie.commit(rows(1, 4, "zombie"), {"a": (0, 4)})
    assert ei.value.found == 4
    assert delta_version(uri) == version
    assert "zombie" not in owner.read().column("tag").to_pylist()
    assert zombie.watermark("a") == 4  # the zombie re-reads and skips what is committed


def _race_same_app(uri: str, n: int, fresh: bool) -> None:
    if not fresh:
        DeltaSink(uri).commit(rows(1, 1, "seed"), {"other": (0, 1)})
    sinks = [DeltaSink(uri) for _ in range(n)]
    assert all(s.watermark("a") == 0 for s in sinks)
    out = race(n, lambda i: sinks[i].commit(rows(1, 3, f"w{i}"), {"a": (0, 10 + i)}))
    winners = [i for i, e in out.items() if e is None]
    assert len(winners) == 1, out
    losers = [e for e in out.values() if e is not None]
    assert all(isinstance(e, FenceConflictError) for e in losers), losers
    winner = winners[0]
    assert DeltaSink(uri).watermark("a") == 10 + winner
    tags = DeltaSink(uri).read(filter=pc.field("tag") != "seed").column("tag").to_pylist()
    assert tags == [f"w{winner}"] * 3


def test_race_same_app_existing_table_exactly_one_wins(uri: str) -> None:
    _race_same_app(uri, 4, fresh=False)


@pytest.mark.parametrize("attempt", range(3))
def test_race_same_app_fresh_table_exactly_one_wins(tmp_path: Path, attempt: int) -> None:
    _race_same_app(str(tmp_path / "t"), 4, fresh=True)


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_partitions_commit_concurrently_without_conflict(
    uri: str, fresh: bool, shared: bool
) -> None:
    if not fresh:
        DeltaSink(uri).ensure_table(SCHEMA)
    n, batches = 4, 5
    one = DeltaSink(uri)
    sinks = [one if shared else DeltaSink(uri) for _ in range(n)]

    def partition(i: int) -> None:
        app = f"s/g/{i}"
        wm = sinks[i].watermark(app)
        for _ in range(batches):
            sinks[i].commit(rows(wm + 1, 2, key=str(i)), {app: (wm, wm + 2)})
            wm += 2

    out = race(n, partition)
    assert out == {i: None for i in range(n)}
    check = DeltaSink(uri)
    assert [check.watermark(f"s/g/{i}") for i in range(n)] == [2 * batches] * n
    for i in range(n):
        got = check.read(filter=pc.field("key") == str(i)).column("seq").to_pylist()
        assert sorted(got) == list(range(1, 2 * batches + 1))


def test_empty_commit_advances_watermark(uri: str) -> None:
    sink = DeltaSink(uri)
    sink.watermark("a")
    sink.commit(rows(1, 2), {"a": (0, 2)})
    v = delta_version(uri)
    sink.commit(None, {"a": (2, 5)})
    assert sink.watermark("a") == 5
    assert delta_version(uri) == v + 1
    sink.commit(rows(1, 0), {"a": (5, 6)})  # 0 rows
    assert sink.watermark("a") == 6
    assert delta_version(uri) == v + 2
    assert sink.read().num_rows == 2
    assert DeltaSink(uri).watermark("a") == 6


def test_empty_commit_is_fenced(uri: str) -> None:
    DeltaSink(uri).ensure_table(SCHEMA)
    a, b = DeltaSink(uri), DeltaSink(uri)
    a.watermark("p")
    b.watermark("p")
    a.commit(None, {"p": (0, 3)})
    with pytest.raises(FenceConflictError):
        b.commit(None, {"p": (0, 4)})
    assert DeltaSink(uri).watermark("p") == 3


def test_empty_first_commit_needs_a_schema(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="schema"):
        DeltaSink(str(tmp_path / "x")).commit(None, {"a": (0, 1)})
    assert not DeltaSink(str(tmp_path / "x")).exists()
    sink = DeltaSink(str(tmp_path / "y"), schema=SCHEMA)
    assert sink.read().schema == SCHEMA  # no table yet: empty, with the given schema
    sink.commit(None, {"a": (0, 1)})
    assert sink.exists() and sink.watermark("a") == 1
    assert sink.read().num_rows == 0
    assert sink.read().schema.names == SCHEMA.names


def test_version_must_advance(uri: str) -> None:
    sink = DeltaSink(uri)
    with pytest.raises(ValueError):
        sink.commit(rows(1, 1), {"a": (3, 3)})
    with pytest.raises(ValueError):
        sink.commit(rows(1, 1), {"a": (3, 2)})
    assert not sink.exists()


@pytest.mark.parametrize("attempt", range(4))
def test_ensure_table_concurrent_creators_make_one_version(tmp_path: Path, attempt: int) -> None:
    # Without max_commit_retries=0 a losing creator often re-creates the table at version 1.
    uri = str(tmp_path / "t")
    sinks = [DeltaSink(uri) for _ in range(6)]
    created: dict[int, bool] = {}
    out = race(6, lambda i: created.__setitem__(i, sinks[i].ensure_table(SCHEMA)))
    assert out == {i: None for i in range(6)}
    assert sorted(created.values()) == [False] * 5 + [True]
    assert delta_version(uri) == 0  # no loser re-created the table at version 1
    assert DeltaSink(uri).ensure_table(SCHEMA) is False
    assert delta_version(uri) == 0


def test_read_returns_what_was_written(uri: str) -> None:
    sink = DeltaSink(uri, partition_by=["key"])
    sink.commit(rows(1, 3, "x", key="N1"), {"a": (0, 3)})
    sink.commit(rows(4, 2, "y", key="N2"), {"a": (3, 5)})
    assert DeltaTable(uri).metadata().partition_columns == ["key"]
    all_rows = sink.read().sort_by("seq")
    assert all_rows.select(SCHEMA.names).to_pylist() == (
        rows(1, 3, "x", key="N1").to_pylist() + rows(4, 2, "y", key="N2").to_pylist()
    )
    got = sink.read(columns=["seq", "tag"], filter=pc.field("key") == "N2")
    assert got.column_names == ["seq", "tag"]
    assert sorted(got.column("seq").to_pylist()) == [4, 5]
    # A reader sees commits made by others after its first read.
    other = DeltaSink(uri)
    other.commit(rows(6, 1, "z", key="N1"), {"b": (0, 1)})
    assert sink.read(filter=pc.field("tag") == "z").num_rows == 1


def test_nanosecond_timestamps_are_stored_as_microseconds(uri: str) -> None:
    recs = [Record(1, "a.b", b"x", 1_700_000_000_123_456_789), Record(2, "a.c", b"y", 5_000)]
    sink = DeltaSink(uri)
    sink.commit(records_to_arrow(recs), {"a": (0, 2)})
    assert DeltaTable(uri).protocol().reader_features is None  # no timestampNanos
    got = sink.read().sort_by("seq")
    assert got.schema.field("time").type == pa.timestamp("us", tz="UTC")
    assert got.column("time").cast(pa.int64()).to_pylist() == [1_700_000_000_123_456, 5]


def test_repr_hides_secrets() -> None:
    opts = DeltaSink.s3_options("http://127.0.0.1:9", "AKIAEXAMPLEKEYID", "s3cr3t-VALUE-xyz",
                                allow_http=True)
    opts["AWS_SESSION_TOKEN"] = "tok-SESSION-123"
    sink = DeltaSink("s3://bucket/path", storage_options=opts)
    text = repr(sink) + str(sink)
    for secret in ("AKIAEXAMPLEKEYID", "s3cr3t-VALUE-xyz", "tok-SESSION-123"):
        assert secret not in text
    assert "http://127.0.0.1:9" in text and "s3://bucket/path" in text and "***" in text
    assert "user:pw" not in repr(DeltaSink("s3://user:pw@bucket/p"))


def test_errors_are_scrubbed_of_secrets(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = DeltaSink(uri, storage_options={"AWS_SECRET_ACCESS_KEY": "very-secret-1"})

    def boom() -> None:
        raise OSError("request signed with very-secret-1 failed")

    monkeypatch.setattr(sink._handle, "load", boom)
    with pytest.raises(OSError) as ei:
        sink.watermark("a")
    assert "very-secret-1" not in str(ei.value) and "***" in str(ei.value)
    assert ei.value.__cause__ is None and ei.value.__suppress_context__


def test_s3_options() -> None:
    assert DeltaSink.s3_options(None, None, None) == {"AWS_REGION": "us-east-1"}
    opts = DeltaSink.s3_options("http://h:1", "id", "sec", region="eu-west-1", allow_http=True)
    assert opts == {
        "AWS_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://h:1", "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "sec", "AWS_ALLOW_HTTP": "true",
    }
    assert not any("UNSAFE" in k or "LOCKING" in k for k in opts)
    with pytest.raises(ValueError, match="allow_http"):
        DeltaSink.s3_options("http://h:1", None, None)


def test_watermarks_survive_checkpoints(uri: str) -> None:
    sink = DeltaSink(uri, checkpoint_interval=3)
    wm = sink.watermark("a")
    for _ in range(7):
        sink.commit(rows(wm + 1, 1), {"a": (wm, wm + 1)})
        wm += 1
    sink.commit(None, {"b": (0, 4)})
    assert DeltaTable(uri).metadata().configuration["delta.checkpointInterval"] == "3"
    assert (Path(uri) / "_delta_log" / "_last_checkpoint").exists()
    fresh = DeltaSink(uri)
    assert (fresh.watermark("a"), fresh.watermark("b")) == (7, 4)
    with pytest.raises(FenceConflictError):
        fresh.commit(None, {"a": (6, 9)})
    fresh.commit(None, {"a": (7, 9)})
    assert DeltaSink(uri).watermark("a") == 9


def test_concurrent_reads_and_commits_on_one_sink(uri: str) -> None:
    sink = DeltaSink(uri)
    sink.commit(rows(1, 1, key="0"), {"s/g/0": (0, 1)})

    def work(i: int) -> None:
        if i == 0:
            wm = sink.watermark("s/g/0")
            for _ in range(10):
                sink.commit(rows(wm + 1, 1, key="0"), {"s/g/0": (wm, wm + 1)})
                wm += 1
        else:
            seen = 0
            for _ in range(20):
                n = sink.read(filter=pc.field("key") == "0").num_rows
                assert n >= seen  # a reader never goes back in time
                seen = n

    assert race(4, work) == {i: None for i in range(4)}
    assert sink.read().num_rows == 11


def test_commit_decides_on_latest_snapshot_when_remembered_one_is_older(uri: str) -> None:
    # The caller learnt the watermark elsewhere (another sink object): not a fence conflict.
    old = DeltaSink(uri)
    assert old.watermark("a") == 0
    DeltaSink(uri).commit(rows(1, 2), {"a": (0, 2)})
    old.commit(rows(3, 1), {"a": (2, 3)})
    assert DeltaSink(uri).watermark("a") == 3
    with pytest.raises(FenceConflictError) as ei:
        old.commit(rows(4, 1), {"a": (2, 4)})
    assert ei.value.found == 3
