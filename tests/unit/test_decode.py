"""Strict JSON decoding: each bad payload rejected with its reason."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cg_pipelines.core.decode import BadMessage, JsonDecoder, JsonField, subject_tokens
from cg_pipelines.engine.processing import decode_batch
from cg_pipelines.engine.processor import Record, records_to_arrow

DEC = JsonDecoder([JsonField("key", "string"), JsonField("n", "int"),
                   JsonField("x", "float", required=False),
                   JsonField("ok", "bool", required=False, nullable=False)])


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty payload"),
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'{"n": 1}', "missing field 'key'"),
        (b'{"key": 1, "n": 1}', "field 'key' must be string, got int"),
        (b'{"key": "a", "n": "1"}', "field 'n' must be int, got str"),
        (b'{"key": "a", "n": true}', "field 'n' must be int, got bool"),
        (b'{"key": "a", "n": 1.5}', "field 'n' must be int, got float"),
        (b'{"key": "a", "n": 1, "ok": null}', "field 'ok' must not be null"),
    ],
)
def test_rejects_with_reason(data: bytes, reason: str) -> None:
    with pytest.raises(BadMessage) as ei:
        DEC.decode(data)
    assert reason in str(ei.value)


@pytest.mark.parametrize(
    ("data", "row"),
    [
        (b'{"key": "a", "n": 1}', {"key": "a", "n": 1, "x": None, "ok": None}),
        (b'{"key": "a", "n": 2, "x": 3, "ok": false, "extra": 1}',
         {"key": "a", "n": 2, "x": 3.0, "ok": False}),
        (b'{"key": null, "n": null}', {"key": None, "n": None, "x": None, "ok": None}),
    ],
)
def test_accepts(data: bytes, row: dict) -> None:
    assert DEC.decode(data) == row


def test_decode_batch_keeps_order_and_lists_dead() -> None:
    recs = [Record(5, "s.a", b'{"key":"a","n":1}', 10), Record(6, "s.b", b"oops", 11),
            Record(9, "s.a", b'{"key":"a","n":2}', 12)]
    table, dead = decode_batch(records_to_arrow(recs), DEC)
    assert table.column("_seq").to_pylist() == [5, 9]
    assert table.column("n").to_pylist() == [1, 2]
    assert table.column("_subject").to_pylist() == ["s.a", "s.a"]
    assert [(d.seq, d.reason.split(":")[0]) for d in dead] == [(6, "malformed JSON")]


def test_duplicate_fields_rejected() -> None:
    with pytest.raises(ValueError):
        JsonDecoder([JsonField("a", "int"), JsonField("a", "string")])


def test_subject_tokens_names_the_missing_tokens() -> None:
    assert subject_tokens("flights.AA.N1", "flights.<carrier>.<tailnum>") == [
        "flights", "AA", "N1"]
    with pytest.raises(BadMessage, match=r"subject 'flights.AA' has too few tokens \(2, "
                       r"expected 3: flights.<carrier>.<tailnum>\)"):
        subject_tokens("flights.AA", "flights.<carrier>.<tailnum>")
    with pytest.raises(BadMessage, match="too many tokens"):
        subject_tokens("flights.AA.N1.x", "flights.<carrier>.<tailnum>")


# -- limits and poison payloads (issue 16) ---------------------------------------------------

POISON = [
    (b'{"key": "a", "n": 123456789012345678901234567890}',
     "field 'n' must be a 64-bit int, got a 30-digit integer"),
    (b'{"key": "a", "n": -9223372036854775809}',
     "field 'n' must be a 64-bit int, got a 19-digit integer"),
    (b'{"key": "\\ud800", "n": 1}', "field 'key' is not valid Unicode (lone surrogate at "
                                    "character 0)"),
    (b'{"key": "a", "n": 1, "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "JSON nested deeper than 64 levels"),
    (b'{"key": "a", "n": 1, "deep": ' + b"[" * 64 + b"]" * 64 + b"}",
     "JSON nested deeper than 64 levels"),
    (b'{"key": "a", "n": 1, "x": NaN}', "malformed JSON: NaN is not valid JSON"),
    (b'{"key": "a", "n": 1, "x": Infinity}', "malformed JSON: Infinity is not valid JSON"),
    (b'{"key": "a", "n": 1, "x": 1e999}', "field 'x' must be a finite float"),
    (b" " * 2000, "malformed JSON"),
]


@pytest.mark.parametrize(("data", "reason"), POISON, ids=range(len(POISON)))
def test_poison_payloads_are_rejected_with_reason(data: bytes, reason: str) -> None:
    with pytest.raises(BadMessage) as err:
        DEC.decode(data)
    assert str(err.value).startswith(reason), str(err.value)


def test_depth_and_size_limits_are_inclusive() -> None:
    ok = b'{"key": "a", "n": 1, "deep": ' + b"[" * 63 + b"]" * 63 + b"}"
    assert DEC.decode(ok)["n"] == 1
    small = JsonDecoder([JsonField("k", "string")], max_payload_bytes=12)
    assert small.decode(b'{"k": "abc"}') == {"k": "abc"}
    with pytest.raises(BadMessage, match="payload is 13 bytes, over the 12-byte limit"):
        small.decode(b'{"k": "abcd"}')


# Payloads covering both paths: every one must decode the same way in bulk (decode_column)
# as one by one (decode): the same accepted rows, the same values, the same reasons.
MIXED = [
    b'{"key":"a","n":1}', b'{"key":"b","n":2,"x":2,"ok":true}', b'', b'  ',
    b'{"key":"c","n":1.0}', b'{"key":"d","n":true}', b'{"key":5,"n":1}', b'[1]',
    b'{"key":"e","n":null}', b'{"n":1}', b'{"key":"f","n":1,"ok":null}',
    b'{"key":"g",\n"n":1}', b'{"key":"h","n":1}{"key":"i","n":2}',
    b'{"key":"j","n":1,"n":2}', b'{"key":"\\ud83d\\ude00","n":3}', b'\xff{}',
    b'{"key":"k","n":1,"extra":{"nested":[1,2,{"a":null}]}}', b'{"key":"l","n":-0}',
    b'{"key":"NaN","n":7}', b'  {"key":"m","n":8}', b'{"key":"o","n":9,"x":-1.5e3}',
    *[p for p, _ in POISON],
]


def _one_by_one(payloads: list[bytes]) -> tuple[list[int], list[dict], list[tuple[int, str]]]:
    rows, values, dead = [], [], []
    for i, p in enumerate(payloads):
        try:
            values.append(DEC.decode(p))
            rows.append(i)
        except BadMessage as e:
            dead.append((i, str(e)))
    return rows, values, dead


@pytest.mark.parametrize("order", ["as listed", "reversed", "good only", "poison alone"])
def test_bulk_decoding_equals_one_by_one(order: str) -> None:
    payloads = {"as listed": MIXED, "reversed": MIXED[::-1],
                "good only": [p for p in MIXED if p.startswith(b'{"key":"')][:8],
                "poison alone": [POISON[0][0]]}[order]
    got = DEC.decode_column(pa.array(payloads, pa.binary()))
    rows, values, dead = _one_by_one(payloads)
    assert got.rows == rows
    assert got.table.to_pylist() == values
    assert got.dead == dead
    assert got.table.schema == DEC.arrow_schema


def test_bulk_path_is_taken_for_clean_batches() -> None:
    payloads = [b'{"key":"k%d","n":%d,"x":1.5}' % (i, i) for i in range(500)]
    got = DEC.decode_column(pa.array(payloads, pa.binary()))
    assert got.fast == 500 and got.dead == [] and got.table.num_rows == 500
    # one required field null: only that row goes the strict way
    payloads[7] = b'{"key":"k7","n":null}'
    got = DEC.decode_column(pa.array(payloads, pa.binary()))
    assert got.fast == 499 and got.table["n"][7].as_py() is None
