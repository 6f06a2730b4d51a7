"""How a partition run ended: :class:`RunResult` (and its :data:`RunStatus`), what
:func:`~cg_pipelines.engine.runner.run_partition`,
:func:`~cg_pipelines.engine.static.run_static_partition` and
:func:`~cg_pipelines.engine.rebuild.rebuild_partition` return.

Units: sequences are stream sequences (``int``, first is 1); durations are seconds (``float``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["RunResult", "RunStatus"]


RunStatus = Literal["drained", "limit", "held", "empty", "fenced", "halted", "handed_over",
                    "rebuilt"]
"""How a partition run ended (see :class:`RunResult`)."""


@dataclass(slots=True)
class RunResult:
    """Outcome of one partition run.

    ``status``: ``"drained"`` (backlog seen at start processed), ``"limit"`` (a message or time
    limit stopped it), ``"held"`` (another instance holds the partition; nothing done),
    ``"empty"`` (no backlog), ``"fenced"`` (a newer holder took over mid-run), ``"halted"``
    (the ``halt`` policy stopped at a bad message; see ``halted_at``), ``handed_over`` (the
    server names another instance as the partition's pinned holder), ``rebuilt`` (a rebuild
    replaced the partition's rows: ``messages_read`` origin messages read, ``rows_replaced``
    by ``rows_written``, from origin sequence ``origin_first_seq`` through ``origin_last_seq``).
    ``first_seq``/``last_seq``: the first and last **work-queue** sequence the run handled
    (``None``: none, as in a rebuild, which reads the origin stream only).
    ``nats_retries`` counts NATS steps retried while NATS was unreachable; ``repins`` counts
    times the run's pin was gone with no other holder (a restarted server forgets pins) and
    the run pinned itself again. ``maintenance``: the figures of the sink's ``maintain``
    hook (:class:`~cg_pipelines.sinks.base.MaintainedSink`) when it ran (empty otherwise).
    """

    stream: str
    group: str
    partition: int
    status: RunStatus = "empty"
    first_seq: int | None = None
    last_seq: int | None = None
    processed: int = 0
    dead_lettered: int = 0
    duplicates_skipped: int = 0
    commits: int = 0
    fence_conflicts: int = 0
    nats_retries: int = 0
    repins: int = 0
    watermark: int = 0
    seconds: float = 0.0
    halted_at: int | None = None
    messages_read: int = 0
    rows_replaced: int = 0
    rows_written: int = 0
    origin_first_seq: int | None = None
    origin_last_seq: int | None = None
    detail: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    maintenance: dict[str, int | float | str] = field(default_factory=dict)

    @property
    def messages_per_second(self) -> float:
        """``processed`` per second of the run (0.0 for a run of no time)."""
        return self.processed / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        """A JSON-able dict (for metadata and logs), including ``messages_per_second``."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["messages_per_second"] = round(self.messages_per_second, 1)
        return d
