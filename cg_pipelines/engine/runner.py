"""The ordered partition engine: lease-and-range over an elastic group's work-queue stream.

Algorithm (DESIGN §5, the draining rule of seed 004):

1. **Lease.** A durable consumer per partition on ``<stream>-<group>`` (name
   ``partition-<p>``, filter ``<p>.>``, explicit ack, ``max_ack_pending=1``, priority group
   ``PCG`` with ``pinned_client``). Pulling one message pins this run; with one ack pending the
   server hands no other message of the partition to anyone.
2. **Range.** Read the backlog from the leased sequence on, in stream order, without consuming
   it (batched direct get, ``next_by_subj = "<p>.>"``), bounded by messages and bytes. The range
   starts after the committed watermark: anything at or below it is never processed again.
3. **Process.** The processing step turns the batch into rows (and dead letters).
4. **Commit, fenced.** One sink commit with the rows and the watermark (application
   transaction ``<stream>/<group>/<p>`` = last sequence), only if the watermark is still the
   one read in 2. A stale holder (a zombie) gets a fence conflict and stops.
5. **Acknowledge after commit.** Purge the partition below ``last + 1`` (dead letters were
   published before the commit), then ack the lease.

**Executor read** (opt-in, ``EngineOptions.executor_read_min_msgs``): when the processor can
process a whole sequence range on Spark executors (:class:`RangeProcessor`, e.g.
:class:`~cg_pipelines.spark.SparkProcessor`) and the partition's remaining backlog is at least
the threshold, steps 2-3 for the rest of the range up to the run's start are one batch read,
decoded and transformed on the executors (the ``jetstream`` data source); only the output rows
and the dead letters come to the driver, and steps 4-5 are the same single fenced commit,
purge and ack.

While a batch is processed, the lease is kept with ``+WPI`` (in progress) every third of the
ack wait. A run drains the backlog present when it started (new messages wait for the next
run), or stops at a message/time limit. A crash anywhere is safe: before the commit nothing is
visible; after it, the rerun sees the watermark and skips what is committed. Losing NATS
mid-run is retried with backoff (:mod:`cg_pipelines.engine.retry`), then fails the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import nats.errors
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from nats.aio.client import Client
from nats.aio.msg import Msg

from cg_pipelines.core.batching import CostModel, next_batch_size
from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.core.contract import check_output
from cg_pipelines.core.errors import CgError
from cg_pipelines.core.state import KeyedState
from cg_pipelines.engine.deadletter import ensure_dlq_stream, publish_dead_letters
from cg_pipelines.engine.model import (
    PARTITION_COLUMN,
    RECORD_SCHEMA,
    BatchContext,
    DeadLetter,
    FenceConflictError,
    Processed,
    Processor,
    RunResult,
    Sink,
    StateSink,
    origin_marker,
)
from cg_pipelines.engine.retry import Retrier
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.jetstream.api import JetStreamAPI, PullResult, consumer_config
from cg_pipelines.jetstream.errors import (
    ConsumerAlreadyExistsError,
    JetStreamUnavailableError,
    RequestTimeoutError,
    WorkQueueConsumerNotUniqueError,
)
from cg_pipelines.jetstream.leader import confirm_empty_range
from cg_pipelines.jetstream.rangeread import read_range

PRIORITY_GROUP = "PCG"
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
        retry_max_s: seconds a NATS step is retried while NATS is unreachable (connection lost,
            server restarting, JetStream unavailable) before the run fails with
            :class:`~cg_pipelines.engine.retry.NatsUnavailableError`.
        retry_backoff_s, retry_max_backoff_s: first and largest pause between retries
            (seconds; doubling).
        executor_read_min_msgs: messages. When set, and the processor implements
            :class:`RangeProcessor` (``process_range``, e.g.
            :class:`~cg_pipelines.spark.SparkProcessor`), a partition whose remaining backlog
            at a batch boundary is at least this many messages is processed as ONE batch:
            the rest of the range up to the run's start is read, decoded and transformed on
            the Spark executors (the payloads never pass through the driver on the way in),
            then committed once (fenced), dead-lettered, purged and acked on the driver as any
            batch. The remaining backlog is the partition's pending messages when the run
            started less those handled since. Not used under ``dead_letter_policy="halt"``,
            when the backlog is over what ``max_messages`` still allows, or when the
            connection's TLS context cannot be shipped to the executors (give the processor
            ``read_options`` with ``tls_ca``). ``batch_max_msgs``/``batch_max_bytes`` do not
            bound that batch: the driver holds its output rows. ``None`` (default): off
            (bench/spark_read.py measures the crossover; on 2 local cores the driver read
            wins at every size).
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
    retry_max_s: float = 30.0
    retry_backoff_s: float = 0.1
    retry_max_backoff_s: float = 3.0
    executor_read_min_msgs: int | None = None

    def __post_init__(self) -> None:
        if self.batch_max_msgs < 1 or self.batch_max_bytes < 1 or self.read_chunk < 1:
            raise ValueError("batch_max_msgs, batch_max_bytes and read_chunk must be >= 1")
        if self.ack_wait_s <= 0 or self.priority_timeout_s <= 0 or self.hold_wait_s <= 0:
            raise ValueError("ack_wait_s, priority_timeout_s and hold_wait_s must be > 0 seconds")
        if self.timeout_s <= 0 or self.retry_max_s < 0:
            raise ValueError("timeout_s must be > 0 and retry_max_s >= 0 seconds")
        if not 0 < self.retry_backoff_s <= self.retry_max_backoff_s:
            raise ValueError("need 0 < retry_backoff_s <= retry_max_backoff_s seconds")
        if self.executor_read_min_msgs is not None and self.executor_read_min_msgs < 1:
            raise ValueError("executor_read_min_msgs must be >= 1 messages (or None: off)")
        if self.dead_letter_policy not in ("dlq", "halt"):
            raise ValueError(f"dead_letter_policy must be 'dlq' or 'halt', not "
                             f"{self.dead_letter_policy!r}")


def lease_consumer_name(partition: int) -> str:
    """The partition's lease consumer on the work-queue stream: ``partition-<p>``."""
    return f"partition-{partition}"


