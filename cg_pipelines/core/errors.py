"""The library's error family: :class:`CgError`, the general kinds every layer raises, and the
errors of the pure core (no I/O).

Every exception the library raises on purpose is a :class:`CgError` and keeps its standard
base, so ``except ValueError`` (or ``KeyError``, ``RuntimeError``...) keeps working. The whole
family, by layer:

- general kinds (here): :class:`ConfigError`, :class:`UsageError`, :class:`DecodeError`,
  :class:`ContractError` (``ValueError``); :class:`ColumnNotFoundError` (``KeyError``);
  :class:`WrongTypeError` (``TypeError``); :class:`StateError`, :class:`InvariantError`
  (``RuntimeError``);
- groups (here): :class:`GroupNotFoundError`, :class:`GroupExistsError`,
  :class:`MembershipError`, :class:`ConcurrentUpdateError`, :class:`MigrationError` (a
  migration to a new partition count that must be run again to finish); a failed partition
  run's facts: :class:`PartitionRunError`;
- core: ``OutputContractError`` (a :class:`ContractError`), ``CursorError`` (a sensor cursor
  that does not decode; a :class:`DecodeError`), ``BadMessage`` (a payload a transform cannot
  decode; dead-lettered), ``CoPartitionError`` (a :class:`ConfigError`: groups declared as
  a co-partitioned set that cannot be shown to partition alike);
- JetStream: ``JetStreamError`` and one subclass per server error it tells apart
  (``StreamNotFoundError``, ``ConsumerNotFoundError``, ``ConsumerAlreadyExistsError``,
  ``WorkQueueConsumerNotUniqueError``, ``NoMessageFoundError``, ``NotPinnedError``,
  ``JetStreamUnavailableError``, ``RequestTimeoutError``, ``StaleReplicaError``,
  ``PublishError``); a run heartbeat not stored: ``HeartbeatError``;
  connections: ``NatsConnectError``, ``NatsAuthError``, ``NatsTLSError``;
- engine and sinks: ``FenceConflictError``, ``EngineConfigError``, ``NatsUnavailableError``,
  ``RebuildError``, ``CoverageLogError``, ``WorkQueueLossError`` (a purge removed messages no
  read returned: a server-side skip, named loudly);
- Spark and local servers: ``JavaNotFoundError``, ``NatsServerError``,
  ``NatsServerNotFoundError``, ``NatsServerStartError``, ``NatsClusterError``,
  ``PostgresServerError``.

``tests/unit/test_raise_walk.py`` walks every ``raise`` of the package and lists, with a reason
each, the few foreign exceptions raised on purpose (Dagster's ``Failure``, ``SystemExit`` in
the CLI, a table library's own "no table" error...); ``tests/unit/test_error_family.py`` checks
that every exception class the package defines is named in this list.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class CgError(Exception):
    """The base of every exception this library raises on purpose: ``except CgError`` catches
    them all (each also keeps its standard base, e.g. ``ValueError`` for bad input)."""


class ConfigError(CgError, ValueError):
    """An invalid configuration: a consumer group's config, or a field of an options object
    (``EngineOptions``, ``MemberConfig``, ``Maintenance``, ``RetryPolicy``, a Dagster spec).

    Attributes:
        field: the configuration field at fault (e.g. ``"member_mappings"``), using the
            reference JSON field names.
        rule: the rule broken, in words.

    ``str(err)`` is ``"<field>: <rule>"``, a one-line message fit for a CLI error.
    """

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class GroupNotFoundError(CgError, LookupError):
    """No config for ``<stream>.<group>`` in the kind's KV bucket (or no bucket at all)."""

    def __init__(self, kind: str, stream: str, group: str, why: str = "not found") -> None:
        super().__init__(f"{kind} consumer group {group!r} on stream {stream!r}: {why}")
        self.kind, self.stream, self.group = kind, stream, group


class GroupExistsError(CgError, ValueError):
    """A create found an existing group whose config differs from the requested one."""


class MembershipError(CgError, ValueError):
    """A membership change that the group's config does not allow (e.g. adding members to a
    group that uses member mappings)."""


class ConcurrentUpdateError(CgError, RuntimeError):
    """A compare-and-set config update kept losing to concurrent writers and gave up."""


class UsageError(CgError, ValueError):
    """A call got an argument it cannot take: out of range (``partition must be >= 0``),
    missing, or in conflict with another (``purge takes seq or keep, not both``). The
    caller's mistake, fixed by changing the call; the message names the argument."""


class WrongTypeError(CgError, TypeError):
    """A call got an object of a type it cannot use (a resource that is not a Spark
    resource, an input annotated with a type an IO manager cannot load)."""


