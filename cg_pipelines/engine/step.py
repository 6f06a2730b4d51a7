"""The processing step of a run over its sides: the sides' batches in, one output table and each
side's dead letters out (:class:`BatchStep`).

A run over one side calls a :class:`~cg_pipelines.engine.processor.Processor` with that side's
batch (:class:`SingleStep`); a run over several partitions of one group calls the same
one-input processor once per side with that side's batch and context, and concatenates the
outputs (:class:`RangeStep`); a co-partitioned run calls a
:class:`~cg_pipelines.engine.join_processor.JoinProcessor` with every side's batch
(:class:`JoinStep`). Both hold the output to the same contract before anything is committed:
the partition column set, the declared state's columns present
(:func:`~cg_pipelines.core.contract.check_output`), every dead letter a message of its side's
batch. The state both read is the run's own: one per-run cache reading the snapshot of the
run's first side (``last_rows(..., app_id=<first side's app id>)``).

A step that can also process whole ranges on Spark executors says so with
:meth:`BatchStep.range_processor` (the executor read, :mod:`cg_pipelines.engine.executor_read`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.contract import check_output
from cg_pipelines.core.errors import ContractError
from cg_pipelines.core.state import KeyedState
from cg_pipelines.engine.context import RunContext, state_cache
from cg_pipelines.engine.executor_read import RangeProcessed, RangeProcessor
from cg_pipelines.engine.join_processor import JoinContext, JoinProcessor
from cg_pipelines.engine.processor import BatchContext, DeadLetter, Processed
from cg_pipelines.engine.side import bounds
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.sinks.base import PARTITION_COLUMN, with_partition_column

__all__ = ["BatchStep", "JoinStep", "Output", "RangeState", "RangeStep", "SingleStep",
           "check_dead"]

Output = tuple[pa.Table | None, dict[str, list[DeadLetter]]]
"""A processed batch: the rows to commit (partition column set; None: none) and each side's
dead letters by side name (sorted by sequence; a side without any is absent)."""


def check_dead(dead: Mapping[str, Sequence[DeadLetter]], batches: Mapping[str, pa.Table]
               ) -> dict[str, list[DeadLetter]]:
    """``dead`` sorted by sequence, sides without dead letters left out.

    Raises:
        ContractError: a dead letter names a side not in ``batches`` or a sequence not in its
            side's batch.
    """
    unknown_sides = sorted(set(dead) - set(batches))
    if unknown_sides:
        raise ContractError(f"processing step dead-lettered messages of unknown inputs "
                            f"{unknown_sides}")
    out: dict[str, list[DeadLetter]] = {}
    for name, letters in dead.items():
        if not letters:
            continue
        seqs = set(batches[name]["seq"].to_pylist())
        unknown = [d.seq for d in letters if d.seq not in seqs]
        if unknown:
            raise ContractError(f"processing step dead-lettered sequences not in the batch "
                                f"of {name!r}: {unknown[:5]}")
        out[name] = sorted(letters, key=lambda d: d.seq)
    return out


class BatchStep(ABC):
    """The processing step of a run (see the module docstring).

    Attributes:
        state: the run's per-key state cache (None: no state declared). The loop updates it
            with each processed batch and resets it when a batch is dropped; a rebuild
            replaces it with an empty one that never reads the sink.
        mode: ``"drain"`` or ``"rebuild"`` (handed to the processor's context).
        spec: the declared state (:class:`~cg_pipelines.core.state.KeyedState`), or None.
    """

    state: KeyStateCache | RangeState | None
    mode: str = "drain"
    spec: KeyedState | None

    @abstractmethod
    def process(self, batches: Mapping[str, pa.Table]) -> Output:
        """Process one batch of every side (``{side name: records}``, each
        :data:`~cg_pipelines.core.record.RECORD_SCHEMA` in stream order, possibly empty,
        never all empty). Called in a worker thread.

        Raises:
            ContractError / OutputContractError: the output breaks the contract (see the
                module docstring). The processor's own exceptions, unchanged.
        """

    def range_processor(self) -> RangeProcessor | None:
        """The processor that can process a whole range on the executors, or None (then the
        executor read is not used)."""
        return None

    def process_range(self, source: Mapping[str, str], first: int, last: int
                      ) -> RangeProcessed:
        """Process the range ``source`` names on the executors (only when
        :meth:`range_processor` is not None). Called in a worker thread."""
        raise NotImplementedError


class SingleStep(BatchStep):
    """A run over one side: its :class:`~cg_pipelines.engine.processor.Processor`, with the
    run's state cache (:func:`~cg_pipelines.engine.context.state_cache`, made by the side's
    context)."""

    state: KeyStateCache | None

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.state = ctx.state
        self.spec = ctx.processor.state

    def _context(self, first: int, last: int) -> BatchContext:
        c = self.ctx
        return BatchContext(c.stream, c.group, c.partition, c.app_id, first, last, c.sink,
                            self.state, self.mode)

    def process(self, batches: Mapping[str, pa.Table]) -> Output:
        """The one side's batch through ``processor.process``."""
        records = batches[self.ctx.name]
        processed = self.ctx.processor.process(records, self.context(records))
        return self.output(processed, records)

    def context(self, records: pa.Table) -> BatchContext:
        """The :class:`~cg_pipelines.engine.processor.BatchContext` of the side's batch
        ``records``."""
        first, last = bounds(records) or (0, 0)
        return self._context(first, last)

    def output(self, processed: Processed, records: pa.Table) -> Output:
        """The processor's output for the side's batch ``records``, held to the contract, the
        partition column set."""
        c = self.ctx
        if processed.table is not None:  # one line naming a missing or mistyped column
            first, last = bounds(records) or (0, 0)
            check_output(processed.table.schema, self.spec,
                         where=f"transform output of partition {c.partition} of "
                               f"{c.read_stream} (sequences {first}..{last})")
        table = with_partition_column(processed.table, c.partition)
        return table, check_dead({c.name: processed.dead}, {c.name: records})

    def range_processor(self) -> RangeProcessor | None:
        """The processor when it implements the executor read."""
        p = self.ctx.processor
        return p if isinstance(p, RangeProcessor) else None

    def process_range(self, source: Mapping[str, str], first: int, last: int
                      ) -> RangeProcessed:
        """``processor.process_range`` over ``[first, last]``."""
        p = self.range_processor()
        assert p is not None
        got = p.process_range(source, self._context(first, last))
        got.processed.table = with_partition_column(got.processed.table, self.ctx.partition)
        return got


