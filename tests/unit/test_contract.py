"""The transform's output contract (cg_pipelines.core.contract): one line naming the missing or
mistyped column, table-driven."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cg_pipelines.core.contract import OutputContractError, check_output, contract_violation
from cg_pipelines.core.state import KeyedState

STATE = KeyedState("device", ("total", "count"),
                   schema=pa.schema([("device", pa.string()), ("total", pa.float64()),
                                     ("count", pa.int64())]))
UNTYPED = KeyedState("device", ("total",), order_by="ts")


def schema(**cols: pa.DataType) -> pa.Schema:
    return pa.schema(list(cols.items()))


GOOD = schema(device=pa.string(), total=pa.float64(), count=pa.int64(), _seq=pa.int64())

CASES = [
    # (schema, state, column named, text in the message)
    (schema(total=pa.float64(), count=pa.int64(), _seq=pa.int64()), STATE, "device",
     "missing state key column 'device' (KeyedState.key)"),
    (schema(device=pa.int64(), total=pa.float64(), count=pa.int64(), _seq=pa.int64()), STATE,
     "device", "state key column 'device' is int64, expected string"),
    (schema(device=pa.string(), total=pa.float64(), count=pa.int64()), STATE, "_seq",
     "missing order column '_seq' (the origin sequence, keep the input's _seq)"),
    (schema(device=pa.string(), count=pa.int64(), _seq=pa.int64()), STATE, "total",
     "missing state column 'total' (KeyedState.columns)"),
    (schema(device=pa.string(), total=pa.string(), count=pa.int64(), _seq=pa.int64()), STATE,
     "total", "state column 'total' is string, expected double (KeyedState.schema)"),
    (schema(device=pa.string(), total=pa.float64(), count=pa.int64(), _seq=pa.string()), STATE,
     "_seq", "order column '_seq' is string, expected int64"),
    (schema(device=pa.string(), total=pa.float64()), UNTYPED, "ts",
     "missing order column 'ts' (KeyedState.order_by)"),
    (schema(x=pa.int64(), _seq=pa.float64()), None, "_seq", "order column '_seq' is double"),
]


@pytest.mark.parametrize(("sch", "state", "column", "text"), CASES)
def test_violations_name_the_column_in_one_line(sch: pa.Schema, state: KeyedState | None,
                                                column: str, text: str) -> None:
    with pytest.raises(OutputContractError) as e:
        check_output(sch, state, where="transform output of partition 3 of S-g")
    msg = str(e.value)
    assert e.value.column == column
    assert "\n" not in msg
    assert msg.startswith("transform output of partition 3 of S-g: ")
    assert text in msg, msg
    assert "output columns: " in msg


@pytest.mark.parametrize(("sch", "state"), [
    (GOOD, STATE),
    # string family and integer family are the same to the table writer; all-null columns pass
    (schema(device=pa.large_string(), total=pa.null(), count=pa.int32(), _seq=pa.int64()), STATE),
    (schema(device=pa.string(), total=pa.int64(), ts=pa.timestamp("us")), UNTYPED),
    (schema(anything=pa.binary()), None),
    (schema(x=pa.int64(), _seq=pa.int32()), None),
])
def test_conforming_outputs_pass(sch: pa.Schema, state: KeyedState | None) -> None:
    assert contract_violation(sch, state) is None
    check_output(sch, state)


def test_key_type_from_the_batch_wins_over_the_schema() -> None:
    sch = schema(device=pa.int64(), total=pa.float64(), count=pa.int64(), _seq=pa.int64())
    assert contract_violation(sch, STATE, key_type=pa.int64()) is None
    err = contract_violation(GOOD, STATE, key_type=pa.int64())
    assert err is not None and "'device' is string, expected int64" in str(err)


def test_long_column_lists_are_cut() -> None:
    sch = pa.schema([(f"c{i}", pa.int64()) for i in range(30)])
    err = contract_violation(sch, STATE)
    assert err is not None and "(+18 more)" in str(err)
