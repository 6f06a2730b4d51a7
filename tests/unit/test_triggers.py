"""Sensor decisions: backlog run requests, membership gains, how a tick reads the backlog."""

from __future__ import annotations

import pytest

from cg_pipelines.core.lag import (
    DEFAULT_LAG_PER_DAY,
    LAG_BURST,
    LAG_STATES,
    lag_events_per_day,
    lag_observations_due,
    lag_state,
)
from cg_pipelines.core.triggers import (
    MAX_LISTED_SUBJECTS,
    SUBJECTS_PER_PARTITION,
    BacklogCursor,
    BacklogRequest,
    CursorError,
    MembershipCursor,
    backlog_requests,
    decode_cursor,
    drop_repeated_requests,
    encode_cursor,
    gained_partitions,
    pending_by_partition,
    served_partitions,
    summary_lines,
    use_subject_counts,
)
from cg_pipelines.core.triggers import (
    PartitionBacklog as B,
)


@pytest.mark.parametrize(
    ("backlog", "kw", "expected"),
    [
        ([B(0, 5, 10, 1.0), B(1, 0, None, 0.0), B(2, 1, 7, 0.5)], {},
         [(0, "g:0:10"), (2, "g:2:7")]),
        ([B(0, 5, 10, 1.0), B(2, 100, 7, 0.5)], {"min_pending": 50}, [(2, "g:2:7")]),
        ([B(0, 5, 10, 900.0), B(2, 3, 7, 0.5)], {"min_pending": 50, "max_age_s": 600},
         [(0, "g:0:10")]),
        ([B(0, 5, 10, 1.0), B(1, 5, 3, 1.0)], {"partitions": [1]}, [(1, "g:1:3")]),
        ([B(0, 5, 10, 1.0), B(0, 6, 10, 1.0)], {}, [(0, "g:0:10")]),  # one per partition
        ([], {}, []),
    ],
)
def test_backlog_requests(backlog, kw, expected) -> None:
    got = backlog_requests("g", backlog, **kw)
    assert [(r.partition, r.run_key) for r in got] == expected
    assert all(r.reason for r in got)


def test_backlog_requests_rejects_bad_threshold() -> None:
    with pytest.raises(ValueError):
        backlog_requests("g", [], min_pending=0)


def test_same_backlog_same_key_new_backlog_new_key() -> None:
    a = backlog_requests("g", [B(3, 10, 100, 1.0)])
    b = backlog_requests("g", [B(3, 12, 100, 2.0)])  # more arrived, same first pending
    c = backlog_requests("g", [B(3, 4, 111, 0.1)])  # drained up to 110, new backlog
    assert a[0].run_key == b[0].run_key != c[0].run_key


@pytest.mark.parametrize(
    ("old", "new", "served", "expected"),
    [
        ({"m1": [0, 1, 2, 3]}, {"m1": [0, 1], "m2": [2, 3]}, None,
         {2: ("m1", "m2"), 3: ("m1", "m2")}),
        ({"m1": [0, 1, 2, 3]}, {"m1": [0, 1], "m2": [2, 3]}, ["m1"], {}),
        ({}, {"m1": [0, 1]}, ["m1"], {0: (None, "m1"), 1: (None, "m1")}),
        ({"m1": [0], "m2": [1]}, {"m2": [0, 1]}, ["m2"], {0: ("m1", "m2")}),
        ({"m1": [0]}, {}, None, {}),  # dropped: nothing gained
    ],
)
def test_gained_partitions(old, new, served, expected) -> None:
    assert gained_partitions(old, new, served) == expected


def test_served_partitions_and_cursor_round_trip() -> None:
    assign = {"m1": [0, 3], "m2": [1, 2]}
    assert served_partitions(assign, ["m2"]) == [1, 2]
    assert served_partitions(assign, None) == [0, 1, 2, 3]
    m = MembershipCursor(7, assign)
    assert encode_cursor(m) == '{"rev":7,"assignment":{"m1":[0,3],"m2":[1,2]}}'
    assert decode_cursor(encode_cursor(m), MembershipCursor) == m
    assert decode_cursor(None, MembershipCursor) == MembershipCursor()
    b = BacklogCursor({"0": [3, 17, 1.5e9], "1": [0, None, 0.0]}, 12.5, {2: 4}, {"r1": "boom"},
                      {0: ("g:0:17", 1.5e9)})
    assert decode_cursor(encode_cursor(b), BacklogCursor) == b
    assert decode_cursor("", BacklogCursor) == BacklogCursor()
    assert decode_cursor("{}", BacklogCursor) == BacklogCursor()  # missing fields: empty