def app_id_for(stream: str, group: str, partition: int) -> str:
    """The partition's watermark key in the sink: ``<stream>/<group>/<partition>``."""
    return f"{stream}/{group}/{partition}"


def lease_consumer_config(partition: int, options: EngineOptions) -> dict[str, Any]:
    """Wire config of the lease consumer; identical for every instance (required by
    action ``create``)."""
    return consumer_config(
        durable_name=lease_consumer_name(partition),
        filter_subjects=[f"{partition}.>"],
        ack_wait_s=options.ack_wait_s,
        max_ack_pending=1,
        priority_groups=[PRIORITY_GROUP],
        priority_policy="pinned_client",
        priority_timeout_s=options.priority_timeout_s,
        description="cg_pipelines lease-and-range partition lease",
    )


async def ensure_lease_consumer(
    api: JetStreamAPI, wq: str, partition: int, options: EngineOptions
) -> None:
    """Create the partition's lease consumer (idempotent). Raises :class:`EngineConfigError`."""
    try:
        await api.create_consumer(wq, lease_consumer_config(partition, options))
    except ConsumerAlreadyExistsError as e:
        raise EngineConfigError(
            f"lease consumer {lease_consumer_name(partition)} on {wq} exists with other "
            f"settings (ack wait / priority timeout): run every instance with the same engine "
            f"options, or delete the consumer while no run is active ({e})"
        ) from e
    except WorkQueueConsumerNotUniqueError as e:
        raise EngineConfigError(
            f"partition {partition} of {wq} is held by another consumer (streaming members?): "
            f"a group is consumed either by members or by partition runs, not both ({e})"
        ) from e


@dataclass
class _Lease:
    """Delivered, unacknowledged messages this run holds (one for the elastic lease)."""

    msgs: list[Msg]
    seq: int
    pin_id: str | None
    keeper: asyncio.Task[None] | None = field(default=None)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def msg(self) -> Msg:
        return self.msgs[0]


@dataclass
class RangeProcessed:
    """What :meth:`RangeProcessor.process_range` made of a sequence range read on the
    executors: the output and dead letters, and the range's facts the engine commits by.

    Attributes:
        processed: the rows to commit (``table``, ``None`` when no message decoded) and the
            dead letters (work-queue sequences, with their reasons).
        dead_records: the dead-lettered messages as
            :data:`~cg_pipelines.engine.model.RECORD_SCHEMA` rows (user headers only, partition
            token stripped from ``subject``): what the dead-letter stream stores.
        messages: messages read (rows decoded + dead letters).
        first_seq, last_seq: work-queue sequences of the first and last message read (``None``
            when nothing was read); ``last_seq`` becomes the watermark.
        last_origin_seq: origin stream sequence of the last message (the ``<app_id>@origin``
            marker), ``None`` when it has none.
        timings: seconds by step (e.g. ``read_executors``, ``process``), added to the run's.
    """

    processed: Processed
    dead_records: pa.Table
    messages: int
    first_seq: int | None
    last_seq: int | None
    last_origin_seq: int | None
    timings: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class RangeProcessor(Protocol):
    """A processor that can also process a whole sequence range read on the executors.

    ``process_range(source, ctx)``: ``source`` holds the options of the ``jetstream`` Spark data
    source (:mod:`cg_pipelines.spark.datasource`: ``servers``, ``stream`` (the work queue),
    ``subject`` (``<p>.>``), ``first_seq``, ``last_seq``, ``strip_partition``, ``timeout`` and
    the connection's credentials; never log it); ``ctx`` is the batch context with
    ``first_seq``/``last_seq`` the range's bounds. It must give, message for message, what
    ``process`` gives for the same messages in one batch (same rows, same dead letters and
    reasons, ``_seq`` the origin sequence). Optional ``read_options`` (a mapping) are extra
    source options (e.g. TLS files, which the engine cannot derive from its connection).
    """

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed: ...

    def process_range(self, source: Mapping[str, str], ctx: BatchContext) -> RangeProcessed: ...


@dataclass(frozen=True)
class _Span:
    """Facts of a batch whose records stayed on the executors: first and last work-queue
    sequence, origin sequence of the last message, messages."""

    first: int
    last: int
    last_origin: int | None
    messages: int


@dataclass
class _Prepared:
    """A processed batch waiting for its commit: ``records`` (only those before a bad message
    under ``halt``), ``processed``, ``halted`` (the bad message, or None), ``process_s``.
    An executor batch has ``span`` (its facts) and only its dead-lettered ``records``."""

    records: pa.Table
    processed: Processed
    halted: DeadLetter | None
    process_s: float
    span: _Span | None = None

    def facts(self) -> _Span:
        """First and last sequence, last origin sequence and size of the batch."""
        if self.span is not None:
            return self.span
        first, last = _bounds(self.records)
        return _Span(first, last, _last_origin_seq(self.records), self.records.num_rows)


