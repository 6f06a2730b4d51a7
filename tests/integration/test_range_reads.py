"""The read path of a run over several partitions (``engine/reads.py``) against a real
nats-server: ONE unfiltered read of the work queue split by partition when the run's leased
partitions hold 90 % of it or more, else the partitions' own filtered reads, concurrently.

Each test checks which path the run took (its ``timings``: ``read_split`` for the split read,
``read`` for reads side by side) and the contract of a one-partition run for every partition:
per-key stream order, each effect committed exactly once (table == pandas reference), nothing
dropped, each partition's own watermark, and nothing of a partition the run does not hold
(outside its range, held by another run) read into a batch, acknowledged or purged.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from itertools import pairwise

from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter, dlq_stream_name
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine.lease import ensure_lease_consumer, lease_consumer_name
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition, run_partitions
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.base import app_id_for
from cg_pipelines.testing import MemorySink
from tests.support import keyed

FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0)


def _keys(n: int, per: int) -> dict[int, list[str]]:
    """``per`` keys of each of ``n`` partitions."""
    out: dict[int, list[str]] = defaultdict(list)
    i = 0
    while any(len(out[p]) < per for p in range(n)):
        k = f"k{i}"
        p = partition_for([k], n)
        if len(out[p]) < per:
            out[p].append(k)
        i += 1
    return out


def _events(counts: dict[int, int], n: int, per: int = 3) -> list[tuple[str, int]]:
    """``counts[p]`` keyed events of partition ``p`` (``per`` keys each), the partitions
    interleaved; each key's ``n`` increasing (the reference checks order per key)."""
    keys = _keys(n, per)
    queues = {p: [keys[p][i % per] for i in range(c)] for p, c in counts.items()}
    out: list[tuple[str, int]] = []
    seen: dict[str, int] = defaultdict(int)
    while any(queues.values()):
        for p in sorted(queues):
            if queues[p]:
                k = queues[p].pop()
                seen[k] += 1
                out.append((k, seen[k] * 1000 + int(k[1:]) % 1000))
    return out


async def _setup(js, stream: str, n: int, evs: list[tuple[str, int]]) -> JetStreamAPI:
    return await keyed.elastic_group(js, stream, evs, n)


async def _left(api: JetStreamAPI, wq: str, partition: int | None = None) -> int:
    if partition is None:
        return int((await api.stream_info(wq))["state"]["messages"])
    info = await api.stream_info(wq, subjects_filter=f"{partition}.>")
    return sum(int(c) for c in (info["state"].get("subjects") or {}).values())


def _of(evs: list[tuple[str, int]], n: int, parts: set[int]) -> list[tuple[str, int]]:
    return [e for e in evs if partition_for([e[0]], n) in parts]


class Steps:
    """A hook recording every step with its info."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, step: str, info: dict) -> None:
        self.seen.append((step, info))

    def of(self, step: str) -> list[dict]:
        return [i for s, i in self.seen if s == step]

    def reads(self) -> dict[int, list[tuple[int, int]]]:
        """Each partition's ranges read into batches that were committed, in order."""
        out: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for i in self.of("acked"):
            out[i["partition"]].append((i["first_seq"], i["last_seq"]))
        return out


async def test_split_read_keeps_order_and_drops_nothing(nc, js, unique_name) -> None:
    """A run over all 32 partitions of a group reads it split (one read per batch for all
    partitions): the table equals the reference (per-key order, exactly once), every side is
    drained to its own watermark, each partition's committed ranges follow one another in
    stream order without overlap, no batch read ahead is dropped, and the work queue is empty."""
    n = 32
    evs = _events({p: 40 + 7 * (p % 5) for p in range(n)}, n)
    api = await _setup(js, unique_name, n, evs)
    sink, steps = MemorySink(), Steps()
    r = await run_partitions(nc, unique_name, "g", range(n), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=300, **FAST), hook=steps)
    assert r.status == "drained" and r.processed == len(evs) and r.fence_conflicts == 0, r
    assert "read_split" in r.timings and "read" not in r.timings, r.timings
    assert "purge_split" in r.timings, r.timings  # batches purged with one purge
    assert r.commits >= len(evs) // 300
    assert keyed.mismatches(sink.rows(), evs) is None
    for p in range(n):
        side = r.inputs[app_id_for(unique_name, "g", p)]
        assert side.status == "drained" and side.processed == len(_of(evs, n, {p})), side
        assert sink.watermark(app_id_for(unique_name, "g", p)) == side.last_seq
    for p, ranges in steps.reads().items():
        assert all(a[1] < b[0] for a, b in pairwise(ranges)), (p, ranges)
    # every batch processed was committed: the split reads ahead lined up with the leases
    assert len(steps.of("processed")) == len(steps.of("committed")) == r.commits
    assert await _left(api, f"{unique_name}-g") == 0


