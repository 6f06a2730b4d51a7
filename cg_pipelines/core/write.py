"""How a consumer group's output rows are written to its table: :class:`Append` (the default:
every output row is kept, the table is the history) or :class:`Merge` (the table holds the
current row of each key: upserts and deletes), and the pure Arrow logic of a merge (no I/O).

A merge batch is reduced before it is written: of each key's rows in the batch, the last in
stream order (greatest ``order_by``, default ``_seq``; on ties the later row) wins; if that row
is a delete marker the key is deleted, else it replaces the key's row (or is inserted). Because
a partition's messages are processed in stream order and each batch is committed once, fenced,
the table then equals "the last event of every key that was not deleted", whatever the batch
boundaries, crashes or zombie holders.

Example::

    Merge(key="device")                                   # upserts only
    Merge(key="device", delete_when=("op", "delete"))     # op == "delete" deletes the key
    Merge(key=("site", "device"), delete_when=pc.field("deleted"))   # any Arrow predicate
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.errors import ColumnNotFoundError, ContractError, UsageError
from cg_pipelines.core.record import SEQ_COLUMN

__all__ = ["DELETE_COLUMN", "Append", "DeleteWhen", "Merge", "WriteMode", "write_mode_name"]

DELETE_COLUMN: Final = "__cg_delete"
"""Boolean helper column a merge source carries (never written to the table)."""

DeleteWhen: TypeAlias = "tuple[str, object] | pc.Expression"
"""A delete marker: ``(column, value)`` (the row deletes its key when ``column == value``; a
list/set/tuple/frozenset ``value`` means "is one of"), or a boolean pyarrow expression over the
output columns, e.g. ``pc.field("deleted")`` or ``pc.field("op").isin(["D", "X"])`` (a null
result does not delete)."""


@dataclass(frozen=True)
class Append:
    """Write mode ``append`` (the default): every output row is appended; the table is the
    history of the stream's effects. Downstream readers get every row."""

    @property
    def name(self) -> str:
        return "append"


