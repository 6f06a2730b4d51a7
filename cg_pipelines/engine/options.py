"""How a partition run is tuned (:class:`EngineOptions`) and observed (:data:`Hook`), and the
error a run raises when it cannot run as configured (:class:`EngineConfigError`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from cg_pipelines.core.errors import CgError, ConfigError

__all__ = ["EngineConfigError", "EngineOptions", "Hook"]

Hook = Callable[[str, dict[str, Any]], None]
"""``hook(step, info)``: called after each step (``"leased"``, ``"read"``, ``"processed"``,
``"committed"``, ``"purged"``, ``"acked"``) with ``first_seq``/``last_seq`` (``"committed"``
also with the run's totals so far: ``processed`` and ``dead_lettered`` messages, ``left``
(the backlog seen at the start less what was handled) and ``seconds`` since the start), and
``"retry"``
(``step``, ``attempt``, ``error``) after each failed attempt of a NATS step that will be
retried; used by fault-injection tests and progress reporting. It runs on the event loop: keep
it short."""


class EngineConfigError(CgError, RuntimeError):
    """The partition cannot be run as configured (e.g. the lease consumer exists with another
    config, or streaming member consumers already hold the partition's subjects)."""


class WorkQueueLossError(CgError, RuntimeError):
    """A purge of what a run committed removed more messages than the run read: the work
    queue held messages of the partition that the server's read or lease skipped, and they
    left it uncommitted. The engine purges a partition below the last sequence it committed
    (one request per batch) and checks the count the server returns against the messages it
    read; this is raised when the server's count is higher (seen with nats-server 2.15.1 after
    it logged "Stream state encountered internal inconsistency", ``notes/RANGE_RUNS.md`` §10).

    The commit stands and nothing later is processed by this run; the lost messages are still
    in the origin stream: rebuild the partition (a backfill of its partition key) to recompute
    it from there.

    Attributes:
        read_stream: the work queue; ``partition`` the group partition (None: a purge of
            several partitions at once); ``below`` the purge's sequence (messages below it);
        read: messages the run read below ``below``; ``purged``: messages the server removed.
    """

    def __init__(self, read_stream: str, partition: int | None, below: int, read: int,
                 purged: int) -> None:
        self.read_stream, self.partition, self.below = read_stream, partition, below
        self.read, self.purged = read, purged
        where = f"partition {partition}" if partition is not None else "the partitions read"
        super().__init__(
            f"nats-server removed {purged - read} message(s) of {where} of {read_stream} below "
            f"sequence {below} that no read of this run returned ({purged} purged, {read} "
            f"read and committed): they left the work queue uncommitted. They are still in "
            f"the origin stream: rebuild the partition (a backfill of its partition key) to "
            f"recompute it. A server-side skip (notes/RANGE_RUNS.md §10), not a data error")


@dataclass(frozen=True)
class EngineOptions:
    """Tuning of one partition run.

    Attributes:
        batch_max_msgs: messages per batch (one commit each); with ``adaptive_max_msgs`` the
            first and smallest batch size.
        adaptive_max_msgs: when set, batches grow up to this many messages while the
            processor's fixed cost per batch is more than a fifth of its time
            (:func:`~cg_pipelines.core.batching.next_batch_size`; a Spark transform's fixed
            cost is about a second); ``None``: every batch is ``batch_max_msgs``.
        batch_max_bytes: most payload bytes per batch (at least one message is taken).
        read_chunk: messages per pull when a rebuild replays the origin stream (a drain reads
            each batch with one request).
        ack_wait_s: the lease consumer's ack wait (seconds); the lease is renewed every third.
        priority_timeout_s: seconds without a pull after which the server unpins a holder.
        hold_wait_s: seconds to wait for the pin when another instance holds the partition.
        max_messages: stop after about this many messages (``None``: drain the backlog).
        max_seconds: stop starting new batches after this many seconds.
        dead_letter_policy: ``"dlq"`` (dead-letter and go on) or ``"halt"`` (commit what is
            before the bad message, stop there).
        timeout_s: seconds allowed for each NATS request.
        nats_retry_max_s: seconds a NATS step is retried while NATS is unreachable (connection
            lost, server restarting, JetStream unavailable) before the run fails with
            :class:`~cg_pipelines.engine.retry.NatsUnavailableError`.
        nats_retry_backoff_s, nats_retry_max_backoff_s: first and largest pause between NATS
            retries (seconds; doubling). Not the Dagster sensor's retry of a failed run
            (``PartitionRunsResource.retry_backoff_s``, 15 s).
        executor_read_min_msgs: messages. When set, and the processor implements
            :class:`~cg_pipelines.engine.executor_read.RangeProcessor` (``process_range``, e.g.
            :class:`~cg_pipelines.spark.SparkProcessor`), a partition whose remaining backlog
            at a batch boundary is at least this many messages is processed as ONE batch:
            the rest of the range up to the run's start is read, decoded and transformed on
            the Spark executors (the payloads never pass through the driver on the way in),
            then committed once (fenced), dead-lettered, purged and acked on the driver as any
            batch. The remaining backlog is the partition's pending messages when the run
            started less those handled since. Not used under ``dead_letter_policy="halt"``,
            when the backlog is over what ``max_messages`` still allows, when the
            connection uses TLS and the processor's ``read_options`` name no ``tls_ca``, or
            when its credentials cannot be shipped to the executors (a connection neither made
            by :meth:`ConnectOptions.connect
            <cg_pipelines.jetstream.connect.ConnectOptions.connect>` nor run with its
            ``ConnectOptions``, see :func:`~cg_pipelines.engine.runner.run_partition`, whose
            credentials nats-py does not show: a creds file, an NKey seed).
            ``batch_max_msgs``/``batch_max_bytes`` do not bound that batch: the driver holds
            its output rows. ``None`` (default): off (bench/spark_read.py measures the
            crossover; on 2 local cores the driver read wins at every size).
        dlq_max_age_s: seconds the group's dead-letter stream keeps a dead letter (its
            ``max_age``; default 30 days; ``None``: for ever). An existing stream is updated.
        settle_interval_s: seconds. A committed batch is settled (its messages purged from
            the work queue, the lease acknowledged and the next one taken) at once when the
            run's last settle is at least this long ago, else together with the batches
            committed after it, and always before the run leaves its batch loop. nats-server
            takes about as long for a purge of 5,000 messages as for one of 50,000 (a work
            queue's interior purge costs per call, not per message: ``bench/range_runs.py``,
            ``notes/RANGE_RUNS.md`` §13), so fewer purges make a run faster. Nothing is
            acknowledged before its commit either way; a run that stops in between leaves
            committed messages in the work queue, which the partition's next run purges
            unread (step 1, below its watermark). ``0``: settle after every commit. Never
            more than a sixth of ``priority_timeout_s`` (:meth:`settle_after_s`): the lease
            held meanwhile then needs no more keep-alive pulls than a batch's.

    Raises:
        ConfigError: a field out of range (the message names it: ``"<field>: <rule>"``).
    """

    batch_max_msgs: int = 20_000
    adaptive_max_msgs: int | None = None
    batch_max_bytes: int = 64 * 1024 * 1024
    read_chunk: int = 2_000
    ack_wait_s: float = 30.0
    priority_timeout_s: float = 30.0
    hold_wait_s: float = 5.0
    max_messages: int | None = None
    max_seconds: float | None = None
    dead_letter_policy: Literal["dlq", "halt"] = "dlq"
    timeout_s: float = 5.0
    nats_retry_max_s: float = 30.0
    nats_retry_backoff_s: float = 0.1
    nats_retry_max_backoff_s: float = 3.0
    executor_read_min_msgs: int | None = None
    dlq_max_age_s: float | None = 30 * 24 * 3600.0
    settle_interval_s: float = 1.0

    def settle_after_s(self) -> float:
        """Seconds after a run's last settle from which a commit is settled at once:
        ``settle_interval_s``, at most a sixth of ``priority_timeout_s`` (the lease's pin
        keep-alive pulls every third of it)."""
        return min(self.settle_interval_s, self.priority_timeout_s / 6)

    def __post_init__(self) -> None:
        """Raises :class:`~cg_pipelines.core.errors.ConfigError` (a ``ValueError``) naming the
        first field out of range."""
        for name in ("batch_max_msgs", "batch_max_bytes", "read_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)!r}")
        for name in ("ack_wait_s", "priority_timeout_s", "hold_wait_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0 seconds, got {getattr(self, name)!r}")
        if self.nats_retry_max_s < 0:
            raise ConfigError("nats_retry_max_s", f"must be >= 0 seconds, got "
                              f"{self.nats_retry_max_s!r}")
        if not 0 < self.nats_retry_backoff_s <= self.nats_retry_max_backoff_s:
            raise ConfigError("nats_retry_backoff_s", f"need 0 < nats_retry_backoff_s <= "
                              f"nats_retry_max_backoff_s seconds, got "
                              f"{self.nats_retry_backoff_s!r} and "
                              f"{self.nats_retry_max_backoff_s!r}")
        if self.executor_read_min_msgs is not None and self.executor_read_min_msgs < 1:
            raise ConfigError("executor_read_min_msgs", f"must be >= 1 messages (or None: off), "
                              f"got {self.executor_read_min_msgs!r}")
        if self.dlq_max_age_s is not None and self.dlq_max_age_s <= 0:
            raise ConfigError("dlq_max_age_s", f"must be > 0 seconds (or None: keep for ever), "
                              f"got {self.dlq_max_age_s!r}")
        if not self.settle_interval_s >= 0:
            raise ConfigError("settle_interval_s", f"must be >= 0 seconds (0: after every "
                              f"commit), got {self.settle_interval_s!r}")
        if self.dead_letter_policy not in ("dlq", "halt"):
            raise ConfigError("dead_letter_policy", f"must be 'dlq' or 'halt', not "
                              f"{self.dead_letter_policy!r}")
