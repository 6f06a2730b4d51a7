"""Step 2 of the run loop: how a run's batches are read (:class:`Reads`), side by side or, for a
run over most of its group's work queue, as ONE read split by partition (:class:`SplitRead`).

**Per side** (a one-partition run, a co-partitioned run, a run over a small share of its
group's work queue): each leased side reads its own range with one batched direct get
(:meth:`~cg_pipelines.engine.side.Side.read`: filtered ``"<p>.>"``, unfiltered when its
partition is dense), the next batch read ahead while this one commits. The sides of a run over
several partitions read at once (each its share of the batch size), not one after the other.

**Split** (a run over several partitions of one group whose leased partitions held 90 % of the
work queue's messages or more when it started, :func:`reads_split`): ONE unfiltered batched
direct get (``">"``) of the work queue, from the lowest sequence a side needs, up to the batch
size in all, split here by each subject's first token (the partition) into the leased sides'
batches. Messages of partitions the run does not hold (outside its range, held by another run,
given up) are dropped, as a dense one-partition read drops other partitions'. Why: k filtered
reads cost k requests and the server more per message than one unfiltered read; at k = 32 the
split read ran at 79.7k msg/s against 48.6k for 32 filtered reads in flight together and 76.3k
for a one-partition group's read (``notes/RANGE_RUNS.md`` §4). The 90 % bound is the dense
one-partition read's: it caps what is read and dropped at about a tenth.

A read gives a :class:`Window`: each side's records and how far the read covered the side
(``through``): every message of the side's partition from where its read started up to
``through`` is in its records. A batch read ahead is used only when it lines up with the sides'
next leases (:meth:`Reads.lines_up`); a read that covered a side's lease and found nothing of it
is checked with the stream leader (the lease was settled, or a replica is behind).

Units: sequences are sequences of the stream the sides read (``int``, first is 1); sizes are
messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.engine.commit import Span
from cg_pipelines.engine.options import WorkQueueLossError
from cg_pipelines.engine.side import Side, bounds, drop_prefetch, take_prefetch
from cg_pipelines.jetstream.rangeread import RangeBatch, read_range

__all__ = ["AT_ONCE", "Reads", "SplitRead", "Window", "at_once", "reads_split"]

AT_ONCE = 32
"""Most sides of one run doing a step (start, read, settle) concurrently."""

ALL_PARTITIONS = "*.>"
"""Every subject of an elastic group's work queue (``<p>.<origin subject>``): the filter of a
split read's one purge (:meth:`SplitRead.purge_below`)."""

_X = TypeVar("_X")
_T = TypeVar("_T")


async def at_once(items: Sequence[_X], fn: Callable[[_X], Awaitable[_T]],
                  limit: int = AT_ONCE) -> list[_T]:
    """``fn(item)`` for every item concurrently (at most ``limit`` at a time), the results in
    the items' order. On the first failure the others are cancelled and waited for (nothing of
    this call is left running), then the failure propagates as it is."""
    gate = asyncio.Semaphore(limit)

    async def one(x: _X) -> _T:
        async with gate:
            return await fn(x)

    tasks = [asyncio.create_task(one(x)) for x in items]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
        raise


@dataclass(frozen=True)
class Window:
    """What one read gave the run's sides.

    Attributes:
        tables: each side's records by side name (the record schema, stream order; empty for a
            side with nothing in the read).
        through: by side name, the last sequence the read covered for the side: every message
            of its partition from where its read started up to ``through`` is in its records.
        end: a split read's last sequence covered (its next read starts after it); None for
            reads side by side.
        start: a split read's first sequence (None for reads side by side).
        read_rows: a split read's messages in ``[start, end]``, all partitions, when it ran.
    """

    tables: dict[str, pa.Table]
    through: dict[str, int]
    end: int | None = None
    start: int | None = None
    read_rows: int = 0

    @property
    def rows(self) -> int:
        """Messages in the window, all sides."""
        return sum(t.num_rows for t in self.tables.values())


def reads_split(sides: Sequence[Side]) -> bool:
    """Whether a run's leased ``sides`` (partitions of one group, started) are read with one
    split read: two or more, one work queue, and together holding 90 % or more of its messages
    when they started (the dense one-partition rule applied to the range)."""
    if len(sides) < 2 or len({s.ctx.read_stream for s in sides}) != 1:
        return False
    pending = sum(s.ctx.pending for s in sides)
    return 10 * pending >= 9 * max(s.queue_messages for s in sides)


