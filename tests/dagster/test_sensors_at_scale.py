"""Sensors at scale (issue 13): a group of 256 partitions and a code location of 8 groups,
evaluated as the daemon evaluates them, plus the backlog reads behind them
(:mod:`cg_pipelines.jetstream.backlog`) against a plain per-partition reference.

Behaviour only: how long a tick takes is measured by ``bench/sensor_ticks.py``.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Sequence

import pytest
from dagster import DagsterInstance, Definitions, RunRequest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.config import ElasticConfig, PartitioningFilter, work_queue_stream_name
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.core.triggers import PartitionBacklog, use_subject_counts
from cg_pipelines.dagster import ConsumerGroupAsset, build_definitions
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import first_pending, partition_backlog
from cg_pipelines.jetstream.errors import (
    JetStreamUnavailableError,
    RequestTimeoutError,
    StreamNotFoundError,
)
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import make_resources
from tests.support import keyed

BIG = 256
BIG_GROUP = "big"
BIG_ASSET = "big_events"
# partitions with a backlog: both ends, the middle, and a spread
WITH_BACKLOG = sorted({0, 1, 2, 127, 128, 254, 255} | {p for p in range(BIG) if p % 9 == 4})

Message = tuple[str, int]  # (subject, partition)


@functools.cache
def tail_for(partition: int, partitions: int, nth: int = 0) -> str:
    """The ``nth`` tail token (``t<j>``) that the group's partitioning maps to ``partition``."""
    found = -1
    j = 0
    while True:
        t = f"t{j}"
        if partition_for([t], partitions) == partition:
            found += 1
            if found == nth:
                return t
        j += 1


def messages(stream: str, partitions: int, with_backlog: Sequence[int], *, tails: int,
             carriers: int, rounds: int = 2, seed: int = 13) -> list[Message]:
    """Messages ``<stream>.c<carrier>.<tail>`` on ``tails`` tails of each partition in
    ``with_backlog`` and ``carriers`` carriers, ``rounds`` per subject, in a shuffled order."""
    subjects = [(f"{stream}.c{c}.{tail_for(p, partitions, k)}", p)
                for p in with_backlog for k in range(tails) for c in range(carriers)]
    rng = random.Random(seed)
    out: list[Message] = []
    for _ in range(rounds):
        batch = list(subjects)
        rng.shuffle(batch)
        out.extend(batch)
    return out


async def create_group(js: JetStreamContext, stream: str, group: str, partitions: int,
                       members: Sequence[str] = ("m1",)) -> int:
    """Origin stream ``<stream>`` (subjects ``<stream>.>``) and elastic group ``group``
    partitioned on the tail of ``<stream>.<carrier>.<tail>``; returns the config revision."""
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    v = await admin.create_elastic(js, stream, group, ElasticConfig(
        partitions, (PartitioningFilter(f"{stream}.*.*", (2,)),), members=tuple(members)))
    return v.revision


async def publish(js: JetStreamContext, stream: str, group: str, msgs: list[Message],
                  already: int = 0) -> None:
    """Publish in order; wait until the work queue has received them all."""
    acks = [await js.publish_async(subject, b'{"key":"k","n":1}') for subject, _ in msgs]
    await asyncio.gather(*acks)
    api = JetStreamAPI.from_js(js)
    wq = work_queue_stream_name(stream, group)
    for _ in range(400):
        if int((await api.stream_info(wq))["state"]["last_seq"]) >= already + len(msgs):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{wq} did not receive {already + len(msgs)} messages")


def expected_backlog(msgs: list[Message], partitions: int, first_seq: int = 1
                     ) -> dict[int, tuple[int, int]]:
    """``{partition: (pending, first pending sequence)}`` of messages sourced in order from
    work-queue sequence ``first_seq`` on (one origin stream: its order is the work queue's)."""
    out: dict[int, tuple[int, int]] = {}
    for i, (_, p) in enumerate(msgs):
        pending, first = out.get(p, (0, first_seq + i))
        out[p] = (pending + 1, first)
    assert all(0 <= p < partitions for p in out)
    return out


async def reference_backlog(api: JetStreamAPI, wq: str, partitions: int
                            ) -> dict[int, tuple[int, int]]:
    """The plain per-partition read (one direct get each), partitions with messages only."""
    out = {}
    for p in range(partitions):
        got = await api.direct_get_batch(wq, 1, f"{p}.>", 1)
        if got:
            out[p] = (1 + (got[0].num_pending or 0), got[0].seq)
    return out


def as_map(backlog: list[PartitionBacklog]) -> dict[int, tuple[int, int]]:
    return {b.partition: (b.pending, b.first_seq) for b in backlog if b.first_seq is not None}