class _PartitionRun:
    def __init__(
        self, nc: Client, stream: str, group: str, partition: int, processor: Processor,
        sink: Sink, options: EngineOptions, hook: Hook | None,
    ) -> None:
        self.nc, self.js = nc, nc.jetstream(timeout=options.timeout_s)
        self.stream, self.group, self.partition = stream, group, partition
        self.wq = work_queue_stream_name(stream, group)
        self.flt = f"{partition}.>"
        self.cname = lease_consumer_name(partition)
        self.app_id = app_id_for(stream, group, partition)
        self.processor, self.sink, self.opt = processor, sink, options
        self.hook = hook
        self.api = JetStreamAPI(nc, timeout=options.timeout_s)
        self.res = RunResult(stream, group, partition)
        self.t0 = time.monotonic()
        self._pending = 0  # the partition's backlog at start (consumer pending + ack pending)
        self._dense = False  # read ranges unfiltered (see _loop)
        self._pinned = False  # a lease (so the pin) was held at some point
        self._lease_now: _Lease | None = None  # the newest lease taken (nak'ed on failure)
        self._inflight: tuple[int, int] | None = None  # sequences being processed
        self._watermark_read = False  # res.watermark holds the sink's committed watermark
        self._settled_through = 0  # purged/acknowledged through this sequence
        self.state = _state_cache(processor, sink, partition)
        self.cost = getattr(processor, "cost_model", None) or CostModel()
        self.retry = Retrier(nc, options.retry_max_s, options.retry_backoff_s,
                             options.retry_max_backoff_s, f"partition {partition} of {self.wq}",
                             on_retry=self._on_retry)

    def _on_retry(self, step: str, attempt: int, exc: BaseException) -> None:
        self.res.nats_retries += 1
        self._step("retry", step=step, attempt=attempt, error=type(exc).__name__)

    async def _pull(self, step: str, **kw: Any) -> PullResult:
        """A pull request, retried while NATS is unreachable. A pull the server never
        answered (no message, no status) or answered 503 counts as unreachable."""
        async def once() -> PullResult:
            got = await self.api.pull(self.wq, self.cname, **kw)
            if not got.messages and got.status == 503:
                raise JetStreamUnavailableError(503, 0, got.description)
            if not got.messages and got.status is None:
                raise RequestTimeoutError(f"pull {self.wq} > {self.cname}",
                                          float(kw.get("expires_s") or 0) + self.opt.timeout_s)
            return got
        return await self.retry.call(step, once)

    async def _ack(self, lease: _Lease) -> None:
        """Acknowledge the lease (after its range was committed and purged), retried while
        NATS is unreachable. An ack whose reply is lost may have been applied, and a restarted
        server may have forgotten the delivery: both count as done once the consumer holds no
        unacknowledged message at or below the lease (the purge already removed the range)."""
        async def once() -> None:
            try:
                await lease.msg.ack_sync(timeout=self.opt.timeout_s)
            except nats.errors.MsgAlreadyAckdError:
                return
            except TimeoutError:
                info = await self.api.consumer_info(self.wq, self.cname)
                floor = int((info.get("ack_floor") or {}).get("stream_seq") or 0)
                if floor >= lease.seq or not info.get("num_ack_pending"):
                    return
                raise
        await self.retry.call("ack", once)

    def _step(self, name: str, **info: Any) -> None:
        if self.hook is not None:
            self.hook(name, info)

    def _timed(self, key: str, t: float) -> None:
        self.res.timings[key] = self.res.timings.get(key, 0.0) + (time.monotonic() - t)

    async def _ensure_consumer(self) -> None:
        await self.retry.call("create the lease consumer", lambda: ensure_lease_consumer(
            self.api, self.wq, self.partition, self.opt))

    async def run(self) -> RunResult:
        try:
            await self._ensure_consumer()
            await self._loop()
            await self._unpin()
        except BaseException as e:
            # Any failure (the transform's, the sink's, NATS', a cancellation) gives the
            # partition back on the way out, so a retry starts at once instead of finding it
            # "held" until the ack wait / pin timeout.
            await self._give_back()
            if isinstance(e, Exception):
                e.add_note(self.failure_summary(e))
            raise
        finally:
            await self.api.close()
            self.res.seconds = time.monotonic() - self.t0
        return self.res

    def failure_summary(self, error: BaseException) -> str:
        """One line for a failed run: the partition, the sequence range in flight, and what
        was committed and acknowledged (so an operator knows nothing was lost)."""
        res = self.res
        inflight = (f"sequences {self._inflight[0]}..{self._inflight[1]} in flight"
                    if self._inflight else "no batch in flight")
        committed = (f"committed through sequence {res.watermark}" if self._watermark_read
                     else "nothing read from the sink yet")
        return (f"partition {self.partition} of {self.wq}: run failed "
                f"({type(error).__name__}) with {inflight}; {committed}, acknowledged through "
                f"{self._settled_through or 'none'} ({res.commits} commit(s) by this run); "
                "nothing later was committed or acknowledged, the partition was given back "
                "and the next run resumes from the committed watermark")

    async def _give_back(self) -> None:
        """After a failure: nak the messages of the lease still held (so they are delivered
        again at once, not after the ack wait) and unpin. Best effort and bounded: with NATS
        gone the ack wait and pin timeout do the same later."""
        lease = self._lease_now
        if lease is not None:
            await self._release(lease)
            for msg in lease.msgs:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(msg.nak(), self.opt.timeout_s)
        if self._pinned:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.api.unpin(self.wq, self.cname), self.opt.timeout_s)

    async def _unpin(self) -> None:
        """A run that held the pin and ended on its own gives the pin up, so the next run of
        the partition (another deployment after a membership change, say) is pinned at once
        instead of after ``priority_timeout_s``. Best effort: the pin times out anyway."""
        if not self._pinned or self.res.status in ("handed_over", "held"):
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.api.unpin(self.wq, self.cname), self.opt.timeout_s)

    async def _keep(self, lease: _Lease) -> None:
        """Keep the lease while a batch is processed: ``+WPI`` on the held messages every third
        of the ack wait, and, every third of the pin timeout, a short pull carrying the pin id
        (a pinned client that does not pull within the pin timeout loses the pin). With the
        lease unacknowledged (``max_ack_pending=1``) such a pull gets nothing, unless the lease
        itself was redelivered: then the newest delivery replaces it (that is the one to ack).
        """
        renew_every = self.opt.ack_wait_s / 3
        pin_every = self.opt.priority_timeout_s / 3
        loop = asyncio.get_running_loop()
        next_renew = loop.time() + renew_every
        next_pin = loop.time() + pin_every
        while not lease.stop.is_set():
            wait = max(0.0, min(next_renew, next_pin) - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lease.stop.wait(), wait)
            if lease.stop.is_set():
                return
            now = loop.time()
            if now >= next_renew:
                next_renew = now + renew_every
                for msg in lease.msgs:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
            if now >= next_pin and len(lease.msgs) == 1:
                next_pin = now + pin_every
                try:
                    got = await self.api.pull(self.wq, self.cname, batch=1, pin_id=lease.pin_id,
                                              expires_s=min(1.0, pin_every / 2))
                except Exception:  # noqa: BLE001 - NATS lost: the fence covers a lost lease
                    continue
                for m in got.messages:
                    if m.metadata.sequence.stream == lease.seq:
                        lease.msgs[0] = m
                    else:
                        await m.nak()
                if got.pin_id:
                    lease.pin_id = got.pin_id

    async def _has_backlog(self) -> bool:
        info = await self.retry.call("consumer info", lambda: self.api.consumer_info(
            self.wq, self.cname))
        self._pending = int(info.get("num_pending") or 0) + int(info.get("num_ack_pending") or 0)
        if self._pending:
            return True
        self.res.status = "empty"
        return False

    async def _first_lease(self) -> _Lease | None:
        if not await self._has_backlog():
            return None
        got = await self._pull("pull the lease", batch=1, expires_s=self.opt.hold_wait_s)
        if got.messages:
            return self._lease_of(got.messages[0], got.pin_id)
        await self._why_nothing()
        return None

    async def _why_nothing(self) -> None:
        """Set ``held`` (another instance holds the partition) or ``empty`` after a first pull
        that returned nothing."""
        info = await self.retry.call("consumer info", lambda: self.api.consumer_info(
            self.wq, self.cname))
        if info.get("num_ack_pending") or info.get("num_pending"):
            self.res.status = "held"
            holder = _pinned_id(info)
            who = (f"pinned client {holder}" if holder else
                   f"{int(info.get('num_ack_pending') or 0)} message(s) delivered and not yet "
                   f"acknowledged; an earlier holder's lease returns after the ack wait "
                   f"({self.opt.ack_wait_s:g} s)")
            self.res.detail = (f"partition {self.partition} held by another instance ({who}; "
                               f"waited {self.opt.hold_wait_s:g} s); nothing processed")
        else:
            self.res.status = "empty"

    def _lease_of(self, msg: Msg | list[Msg], pin_id: str | None) -> _Lease:
        msgs = msg if isinstance(msg, list) else [msg]
        lease = _Lease(msgs, msgs[0].metadata.sequence.stream, pin_id)
        self._pinned = True
        self._lease_now = lease
        lease.keeper = asyncio.create_task(self._keep(lease))
        self._step("leased", first_seq=lease.seq, last_seq=lease.seq)
        return lease

    @staticmethod
    async def _release(lease: _Lease) -> None:
        """Stop keeping the lease (waits for an in-flight keep-alive pull to end, so no pull
        of ours is left waiting at the server when the next one is sent)."""
        lease.stop.set()
        if lease.keeper is not None:
            with contextlib.suppress(BaseException):
                await lease.keeper

    async def _next_lease(self, done: _Lease) -> _Lease | None:
        """Release the finished lease ``done`` and pull the partition's next message."""
        await self._release(done)
        got = await self._pull("pull the next lease", batch=1, expires_s=0, no_wait=True,
                               pin_id=done.pin_id)
        if got.pin_lost:
            got = await self._repin()
        if got.messages:
            return self._lease_of(got.messages[0], got.pin_id)
        if got.pin_lost:
            self.res.status = "handed_over"
        elif got.status in (None, 404, 408):
            self.res.status = "drained"
        else:
            got.raise_for_status()
        return None

    async def _repin(self) -> PullResult:
        """The pin this run held is gone. Either another instance holds it now (a step-down
        or a pin timeout moved it), or nobody does: a restarted server forgets pins, whether
        or not any step of this run had to be retried. Pull without a pin id until the server
        pins this run again or names another holder (consumer info's ``pinned_client_id``),
        for up to ``hold_wait_s``. Returns the pull that got a message, or one marked as pin
        lost (status 423, ``detail`` names the new holder), or the last empty one when the
        partition has nothing left."""
        deadline = time.monotonic() + self.opt.hold_wait_s
        while True:
            got = await self._pull("re-pin", batch=1,
                                   expires_s=max(0.1, min(1.0, deadline - time.monotonic())))
            if got.messages:
                self.res.repins += 1
                return got
            info = await self.retry.call("consumer info", lambda: self.api.consumer_info(
                self.wq, self.cname))
            holder = _pinned_id(info)
            if holder is not None:
                got.status = 423
                self.res.detail = (f"the pin moved to another instance (pin id {holder}): "
                                   "step-down or pin timeout")
                return got
            if not (info.get("num_pending") or info.get("num_ack_pending")):
                got.status = 404
                return got
            if time.monotonic() >= deadline:
                got.status = 423
                self.res.detail = (f"partition {self.partition} has a backlog but the server "
                                   f"gave this run no message for {self.opt.hold_wait_s:g} s "
                                   "and names no pinned holder")
                return got

    def _limit_hit(self) -> bool:
        o = self.opt
        if o.max_messages is not None and self.res.processed >= o.max_messages:
            return True
        return o.max_seconds is not None and time.monotonic() - self.t0 >= o.max_seconds

    async def _loop(self) -> None:
        start = await self.retry.call("stream info", lambda: self.api.stream_info(self.wq))
        start_last = int(start["state"].get("last_seq") or 0)
        lease = await self._first_lease()
        # Dense partition: when it holds 90 % of the work queue's messages or more, reading the
        # range unfiltered and dropping the few other partitions' messages here is cheaper than
        # the server's filtered lookup; below that, the server and the client pay for every
        # message sent and filtered wins (bench/range_read.py: break-even at about 0.9).
        self._dense = 10 * self._pending >= 9 * int(start["state"].get("messages") or 0)
        dlq_ready = False
        # The next range is read while the current batch is processed and committed: reading
        # consumes nothing, and a prefetch that no longer starts where the next range starts
        # (or whose range another holder took over) is discarded or fenced at commit.
        prefetch: tuple[int, asyncio.Task[pa.Table]] | None = None
        try:
            while lease is not None:
                if lease.seq > start_last or self._limit_hit():
                    # Arrived after the run started, or a limit: leave it for the next run.
                    await self._release(lease)
                    await lease.msg.nak()
                    self.res.status = "drained" if lease.seq > start_last else "limit"
                    return
                t = time.monotonic()
                watermark = await asyncio.to_thread(self.sink.watermark, self.app_id)
                self._timed("watermark", t)
                self.res.watermark = watermark
                self._watermark_read = True
                if lease.seq <= watermark:
                    # Committed by an earlier run that stopped before purge/ack: finish its job.
                    await self._purge(watermark + 1)
                    await self._ack(lease)
                    self.res.duplicates_skipped += 1
                    lease = await self._next_lease(lease)
                    continue
                from_seq = max(lease.seq, watermark + 1)
                source = self._executor_source(from_seq, start_last)
                if source is not None:
                    # A large backlog: one batch read, decoded and transformed on the executors.
                    if prefetch is not None:
                        prefetch[1].cancel()
                        with contextlib.suppress(BaseException):
                            await prefetch[1]
                        prefetch = None
                    if not dlq_ready:
                        await self.retry.call("create the DLQ stream", lambda: ensure_dlq_stream(
                            self.api, self.stream, self.group))
                        dlq_ready = True
                    lease = await self._executor_batch(lease, watermark, source)
                    continue
                if prefetch is not None and prefetch[0] == from_seq:
                    records = await prefetch[1]
                else:
                    if prefetch is not None:
                        prefetch[1].cancel()
                    records = await self._read(from_seq, start_last)
                prefetch = None
                if records.num_rows == 0:
                    if await self._stale_empty_read(from_seq, start_last):
                        continue  # a replica behind the leader answered: read again
                    # The leased message was purged after a commit (crash before its ack).
                    await self._ack(lease)
                    lease = await self._next_lease(lease)
                    continue
                if not dlq_ready:
                    await self.retry.call("create the DLQ stream", lambda: ensure_dlq_stream(
                        self.api, self.stream, self.group))
                    dlq_ready = True
                lease, prefetch = await self._pipeline(lease, records, watermark, start_last,
                                                       prefetch)
        finally:
            if prefetch is not None:
                prefetch[1].cancel()
                with contextlib.suppress(BaseException):
                    await prefetch[1]
            if lease is not None:
                await self._release(lease)

    def _executor_source(self, from_seq: int, start_last: int) -> dict[str, str] | None:
        """The ``jetstream`` source options for reading ``[from_seq, start_last]`` of the
        partition on the executors, when the executor read is to be used for it (see
        ``EngineOptions.executor_read_min_msgs``); else None."""
        o, res = self.opt, self.res
        if (o.executor_read_min_msgs is None or o.dead_letter_policy != "dlq"
                or not isinstance(self.processor, RangeProcessor)):
            return None
        handled = res.processed + res.dead_lettered + res.duplicates_skipped
        backlog = min(self._pending - handled, start_last - from_seq + 1)
        if backlog < o.executor_read_min_msgs:
            return None
        if o.max_messages is not None and backlog > o.max_messages - res.processed:
            return None
        extra = getattr(self.processor, "read_options", None) or {}
        conn = executor_connect_options(self.nc, tls_files="tls_ca" in extra)
        if conn is None:
            return None
        return {**conn, "stream": self.wq, "subject": self.flt, "first_seq": str(from_seq),
                "last_seq": str(start_last), "strip_partition": "true",
                "timeout": str(o.timeout_s)}

    async def _executor_batch(self, lease: _Lease, watermark: int,
                              source: dict[str, str]) -> _Lease | None:
        """Process the range ``source`` names as one batch on the executors
        (:meth:`RangeProcessor.process_range`), then dead-letter, commit (fenced), purge and
        ack exactly as a driver batch. Returns the next lease, or None when the run stops."""
        first, last = int(source["first_seq"]), int(source["last_seq"])
        ctx = BatchContext(self.stream, self.group, self.partition, self.app_id, first, last,
                           self.sink, self.state)
        t = time.monotonic()
        assert isinstance(self.processor, RangeProcessor)
        got = await asyncio.to_thread(self.processor.process_range, source, ctx)
        process_s = time.monotonic() - t
        for k, v in got.timings.items():
            self.res.timings[k] = self.res.timings.get(k, 0.0) + v
        self.res.timings.setdefault("read_executors", 0.0)
        if got.messages == 0 or got.first_seq is None or got.last_seq is None:
            if await self._stale_empty_read(first, last):
                return lease  # a replica behind the leader answered: the loop reads again
            # The leased message was purged after a commit (crash before its ack).
            await self._ack(lease)
            return await self._next_lease(lease)
        span = _Span(got.first_seq, got.last_seq, got.last_origin_seq, got.messages)
        self._inflight = (span.first, span.last)
        _check_range(got, span, first, last)
        processed = got.processed
        processed.table = with_partition_column(processed.table, self.partition)
        self._step("read", first_seq=span.first, last_seq=span.last, executors=True)
        if self.state is not None:
            self.state.update(processed.table)  # as _prepare_batch: the cache goes on a fence
        self._step("processed", first_seq=span.first, last_seq=span.last)
        prep = _Prepared(got.dead_records, processed, None, process_s, span)
        await self._dead_letter(prep)
        if await self._commit_batch(lease, prep, watermark):
            return None
        return await self._next_lease(lease)

    async def _stale_empty_read(self, first: int, last: int) -> bool:
        """An empty read of the leased range ``[first, last]`` is taken as "purged after a
        commit" (and the lease acknowledged) only when the stream's leader agrees: direct gets
        may be answered by a replica a little behind it. True: the leader holds a message of
        the partition there (a replica now serves it too): read the range again. Raises
        :class:`~cg_pipelines.jetstream.leader.StaleReplicaError` when replicas miss it for
        5 s."""
        return await self.retry.call("confirm the empty range with the stream leader", lambda:
                                     confirm_empty_range(self.api, self.wq, self.flt, first,
                                                         last))

    async def _read(self, from_seq: int, start_last: int, timing: str = "read") -> pa.Table:
        """The partition's stored messages from ``from_seq`` on, in order, up to the batch
        limits and never past ``start_last``: one batched direct get (nothing is consumed),
        its replies cut into Arrow columns in bulk (:func:`~cg_pipelines.jetstream.rangeread.
        read_range`)."""
        t = time.monotonic()
        opt = self.opt
        flt = ">" if self._dense else self.flt
        size = next_batch_size(self.cost, opt.batch_max_msgs,
                               opt.adaptive_max_msgs or opt.batch_max_msgs)
        got = await self.retry.call("read", lambda: read_range(
            self.nc, self.wq, from_seq, filter_subject=flt, prefix=f"{self.partition}.",
            max_msgs=size, max_bytes=opt.batch_max_bytes, last_seq=start_last,
            timeout_s=opt.timeout_s, drop_nats_headers=True))
        self._timed(timing, t)
        return got.table(origin=True).cast(RECORD_SCHEMA)

    async def _process(self, records: pa.Table) -> Processed:
        first, last = _bounds(records)
        ctx = BatchContext(self.stream, self.group, self.partition, self.app_id,
                           first, last, self.sink, self.state)
        t = time.monotonic()
        processed = await asyncio.to_thread(self.processor.process, records, ctx)
        if processed.table is not None:  # one line naming a missing or mistyped column
            check_output(processed.table.schema, getattr(self.processor, "state", None),
                         where=f"transform output of partition {self.partition} of {self.wq} "
                               f"(sequences {first}..{last})")
        processed.table = with_partition_column(processed.table, self.partition)
        self._timed("process", t)
        seqs = set(records["seq"].to_pylist())
        unknown = [d.seq for d in processed.dead if d.seq not in seqs]
        if unknown:
            raise ValueError(f"processing step dead-lettered sequences not in the batch: "
                             f"{unknown[:5]}")
        return processed

    async def _prepare_batch(self, records: pa.Table) -> _Prepared:
        """Process one batch (under ``halt``, re-process the part before the first bad
        message) and take its output as the newest per-key state. Touches no lease."""
        t = time.monotonic()
        processed = await self._process(records)
        halted = None
        if processed.dead and self.opt.dead_letter_policy == "halt":
            halted = min(processed.dead, key=lambda d: d.seq)
            records = records.filter(pc.less(records["seq"], halted.seq))
            if records.num_rows == 0:
                return _Prepared(records, processed, halted, time.monotonic() - t)
            processed = await self._process(records)
            if processed.dead:  # the prefix must process cleanly: it did in the full batch
                raise RuntimeError("processing step is not deterministic: the batch before a "
                                   "bad message produced dead letters on re-processing")
        if self.state is not None:
            # Optimistic: the next batch is processed while this one commits; if the commit
            # is refused (fence), the run stops and this per-run cache goes with it.
            self.state.update(processed.table)
        first, last = _bounds(records)
        self._step("processed", first_seq=first, last_seq=last)
        return _Prepared(records, processed, halted, time.monotonic() - t)

    async def _dead_letter(self, prep: _Prepared) -> None:
        if not prep.processed.dead or not prep.records.num_rows:
            return
        t = time.monotonic()
        dead = prep.processed.dead
        # Retried as a whole: Nats-Msg-Id makes the DLQ store each dead letter once.
        self.res.dead_lettered += await self.retry.call("publish dead letters", lambda:
            publish_dead_letters(
                self.js, origin_stream=self.stream, read_stream=self.wq, group=self.group,
                partition=self.partition, batch=prep.records, dead=dead,
                timeout=self.opt.timeout_s))
        self._timed("dead_letter", t)

    async def _commit_batch(self, lease: _Lease, prep: _Prepared, watermark: int) -> bool:
        """Commit (fenced), purge, ack one prepared batch. Returns True to stop the run."""
        res = self.res
        processed = prep.processed
        facts = prep.facts()
        first, last = facts.first, facts.last
        t = time.monotonic()
        try:
            origin = facts.last_origin
            markers = {origin_marker(self.app_id): origin} if origin is not None else None
            lineage = {"stream": self.stream, "group": self.group,
                       "partition": self.partition, "first_seq": first, "last_seq": last,
                       "last_origin_seq": origin}
            await asyncio.to_thread(self.sink.commit, processed.table, self.app_id, last,
                                    watermark, markers, lineage=lineage)
        except FenceConflictError as e:
            res.fence_conflicts += 1
            res.status = "fenced"
            res.detail = f"{e}; a newer holder owns this range, stopping"
            # Stop renewing the lease (nobody else holds this one): left unacknowledged, it is
            # redelivered to the partition's next run after the ack wait.
            await self._release(lease)
            return True
        self._timed("commit", t)
        res.commits += 1
        if prep.span is None:  # an executor batch costs another path: it would skew the fit
            self.cost.observe(facts.messages, prep.process_s + time.monotonic() - t)
        res.watermark = last
        res.processed += facts.messages - len(processed.dead)
        res.first_seq = res.first_seq or first
        res.last_seq = last
        handled = res.processed + res.dead_lettered + res.duplicates_skipped
        self._step("committed", first_seq=first, last_seq=last, processed=res.processed,
                   dead_lettered=res.dead_lettered, left=max(0, self._pending - handled),
                   seconds=time.monotonic() - self.t0)
        t = time.monotonic()
        await self._release(lease)  # no keep-alive pull may be waiting when the lease is acked
        await self._settle(lease, last)
        self._settled_through = last
        if self._inflight is not None and self._inflight[1] <= last:
            self._inflight = None
        self._timed("settle", t)
        if prep.halted is not None:
            # The bad message is now the partition's first: leave it for an operator.
            self._halt(prep.halted.seq, prep.halted.reason)
            return True
        self._step("acked", first_seq=first, last_seq=last)
        return False

    def _halt(self, seq: int, reason: str) -> None:
        self.res.status, self.res.halted_at = "halted", seq
        self.res.detail = f"halted at sequence {seq}: {reason}"

    async def _process_and_commit(
        self, lease: _Lease, records: pa.Table, watermark: int
    ) -> bool:
        """Process, dead-letter, commit, purge, ack one batch, in that order. Returns True to
        stop the run."""
        self._inflight = _bounds(records)
        prep = await self._prepare_batch(records)
        if prep.records.num_rows == 0:  # halted at the batch's first message
            await self._release(lease)
            await lease.msg.nak()
            assert prep.halted is not None
            self._halt(prep.halted.seq, prep.halted.reason)
            return True
        await self._dead_letter(prep)
        return await self._commit_batch(lease, prep, watermark)

    async def _commit_and_next(self, lease: _Lease, prep: _Prepared,
                               watermark: int) -> _Lease | None:
        """:meth:`_commit_batch`, then the next lease (None: the run stops, status set)."""
        if await self._commit_batch(lease, prep, watermark):
            return None
        return await self._next_lease(lease)

    async def _pipeline(
        self, lease: _Lease, records: pa.Table, watermark: int, start_last: int,
        prefetch: tuple[int, asyncio.Task[pa.Table]] | None,
    ) -> tuple[_Lease | None, tuple[int, asyncio.Task[pa.Table]] | None]:
        """Drain batches with commit and settle off the critical path: batch k+1 is processed
        while batch k commits (fenced, in order), purges, acks and the next lease comes back.
        The next batch is read meanwhile too. Returns the lease to go on with (the outer loop
        checks it) or None when the run stops, and an unused prefetch."""
        pending: asyncio.Task[_Lease | None] | None = None
        try:
            while True:
                first, last = _bounds(records)
                self._inflight = (first, last)
                self._step("read", first_seq=first, last_seq=last)
                if prefetch is None and last < start_last:
                    prefetch = (last + 1, asyncio.create_task(
                        self._read(last + 1, start_last, timing="read_overlapped")))
                prep = await self._prepare_batch(records)
                if pending is not None:
                    next_lease, pending = await pending, None
                    if next_lease is None:
                        return None, prefetch
                    lease = next_lease
                    if lease.seq != first or self._limit_hit():
                        # Not where this batch starts (or a limit): drop it, and the state it
                        # added to the cache, and let the outer loop decide.
                        if self.state is not None:
                            self.state.reset()
                        return lease, prefetch
                if prep.records.num_rows == 0:  # halted at the batch's first message
                    await self._release(lease)
                    await lease.msg.nak()
                    assert prep.halted is not None
                    self._halt(prep.halted.seq, prep.halted.reason)
                    return None, prefetch
                await self._dead_letter(prep)
                pending = asyncio.create_task(self._commit_and_next(lease, prep, watermark))
                watermark = _bounds(prep.records)[1]
                if prep.halted is not None or prefetch is None or prefetch[0] != last + 1:
                    next_lease, pending = await pending, None
                    return next_lease, prefetch
                records = await prefetch[1]
                prefetch = None
                if records.num_rows == 0:
                    next_lease, pending = await pending, None
                    return next_lease, None
        except BaseException:
            if prefetch is not None:  # the caller never sees this prefetch
                prefetch[1].cancel()
                with contextlib.suppress(BaseException):
                    await prefetch[1]
            raise
        finally:
            if pending is not None:  # an error or cancellation: let the commit finish first
                with contextlib.suppress(BaseException):
                    await pending

    async def _settle(self, lease: _Lease, last: int) -> None:
        """After a commit: purge the partition below ``last + 1``, then ack the lease."""
        await self._purge(last + 1)
        self._step("purged", last_seq=last)
        await self._ack(lease)

    async def _purge(self, below: int) -> None:
        """Purge the partition's messages below sequence ``below`` (idempotent; retried)."""
        await self.retry.call("purge", lambda: self.api.purge(self.wq, filter=self.flt,
                                                              seq=below))