class SplitRead:
    """ONE unfiltered read of the work queue for the leased ``sides`` of a run over several
    partitions, split by partition (see the module docstring); never past a side's
    ``start_last``. Holds at most one read ahead."""

    def __init__(self, sides: Sequence[Side]) -> None:
        self.sides = list(sides)
        self.ctx = self.sides[0].ctx
        self.last = max(s.start_last for s in self.sides)
        self.labels = pa.array([str(s.ctx.partition) for s in self.sides], pa.string())
        self.prefetch: tuple[int, asyncio.Task[Window]] | None = None

    async def read(self, from_seq: int, size: int, timing: str = "read_split") -> Window:
        """The work queue from ``from_seq`` on, up to ``size`` messages (all partitions) and the
        byte limit, split by side; read on past a range holding nothing for a side still
        leased until one has messages or the read reaches the end (so a read with nothing for
        the leased sides covered everything up to the sides' ``start_last``)."""
        t = time.monotonic()
        c, opt = self.ctx, self.ctx.opt

        async def once(seq: int) -> RangeBatch:
            return await read_range(
                c.nc, c.read_stream, seq, filter_subject=">", max_msgs=size,
                max_bytes=opt.batch_max_bytes, last_seq=self.last, timeout_s=opt.timeout_s,
                drop_nats_headers=True)

        seq, rows = from_seq, 0
        while True:
            got = await c.retry.call("read", functools.partial(once, seq))
            rows += got.num_rows
            window = self.split(got.table(origin=True).cast(RECORD_SCHEMA), got.next_seq - 1)
            if (got.ended or got.next_seq > self.last or any(
                    window.tables[s.name].num_rows for s in self.sides if s.lease is not None)):
                break
            seq = got.next_seq
        c.timed(timing, t)
        return dataclasses.replace(window, start=from_seq, read_rows=rows)

    async def purge_below(self, window: Window, committed: int) -> bool:
        """After the commit of ``committed`` messages read as ``window``: purge the work queue
        below ``window.end + 1`` with ONE purge of every partition's subjects (``*.>``) when
        that removes exactly them, i.e. when they are every message the read found
        (``window.read_rows``) and the queue holds nothing below ``window.start`` (its first
        sequence, asked now); sequences below ``end`` only ever go away, so nothing else is
        there. True: purged (each side then only acks; its seconds in the run's
        ``timings["purge_split"]``); False: the sides purge their own partitions.

        Why ``*.>`` (every work-queue subject is ``<p>.<origin subject>``) and not an
        unfiltered purge: nats-server 2.15.1 turns a purge without a filter (or with ``>``)
        into a compaction of the store, and that compaction, with other partitions purged and
        acknowledged concurrently and the source storing new messages, removed messages above
        its sequence and left the stream's state inconsistent ("Stream state encountered
        internal inconsistency on write"): in loops of two range runs draining one queue at
        once (``bench/wq_consistency.py``), 2 of 6 lost messages and all 6 logged that
        warning; with ``*.>``, 0 of 18 and none (``notes/RANGE_RUNS.md`` §12). A filtered
        purge takes the server's per-message path.

        Raises :class:`~cg_pipelines.engine.options.WorkQueueLossError` when the server
        purged more than the read found."""
        if window.start is None or window.end is None or committed != window.read_rows:
            return False
        c = self.ctx
        info = await c.retry.call("stream info", lambda: c.api.stream_info(c.read_stream))
        if int(info["state"].get("first_seq") or 0) < window.start:
            return False
        end, t = window.end, time.monotonic()
        purged = await c.retry.call(
            "purge", lambda: c.api.purge(c.read_stream, filter=ALL_PARTITIONS, seq=end + 1))
        if purged > window.read_rows:  # stored below end + 1 and no read returned it
            raise WorkQueueLossError(c.read_stream, None, end + 1, window.read_rows, purged)
        c.timed("purge_split", t)
        return True

    def split(self, table: pa.Table, end: int) -> Window:
        """``table`` (a read of the work queue covering sequences up to ``end``; subjects
        ``<p>.<origin subject>``) as each side's records: its partition's rows up to its
        ``start_last``, in stream order, the ``<p>.`` prefix cut off their subjects."""
        n = len(self.sides)
        tables: dict[str, pa.Table] = {}
        through = {s.name: min(end, s.start_last) for s in self.sides}
        if table.num_rows == 0:
            return Window({s.name: table for s in self.sides}, through, end)
        head = pc.list_element(pc.split_pattern(table["subject"], ".", max_splits=1), 0)
        which = pc.index_in(head, value_set=self.labels).fill_null(n)
        idx = which.to_numpy(zero_copy_only=False)
        counts = np.bincount(idx, minlength=n + 1)
        order = np.argsort(idx, kind="stable")  # stream order kept within each side
        ordered = table.take(pa.array(order))
        col = ordered.schema.get_field_index("subject")
        # the "<p>." prefix cut off every subject at once (one call, not one per side)
        ordered = ordered.set_column(col, ordered.schema.field(col), pc.replace_substring_regex(
            ordered["subject"], r"^[^.]*\.", "", max_replacements=1))
        seqs = ordered["seq"].to_numpy()
        off = 0
        for i, s in enumerate(self.sides):
            n = int(counts[i])
            keep = n
            if n and seqs[off + n - 1] > s.start_last:
                keep = int(np.searchsorted(seqs[off:off + n], s.start_last, side="right"))
            tables[s.name] = ordered.slice(off, keep)
            off += n
        return Window(tables, through, end)

    def read_ahead(self, from_seq: int, size: int) -> None:
        """Start reading from ``from_seq`` (the prefetch), unless one is running or nothing
        of the sides is after ``from_seq - 1``."""
        if self.prefetch is None and from_seq <= self.last:
            self.prefetch = (from_seq, asyncio.create_task(
                self.read(from_seq, size, timing="read_split_overlapped")))

    async def take(self, from_seq: int, size: int) -> Window:
        """The read from ``from_seq``: the prefetch when it starts there, else a read (a
        prefetch starting elsewhere is dropped)."""
        prefetch, self.prefetch = self.prefetch, None
        return await take_prefetch(prefetch, from_seq, lambda: self.read(from_seq, size))

    async def take_ahead(self, from_seq: int) -> Window | None:
        """The prefetch when it starts at ``from_seq`` (None: there is none, or it starts
        elsewhere and is kept)."""
        prefetch, self.prefetch = self.prefetch, None
        if prefetch is None or prefetch[0] != from_seq:
            self.prefetch = prefetch
            return None
        return await prefetch[1]

    async def drop(self) -> None:
        """Drop the read ahead, if any."""
        prefetch, self.prefetch = self.prefetch, None
        await drop_prefetch(prefetch)