@pytest.mark.parametrize(("kind", "text", "problem"), [
    (MembershipCursor, "{oops", "JSONDecodeError"),
    (MembershipCursor, "[1]", "expected a JSON object, got list"),
    (MembershipCursor, '{"assignment": {}}', "KeyError: 'rev'"),
    (MembershipCursor, '{"rev": 1, "assignment": {"m1": 3}}', "expected a JSON array, got int"),
    (MembershipCursor, '{"rev": true, "assignment": {}}', "expected an integer, got bool"),
    (BacklogCursor, "7", "expected a JSON object, got int"),
    (BacklogCursor, '{"dead_letters": {"x": 1}}', "ValueError: invalid literal"),
    (BacklogCursor, '{"observed": {"0": "abc"}}', "expected a JSON array, got str"),
    (BacklogCursor, '{"reconciled_at": "soon"}', "expected a number, got str"),
    (BacklogCursor, '{"errors": ["x"]}', "expected a JSON object, got list"),
    (BacklogCursor, '{"requested": {"0": [1, 2]}}', "expected a run key string, got int"),
    (BacklogCursor, '{"requested": {"0": ["k"]}}', "ValueError: not enough values"),
])
def test_corrupt_cursors_raise_cursor_error(kind: type, text: str, problem: str) -> None:
    with pytest.raises(CursorError) as ei:
        decode_cursor(text, kind)
    what = "membership" if kind is MembershipCursor else "backlog"
    assert str(ei.value).startswith(f"corrupt {what} cursor {text[:80]!r}: "), str(ei.value)
    assert problem in str(ei.value)
    assert isinstance(ei.value, ValueError)  # a CgError that is also a ValueError


