"""Streaming members (``static_consume`` / ``elastic_consume``) against a real nats-server.

Seed 000 "Partitioned consumer group members" and "Transitioning as the membership changes":
each member gets exactly its partitions' messages with the partition token stripped; an elastic
membership change moves partitions without loss, with per-key order kept and duplicates only
for messages in flight at the change; one pinned instance per member receives, a standby takes
over after a crash or a step-down; a member re-creates its consumer deleted under it (#41).

Every message is JSON ``{"key", "n"}`` with ``n`` increasing per key. Handlers record each
delivery with a global counter taken at processing time, then double-ack; a duplicate is a
``(key, n)`` recorded twice, and every duplicate must follow a delivery whose ack failed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import StreamConfig

from cg_pipelines.core.assignment import assignment, generate_partition_filters
from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    STATIC_BUCKET,
    ElasticConfig,
    PartitioningFilter,
    StaticConfig,
)
from cg_pipelines.core.errors import ConfigError, MembershipError
from cg_pipelines.core.subjects import partition_of_subject
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import ConsumerNotFoundError
from cg_pipelines.jetstream.kv import ConfigStore
from cg_pipelines.jetstream.members import (
    ConsumeHandle,
    GroupMsg,
    MemberConfig,
    elastic_consume,
    static_consume,
)
from tests.support.wait import still_running, wait_for

ROOT = Path(__file__).resolve().parents[2]
N = 4  # partitions
ACK_WAIT = 1.0
FAST = MemberConfig(ack_wait_s=ACK_WAIT)


# ------------------------------------------------------------------------------------ helpers




@dataclass
class Row:
    order: int  # global processing counter
    member: str
    key: str
    n: int
    subject: str
    partition: int
    acked: bool | None = None


class Log:
    """Deliveries of all members of a test, in processing order."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self._counter = itertools.count()

    def handler(self, member: str) -> Callable[[GroupMsg], Awaitable[None]]:
        async def handle(msg: GroupMsg) -> None:
            d = json.loads(msg.data)
            row = Row(next(self._counter), member, d["key"], d["n"], msg.subject, msg.partition)
            self.rows.append(row)
            try:
                await msg.ack_sync(timeout=2.0)
                row.acked = True
            except Exception:  # consumer deleted under us: redelivered
                row.acked = False
        return handle

    def of(self, member: str) -> list[Row]:
        return [r for r in self.rows if r.member == member]

    def unique(self) -> set[tuple[str, int]]:
        return {(r.key, r.n) for r in self.rows}

    def duplicates(self) -> int:
        return len(self.rows) - len(self.unique())

    async def check(self, published: list[tuple[str, int]]) -> int:
        """Nothing lost, nothing unexpected, per-key order, duplicates explained; returns the
        number of duplicates. Waits for pending acks to settle first (an ack sent while the
        consumer was being deleted gets no answer and fails at its timeout)."""
        await wait_for(lambda: all(r.acked is not None for r in self.rows), 5,
                       "every ack answered or timed out")
        assert self.unique() == set(published), (
            f"lost {sorted(set(published) - self.unique())[:10]}, "
            f"unexpected {sorted(self.unique() - set(published))[:10]}")
        assert_key_order([(r.key, r.n) for r in sorted(self.rows, key=lambda r: r.order)])
        first: dict[tuple[str, int], Row] = {}
        for r in sorted(self.rows, key=lambda r: r.order):
            prev = first.get((r.key, r.n))
            if prev is None:
                first[(r.key, r.n)] = r
            else:
                # A redelivery is only legitimate if the earlier delivery was never acked.
                assert prev.acked is False, f"{r} redelivered although {prev} was acked"
                first[(r.key, r.n)] = r
        return self.duplicates()


def assert_key_order(seen: list[tuple[str, int]]) -> None:
    """Per key, ``n`` never goes back (a redelivery repeats the last value at most)."""
    last: dict[str, int] = {}
    bad = []
    for k, n in seen:
        if k in last and n < last[k]:
            bad.append((k, last[k], n))
        last[k] = max(n, last.get(k, n))
    assert not bad, f"per-key order broken (key, previous n, then n): {bad[:10]}"