def executor_connect_options(nc: Client, *, tls_files: bool = False) -> dict[str, str] | None:
    """How executors reach the NATS that ``nc`` is connected to, as ``jetstream`` source options
    (``servers`` with any URL credentials, ``user``/``password``/``token``, ``creds`` and
    ``nkey_seed`` file paths), or None when that cannot be shipped: a TLS connection (its
    SSL context stays here) unless ``tls_files`` (the processor's ``read_options`` name the TLS
    files), or credentials given as callbacks or in memory. Holds secrets: never log it."""
    if nc.options.get("tls") is not None and not tls_files:
        return None
    if getattr(nc, "_nkeys_seed_str", None) is not None:
        return None
    creds = getattr(nc, "_user_credentials", None)
    seed = getattr(nc, "_nkeys_seed", None)
    if (creds is not None and not isinstance(creds, str)) or (
            seed is not None and not isinstance(seed, str)):
        return None
    urls = [u.geturl() for u in nc.servers] or (
        [nc.connected_url.geturl()] if nc.connected_url else [])
    if not urls:
        return None
    out = {"servers": ",".join(urls)}
    for key, value in (("user", nc.options.get("user")), ("password", nc.options.get("password")),
                       ("token", nc.options.get("token")), ("creds", creds),
                       ("nkey_seed", None if creds else seed)):
        if value:
            out[key] = str(value)
    return out


