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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.core.subjects import strip_partition
from cg_pipelines.engine.deadletter import ensure_dlq_stream, publish_dead_letters
from cg_pipelines.engine.model import (
    BatchContext,
    FenceConflictError,
    Processed,
    Processor,
    Record,
    RunResult,
    Sink,
)
from cg_pipelines.engine.retry import Retrier
from cg_pipelines.jetstream.api import JetStreamAPI, PullResult, consumer_config
from cg_pipelines.jetstream.errors import (
    ConsumerAlreadyExistsError,
    JetStreamUnavailableError,
    RequestTimeoutError,
    WorkQueueConsumerNotUniqueError,
)

PRIORITY_GROUP = "PCG"
Hook = Callable[[str, dict[str, Any]], None]
"""``hook(step, info)``: called after each step (``"leased"``, ``"read"``, ``"processed"``,
``"committed"``, ``"purged"``, ``"acked"``) with ``first_seq``/``last_seq``, and ``"retry"``
(``step``, ``attempt``, ``error``) after each failed attempt of a NATS step that will be
retried; used by fault-injection tests and progress reporting. It runs on the event loop: keep
it short."""


class EngineConfigError(RuntimeError):
    """The partition cannot be run as configured (e.g. the lease consumer exists with another
    config, or streaming member consumers already hold the partition's subjects)."""


