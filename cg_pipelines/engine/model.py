"""Data shapes of the ordered partition engine: records, processing results, run results.

Units: sequences are work-queue stream sequences (``int``, first is 1); ``time_ns`` is the
publish time in nanoseconds since the Unix epoch; durations are seconds (``float``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import pyarrow as pa

RECORD_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("subject", pa.string(), nullable=False),
        pa.field("time", pa.timestamp("ns", tz="UTC"), nullable=False),
        pa.field("headers", pa.string()),
        pa.field("data", pa.binary(), nullable=False),
    ]
)
"""Arrow schema of a batch of records: ``headers`` is a JSON object string or null."""


@dataclass(frozen=True, slots=True)
class Record:
    """One message of a partition, as user code sees it.

    ``subject`` has the partition token stripped (the origin stream's subject); ``seq`` is the
    work-queue (or, for static groups, origin) stream sequence; ``headers`` are the user headers.
    """

    seq: int
    subject: str
    data: bytes
    time_ns: int
    headers: dict[str, str] | None = None


def records_to_arrow(records: Sequence[Record]) -> pa.Table:
    """A batch as an Arrow table with :data:`RECORD_SCHEMA` (in the given order)."""
    return pa.Table.from_arrays(
        [
            pa.array([r.seq for r in records], pa.int64()),
            pa.array([r.subject for r in records], pa.string()),
            pa.array([r.time_ns for r in records], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
            pa.array([json.dumps(r.headers) if r.headers else None for r in records], pa.string()),
            pa.array([r.data for r in records], pa.binary()),
        ],
        schema=RECORD_SCHEMA,
    )


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message the processing step could not handle, and why (one line)."""

    seq: int
    reason: str


@dataclass(slots=True)
class Processed:
    """Output of the processing step for one batch.

    ``table``: rows to commit (``None`` or empty when nothing to write); ``dead``: messages to
    dead-letter, by sequence. Every input sequence must be either reflected in ``table`` or
    listed in ``dead`` — the engine never drops one silently.
    """

    table: pa.Table | None
    dead: list[DeadLetter] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BatchContext:
    """What the processing step knows about the batch besides its records.

    ``app_id`` is the partition's watermark key in the sink (``<stream>/<group>/<partition>``);
    ``sink`` lets the step read committed per-key state (e.g. a key's previous event).
    """

    stream: str
    group: str
    partition: int
    app_id: str
    first_seq: int
    last_seq: int
    sink: Sink


class Processor(Protocol):
    """The processing step: turns a batch of records (in stream order) into rows to commit.

    It must be deterministic for the same records and committed state, so that a batch
    re-processed after a crash or fence conflict gives the same effect.
    """

    def process(self, records: Sequence[Record], ctx: BatchContext) -> Processed: ...


class FenceConflictError(Exception):
    """A commit was refused because the partition's watermark moved since it was read
    (another holder committed first: this run is a zombie for that range)."""

    def __init__(self, app_id: str, expected: int, found: int | None) -> None:
        super().__init__(
            f"fence conflict on {app_id}: expected watermark {expected}, found "
            f"{'unknown (concurrent commit)' if found is None else found}"
        )
        self.app_id, self.expected, self.found = app_id, expected, found


class Sink(Protocol):
    """Where effects are committed, fenced by a per-partition watermark.

    ``watermark(app_id)``: the last committed sequence for ``app_id`` (0 if none), read from a
    fresh snapshot which later ``commit`` calls are fenced against.
    ``commit(table, app_id, version, expected)``: atomically append ``table`` and set the
    watermark to ``version``, only if it is still ``expected``; raises
    :class:`FenceConflictError` otherwise (nothing written).
    """

    def watermark(self, app_id: str) -> int: ...

    def commit(self, table: pa.Table | None, app_id: str, version: int, expected: int) -> None: ...


class PartitionHaltedError(Exception):
    """The ``halt`` policy stopped a partition at a message it could not process."""

    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(f"halted at sequence {seq}: {reason}")
        self.seq, self.reason = seq, reason


@dataclass(slots=True)
class RunResult:
    """Outcome of one partition run.

    ``status``: ``"drained"`` (backlog seen at start processed), ``"limit"`` (a message or time
    limit stopped it), ``"held"`` (another instance holds the partition; nothing done),
    ``"empty"`` (no backlog), ``"fenced"`` (a newer holder took over mid-run), ``"halted"``
    (the ``halt`` policy stopped at a bad message; see ``halted_at``). ``nats_retries`` counts
    NATS steps retried while NATS was unreachable.
    """

    stream: str
    group: str
    partition: int
    status: str = "empty"
    first_seq: int | None = None
    last_seq: int | None = None
    processed: int = 0
    dead_lettered: int = 0
    duplicates_skipped: int = 0
    commits: int = 0
    fence_conflicts: int = 0
    nats_retries: int = 0
    watermark: int = 0
    seconds: float = 0.0
    halted_at: int | None = None
    detail: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def messages_per_second(self) -> float:
        return self.processed / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        """A JSON-able dict (for metadata and logs), including ``messages_per_second``."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["messages_per_second"] = round(self.messages_per_second, 1)
        return d