class ColumnNotFoundError(CgError, KeyError):
    """A column the call needs is not in the table or batch; the message names it and the
    columns there are."""


class DecodeError(CgError, ValueError):
    """Stored or wire data that cannot be decoded: a sensor cursor, an encoded coverage, an
    RFC 3339 time stamp, a direct-get header block or control line, a subject without its
    partition token, a JSON constant Go rejects. The message names the format and shows (the
    start of) the input. Messages whose payload a transform cannot decode are
    :class:`~cg_pipelines.core.decode.BadMessage` instead (dead-lettered, not raised to the
    caller)."""


class ContractError(CgError, ValueError):
    """A user's processor, transform or sink broke its contract with the engine: it returned
    rows, sequences or dead letters for messages it was not given, rows of another partition,
    or an output without the columns its write mode needs. A bug in that code, not in the data;
    nothing of the batch is committed. (A missing or mistyped output column is the subclass
    :class:`~cg_pipelines.core.contract.OutputContractError`.)"""


class InvariantError(CgError, RuntimeError):
    """A check the library makes on its own work failed: re-processing a batch gave other
    dead letters (a processor that is not deterministic), a decode step lost or doubled a
    message, a state read did not find the files the table's log lists, a warm-up job returned
    the wrong row count. Nothing is committed past the failure."""


class StateError(CgError, RuntimeError):
    """An object or process is not in the state the call needs: a helper used before it was
    started (or started twice), a local server or Spark process that exited or did not come up,
    a SparkSession that is missing or stopped, a processor run outside the engine that needs
    the engine's state reader."""


class MigrationError(CgError, RuntimeError):
    """A step of a group's migration to a new partition count cannot finish now (the work
    queue is not drained yet, the new source has stored no message yet, or the exact cut
    cannot be read): nothing is lost, the migration stays at its last recorded step and
    running it again resumes there (:mod:`cg_pipelines.jetstream.migration`)."""


CAUSE_CHARS = 1000
"""The most characters of a cause's text (``<type>: <message>`` on one line) that a
:class:`PartitionRunError` description, a Dagster failure or a check carries (longer ones end
in ``…``)."""

_ATTR = "partition_run_error"