@dataclass(frozen=True)
class EngineOptions:
    """Tuning of one partition run.

    Attributes:
        batch_max_msgs: most messages per batch (one commit each).
        batch_max_bytes: most payload bytes per batch (at least one message is taken).
        read_chunk: messages per direct-get request.
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
    """

    batch_max_msgs: int = 20_000
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

    def __post_init__(self) -> None:
        if self.batch_max_msgs < 1 or self.batch_max_bytes < 1 or self.read_chunk < 1:
            raise ValueError("batch_max_msgs, batch_max_bytes and read_chunk must be >= 1")
        if self.ack_wait_s <= 0 or self.priority_timeout_s <= 0 or self.hold_wait_s <= 0:
            raise ValueError("ack_wait_s, priority_timeout_s and hold_wait_s must be > 0 seconds")
        if self.timeout_s <= 0 or self.retry_max_s < 0:
            raise ValueError("timeout_s must be > 0 and retry_max_s >= 0 seconds")
        if not 0 < self.retry_backoff_s <= self.retry_max_backoff_s:
            raise ValueError("need 0 < retry_backoff_s <= retry_max_backoff_s seconds")
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
    retries: int = 0  # the run's NATS retries when the lease was taken
    keeper: asyncio.Task[None] | None = field(default=None)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def msg(self) -> Msg:
        return self.msgs[0]


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
        finally:
            await self.api.close()
            self.res.seconds = time.monotonic() - self.t0
        return self.res

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
            self.res.detail = (f"partition {self.partition} held by another instance "
                               f"(waited {self.opt.hold_wait_s:g} s)")
        else:
            self.res.status = "empty"

    def _lease_of(self, msg: Msg | list[Msg], pin_id: str | None) -> _Lease:
        msgs = msg if isinstance(msg, list) else [msg]
        lease = _Lease(msgs, msgs[0].metadata.sequence.stream, pin_id, self.res.nats_retries)
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
        if got.pin_lost and self.res.nats_retries > done.retries:
            # NATS was lost while we held the lease: a restarted server forgets pins, so the
            # pin moving is no sign of a new holder. Pull without the old id: if another
            # instance holds the pin now, the server gives us nothing and we hand over.
            got = await self._pull("re-pin after reconnect", batch=1,
                                   expires_s=min(self.opt.hold_wait_s, 2.0))
            if got.messages:
                return self._lease_of(got.messages[0], got.pin_id)
            if await self._has_backlog():  # backlog left but none for us: another holder
                got.status = 423
        if got.messages:
            return self._lease_of(got.messages[0], got.pin_id)
        if got.pin_lost:
            self.res.status = "handed_over"
            self.res.detail = "the pin moved to another instance (step-down or pin timeout)"
        elif got.status in (None, 404, 408):
            self.res.status = "drained"
        else:
            got.raise_for_status()
        return None

    def _limit_hit(self) -> bool:
        o = self.opt
        if o.max_messages is not None and self.res.processed >= o.max_messages:
            return True
        return o.max_seconds is not None and time.monotonic() - self.t0 >= o.max_seconds

    async def _loop(self) -> None:
        start = await self.retry.call("stream info", lambda: self.api.stream_info(self.wq))
        start_last = int(start["state"].get("last_seq") or 0)
        lease = await self._first_lease()
        # Dense partition: when it holds at least half of the work queue's messages, reading
        # the range unfiltered and skipping other partitions' messages here is cheaper than
        # the server's per-message wildcard lookup (``next_by_subj="<p>.>"`` slows down with
        # the number of distinct subjects: ~2.3x on 1,000 subjects, bench/partition_drain.py).
        self._dense = 2 * self._pending >= int(start["state"].get("messages") or 0)
        dlq_ready = False
        # The next range is read while the current batch is processed and committed: reading
        # consumes nothing, and a prefetch that no longer starts where the next range starts
        # (or whose range another holder took over) is discarded or fenced at commit.
        prefetch: tuple[int, asyncio.Task[list[Record]]] | None = None
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
                if lease.seq <= watermark:
                    # Committed by an earlier run that stopped before purge/ack: finish its job.
                    await self._purge(watermark + 1)
                    await self._ack(lease)
                    self.res.duplicates_skipped += 1
                    lease = await self._next_lease(lease)
                    continue
                from_seq = max(lease.seq, watermark + 1)
                if prefetch is not None and prefetch[0] == from_seq:
                    records = await prefetch[1]
                else:
                    if prefetch is not None:
                        prefetch[1].cancel()
                    records = await self._read(from_seq, start_last)
                prefetch = None
                if not records:
                    # The leased message was purged after a commit (crash before its ack).
                    await self._ack(lease)
                    lease = await self._next_lease(lease)
                    continue
                self._step("read", first_seq=records[0].seq, last_seq=records[-1].seq)
                if not dlq_ready:
                    await self.retry.call("create the DLQ stream", lambda: ensure_dlq_stream(
                        self.api, self.stream, self.group))
                    dlq_ready = True
                if len(records) >= self.opt.batch_max_msgs and records[-1].seq < start_last:
                    nxt = records[-1].seq + 1
                    prefetch = (nxt, asyncio.create_task(
                        self._read(nxt, start_last, timing="read_overlapped")))
                if await self._process_and_commit(lease, records, watermark):
                    return
                lease = await self._next_lease(lease)
        finally:
            if prefetch is not None:
                prefetch[1].cancel()
                with contextlib.suppress(BaseException):
                    await prefetch[1]
            if lease is not None:
                await self._release(lease)

    async def _read(self, from_seq: int, start_last: int, timing: str = "read") -> list[Record]:
        """The partition's stored messages from ``from_seq`` on, in order, up to the batch
        limits and never past ``start_last`` (direct get: nothing is consumed)."""
        t = time.monotonic()
        out: list[Record] = []
        nbytes = 0
        seq = from_seq
        opt = self.opt
        flt = ">" if self._dense else self.flt
        prefix = f"{self.partition}."
        while len(out) < opt.batch_max_msgs and nbytes < opt.batch_max_bytes:
            want = min(opt.read_chunk, opt.batch_max_msgs - len(out))
            msgs = await self.retry.call("read", lambda s=seq, w=want, b=nbytes:
                                         self.api.direct_get_batch(
                                             self.wq, s, flt, w, max_bytes=opt.batch_max_bytes - b))
            for m in msgs:
                if m.seq > start_last:
                    self._timed(timing, t)
                    return out
                if not m.subject.startswith(prefix):
                    continue  # another partition's message (dense, unfiltered read)
                _, subject = strip_partition(m.subject)
                out.append(Record(m.seq, subject, m.data, m.time_ns, _user_headers(m.headers)))
                nbytes += len(m.data)
            if len(msgs) < want or (msgs and msgs[-1].num_pending == 0):
                break
            seq = msgs[-1].seq + 1
        self._timed(timing, t)
        return out

    async def _process(self, records: Sequence[Record]) -> Processed:
        ctx = BatchContext(self.stream, self.group, self.partition, self.app_id,
                           records[0].seq, records[-1].seq, self.sink)
        t = time.monotonic()
        processed = await asyncio.to_thread(self.processor.process, records, ctx)
        self._timed("process", t)
        seqs = {r.seq for r in records}
        unknown = [d.seq for d in processed.dead if d.seq not in seqs]
        if unknown:
            raise ValueError(f"processing step dead-lettered sequences not in the batch: "
                             f"{unknown[:5]}")
        return processed

    async def _process_and_commit(
        self, lease: _Lease, records: list[Record], watermark: int
    ) -> bool:
        """Process, dead-letter, commit, purge, ack one batch. Returns True to stop the run."""
        res = self.res
        processed = await self._process(records)
        halted = None
        if processed.dead and self.opt.dead_letter_policy == "halt":
            halted = min(processed.dead, key=lambda d: d.seq)
            records = [r for r in records if r.seq < halted.seq]
            if not records:
                await self._release(lease)
                await lease.msg.nak()
                res.status, res.halted_at = "halted", halted.seq
                res.detail = f"halted at sequence {halted.seq}: {halted.reason}"
                return True
            processed = await self._process(records)
            if processed.dead:  # the prefix must process cleanly: it did in the full batch
                raise RuntimeError("processing step is not deterministic: the batch before a "
                                   "bad message produced dead letters on re-processing")
        self._step("processed", first_seq=records[0].seq, last_seq=records[-1].seq)
        last = records[-1].seq
        if processed.dead:
            t = time.monotonic()
            dead = processed.dead
            # Retried as a whole: Nats-Msg-Id makes the DLQ store each dead letter once.
            res.dead_lettered += await self.retry.call("publish dead letters", lambda:
                publish_dead_letters(
                    self.js, origin_stream=self.stream, read_stream=self.wq, group=self.group,
                    partition=self.partition, records=records, dead=dead,
                    timeout=self.opt.timeout_s))
            self._timed("dead_letter", t)
        t = time.monotonic()
        try:
            await asyncio.to_thread(self.sink.commit, processed.table, self.app_id, last,
                                    watermark)
        except FenceConflictError as e:
            res.fence_conflicts += 1
            res.status = "fenced"
            res.detail = f"{e}; a newer holder owns this range, stopping"
            return True
        self._timed("commit", t)
        res.commits += 1
        res.watermark = last
        res.processed += len(records) - len(processed.dead)
        res.first_seq = res.first_seq or records[0].seq
        res.last_seq = last
        self._step("committed", first_seq=records[0].seq, last_seq=last)
        t = time.monotonic()
        await self._release(lease)  # no keep-alive pull may be waiting when the lease is acked
        await self._settle(lease, last)
        self._timed("settle", t)
        if halted is not None:
            # The bad message is now the partition's first: leave it for an operator.
            res.status, res.halted_at = "halted", halted.seq
            res.detail = f"halted at sequence {halted.seq}: {halted.reason}"
            return True
        self._step("acked", first_seq=records[0].seq, last_seq=last)
        return False

    async def _settle(self, lease: _Lease, last: int) -> None:
        """After a commit: purge the partition below ``last + 1``, then ack the lease."""
        await self._purge(last + 1)
        self._step("purged", last_seq=last)
        await self._ack(lease)

    async def _purge(self, below: int) -> None:
        """Purge the partition's messages below sequence ``below`` (idempotent; retried)."""
        await self.retry.call("purge", lambda: self.api.purge(self.wq, filter=self.flt,
                                                              seq=below))


