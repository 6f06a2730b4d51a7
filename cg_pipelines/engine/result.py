"""How a run ended: :class:`RunResult` (and its :data:`RunStatus`), what every engine entry
point returns (:func:`~cg_pipelines.engine.runner.run_partition`,
:func:`~cg_pipelines.engine.join.run_copartitioned`,
:func:`~cg_pipelines.engine.static.run_static_partition`,
:func:`~cg_pipelines.engine.rebuild.rebuild_partition`,
:func:`~cg_pipelines.engine.rebuild.rebuild_copartitioned`), with one :class:`SideResult` per
side of the run (a side: one partition of one group, with its lease and watermark).

Units: sequences are stream sequences (``int``, first is 1); durations are seconds (``float``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar, overload

__all__ = ["RunResult", "RunStatus", "SideResult"]

T = TypeVar("T")


RunStatus = Literal["drained", "limit", "held", "empty", "fenced", "halted", "handed_over",
                    "rebuilt"]
"""How a run ended (see :class:`RunResult`)."""


@dataclass(slots=True)
class SideResult:
    """What a run did on one side: partition ``partition`` of group ``group`` of ``stream``.

    ``first_seq``/``last_seq``: the first and last **work-queue** sequence the run committed
    for the side (``None``: none, as in a rebuild, which reads the origin stream only);
    ``processed``: its messages committed as rows; ``dead_lettered``; ``duplicates_skipped``
    (leases at or below the watermark, committed by an earlier run); ``watermark``: the
    committed watermark last read or written; ``halted_at``: the sequence the ``halt`` policy
    stopped at; ``nats_retries``: NATS steps retried while NATS was unreachable; ``repins``:
    times the side's pin was gone with no other holder and the run pinned itself again; a
    rebuild's ``messages_read`` (origin messages read) and origin range ``origin_first_seq``
    .. ``origin_last_seq``.

    ``status`` and ``detail``: how this side ended, in a run whose sides end on their own (a
    run over several partitions of one group, :func:`~cg_pipelines.engine.runner.
    run_partitions`: ``"held"`` for a partition another run holds, ``"empty"``, ``"drained"``,
    ``"limit"``, ``"handed_over"``; a side the run stopped with carries the run's
    ``"fenced"``/``"halted"``); ``None`` and ``""`` in a run whose sides end together (one
    partition, co-partitioned inputs): read :attr:`RunResult.status` there.
    """

    stream: str
    group: str
    partition: int
    first_seq: int | None = None
    last_seq: int | None = None
    processed: int = 0
    dead_lettered: int = 0
    duplicates_skipped: int = 0
    watermark: int = 0
    halted_at: int | None = None
    nats_retries: int = 0
    repins: int = 0
    messages_read: int = 0
    origin_first_seq: int | None = None
    origin_last_seq: int | None = None
    status: RunStatus | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        """A JSON-able dict of the fields."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def lineage(self, *, rebuild: bool = False, rows_replaced: int = 0) -> dict[str, int | str]:
        """The side's row of a run's reported lineage, the same for every orchestrator
        (Dagster's materialization, Airflow's asset event): ``stream``, ``group``,
        ``first_seq``/``last_seq`` (work-queue sequences, 0 for none), ``messages``,
        ``dead_lettered``, ``watermark``; a rebuild adds its origin range
        ``origin_first_seq``/``origin_last_seq`` (0 for none), ``messages_read`` and the run's
        ``rows_replaced``."""
        row: dict[str, int | str] = {
            "stream": self.stream, "group": self.group, "first_seq": self.first_seq or 0,
            "last_seq": self.last_seq or 0, "messages": self.processed,
            "dead_lettered": self.dead_lettered, "watermark": self.watermark}
        if rebuild:
            row.update({"origin_first_seq": self.origin_first_seq or 0,
                        "origin_last_seq": self.origin_last_seq or 0,
                        "messages_read": self.messages_read, "rows_replaced": rows_replaced})
        return row