def check_requests(reqs: Sequence[RunRequest], prefix: str, job: str,
                   expected: dict[int, str]) -> None:
    """Exactly the partitions of ``expected`` in partition order, with their run keys, the
    ``<prefix><p>`` partition keys and tags, and no other job's name."""
    assert [r.partition_key for r in reqs] == [f"{prefix}{p}" for p in sorted(expected)]
    assert [r.run_key for r in reqs] == [expected[p] for p in sorted(expected)]
    for r in reqs:
        assert r.tags["dagster/partition"] == r.partition_key
        assert r.job_name in (None, job)


def big_defs(stream: str, url: str, warehouse: str,
             members: Sequence[str] | None = None) -> Definitions:
    spec = ConsumerGroupAsset(name=BIG_ASSET, stream=stream, group=BIG_GROUP, partitions=BIG,
                              processor=keyed.processor())
    return build_definitions([spec], resources=make_resources(url, warehouse, members))


# --------------------------------------------------------------------------- 256 partitions


@pytest.mark.parametrize(("tails", "carriers"), [(1, 2), (2, 30)],
                         ids=["few-subjects", "many-subjects"])
async def test_backlog_sensor_256_partitions_exact_run_keys(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance, tails: int, carriers: int) -> None:
    stream = unique_name
    await create_group(js, stream, BIG_GROUP, BIG, members=("m1", "m2"))
    msgs = messages(stream, BIG, WITH_BACKLOG, tails=tails, carriers=carriers)
    await publish(js, stream, BIG_GROUP, msgs)
    want = expected_backlog(msgs, BIG)
    assert sorted(want) == WITH_BACKLOG

    # both ways of reading are exercised: with and without the subject-count listing
    api = JetStreamAPI.from_js(js)
    wq = work_queue_stream_name(stream, BIG_GROUP)
    state = (await api.stream_info(wq))["state"]
    assert int(state["num_subjects"]) == len(WITH_BACKLOG) * tails * carriers
    assert use_subject_counts(int(state["num_subjects"]), BIG) == (carriers == 2)
    got = await partition_backlog(api, stream, BIG_GROUP, range(BIG))
    assert [b.partition for b in got] == list(range(BIG))
    assert as_map(got) == want == await reference_backlog(api, wq, BIG)
    assert all(b.age_s >= 0 for b in got)

    defs = big_defs(stream, nats_server.url, warehouse)
    keys = {p: f"{BIG_GROUP}:{p}:{want[p][1]}" for p in WITH_BACKLOG}
    d1 = await asyncio.to_thread(h.tick, defs, f"{BIG_ASSET}_backlog", instance)
    check_requests(list(d1.run_requests or []), f"{BIG_GROUP}-", f"{BIG_ASSET}_job", keys)
    # the drain schedule asks for the same runs
    s1 = await asyncio.to_thread(h.schedule_tick, defs, f"{BIG_ASSET}_drain", instance)
    check_requests(list(s1.run_requests or []), f"{BIG_GROUP}-", f"{BIG_ASSET}_job", keys)

    # a deployment serving m2 only asks for m2's partitions with backlog
    v = await admin.get_elastic(js, stream, BIG_GROUP)
    m2 = set(assignment(v.config)["m2"])
    assert 0 < len(m2 & set(WITH_BACKLOG)) < len(WITH_BACKLOG)
    only_m2 = big_defs(stream, nats_server.url, warehouse, members=["m2"])
    d2 = await asyncio.to_thread(h.tick, only_m2, f"{BIG_ASSET}_backlog", instance)
    check_requests(list(d2.run_requests or []), f"{BIG_GROUP}-", f"{BIG_ASSET}_job",
                   {p: k for p, k in keys.items() if p in m2})

    # drained partitions drop out; a partition whose older messages went has a new key
    drained, moved = WITH_BACKLOG[:3], WITH_BACKLOG[3:5]
    for p in drained:
        await api.purge(wq, filter=f"{p}.>")
    for p in moved:
        await api.purge(wq, filter=f"{p}.>", keep=1)
    last = {p: max(1 + i for i, (_, q) in enumerate(msgs) if q == p) for p in moved}
    keys3 = {p: (f"{BIG_GROUP}:{p}:{last[p]}" if p in moved else k)
             for p, k in keys.items() if p not in drained}
    d3 = await asyncio.to_thread(h.tick, defs, f"{BIG_ASSET}_backlog", instance)
    check_requests(list(d3.run_requests or []), f"{BIG_GROUP}-", f"{BIG_ASSET}_job", keys3)


