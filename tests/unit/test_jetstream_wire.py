"""Pure wire helpers of cg_pipelines.jetstream (no server)."""

from __future__ import annotations

import datetime

import pytest

from cg_pipelines.jetstream.api import (
    PullResult,
    consumer_config,
    parse_rfc3339_ns,
    seconds_to_ns,
)
from cg_pipelines.jetstream.errors import (
    ConsumerAlreadyExistsError,
    ConsumerNotFoundError,
    JetStreamError,
    JetStreamUnavailableError,
    NoMessageFoundError,
    NotPinnedError,
    RequestTimeoutError,
    StreamNotFoundError,
    WorkQueueConsumerNotUniqueError,
    error_from_response,
    error_from_status,
)


def test_consumer_config_converts_seconds_and_omits_none() -> None:
    cfg = consumer_config(
        "m1",
        filter_subjects=["0.>", "3.>"],
        ack_wait_s=5,
        max_ack_pending=1,
        inactive_threshold_s=0.25,
        priority_groups=["PCG"],
        priority_policy="pinned_client",
        priority_timeout_s=1.5,
    )
    assert cfg == {
        "name": "m1",
        "filter_subjects": ["0.>", "3.>"],
        "deliver_policy": "all",
        "ack_policy": "explicit",
        "ack_wait": 5_000_000_000,
        "max_ack_pending": 1,
        "inactive_threshold": 250_000_000,
        "priority_groups": ["PCG"],
        "priority_policy": "pinned_client",
        "priority_timeout": 1_500_000_000,
    }
    assert all(isinstance(cfg[k], int) for k in ("ack_wait", "inactive_threshold"))


def test_consumer_config_single_filter_stays_a_list() -> None:
    cfg = consumer_config(durable_name="g-m1", filter_subjects=["orders.>"])
    assert cfg == {
        "durable_name": "g-m1",
        "filter_subjects": ["orders.>"],
        "deliver_policy": "all",
        "ack_policy": "explicit",
    }
    assert "filter_subject" not in cfg


def test_consumer_config_extra_and_validation() -> None:
    cfg = consumer_config("c", max_deliver=3, extra={"replay_policy": "instant"})
    assert cfg["max_deliver"] == 3 and cfg["replay_policy"] == "instant"
    with pytest.raises(ValueError):
        consumer_config("c", ack_wait_s=-1)
    with pytest.raises(ValueError):
        consumer_config("c", filter_subjects=[""])
    with pytest.raises(ValueError):
        consumer_config("c", priority_policy="pinned_client")


def test_seconds_to_ns() -> None:
    assert seconds_to_ns(0) == 0
    assert seconds_to_ns(1e-9) == 1
    assert seconds_to_ns(0.1) == 100_000_000
    with pytest.raises(ValueError):
        seconds_to_ns(-0.5)


@pytest.mark.parametrize(
    ("stamp", "expected"),
    [
        ("1970-01-01T00:00:00Z", 0),
        ("1970-01-01T00:00:01.000000001Z", 1_000_000_001),
        ("2026-11-21T01:50:48.67076386Z", 1795225848_670763860),
        ("2026-11-21T01:50:48Z", 1795225848_000000000),
        ("2024-01-01T01:00:00.5+01:00", 1704067200_500000000),
        ("2023-12-31T19:00:00-05:00", 1704067200_000000000),
    ],
)
def test_parse_rfc3339_ns(stamp: str, expected: int) -> None:
    assert parse_rfc3339_ns(stamp) == expected


def test_parse_rfc3339_ns_matches_datetime_to_the_microsecond() -> None:
    dt = datetime.datetime(2025, 6, 7, 8, 9, 10, 123456, tzinfo=datetime.UTC)
    assert parse_rfc3339_ns(dt.isoformat().replace("+00:00", "Z")) // 1000 == int(
        dt.timestamp() * 1_000_000
    )


@pytest.mark.parametrize("bad", ["", "yesterday", "2026-11-21", "2026-11-21T01:50:48.1234567890Z"])
def test_parse_rfc3339_ns_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_rfc3339_ns(bad)


@pytest.mark.parametrize(
    ("code", "err_code", "cls"),
    [
        (404, 10059, StreamNotFoundError),
        (404, 10014, ConsumerNotFoundError),
        (400, 10149, ConsumerNotFoundError),
        (400, 10148, ConsumerAlreadyExistsError),
        (400, 10013, ConsumerAlreadyExistsError),
        (400, 10105, ConsumerAlreadyExistsError),
        (400, 10100, WorkQueueConsumerNotUniqueError),
        (400, 10099, WorkQueueConsumerNotUniqueError),
        (404, 10037, NoMessageFoundError),
        (400, 10160, JetStreamError),
    ],
)
def test_error_from_response(code: int, err_code: int, cls: type[JetStreamError]) -> None:
    resp = {"type": "x", "error": {"code": code, "err_code": err_code, "description": "boom"}}
    e = error_from_response(resp)
    assert type(e) is cls
    assert (e.status, e.err_code, e.description) == (code, err_code, "boom")
    assert str(e) == f"boom (status {code}, err_code {err_code})"


def test_error_from_status_and_timeout() -> None:
    assert isinstance(error_from_status(423, "Nats-Wrong-Pin-Id"), NotPinnedError)
    assert isinstance(error_from_status(404, "No Messages"), NoMessageFoundError)
    assert isinstance(error_from_status(503), JetStreamUnavailableError)
    assert type(error_from_status(409, "Consumer Deleted")) is JetStreamError
    # a clustered consumer's new leader ends the pulls waiting at the old one; a stopping
    # node ends its pulls: both are "ask again", like 503
    for text in ("Leadership Change", "Server Shutdown", "leadership change"):
        assert isinstance(error_from_status(409, text), JetStreamUnavailableError), text
    assert type(error_from_status(409, "Consumer is push based")) is JetStreamError
    t = RequestTimeoutError("$JS.API.STREAM.INFO.S", 0.5)
    assert t.subject == "$JS.API.STREAM.INFO.S" and t.timeout_s == 0.5
    assert "$JS.API.STREAM.INFO.S" in str(t) and isinstance(t, JetStreamError)


def test_pull_result_error() -> None:
    assert PullResult(status=None).error is None
    assert PullResult(status=404).error is None
    assert PullResult(status=408).error is None
    assert isinstance(PullResult(status=423).error, NotPinnedError)
    assert PullResult(status=423).pin_lost
    assert PullResult(status=409, description="Message Size Exceeds MaxBytes").error is not None
    with pytest.raises(JetStreamError):
        PullResult(status=400, description="Bad Request").raise_for_status()
    ok = PullResult(status=408)
    assert ok.raise_for_status() is ok


@pytest.mark.parametrize(("status", "description", "delivered", "unavailable"), [
    (503, "No Responders", False, True),
    (409, "Leadership Change", False, True),
    (409, "Server Shutdown", False, True),
    (409, "Leadership Change", True, False),  # something came: use it
    (409, "Consumer Deleted", False, False),
    (409, "Message Size Exceeds MaxBytes", False, False),
    (423, "Nats-Wrong-Pin-Id", False, False),
    (404, "No Messages", False, False),
    (408, "Request Timeout", False, False),
    (None, "", False, False),
])
def test_pull_result_unavailable(status: int | None, description: str, delivered: bool,
                                 unavailable: bool) -> None:
    got = PullResult(messages=[object()] if delivered else [],  # type: ignore[list-item]
                     status=status, description=description)
    assert got.unavailable is unavailable
