"""Strict JSON decoding: each bad payload rejected with its reason."""

from __future__ import annotations

import pytest

from cg_pipelines.core.decode import BadMessage, Field, JsonDecoder, subject_tokens
from cg_pipelines.engine.model import Record
from cg_pipelines.engine.processing import decode_batch

DEC = JsonDecoder([Field("key", "string"), Field("n", "int"), Field("x", "float", required=False),
                   Field("ok", "bool", required=False, nullable=False)])


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
    table, dead = decode_batch(recs, DEC)
    assert table.column("_seq").to_pylist() == [5, 9]
    assert table.column("n").to_pylist() == [1, 2]
    assert table.column("_subject").to_pylist() == ["s.a", "s.a"]
    assert [(d.seq, d.reason.split(":")[0]) for d in dead] == [(6, "malformed JSON")]


def test_duplicate_fields_rejected() -> None:
    with pytest.raises(ValueError):
        JsonDecoder([Field("a", "int"), Field("a", "string")])


def test_subject_tokens_names_the_missing_tokens() -> None:
    assert subject_tokens("flights.AA.N1", "flights.<carrier>.<tailnum>") == [
        "flights", "AA", "N1"]
    with pytest.raises(BadMessage, match=r"subject 'flights.AA' has too few tokens \(2, "
                       r"expected 3: flights.<carrier>.<tailnum>\)"):
        subject_tokens("flights.AA", "flights.<carrier>.<tailnum>")
    with pytest.raises(BadMessage, match="too many tokens"):
        subject_tokens("flights.AA.N1.x", "flights.<carrier>.<tailnum>")