def _check_range(got: RangeProcessed, span: _Span, first: int, last: int) -> None:
    """An executor batch's facts must be consistent: within the range asked for, every dead
    letter in ``dead_records`` and in the range, no more dead letters than messages."""
    if not first <= span.first <= span.last <= last:
        raise ValueError(f"range processing returned sequences {span.first}..{span.last} "
                         f"outside the range {first}..{last}")
    dead = [d.seq for d in got.processed.dead]
    known = set(got.dead_records["seq"].to_pylist())
    unknown = [q for q in dead if q not in known or not span.first <= q <= span.last]
    if unknown or len(set(dead)) != len(dead) or len(dead) > span.messages:
        raise ValueError(f"range processing dead-lettered sequences it did not read or twice: "
                         f"{(unknown or dead)[:5]}")


def _pinned_id(info: dict[str, Any]) -> str | None:
    """The pinned client id of the ``PCG`` priority group in a consumer info, or None."""
    for g in info.get("priority_groups") or []:
        if g.get("group") == PRIORITY_GROUP and g.get("pinned_client_id"):
            return str(g["pinned_client_id"])
    return None


def _bounds(batch: pa.Table) -> tuple[int, int]:
    """First and last sequence of a non-empty batch (stream order)."""
    seqs = batch["seq"]
    return seqs[0].as_py(), seqs[-1].as_py()


