"""A processed batch (:class:`Prepared`) and its one fenced commit over the run's sides
(:func:`commit_batch`).

The commit carries the rows, every side's new watermark (the last sequence of its part of the
batch; a side with nothing in the batch keeps its watermark, fenced all the same), each side's
origin marker (:func:`~cg_pipelines.sinks.base.origin_marker`) and the lineage the reconcile
check reads: for one side ``stream``, ``group``, ``partition``, ``first_seq``, ``last_seq``,
``last_origin_seq`` and ``cg.coverage`` (:data:`~cg_pipelines.core.coverage.COVERAGE_KEY`);
for several, ``partition`` and ``cg.join`` (:data:`~cg_pipelines.core.coverage.
JOIN_LINEAGE_KEY`: the same facts per side as one JSON list). A run over several partitions of
one group (independent sides) fences only the sides with messages in the batch (a side it
leaves untouched may be another run's by then) and records: for one such side exactly a
one-side commit; for several ``stream``, ``group``, ``partitions`` (comma-separated) and
``cg.join`` with each entry's own ``partition`` (no commit-level ``partition``: the reconcile
check reads each entry's). One call of
:meth:`TableSink.commit <cg_pipelines.sinks.base.TableSink.commit>` commits them, for one side
or many.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from cg_pipelines.core.coverage import COVERAGE_KEY, JOIN_LINEAGE_KEY, encode_seqs
from cg_pipelines.engine.processor import DeadLetter
from cg_pipelines.engine.side import Side, bounds, last_origin_seq
from cg_pipelines.sinks.base import origin_marker

__all__ = ["Prepared", "Span", "commit_batch", "span_info", "spans_of"]


@dataclass(frozen=True)
class Span:
    """One side's part of a batch: first and last sequence, origin sequence of the last
    message, messages."""

    first: int
    last: int
    last_origin: int | None
    messages: int


def spans_of(records: Mapping[str, pa.Table]) -> dict[str, Span]:
    """The :class:`Span` of each side with messages in ``records``."""
    out: dict[str, Span] = {}
    for name, batch in records.items():
        b = bounds(batch)
        if b is not None:
            out[name] = Span(b[0], b[1], last_origin_seq(batch), batch.num_rows)
    return out


def span_info(names: Sequence[str], spans: Mapping[str, Span]) -> dict[str, object]:
    """Hook info of a batch over the sides ``names`` (the run's order): ``ranges`` (each
    side's first and last sequence, None for a side without messages) and the first side's
    ``first_seq``/``last_seq`` when it has messages."""
    info: dict[str, object] = {"ranges": {
        n: (spans[n].first, spans[n].last) if n in spans else None for n in names}}
    head = spans.get(names[0])
    if head is not None:
        info.update(first_seq=head.first, last_seq=head.last)
    return info


@dataclass
class Prepared:
    """A processed batch waiting for its commit.

    Attributes:
        records: each side's records to commit (under ``halt``, only those before its first
            bad message; an executor batch: only its dead-lettered records).
        table: the output rows (None: none). dead: each side's dead letters.
        halted: the bad message each halted side stopped at (``halt`` policy).
        process_s: seconds spent processing.
        spans: each side's part of the batch (sides with messages only).
        executor: the batch was read and processed on the executors (its records stayed
            there: no coverage list).
    """

    records: dict[str, pa.Table]
    table: pa.Table | None
    dead: dict[str, list[DeadLetter]]
    halted: dict[str, DeadLetter]
    process_s: float
    spans: dict[str, Span]
    executor: bool = False

    def coverage(self, name: str) -> str | None:
        """Side ``name``'s covered origin sequences (:func:`~cg_pipelines.core.coverage.
        encode_seqs`: rows, dead letters, filtered out), or None (none, or an executor
        batch)."""
        if self.executor or name not in self.records:
            return None
        col = self.records[name]["origin_seq"].drop_null()
        return encode_seqs(col.to_numpy()) if len(col) else None


async def commit_batch(sides: Sequence[Side], prep: Prepared, watermarks: Mapping[str, int],
                       *, independent: bool = False) -> None:
    """Commit ``prep`` once, fenced on every side's watermark read (``watermarks`` by side
    name), in a worker thread (see the module docstring). ``independent``: the sides are
    partitions of one group that end on their own: only those with messages in ``prep`` are
    fenced and recorded.

    Raises:
        FenceConflictError: a side's watermark moved (nothing written).
        The sink's other errors, unchanged.
    """
    # the coverage texts and lineage too are made in the thread, off the event loop
    await asyncio.to_thread(_commit, sides, prep, watermarks, independent)


def _commit(sides: Sequence[Side], prep: Prepared, watermarks: Mapping[str, int],
            independent: bool) -> None:
    """:func:`commit_batch`'s work, in the calling thread."""
    sink = sides[0].ctx.sink
    if independent:
        sides = [s for s in sides if s.name in prep.spans]
    if len(sides) == 1:
        c = sides[0].ctx
        span = prep.spans[c.name]
        markers = ({origin_marker(c.app_id): span.last_origin}
                   if span.last_origin is not None else None)
        one = {"stream": c.stream, "group": c.group, "partition": c.partition,
               "first_seq": span.first, "last_seq": span.last,
               "last_origin_seq": span.last_origin, COVERAGE_KEY: prep.coverage(c.name)}
        sink.commit(prep.table, {c.app_id: (watermarks[c.name], span.last)},
                    markers=markers, lineage=one)
        return
    fences: dict[str, tuple[int, int]] = {}
    marks: dict[str, int] = {}
    sides_lineage: list[dict[str, object]] = []
    for side in sides:
        c, wm = side.ctx, watermarks[side.name]
        s = prep.spans.get(side.name)
        fences[c.app_id] = (wm, s.last if s else wm)
        if s is not None and s.last_origin is not None:
            marks[origin_marker(c.app_id)] = s.last_origin
        sides_lineage.append({
            "name": side.name, "stream": c.stream, "group": c.group, "app_id": c.app_id,
            **({"partition": c.partition} if independent else {}),
            "first_seq": s.first if s else None, "last_seq": s.last if s else None,
            "last_origin_seq": s.last_origin if s else None,
            "coverage": prep.coverage(side.name)})
    joint = json.dumps(sides_lineage, separators=(",", ":"))
    lineage: dict[str, object]
    if independent:
        first = sides[0].ctx
        lineage = {"stream": first.stream, "group": first.group,
                   "partitions": ",".join(str(s.ctx.partition) for s in sides),
                   JOIN_LINEAGE_KEY: joint}
    else:
        lineage = {"partition": sides[0].ctx.partition, JOIN_LINEAGE_KEY: joint}
    sink.commit(prep.table, fences, markers=marks or None, lineage=lineage)