class Publisher:
    """Keyed events ``{"key", "n"}`` on ``<stream>.<key>``, ``n`` increasing per key."""

    def __init__(self, js: Any, stream: str, n_keys: int = 11) -> None:
        self.js, self.stream, self.n_keys = js, stream, n_keys
        self.sent: list[tuple[str, int]] = []
        self._i = 0

    def next_event(self) -> tuple[str, int]:
        i = self._i
        self._i += 1
        return f"k{(i * 7) % self.n_keys}", i

    async def publish(self, count: int) -> list[tuple[str, int]]:
        evs = [self.next_event() for _ in range(count)]
        acks = [await self.js.publish_async(f"{self.stream}.{k}", _payload(k, n))
                for k, n in evs]
        await asyncio.gather(*acks)
        self.sent.extend(evs)
        return evs

    async def steady(self, count: int, rate: float,
                     at: dict[int, Callable[[], Awaitable[Any]]] | None = None) -> None:
        """Publish ``count`` events at ``rate`` per second; ``at[i]`` runs before event ``i``."""
        start = time.monotonic()
        for i in range(count):
            if at and i in at:
                await at[i]()
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the publishing rate: event i at start + i / rate
            k, n = self.next_event()
            await self.js.publish(f"{self.stream}.{k}", _payload(k, n))
            self.sent.append((k, n))


def _payload(key: str, n: int) -> bytes:
    return json.dumps({"key": key, "n": n}).encode()


async def elastic_group(js: Any, stream: str, members: tuple[str, ...] = (),
                        wildcard: bool = True) -> ElasticConfig:
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    pfs = (PartitioningFilter(f"{stream}.*", (1,)),) if wildcard else ()
    return (await admin.create_elastic(js, stream, "g", ElasticConfig(N, pfs, members=members))
            ).config


def owner_of(cfg: StaticConfig | ElasticConfig) -> dict[int, str]:
    return {p: m for m, ps in assignment(cfg).items() for p in ps}


async def transition_done(api: JetStreamAPI, stream: str, js: Any) -> bool:
    """True when the work-queue consumers are exactly the current config's members, each with
    its filters (so new messages go to their owners)."""
    cfg = (await admin.get_elastic(js, stream, "g")).config
    wq = f"{stream}-g"
    infos = {ci["name"]: ci for ci in await api.list_consumers(wq)}
    want = {m: generate_partition_filters(cfg.members, cfg.max_members, cfg.member_mappings, m,
                                          cfg.consumer_filters())
            for m in assignment(cfg)}
    if set(infos) != set(want):
        return False
    return all(sorted(infos[m]["config"].get("filter_subjects") or []) == sorted(f)
               for m, f in want.items())


async def wq_messages(api: JetStreamAPI, stream: str) -> int:
    return int((await api.stream_info(f"{stream}-g"))["state"]["messages"])


async def stop_all(*handles: ConsumeHandle) -> list[BaseException | None]:
    for h in handles:
        h.stop()
    return [await asyncio.wait_for(h.done(), 10) for h in handles]


# ------------------------------------------------------------------- 1. reference scenarios


