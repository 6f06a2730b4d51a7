"""What every cluster test asserts: the keyed pipeline's table against its pandas reference
(lost 0, duplicates 0, order violations 0), and the group's streams and bucket at R3."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import pyarrow as pa
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import (
    ElasticConfig,
    PartitioningFilter,
    dlq_stream_name,
    work_queue_stream_name,
)
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import StreamNotFoundError
from tests.support import keyed
from tests.support.wait import wait_for

Event = tuple[str, int]
KV_STREAM = "KV_elastic-consumer-groups"


@dataclass(frozen=True)
class Effects:
    """Counted against the events published: missing, doubled and out-of-order effects."""

    rows: int
    lost: int
    duplicates: int
    order_violations: int

    def line(self) -> str:
        return (f"rows {self.rows}, lost {self.lost}, duplicates {self.duplicates}, "
                f"order violations {self.order_violations}")


def effects(table: pa.Table, evs: list[Event]) -> Effects:
    """Compare the keyed table with the events: ``lost`` events with no row, ``duplicates``
    rows beyond one per event, ``order_violations`` rows whose per-key ``count``/``prev_n``
    differ from the reference's (what a reordering or a gap in a key's sequence gives)."""
    got = table.select(["key", "n", "count", "prev_n", "seq"]).to_pandas()
    want = keyed.reference(evs)
    seen = got.groupby(["key", "n"]).size()
    expected = want.groupby(["key", "n"]).size()
    joined = pd.concat([expected.rename("want"), seen.rename("got")], axis=1).fillna(0)
    lost = int((joined["want"] - joined["got"]).clip(lower=0).sum())
    duplicates = int((joined["got"] - joined["want"]).clip(lower=0).sum())
    ref = want.set_index(["key", "n"])[["count", "prev_n"]]
    first = got.drop_duplicates(["key", "n"]).set_index(["key", "n"])
    both = first.join(ref, rsuffix="_ref", how="inner")
    prev = both["prev_n"].astype("float64").fillna(-1.0)
    prev_ref = both["prev_n_ref"].astype("float64").fillna(-1.0)
    bad = (both["count"] != both["count_ref"]) | (prev != prev_ref)
    # and seq must grow with count within a key
    order = 0
    for _, g in got.sort_values("count").groupby("key"):
        order += int((g["seq"].diff().dropna() < 0).sum())
    return Effects(len(got), lost, duplicates, int(bad.sum()) + order)


async def create_r3_group(js: JetStreamContext, stream: str, partitions: int,
                          members: tuple[str, ...] = ("m1",)) -> None:
    """Origin stream ``<stream>`` (subjects ``<stream>.>``, R3, direct gets allowed) and elastic
    group ``g`` partitioned on the key token: its work queue and KV bucket come up R3."""
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], num_replicas=3,
                                     allow_direct=True))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        partitions, (PartitioningFilter(f"{stream}.*", (1,)),), members=members))


async def wait_sourced(api: JetStreamAPI, stream: str, total: int, timeout_s: float = 60.0
                       ) -> None:
    """Until the work queue has received ``total`` messages since it was made."""
    wq = work_queue_stream_name(stream, "g")

    async def done() -> bool:
        return int((await api.stream_info(wq))["state"]["last_seq"]) >= total
    try:
        await wait_for(done, timeout_s, f"{wq} to receive {total} messages", interval=0.05)
    except AssertionError as e:
        info = await api.stream_info(wq)
        raise AssertionError(f"{e}: {wq} last_seq {info['state']['last_seq']}, sources "
                             f"{info.get('sources')}, cluster {info.get('cluster')}") from None


async def replicas(api: JetStreamAPI, stream: str) -> dict[str, int]:
    """Replica count of the origin, work queue, dead-letter stream (when a run made it: the
    engine creates it with the first dead letter) and KV bucket."""
    out = {}
    dlq = dlq_stream_name(stream, "g")
    for name in (stream, work_queue_stream_name(stream, "g"), dlq, KV_STREAM):
        try:
            info = await api.stream_info(name)
        except StreamNotFoundError:
            if name == dlq:
                continue
            raise
        out[name] = int(info["config"]["num_replicas"])
    return out


async def wq_messages(api: JetStreamAPI, stream: str) -> int:
    return int((await api.stream_info(work_queue_stream_name(stream, "g")))["state"]["messages"])

