"""A partition run loads the table's snapshot once: its state reads (``last_rows`` with the
run's ``app_id``, as the engine calls it) and its upkeep use the snapshot its watermark read
loaded (and its own commits advanced), not a snapshot update of their own; each update lists
``_delta_log``, which on local disk costs in proportion to the log entries the retention keeps.
Exactness is checked against an independent reference, on local disk and moto S3; the loads are
counted by wrapping delta-rs' two snapshot entry points."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import FenceConflictError, app_id_for
from cg_pipelines.sinks.delta import DeltaSink, Maintenance

SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64()), ("_seq", pa.int64()),
                    ("_partition", pa.int32())])
COLS = ["k", "_seq", "v"]
KEYS = [f"k{i}" for i in range(30)]
NO_VACUUM = Maintenance(compact_min_files=4, vacuum_retention_hours=None, log_cleanup=False)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every fresh snapshot load and snapshot update made on the test's own thread, in order
    (the real calls run; a commit on another thread is not counted)."""
    seen: list[str] = []
    init, update = DeltaTable.__init__, DeltaTable.update_incremental

    def mine() -> bool:
        return threading.current_thread() is threading.main_thread()

    def counted_init(self: DeltaTable, *a: object, **kw: object) -> None:
        if mine():
            seen.append("load")
        init(self, *a, **kw)  # type: ignore[arg-type]

    def counted_update(self: DeltaTable) -> None:
        if mine():
            seen.append("update")
        update(self)

    monkeypatch.setattr(DeltaTable, "__init__", counted_init)
    monkeypatch.setattr(DeltaTable, "update_incremental", counted_update)
    yield seen


def sink_at(where: tuple[str, dict[str, str]], write: Append | Merge | None = None
            ) -> DeltaSink:
    return DeltaSink(where[0], storage_options=where[1] or None, schema=SCHEMA, write=write,
                     maintenance=NO_VACUUM)


class Partitions:
    """Random batches per partition, committed like a run (watermark, state read, commit,
    upkeep), with every row kept as the reference."""

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.rows: dict[int, list[pa.Table]] = {}
        self.seq: dict[int, int] = {}

    def batch(self, p: int, n: int = 12) -> pa.Table:
        first = self.seq.get(p, 0) + 1
        self.seq[p] = first + n - 1
        t = pa.table([[self.rnd.choice(KEYS) for _ in range(n)],
                      [self.rnd.randrange(1000) for _ in range(n)],
                      list(range(first, first + n)), [p] * n], schema=SCHEMA)
        self.rows.setdefault(p, []).append(t)
        return t

    def reference(self, p: int) -> pa.Table:
        return last_per_key(pa.concat_tables(self.rows[p]).select(COLS), "k", "_seq")


def state(sink: DeltaSink, p: int, app_id: str | None = None) -> pa.Table:
    return sink.last_rows("k", KEYS, COLS, "_seq", p, app_id=app_id)


def run(sink: DeltaSink, parts: Partitions, p: int, loads: list[str]
        ) -> tuple[list[str], bool]:
    """One run's sink calls (watermark, state read, commit, upkeep); returns the snapshot
    loads and updates of its state read and its upkeep, and whether the upkeep compacted."""
    app = app_id_for("S", "g", p)
    watermark = sink.watermark(app)
    assert watermark == parts.seq.get(p, 0)
    before = len(loads)
    if p in parts.rows:
        assert state(sink, p, app).equals(parts.reference(p))
    counted = loads[before:]
    sink.commit(parts.batch(p), {app: (watermark, parts.seq[p])})
    before = len(loads)
    figures = sink.maintain(p, app)
    assert "error" not in figures, figures
    counted += loads[before:]
    assert state(sink, p).equals(parts.reference(p))
    return counted, figures["compact"] == "done"


@pytest.mark.parametrize("write", [Append(), Merge(key="k")], ids=["append", "merge"])
def test_a_run_reads_state_and_maintains_from_its_watermark_snapshot(
        where, loads, write) -> None:
    sink = sink_at(where, write)
    other = sink_at(where, write)  # another process committing other partitions meanwhile
    parts = Partitions(seed=3)
    plain: list[list[str]] = []
    compactions = 0
    for i in range(16):
        p = i % 2
        counted, compacted = run(sink, parts, p, loads)
        if compacted:  # a compaction commits against the latest version: it loads it
            compactions += 1
            assert "load" in counted
        else:
            plain.append(counted)
        for q in (2, 3):
            run(other, parts, q, loads)
    # the state reads and the upkeep of a run loaded nothing; before, each did a snapshot
    # update of its own
    assert plain and all(c == [] for c in plain), plain
    assert compactions >= (2 if isinstance(write, Append) else 0)
    # every partition's state and watermark, read by a fresh sink, equals the reference
    fresh = sink_at(where, write)
    for p in range(4):
        assert state(fresh, p).equals(parts.reference(p)), p
        assert fresh.watermark(app_id_for("S", "g", p)) == parts.seq[p]


def test_a_state_read_outside_a_run_reads_the_latest_version(where) -> None:
    """Without ``app_id``, or once the run is over (its upkeep ran), a state read brings the
    shared reader up to date: another process's commits of the partition are in it."""
    parts = Partitions(seed=4)
    writer, other = sink_at(where), sink_at(where)
    app = app_id_for("S", "g", 0)
    run(writer, parts, 0, [])
    run(other, parts, 0, [])  # commits partition 0 after writer's run
    assert state(writer, 0).equals(parts.reference(0))
    assert state(writer, 0, app).equals(parts.reference(0))  # writer's run is over


def test_state_reads_during_a_commit_neither_wait_nor_reload(where, loads) -> None:
    """The engine reads batch k+1's state while batch k commits: the reads are served from the
    run's view (taken before the commit) with no lock and no reload, and see the rows
    committed before the run's watermark read."""
    parts = Partitions(seed=6)
    sink = sink_at(where)
    app = app_id_for("S", "g", 0)
    run(sink, parts, 0, [])
    watermark = sink.watermark(app)
    before = parts.reference(0)
    assert state(sink, 0, app).equals(before)  # the run's first state read takes the view
    batch = parts.batch(0, n=2_000)
    counted = len(loads)
    committing = threading.Thread(
        target=sink.commit, args=(batch, {app: (watermark, parts.seq[0])}))
    committing.start()
    reads = 0
    while committing.is_alive() or reads == 0:
        assert state(sink, 0, app).equals(before)
        reads += 1
    committing.join()
    assert loads[counted:] == [], loads[counted:]  # the reads loaded nothing
    figures = sink.maintain(0, app)
    assert "error" not in figures, figures
    assert state(sink_at(where), 0).equals(parts.reference(0))


def test_a_stale_run_snapshot_never_commits(where) -> None:
    """A zombie whose lease moved on reads state from its run's snapshot, which misses the new
    holder's commits; its commit is then fenced, so the stale state is never written."""
    parts = Partitions(seed=5)
    zombie, holder = sink_at(where), sink_at(where)
    app = app_id_for("S", "g", 0)
    run(zombie, parts, 0, [])
    watermark = zombie.watermark(app)
    run(holder, parts, 0, [])  # the new holder commits after the zombie's watermark read
    stale = state(zombie, 0, app)
    assert not stale.equals(parts.reference(0))
    with pytest.raises(FenceConflictError):
        zombie.commit(parts.batch(0), {app: (watermark, parts.seq[0])})
    assert holder.watermark(app) == parts.seq[0] - 12