class _FirstSide(Generic[T]):
    """A :class:`RunResult` attribute read from its first side's :class:`SideResult`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _FirstSide[T]: ...

    @overload
    def __get__(self, obj: RunResult, owner: type | None = None) -> T: ...

    def __get__(self, obj: RunResult | None, owner: type | None = None
                ) -> T | _FirstSide[T]:
        if obj is None:
            return self
        value: T = getattr(next(iter(obj.inputs.values())), self.name)
        return value


class _AllSides:
    """A :class:`RunResult` count summed over its sides' :class:`SideResult`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _AllSides: ...

    @overload
    def __get__(self, obj: RunResult, owner: type | None = None) -> int: ...

    def __get__(self, obj: RunResult | None, owner: type | None = None) -> int | _AllSides:
        if obj is None:
            return self
        total: int = sum(getattr(s, self.name) for s in obj.inputs.values())
        return total


@dataclass(slots=True)
class RunResult:
    """Outcome of one run over one side (a partition run) or several (a co-partitioned run).

    ``status``: ``"drained"`` (backlog seen at start processed), ``"limit"`` (a message or time
    limit stopped it), ``"held"`` (another instance holds a side's partition; nothing done),
    ``"empty"`` (no backlog), ``"fenced"`` (a newer holder took over mid-run), ``"halted"``
    (the ``halt`` policy stopped at a bad message; see ``halted_at``), ``handed_over`` (the
    server names another instance as a side's pinned holder), ``rebuilt`` (a rebuild replaced
    the partition's rows: ``rows_replaced`` by ``rows_written``).
    ``inputs``: each side's :class:`SideResult`, by side name (a co-partitioned run's input
    names; for a partition run the one side is named by its app id
    ``<stream>/<group>/<partition>``), in the run's order: the first side's watermark key is
    the one the commits are recorded under.
    ``commits``: commits made (each moved every side's watermark that had messages);
    ``fence_conflicts``: commits refused by the fence; ``rows_written``: output rows committed
    (a rebuild: the rows left in the partition); ``maintenance``: the figures of the sink's
    ``maintain`` hook (:class:`~cg_pipelines.sinks.base.MaintainedSink`) when it ran.

    The one-input attributes (``stream``, ``group``, ``partition``, ``first_seq``,
    ``last_seq``, ``watermark``, ``halted_at``, ``origin_first_seq``, ``origin_last_seq``)
    are the first side's; the counts (``processed``, ``dead_lettered``,
    ``duplicates_skipped``, ``nats_retries``, ``repins``, ``messages_read``) are summed over
    the sides. For a run over several sides read ``inputs`` for each.
    """

    inputs: dict[str, SideResult]
    status: RunStatus = "empty"
    commits: int = 0
    fence_conflicts: int = 0
    seconds: float = 0.0
    rows_replaced: int = 0
    rows_written: int = 0
    detail: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    maintenance: dict[str, int | float | str] = field(default_factory=dict)

    stream = _FirstSide[str]()
    group = _FirstSide[str]()
    partition = _FirstSide[int]()
    first_seq = _FirstSide[int | None]()
    last_seq = _FirstSide[int | None]()
    watermark = _FirstSide[int]()
    origin_first_seq = _FirstSide[int | None]()
    origin_last_seq = _FirstSide[int | None]()
    processed = _AllSides()
    dead_lettered = _AllSides()
    duplicates_skipped = _AllSides()
    nats_retries = _AllSides()
    repins = _AllSides()
    messages_read = _AllSides()

    @property
    def halted_at(self) -> int | None:
        """The sequence a ``halt`` stopped at (the first halted side's), or None."""
        return next((s.halted_at for s in self.inputs.values() if s.halted_at is not None),
                    None)

    @property
    def messages_per_second(self) -> float:
        """``processed`` per second of the run (0.0 for a run of no time)."""
        return self.processed / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        """A JSON-able dict (for metadata and logs): the one-input attributes, the run's
        fields, ``messages_per_second`` and ``inputs`` (each side's :meth:`SideResult.as_dict`
        by name)."""
        d: dict[str, object] = {k: getattr(self, k) for k in _FLAT}
        d.update({k: getattr(self, k) for k in self.__dataclass_fields__ if k != "inputs"})
        d["messages_per_second"] = round(self.messages_per_second, 1)
        d["inputs"] = {n: s.as_dict() for n, s in self.inputs.items()}
        return d


_FLAT = ("stream", "group", "partition", "first_seq", "last_seq", "processed", "dead_lettered",
         "duplicates_skipped", "nats_retries", "repins", "watermark", "halted_at",
         "messages_read", "origin_first_seq", "origin_last_seq")
