"""The legs computed straight from the flights frame with pandas, and a table comparison.

:func:`reference_legs` is the oracle for the streamed computation: it sees all flights at once,
in event order, and follows the definitions of :data:`~flights.data.LEGS_SCHEMA`
literally (overnight arrivals: add 1440 minutes while the arrival is before the departure).
:func:`compare_legs` checks a result table against it, keyed on ``(tailnum, leg_number)``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from flights.data import EPOCH, LEGS_COLUMNS, LEGS_SCHEMA, tail_keys

__all__ = ["KEY", "compare_legs", "day_index", "normalize_legs", "reference_legs"]

KEY = ["tailnum", "leg_number"]
"""The key of a leg: a tail number's n-th event."""

_MINUTES_PER_DAY = 1440


def day_index(df: pd.DataFrame) -> pd.Series:
    """Days from 2013-01-01 to each row's ``(year, month, day)`` (int64)."""
    dates = pd.to_datetime(
        pd.DataFrame({"year": df["year"], "month": df["month"], "day": df["day"]})
    )
    return (dates - EPOCH).dt.days.astype("int64")


def _clock_minutes(hhmm: pd.Series) -> pd.Series:
    """``HHMM`` clock value -> minutes after midnight (``2400`` -> 1440)."""
    return (hhmm // 100) * 60 + hhmm % 100


def reference_legs(df: pd.DataFrame) -> pd.DataFrame:
    """The legs of every flight of ``df``, computed per tail number in event order.

    Args:
        df: flights as :func:`~flights.data.load_flights` returns them (or a
            slice): event order is ``event_index`` when present, else row order. ``tailnum``
            may be missing (NaN/None: key :data:`~flights.data.NO_TAIL`).
            Needs the payload columns (``arr_time`` included).

    Returns:
        One row per flight, in event order, index ``0..n-1``, columns
        :data:`~flights.data.LEGS_COLUMNS` (all of ``LEGS_SCHEMA`` but ``_seq``);
        integers as pandas ``Int64`` (nullable), ``prev_dest_matches_origin`` as ``boolean``,
        strings as ``object``. Minutes and delays are minutes; distances are miles.
    """
    if "event_index" in df.columns:
        df = df.sort_values("event_index", kind="mergesort")
    df = df.reset_index(drop=True)
    out = pd.DataFrame(
        {
            "carrier": df["carrier"].astype(object),
            "flight": df["flight"].astype("Int64"),
            "tailnum": tail_keys(df),
            "year": df["year"].astype("Int64"),
            "month": df["month"].astype("Int64"),
            "day": df["day"].astype("Int64"),
            "origin": df["origin"].astype(object),
            "dest": df["dest"].astype(object),
            "sched_dep_time": df["sched_dep_time"].astype("Int64"),
            "dep_delay": df["dep_delay"].astype("Int64"),
            "arr_delay": df["arr_delay"].astype("Int64"),
            "distance": df["distance"].astype("Int64"),
        }
    )
    days = day_index(df).astype("Int64") * _MINUTES_PER_DAY
    dep = days + _clock_minutes(out["sched_dep_time"]) + out["dep_delay"]
    arr = days + _clock_minutes(df["arr_time"].astype("Int64"))
    arr = arr.where(dep.notna(), pd.NA).astype("Int64")
    while True:  # the definition, literally: +1440 while the arrival is before the departure
        early = (arr < dep).fillna(False).astype(bool)
        if not early.any():
            break
        arr = arr.where(~early, arr + _MINUTES_PER_DAY)
    out["dep_minute"] = dep
    out["arr_minute"] = arr

    by_tail = out.groupby("tailnum", sort=False)
    out["leg_number"] = (by_tail.cumcount() + 1).astype("Int64")
    prev_dest = by_tail["dest"].shift(1)
    out["prev_dest"] = prev_dest.astype(object).where(prev_dest.notna(), None)
    out["prev_dest_matches_origin"] = pd.array(
        [None if p is None else p == o for p, o in zip(out["prev_dest"], out["origin"],
                                                          strict=True)],
        dtype="boolean",
    )
    out["prev_arr_delay"] = by_tail["arr_delay"].shift(1).astype("Int64")
    out["ground_minutes"] = (out["dep_minute"] - by_tail["arr_minute"].shift(1)).astype("Int64")
    out["cum_distance"] = by_tail["distance"].cumsum().astype("Int64")
    return out[LEGS_COLUMNS]


_PANDAS_TYPES: dict[pa.DataType, object] = {
    pa.int64(): pd.Int64Dtype(),
    pa.bool_(): pd.BooleanDtype(),
}


def normalize_legs(data: pa.Table | pd.DataFrame, columns: list[str] | None = None) -> pd.DataFrame:
    """``data`` as a pandas frame with the legs columns in comparable dtypes.

    Integers -> ``Int64``, booleans -> ``boolean``, strings -> ``object`` with ``None`` for
    nulls, following :data:`~flights.data.LEGS_SCHEMA`. Only ``columns`` (default:
    those of ``LEGS_COLUMNS`` present in ``data``) are kept.

    Raises:
        KeyError: ``tailnum`` or ``leg_number`` is missing.
        TypeError / ValueError: a column cannot be converted (e.g. a non-integral float).
    """
    if isinstance(data, pa.Table):
        frame = data.to_pandas(types_mapper=_PANDAS_TYPES.get)
    else:
        frame = data
    cols = columns if columns is not None else [c for c in LEGS_COLUMNS if c in frame.columns]
    for k in KEY:
        if k not in frame.columns:
            raise KeyError(f"column {k!r} missing (have {list(frame.columns)})")
    out = pd.DataFrame(index=pd.RangeIndex(len(frame)))
    for c in cols:
        s = frame[c].reset_index(drop=True)
        t = LEGS_SCHEMA.field(c).type
        if t == pa.int64():
            out[c] = s.astype("Int64")
        elif t == pa.bool_():
            out[c] = s.astype("boolean")
        else:
            out[c] = s.astype(object).where(s.notna(), None)
    return out


def _fmt_key(key: tuple[object, object]) -> str:
    return f"{key[0]}#{key[1]}"


def _fmt_value(v: object) -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)):
        return "null"
    return repr(v.item()) if isinstance(v, np.generic) else repr(v)


