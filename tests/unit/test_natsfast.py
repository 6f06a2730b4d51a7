"""The faster header parser returns exactly what nats-py 2.16's does."""

from __future__ import annotations

import pytest

from cg_pipelines.jetstream import natsfast

CASES = [
    b"",
    b"\r\n",
    b"Nats-Stream: S\r\nNats-Sequence: 12\r\nNats-Time-Stamp: 2026-11-21T02:11:10.96Z\r\n\r\n",
    b"A:b\r\nC:\td \r\n",
    b"No colon here\r\nK: v\r\n",
    b"Bad Name: x\r\nGood: y\r\n",
    b"Tab\tName: x\r\n",
    b" Spaced : v \r\n",
    b": empty name\r\n",
    b"\xc3\xa9t\xc3\xa9: non-ascii name\r\nOk: \xc3\xa9\r\n",
    b"Bad-Utf8: \xff\xfe\r\n",
    b"Dup: 1\r\nDup: 2\r\n",
    b"Colon: a:b:c\r\n",
    b"Line\rFeed: x\r\n",
    b"U+2003\xe2\x80\x83Name: x\r\n",
]


@pytest.mark.parametrize("raw", CASES)
def test_same_result_as_nats_py(raw: bytes) -> None:
    assert natsfast.parse_header_lines(raw) == natsfast.ORIGINAL_PARSE_HEADER_LINES(raw)


def test_installed_on_this_nats_py() -> None:
    from nats.aio.client import Client

    assert natsfast.install()
    assert Client._parse_header_lines is natsfast.parse_header_lines