class JoinStep(BatchStep):
    """A co-partitioned run: one :class:`~cg_pipelines.engine.join_processor.JoinProcessor`
    call per batch with every side's records, by side name. ``sides``: the sides' contexts in
    the run's order (state reads use the snapshot of the first one's app id, and its
    ``parents`` after a migration, :func:`~cg_pipelines.engine.context.follow_set_lineage`).

    Raises:
        EngineConfigError: the processor declares state the sink cannot serve
            (:func:`~cg_pipelines.engine.context.state_cache`).
    """

    state: KeyStateCache | None

    def __init__(self, processor: JoinProcessor, sides: Sequence[RunContext]) -> None:
        first = sides[0]
        self.processor, self.spec = processor, processor.state
        self.partition, self.sink = first.partition, first.sink
        self.app_ids = {c.name: c.app_id for c in sides}
        self.where = f"join output of partition {first.partition}"
        self.state = state_cache(processor, first.sink, first.partition, first.app_id,
                                 lambda: first.parents)

    def process(self, batches: Mapping[str, pa.Table]) -> Output:
        """Every side's batch through ``processor.process_inputs``."""
        ctx = JoinContext(self.partition, {n: bounds(b) for n, b in batches.items()},
                          self.app_ids, self.sink, self.state, self.mode)
        out = self.processor.process_inputs(batches, ctx)
        if out.table is not None:
            check_output(out.table.schema, self.spec, where=self.where)
        return with_partition_column(out.table, self.partition), check_dead(out.dead, batches)



