"""A keyed-events pipeline for engine tests, and its pandas reference.

Events are JSON ``{"key": str, "n": int}`` on ``<stream>.<key>``; the transform computes per key
``count`` (events so far, across batches) and ``prev_n`` (the previous event's ``n``), continuing
from the key's committed state (declared :data:`STATE`, attached by the library as ``last_n`` and
``last_count``) — so the result is right only if per-key order, no loss and no duplicates all
hold, wherever batches split.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pandas as pd
import pyarrow as pa
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.core.state import KeyedState
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI

DECODER = JsonDecoder([JsonField("key", "string", nullable=False),
                       JsonField("n", "int", nullable=False)])
OUT_SCHEMA = pa.schema([("key", pa.string()), ("n", pa.int64()), ("count", pa.int64()),
                        ("prev_n", pa.int64()), ("seq", pa.int64())])


STATE = KeyedState("key", ("n", "count"), order_by="seq", schema=OUT_SCHEMA)


def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    df = table.select(["key", "n", "_seq", "last_n", "last_count"]).to_pandas()
    df = df.sort_values("_seq", kind="stable")
    g = df.groupby("key")
    first = g.cumcount() == 0
    df["count"] = g.cumcount() + 1 + df["last_count"].fillna(0).astype("int64")
    df["prev_n"] = g["n"].shift(1)
    df.loc[first, "prev_n"] = df.loc[first, "last_n"]
    out = pd.DataFrame({"key": df["key"], "n": df["n"], "count": df["count"],
                        "prev_n": df["prev_n"].astype("Int64"), "seq": df["_seq"]})
    return pa.Table.from_pandas(out, schema=OUT_SCHEMA, preserve_index=False)


def processor() -> ArrowProcessor:
    return ArrowProcessor(DECODER, transform, state=STATE)


def events(n_keys: int, n_events: int) -> list[tuple[str, int]]:
    """Deterministic keyed events: key i gets its own increasing ``n`` values."""
    counters = [0] * n_keys
    out = []
    for i in range(n_events):
        k = (i * 7919 + i // 3) % n_keys
        counters[k] += 1
        out.append((f"k{k}", counters[k] * 10 + k))
    return out


async def publish(js, stream: str, evs: list[tuple[str, int]]) -> None:
    acks = [await js.publish_async(f"{stream}.{k}", json.dumps({"key": k, "n": n}).encode())
            for k, n in evs]
    await asyncio.gather(*acks)


async def elastic_group(js, stream: str, evs: list, n: int,
                        publisher: Callable[..., Awaitable[None]] | None = None) -> JetStreamAPI:
    """Stream ``stream`` (``<stream>.>``, direct gets allowed) with an elastic group ``g`` of
    ``n`` partitions on the key token (member ``m1``), ``evs`` published (by ``publisher``,
    default :func:`publish`) and sourced into the work queue ``<stream>-g``; a JetStream API
    on ``js``'s connection."""
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], allow_direct=True))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        n, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await (publisher or publish)(js, stream, evs)
    api = JetStreamAPI.from_js(js)
    for _ in range(200):
        if (await api.stream_info(f"{stream}-g"))["state"]["messages"] >= len(evs):
            return api
        await asyncio.sleep(0.05)
    raise AssertionError(f"{stream}-g did not receive {len(evs)} messages")


def reference(evs: list[tuple[str, int]]) -> pd.DataFrame:
    """Expected table, sorted by key then count (seq is not compared: it is the stream's)."""
    df = pd.DataFrame(evs, columns=["key", "n"])
    df["count"] = df.groupby("key").cumcount() + 1
    df["prev_n"] = df.groupby("key")["n"].shift(1).astype("Int64")
    return df.sort_values(["key", "count"]).reset_index(drop=True)


def table_frame(sink_table: pa.Table) -> pd.DataFrame:
    df = sink_table.select(["key", "n", "count", "prev_n"]).to_pandas()
    df["prev_n"] = df["prev_n"].astype("Int64")
    return df.sort_values(["key", "count"]).reset_index(drop=True)


def mismatches(sink_table: pa.Table, evs: list[tuple[str, int]]) -> str | None:
    """None if the committed table equals the reference row for row, else why not."""
    got, want = table_frame(sink_table), reference(evs)
    if len(got) != len(want):
        dup = got.duplicated(["key", "count"]).sum()
        return f"{len(got)} rows (duplicates {dup}) vs {len(want)} expected"
    diff = (got != want) & ~(got.isna() & want.isna())
    bad = diff.any(axis=1)
    if bad.any():
        return f"{int(bad.sum())} rows differ, first:\n{got[bad].head(3)}\n{want[bad].head(3)}"
    return None