async def test_static_members_get_exactly_their_filtered_partitions(js, unique_name) -> None:
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream,
                                     subjects=[f"{p}.{stream}.>" for p in range(N)]))
    cfg = StaticConfig(N, filters=(f"{stream}.a.>",), members=("m1", "m2"))
    await admin.create_static(js, stream, "g", cfg)
    assign = assignment(cfg)
    assert assign == {"m1": [0, 1], "m2": [2, 3]}

    # Non-matching subjects first: delivery follows stream order, so once every later "a"
    # message has arrived, any "b" message would have arrived too.
    async def publish_round(r: int) -> list[tuple[str, int]]:
        for p in range(N):
            await js.publish(f"{p}.{stream}.b.x", _payload(f"b{p}", r))
        evs = []
        for p in range(N):
            for i in range(5):
                key = f"p{p}k{i}"
                await js.publish(f"{p}.{stream}.a.{key}", _payload(key, r))
                evs.append((key, r))
        return evs

    published = await publish_round(0)  # before the members start
    log = Log()
    with pytest.raises(MembershipError):
        await static_consume(js, stream, "g", "m3", log.handler("m3"), FAST)
    h1 = await static_consume(js, stream, "g", "m1", log.handler("m1"), FAST)
    h2 = await static_consume(js, stream, "g", "m2", log.handler("m2"), FAST)
    try:
        await wait_for(lambda: len(log.unique()) >= len(published), 10, "round 0")
        published += await publish_round(1)  # while they run
        await wait_for(lambda: len(log.unique()) >= len(published), 10, "round 1")
        assert await log.check(published) == 0
        for r in log.rows:
            assert r.partition in assign[r.member], r
            assert r.subject == f"{stream}.a.{r.key}", r  # partition token stripped
            assert r.key == f"p{r.partition}k{r.key[-1]}", r
        for m in ("m1", "m2"):
            assert {r.partition for r in log.of(m)} == set(assign[m])
        assert not log.of("m3")
        # The durable consumers are the reference's: <group>-<member> with <p>.<filter>.
        api = JetStreamAPI.from_js(js)
        ci = await api.consumer_info(stream, "g-m1")
        assert ci["config"]["filter_subjects"] == [f"0.{stream}.a.>", f"1.{stream}.a.>"]
        assert ci["config"]["priority_policy"] == "pinned_client"
        assert ci["config"]["priority_timeout"] == 1_000_000_000
    finally:
        assert await stop_all(h1, h2) == [None, None]


async def test_elastic_membership_changes_move_partitions(js, unique_name, report) -> None:
    stream = unique_name
    cfg = await elastic_group(js, stream)
    api = JetStreamAPI.from_js(js)
    pub = Publisher(js, stream)
    log = Log()
    h1 = await elastic_consume(js, stream, "g", "m1", log.handler("m1"), FAST)
    h2 = await elastic_consume(js, stream, "g", "m2", log.handler("m2"), FAST)
    try:
        # Nobody is a member: no consumer, the messages wait in the work queue.
        batch1 = await pub.publish(40)
        await wait_for(lambda: _at_least(api, stream, len(batch1)), 5, "messages sourced")
        await asyncio.sleep(ACK_WAIT + 0.6)  # past a self-heal round
        assert await api.list_consumer_names(f"{stream}-g") == []
        assert log.rows == []

        # m1 joins: it gets everything.
        await admin.add_members(js, stream, "g", ["m1"])
        await wait_for(lambda: len(log.unique()) >= len(batch1), 10, "batch 1 at m1")
        assert {r.member for r in log.rows} == {"m1"}
        assert {r.partition for r in log.rows} == set(range(N))

        # m2 joins: once the consumers are re-created, messages go to their owners.
        cfg = (await admin.add_members(js, stream, "g", ["m2"])).config
        await wait_for(lambda: transition_done(api, stream, js), 10, "m1+m2 consumers")
        owners = owner_of(cfg)
        assert set(owners.values()) == {"m1", "m2"}
        mark = len(log.rows)
        batch2 = await pub.publish(80)
        await wait_for(lambda: len(log.unique()) >= len(batch1) + len(batch2), 10, "batch 2")
        rows2 = log.rows[mark:]
        assert {r.member for r in rows2} == {"m1", "m2"}
        for r in rows2:
            assert r.partition == partition_of_subject(f"{stream}.{r.key}", f"{stream}.*", (1,),
                                                       N), r
            assert owners[r.partition] == r.member, r

        # So far every change happened with nothing in flight: no redelivery at all.
        assert await log.check(pub.sent) == 0

        # m1 is dropped right after a batch is published (racing it): m2 gets the rest, and
        # m1 only ever had its own partitions.
        mark = len(log.rows)
        await pub.publish(80)
        await admin.drop_members(js, stream, "g", ["m1"])
        await wait_for(lambda: transition_done(api, stream, js), 10, "m2-only consumer")
        await wait_for(lambda: len(log.unique()) >= len(pub.sent), 10, "batch 3")
        assert all(owners[r.partition] == r.member for r in log.rows[mark:] if r.member == "m1")
        mark = len(log.rows)
        await pub.publish(40)
        await wait_for(lambda: len(log.unique()) >= len(pub.sent), 10, "batch 4")
        assert {r.member for r in log.rows[mark:]} == {"m2"}
        assert {r.partition for r in log.rows[mark:]} == set(range(N))

        for r in log.rows:
            assert r.subject == f"{stream}.{r.key}", r
        dups = await log.check(pub.sent)
        await wait_for(lambda: _zero(api, stream), 5, "work queue empty (everything acked)")
        # At most one in-flight message per member whose consumer was re-created by the drop
        # (m1 and m2; max_ack_pending=1), and only after a failed ack (checked above).
        assert dups <= 2, [r for r in log.rows if not r.acked]
        report.append(f"members: elastic reference scenario, {len(pub.sent)} messages, "
                      f"{dups} duplicates")
    finally:
        assert await stop_all(h1, h2) == [None, None]