class RangeState:
    """The per-key state of a run over several partitions of one group: each side's own
    :class:`~cg_pipelines.engine.state.KeyStateCache` (a key belongs to one partition, so its
    state is read from and kept for that partition only), updated and reset together as the
    run loop does with one cache. ``caches``: ``{partition: cache}``."""

    def __init__(self, caches: Mapping[int, KeyStateCache]) -> None:
        self.caches = dict(caches)

    def update(self, rows: pa.Table | None) -> None:
        """Take each partition's rows of ``rows`` (by :data:`~cg_pipelines.sinks.base.
        PARTITION_COLUMN`, which the step set) as the newest state of their keys."""
        if rows is None or rows.num_rows == 0:
            return
        col = rows[PARTITION_COLUMN]
        for p in pc.unique(col).to_pylist():
            cache = self.caches.get(p)
            if cache is not None:
                cache.update(rows.filter(pc.equal(col, p)))

    def reset(self) -> None:
        """Forget every partition's cached state (:meth:`KeyStateCache.reset
        <cg_pipelines.engine.state.KeyStateCache.reset>`)."""
        for cache in self.caches.values():
            cache.reset()


class RangeStep(BatchStep):
    """A run over several partitions of one group (:func:`~cg_pipelines.engine.runner.
    run_partitions`): the run's one-input :class:`~cg_pipelines.engine.processor.Processor`
    given every side with records, in the sides' order, each with its own
    :class:`~cg_pipelines.engine.processor.BatchContext` (its partition, app id, sequence
    bounds and state), in ONE :meth:`~cg_pipelines.engine.processor.Processor.
    process_partitions` call (its default: :meth:`~cg_pipelines.engine.processor.Processor.
    process` per side, exactly as a one-partition run calls it, :class:`SingleStep`); each
    output held to the contract as a one-partition run's, then (each with its side's
    partition column) concatenated into one table. ``sides``: the sides' contexts in the
    run's order (one processor).
    """

    def __init__(self, sides: Sequence[RunContext]) -> None:
        self.steps = {c.name: SingleStep(c) for c in sides}
        first = sides[0]
        self.processor = first.processor
        self.spec = first.processor.state
        caches = {c.partition: c.state for c in sides if c.state is not None}
        self.state = RangeState(caches) if caches else None

    def process(self, batches: Mapping[str, pa.Table]) -> Output:
        """Each side's non-empty batch through ``processor.process``; the rows concatenated
        in the sides' order (schemas unified: a column all null in one side's output takes
        the type of another's).

        Raises:
            ContractError: the sides' outputs have columns of incompatible types; or as
                :class:`SingleStep`.
        """
        tables: list[pa.Table] = []
        dead: dict[str, list[DeadLetter]] = {}
        todo = [(step, records) for name, step in self.steps.items()
                if (records := batches.get(name)) is not None and records.num_rows]
        for step, _ in todo:
            step.mode = self.mode
        outs = (self.processor.process_partitions([(r, step.context(r)) for step, r in todo])
                if len(todo) > 1 else
                [self.processor.process(r, step.context(r)) for step, r in todo])
        if len(outs) != len(todo):
            raise ContractError(f"process_partitions returned {len(outs)} results for "
                                f"{len(todo)} partitions' batches")
        for (step, records), processed in zip(todo, outs, strict=True):
            table, letters = step.output(processed, records)
            if table is not None:
                tables.append(table)
            dead.update(letters)
        if not tables:
            return None, dead
        if len(tables) == 1:
            return tables[0], dead
        try:
            return pa.concat_tables(tables, promote_options="default"), dead
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise ContractError(f"the transform's outputs for partitions "
                                f"{[s.ctx.partition for s in self.steps.values()]} cannot be "
                                f"concatenated (columns of different types): {e}") from e

    def _only(self) -> SingleStep | None:
        """The one side's step when the run has one side, else None."""
        return next(iter(self.steps.values())) if len(self.steps) == 1 else None

    def range_processor(self) -> RangeProcessor | None:
        """A run over one partition: its step's (:meth:`SingleStep.range_processor`, the
        executor read); over several, None (not used)."""
        only = self._only()
        return only.range_processor() if only is not None else None

    def process_range(self, source: Mapping[str, str], first: int, last: int
                      ) -> RangeProcessed:
        """The one side's :meth:`SingleStep.process_range`."""
        only = self._only()
        assert only is not None
        only.mode = self.mode
        return only.process_range(source, first, last)
