"""Committed batches of a run not settled yet (:class:`Unsettled`): what step 6 owes the work
queue when a run settles several commits at once (``EngineOptions.settle_interval_s``).

Why: nats-server's purge of a work queue's interior costs about the same for 5,000 messages as
for 50,000 (``notes/RANGE_RUNS.md`` §13), so a run that purges once for several commits spends
less time settling. The rule that makes it safe is unchanged: a batch is purged and its lease
acknowledged only after its commit; a run that stops with batches unsettled leaves committed
messages in the work queue, and the partition's next run purges them unread (its lease is at
or below its watermark: :meth:`~cg_pipelines.engine.side.Side.skip_committed`).

Units: sequences of the stream the sides read; counts are messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cg_pipelines.engine.commit import Prepared, Span
from cg_pipelines.engine.reads import Window

__all__ = ["Unsettled"]


@dataclass(frozen=True)
class Unsettled:
    """Consecutive committed batches of one run's batch loop, merged for one settle.

    Attributes:
        spans: by side name, the side's part of the batches: first sequence of the earliest,
            last of the latest, their messages summed (contiguous: each batch of a side starts
            after its previous one ends).
        committed: messages the batches committed, all sides (a split read's purge removes
            exactly them: :meth:`~cg_pipelines.engine.reads.SplitRead.purge_below`).
        window: the split reads the batches came from, merged (``start`` of the first,
            ``end`` of the last, ``read_rows`` summed; no tables); None when a batch was read
            side by side or the reads are not back to back.
    """

    spans: Mapping[str, Span]
    committed: int
    window: Window | None

    @classmethod
    def of(cls, prep: Prepared, window: Window | None) -> Unsettled:
        """One committed batch ``prep``, read as ``window`` (None: side by side)."""
        return cls(dict(prep.spans), sum(r.num_rows for r in prep.records.values()), window)

    def then(self, later: Unsettled) -> Unsettled:
        """These batches followed by ``later`` (committed after them), as one."""
        spans = dict(self.spans)
        for name, s in later.spans.items():
            a = spans.get(name)
            spans[name] = s if a is None else Span(
                a.first, s.last, s.last_origin if s.last_origin is not None else a.last_origin,
                a.messages + s.messages)
        return Unsettled(spans, self.committed + later.committed,
                         _joined(self.window, later.window))


def _joined(a: Window | None, b: Window | None) -> Window | None:
    """Split reads ``a`` then ``b`` as one window, when ``b`` starts right after ``a``."""
    if (a is None or b is None or a.start is None or a.end is None or b.start is None
            or b.end is None or b.start != a.end + 1):
        return None
    return Window({}, {}, end=b.end, start=a.start, read_rows=a.read_rows + b.read_rows)