def _user_headers(headers: dict[str, str] | None) -> dict[str, str] | None:
    """Headers without the server's ``Nats-*`` ones (stream source, pin id ...)."""
    user = {k: v for k, v in (headers or {}).items() if not k.startswith("Nats-")}
    return user or None


def _record_of(m: Msg) -> Record:
    """A delivered message as a :class:`Record` (partition token stripped)."""
    md = m.metadata
    return Record(md.sequence.stream, strip_partition(m.subject)[1], m.data,
                  int(md.timestamp.timestamp() * 1_000_000_000), _user_headers(m.headers))


class _StaticPartitionRun(_PartitionRun):
    """Static groups: the origin stream holds ``<p>.<...>`` subjects and is never purged.

    A durable consumer per partition (``<group>-partition-<p>``, filters ``<p>.<filter>``,
    pinned, ``max_ack_pending`` = batch size) delivers a batch in stream order; after the commit
    every delivered message is acknowledged (one ack each). Messages at or below the watermark
    are acknowledged without processing.
    """

    def __init__(self, *args: Any, filters: Sequence[str] = ()) -> None:
        super().__init__(*args)
        self.wq = self.stream
        self.cname = f"{self.group}-partition-{self.partition}"
        self.filters = [f"{self.partition}.{f}" for f in filters] or [self.flt]

    async def _ensure_consumer(self) -> None:
        cfg = consumer_config(
            durable_name=self.cname, filter_subjects=self.filters,
            ack_wait_s=self.opt.ack_wait_s, max_ack_pending=self.opt.batch_max_msgs,
            priority_groups=[PRIORITY_GROUP], priority_policy="pinned_client",
            priority_timeout_s=self.opt.priority_timeout_s,
            description="cg_pipelines static partition run")
        try:
            await self.retry.call("create the partition consumer", lambda: self.api.create_consumer(
                self.stream, cfg))
        except ConsumerAlreadyExistsError as e:
            raise EngineConfigError(
                f"consumer {self.cname} on {self.stream} exists with other settings: run every "
                f"instance with the same engine options ({e})") from e

    async def _loop(self) -> None:
        start = await self.retry.call("stream info", lambda: self.api.stream_info(self.stream))
        start_last = int(start["state"].get("last_seq") or 0)
        if not await self._has_backlog():
            return
        pin: str | None = None
        first = True
        while not self._limit_hit():
            got = await self._pull(
                "pull a batch", batch=self.opt.batch_max_msgs,
                max_bytes=self.opt.batch_max_bytes, expires_s=self.opt.hold_wait_s if first
                else 0, no_wait=not first, pin_id=pin)
            if not got.messages:
                if first:
                    await self._why_nothing()
                elif got.pin_lost:
                    self.res.status = "handed_over"
                elif got.status in (None, 404, 408):
                    self.res.status = "drained"
                else:
                    got.raise_for_status()
                return
            first, pin = False, got.pin_id
            watermark = await asyncio.to_thread(self.sink.watermark, self.app_id)
            self.res.watermark = watermark
            msgs = got.messages
            seqs = [m.metadata.sequence.stream for m in msgs]
            done = [m for m, q in zip(msgs, seqs, strict=True) if q <= watermark]
            later = [m for m, q in zip(msgs, seqs, strict=True) if q > start_last]
            fresh = [m for m, q in zip(msgs, seqs, strict=True) if watermark < q <= start_last]
            for m in done:
                await m.ack()
            self.res.duplicates_skipped += len(done)
            for m in later:
                await m.nak()
            if fresh:
                lease = self._lease_of(fresh, pin)
                try:
                    records = [_record_of(m) for m in fresh]
                    if await self._process_and_commit(lease, records, watermark):
                        return
                finally:
                    await self._release(lease)
            if later or (not fresh and not done):
                self.res.status = "drained"
                return
        self.res.status = "limit"

    async def _settle(self, lease: _Lease, last: int) -> None:
        """After a commit: ack every delivered message up to ``last``; nak the rest."""
        for m in lease.msgs:
            if m.metadata.sequence.stream <= last:
                await m.ack()
            else:
                await m.nak()
        await self.retry.call("flush acks", lambda: self.nc.flush(timeout=self.opt.timeout_s))


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
    """
    if partition < 0:
        raise ValueError(f"partition must be >= 0, got {partition}")
    run = _PartitionRun(nc, stream, group, partition, processor, sink,
                        options or EngineOptions(), hook)
    return await run.run()


async def run_static_partition(
    nc: Client,
    stream: str,
    group: str,
    partition: int,
    processor: Processor,
    sink: Sink,
    options: EngineOptions | None = None,
    *,
    filters: Sequence[str] = (),
    hook: Hook | None = None,
) -> RunResult:
    """Drain one partition of a static group (origin stream ``<p>.<...>`` subjects).

    Same contract and results as :func:`run_partition`; ``filters`` are the static group's
    subject filters (after the partition token). The origin stream is never purged: the
    partition's consumer advances by acknowledging each delivered message after its commit.
    """
    if partition < 0:
        raise ValueError(f"partition must be >= 0, got {partition}")
    run = _StaticPartitionRun(nc, stream, group, partition, processor, sink,
                              options or EngineOptions(), hook, filters=filters)
    return await run.run()
