"""Co-partitioned runs: partition ``p`` of several consumer groups, drained together, committed
once (the stream-join case of KIP-315, ``../shared/seeds/``: "all of the topics for a given
partition must go to the same consumer").

The groups of a co-partitioned set (:mod:`cg_pipelines.core.copartition`) partition different
streams on the same key into the same number of partitions, so partition ``p`` of every group
holds the same keys. One run for ``p``:

1. **Lease** partition ``p`` of every input, one after the other in a fixed order (sorted by
   stream, then group: two runs never hold one lease each and wait for the other's), each
   exactly as a single-input run (:mod:`cg_pipelines.engine.lease`). An input held by another
   instance makes the run ``held``: the leases already taken are put back at once. An input
   with no backlog is not leased; it has an empty batch.
2. **Watermarks** of every input (the first input's read first: the commit is fenced against
   the snapshot that read loaded). A lease at or below its input's watermark was committed by
   an earlier run that stopped before its acknowledgements: finish them (purge, ack).
3. **Read** each leased input's range after its watermark, in its stream order, up to the batch
   limits and never past that input's last sequence when the run started (batched direct get,
   nothing consumed; :func:`~cg_pipelines.jetstream.rangeread.read_range`).
4. **Process**: one call with every input's batch
   (:meth:`~cg_pipelines.engine.join_processor.JoinProcessor.process_inputs`), state shared
   across inputs through one per-run cache.
5. **Dead-letter** each input's rejects to its own group's DLQ stream.
6. **Commit, fenced on every input**: the rows and every input's new watermark (and origin
   marker) in ONE sink commit (:meth:`~cg_pipelines.sinks.base.JoinSink.commit_inputs`); an
   input with nothing in the batch keeps its watermark, fenced all the same. A fence conflict
   on any input stops the run (``fenced``), nothing acknowledged.
7. **Settle** each input that had messages: purge its partition below its batch's last + 1,
   ack its lease, pull its next lease; then the next batch from 2.

A crash anywhere is safe as for one input: before 6 nothing is visible; after it, the rerun
finds every input's watermark and skips what is committed. Progress of one input is never
committed without the others' (one commit), and a zombie holding any one lease is refused at
its commit (every commit names every input's watermark).

Limits: no executor read and no ``halt`` policy (``EngineOptions.dead_letter_policy`` must be
``"dlq"``); batches are read on the driver.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import pyarrow as pa
from nats.aio.client import Client

from cg_pipelines.core.coverage import JOIN_LINEAGE_KEY, encode_seqs
from cg_pipelines.core.errors import ContractError, InvariantError, UsageError
from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.engine.context import RunContext, open_run
from cg_pipelines.engine.deadletter import ensure_dlq_stream, publish_dead_letters
from cg_pipelines.engine.join_processor import JoinContext, JoinProcessor
from cg_pipelines.engine.lease import Lease, LeaseHolder, lease_consumer_name
from cg_pipelines.engine.options import EngineConfigError, EngineOptions, Hook
from cg_pipelines.engine.processor import BatchContext, DeadLetter, Processed, ProcessorBase
from cg_pipelines.engine.result import RunResult, RunStatus
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.jetstream.leader import confirm_empty_range
from cg_pipelines.jetstream.rangeread import read_range
from cg_pipelines.sinks.base import (
    FenceConflictError,
    JoinSink,
    MaintainedSink,
    StateSink,
    origin_marker,
    with_partition_column,
)

__all__ = ["JoinInput", "JoinResult", "run_copartitioned"]

@dataclass(frozen=True)
class JoinInput:
    """One input of a co-partitioned run: the processor's name for it and its elastic group
    (``stream``, ``group``; work queue ``<stream>-<group>``)."""

    name: str
    stream: str
    group: str


@dataclass
class JoinResult:
    """How a co-partitioned run ended.

    Attributes:
        partition: the partition drained.
        status: ``drained``, ``empty``, ``held``, ``fenced`` or ``limit`` (as
            :data:`~cg_pipelines.engine.result.RunStatus`).
        inputs: each input's :class:`~cg_pipelines.engine.result.RunResult` (processed,
            dead-lettered, watermark, sequence range of this run), by input name.
        commits: joint commits made (each moved every input's watermark together).
        rows_written: output rows committed.
        seconds: wall time.
        detail: why the run ended when it is not plain (held by whom, the fence conflict).
        maintenance: the sink's upkeep figures (after the last commit), if any.
    """

    partition: int
    status: RunStatus = "empty"
    inputs: dict[str, RunResult] = field(default_factory=dict)
    commits: int = 0
    rows_written: int = 0
    seconds: float = 0.0
    detail: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    maintenance: dict[str, int | float | str] = field(default_factory=dict)

    @property
    def processed(self) -> int:
        """Messages of all inputs committed as rows (not dead letters)."""
        return sum(r.processed for r in self.inputs.values())


class NoProcessing(ProcessorBase):
    """The per-input run contexts' processor slot: a co-partitioned run processes through its
    :class:`JoinProcessor`, never per input."""

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        raise InvariantError("a co-partitioned input is never processed alone")


@dataclass
class _Side:
    """One input during the run: its context, lease holder, current lease, and the sequence
    of its work queue's last message when the run started."""

    inp: JoinInput
    ctx: RunContext
    holder: LeaseHolder
    lease: Lease | None = None
    start_last: int = 0
    records: pa.Table | None = None
    dlq_ready: bool = False


async def run_copartitioned(
    nc: Client, inputs: Sequence[JoinInput], partition: int, processor: JoinProcessor,
    sink: JoinSink, options: EngineOptions | None = None, *, hook: Hook | None = None,
    connect: ConnectOptions | None = None,
) -> JoinResult:
    """Drain partition ``partition`` of every input's group in one run, one commit per batch
    for all inputs (see the module docstring).

    Args:
        nc: a connected nats-py client.
        inputs: the set's inputs (two or more; each group's work queue must exist and the
            groups must be co-partitioned: :func:`cg_pipelines.core.copartition.
            check_copartitioned`). Names must be the processor's ``inputs``.
        partition: 0 <= partition < the set's partition count.
        processor: the :class:`~cg_pipelines.engine.join_processor.JoinProcessor`.
        sink: a :class:`~cg_pipelines.sinks.base.JoinSink` (Delta and Iceberg sinks are).
        options: :class:`EngineOptions` (``dead_letter_policy`` must be ``"dlq"``; batch
            limits apply per input; ``max_messages`` counts all inputs).
        hook: step callback ``hook(step, info)``; ``info["input"]`` names the input for the
            per-input steps (``leased``, ``read``, ``purged``, ``acked``); ``processed`` and
            ``committed`` are joint.
        connect: the connect options ``nc`` was made with (unused on this path; accepted for
            symmetry with :func:`~cg_pipelines.engine.runner.run_partition`).

    Returns:
        A :class:`JoinResult`.

    Raises:
        UsageError: fewer than two inputs, duplicate names or groups, or names that are not
            the processor's inputs.
        EngineConfigError: the sink cannot commit several watermarks at once (not a
            ``JoinSink``), or cannot serve declared state, or ``halt`` was asked for.
        ConfigError: ``partition`` is negative.
        NatsUnavailableError / JetStreamError / the processor's and the sink's errors: as
            :func:`~cg_pipelines.engine.runner.run_partition`; every lease taken is given back
            first (nak and unpin), nothing acknowledged that was not committed.
    """
    opt = options or EngineOptions()
    check_inputs(inputs, processor, sink, opt)
    order = sorted(inputs, key=lambda i: (i.stream, i.group))
    sides: list[_Side] = []
    for inp in order:
        ctx = open_run(nc, inp.stream, inp.group, partition, NoProcessing(), sink, opt,
                       tag_hook(hook, inp.name), connect=connect)
        sides.append(_Side(inp, ctx, LeaseHolder(ctx, lease_consumer_name(partition))))
    run = _JoinRun(sides, [i.name for i in inputs], partition, processor, sink, opt, hook)

    async def nest(k: int) -> None:
        # Each lease holder's guard gives its partition back on any failure inside it.
        if k == len(sides):
            await run.run()
            return
        await sides[k].holder.guard(sides[k].holder.ensure, lambda: nest(k + 1))

    try:
        await nest(0)
    finally:
        run.res.seconds = time.monotonic() - run.t0
    return run.res


def check_inputs(inputs: Sequence[JoinInput], processor: JoinProcessor, sink: object,
                 opt: EngineOptions) -> None:
    """Refuse a co-partitioned run's arguments before anything is read (the reasons of
    :func:`run_copartitioned`'s ``UsageError``/``EngineConfigError``)."""
    names = [i.name for i in inputs]
    if len(inputs) < 2:
        raise UsageError(f"a co-partitioned run needs two or more inputs, got {names}")
    if len(set(names)) != len(names):
        raise UsageError(f"input names must be unique, got {names}")
    groups = [(i.stream, i.group) for i in inputs]
    if len(set(groups)) != len(groups):
        raise UsageError(f"each input must be its own group, got {groups}")
    if set(names) != set(processor.inputs):
        raise UsageError(f"inputs {sorted(names)} are not the processor's "
                         f"{sorted(processor.inputs)}")
    if not isinstance(sink, JoinSink):
        raise EngineConfigError(f"{type(sink).__name__} cannot commit several inputs' "
                                "watermarks at once (no commit_inputs): use DeltaSink or "
                                "IcebergSink")
    if processor.state is not None and not isinstance(sink, StateSink):
        raise EngineConfigError(f"the processor declares per-key state but "
                                f"{type(sink).__name__} has no last_rows")
    if opt.dead_letter_policy != "dlq":
        raise EngineConfigError("a co-partitioned run supports dead_letter_policy='dlq' only")


def tag_hook(hook: Hook | None, name: str) -> Hook | None:
    """``hook`` with ``input=<name>`` added to every step's info."""
    if hook is None:
        return None

    def tagged(step: str, info: dict[str, object]) -> None:
        hook(step, {**info, "input": name})
    return tagged


class _JoinRun:
    """The batch loop of one co-partitioned run over its leased sides."""

    def __init__(self, sides: list[_Side], names: list[str], partition: int,
                 processor: JoinProcessor, sink: JoinSink, opt: EngineOptions,
                 hook: Hook | None) -> None:
        self.sides, self.names, self.partition = sides, names, partition
        self.by_name = {s.inp.name: s for s in sides}
        self.processor, self.sink, self.opt, self.hook = processor, sink, opt, hook
        self.res = JoinResult(partition, inputs={s.inp.name: s.ctx.res for s in sides})
        self.t0 = time.monotonic()
        self.state = self._state_cache()
        # The commit is fenced against the snapshot the first input's watermark read loads.
        self.primary = self.by_name[names[0]]

    def _state_cache(self) -> KeyStateCache | None:
        spec, sink = self.processor.state, self.sink
        if spec is None:
            return None
        assert isinstance(sink, StateSink)
        p = self.partition
        return KeyStateCache(spec, lambda keys: sink.last_rows(
            spec.key, keys, spec.read_columns, spec.order_by, p), getattr(sink, "write", None))

    def step(self, name: str, **info: object) -> None:
        if self.hook is not None:
            self.hook(name, info)

    def timed(self, key: str, t: float) -> None:
        self.res.timings[key] = self.res.timings.get(key, 0.0) + time.monotonic() - t

    async def run(self) -> None:
        """Lease every input, then batch after batch until every input's backlog present at
        the start is committed, a limit is hit, or a fence stops the run."""
        for side in self.sides:
            c = side.ctx
            info = await c.retry.call("stream info", partial(c.api.stream_info, c.read_stream))
            side.start_last = int(info["state"].get("last_seq") or 0)
            side.lease = await side.holder.take()
            if side.lease is None and c.res.status == "held":
                await self._put_back_all()
                self.res.status, self.res.detail = "held", f"input {side.inp.name}: " \
                    f"{c.res.detail}"
                return
        try:
            while await self._batch():
                pass
        finally:
            for side in self.sides:
                if side.lease is not None:
                    await side.holder.release(side.lease)
        if self.res.status == "drained":
            await self._maintain()

    async def _put_back_all(self) -> None:
        for side in self.sides:
            if side.lease is not None:
                await side.holder.put_back(side.lease)
                side.lease = None

    def _limit_hit(self) -> bool:
        o = self.opt
        if o.max_messages is not None and self.res.processed >= o.max_messages:
            return True
        return o.max_seconds is not None and time.monotonic() - self.t0 >= o.max_seconds

    async def _put_back_late(self) -> None:
        """Leases of messages that arrived after the run started wait for the next run."""
        for side in self.sides:
            if side.lease is not None and side.lease.seq > side.start_last:
                await side.holder.put_back(side.lease)
                side.lease = None

    async def _batch(self) -> bool:
        """One batch, steps 2-7. False: the run ends (status set)."""
        await self._put_back_late()
        if all(s.lease is None for s in self.sides):
            self.res.status = "drained" if self.res.commits or any(
                r.duplicates_skipped for r in self.res.inputs.values()) else "empty"
            return False
        if self._limit_hit():
            await self._put_back_all()
            self.res.status = "limit"
            return False
        watermarks = await self._watermarks()
        await self._put_back_late()
        if all(s.lease is None for s in self.sides) or not await self._read(watermarks):
            return True  # a lease was settled or re-read: decide again
        batches = {n: self.by_name[n].records or RECORD_SCHEMA.empty_table()
                   for n in self.names}
        ctx = JoinContext(self.partition, {n: _bounds(b) for n, b in batches.items()},
                          {n: self.by_name[n].ctx.app_id for n in self.names}, self.sink,
                          self.state)
        t = time.monotonic()
        out = await asyncio.to_thread(self.processor.process_inputs, batches, ctx)
        self.timed("process", t)
        dead = self._check_dead(out.dead, batches)
        table = with_partition_column(out.table, self.partition)
        if self.state is not None:
            self.state.update(table)
        self.step("processed", ranges=dict(ctx.ranges))
        await self._dead_letter(dead, batches)
        if not await self._commit(table, watermarks, batches):
            return False
        self._count(table, dead, batches)
        await self._settle(batches)
        return True

    async def _watermarks(self) -> dict[str, int]:
        """Step 2: every input's committed watermark (the first input's read first), and the
        leases at or below theirs settled (committed by a run that stopped before its acks)."""
        t = time.monotonic()
        out: dict[str, int] = {}
        for name in self.names:
            side = self.by_name[name]
            out[name] = await asyncio.to_thread(self.sink.watermark, side.ctx.app_id)
            side.ctx.res.watermark = out[name]
            side.ctx.watermark_read = True
        self.timed("watermark", t)
        for side in self.sides:
            while side.lease is not None and side.lease.seq <= out[side.inp.name]:
                await self._purge(side, out[side.inp.name] + 1)
                await side.holder.ack(side.lease)
                side.ctx.res.duplicates_skipped += 1
                side.lease = await side.holder.next(side.lease)
        return out

    async def _read(self, watermarks: dict[str, int]) -> bool:
        """Step 3 for every leased input. False when an input's read came back empty and its
        lease was settled (purged after a commit, crash before the ack) or must be read again:
        the caller starts the batch over."""
        t = time.monotonic()
        for side in self.sides:
            side.records = None
            if side.lease is None:
                continue
            c, o = side.ctx, self.opt
            first = max(side.lease.seq, watermarks[side.inp.name] + 1)
            got = await c.retry.call("read", partial(
                read_range, c.nc, c.read_stream, first, filter_subject=c.flt,
                prefix=f"{c.partition}.", max_msgs=o.batch_max_msgs,
                max_bytes=o.batch_max_bytes, last_seq=side.start_last, timeout_s=o.timeout_s,
                drop_nats_headers=True))
            records = got.table(origin=True).cast(RECORD_SCHEMA)
            if records.num_rows == 0:
                if not await c.retry.call("confirm the empty range", partial(
                        confirm_empty_range, c.api, c.read_stream, c.flt, first,
                        side.start_last)):
                    await side.holder.ack(side.lease)
                    side.lease = await side.holder.next(side.lease)
                return False
            side.records = records
            c.inflight = bounds = (records["seq"][0].as_py(), records["seq"][-1].as_py())
            side.ctx.step("read", first_seq=bounds[0], last_seq=bounds[1])
        self.timed("read", t)
        return True

    def _check_dead(self, dead: dict[str, list[DeadLetter]], batches: dict[str, pa.Table]
                    ) -> dict[str, list[DeadLetter]]:
        unknown_inputs = sorted(set(dead) - set(batches))
        if unknown_inputs:
            raise ContractError(f"processing step dead-lettered messages of unknown inputs "
                                f"{unknown_inputs}")
        for name, letters in dead.items():
            seqs = set(batches[name]["seq"].to_pylist())
            unknown = [d.seq for d in letters if d.seq not in seqs]
            if unknown:
                raise ContractError(f"processing step dead-lettered sequences not in input "
                                    f"{name!r}'s batch: {unknown[:5]}")
        return {n: sorted(d, key=lambda x: x.seq) for n, d in dead.items() if d}

    async def _dead_letter(self, dead: dict[str, list[DeadLetter]],
                           batches: dict[str, pa.Table]) -> None:
        """Step 5: each input's dead letters to its group's DLQ (idempotent: Nats-Msg-Id)."""
        for name, letters in dead.items():
            side, c = self.by_name[name], self.by_name[name].ctx
            if not side.dlq_ready:
                await c.retry.call("create the DLQ stream", partial(
                    ensure_dlq_stream, c.api, c.stream, c.group,
                    max_age_s=c.opt.dlq_max_age_s))
                side.dlq_ready = True
            c.res.dead_lettered += await c.retry.call("publish dead letters", partial(
                publish_dead_letters, c.js, origin_stream=c.stream, read_stream=c.read_stream,
                group=c.group, partition=c.partition, batch=batches[name], dead=letters,
                timeout=c.opt.timeout_s))

    async def _commit(self, table: pa.Table | None, watermarks: dict[str, int],
                      batches: dict[str, pa.Table]) -> bool:
        """Step 6: one commit, fenced on every input. False: fenced (status set)."""
        fences: dict[str, tuple[int, int]] = {}
        markers: dict[str, int] = {}
        lineage: list[dict[str, object]] = []
        for name in self.names:
            side, batch = self.by_name[name], batches[name]
            wm = watermarks[name]
            bounds = _bounds(batch)
            fences[side.ctx.app_id] = (wm, bounds[1] if bounds else wm)
            origin = _last_origin(batch)
            if origin is not None:
                markers[origin_marker(side.ctx.app_id)] = origin
            col = batch["origin_seq"].drop_null()
            lineage.append({"name": name, "stream": side.inp.stream, "group": side.inp.group,
                            "app_id": side.ctx.app_id,
                            "first_seq": bounds[0] if bounds else None,
                            "last_seq": bounds[1] if bounds else None,
                            "last_origin_seq": origin,
                            "coverage": encode_seqs(col.to_numpy()) if len(col) else None})
        t = time.monotonic()
        try:
            await asyncio.to_thread(
                self.sink.commit_inputs, table, fences, markers or None,
                lineage={"partition": self.partition,
                         JOIN_LINEAGE_KEY: json.dumps(lineage, separators=(",", ":"))})
        except FenceConflictError as e:
            self.res.status = "fenced"
            self.res.detail = f"{e}; a newer holder owns this partition, stopping"
            for side in self.sides:
                side.ctx.res.fence_conflicts += 1
                if side.lease is not None:  # unacknowledged: redelivered to the next holder
                    await side.holder.release(side.lease)
            return False
        self.timed("commit", t)
        self.res.commits += 1
        self.step("committed", commits=self.res.commits,
                  seconds=time.monotonic() - self.t0)
        return True

    def _count(self, table: pa.Table | None, dead: dict[str, list[DeadLetter]],
               batches: dict[str, pa.Table]) -> None:
        self.res.rows_written += table.num_rows if table is not None else 0
        for name, batch in batches.items():
            bounds = _bounds(batch)
            if bounds is None:
                continue
            r = self.by_name[name].ctx.res
            r.commits += 1
            r.watermark = bounds[1]
            r.processed += batch.num_rows - len(dead.get(name, ()))
            r.first_seq = r.first_seq or bounds[0]
            r.last_seq = bounds[1]

    async def _settle(self, batches: dict[str, pa.Table]) -> None:
        """Step 7 for each input that had messages: purge, ack, next lease."""
        t = time.monotonic()
        for side in self.sides:
            bounds = _bounds(batches[side.inp.name])
            if bounds is None or side.lease is None:
                continue
            await side.holder.release(side.lease)
            await self._purge(side, bounds[1] + 1)
            side.ctx.step("purged", last_seq=bounds[1])
            await side.holder.ack(side.lease)
            side.ctx.settled_through = bounds[1]
            side.ctx.inflight = None
            side.ctx.step("acked", first_seq=bounds[0], last_seq=bounds[1])
            side.lease = await side.holder.next(side.lease)
        self.timed("settle", t)

    @staticmethod
    async def _purge(side: _Side, below: int) -> None:
        c = side.ctx
        await c.retry.call("purge", lambda: c.api.purge(c.read_stream, filter=c.flt,
                                                        seq=below))

    async def _maintain(self) -> None:
        """The sink's upkeep of the partition after the last commit, under the leases."""
        if self.res.commits == 0 or not isinstance(self.sink, MaintainedSink):
            return
        t = time.monotonic()
        self.res.maintenance = await asyncio.to_thread(
            self.sink.maintain, self.partition, self.primary.ctx.app_id)
        self.timed("maintain", t)


def _bounds(batch: pa.Table) -> tuple[int, int] | None:
    """First and last sequence of a batch, None when empty."""
    if batch.num_rows == 0:
        return None
    seqs = batch["seq"]
    return seqs[0].as_py(), seqs[len(seqs) - 1].as_py()


def _last_origin(batch: pa.Table) -> int | None:
    col = batch["origin_seq"]
    return col[len(col) - 1].as_py() if len(col) else None

