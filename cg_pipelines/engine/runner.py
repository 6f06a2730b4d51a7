"""The ordered partition engine: lease-and-range over an elastic group's work-queue stream.

Algorithm (the draining rule: a partition changes hands only after the old holder's in-flight
work is committed or abandoned):

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

Where each part lives: the options in :mod:`~cg_pipelines.engine.options`; the lease (step 1,
the pin, keep-alive, ack, unpin and give-back rules) in :mod:`~cg_pipelines.engine.lease`;
what each step does to one side (a partition of one group) in :mod:`~cg_pipelines.engine.side`;
steps 2-5 as the run loop over a run's sides in :mod:`~cg_pipelines.engine.drain` (one loop for
a partition run and a co-partitioned one, :mod:`~cg_pipelines.engine.join`); the processing
step over the sides in :mod:`~cg_pipelines.engine.step`; the commit in
:mod:`~cg_pipelines.engine.commit`; the executor-read protocol in
:mod:`~cg_pipelines.engine.executor_read`; the contracts in
:mod:`~cg_pipelines.engine.processor` (the processing step), :mod:`~cg_pipelines.sinks.base`
(the sink) and :mod:`~cg_pipelines.engine.result` (what a run returns). This module runs them
over one partition (:func:`run_partition`), several partitions of one group
(:func:`run_partitions`) or any set of sides (:func:`run_sides`).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from numbers import Integral
from typing import cast

from nats.aio.client import Client

from cg_pipelines.core.errors import ConfigError, UsageError
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.context import check_sink, follow_lineage, open_run
from cg_pipelines.engine.drain import Drain
from cg_pipelines.engine.lease import LeaseHolder, guard_all, guard_each, lease_consumer_name
from cg_pipelines.engine.options import EngineConfigError, EngineOptions, Hook
from cg_pipelines.engine.processor import Processor
from cg_pipelines.engine.result import RunResult
from cg_pipelines.engine.side import Side
from cg_pipelines.engine.step import BatchStep, RangeStep
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.sinks.base import TableSink

__all__ = ["check_partitions", "run_partition", "run_partitions", "run_sides"]


async def run_sides(sides: Sequence[Side], step: BatchStep, hook: Hook | None, *,
                    after_start: Callable[[], Awaitable[None]] | None = None) -> RunResult:
    """Run the loop (:class:`~cg_pipelines.engine.drain.Drain`) over ``sides`` (in the run's
    order; their contexts share one :class:`RunResult`) with the processing step ``step``
    (``after_start``: awaited once the sides started, before the first batch), each side's
    lease guarded (in leasing order): on any failure every lease taken is given
    back (nak and unpin) before the exception propagates, a
    :class:`~cg_pipelines.core.errors.PartitionRunError` attached.

    Returns:
        The run's :class:`RunResult` (``seconds`` set).

    Raises:
        Whatever the run raises (see :func:`run_partition`).
    """
    loop = Drain(sides, step, hook, after_start=after_start)
    await guard_all([(s.holder, s.holder.ensure) for s in loop.leasing], loop.run)
    return loop.res


async def run_partition(
    nc: Client,
    stream: str,
    group: str,
    partition: int,
    processor: Processor,
    sink: TableSink,
    options: EngineOptions | None = None,
    *,
    hook: Hook | None = None,
    connect: ConnectOptions | None = None,
) -> RunResult:
    """Drain one partition of an elastic group with lease-and-range (see module docstring):
    :func:`run_partitions` over ``[partition]`` (the run loop over one side).

    Args:
        nc: a connected nats-py client.
        stream, group: the origin stream and elastic group (work-queue stream
            ``<stream>-<group>`` must exist: :func:`cg_pipelines.jetstream.admin.create_elastic`).
        partition: 0 <= partition < max_members.
        processor: the processing step; sink: where effects commit, fenced.
        options: :class:`EngineOptions`; hook: step callback (fault injection, progress).
        connect: the :class:`~cg_pipelines.jetstream.connect.ConnectOptions` ``nc`` was made
            with, for the executor read (Spark executors connect with its servers, credentials
            and files). Not needed when ``nc`` came from ``ConnectOptions.connect`` (the
            library knows those); without it, a connection whose credentials nats-py does not
            show (creds file, NKey seed) is read on the driver.

    Returns:
        A :class:`RunResult`; ``status`` says how the run ended. "Held by another instance",
        "fenced" and "halted" are results, not exceptions.

    Raises:
        ConfigError: ``partition`` is negative.
        EngineConfigError: the lease consumer cannot be created as required.
        NatsUnavailableError: NATS stayed unreachable for ``options.nats_retry_max_s`` seconds
            (each NATS step is retried with backoff until then); nothing acknowledged that was
            not committed, and the next run resumes from the watermark.
        JetStreamError: other NATS API failures (same guarantee).
        Exceptions of the processing step or the sink (other than fence conflicts), unchanged.

    On any failure (a cancellation included) the run gives the partition back before raising:
    the held lease is nak'ed and the pin released, so an immediate retry is not ``held``. The
    exception is raised as it was, with a :class:`~cg_pipelines.core.errors.PartitionRunError`
    attached (``PartitionRunError.of(exc)``): the partition, the sequences in flight and what
    was committed and acknowledged, the exception as its cause.
    """
    if partition < 0:  # as every entry point says it (open_run)
        raise ConfigError("partition", f"must be >= 0, got {partition}")
    return await run_partitions(nc, stream, group, [partition], processor, sink, options,
                                hook=hook, connect=connect)


def check_partitions(partitions: Sequence[int]) -> list[int]:
    """``partitions`` as a list, checked before anything is sent or read.

    Raises:
        UsageError: empty, not integers (``bool`` included), or repeated (each is named).
        ConfigError: a partition is negative (as every entry point says it).
    """
    parts = list(partitions) if not isinstance(partitions, (str, bytes)) else [partitions]
    if not parts:
        raise UsageError("partitions: a run needs one partition or more, got none")
    bad = [p for p in parts if not isinstance(p, Integral) or isinstance(p, bool)]
    if bad:
        raise UsageError(f"partitions must be integers, got {bad[:5]!r}")
    ints = [operator.index(cast(int, p)) for p in parts]  # numpy integers become ints
    negative = [p for p in ints if p < 0]
    if negative:
        raise ConfigError("partitions", f"must be >= 0, got {negative[:5]}")
    repeated = sorted(p for p, n in Counter(ints).items() if n > 1)
    if repeated:
        raise UsageError(f"partitions must be distinct, repeated: {repeated[:5]}")
    return ints


async def run_partitions(
    nc: Client,
    stream: str,
    group: str,
    partitions: Sequence[int],
    processor: Processor,
    sink: TableSink,
    options: EngineOptions | None = None,
    *,
    hook: Hook | None = None,
    connect: ConnectOptions | None = None,
) -> RunResult:
    """Drain several partitions of one elastic group in one run: the run loop over one
    independent side per partition (:class:`~cg_pipelines.engine.drain.Drain` with
    ``independent``), one fenced commit per batch for the partitions in it.

    Each partition keeps what a one-partition run (:func:`run_partition`) gives it: its own
    lease consumer ``partition-<p>``, watermark key ``<stream>/<group>/<p>`` (its fence), dead
    letters, per-key state (read from and kept for that partition only), ``_partition`` column
    on its rows and :class:`~cg_pipelines.engine.result.SideResult`. ``processor`` is the
    ordinary one-input processor, called once per partition with records in a batch, with
    that partition's :class:`~cg_pipelines.engine.processor.BatchContext`
    (:class:`~cg_pipelines.engine.step.RangeStep`): a transform written for one partition runs
    unchanged. A batch holds at most ``options.batch_max_msgs`` messages in all, shared out
    among the partitions still leased (``batch_max_bytes`` applies per partition).

    Ownership: a partition another run holds (a one-partition run, a run over another range)
    is not processed and holds up no other partition: its side is ``held`` and the run drains
    the others; no key is processed by two runs (one holder per lease, fenced commits). Over
    several partitions, one drained while the others go on is given up at once (its pin
    released), so its next run need not wait for this one to end; the sink's upkeep of it
    still runs at the run's end (see ``notes/RANGE_RUNS.md``: the upkeep contract says "while
    the lease is held"; the upkeep only does less on a snapshot another holder moved past).

    Over one partition this is :func:`run_partition`'s run exactly (it calls this):
    the same commits and lineage, statuses, pin and upkeep order, executor read.

    A fence conflict (another holder committed a partition of the batch) stops the whole run
    (status ``fenced``): nothing of the refused batch was acknowledged; the other partitions'
    leases are put back at once. A ``halt`` stops the whole run too.

    Args:
        nc: a connected nats-py client.
        stream, group: the origin stream and elastic group (its work queue must exist).
        partitions: the partitions to drain, each ``0 <= p < max_members``, distinct, in the
            run's order (the first's watermark key is the run's ``RunResult.partition``;
            leases are taken in ascending order).
        processor, sink, options, hook, connect: as :func:`run_partition` (``hook``: the
            per-partition steps ``leased``, ``read``, ``purged``, ``acked`` carry
            ``partition``; ``processed`` and ``committed`` are the run's, with ``ranges``:
            each side's first and last sequence by side name ``<stream>/<group>/<p>``).

    Returns:
        A :class:`RunResult`: ``inputs`` holds each partition's :class:`SideResult` by its app
        id ``<stream>/<group>/<p>``, with its own ``status`` (``held``, ``empty``,
        ``drained``, ``limit``, ``handed_over``; ``fenced``/``halted`` when the run stopped
        with it) and ``detail``. The run's ``status``: ``fenced``/``halted`` when it stopped,
        else ``limit`` when a limit stopped a partition, ``drained`` when one was leased
        (others may be held: read ``inputs``), ``held`` when none was and one is held,
        ``empty`` otherwise; ``detail`` names the partitions held or handed over. Counts are
        summed over the partitions.

    Raises:
        UsageError: ``partitions`` is empty, repeats one, or holds a non-integer (before
            anything is sent or read).
        ConfigError: a partition is negative (before anything is sent or read).
        EngineConfigError: ``sink`` is not a table sink, or an Iceberg sink in Merge mode with
            more than one partition (before any I/O); or a lease consumer cannot be created
            as required.
        NatsUnavailableError / JetStreamError / the processor's and the sink's errors: as
            :func:`run_partition`; every lease taken is given back first (nak and unpin),
            nothing acknowledged that was not committed; the
            :class:`~cg_pipelines.core.errors.PartitionRunError` attached is the partition's
            with a batch in flight.
    """
    parts = check_partitions(partitions)
    check_sink(sink)
    if len(parts) > 1 and sink.table_format == "iceberg" and isinstance(sink.write, Merge):
        raise EngineConfigError(
            "a run over several partitions commits rows of several partitions at once, which "
            "IcebergSink's Merge mode refuses (one partition per merge): run the partitions "
            "one by one (run_partition), or use Append or DeltaSink")
    res = RunResult({})
    ctxs = [open_run(nc, stream, group, p, processor, sink, options, tag_partition(hook, p),
                     connect=connect, res=res) for p in parts]
    for c in ctxs:
        c.independent = True
    sides = [Side(c, LeaseHolder(c, lease_consumer_name(c.partition))) for c in ctxs]
    for s in sides:  # one partition: its pin goes at the end, after the upkeep, as ever
        s.holder.unpin_when_drained = len(sides) > 1
    loop = Drain(sides, RangeStep(ctxs), hook, independent=True,
                 after_start=lambda: follow_lineage(ctxs))
    await guard_each([s.holder for s in loop.leasing], loop.run)
    return loop.res


def tag_partition(hook: Hook | None, partition: int) -> Hook | None:
    """``hook`` with ``partition=<partition>`` added to every per-side step's info."""
    if hook is None:
        return None

    def tagged(step: str, info: dict[str, object]) -> None:
        hook(step, {**info, "partition": partition})
    return tagged