async def test_split_read_with_a_partition_far_ahead(nc, js, unique_name) -> None:
    """Partition 0's messages all come after the others': the first batches hold nothing of
    it (its lease lies past what they covered), and they are still used, not dropped and read
    again; partition 0 is then drained in order like the others."""
    n = 8
    early = _events({p: 150 for p in range(1, n)}, n)
    late = _events({0: 120}, n)
    evs = early + late
    api = await _setup(js, unique_name, n, evs)
    sink, steps = MemorySink(), Steps()
    r = await run_partitions(nc, unique_name, "g", range(n), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=200, **FAST), hook=steps)
    assert r.status == "drained" and r.processed == len(evs), r
    assert "read_split" in r.timings, r.timings
    assert keyed.mismatches(sink.rows(), evs) is None
    assert len(steps.of("processed")) == len(steps.of("committed")) == r.commits
    first0 = steps.reads()[0][0][0]
    assert first0 > len(early)
    assert await _left(api, f"{unique_name}-g") == 0


async def test_split_read_leaves_other_partitions_alone(nc, js, unique_name) -> None:
    """16 partitions; partition 15 is outside the range, partition 3's lease is held by
    another holder, and both hold few messages (the run's leased partitions hold over 90 %
    of the work queue: the split read is used). Nothing of 3 or 15 is read into a batch,
    committed, acknowledged or purged; the others are drained exactly; afterwards runs of 3
    and 15 drain them."""
    n, held, outside = 16, 3, 15
    evs = _events({p: 8 if p in (held, outside) else 120 for p in range(n)}, n)
    api = await _setup(js, unique_name, n, evs)
    wq = f"{unique_name}-g"
    slow = dict(ack_wait_s=30.0, priority_timeout_s=30.0)
    opts = EngineOptions(batch_max_msgs=250, hold_wait_s=0.5, **slow)
    await ensure_lease_consumer(api, wq, held, opts)
    got = await api.pull(wq, lease_consumer_name(held), batch=1, expires_s=2.0)
    assert got.messages and got.pin_id
    sink, steps = MemorySink(), Steps()
    r = await run_partitions(nc, unique_name, "g", range(outside), keyed.processor(), sink,
                             opts, hook=steps)
    assert r.status == "drained" and r.inputs[app_id_for(unique_name, "g", held)].status \
        == "held", r
    assert "read_split" in r.timings, r.timings
    mine = set(range(outside)) - {held}
    assert keyed.mismatches(sink.rows(), _of(evs, n, mine)) is None
    assert r.processed == len(_of(evs, n, mine))
    for step in ("read", "purged", "acked", "leased"):
        assert {i["partition"] for i in steps.of(step)} <= mine, step
    for p in (held, outside):
        assert sink.watermark(app_id_for(unique_name, "g", p)) == 0
        assert await _left(api, wq, p) == len(_of(evs, n, {p}))
    assert await _left(api, wq) == len(_of(evs, n, {held, outside}))
    info = await api.consumer_info(wq, lease_consumer_name(held))
    assert info["num_ack_pending"] == 1 and info["delivered"]["stream_seq"] == got.messages[
        0].metadata.sequence.stream  # only the other holder's delivery

    await got.messages[0].nak()
    await api.unpin(wq, lease_consumer_name(held))
    for p in (held, outside):
        one = await run_partition(nc, unique_name, "g", p, keyed.processor(), sink, opts)
        assert one.status == "drained" and one.processed == len(_of(evs, n, {p})), one
    assert keyed.mismatches(sink.rows(), evs) is None
    assert await _left(api, wq) == 0


async def test_one_purge_never_takes_earlier_messages_of_others(nc, js, unique_name) -> None:
    """Partition 7 (outside the range) has its messages first in the work queue, below every
    batch of the run over 0..6, and nothing of it inside the batches: purging a batch with ONE
    unfiltered purge would take them too, so each partition purges its own; all of partition
    7's messages are still there for its own run."""
    n, outside = 8, 7
    first = _events({outside: 12}, n)
    rest = _events({p: 100 for p in range(outside)}, n)
    evs = first + rest
    api = await _setup(js, unique_name, n, evs)
    wq = f"{unique_name}-g"
    sink = MemorySink()
    r = await run_partitions(nc, unique_name, "g", range(outside), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=150, **FAST))
    assert r.status == "drained" and r.processed == len(rest), r
    assert "read_split" in r.timings and "purge_split" not in r.timings, r.timings
    assert keyed.mismatches(sink.rows(), rest) is None
    assert await _left(api, wq, outside) == len(first) == await _left(api, wq)
    one = await run_partition(nc, unique_name, "g", outside, keyed.processor(), sink,
                              EngineOptions(batch_max_msgs=150, **FAST))
    assert one.status == "drained" and one.processed == len(first), one
    assert keyed.mismatches(sink.rows(), evs) is None
    assert await _left(api, wq) == 0


