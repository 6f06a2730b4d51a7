"""What one side of a run knows and tells: its partition, stream, processor, sink and options,
the NATS API and retrier it calls through, the run's result so far (its own facts in it) and
its progress (what is in flight, committed, acknowledged). The lease
(:mod:`cg_pipelines.engine.lease`), the side's steps (:mod:`cg_pipelines.engine.side`) and the
run loop (:mod:`cg_pipelines.engine.drain`) of an elastic, a static, a co-partitioned or a
rebuild run share it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pyarrow as pa
from nats.aio.client import Client

from cg_pipelines.core.batching import CostModel
from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.core.errors import ConfigError, PartitionRunError
from cg_pipelines.core.state import KeyedState, merge_last
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.options import EngineConfigError, EngineOptions, Hook
from cg_pipelines.engine.processor import Processor, with_defaults
from cg_pipelines.engine.result import RunResult, RunStatus, SideResult
from cg_pipelines.engine.retry import Retrier
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.connect import ConnectOptions, connect_options_of
from cg_pipelines.jetstream.migration import get_lineage
from cg_pipelines.sinks.base import TableSink, app_id_for, missing_members

__all__ = ["RunContext", "Stateful", "check_sink", "open_run", "state_cache"]


class RunContext:
    """One side's identity, tools, result and progress (a partition run has one side).

    Attributes:
        read_stream: the stream the run reads and leases on (an elastic group's work queue
            ``<stream>-<group>``; a static group's origin stream, ``stream`` itself).
        flt: the partition's subjects there (``<p>.>``).
        app_id: the partition's watermark key in the sink.
        processor: the processor, every hook declared (:func:`~cg_pipelines.engine.processor.
            with_defaults`).
        res: the run's :class:`~cg_pipelines.engine.result.RunResult` so far (shared by the
            run's sides).
        name: the side's name in ``res.inputs``; side: its
            :class:`~cg_pipelines.engine.result.SideResult` there.
        pending: the partition's backlog when the run started (consumer pending + ack pending).
        inflight: first and last sequence of the batch being processed, or None.
        watermark_read: ``res.watermark`` holds the sink's committed watermark.
        settled_through: purged/acknowledged through this sequence (0: none).
        state: the per-key state cache (:func:`state_cache`), or None.
        cost: the cost model batch sizing learns into.
        connect: the :class:`~cg_pipelines.jetstream.connect.ConnectOptions` ``nc`` was made
            with (given, or known from
            :func:`~cg_pipelines.jetstream.connect.connect_options_of`), or None: what Spark
            executors connect with.
        independent: the side ends on its own (a run over several partitions of one group):
            how it ends (:meth:`end`) is its own ``side.status``, not the run's.
    """

    def __init__(
        self, nc: Client, stream: str, group: str, partition: int, processor: Processor,
        sink: TableSink, options: EngineOptions, hook: Hook | None, *,
        read_stream: str | None = None, connect: ConnectOptions | None = None,
        res: RunResult | None = None, name: str | None = None,
    ) -> None:
        check_sink(sink)
        self.nc, self.js = nc, nc.jetstream(timeout=options.timeout_s)
        self.connect = connect or connect_options_of(nc)
        self.stream, self.group, self.partition = stream, group, partition
        self.read_stream = read_stream or work_queue_stream_name(stream, group)
        self.flt = f"{partition}.>"
        self.app_id = app_id_for(stream, group, partition)
        self.processor = with_defaults(processor)
        self.sink, self.opt, self.hook = sink, options, hook
        self.api = JetStreamAPI(nc, timeout=options.timeout_s)
        self.name = name or self.app_id
        self.side = SideResult(stream, group, partition)
        self.res = res if res is not None else RunResult({})
        self.res.inputs[self.name] = self.side
        self.t0 = time.monotonic()
        self.pending = 0
        self.inflight: tuple[int, int] | None = None
        self.watermark_read = False
        self.settled_through = 0
        self.independent = False
        self.parents: tuple[int, ...] = ()  # set by follow_lineage once the side started
        self.state = state_cache(self.processor, sink, partition, self.app_id,
                                 lambda: self.parents)
        self.cost = self.processor.cost_model or CostModel()
        self.retry = Retrier(nc, options.nats_retry_max_s, options.nats_retry_backoff_s,
                             options.nats_retry_max_backoff_s,
                             f"partition {partition} of {work_queue_stream_name(stream, group)}",
                             on_retry=self._on_retry)

    def _on_retry(self, step: str, attempt: int, exc: BaseException) -> None:
        self.side.nats_retries += 1
        self.step("retry", step=step, attempt=attempt, error=type(exc).__name__)

    def step(self, name: str, **info: Any) -> None:
        """Tell the hook (if any) that step ``name`` is done."""
        if self.hook is not None:
            self.hook(name, info)

    def end(self, status: RunStatus, detail: str | None = None) -> None:
        """Record how the side ended (``detail``: why, None: unchanged): on its own
        :class:`~cg_pipelines.engine.result.SideResult` when it is ``independent``, else on the
        run's result (the run ends with it)."""
        target: SideResult | RunResult = self.side if self.independent else self.res
        target.status = status
        if detail is not None:
            target.detail = detail

    @property
    def status(self) -> RunStatus | None:
        """How the side ended so far (:meth:`end`): its own status when ``independent``, else
        the run's."""
        return self.side.status if self.independent else self.res.status

    def timed(self, key: str, t: float) -> None:
        """Add the seconds since ``t`` (a ``time.monotonic()``) to ``res.timings[key]``."""
        self.res.timings[key] = self.res.timings.get(key, 0.0) + (time.monotonic() - t)

    def limit_hit(self) -> bool:
        """The run reached ``max_messages`` or ``max_seconds``: start no new batch."""
        o = self.opt
        if o.max_messages is not None and self.res.processed >= o.max_messages:
            return True
        return o.max_seconds is not None and time.monotonic() - self.t0 >= o.max_seconds

    def failure(self, error: BaseException) -> PartitionRunError:
        """The run's :class:`~cg_pipelines.core.errors.PartitionRunError` for ``error``: the
        partition, the sequence range in flight, and what was committed and acknowledged (so
        an operator knows nothing was lost), with ``error`` as its cause."""
        res = self.res
        return PartitionRunError(
            error, stream=self.stream, group=self.group, read_stream=self.read_stream,
            partition=self.partition, inflight=self.inflight,
            committed_through=self.side.watermark if self.watermark_read else None,
            acknowledged_through=self.settled_through, commits=res.commits)


def open_run(
    nc: Client, stream: str, group: str, partition: int, processor: Processor, sink: TableSink,
    options: EngineOptions | None, hook: Hook | None, *, read_stream: str | None = None,
    connect: ConnectOptions | None = None, res: RunResult | None = None, name: str | None = None,
) -> RunContext:
    """The preamble every engine entry point shares
    (:func:`~cg_pipelines.engine.runner.run_partition`,
    :func:`~cg_pipelines.engine.static.run_static_partition`,
    :func:`~cg_pipelines.engine.rebuild.rebuild_partition`, and each side of the
    co-partitioned ones): check the arguments and make the side's :class:`RunContext`
    (``options`` default to :class:`EngineOptions` ``()``; ``res``: the run's result the
    side's facts join, a new one when None; ``name``: the side's name there, default its app
    id). Nothing is sent to NATS or read from the sink yet.

    Raises:
        ConfigError: ``partition`` is negative.
        EngineConfigError: ``sink`` is not a table sink (:func:`check_sink`).
    """
    if partition < 0:
        raise ConfigError("partition", f"must be >= 0, got {partition}")
    return RunContext(nc, stream, group, partition, processor, sink, options or EngineOptions(),
                      hook, read_stream=read_stream, connect=connect, res=res, name=name)


class Stateful(Protocol):
    """A processing step that may declare per-key state (a :class:`~cg_pipelines.engine.
    processor.Processor` or a :class:`~cg_pipelines.engine.join_processor.JoinProcessor`)."""

    state: KeyedState | None


async def follow_lineage(ctxs: Sequence[RunContext]) -> None:
    """After the group was migrated to a new partition count (its lineage, one KV read, has
    several epochs): give each side the partitions its moved keys' state is read from
    (``ctx.parents``, :func:`state_cache`).

    Called once the sides started (their ``start_last`` is read): a run that reads a message
    of a new epoch started after that epoch's source was added, which the migration does only
    after writing the lineage, so the run sees it (read before the start, it could miss it).

    Raises:
        EngineConfigError: the sink writes in :class:`~cg_pipelines.core.write.Merge` mode
            (a moved key's current row stays under its old partition, and a merge matches
            within the batch's partition: the key would get a second current row).
    """
    first = ctxs[0]
    lineage = await get_lineage(first.js, first.stream, first.group)
    if lineage is None or len(lineage.epochs) < 2:
        return
    for c in ctxs:
        if isinstance(c.sink.write, Merge):
            raise EngineConfigError(
                f"group {c.stream}.{c.group} was migrated from "
                f"{lineage.epochs[-2].partitions} to {lineage.partitions} partitions: a Merge "
                "table cannot follow it yet (a moved key's current row stays under its old "
                "partition); use an Append table, or a new group and a rebuild")
        c.parents = lineage.parents(c.partition)


async def refuse_after_migration(ctxs: Sequence[RunContext], what: str) -> None:
    """Refuse ``what`` (a rebuild) on a group migrated to a new partition count (its lineage
    has several epochs; one KV read per group).

    Raises:
        EngineConfigError: naming the group, its counts and why.
    """
    for c in ctxs:
        lineage = await get_lineage(c.js, c.stream, c.group)
        if lineage is not None and len(lineage.epochs) > 1:
            raise EngineConfigError(
                f"{what} of group {c.stream}.{c.group}, migrated from "
                f"{lineage.epochs[-2].partitions} to {lineage.partitions} partitions, is not "
                "supported yet: a rebuild replays a key's whole history into its current "
                "partition while its rows from before the migration stay under the old one")


async def follow_set_lineage(ctxs: Sequence[RunContext]) -> None:
    """For a co-partitioned run, once its sides started (as :func:`follow_lineage`): the
    partitions of earlier epochs its state reads a moved key from, on the first side (whose
    app id the join's state reads use; empty when the set was never migrated). One KV read
    per group.

    Raises:
        EngineConfigError: the groups were not migrated together (the partition counts'
            histories of the migrated ones differ), or the sink writes in Merge mode after a
            migration (as :func:`follow_lineage`).
    """
    got = [await get_lineage(c.js, c.stream, c.group) for c in ctxs]
    migrated = [lin for lin in got if lin is not None and len(lin.epochs) > 1]
    if not migrated:
        return
    # a group whose earlier epochs held no message has one epoch: nothing of it moved
    counts = {tuple(e.partitions for e in lin.epochs) for lin in migrated}
    first = ctxs[0]
    if len(counts) > 1:
        raise EngineConfigError(
            f"the groups of partition {first.partition}'s co-partitioned run were not migrated "
            f"together (partition counts over time: "
            f"{sorted(str(c) for c in counts)}): migrate them with one cg elastic migrate "
            "--co-partitioned call")
    if isinstance(first.sink.write, Merge):
        raise EngineConfigError(
            f"the co-partitioned set of {first.stream}.{first.group} was migrated to "
            f"{migrated[0].partitions} partitions: a Merge table cannot follow it yet (a "
            "moved key's current row stays under its old partition); use an Append table")
    first.parents = migrated[0].parents(first.partition)


def check_sink(sink: object) -> None:
    """Check once, before a run starts, that ``sink`` has every member of
    :class:`~cg_pipelines.sinks.base.TableSink` (the one contract every run, one input or
    many, drain or rebuild, relies on).

    Raises:
        EngineConfigError: members are missing (named), e.g. a hand-written sink without
            ``replace_partition``.
    """
    missing = missing_members(sink)
    if missing:
        raise EngineConfigError(
            f"{type(sink).__name__} is not a table sink: it lacks {', '.join(missing)} "
            "(cg_pipelines.sinks.base.TableSink; DeltaSink, IcebergSink and "
            "cg_pipelines.testing.MemorySink have them all)")


def state_cache(processor: Stateful, sink: TableSink, partition: int, app_id: str,
                parents: Callable[[], Sequence[int]] = tuple) -> KeyStateCache | None:
    """The run's per-key state cache when the processor declares
    :class:`~cg_pipelines.core.state.KeyedState` (``processor.state``), else ``None``. It
    reads what it misses with ``sink.last_rows(..., partition, app_id=app_id)`` (the run's
    identity: :meth:`TableSink.last_rows <cg_pipelines.sinks.base.TableSink.last_rows>`).

    ``parents``: asked at each read (the run learns them once its sides started,
    :func:`follow_lineage`): after the group was migrated to a new partition count, the
    partitions of earlier epochs that may hold the last rows of this partition's keys
    (:meth:`~cg_pipelines.core.migration.Lineage.parents`); a key with no row in
    ``partition`` is looked up there (its newest row wins, by the state's ``order_by``)."""
    spec = processor.state
    if spec is None:
        return None

    def read(keys: Sequence[object]) -> pa.Table:
        got = sink.last_rows(spec.key, keys, spec.read_columns, spec.order_by, partition,
                             app_id=app_id)
        olds = parents()
        if not olds:
            return got
        found = set(got[spec.key].to_pylist()) if got.num_rows else set()
        moved = [k for k in keys if k not in found]
        for q in olds:
            if not moved:
                break
            old = sink.last_rows(spec.key, moved, spec.read_columns, spec.order_by, q,
                                 app_id=app_id)
            if old.num_rows:
                got = merge_last(got if got.num_rows else None, old, spec)
        return got

    return KeyStateCache(spec, read, sink.write)