async def test_membership_sensor_256_partitions(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    stream = unique_name
    rev = await create_group(js, stream, BIG_GROUP, BIG)
    defs = big_defs(stream, nats_server.url, warehouse)
    d = await asyncio.to_thread(h.tick, defs, f"{BIG_ASSET}_membership", instance)
    check_requests(list(d.run_requests or []), f"{BIG_GROUP}-", f"{BIG_ASSET}_job",
                   {p: f"{BIG_GROUP}:member:{rev}:{p}" for p in range(BIG)})
    assert [e.partition for e in d.asset_events] == [f"{BIG_GROUP}-{p}" for p in range(BIG)]
    again = await asyncio.to_thread(h.tick, defs, f"{BIG_ASSET}_membership", instance,
                                    cursor=d.cursor)
    assert not again.run_requests
    assert again.skip_message == f"no membership change (revision {rev})"


# ------------------------------------------------------------- 8 groups in one code location


LOCATION_GROUPS = 8
LOCATION_PARTITIONS = 64


def location_backlog(i: int) -> list[int]:
    """Group ``g<i>``'s partitions with a backlog: its own, different for every group."""
    return [p for p in range(LOCATION_PARTITIONS) if p % LOCATION_GROUPS == i] + (
        [LOCATION_PARTITIONS - 1] if i == 0 else [])


async def test_eight_groups_in_one_location(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    specs, revs, want = [], {}, {}
    for i in range(LOCATION_GROUPS):
        stream, group = f"{unique_name}x{i}", f"g{i}"
        revs[group] = await create_group(js, stream, group, LOCATION_PARTITIONS)
        msgs = messages(stream, LOCATION_PARTITIONS, location_backlog(i), tails=2, carriers=2,
                        seed=i)
        await publish(js, stream, group, msgs)
        want[group] = expected_backlog(msgs, LOCATION_PARTITIONS)
        assert sorted(want[group]) == location_backlog(i)
        specs.append(ConsumerGroupAsset(name=f"events_{i}", stream=stream, group=group,
                                        partitions=LOCATION_PARTITIONS,
                                        processor=keyed.processor()))
    defs = build_definitions(specs, resources=make_resources(nats_server.url, warehouse))
    Definitions.validate_loadable(defs)

    def tick_all() -> dict[str, h.SensorExecutionData]:
        return {f"{s.name}_{kind}": h.tick(defs, f"{s.name}_{kind}", instance)
                for s in specs for kind in ("membership", "backlog")}

    data = await asyncio.to_thread(tick_all)
    for s in specs:
        g = s.group
        check_requests(list(data[f"{s.name}_membership"].run_requests or []), f"{g}-",
                       f"{s.name}_job",
                       {p: f"{g}:member:{revs[g]}:{p}" for p in range(LOCATION_PARTITIONS)})
        check_requests(list(data[f"{s.name}_backlog"].run_requests or []), f"{g}-",
                       f"{s.name}_job", {p: f"{g}:{p}:{want[g][p][1]}" for p in want[g]})


# ------------------------------------------------------------------------- the backlog reads


async def test_backlog_reads_edge_cases(js: JetStreamContext, unique_name: str) -> None:
    stream, group, n = unique_name, "e", 16
    await create_group(js, stream, group, n)
    api = JetStreamAPI.from_js(js)
    wq = work_queue_stream_name(stream, group)

    # an empty work queue: nothing pending, and nothing to ask
    assert await partition_backlog(api, stream, group, range(n)) == [
        PartitionBacklog(p, 0, None, 0.0) for p in range(n)]
    assert await partition_backlog(api, stream, group, []) == []
    assert await first_pending(api, wq, []) == {}

    msgs = messages(stream, n, [3, 5, 11], tails=2, carriers=3)
    await publish(js, stream, group, msgs)
    want = expected_backlog(msgs, n)
    # any order, repeats, a window of one: the same answers
    for window in (1, 2, 256):
        got = await first_pending(api, wq, [11, 0, 5, 3, 5, 15], window=window)
        assert {p: (1 + after, seq) for p, (seq, _, after) in got.items()} == want
    assert as_map(await partition_backlog(api, stream, group, [5, 3], window=1)) == {
        p: want[p] for p in (3, 5)}
    with pytest.raises(ValueError, match="window"):
        await first_pending(api, wq, [0], window=0)

    # every read is bounded by the API's timeout
    hasty = JetStreamAPI(api.nc, prefix=api.prefix, timeout=1e-6)
    with pytest.raises(RequestTimeoutError):
        await first_pending(hasty, wq, list(range(n)))

    # a missing work queue, or one that does not allow direct gets
    with pytest.raises(StreamNotFoundError):
        await partition_backlog(api, stream, "nosuchgroup", range(n))
    await js.add_stream(StreamConfig(name=f"{stream}nd", subjects=[f"{stream}nd.>"]))
    await js.publish(f"{stream}nd.a", b"x")
    with pytest.raises(JetStreamUnavailableError):
        await first_pending(api, f"{stream}nd", [0, 1])