def _state_cache(processor: Processor, sink: Sink, partition: int) -> KeyStateCache | None:
    """The run's per-key state cache when the processor declares
    :class:`~cg_pipelines.core.state.KeyedState` (``processor.state``), else ``None``.

    Raises:
        EngineConfigError: state is declared but ``sink`` cannot serve it (no ``last_rows``).
    """
    spec: KeyedState | None = getattr(processor, "state", None)
    if spec is None:
        return None
    if not isinstance(sink, StateSink):
        raise EngineConfigError(
            f"the processor declares per-key state on {spec.key!r} but {type(sink).__name__} "
            "cannot serve it (no last_rows method): use a state sink such as DeltaSink")

    def read(keys: Sequence[object]) -> pa.Table:
        return sink.last_rows(spec.key, keys, spec.read_columns, spec.order_by, partition)

    return KeyStateCache(spec, read, getattr(sink, "write", None))


def with_partition_column(table: pa.Table | None, partition: int) -> pa.Table | None:
    """``table`` with :data:`~cg_pipelines.engine.model.PARTITION_COLUMN` (int64) set to
    ``partition`` on every row (appended, or checked when the transform kept it).

    Raises:
        ValueError: the table has the column with another partition's number.
    """
    if table is None:
        return None
    if PARTITION_COLUMN in table.column_names:
        col = table[PARTITION_COLUMN]
        if table.num_rows and not pc.all(pc.equal(col, partition)).as_py():
            raise ValueError(f"the transform's {PARTITION_COLUMN} column holds other "
                             f"partitions than {partition}")
        return table
    return table.append_column(pa.field(PARTITION_COLUMN, pa.int64(), nullable=False),
                               pa.array(np.full(table.num_rows, partition, np.int64)))