@dataclass(frozen=True)
class Merge:
    """Write mode ``merge``: a Delta MERGE by key, so the table holds each key's current row.

    Attributes:
        key: the key column, or several (a composite key). The rows of one key must come from
            one consumer-group partition (partition the group on the key, or a coarser one):
            the merge matches a key within the batch's partition (``_partition``), so the
            same key in two partitions is two rows.
        delete_when: the delete marker (:data:`DeleteWhen`), or ``None``: rows never delete.
            Marker rows are not written; a key whose last row in a batch is a marker is deleted
            (nothing happens if it had no row).
        order_by: the column ordering a key's rows in a batch (the last wins): ``"_seq"``, the
            stream sequence the decoded batch carries (keep it in the output), or ``None`` to
            take the output's row order as stream order (an Arrow transform that keeps its
            input's order; NOT a Spark transform, whose row order is not kept).

    Raises:
        UsageError: an empty key or key name, a duplicate key column, an empty ``order_by``,
            ``order_by`` among the key columns, a ``delete_when`` that is neither a
            ``(column, value)`` pair with a non-empty column nor a pyarrow ``Expression``, or
            a delete column that is a key column.
    """

    key: str | tuple[str, ...]
    delete_when: DeleteWhen | None = None
    order_by: str | None = SEQ_COLUMN

    def __post_init__(self) -> None:
        keys = (self.key,) if isinstance(self.key, str) else tuple(self.key)
        object.__setattr__(self, "key", self.key if isinstance(self.key, str) else keys)
        if not keys or not all(isinstance(k, str) and k for k in keys):
            raise UsageError(f"Merge: key must be a column name or a non-empty tuple of names, "
                             f"got {self.key!r}")
        if len(set(keys)) != len(keys):
            raise UsageError(f"Merge: duplicate key columns in {list(keys)}")
        if self.order_by is not None and (not isinstance(self.order_by, str) or
                                          not self.order_by):
            raise UsageError(f"Merge: order_by must be a column name or None, got "
                             f"{self.order_by!r}")
        if self.order_by in keys:
            raise UsageError(f"Merge: order_by {self.order_by!r} cannot be a key column")
        d = self.delete_when
        if d is None or isinstance(d, pc.Expression):
            return
        if not (isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], str) and d[0]):
            raise UsageError("Merge: delete_when must be (column, value) or a pyarrow "
                             f"Expression (e.g. pc.field('op') == 'delete'), got {d!r}")
        if d[0] in keys:
            raise UsageError(f"Merge: the delete column {d[0]!r} cannot be a key column")

    @property
    def name(self) -> str:
        return "merge"

    @property
    def keys(self) -> tuple[str, ...]:
        """The key columns, as a tuple."""
        return (self.key,) if isinstance(self.key, str) else tuple(self.key)

    def required_columns(self) -> list[str]:
        """Columns the output must have: the keys, ``order_by`` (when set) and the delete
        column of a ``(column, value)`` marker."""
        cols = list(self.keys)
        if self.order_by is not None:
            cols.append(self.order_by)
        if isinstance(self.delete_when, tuple):
            cols.append(self.delete_when[0])
        return cols

    def check(self, table: pa.Table) -> None:
        """Check that ``table`` (a batch's output) can be merged.

        Raises:
            ContractError: a required column is missing (the message names it and the columns
                present), or a key column holds nulls (a null key cannot be matched).
        """
        missing = [c for c in self.required_columns() if c not in table.column_names]
        if missing:
            hint = (" (keep _seq from the decoded batch, or Merge(order_by=None) to use the "
                    "output's row order)" if self.order_by in missing else "")
            raise ContractError(f"merge mode needs the output columns {missing}{hint}; the output "
                                f"has {table.column_names}")
        for k in self.keys:
            nulls = table[k].null_count
            if nulls:
                raise ContractError(f"merge key column {k!r} holds {nulls} null value(s): a null "
                                    "key cannot be merged (drop or fix those rows in the "
                                    "transform)")

    def delete_mask(self, table: pa.Table) -> pa.Array:
        """A boolean array (no nulls), one per row of ``table``: whether the row is a delete
        marker. All false without ``delete_when``.

        Raises:
            ColumnNotFoundError: the delete column is missing. pyarrow errors: the expression
                cannot be evaluated on ``table``.
        """
        n = table.num_rows
        d = self.delete_when
        if d is None:
            return pa.array(np.zeros(n, dtype=bool))
        if isinstance(d, tuple):
            col, value = d
            if col not in table.column_names:
                raise ColumnNotFoundError(f"delete column {col!r} not in the output "
                                          f"{table.column_names}")
            values = table[col]
            if isinstance(value, Collection) and not isinstance(value, (str, bytes)):
                mask = pc.is_in(values, value_set=pa.array(list(value), values.type))
            else:
                mask = pc.equal(values, pa.scalar(value, values.type))
            return pc.fill_null(mask, False).combine_chunks() if isinstance(
                mask, pa.ChunkedArray) else pc.fill_null(mask, False)
        rows = pa.array(np.arange(n, dtype=np.int64))
        hit = table.append_column("__cg_row", rows).filter(d)["__cg_row"]
        return pc.is_in(rows, value_set=hit.combine_chunks())

    def current(self, table: pa.Table) -> pa.Table:
        """The batch reduced to one row per key: the key's last row (see the class), with the
        boolean :data:`DELETE_COLUMN` appended (true: the key is to be deleted). Row order:
        unspecified.

        Raises:
            ContractError: as :meth:`check`.
        """
        self.check(table)
        return last_rows_by_key(table.append_column(DELETE_COLUMN, self.delete_mask(table)),
                                self.keys, self.order_by)


def last_rows_by_key(table: pa.Table, keys: tuple[str, ...] | list[str],
                     order_by: str | None) -> pa.Table:
    """Of each key (one or several columns), the row with the greatest ``order_by``; on ties,
    or with ``order_by=None``, the later row of ``table``. Row order of the result: by the
    winning rows' order (stable)."""
    if table.num_rows == 0:
        return table
    ordered = table.sort_by([(order_by, "ascending")]) if order_by is not None else table
    idx = ordered.append_column("__cg_row", pa.array(np.arange(ordered.num_rows,
                                                                dtype=np.int64)))
    last = idx.group_by(list(keys), use_threads=False).aggregate([("__cg_row", "max")])
    rows = last["__cg_row_max"]
    return ordered.take(pc.take(rows, pc.sort_indices(rows)))


WriteMode: TypeAlias = "Append | Merge"
"""A write mode: :class:`Append` or :class:`Merge`."""


def write_mode_name(mode: Append | Merge | None) -> str:
    """``"append"`` or ``"merge"`` (``None`` is append)."""
    return "append" if mode is None else mode.name
