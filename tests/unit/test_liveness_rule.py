"""The lost-run rule (cg_pipelines.core.liveness.judge_run): a table of sightings."""

from __future__ import annotations

import pytest

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.liveness import RunSighting, heartbeat_subject, judge_run

OLD = 1_000.0  # seconds since the run started: past the default 120 s grace
NEW = 30.0


@pytest.mark.parametrize(("seen", "lost"), [
    # the same-host fast path decides first, whatever NATS says
    (RunSighting("r", NEW, process_gone=True, heartbeat=True, pinned=True), True),
    (RunSighting("r", OLD, process_gone=False, heartbeat=False, pinned=False), False),
    # another host: a live heartbeat or a pinned lease keeps the run
    (RunSighting("r", OLD, heartbeat=True, pinned=False), False),
    (RunSighting("r", OLD, heartbeat=False, pinned=True), False),
    (RunSighting("r", OLD, heartbeat=True, pinned=True), False),
    # no heartbeat, no pin, past the grace: lost (the lost-host case)
    (RunSighting("r", OLD, heartbeat=False, pinned=False), True),
    # ... but not while the run may still be starting
    (RunSighting("r", NEW, heartbeat=False, pinned=False), False),
    # anything unknown keeps it alive
    (RunSighting("r", OLD, heartbeat=None, pinned=False), False),
    (RunSighting("r", OLD, heartbeat=False, pinned=None), False),
    (RunSighting("r", OLD), False),
])
def test_judge_run(seen: RunSighting, lost: bool) -> None:
    verdict = judge_run(seen)
    assert verdict.lost is lost, verdict.reason
    assert verdict.reason


def test_grace_is_a_setting() -> None:
    seen = RunSighting("r", NEW, heartbeat=False, pinned=False)
    assert judge_run(seen, grace_s=10.0).lost
    assert not judge_run(seen, grace_s=60.0).lost
    with pytest.raises(ConfigError, match="grace_s"):
        judge_run(seen, grace_s=-1)


def test_heartbeat_subject_is_one_token() -> None:
    assert heartbeat_subject("3f2a-b_9") == "cg.liveness.3f2a-b_9"
    for bad in ("", "a.b", "a b", "*", ">", "x" * 129):
        with pytest.raises(ConfigError, match="run_id"):
            heartbeat_subject(bad)
