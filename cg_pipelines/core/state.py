"""Per-key state carried across batches: what a transform declares, and the Arrow logic that
finds each key's last row and attaches it to a batch (pure: no I/O).

A transform that continues something per key (a running total, a key's previous event) declares
:class:`KeyedState`: the key column, the order column and the state columns of its *output*
rows. Before each batch, the library looks up the last committed output row of every key in the
batch (through the sink, :meth:`cg_pipelines.sinks.delta.DeltaSink.last_rows`, and a per-run
cache) and attaches its state columns to the batch's rows as ``<prefix><column>`` (default
``last_<column>``): null for a key with no committed row yet. So a running total is
``coalesce(last_total, 0) + running sum within the batch`` and needs no hand-written reads.

With a :class:`~cg_pipelines.core.write.Merge` table the committed rows ARE the current state
(one per key), so the state read is the key's current row; a key deleted by a marker has no
state (its ``last_<column>`` values are null, as for a new key). Declare the merge key as
:attr:`KeyedState.key`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.errors import ColumnNotFoundError, UsageError
from cg_pipelines.core.record import SEQ_COLUMN

__all__ = ["KeyedState", "attach_state", "keys_of", "last_per_key", "merge_last"]


@dataclass(frozen=True)
class KeyedState:
    """Per-key state a transform needs from its committed output.

    Attributes:
        key: the key column (in the decoded batch and in the output), e.g. ``"customer"``.
        columns: output columns that make up a key's state, e.g. ``("total", "orders")``.
        order_by: output column ordering a key's rows; the state is the row with the greatest
            value (default ``"_seq"``, the origin stream sequence, which outputs should keep).
        prefix: the state columns appear in the batch as ``prefix + column``.
        schema: optional Arrow types of ``columns`` (and ``key``), used while the table does
            not exist yet so the attached columns are typed (else they are null-typed until the
            first commit).

    Raises:
        UsageError: empty names, ``key`` among ``columns``, or duplicate columns.
    """

    key: str
    columns: tuple[str, ...]
    order_by: str = SEQ_COLUMN
    prefix: str = "last_"
    schema: pa.Schema | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        cols = tuple(self.columns)
        object.__setattr__(self, "columns", cols)
        if not self.key or not self.order_by or not all(cols):
            raise UsageError("KeyedState: key, order_by and columns must be non-empty names")
        if self.key in cols:
            raise UsageError(f"KeyedState: the key {self.key!r} cannot also be a state column")
        if len(set(cols)) != len(cols):
            raise UsageError(f"KeyedState: duplicate state columns in {list(cols)}")

    @property
    def read_columns(self) -> list[str]:
        """Output columns to read back: key, order column, state columns (no duplicates)."""
        return list(dict.fromkeys([self.key, self.order_by, *self.columns]))

    @property
    def attached_names(self) -> list[str]:
        """Names of the columns attached to a batch: ``prefix + column``."""
        return [self.prefix + c for c in self.columns]

    def empty(self) -> pa.Table:
        """No rows, with :attr:`read_columns` typed from :attr:`schema` (null-typed without)."""
        types = {f.name: f.type for f in self.schema} if self.schema is not None else {}
        return pa.table({c: pa.array([], types.get(c, pa.null())) for c in self.read_columns})


def last_per_key(table: pa.Table, key: str, order_by: str) -> pa.Table:
    """The row with the greatest ``order_by`` of each key (on ties, the later row of
    ``table``), sorted by key.

    Raises:
        ColumnNotFoundError: ``key`` or ``order_by`` is not a column.
    """
    for c in (key, order_by):
        if c not in table.column_names:
            raise ColumnNotFoundError(f"column {c!r} not in {table.column_names}")
    if table.num_rows == 0:
        return table
    ordered = table.sort_by([(order_by, "ascending")])
    idx = ordered.append_column("__row", pa.array(range(ordered.num_rows), pa.int64()))
    last = idx.group_by(key, use_threads=False).aggregate([("__row", "max")])
    return ordered.take(last["__row_max"]).sort_by([(key, "ascending")])


def merge_last(known: pa.Table | None, new: pa.Table, spec: KeyedState) -> pa.Table:
    """``known`` last rows updated with the rows of ``new`` (the later output wins per key).

    Both are projected to :attr:`KeyedState.read_columns`; ``new`` is cast to ``known``'s
    schema when the two differ (``known`` may have been null-typed before the first commit).
    """
    cols = spec.read_columns
    fresh = new.select(cols)
    if known is None or known.num_rows == 0:
        return last_per_key(fresh, spec.key, spec.order_by)
    known = known.select(cols)
    if known.schema != fresh.schema:
        known = _unify(known, fresh.schema)
    return last_per_key(pa.concat_tables([known, fresh]), spec.key, spec.order_by)


def _unify(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` cast to ``schema`` where its columns are null-typed or castable."""
    return pa.Table.from_arrays(
        [table[f.name].cast(f.type) for f in schema], schema=pa.schema(list(schema)))


def attach_state(batch: pa.Table, state: pa.Table, spec: KeyedState) -> pa.Table:
    """``batch`` with the state columns of its keys' rows in ``state`` appended as
    ``prefix + column`` (row order kept; null where a key has no state row).

    Args:
        batch: the decoded batch; must have ``spec.key``.
        state: one row per key (as :func:`last_per_key` returns), with the state columns.

    Raises:
        ColumnNotFoundError: the key column is missing from ``batch``. KeyError: it or a
            state column is missing from ``state``.
        UsageError: an attached name already exists in ``batch``.
    """
    if spec.key not in batch.column_names:
        raise ColumnNotFoundError(f"state key {spec.key!r} not in the batch's columns "
                                  f"{batch.column_names}")
    clash = [n for n in spec.attached_names if n in batch.column_names]
    if clash:
        raise UsageError(f"state columns {clash} clash with the batch's own columns: choose "
                         "another KeyedState.prefix")
    if state.num_rows == 0:
        types = {f.name: f.type for f in state.schema}
        out = batch
        for c, name in zip(spec.columns, spec.attached_names, strict=True):
            out = out.append_column(name, pa.nulls(batch.num_rows, types.get(c, pa.null())))
        return out
    keys = state[spec.key]
    if batch[spec.key].type != keys.type:
        keys = keys.cast(batch[spec.key].type)
    idx = pc.index_in(batch[spec.key], value_set=keys.combine_chunks())
    out = batch
    for c, name in zip(spec.columns, spec.attached_names, strict=True):
        out = out.append_column(name, state[c].take(idx))
    return out


def keys_of(batch: pa.Table, key: str) -> Sequence[object]:
    """The distinct values of ``key`` in ``batch`` (nulls dropped), as Python values."""
    return cast("list[object]", pc.unique(batch[key]).drop_null().to_pylist())