def _equal(a: pd.Series, b: pd.Series) -> np.ndarray:
    """Element-wise equality with null == null (bool numpy array)."""
    na, nb = a.isna().to_numpy(), b.isna().to_numpy()
    same = (a == b).fillna(False).to_numpy(dtype=bool, na_value=False)
    return (na & nb) | (~na & ~nb & same)


def compare_legs(
    table: pa.Table | pd.DataFrame, ref: pd.DataFrame, *, max_details: int = 5
) -> tuple[int, int, str]:
    """Compare a legs table (e.g. the committed Delta table) with :func:`reference_legs`.

    Rows are matched on ``(tailnum, leg_number)``; the columns compared are those of
    ``LEGS_COLUMNS`` present in both (``_seq`` and other extra columns are ignored). Nulls
    equal nulls.

    Returns:
        ``(rows, mismatches, description)``: ``rows`` = distinct keys on either side;
        ``mismatches`` = missing keys (in ``ref`` only) + extra keys (in ``table`` only) +
        duplicate rows (each row beyond the first of a key, on either side) + matched keys
        with at least one differing value; ``description`` = counts per kind and the first
        ``max_details`` problems (``"ok"`` when there are none).
    """
    got = normalize_legs(table)
    exp = normalize_legs(ref)
    cols = [c for c in LEGS_COLUMNS if c in got.columns and c in exp.columns and c not in KEY]

    dup_got = got.duplicated(KEY, keep="first")
    dup_exp = exp.duplicated(KEY, keep="first")
    details: list[str] = []
    for name, frame, dups in (("duplicate", got, dup_got), ("duplicate in ref", exp, dup_exp)):
        for key in frame.loc[dups, KEY].itertuples(index=False, name=None):
            details.append(f"{name} {_fmt_key(key)}")
    g1, e1 = got[~dup_got], exp[~dup_exp]

    merged = g1.merge(e1, on=KEY, how="outer", suffixes=("", "__ref"), indicator=True)
    merged = merged.sort_values(KEY, kind="mergesort", ignore_index=True)
    missing = (merged["_merge"] == "right_only").to_numpy()
    extra = (merged["_merge"] == "left_only").to_numpy()
    both = (merged["_merge"] == "both").to_numpy()
    for key in merged.loc[missing, KEY].itertuples(index=False, name=None):
        details.append(f"missing {_fmt_key(key)}")
    for key in merged.loc[extra, KEY].itertuples(index=False, name=None):
        details.append(f"extra {_fmt_key(key)}")

    differs = np.zeros(len(merged), dtype=bool)
    diff_cols: dict[str, np.ndarray] = {}
    for c in cols:
        bad = both & ~_equal(merged[c], merged[f"{c}__ref"])
        if bad.any():
            diff_cols[c] = bad
            differs |= bad
    for i in np.flatnonzero(differs)[: max_details].tolist():
        key = (merged.at[i, "tailnum"], merged.at[i, "leg_number"])
        parts = [f"{c}={_fmt_value(merged.at[i, c])} (ref {_fmt_value(merged.at[i, c + '__ref'])})"
                 for c, bad in diff_cols.items() if bad[i]]
        details.append(f"changed {_fmt_key(key)}: " + ", ".join(parts))

    n_dup = int(dup_got.sum() + dup_exp.sum())
    n_missing, n_extra, n_changed = int(missing.sum()), int(extra.sum()), int(differs.sum())
    mismatches = n_dup + n_missing + n_extra + n_changed
    rows = len(merged)
    if mismatches == 0:
        return rows, 0, "ok"
    summary = (f"{n_missing} missing, {n_extra} extra, {n_dup} duplicate, {n_changed} changed"
               + (f" (columns: {', '.join(diff_cols)})" if diff_cols else ""))
    return rows, mismatches, summary + "; " + "; ".join(details[:max_details])