async def _zero(api: JetStreamAPI, stream: str) -> bool:
    return await wq_messages(api, stream) == 0


async def _at_least(api: JetStreamAPI, stream: str, n: int) -> bool:
    return await wq_messages(api, stream) >= n


async def test_whole_subject_partitioning(js, unique_name) -> None:
    """No partitioning filters: the whole subject is hashed; subjects of any depth work."""
    stream = unique_name
    cfg = await elastic_group(js, stream, members=("m1", "m2"), wildcard=False)
    owners = owner_of(cfg)
    log = Log()
    h1 = await elastic_consume(js, stream, "g", "m1", log.handler("m1"), FAST)
    h2 = await elastic_consume(js, stream, "g", "m2", log.handler("m2"), FAST)
    try:
        subjects = {}
        published = []
        for i in range(60):
            key = f"s{i}"
            subject = f"{stream}.{key}" if i % 2 else f"{stream}.deep.{key}.x"
            subjects[key] = subject
            await js.publish(subject, _payload(key, i))
            published.append((key, i))
        await wait_for(lambda: len(log.unique()) >= len(published), 10, "all messages")
        assert await log.check(published) == 0
        for r in log.rows:
            assert r.subject == subjects[r.key], r
            assert r.partition == partition_of_subject(r.subject, ">", (), N), r
            assert owners[r.partition] == r.member, r
        assert {r.member for r in log.rows} == {"m1", "m2"}
    finally:
        assert await stop_all(h1, h2) == [None, None]


async def test_config_deleted_stops_cleanly_and_static_change_stops_with_error(
        js, unique_name) -> None:
    stream = unique_name
    log = Log()
    handles: list[ConsumeHandle] = []
    try:
        # Elastic: the config deleted -> done() is None.
        await elastic_group(js, stream, members=("m1",))
        handles.append(he := await elastic_consume(js, stream, "g", "m1", log.handler("m1"),
                                                   FAST))
        await wait_for(lambda: he.joined, 5, "elastic member joined")
        assert await ConfigStore(js, "elastic").delete(stream, "g")
        assert await asyncio.wait_for(he.done(), 5) is None

        # Static: another valid config written over it -> an error; its consumer is gone.
        sstream = f"{stream}S"
        await js.add_stream(StreamConfig(name=sstream, subjects=[f"{p}.{sstream}.>"
                                                                 for p in range(N)]))
        await admin.create_static(js, sstream, "g", StaticConfig(N, members=("m1",)))
        handles.append(hs := await static_consume(js, sstream, "g", "m1", log.handler("m1"),
                                                  FAST))
        await wait_for(lambda: hs.joined, 5, "static member joined")
        kv = await js.key_value(STATIC_BUCKET)
        await kv.put(f"{sstream}.g", StaticConfig(N, members=("m1", "m2")).to_json())
        err = await asyncio.wait_for(hs.done(), 5)
        assert isinstance(err, MembershipError), err
        with pytest.raises(ConsumerNotFoundError):
            await JetStreamAPI.from_js(js).consumer_info(sstream, "g-m1")

        # Static: the config deleted -> done() is None.
        await admin.create_static(js, sstream, "h", StaticConfig(N, members=("m1",)))
        handles.append(hs2 := await static_consume(js, sstream, "h", "m1", log.handler("m1"),
                                                   FAST))
        assert await admin.delete_static(js, sstream, "h") == ["h-m1"]
        assert await asyncio.wait_for(hs2.done(), 5) is None

        # Elastic: an invalid config written -> ignored, the member goes on (the last valid
        # config stays in force; test_members_bad_config.py covers every kind of bad config).
        estream = f"{stream}E"
        await elastic_group(js, estream, members=("m1",))
        handles.append(he2 := await elastic_consume(js, estream, "g", "m1", log.handler("m1"),
                                                    FAST))
        kv = await js.key_value(ELASTIC_BUCKET)
        rev = await kv.put(f"{estream}.g", b'{"max_members":0}')
        await wait_for(lambda: he2.config_error is not None, 5, "invalid config rejected")
        assert isinstance(he2.config_error, ConfigError)
        assert f"revision {rev} ignored" in str(he2.config_error)
        assert await still_running(he2)
    finally:
        await asyncio.gather(stop_all(*handles), return_exceptions=True)


