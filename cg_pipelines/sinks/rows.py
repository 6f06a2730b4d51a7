"""Fitting a batch's rows to a table, whatever the format (pure Arrow, no I/O): the columns
in the table's order and types (:func:`conform`), a replayed partition's history reduced to
what :class:`~cg_pipelines.core.write.Merge` mode leaves (:func:`current_of`), and a reader's
rows counted as they stream by (:func:`counting`). Shared by the Delta, Iceberg and memory
sinks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.errors import ContractError
from cg_pipelines.core.write import DELETE_COLUMN, Merge, last_rows_by_key

__all__ = ["conform", "counting", "current_of"]


def counting(data: pa.RecordBatchReader, counted: dict[str, int]) -> pa.RecordBatchReader:
    """``data`` passed through, its rows added up in ``counted["rows"]``."""

    def gen() -> Iterator[pa.RecordBatch]:
        for batch in data:
            counted["rows"] += batch.num_rows
            yield batch

    return pa.RecordBatchReader.from_batches(data.schema, gen())


def conform(table: pa.Table, target: pa.Schema, where: str, keep: Sequence[str] = ()
            ) -> pa.Table:
    """``table`` with the target's columns in its order and types (plus ``keep``);
    ``where`` names the table in errors.

    Raises:
        ContractError: columns missing from ``table`` or not in the table (named).
    """
    names = [n for n in table.column_names if n not in keep]
    extra = [n for n in names if n not in target.names]
    missing = [f.name for f in target if f.name not in names]
    if extra or missing:
        raise ContractError(
            f"{where}: the output's columns differ from the table's"
            + (f"; not in the table: {extra}" if extra else "")
            + (f"; missing from the output: {missing}" if missing else ""))
    # timestamps: truncated to the table's microseconds, as delta-rs does on append
    cols = [table[f.name].cast(f.type, safe=not pa.types.is_timestamp(f.type))
            for f in target] + [table[k] for k in keep]
    return pa.Table.from_arrays(cols, names=[*target.names, *keep])


def current_of(data: pa.RecordBatchReader, mode: Merge, target: pa.Schema, where: str
               ) -> pa.Table:
    """Merge mode: the rows ``data`` (output rows in stream order) leaves in the table (last
    row per key, deletes dropped), conformed to ``target``; ``where`` names the table in
    errors."""
    state: pa.Table | None = None
    for batch in data:
        if batch.num_rows == 0:
            continue
        cur = mode.current(pa.Table.from_batches([batch]))
        state = cur if state is None else last_rows_by_key(
            pa.concat_tables([state, cur], promote_options="permissive"),
            mode.keys, mode.order_by)
    if state is None:
        return target.empty_table()
    live = state.filter(pc.invert(state[DELETE_COLUMN])).drop_columns([DELETE_COLUMN])
    return conform(live, target, where)