class Reads:
    """Step 2 for a run's ``sides`` (see the module docstring): the first read of a batch
    (:meth:`first`), the next one read ahead (:meth:`ahead`, :meth:`following`) and whether a
    batch read ahead lines up with the sides' next leases (:meth:`lines_up`). ``independent``:
    the sides are partitions of one group read at once and sharing the batch size
    (:class:`~cg_pipelines.engine.drain.Drain`'s flag); call :meth:`choose` once they started.
    """

    def __init__(self, sides: Sequence[Side], *, independent: bool = False) -> None:
        self.sides = list(sides)
        self.independent = independent
        self.split: SplitRead | None = None

    def choose(self) -> None:
        """After the sides started: one split read for the leased sides when
        :func:`reads_split` says so, else side by side."""
        live = [s for s in self.sides if s.lease is not None]
        if self.independent and reads_split(live):
            self.split = SplitRead(live)

    def share(self, size: int) -> int:
        """A side's part of a batch of ``size`` messages when the sides read side by side:
        all of it for dependent sides, else shared out among the sides still leased (at least
        one message)."""
        if not self.independent:
            return size
        live = sum(1 for s in self.sides if s.lease is not None) or 1
        return max(1, -(-size // live))

    async def first(self, watermarks: Mapping[str, int], size: int) -> Window | None:
        """The batch of up to ``size`` messages starting at every leased side's lease (past its
        watermark); None when a side's lease was not found where the read covered it: it was
        settled (purged after a commit, a crash before the ack: acked now and the next lease
        taken) or a replica is behind the leader (read again): the caller decides again."""
        live = [s for s in self.sides if s.lease is not None]
        froms = {s.name: max(s.lease.seq, watermarks[s.name] + 1)
                 for s in live if s.lease is not None}
        if self.split is not None:
            return await self._first_split(live, froms, size)
        size = self.share(size)
        tables = {s.name: RECORD_SCHEMA.empty_table() for s in self.sides}
        through = {s.name: s.start_last for s in self.sides}
        missed: list[Side] = []
        if self.independent and len(live) > 1:
            got = await at_once(live, lambda s: s.take_read(froms[s.name], size))
            tables.update({s.name: t for s, t in zip(live, got, strict=True)})
            missed = [s for s in live if tables[s.name].num_rows == 0]
        else:  # in the run's order; the first empty read decides
            for s in live:
                tables[s.name] = await s.take_read(froms[s.name], size)
                if tables[s.name].num_rows == 0:
                    missed = [s]
                    break
        for s in missed:
            await self._missed(s, froms[s.name], s.start_last)
        if missed:
            return None
        for s in live:
            b = bounds(tables[s.name])
            if b is not None:
                through[s.name] = b[1]
        return Window(tables, through)

    async def _first_split(self, live: Sequence[Side], froms: Mapping[str, int], size: int
                           ) -> Window | None:
        assert self.split is not None
        got = await self.split.take(min(froms.values()), size)
        tables = dict(got.tables)
        for s in self.sides:  # a side given up since the read started: nothing of it
            if s.lease is None or s.name not in tables:
                tables[s.name] = RECORD_SCHEMA.empty_table()
            elif tables[s.name].num_rows and tables[s.name]["seq"][0].as_py() < froms[s.name]:
                t = tables[s.name]
                tables[s.name] = t.filter(pc.greater_equal(t["seq"], froms[s.name]))
        through = {s.name: got.through.get(s.name, s.start_last) for s in self.sides}
        window = dataclasses.replace(got, tables=tables, through=through)
        if window.rows == 0:  # the read reached the end with nothing of any leased side
            missed = [(s, s.start_last) for s in live]
        else:
            missed = [(s, through[s.name]) for s in live
                      if tables[s.name].num_rows == 0 and froms[s.name] <= through[s.name]]
        for s, last in missed:
            await self._missed(s, froms[s.name], last)
        return None if missed else window

    @staticmethod
    async def _missed(side: Side, first: int, last: int) -> None:
        """A read covering ``[first, last]`` found nothing of ``side``'s partition although its
        lease is there: unless the leader holds a message there (a replica behind: read
        again), the lease was settled: ack it and take the next."""
        if side.lease is not None and not await side.stale_empty_read(first, last):
            await side.holder.ack(side.lease)
            await side.next()

    def ahead(self, window: Window, spans: Mapping[str, Span], size: int) -> None:
        """Start reading the batch after ``window`` (whose sides with messages have
        ``spans``), up to ``size`` messages."""
        if self.split is not None:
            assert window.end is not None
            self.split.read_ahead(window.end + 1, size)
            return
        share = self.share(size)
        for name, span in spans.items():
            next(s for s in self.sides if s.name == name).read_ahead(span.last + 1, share)

    async def following(self, window: Window, spans: Mapping[str, Span]) -> Window | None:
        """The batch after ``window`` (whose sides with messages have ``spans``), read ahead;
        None when there is none, or a read ahead is missing or came back empty (the caller
        reads again)."""
        if self.split is not None:
            assert window.end is not None
            got = await self.split.take_ahead(window.end + 1)
            return got if got is not None and got.rows else None
        tables: dict[str, pa.Table] = {}
        through: dict[str, int] = {}
        for side in self.sides:
            span = spans.get(side.name)
            through[side.name] = side.start_last
            if span is None or span.last >= side.start_last:
                tables[side.name] = RECORD_SCHEMA.empty_table()
                continue
            prefetch, side.prefetch = side.prefetch, None
            if prefetch is None or prefetch[0] != span.last + 1:
                side.prefetch = prefetch
                return None
            records = await prefetch[1]
            if records.num_rows == 0:
                return None
            tables[side.name] = records
            through[side.name] = records["seq"][records.num_rows - 1].as_py()
        window = Window(tables, through)
        return window if window.rows else None

    def lines_up(self, spans: Mapping[str, Span], window: Window,
                 owed: Mapping[str, Span] | None = None) -> bool:
        """Whether a batch read ahead (``window``, its sides with messages have ``spans``)
        starts where each side's next lease does: a side with messages in it at its lease; a
        side without, with no lease or one past what the read covered of it (one that arrived
        after the run started, say). A side with commits ``owed`` (not settled yet: its lease
        is still the one before them) lines up while it holds that lease: its reads go on
        back to back after its last commit."""
        for side in self.sides:
            span = spans.get(side.name)
            if owed and side.name in owed:
                if side.lease is None:
                    return False
                continue
            if span is None:
                if (side.lease is not None
                        and side.lease.seq <= window.through.get(side.name, side.start_last)):
                    return False
            elif side.lease is None or side.lease.seq != span.first:
                return False
        return True

    async def drop(self) -> None:
        """Drop every read ahead (the run ends)."""
        if self.split is not None:
            await self.split.drop()
        for side in self.sides:
            await side.drop_prefetch()
