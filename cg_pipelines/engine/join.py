"""Co-partitioned runs: partition ``p`` of several consumer groups, drained together, committed
once (the stream-join case of KIP-315, ``../shared/seeds/``: "all of the topics for a given
partition must go to the same consumer").

The groups of a co-partitioned set (:mod:`cg_pipelines.core.copartition`) partition different
streams on the same key into the same number of partitions, so partition ``p`` of every group
holds the same keys. One run for ``p`` is the engine's run loop (:mod:`cg_pipelines.engine.drain`)
over one side per input, exactly as a partition run is that loop over one side:

1. **Lease** partition ``p`` of every input, one after the other in a fixed order (sorted by
   stream, then group: two runs never hold one lease each and wait for the other's), each
   exactly as a single-input run (:mod:`cg_pipelines.engine.lease`). An input held by another
   instance makes the run ``held``: the leases already taken are put back at once. An input
   with no backlog is not leased; it has an empty batch.
2. **Watermarks** of every input (the first input's read first: the commit is fenced against
   the snapshot that read loaded, and the run's state reads use it). A lease at or below its
   input's watermark was committed by an earlier run that stopped before its
   acknowledgements: finish them (purge, ack).
3. **Read** each leased input's range after its watermark, in its stream order, up to the batch
   limits and never past that input's last sequence when the run started (batched direct get,
   nothing consumed; :func:`~cg_pipelines.jetstream.rangeread.read_range`), read ahead while
   the previous batch commits, sized adaptively, unfiltered for a dense partition.
4. **Process**: one call with every input's batch
   (:meth:`~cg_pipelines.engine.join_processor.JoinProcessor.process_inputs`), state shared
   across inputs through one per-run cache. Under ``halt`` each input with a bad message is
   cut before its first one (and the run stops after committing the rest).
5. **Dead-letter** each input's rejects to its own group's DLQ stream.
6. **Commit, fenced on every input**: the rows and every input's new watermark (and origin
   marker) in ONE sink commit (:meth:`~cg_pipelines.sinks.base.TableSink.commit`); an
   input with nothing in the batch keeps its watermark, fenced all the same. A fence conflict
   on any input stops the run (``fenced``), nothing acknowledged.
7. **Settle** each input that had messages: purge its partition below its batch's last + 1,
   ack its lease, pull its next lease; then the next batch from 2.

A crash anywhere is safe as for one input: before 6 nothing is visible; after it, the rerun
finds every input's watermark and skips what is committed. Progress of one input is never
committed without the others' (one commit), and a zombie holding any one lease is refused at
its commit (every commit names every input's watermark).

Limit: batches are read on the driver (no :class:`~cg_pipelines.engine.join_processor.
JoinProcessor` processes ranges on the executors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
from nats.aio.client import Client

from cg_pipelines.core.errors import InvariantError, UsageError
from cg_pipelines.engine.context import RunContext, follow_set_lineage, open_run
from cg_pipelines.engine.join_processor import JoinProcessor
from cg_pipelines.engine.lease import LeaseHolder, lease_consumer_name
from cg_pipelines.engine.options import EngineOptions, Hook
from cg_pipelines.engine.processor import BatchContext, Processed, ProcessorBase
from cg_pipelines.engine.result import RunResult
from cg_pipelines.engine.runner import run_sides
from cg_pipelines.engine.side import Side
from cg_pipelines.engine.step import JoinStep
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.sinks.base import TableSink

__all__ = ["JoinInput", "check_inputs", "open_inputs", "run_copartitioned"]


@dataclass(frozen=True)
class JoinInput:
    """One input of a co-partitioned run: the processor's name for it and its elastic group
    (``stream``, ``group``; work queue ``<stream>-<group>``)."""

    name: str
    stream: str
    group: str


class NoProcessing(ProcessorBase):
    """The per-input contexts' processor slot: a co-partitioned run processes through its
    :class:`JoinProcessor`, never per input."""

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        raise InvariantError("a co-partitioned input is never processed alone")


async def run_copartitioned(
    nc: Client, inputs: Sequence[JoinInput], partition: int, processor: JoinProcessor,
    sink: TableSink, options: EngineOptions | None = None, *, hook: Hook | None = None,
    connect: ConnectOptions | None = None,
) -> RunResult:
    """Drain partition ``partition`` of every input's group in one run, one commit per batch
    for all inputs (see the module docstring).

    Args:
        nc: a connected nats-py client.
        inputs: the set's inputs (two or more; each group's work queue must exist and the
            groups must be co-partitioned: :func:`cg_pipelines.core.copartition.
            check_copartitioned`). Names must be the processor's ``inputs``. The first
            input's watermark key records the commits.
        partition: 0 <= partition < the set's partition count.
        processor: the :class:`~cg_pipelines.engine.join_processor.JoinProcessor`.
        sink: a :class:`~cg_pipelines.sinks.base.TableSink` (every sink is; one commit per
            batch fences every input).
        options: :class:`EngineOptions` (batch limits apply per input; ``max_messages``
            counts all inputs; ``dead_letter_policy`` applies to each input).
        hook: step callback ``hook(step, info)``; ``info["input"]`` names the input for the
            per-input steps (``leased``, ``read``, ``purged``, ``acked``); ``processed`` and
            ``committed`` are joint (``info["ranges"]``: each input's sequence range).
        connect: the connect options ``nc`` was made with (as for
            :func:`~cg_pipelines.engine.runner.run_partition`).

    Returns:
        A :class:`~cg_pipelines.engine.result.RunResult`; ``inputs`` holds each input's
        :class:`~cg_pipelines.engine.result.SideResult` by input name.

    Raises:
        UsageError: fewer than two inputs, duplicate names or groups, or names that are not
            the processor's inputs.
        EngineConfigError: ``sink`` is not a table sink (members missing, named).
        ConfigError: ``partition`` is negative.
        NatsUnavailableError / JetStreamError / the processor's and the sink's errors: as
            :func:`~cg_pipelines.engine.runner.run_partition`; every lease taken is given back
            first (nak and unpin), nothing acknowledged that was not committed.
    """
    opt = options or EngineOptions()
    check_inputs(inputs, processor)
    ctxs = open_inputs(nc, inputs, partition, sink, opt, hook, connect)
    sides = [Side(c, LeaseHolder(c, lease_consumer_name(partition))) for c in ctxs]
    return await run_sides(sides, JoinStep(processor, ctxs), hook,
                           after_start=lambda: follow_set_lineage(ctxs))


def open_inputs(nc: Client, inputs: Sequence[JoinInput], partition: int, sink: TableSink,
                opt: EngineOptions, hook: Hook | None, connect: ConnectOptions | None = None
                ) -> list[RunContext]:
    """One side context per input, in the inputs' order, sharing one
    :class:`~cg_pipelines.engine.result.RunResult` (each named by its input; per-side hook
    steps tagged with ``input``). Nothing is sent to NATS yet.

    Raises:
        ConfigError: ``partition`` is negative.
        EngineConfigError: ``sink`` is not a table sink.
    """
    res = RunResult({})
    return [open_run(nc, i.stream, i.group, partition, NoProcessing(), sink, opt,
                     tag_hook(hook, i.name), connect=connect, res=res, name=i.name)
            for i in inputs]


def check_inputs(inputs: Sequence[JoinInput], processor: JoinProcessor) -> None:
    """Refuse a co-partitioned run's inputs before anything is read (the reasons of
    :func:`run_copartitioned`'s ``UsageError``)."""
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


def tag_hook(hook: Hook | None, name: str) -> Hook | None:
    """``hook`` with ``input=<name>`` added to every step's info."""
    if hook is None:
        return None

    def tagged(step: str, info: dict[str, object]) -> None:
        hook(step, {**info, "input": name})
    return tagged
