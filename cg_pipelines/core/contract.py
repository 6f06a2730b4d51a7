"""The transform's output contract, checked on each batch's output before anything uses it.

A transform's output rows are committed to the table and, when the processor declares
:class:`~cg_pipelines.core.state.KeyedState`, read back as the next batch's per-key state. So the
output must have:

- the state key column (``KeyedState.key``), of the batch's key type family (string with
  string, integer with integer);
- the order column (``KeyedState.order_by``, ``_seq`` by default: the message's origin stream
  sequence, which reconciliation also uses to prove coverage), an integer where it is ``_seq``;
- every declared state column (``KeyedState.columns``), of the type ``KeyedState.schema`` gives
  it when a schema is declared.

Whether or not state is declared, a ``_seq`` column present must be an integer. A violation is
one line naming the column: ``transform output: missing state key column 'device'
(KeyedState.key); output columns: ts, value, _seq``. Pure: no I/O.
"""

from __future__ import annotations

import pyarrow as pa

from cg_pipelines.core.errors import ContractError
from cg_pipelines.core.record import SEQ_COLUMN
from cg_pipelines.core.state import KeyedState

__all__ = ["OutputContractError", "check_output", "contract_violation"]


_SHOWN_COLUMNS = 12


class OutputContractError(ContractError):
    """The transform's output misses a required column or has it with the wrong type.

    Attributes:
        column: the offending column's name.
    """

    def __init__(self, column: str, message: str) -> None:
        self.column = column
        super().__init__(message)


def _family(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_dictionary(t):
        return _family(t.value_type)
    return str(t)


def _columns(schema: pa.Schema) -> str:
    names = schema.names
    shown = ", ".join(names[:_SHOWN_COLUMNS])
    more = len(names) - _SHOWN_COLUMNS
    return (shown + (f" (+{more} more)" if more > 0 else "")) or "(none)"


def _same_type(got: pa.DataType, want: pa.DataType) -> bool:
    """``got`` is ``want`` or an all-null column (null type) or of the same string/integer
    family (Arrow's string and large_string, int32 and int64: the table writer unifies
    them)."""
    if got == want or pa.types.is_null(got):
        return True
    fam_got, fam_want = _family(got), _family(want)
    return fam_got == fam_want and fam_got in ("string", "integer")


def contract_violation(
    schema: pa.Schema,
    state: KeyedState | None = None,
    *,
    key_type: pa.DataType | None = None,
    where: str = "transform output",
) -> OutputContractError | None:
    """The first violation of the output contract (module docstring) by ``schema``, or None.

    Args:
        schema: the output table's schema.
        state: the processor's declared per-key state (None: only the ``_seq`` type is checked).
        key_type: the key column's type in the decoded batch, when known (else the one
            ``state.schema`` declares, if any).
        where: how the message starts (e.g. ``"transform output of partition 3 of S-g"``).
    """
    def bad(column: str, what: str) -> OutputContractError:
        return OutputContractError(column, f"{where}: {what}; output columns: {_columns(schema)}")

    def typed(column: str, role: str, want: str) -> OutputContractError:
        got = schema.field(column).type
        return bad(column, f"{role} {column!r} is {got}, expected {want}")

    names = set(schema.names)
    if state is not None:
        if state.key not in names:
            return bad(state.key, f"missing state key column {state.key!r} (KeyedState.key)")
        if key_type is None and state.schema is not None and state.key in state.schema.names:
            key_type = state.schema.field(state.key).type
        if key_type is not None and not _same_type(schema.field(state.key).type, key_type):
            return typed(state.key, "state key column", f"{key_type}")
        if state.order_by not in names:
            what = ("the origin sequence, keep the input's _seq" if state.order_by == SEQ_COLUMN
                    else "KeyedState.order_by")
            return bad(state.order_by, f"missing order column {state.order_by!r} ({what})")
        declared = {f.name: f.type for f in state.schema} if state.schema is not None else {}
        for c in state.columns:
            if c not in names:
                return bad(c, f"missing state column {c!r} (KeyedState.columns)")
            want = declared.get(c)
            if want is not None and not _same_type(schema.field(c).type, want):
                return typed(c, "state column", f"{want} (KeyedState.schema)")
    if SEQ_COLUMN in names:
        t = schema.field(SEQ_COLUMN).type
        if not (pa.types.is_integer(t) or pa.types.is_null(t)):
            return typed(SEQ_COLUMN, "order column", "int64 (the origin stream sequence)")
    return None


def check_output(
    schema: pa.Schema,
    state: KeyedState | None = None,
    *,
    key_type: pa.DataType | None = None,
    where: str = "transform output",
) -> None:
    """Raise the first violation :func:`contract_violation` finds.

    Raises:
        OutputContractError: one line naming the missing or mistyped column.
    """
    err = contract_violation(schema, state, key_type=key_type, where=where)
    if err is not None:
        raise err
