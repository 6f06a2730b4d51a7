"""A current-state pipeline for merge-mode tests, and its pandas/Python reference.

Events are JSON ``{"device": str, "temp": int, "op": "up" | "del"}`` on ``<stream>.<device>``.
The table (``Merge(key="device", delete_when=("op", "del"))``) holds each device's current row:
``temp`` of its last reading and ``readings``, the number of readings since the device was last
deleted (or first seen). ``readings`` continues from the device's committed row (declared
:data:`STATE`, attached as ``last_readings``): after a delete the device has no row, so it starts
again at 1. Delete rows carry ``readings = DELETE_SENTINEL``: had a deleted device's marker row
been taken as its state, the next count would be off by thousands. So the table equals the
reference only if per-key order, no loss, no duplicate and delete-aware state all hold.
"""

from __future__ import annotations

import asyncio
import json
import random

import pandas as pd
import pyarrow as pa

from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.core.state import KeyedState
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext

DECODER = JsonDecoder([JsonField("device", "string", nullable=False),
                       JsonField("temp", "int", nullable=False),
                       JsonField("op", "string", nullable=False)])
OUT_SCHEMA = pa.schema([("device", pa.string()), ("temp", pa.int64()), ("op", pa.string()),
                        ("readings", pa.int64()), ("_seq", pa.int64())])
STATE = KeyedState("device", ("readings",), schema=OUT_SCHEMA)
MERGE = Merge(key="device", delete_when=("op", "del"))
DELETE_SENTINEL = 10_000


def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    df = table.select(["device", "temp", "op", "_seq", "last_readings"]).to_pandas()
    df = df.sort_values("_seq", kind="stable")
    is_del = df["op"] == "del"
    seg = is_del.astype("int64").groupby(df["device"]).cumsum()  # a delete opens a segment
    ups = (~is_del).astype("int64").groupby([df["device"], seg]).cumsum()
    base = df["last_readings"].fillna(0).astype("int64").where(seg == 0, 0)
    df["readings"] = (ups + base).where(~is_del, DELETE_SENTINEL)
    return pa.Table.from_pandas(df[["device", "temp", "op", "readings", "_seq"]],
                                schema=OUT_SCHEMA, preserve_index=False)


def processor() -> ArrowProcessor:
    return ArrowProcessor(DECODER, transform, state=STATE)


def spark_transform(spark, df, ctx):  # pyspark types: optional import
    """The same as :func:`transform`, with Spark window functions over ``_seq``."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    is_del = (F.col("op") == "del").cast("long")
    w = Window.partitionBy("device").orderBy("_seq")
    df = df.withColumn("seg", F.sum(is_del).over(w))
    ws = Window.partitionBy("device", "seg").orderBy("_seq")
    df = df.withColumn("ups", F.sum(1 - is_del).over(ws))
    base = F.when(F.col("seg") == 0, F.coalesce(F.col("last_readings"), F.lit(0))).otherwise(0)
    readings = F.when(F.col("op") == "del", F.lit(DELETE_SENTINEL)).otherwise(F.col("ups") + base)
    return df.select("device", "temp", "op", readings.cast("long").alias("readings"), "_seq")


def events(n: int, n_keys: int, seed: int, p_del: float = 0.12) -> list[tuple[str, int, str]]:
    """Deterministic events: ``(device, temp, op)``; about 5 % are exact re-sends of the
    previous event (same device, temp and op: a publisher retry)."""
    rnd = random.Random(seed)
    out: list[tuple[str, int, str]] = []
    for _ in range(n):
        if out and rnd.random() < 0.05:
            out.append(out[-1])
            continue
        d = f"d{rnd.randrange(n_keys)}"
        out.append((d, rnd.randrange(-40, 60), "del" if rnd.random() < p_del else "up"))
    return out


async def publish(js, stream: str, evs: list[tuple[str, int, str]]) -> None:
    acks = [await js.publish_async(f"{stream}.{d}", json.dumps(
        {"device": d, "temp": t, "op": op}).encode()) for d, t, op in evs]
    await asyncio.gather(*acks)


def reference(evs: list[tuple[str, int, str]]) -> pd.DataFrame:
    """Independent reference (a plain loop): device -> (temp, readings), deleted devices gone;
    sorted by device."""
    state: dict[str, tuple[int, int]] = {}
    for d, t, op in evs:
        if op == "del":
            state.pop(d, None)
        else:
            state[d] = (t, state[d][1] + 1 if d in state else 1)
    rows = [(d, t, r) for d, (t, r) in sorted(state.items())]
    return pd.DataFrame(rows, columns=["device", "temp", "readings"])


def table_frame(table: pa.Table) -> pd.DataFrame:
    return (table.select(["device", "temp", "readings"]).to_pandas()
            .sort_values("device").reset_index(drop=True))


def mismatches(table: pa.Table, evs: list[tuple[str, int, str]]) -> str | None:
    """None if the table equals the reference row for row, else why not (lost keys, duplicate
    keys, stale values)."""
    got, want = table_frame(table), reference(evs)
    dup = int(got.duplicated("device").sum())
    lost = sorted(set(want["device"]) - set(got["device"]))
    extra = sorted(set(got["device"]) - set(want["device"]))
    if dup or lost or extra:
        return f"duplicate keys {dup}, lost {lost[:5]}, deleted but present {extra[:5]}"
    merged = got.merge(want, on="device", suffixes=("", "_want"))
    stale = merged[(merged["temp"] != merged["temp_want"]) |
                   (merged["readings"] != merged["readings_want"])]
    if len(stale):
        return f"{len(stale)} stale values, first:\n{stale.head(3)}"
    return None
