"""The per-run cache of per-key state (:class:`~cg_pipelines.core.state.KeyedState`).

A drain looks a key up in the sink once per run: the first batch that holds the key reads its
last committed row (:meth:`~cg_pipelines.sinks.base.TableSink.last_rows`), and every commit of
the run updates the cache with the committed rows. That is exact because the run is the
partition's only writer while it commits (a commit after another holder's is refused by the
fence, and the run stops). A rebuild starts from empty state and never reads the sink: the
cache is updated with each processed batch instead, since the batches commit together at the
end.

In :class:`~cg_pipelines.core.write.Merge` mode the table holds each key's current row, so the
committed state read is the current table's; a key whose last output row is a delete marker
has no state afterwards (the cache forgets its row), exactly as a later run reading the table
would find it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.state import KeyedState, merge_last
from cg_pipelines.core.write import DELETE_COLUMN, Append, Merge, last_rows_by_key

__all__ = ["KeyStateCache"]

Reader = Callable[[Sequence[object]], pa.Table]
"""``reader(keys)``: the committed last rows of ``keys`` (one row per key found)."""


class KeyStateCache:
    """Last rows per key for one partition run (a
    :class:`~cg_pipelines.engine.processor.StateReader`).

    Args:
        spec: the declared state.
        reader: reads committed last rows for keys not seen yet in this run; ``None`` means
            empty initial state (a rebuild).
        write: the sink's write mode; with :class:`~cg_pipelines.core.write.Merge` and a
            delete marker, a key whose last updated row is a marker loses its state.
    """

    def __init__(self, spec: KeyedState, reader: Reader | None,
                 write: Append | Merge | None = None) -> None:
        self.spec, self._reader = spec, reader
        self._merge = write if isinstance(write, Merge) and write.delete_when is not None \
            else None
        self._table: pa.Table | None = None
        self._known: set[object] = set()
        self.sink_reads = 0  # keys read from the sink (a figure for metadata and tests)

    def lookup(self, keys: Sequence[object]) -> pa.Table:
        """The last rows of ``keys`` that have one (columns ``spec.read_columns``)."""
        missing = [k for k in keys if k not in self._known]
        if missing and self._reader is not None:
            got = self._reader(missing)
            self.sink_reads += len(missing)
            if got.num_rows:
                self._table = merge_last(self._table, got, self.spec)
            elif self._table is None and all(
                    c in got.column_names and not pa.types.is_null(got.schema.field(c).type)
                    for c in self.spec.read_columns):
                self._table = got.select(self.spec.read_columns)  # typed, no rows
        self._known.update(missing)
        if self._table is None or self._table.num_rows == 0:
            return self._empty()
        want = pa.array(list(keys), self._table[self.spec.key].type) if keys else None
        if want is None:
            return self._table.slice(0, 0)
        return self._table.filter(pc.is_in(self._table[self.spec.key], value_set=want))

    def update(self, rows: pa.Table | None) -> None:
        """Take ``rows`` (committed, or for a rebuild processed, output rows) as the newest
        state of their keys."""
        if rows is None or rows.num_rows == 0:
            return
        self._known.update(pc.unique(rows[self.spec.key]).to_pylist())
        if self._merge is None:
            self._table = merge_last(self._table, rows, self.spec)
            return
        cols = self.spec.read_columns
        flagged = rows.select(cols).append_column(DELETE_COLUMN, self._merge.delete_mask(rows))
        last = last_rows_by_key(flagged, [self.spec.key], self.spec.order_by)
        gone = last.filter(last[DELETE_COLUMN])[self.spec.key]
        live = last.filter(pc.invert(last[DELETE_COLUMN])).drop_columns([DELETE_COLUMN])
        table = merge_last(self._table, live, self.spec) if live.num_rows else self._table
        if table is not None and len(gone):
            table = table.filter(pc.invert(pc.is_in(table[self.spec.key],
                                                    value_set=gone.combine_chunks())))
        self._table = table

    def reset(self) -> None:
        """Forget everything (a batch taken as state was not committed after all): the next
        lookups read the committed state again (a rebuild's cache starts empty again)."""
        self._table = None
        self._known.clear()

    def _empty(self) -> pa.Table:
        if self._table is not None:
            return self._table.slice(0, 0)
        return self.spec.empty()