@pytest.mark.parametrize(
    ("num_subjects", "partitions", "expected"),
    [
        (4000, 256, False),  # ~16 subjects per partition: the direct gets are cheaper
        (2048, 256, True),  # 8 per partition: list them, skip the empty partitions
        (2049, 256, False),
        (80, 256, True),
        (4096, 4096, True),
        (4000, 16, False),
        (1, 1, False),  # one partition: its direct get is the cheapest read
        (0, 256, False),  # nothing to list
        (MAX_LISTED_SUBJECTS, MAX_LISTED_SUBJECTS // SUBJECTS_PER_PARTITION, True),
        (MAX_LISTED_SUBJECTS + 1, 4096 * 8, False),  # never more than one page
        (SUBJECTS_PER_PARTITION * 3, 3, True),
        (SUBJECTS_PER_PARTITION * 3 + 1, 3, False),
    ],
)
def test_use_subject_counts(num_subjects: int, partitions: int, expected: bool) -> None:
    assert use_subject_counts(num_subjects, partitions) is expected


@pytest.mark.parametrize(
    ("subjects", "expected"),
    [
        ({}, {}),
        ({"0.s.c1.t1": 3, "0.s.c2.t1": 2, "7.s.c1.t9": 1}, {0: 5, 7: 1}),
        ({"12.a": 4, "1.a": 1, "2.b.c": 0}, {12: 4, 1: 1}),  # no zero counts
        ({"x.a": 5, "3": 2, "3.": 2, "-1.a": 1, "01.a": 1, "\u0663.a": 1, "4.a": 2},
         {4: 2}),  # not <p>.<subject>: ignored
        ({"255.s.c0.t1": 10, "255.s.c0.t2": 10, "0.s.x": 1}, {255: 20, 0: 1}),
    ],
)
def test_pending_by_partition(subjects: dict[str, int], expected: dict[int, int]) -> None:
    assert pending_by_partition(subjects) == expected


@pytest.mark.parametrize(
    ("lines", "limit", "expected"),
    [
        ([], 20, []),
        (["a", "b"], 2, ["a", "b"]),
        (["a", "b", "c"], 2, ["a", "b", "... and 1 more"]),
        (["a", "b", "c"], 0, ["... and 3 more"]),
        ([f"p{i}" for i in range(256)], 20,
         [f"p{i}" for i in range(20)] + ["... and 236 more"]),
    ],
)
def test_summary_lines(lines: list[str], limit: int, expected: list[str]) -> None:
    assert summary_lines(lines, limit) == expected


def test_summary_lines_rejects_negative_limit() -> None:
    with pytest.raises(ValueError):
        summary_lines(["a"], -1)


R = BacklogRequest


@pytest.mark.parametrize(("requested", "pending", "now", "sent", "dropped", "state"), [
    # nothing requested before: all sent, stamped now
    ({}, [0, 1], 100.0, [0, 1], 0, {0: ("g:0:5", 100.0), 1: ("g:1:9", 100.0)}),
    # same key 10 s ago: dropped, its stamp kept; partition 1 sent
    ({0: ("g:0:5", 90.0)}, [0, 1], 100.0, [1], 1, {0: ("g:0:5", 90.0), 1: ("g:1:9", 100.0)}),
    # same key, 300 s ago: sent again (an earlier request may have been lost)
    ({0: ("g:0:5", -200.0)}, [0, 1], 100.0, [0, 1], 0,
     {0: ("g:0:5", 100.0), 1: ("g:1:9", 100.0)}),
    # another key (new backlog or a retry): sent
    ({0: ("g:0:4", 99.0)}, [0, 1], 100.0, [0, 1], 0,
     {0: ("g:0:5", 100.0), 1: ("g:1:9", 100.0)}),
    # a partition without a backlog any more is forgotten
    ({7: ("g:7:1", 99.0)}, [0, 1], 100.0, [0, 1], 0,
     {0: ("g:0:5", 100.0), 1: ("g:1:9", 100.0)}),
    # a stamp from the future (clock moved back): sent
    ({0: ("g:0:5", 200.0)}, [0, 1], 100.0, [0, 1], 0,
     {0: ("g:0:5", 100.0), 1: ("g:1:9", 100.0)}),
])
def test_drop_repeated_requests(requested, pending, now, sent, dropped, state) -> None:
    reqs = [R(0, "g:0:5", "r"), R(1, "g:1:9", "r")]
    out, n, keep = drop_repeated_requests(reqs, requested, pending, now, 300.0)
    assert [r.partition for r in out] == sent
    assert n == dropped
    assert keep == state


# ------------------------------------------------------------------------------ lag volume


@pytest.mark.parametrize(("prev", "b", "now", "due", "entry"), [
    # never seen, idle: nothing to say (an idle group writes nothing), full budget
    (None, B(0, 0, None, 0.0), 100.0, False, [0, None, 0.0, 0, 4.0, None]),
    # never seen, a backlog: recorded (state behind), one unit of budget spent
    (None, B(0, 5, 10, 3.0), 100.0, True, [5, 10, 100.0, 1, 3.0, 10]),
    # an entry of the older shape counts as never seen
    ([5, 10, 40.0], B(0, 5, 10, 3.0), 100.0, True, [5, 10, 100.0, 1, 3.0, 10]),
    # moving (a new first message each tick), same state, within the cadence: not due
    ([5, 10, 50.0, 1, 3.0, 12], B(0, 4, 15, 10.0), 100.0, False,
     [5, 10, 50.0, 1, 3.0, 15]),
    # moving, the 900 s cadence passed: due (the budget refilled to its 4, one spent)
    ([5, 10, 50.0, 1, 3.0, 12], B(0, 4, 15, 10.0), 950.0, True,
     [4, 15, 950.0, 1, 3.0, 15]),
    # stopped on a message not recorded (same first message as the last tick): due at once
    ([5, 10, 50.0, 1, 3.0, 15], B(0, 4, 15, 10.0), 100.0, True,
     [4, 15, 100.0, 1, pytest.approx(3.0 + 50 * 180 / 86400 - 1), 15]),
    # stuck on the recorded message, under the objective: its timestamp still tells the age
    ([5, 10, 50.0, 1, 3.0, 10], B(0, 9, 10, 60.0), 100.0, False,
     [5, 10, 50.0, 1, 3.0, 10]),
    # the objective (300 s) crossed: due at once, state late
    ([5, 10, 50.0, 1, 3.0, 10], B(0, 9, 10, 301.0), 100.0, True,
     [9, 10, 100.0, 2, pytest.approx(2.0 + 50 * 180 / 86400), 10]),
    # drained: due at once, state caught up
    ([5, 10, 50.0, 2, 3.0, 10], B(0, 0, None, 0.0), 100.0, True,
     [0, None, 100.0, 0, pytest.approx(2.0 + 50 * 180 / 86400), None]),
    # recorded idle, still idle: never
    ([0, None, 50.0, 0, 3.0, None], B(0, 0, None, 0.0), 1e9, False,
     [0, None, 50.0, 0, 3.0, None]),
    # a change with the budget spent: held back (still a change at the next tick) ...
    ([5, 10, 100.0, 1, 0.0, 12], B(0, 0, None, 0.0), 200.0, False,
     [5, 10, 100.0, 1, 0.0, None]),
    # ... and recorded once a unit has refilled (86400 / 180 = 480 s)
    ([5, 10, 100.0, 1, 0.0, 12], B(0, 0, None, 0.0), 580.0, True,
     [0, None, 580.0, 0, pytest.approx(0.0), None]),
])
def test_lag_observations_due(prev, b, now, due, entry) -> None:
    got, seen = lag_observations_due([b], {} if prev is None else {"0": prev}, now, 900.0,
                                     objective_s=300.0, per_day=180)
    assert (got == [b]) is due
    assert seen["0"] == entry


def test_lag_state_and_bad_settings() -> None:
    assert [LAG_STATES[lag_state(b, 300.0)] for b in (
        B(0, 0, None, 0.0), B(0, 3, 1, 300.0), B(0, 3, 1, 300.5))] == [
        "caught_up", "behind", "late"]
    assert lag_state(B(0, 3, 1, 1e9)) == 1  # no objective: never late
    with pytest.raises(ValueError, match="refresh interval"):
        lag_observations_due([], {}, 0.0, 0.0)
    with pytest.raises(ValueError, match="per day"):
        lag_observations_due([], {}, 0.0, per_day=0)
    with pytest.raises(ValueError):
        lag_events_per_day(-1, 30.0)


TICK = 30.0
DAY_TICKS = int(86400 // TICK)


def test_lag_events_256_busy_partitions_a_day_and_a_stuck_one() -> None:
    """A simulated day of 30 s backlog ticks over 256 partitions with the defaults. 255 are
    busy all day (steady traffic: at each tick a run drained what the previous one saw, and
    new messages wait, 20 s old at most); partition 0 is busy too until it stops on one
    message at tick STOP and stays stuck there. Lag observations: the busy ones at the 900 s
    cadence only (96 each), 24,576 in all at most (far under the 50,000 a day of issue 40;
    the rule before wrote one per partition per minute, 368,640); the stuck partition's age,
    read from its latest observation as ``now - (observed_at - oldest_pending_age_s)`` (the
    oldest pending message's timestamp), is exact at every tick from the one after it
    stopped, and it is recorded late at the tick its message crosses the 300 s objective."""
    assert lag_events_per_day(256, TICK, steady=True) == 24_576 <= 50_000
    assert lag_events_per_day(256, TICK) == 256 * (DEFAULT_LAG_PER_DAY + LAG_BURST) \
        == 47_104 <= 50_000
    stop = 1000
    stuck_at = stop * TICK - 20.0  # the message partition 0 stops on
    seen: dict = {}
    busy = stuck = 0
    latest: tuple[float, float] | None = None  # partition 0: (observed_at, age then)
    late_at = None
    errors: dict[int, float] = {}
    for t in range(DAY_TICKS):
        now = t * TICK
        backlog = [B(p, 10, 1000 * t + p, 20.0) for p in range(1, 256)]
        if t < stop:
            backlog.insert(0, B(0, 10, 1000 * t, 20.0))
        else:
            backlog.insert(0, B(0, 10 + t - stop, 1000 * stop, now - stuck_at))
        due, seen = lag_observations_due(backlog, seen, now, objective_s=300.0)
        for b in due:
            if b.partition == 0:
                stuck += 1
                latest = (now, b.age_s)
                if lag_state(b, 300.0) == 2 and late_at is None:
                    late_at = t
            else:
                busy += 1
        if t >= stop:
            assert latest is not None
            reported = now - (latest[0] - latest[1])
            errors[t] = abs(reported - (now - stuck_at))
    assert busy == 255 * 96
    assert errors[stop] > TICK  # at the tick it stops nobody can tell yet ...
    assert max(errors[t] for t in errors if t > stop) < 1e-6  # ... from the next on: exact
    assert late_at == stop + int((300.0 - 20.0) // TICK) + 1  # the first tick past 300 s
    p0 = seen["0"]
    assert p0[3] == 2 and p0[1] == 1000 * stop  # recorded late, on the stuck message
    # partition 0: the cadence, plus "stopped" and "late" (two changes of state)
    assert stuck <= 96 + 2
    assert busy + stuck <= lag_events_per_day(256, TICK, steady=True) + 2 <= 50_000


def test_lag_events_bound_holds_whatever_the_traffic() -> None:
    """The worst traffic for the rule: every partition flips between a backlog and nothing
    at every tick (each tick a change of state). Each partition still writes at most its
    budget, 180 a day plus a burst of 4: 47,104 at 256 partitions."""
    seen: dict = {}
    events = 0
    for t in range(DAY_TICKS):
        backlog = [B(p, t % 2, t if t % 2 else None, 1.0 if t % 2 else 0.0)
                   for p in range(256)]
        due, seen = lag_observations_due(backlog, seen, t * TICK, objective_s=300.0)
        events += len(due)
    assert events <= lag_events_per_day(256, TICK) == 47_104
    assert events >= 256 * DEFAULT_LAG_PER_DAY  # the budget is what limits it here