async def test_small_share_reads_side_by_side(nc, js, unique_name) -> None:
    """A run over 4 of 16 evenly filled partitions (a quarter of the work queue) reads each
    partition filtered, side by side, and leaves the other 12 untouched."""
    n = 16
    evs = _events({p: 60 for p in range(n)}, n)
    api = await _setup(js, unique_name, n, evs)
    sink, steps = MemorySink(), Steps()
    mine = {0, 5, 6, 11}
    r = await run_partitions(nc, unique_name, "g", sorted(mine), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=100, **FAST), hook=steps)
    assert r.status == "drained" and r.processed == len(_of(evs, n, mine)), r
    assert "read" in r.timings and "read_split" not in r.timings, r.timings
    assert keyed.mismatches(sink.rows(), _of(evs, n, mine)) is None
    assert {i["partition"] for i in steps.of("acked")} == mine
    for p in range(n):
        assert await _left(api, f"{unique_name}-g", p) == (
            0 if p in mine else len(_of(evs, n, {p})))


async def _bad_setup(js, stream: str, n: int) -> tuple[JetStreamAPI, list, list, dict]:
    """``n`` partitions of keyed events with bad payloads on keys of partitions 1 and 6:
    (api, good events, (subject, payload) published, {work-queue seq: partition})."""
    keys = _keys(n, 2)
    evs = _events({p: 50 for p in range(n)}, n, per=2)
    msgs = [(f"{stream}.{k}", json.dumps({"key": k, "n": v}).encode()) for k, v in evs]
    bad_at = {40: 1, 90: 6, 91: 1, 260: 6}
    for i, p in sorted(bad_at.items()):
        msgs.insert(i, (f"{stream}.{keys[p][0]}", b"{not json"))
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], allow_direct=True))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        n, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    for subject, data in msgs:
        await js.publish(subject, data)
    api = JetStreamAPI.from_js(js)
    for _ in range(200):
        if (await api.stream_info(f"{stream}-g"))["state"]["messages"] >= len(msgs):
            break
        await asyncio.sleep(0.05)
    return api, evs, msgs, {i + 1: p for i, p in bad_at.items()}


async def test_split_read_dead_letters_per_partition(nc, js, unique_name) -> None:
    """``dlq`` with the split read: bad messages of partitions 1 and 6 go to the DLQ tagged
    with their own partition, counted on their own side; every good message is committed."""
    n = 8
    api, evs, msgs, bad = await _bad_setup(js, unique_name, n)
    sink = MemorySink()
    r = await run_partitions(nc, unique_name, "g", range(n), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=120, **FAST))
    assert r.status == "drained" and r.processed == len(evs) and r.dead_lettered == len(bad), r
    assert "read_split" in r.timings, r.timings
    assert {s.partition: s.dead_lettered for s in r.inputs.values()} == {
        p: sum(1 for q in bad.values() if q == p) for p in range(n)}
    assert keyed.mismatches(sink.rows(), evs) is None
    dlq = dlq_stream_name(unique_name, "g")
    stored = await api.direct_get_batch(dlq, 1, f"{dlq}.>", 100)
    assert sorted((int(m.headers["Cg-Sequence"]), int(m.headers["Cg-Partition"]))
                  for m in stored) == sorted(bad.items())
    assert await _left(api, f"{unique_name}-g") == 0


async def test_split_read_halts_at_the_first_bad_message(nc, js, unique_name) -> None:
    """``halt`` with the split read: the run stops at a bad message (its side ``halted`` at
    it); in every partition the table holds exactly the committed prefix and nothing beyond
    the watermark was acknowledged; a halted partition's bad message stays its first."""
    n = 8
    api, evs, msgs, bad = await _bad_setup(js, unique_name, n)
    sink = MemorySink()
    r = await run_partitions(nc, unique_name, "g", range(n), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=120, dead_letter_policy="halt",
                                           **FAST))
    assert r.status == "halted" and r.halted_at in bad, r
    assert "read_split" in r.timings, r.timings
    halted = [s for s in r.inputs.values() if s.halted_at is not None]
    assert halted and all(s.status == "halted" and bad[s.halted_at] == s.partition
                          for s in halted)  # at its own partition's bad message
    wq = f"{unique_name}-g"
    committed: list[tuple[str, int]] = []
    for p in range(n):
        wm = sink.watermark(app_id_for(unique_name, "g", p))
        mine = [(seq, m) for seq, m in enumerate(msgs, 1)
                if partition_for([m[0].split(".", 1)[1]], n) == p]
        done = [m for seq, m in mine if seq <= wm]
        assert await _left(api, wq, p) == len(mine) - len(done), p
        committed += [(json.loads(d)["key"], json.loads(d)["n"]) for _, d in done]
    assert keyed.mismatches(sink.rows(), committed) is None
    for s in halted:
        first = await api.direct_get_batch(wq, 1, f"{s.partition}.>", 1)
        assert first[0].seq == s.halted_at