def origin_seq_of(headers: dict[str, str] | None) -> int | None:
    """The origin stream sequence of a sourced message, from its ``Nats-Stream-Source`` header
    (``<origin stream> <origin seq> <filter> <transform> <origin subject> <id>``, as
    nats-server 2.15 writes it), or None."""
    src = (headers or {}).get("Nats-Stream-Source")
    if not src:
        return None
    parts = src.split(" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _last_origin_seq(batch: pa.Table) -> int | None:
    """The origin sequence of the batch's last message (None when it has none)."""
    col = batch["origin_seq"]
    return col[len(col) - 1].as_py() if len(col) else None


def _user_headers(headers: dict[str, str] | None) -> dict[str, str] | None:
    """Headers without the server's ``Nats-*`` ones (stream source, pin id ...)."""
    user = {k: v for k, v in (headers or {}).items() if not k.startswith("Nats-")}
    return user or None


async def run_partition(
    nc: Client,
    stream: str,
    group: str,
    partition: int,
    processor: Processor,
    sink: Sink,
    options: EngineOptions | None = None,
    *,
    hook: Hook | None = None,
) -> RunResult:
    """Drain one partition of an elastic group with lease-and-range (see module docstring).

    Args:
        nc: a connected nats-py client.
        stream, group: the origin stream and elastic group (work-queue stream
            ``<stream>-<group>`` must exist: :func:`cg_pipelines.jetstream.admin.create_elastic`).
        partition: 0 <= partition < max_members.
        processor: the processing step; sink: where effects commit, fenced.
        options: :class:`EngineOptions`; hook: step callback (fault injection, progress).

    Returns:
        A :class:`RunResult`; ``status`` says how the run ended. "Held by another instance",
        "fenced" and "halted" are results, not exceptions.

    Raises:
        EngineConfigError: the lease consumer cannot be created as required.
        NatsUnavailableError: NATS stayed unreachable for ``options.retry_max_s`` seconds
            (each NATS step is retried with backoff until then); nothing acknowledged that was
            not committed, and the next run resumes from the watermark.
        JetStreamError: other NATS API failures (same guarantee).
        Exceptions of the processing step or the sink (other than fence conflicts), unchanged.

    On any failure (a cancellation included) the run gives the partition back before raising:
    the held lease is nak'ed and the pin released, so an immediate retry is not ``held``. The
    raised exception carries a note (:pep:`678`) naming the partition, the sequences in flight
    and what was committed and acknowledged.
    """
    if partition < 0:
        raise ValueError(f"partition must be >= 0, got {partition}")
    run = _PartitionRun(nc, stream, group, partition, processor, sink,
                        options or EngineOptions(), hook)
    return await run.run()
