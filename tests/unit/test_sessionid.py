"""The shared Spark Connect session id (``core.sessionid``) and the URL that carries it."""

from __future__ import annotations

import uuid

import pytest

from cg_pipelines.core.sessionid import shared_session_id
from cg_pipelines.spark.session import with_session_id

KEY = '["sc://h:15002", "cg", "legs_job", ["legs"], "legs-3"]'


@pytest.mark.parametrize(("a", "b", "same"), [
    ((KEY, 1800, 0.0), (KEY, 1800, 1799.9), True),          # one window
    ((KEY, 1800, 1799.9), (KEY, 1800, 1800.0), False),      # the next window
    ((KEY, 1800, 5400.0), (KEY, 1800, 7199.0), True),
    ((KEY, 1800, 100.0), (KEY, 900, 100.0), True),          # window 0 of either length
    ((KEY, 1800, 2000.0), (KEY, 900, 2000.0), False),       # window 1 vs window 2
    ((KEY, 1800, 10.0), (KEY.replace("legs-3", "legs-4"), 1800, 10.0), False),  # partition
    ((KEY, 1800, 10.0), (KEY.replace("legs_job", "other"), 1800, 10.0), False),  # job
])
def test_same_id_within_a_window_for_the_same_key(a: tuple[str, float, float],
                                                   b: tuple[str, float, float],
                                                   same: bool) -> None:
    assert (shared_session_id(*a) == shared_session_id(*b)) is same


def test_id_is_a_version_4_uuid_and_stable() -> None:
    sid = shared_session_id(KEY, 1800, 1_764_000_000.0)
    parsed = uuid.UUID(sid)
    assert str(parsed) == sid
    assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
    # a pure function: the same inputs give the same id in any process
    assert sid == shared_session_id(KEY, 1800, 1_764_000_000.0)
    assert len({shared_session_id(KEY, 60, t * 60.0) for t in range(50)}) == 50


@pytest.mark.parametrize("window", [0, -5, float("nan"), float("inf")])
def test_window_must_be_positive(window: float) -> None:
    with pytest.raises(ValueError, match="window_s"):
        shared_session_id(KEY, window, 10.0)


@pytest.mark.parametrize(("remote", "url"), [
    ("sc://h:15002", "sc://h:15002/;session_id=S"),
    ("sc://h:15002/", "sc://h:15002/;session_id=S"),
    ("sc://h:15002/;token=t;use_ssl=true", "sc://h:15002/;token=t;use_ssl=true;session_id=S"),
    ("sc://h:15002/;session_id=OLD;token=t", "sc://h:15002/;token=t;session_id=S"),
])
def test_with_session_id(remote: str, url: str) -> None:
    assert with_session_id(remote, "S") == url
