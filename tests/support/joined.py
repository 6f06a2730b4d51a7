"""A co-partitioned join pipeline for engine tests, and its independent pandas reference.

Auctions ``a<i>`` have one impression (``{"auction", "ad"}``) on ``<imp>.<auction>``, zero to
three clicks (``{"auction"}``) on ``<clk>.<auction>`` and, with a third input, conversions
(``{"auction", "value"}``) on ``<conv>.<auction>``; each group partitions its stream on the
auction token into the same number of partitions. Clicks and conversions are published before
or after their impression (the two streams are not in any order with each other).

The join output is a Merge table keyed by auction: ``ad`` (null until the impression came),
``clicks`` (clicks so far), ``value`` (conversion values so far), ``updates`` (batches that
touched the key). The transform continues each key from its committed row (the declared
state, shared by the inputs), so the table equals the reference only if no message of any
input is lost or counted twice, wherever batches split and whatever the inputs' order.
"""

from __future__ import annotations

import asyncio
import json

import pandas as pd
import pyarrow as pa
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.core.state import KeyedState
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.join import JoinInput
from cg_pipelines.engine.join_processor import ArrowJoinProcessor, JoinContext
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI

IMP, CLK, CONV = "impressions", "clicks", "conversions"
DECODERS = {
    IMP: JsonDecoder([JsonField("auction", "string", nullable=False),
                      JsonField("ad", "string", nullable=False)]),
    CLK: JsonDecoder([JsonField("auction", "string", nullable=False)]),
    CONV: JsonDecoder([JsonField("auction", "string", nullable=False),
                       JsonField("value", "int", nullable=False)]),
}
OUT_SCHEMA = pa.schema([("auction", pa.string()), ("ad", pa.string()),
                        ("clicks", pa.int64()), ("value", pa.int64()),
                        ("updates", pa.int64())])
STATE = KeyedState("auction", ("ad", "clicks", "value", "updates"), order_by="updates",
                   schema=OUT_SCHEMA)
WRITE = Merge(key="auction", order_by=None)
COLUMNS = ["auction", "ad", "clicks", "value"]


def transform(tables: dict[str, pa.Table], ctx: JoinContext) -> pa.Table:
    """One output row per auction of the batch, continued from its committed row."""
    state_cols = ["auction", "last_ad", "last_clicks", "last_value", "last_updates"]
    state = pd.concat([t.select(state_cols).to_pandas() for t in tables.values()])
    state = state.drop_duplicates("auction").set_index("auction")
    imps = tables[IMP].select(["auction", "ad", "_seq"]).to_pandas()
    ad = imps.sort_values("_seq").groupby("auction")["ad"].last()
    clicks = tables[CLK].select(["auction"]).to_pandas().groupby("auction").size()
    value = (tables[CONV].select(["auction", "value"]).to_pandas()
             .groupby("auction")["value"].sum()) if CONV in tables else pd.Series(dtype="int64")
    out = pd.DataFrame(index=state.index.sort_values())
    out["ad"] = ad.reindex(out.index).fillna(state["last_ad"].reindex(out.index))
    out["clicks"] = (state["last_clicks"].reindex(out.index).fillna(0)
                     + clicks.reindex(out.index).fillna(0)).astype("int64")
    out["value"] = (state["last_value"].reindex(out.index).fillna(0)
                    + value.reindex(out.index).fillna(0)).astype("int64")
    out["updates"] = (state["last_updates"].reindex(out.index).fillna(0) + 1).astype("int64")
    out = out.reset_index().rename(columns={"index": "auction"})
    return pa.Table.from_pandas(out, schema=OUT_SCHEMA, preserve_index=False)


def processor(names: tuple[str, ...] = (IMP, CLK)) -> ArrowJoinProcessor:
    return ArrowJoinProcessor({n: DECODERS[n] for n in names}, transform, state=STATE)


def inputs(stream: str, names: tuple[str, ...] = (IMP, CLK)) -> list[JoinInput]:
    """The run's inputs: input ``n`` reads stream ``<stream>_<n>``, group ``g``."""
    return [JoinInput(n, f"{stream}_{n}", "g") for n in names]


Events = dict[str, list[dict[str, object]]]


def events(n_auctions: int, names: tuple[str, ...] = (IMP, CLK)) -> Events:
    """Deterministic events per input; clicks and conversions of an auction are published
    before its impression for every third auction."""
    out: Events = {n: [] for n in names}
    late = []
    for i in range(n_auctions):
        a = f"a{i}"
        imp = {"auction": a, "ad": f"ad-{i % 7}"}
        (late if i % 3 == 0 else out[IMP]).append(imp)
        out[CLK] += [{"auction": a}] * (i % 4)
        if CONV in names:
            out[CONV] += [{"auction": a, "value": i % 5 + 1}] * (i % 2)
    out[IMP] += late
    return out


async def setup(js, stream: str, evs: Events, n_partitions: int) -> JetStreamAPI:
    """Streams and co-partitioned groups for every input, events published and sourced."""
    api = JetStreamAPI.from_js(js)
    for name, msgs in evs.items():
        s = f"{stream}_{name}"
        await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"], allow_direct=True))
        await admin.create_elastic(js, s, "g", ElasticConfig(
            n_partitions, (PartitioningFilter(f"{s}.*", (1,)),), members=("m1",)))
        acks = [await js.publish_async(f"{s}.{m['auction']}", json.dumps(m).encode())
                for m in msgs]
        await asyncio.gather(*acks)
    for name, msgs in evs.items():
        await wait_sourced(api, f"{stream}_{name}-g", len(msgs))
    return api


async def wait_sourced(api: JetStreamAPI, wq: str, n: int) -> None:
    for _ in range(400):
        if int((await api.stream_info(wq))["state"]["messages"]) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{wq} did not receive {n} messages")


async def left(api: JetStreamAPI, stream: str, names: tuple[str, ...] = (IMP, CLK)) -> int:
    """Messages still in the inputs' work queues."""
    return sum([int((await api.stream_info(f"{stream}_{n}-g"))["state"]["messages"])
                for n in names])


def reference(evs: Events) -> pd.DataFrame:
    """The expected table by a plain pandas outer join of the inputs' aggregates."""
    frames = [pd.DataFrame(evs[IMP]).groupby("auction")["ad"].last().rename("ad")]
    clk = pd.DataFrame(evs[CLK], columns=["auction"])
    frames.append(clk.groupby("auction").size().rename("clicks"))
    if CONV in evs:
        conv = pd.DataFrame(evs[CONV], columns=["auction", "value"])
        frames.append(conv.groupby("auction")["value"].sum().rename("value"))
    df = pd.concat(frames, axis=1)
    df["clicks"] = df["clicks"].fillna(0).astype("int64")
    df["value"] = df["value"].fillna(0).astype("int64") if "value" in df else 0
    return df.reset_index().rename(columns={"index": "auction"})[COLUMNS] \
        .sort_values("auction").reset_index(drop=True)


def mismatches(table: pa.Table, evs: Events) -> str | None:
    """None when the committed table equals the reference row for row, else how not."""
    got = table.select(COLUMNS).to_pandas().sort_values("auction").reset_index(drop=True)
    want = reference(evs)
    if len(got) != len(want):
        return f"{len(got)} rows (duplicate keys {int(got.duplicated('auction').sum())}) " \
               f"vs {len(want)} expected"
    diff = (got.astype(object) != want.astype(object)) & ~(got.isna() & want.isna())
    bad = diff.any(axis=1)
    if bad.any():
        return f"{int(bad.sum())} rows differ, first:\n{got[bad].head(3)}\n{want[bad].head(3)}"
    return None