# ----------------------------------------------------------------- 2. HA across processes


def _start_worker(url: str, stream: str, out: Path, err: Path) -> subprocess.Popen:
    with err.open("w") as stderr:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "tests/support/member_worker.py"), url, stream, "g",
             "m1", str(out), str(ACK_WAIT)],
            stdout=subprocess.PIPE, stderr=stderr, text=True)


async def _ready(proc: subprocess.Popen) -> None:
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)  # type: ignore[union-attr]
    assert line.strip() == "ready", line


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)
    if proc.stdout:
        proc.stdout.close()


def _lines(path: Path) -> list[tuple[int, str, int, float]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().split("\n")[:-1]:  # a line still being written is left out
        seq, key, n, t = line.split()
        out.append((int(seq), key, int(n), float(t)))
    return out


async def test_standby_takes_over_after_sigkill(nats_server, js, unique_name, tmp_path,
                                                report) -> None:
    """Two processes run one member; only the pinned one receives. It is SIGKILLed while
    holding a processed but unacknowledged message: the standby takes over within
    2 x priority_timeout, gets that message again first (the only duplicate), loses nothing and
    keeps per-key order."""
    stream = unique_name
    await elastic_group(js, stream, members=("m1",))
    api = JetStreamAPI.from_js(js)
    pub = Publisher(js, stream, n_keys=5)
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    procs: list[subprocess.Popen] = []
    stop_pub = asyncio.Event()
    hold: dict[str, Any] = {}  # set "s" to make the next message a held one; "ev" is it

    async def publish_continuously() -> None:
        while not stop_pub.is_set():
            k, n = pub.next_event()
            payload = {"key": k, "n": n}
            if hold.get("s") and "ev" not in hold:
                payload["hold"] = hold["s"]
                hold["ev"] = (k, n)
            await js.publish(f"{stream}.{k}", json.dumps(payload).encode())
            pub.sent.append((k, n))
            await asyncio.sleep(0.02)  # ~50 msg/s

    publishing = asyncio.create_task(publish_continuously())
    try:
        procs.append(_start_worker(nats_server.url, stream, files[0], tmp_path / "a.err"))
        await _ready(procs[0])
        await wait_for(lambda: _lines(files[0]), 10, "first instance receiving")
        procs.append(_start_worker(nats_server.url, stream, files[1], tmp_path / "b.err"))
        await _ready(procs[1])
        # The standby pulls too, but while the pinned instance lives it receives nothing.
        mark = len(_lines(files[0]))
        await wait_for(lambda: len(_lines(files[0])) >= mark + 75, 10, "1.5 s more traffic")
        assert _lines(files[1]) == [], "the standby received while the pinned one was alive"

        # Kill the pinned process while it holds a processed, unacknowledged message.
        hold["s"] = 3.0
        await wait_for(lambda: "ev" in hold and any(
            (k, n) == hold["ev"] for _, k, n, _ in _lines(files[0])), 10,
            "the held message processed", interval=0.005)
        t_kill = time.time()
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(5)
        killed = _lines(files[0])
        assert killed[-1][1:3] == hold["ev"]
        first = await wait_for(lambda: _lines(files[1]), 10, "the standby receiving")
        failover = first[0][3] - t_kill
        mark = len(pub.sent)
        await wait_for(lambda: len(pub.sent) >= mark + 50, 10, "1 s more traffic")
        stop_pub.set()
        await publishing
        want = set(pub.sent)
        await wait_for(lambda: {(k, n) for _, k, n, _ in killed + _lines(files[1])} >= want,
                       15, "everything processed")
        await wait_for(lambda: _zero(api, stream), 5, "work queue empty")

        standby = _lines(files[1])
        merged = sorted(killed + standby, key=lambda r: r[3])
        seen = [(k, n) for _, k, n, _ in merged]
        assert set(seen) == want  # nothing lost, nothing unexpected
        assert_key_order(seen)
        dups = len(seen) - len(set(seen))
        # Only the message unacknowledged at the kill (max_ack_pending=1) comes twice, and it
        # comes first at the standby (redelivered before anything after it).
        assert dups == 1, dups
        assert standby[0][1:3] == hold["ev"]
        assert seen.count(hold["ev"]) == 2
        priority_timeout = max(ACK_WAIT, 1.0)
        # Liveness, generously bounded (this machine is shared): the standby took over. The
        # failover time itself is a figure for the report (typically about one pin timeout).
        assert failover < 10 * priority_timeout + 10.0, failover
        report.append(f"members: HA failover after SIGKILL {failover:.2f} s (pin timeout "
                      f"{priority_timeout:.1f} s), {len(want)} messages, {dups} duplicate "
                      "(the message unacknowledged at the kill)")
    finally:
        stop_pub.set()
        await asyncio.gather(publishing, return_exceptions=True)
        for p in procs:
            _stop(p)


# --------------------------------------------------------------------- 3. membership churn


async def test_membership_churn_while_publishing(js, unique_name, report) -> None:
    stream = unique_name
    await elastic_group(js, stream, members=("m1",))
    api = JetStreamAPI.from_js(js)
    pub = Publisher(js, stream, n_keys=23)
    log = Log()
    handles = [await elastic_consume(js, stream, "g", m, log.handler(m), FAST)
               for m in ("m1", "m2", "m3")]
    changes = 0

    def change(add: list[str], drop: list[str]) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            nonlocal changes
            if add:
                await admin.add_members(js, stream, "g", add)
                changes += 1
            if drop:
                await admin.drop_members(js, stream, "g", drop)
                changes += 1
        return run

    try:
        t0 = time.monotonic()
        await pub.steady(1500, rate=250, at={
            250: change(["m2"], []), 500: change(["m3"], []), 750: change([], ["m1"]),
            1000: change(["m1"], ["m2"]), 1250: change(["m2"], ["m3"])})
        await wait_for(lambda: len(log.unique()) >= len(pub.sent), 30, "all messages")
        took = time.monotonic() - t0
        await wait_for(lambda: _zero(api, stream), 10, "work queue empty")
        dups = await log.check(pub.sent)
        # At most one message in flight per member (max_ack_pending=1) at each change.
        assert dups <= 3 * changes, dups
        assert {r.member for r in log.rows} == {"m1", "m2", "m3"}
        report.append(f"members: churn, {len(pub.sent)} messages, {changes} membership "
                      f"changes, {dups} duplicates, all processed in {took:.1f} s")
    finally:
        assert await stop_all(*handles) == [None, None, None]


# ---------------------------------------------------------------------------- 4. step-down


async def test_step_down_moves_the_pin(nats_server, js, unique_name) -> None:
    stream = unique_name
    await elastic_group(js, stream, members=("m1",))
    pub = Publisher(js, stream, n_keys=5)
    log = Log()
    conns = [await nats.connect(nats_server.url) for _ in range(2)]
    handles: list[ConsumeHandle] = []
    stop_pub = asyncio.Event()

    async def publish_continuously() -> None:
        while not stop_pub.is_set():
            k, n = pub.next_event()
            await js.publish(f"{stream}.{k}", _payload(k, n))
            pub.sent.append((k, n))
            await asyncio.sleep(0.01)

    publishing = asyncio.create_task(publish_continuously())
    try:
        handles.append(await elastic_consume(conns[0].jetstream(), stream, "g", "m1",
                                             log.handler("a"), FAST))
        await wait_for(lambda: log.of("a"), 5, "instance a receiving")
        handles.append(await elastic_consume(conns[1].jetstream(), stream, "g", "m1",
                                             log.handler("b"), FAST))
        a, b = handles
        await wait_for(lambda: len(log.of("a")) >= 100, 10, "1 s more traffic")
        assert log.of("b") == [] and a.pin_id and b.pin_id is None
        pin_a = a.pin_id

        await admin.elastic_step_down(js, stream, "g", "m1")
        await wait_for(lambda: log.of("b") and b.pin_id, 5, "b receiving after step-down")
        await wait_for(lambda: a.pin_id is None, 5, "a dropping its pin (423)")
        assert b.pin_id != pin_a
        mark = len(log.rows)
        await wait_for(lambda: len(log.rows) >= mark + 50, 5, "traffic after step-down")
        assert {r.member for r in log.rows[mark:]} == {"b"}
        assert await still_running(a)  # a is a standby now, still running

        pin_b = b.pin_id
        await admin.elastic_step_down(js, stream, "g", "m1")
        mark = len(log.rows)
        await wait_for(lambda: any(r.member == "a" for r in log.rows[mark:]) and a.pin_id,
                       5, "a receiving again after the second step-down")
        await wait_for(lambda: b.pin_id is None, 5, "b dropping its pin")
        assert a.pin_id not in (pin_a, pin_b)

        stop_pub.set()
        await publishing
        await wait_for(lambda: len(log.unique()) >= len(pub.sent), 10, "everything processed")
        assert await log.check(pub.sent) == 0
    finally:
        stop_pub.set()
        await asyncio.gather(publishing, return_exceptions=True)
        try:
            assert await stop_all(*handles) == [None] * len(handles)
        finally:
            for c in conns:
                await c.close()


# ----------------------------------------------------------- 5. consumer deleted under it


async def test_member_recreates_its_deleted_consumer(js, unique_name, report) -> None:
    stream = unique_name
    await elastic_group(js, stream, members=("m1",))
    api = JetStreamAPI.from_js(js)
    pub = Publisher(js, stream)
    log = Log()
    h = await elastic_consume(js, stream, "g", "m1", log.handler("m1"), FAST)
    try:
        await pub.publish(10)
        await wait_for(lambda: len(log.unique()) >= 10, 5, "first messages")

        t0 = time.monotonic()
        assert await api.delete_consumer(f"{stream}-g", "m1")
        await pub.publish(10)  # they wait in the work queue

        async def exists() -> bool:
            try:
                await api.consumer_info(f"{stream}-g", "m1")
                return True
            except ConsumerNotFoundError:
                return False

        # Liveness with generous bounds (a shared machine); the times are report figures.
        await wait_for(exists, ACK_WAIT + 20.0, "the consumer re-created")
        recreated = time.monotonic() - t0
        await wait_for(lambda: len(log.unique()) >= 20, ACK_WAIT + 20.0,
                       "messages flowing again")
        flowing = time.monotonic() - t0
        assert await log.check(pub.sent) == 0
        assert h.joined and await still_running(h)
        report.append(f"members: consumer deleted under a member: re-created after "
                      f"{recreated:.2f} s, messages flowing after {flowing:.2f} s")
    finally:
        assert await stop_all(h) == [None]


async def test_handler_error_naks_and_member_goes_on(js, unique_name) -> None:
    """A handler that raises: the message is nak'ed and redelivered, the member keeps going."""
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(1, members=("m1",)))
    seen: list[bytes] = []
    failed: list[bytes] = []

    async def handler(msg) -> None:
        if msg.data == b"boom" and not failed:
            failed.append(msg.data)
            raise RuntimeError("handler bug")
        seen.append(msg.data)
        await msg.ack()

    h = await elastic_consume(js, stream, "g", "m1", handler, MemberConfig(ack_wait_s=1.0))
    try:
        for data in (b"a", b"boom", b"b"):
            await js.publish(f"{stream}.k", data)
        for _ in range(100):
            if len(seen) == 3:
                break
            await asyncio.sleep(0.05)
        assert failed == [b"boom"] and seen == [b"a", b"boom", b"b"]
    finally:
        h.stop()
    assert await h.done() is None