def exception_chain(error: BaseException, depth: int = 10) -> Iterator[BaseException]:
    """``error``, then the exception it was raised from or during (``__cause__``, else
    ``__context__``), and so on: at most ``depth`` exceptions (a bound against cycles)."""
    seen: BaseException | None = error
    for _ in range(depth):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def one_line(text: str, limit: int = CAUSE_CHARS) -> str:
    """``text`` with every run of whitespace made one space, cut to ``limit`` characters (the
    last one ``…`` when cut)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:max(0, limit - 1)] + "…"


def cause_text(error: BaseException, limit: int = CAUSE_CHARS) -> str:
    """``"<ExceptionType>: <message>"`` on one line, at most ``limit`` characters (just the type
    when the message is empty)."""
    msg = str(error)
    return one_line(f"{type(error).__name__}: {msg}" if msg.strip() else type(error).__name__,
                    limit)


class PartitionRunError(CgError, RuntimeError):
    """What a failed partition run had done when it failed, and why it failed.

    The engine (``run_partition``, ``run_static_partition``, ``rebuild_partition``) re-raises
    the original exception unchanged — ``except EngineConfigError`` and the like keep
    working — with one of these attached; :meth:`of` returns it. The Dagster asset raises its
    ``Failure`` from the cause and builds the description from :meth:`description`.

    Attributes:
        cause: the exception the run failed with (the user's transform error, a sink or NATS
            error); also ``__cause__``.
        stream: the group's origin stream; ``group`` its name.
        read_stream: the stream the run read and leased on (an elastic group's work queue
            ``<stream>-<group>``; a static group's own stream).
        partition: the group partition.
        inflight: ``(first, last)`` stream sequences of the batch being processed when it
            failed, or None (no batch in flight).
        committed_through: the sink's committed watermark (a stream sequence) as last read or
            written by the run, or None when the run had not read it yet.
        acknowledged_through: the stream sequence the run had acknowledged/purged through
            (0: none).
        commits: sink commits made by this run.

    ``str(err)`` is :meth:`description`: the cause first (``<type>: <message>``, at most
    :data:`CAUSE_CHARS` characters), then, on a second line, the partition facts.
    """

    def __init__(self, cause: BaseException, *, stream: str, group: str, read_stream: str,
                 partition: int, inflight: tuple[int, int] | None,
                 committed_through: int | None, acknowledged_through: int,
                 commits: int) -> None:
        self.cause = cause
        self.stream, self.group, self.read_stream = stream, group, read_stream
        self.partition, self.inflight = partition, inflight
        self.committed_through = committed_through
        self.acknowledged_through = acknowledged_through
        self.commits = commits
        super().__init__(self.description())
        self.__cause__ = cause

    @property
    def cause_text(self) -> str:
        """The cause as ``"<type>: <message>"``, one line, at most :data:`CAUSE_CHARS`."""
        return cause_text(self.cause)

    def facts(self) -> str:
        """One line: the partition, the range in flight, what was committed and acknowledged,
        and that the partition was given back."""
        inflight = (f"sequences {self.inflight[0]}..{self.inflight[1]} in flight"
                    if self.inflight else "no batch in flight")
        committed = (f"committed through sequence {self.committed_through}"
                     if self.committed_through is not None
                     else "nothing read from the sink yet")
        return (f"partition {self.partition} of {self.read_stream}: run failed with "
                f"{inflight}; {committed}, acknowledged through "
                f"{self.acknowledged_through or 'none'} ({self.commits} commit(s) by this run); "
                "nothing later was committed or acknowledged, the partition was given back "
                "and the next run resumes from the committed watermark")

    def description(self) -> str:
        """The cause (one line), a newline, then :meth:`facts`."""
        return f"{self.cause_text}\n{self.facts()}"

    def attach(self) -> None:
        """Attach this error to its cause (``cause.partition_run_error``), unless one is
        attached already (the innermost run's facts win). Exceptions that refuse new
        attributes are left as they are."""
        if getattr(self.cause, _ATTR, None) is None:
            try:
                setattr(self.cause, _ATTR, self)
            except (AttributeError, TypeError):
                pass

    @staticmethod
    def of(error: BaseException) -> PartitionRunError | None:
        """The :class:`PartitionRunError` attached to ``error`` or to an exception it was
        raised from or during (``__cause__`` / ``__context__``, at most 10 deep); ``error``
        itself when it is one; else None."""
        for seen in exception_chain(error):
            if isinstance(seen, PartitionRunError):
                return seen
            got = getattr(seen, _ATTR, None)
            if isinstance(got, PartitionRunError):
                return got
        return None


def failure_report(error: BaseException, groups: str, partition: int
                   ) -> tuple[str, dict[str, Any]]:
    """The text and facts of a failed partition run, for any orchestrator: the text's first
    line is the cause (``<type>: <message>``), then the partition facts of the engine's
    :class:`PartitionRunError` (or that nothing was leased); ``groups`` names the inputs
    (``"<stream>.<group>, ..."``). The facts: ``partition``, ``cause_type``, ``cause``, and
    from a :class:`PartitionRunError` ``inflight_first_seq``/``inflight_last_seq``,
    ``committed_through``, ``acknowledged_through`` (stream sequences). Pure."""
    pre = PartitionRunError.of(error)
    facts: dict[str, Any] = {"partition": partition, "cause_type": type(error).__name__,
                             "cause": cause_text(error)}
    if pre is None:
        return (f"{cause_text(error)}\npartition {partition} of {groups}: the run failed "
                "before it leased anything; nothing was committed or acknowledged"), facts
    if pre.inflight is not None:
        facts["inflight_first_seq"], facts["inflight_last_seq"] = pre.inflight
    if pre.committed_through is not None:
        facts["committed_through"] = pre.committed_through
    facts["acknowledged_through"] = pre.acknowledged_through
    return pre.description(), facts


_PLUMBING = tuple(str(Path(str(m.__file__)).parent) + os.sep
                  for m in (asyncio, concurrent.futures)) + (
    threading.__file__, str(Path(__file__).parents[1]) + os.sep)


def trim_traceback(error: BaseException) -> BaseException:
    """``error`` with its traceback cut to the user's frames (outside ``asyncio``,
    ``concurrent.futures``, ``threading`` and this library; if none, outside the first
    three). Returns ``error``."""
    frames: list[types.TracebackType] = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    keep = [f for f in frames if not f.tb_frame.f_code.co_filename.startswith(_PLUMBING)]
    if not keep:
        keep = [f for f in frames
                if not f.tb_frame.f_code.co_filename.startswith(_PLUMBING[:-1])] or frames
    if len(keep) == len(frames):
        return error
    trimmed: types.TracebackType | None = None
    for f in reversed(keep):
        trimmed = types.TracebackType(trimmed, f.tb_frame, f.tb_lasti, f.tb_lineno)
    return error.with_traceback(trimmed)
