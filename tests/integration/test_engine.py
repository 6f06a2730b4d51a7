"""The ordered partition engine against a real nats-server and real Delta tables.

Every test checks the contract: per-key stream order, each effect committed exactly once,
nothing acknowledged before its commit, nothing lost (table == pandas reference, work queue
empty afterwards).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.js.api import StreamConfig

from cg_pipelines.core.config import (
    ElasticConfig,
    PartitioningFilter,
    StaticConfig,
    dlq_stream_name,
)
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine.lease import lease_consumer_name
from cg_pipelines.engine.options import EngineConfigError, EngineOptions
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.engine.static import run_static_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed
from tests.support.wait import SentRequests, pulls_waiting

N = 2  # partitions
FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0)
ROOT = Path(__file__).resolve().parents[2]


async def _group(js, stream: str, n: int = N) -> None:
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        n, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))


async def _wait_sourced(api: JetStreamAPI, wq: str, n: int) -> None:
    for _ in range(200):
        if (await api.stream_info(wq))["state"]["messages"] >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{wq} did not receive {n} messages")


async def _wq_left(api: JetStreamAPI, wq: str) -> int:
    return int((await api.stream_info(wq))["state"]["messages"])


async def _setup(js, stream: str, evs, n: int = N) -> JetStreamAPI:
    await _group(js, stream, n)
    await keyed.publish(js, stream, evs)
    api = JetStreamAPI.from_js(js)
    await _wait_sourced(api, f"{stream}-g", len(evs))
    return api


async def test_ordered_exactly_once_small_batches(nc, js, unique_name, tmp_path) -> None:
    stream = unique_name
    evs = keyed.events(n_keys=23, n_events=1500)
    api = await _setup(js, stream, evs)
    sink = DeltaSink(str(tmp_path / "t"))
    results = [await run_partition(nc, stream, "g", p, keyed.processor(), sink,
                                   EngineOptions(batch_max_msgs=37, read_chunk=16, **FAST))
               for p in range(N)]
    assert [r.status for r in results] == ["drained"] * N
    assert sum(r.processed for r in results) == len(evs)
    assert all(r.commits > 1 for r in results)  # batches split keys
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _wq_left(api, f"{stream}-g") == 0
    for p, r in enumerate(results):
        assert sink.watermark(f"{stream}/g/{p}") == r.last_seq
    # A second run finds nothing to do.
    again = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                                EngineOptions(**FAST))
    assert again.status == "empty" and again.processed == 0


async def test_new_messages_after_start_wait_for_next_run(nc, js, unique_name, tmp_path) -> None:
    stream = unique_name
    evs = keyed.events(5, 200)
    await _setup(js, stream, evs, n=1)
    sink = DeltaSink(str(tmp_path / "t"))
    more = [(k, n + 100000) for k, n in keyed.events(5, 50)]
    state = {"published": False}

    def hook(step: str, info: dict) -> None:
        if step == "committed" and not state["published"]:
            state["published"] = True
            asyncio.get_running_loop().create_task(keyed.publish(js, stream, more))

    r1 = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=50, **FAST), hook=hook)
    assert r1.status == "drained" and r1.processed == 200
    async with JetStreamAPI.from_js(js) as api:  # the 50 published meanwhile are queued
        await _wait_sourced(api, f"{stream}-g", len(more))
    r2 = await run_partition(nc, stream, "g", 0, keyed.processor(), sink, EngineOptions(**FAST))
    assert r2.processed == 50
    assert keyed.mismatches(sink.read(), evs + more) is None


async def test_dense_and_sparse_partitions_read_only_their_messages(nc, js, unique_name,
                                                                    tmp_path) -> None:
    """Partition 1 holds a fifth of the work queue (read with the partition filter), then
    partition 0 all of it (read unfiltered); and with both interleaved, partition 0 (80%, dense)
    skips partition 1's messages. Each commits exactly its own keys, in order."""
    stream = unique_name
    keys0 = [k for k in (f"k{i}" for i in range(200)) if partition_for([k], 2) == 0][:6]
    keys1 = [k for k in (f"k{i}" for i in range(200)) if partition_for([k], 2) == 1][:2]
    evs = [(keys0[i % 6] if i % 5 else keys1[i % 2], 1000 + i) for i in range(600)]
    api = await _setup(js, stream, evs)
    sink = DeltaSink(str(tmp_path / "t"))
    opts = EngineOptions(batch_max_msgs=50, read_chunk=20, **FAST)
    r1 = await run_partition(nc, stream, "g", 1, keyed.processor(), sink, opts)  # 20%: sparse
    r0 = await run_partition(nc, stream, "g", 0, keyed.processor(), sink, opts)  # now 100%
    assert (r0.processed, r1.processed) == (480, 120)
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _wq_left(api, f"{stream}-g") == 0
    # Interleaved: the dense partition first, skipping the other's messages.
    more = [(k, n + 5000) for k, n in evs]
    await keyed.publish(js, stream, more)
    await _wait_sourced(api, f"{stream}-g", len(more))
    r0 = await run_partition(nc, stream, "g", 0, keyed.processor(), sink, opts)
    assert r0.processed == 480 and await _wq_left(api, f"{stream}-g") == 120
    r1 = await run_partition(nc, stream, "g", 1, keyed.processor(), sink, opts)
    assert r1.processed == 120
    assert keyed.mismatches(sink.read(), evs + more) is None


def _worker(url: str, stream: str, partition: int, uri: str, step: str, at: int,
            sig: str = "KILL", batch: int = 40, settle_interval_s: float | None = None
            ) -> subprocess.Popen:
    settle = [] if settle_interval_s is None else [str(settle_interval_s)]
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests/support/engine_worker.py"), url, stream, "g",
         str(partition), uri, str(batch), str(FAST["ack_wait_s"]), step, str(at), sig,
         *settle],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("step", ["read", "committed", "purged"])
async def test_crash_points(nats_server, nc, js, unique_name, tmp_path, step) -> None:
    """SIGKILL the worker after read (before commit), after commit (before purge), after purge
    (before ack), each batch settled at once (``settle_interval_s=0``; the default settles
    several commits together: ``test_settle_interval.py``); a rerun completes with the
    reference result and an empty work queue."""
    stream = unique_name
    evs = keyed.events(11, 400)
    api = await _setup(js, stream, evs, n=1)
    uri = str(tmp_path / "t")
    proc = _worker(nats_server.url, stream, 0, uri, step, at=2, settle_interval_s=0)
    out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    sink = DeltaSink(uri)
    # Killed in the second batch of 40. After its commit or purge: the first two batches are
    # committed (and purged). At its read: the first batch's commit runs concurrently with the
    # second batch (commit off the critical path), so it may or may not have landed.
    wm = sink.watermark(f"{stream}/g/0")
    left = await _wq_left(api, f"{stream}-g")
    if step == "read":
        assert wm in (0, 40) and len(evs) - wm <= left <= len(evs), (wm, left)
    else:
        assert wm == 80
        assert left == len(evs) - (80 if step == "purged" else 40)
    r = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                            EngineOptions(batch_max_msgs=40, **FAST))
    assert r.status == "drained", r
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _wq_left(api, f"{stream}-g") == 0
    if step == "committed":
        assert r.duplicates_skipped == 1  # the committed-but-unpurged lease was skipped


async def test_zombie_is_fenced(nats_server, nc, js, unique_name, tmp_path) -> None:
    """A holder paused (SIGSTOP) past its pin timeout mid-batch; a second run takes over and
    drains; the resumed zombie's commit is refused as a fence conflict."""
    stream = unique_name
    evs = keyed.events(13, 500)
    api = await _setup(js, stream, evs, n=1)
    uri = str(tmp_path / "t")
    zombie = _worker(nats_server.url, stream, 0, uri, "processed", at=2, sig="STOP")
    for _ in range(600):
        state = Path(f"/proc/{zombie.pid}/stat").read_text().split()[2]
        if state == "T":
            break
        await asyncio.sleep(0.05)
    assert state == "T", "worker never paused"
    try:
        sink = DeltaSink(uri)
        r = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                                EngineOptions(batch_max_msgs=40, **FAST))
        assert r.status == "drained" and r.fence_conflicts == 0
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    out, err = await asyncio.to_thread(zombie.communicate, timeout=60)
    zr = json.loads(out.strip().splitlines()[-1])
    # Resumed, the zombie either commits its batch and is refused (fenced), or, when its
    # pipelined previous commit had not pulled the next lease before the pause, finds the pin
    # taken and the partition drained, and stops before committing: never a commit after the
    # takeover (which the table check below would also show as duplicates).
    assert zr["status"] in ("fenced", "drained", "handed_over"), (zr, err)
    if zr["status"] == "fenced":
        assert zr["fence_conflicts"] == 1, (zr, err)
    else:
        assert zr["fence_conflicts"] == 0 and zr["commits"] <= 1, (zr, err)
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _wq_left(api, f"{stream}-g") == 0


async def test_held_partition_and_handover_on_step_down(nc, js, unique_name, tmp_path) -> None:
    stream = unique_name
    evs = keyed.events(7, 300)
    api = await _setup(js, stream, evs, n=1)
    sink = DeltaSink(str(tmp_path / "t"))
    slow = keyed.processor()
    orig = slow.transform

    def slow_transform(table, ctx):  # a slow holder: 0.4 s per batch of 10, >= 3.6 s in all,
        time.sleep(0.4)               # so the step-down below (~1.3 s in) lands mid-drain
        return orig(table, ctx)

    slow.transform = slow_transform
    first_commit = asyncio.Event()
    holder = asyncio.create_task(run_partition(
        nc, stream, "g", 0, slow, sink, EngineOptions(batch_max_msgs=10, **FAST),
        hook=lambda s, i: first_commit.set() if s == "committed" else None))
    await first_commit.wait()
    # Another instance that waits briefly is told the partition is held (not an error).
    short = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                                EngineOptions(**{**FAST, "hold_wait_s": 0.5}))
    assert short.status == "held" and "held by another instance" in short.detail
    # A standby waits; an admin step-down moves the pin after the holder's in-flight commit.
    # The standby is slow too (0.2 s per batch of 30, ~1.8 s in all): still holding the pin
    # when the holder, after its in-flight commit, asks for its next message.
    steady = keyed.processor()
    steady_orig = steady.transform

    def steady_transform(table, ctx):
        time.sleep(0.2)
        return steady_orig(table, ctx)

    steady.transform = steady_transform
    standby = asyncio.create_task(run_partition(
        nc, stream, "g", 0, steady, sink, EngineOptions(batch_max_msgs=30, **FAST)))
    # step down once the standby's first pull (no pin id, hold_wait_s) waits at the server
    lease_pulls = f"$JS.API.CONSUMER.MSG.NEXT.{stream}-g.{lease_consumer_name(0)}"
    async with SentRequests(nc, lease_pulls,
                            lambda b: "id" not in b and b.get("expires", 0) >= 5e9) as pulls:
        await pulls.wait(60, "the standby's first lease pull")
    await pulls_waiting(api, f"{stream}-g", lease_consumer_name(0))
    await api.unpin(f"{stream}-g", lease_consumer_name(0))
    a, b = await asyncio.gather(holder, standby)
    assert a.status == "handed_over" and b.status == "drained", (a, b)
    assert "pin moved to another instance (pin id " in a.detail, a.detail
    assert a.fence_conflicts == 0 and b.fence_conflicts == 0
    assert a.processed + b.processed == len(evs)
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _wq_left(api, f"{stream}-g") == 0


async def test_slow_batch_keeps_lease_and_pin(nc, js, unique_name, tmp_path) -> None:
    """A batch that takes longer than the pin timeout and the ack wait keeps its lease: no
    redelivery, no handover to a waiting standby, and the standby then finds nothing."""
    stream = unique_name
    evs = keyed.events(5, 90)
    api = await _setup(js, stream, evs, n=1)
    sink = DeltaSink(str(tmp_path / "t"))
    slow = keyed.processor()
    orig = slow.transform
    calls = {"n": 0}

    def slow_transform(table, ctx):  # the first batch takes 2.5 pin timeouts
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(2.5 * FAST["priority_timeout_s"])  # past the pin timeout, ack wait
        return orig(table, ctx)

    slow.transform = slow_transform
    started = asyncio.Event()
    holder = asyncio.create_task(run_partition(
        nc, stream, "g", 0, slow, sink, EngineOptions(batch_max_msgs=30, **FAST),
        hook=lambda s, i: started.set() if s == "read" else None))
    await started.wait()
    standby = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                                  EngineOptions(**{**FAST, "hold_wait_s": 2.0}))
    a = await holder
    assert standby.status == "held" and standby.processed == 0
    assert a.status == "drained" and a.processed == len(evs) and a.fence_conflicts == 0, a
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _wq_left(api, f"{stream}-g") == 0


async def _bad_input_setup(js, stream: str):
    evs = keyed.events(5, 120)
    payloads = [json.dumps({"key": k, "n": n}).encode() for k, n in evs]
    bad_at = {17: b"{not json", 40: b"", 41: b'{"key": "k1", "n": "x"}', 90: b"\xff\xfe"}
    for i, data in sorted(bad_at.items()):
        payloads.insert(i, data)
    await _group(js, stream, n=1)
    for data in payloads:  # all on one key token: one partition, one order
        await js.publish(f"{stream}.k0", data)
    api = JetStreamAPI.from_js(js)
    await _wait_sourced(api, f"{stream}-g", len(payloads))
    good = [(k, n) for k, n in evs]
    return api, good, bad_at, payloads


async def test_bad_input_goes_to_dlq_in_order(nc, js, unique_name, tmp_path) -> None:
    stream = unique_name
    api, good, bad_at, payloads = await _bad_input_setup(js, stream)
    sink = DeltaSink(str(tmp_path / "t"))
    r = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                            EngineOptions(batch_max_msgs=25, **FAST))
    assert r.status == "drained" and r.dead_lettered == len(bad_at)
    assert r.processed == len(good)
    assert keyed.mismatches(sink.read(), good) is None
    dlq = dlq_stream_name(stream, "g")
    stored = await api.direct_get_batch(dlq, 1, f"{dlq}.>", 100)
    assert len(stored) == len(bad_at)
    assert [m.data for m in stored] == [bad_at[i] for i in sorted(bad_at)]
    reasons = [m.headers["Cg-Error"] for m in stored]
    assert reasons[0].startswith("malformed JSON") and reasons[1] == "empty payload"
    assert "field 'n' must be int" in reasons[2] and "UTF-8" in reasons[3]
    assert all(m.headers["Cg-Origin-Stream"] == stream and m.headers["Cg-Subject"] ==
               f"{stream}.k0" for m in stored)
    assert [int(m.headers["Cg-Sequence"]) for m in stored] == [i + 1 for i in sorted(bad_at)]
    assert await _wq_left(api, f"{stream}-g") == 0


async def test_halt_policy_commits_nothing_after_bad(nc, js, unique_name, tmp_path) -> None:
    stream = unique_name
    api, good, bad_at, payloads = await _bad_input_setup(js, stream)
    sink = DeltaSink(str(tmp_path / "t"))
    opts = EngineOptions(batch_max_msgs=25, dead_letter_policy="halt", **FAST)
    r = await run_partition(nc, stream, "g", 0, keyed.processor(), sink, opts)
    first_bad_seq = min(bad_at) + 1
    assert r.status == "halted" and r.halted_at == first_bad_seq
    assert sink.watermark(f"{stream}/g/0") == first_bad_seq - 1
    assert keyed.mismatches(sink.read(), good[:min(bad_at)]) is None
    # The bad message and everything after stay in the work queue; a rerun halts again at once.
    assert await _wq_left(api, f"{stream}-g") == len(payloads) - min(bad_at)
    again = await run_partition(nc, stream, "g", 0, keyed.processor(), sink, opts)
    assert again.status == "halted" and again.halted_at == first_bad_seq


async def test_s3_sink_on_moto(nc, js, unique_name, moto_s3) -> None:
    stream = unique_name
    evs = keyed.events(9, 300)
    await _setup(js, stream, evs)
    sink = DeltaSink(f"s3://{moto_s3.bucket}/{stream}", storage_options=moto_s3.options)
    for p in range(N):
        r = await run_partition(nc, stream, "g", p, keyed.processor(), sink,
                                EngineOptions(batch_max_msgs=60, **FAST))
        assert r.status == "drained"
    assert keyed.mismatches(sink.read(), evs) is None


async def test_static_group_partition(nc, js, unique_name, tmp_path) -> None:
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{p}.{stream}.>" for p in range(2)]))
    await admin.create_static(js, stream, "g", StaticConfig(2, (f"{stream}.>",), ("m1",)))
    evs = keyed.events(10, 300)
    acks = [await js.publish_async(f"{partition_for([k], 2)}.{stream}.{k}",
                                   json.dumps({"key": k, "n": n}).encode()) for k, n in evs]
    await asyncio.gather(*acks)
    sink = DeltaSink(str(tmp_path / "t"))
    total = 0
    for p in range(2):
        r = await run_static_partition(nc, stream, "g", p, keyed.processor(), sink,
                                       EngineOptions(batch_max_msgs=32, **FAST),
                                       filters=(f"{stream}.>",))
        assert r.status == "drained", r
        total += r.processed
    assert total == len(evs)
    assert keyed.mismatches(sink.read(), evs) is None
    # The origin stream is never purged.
    assert (await JetStreamAPI.from_js(js).stream_info(stream))["state"]["messages"] == len(evs)
    opts = EngineOptions(batch_max_msgs=32, **FAST)
    r = await run_static_partition(nc, stream, "g", 0, keyed.processor(), sink, opts,
                                   filters=(f"{stream}.>",))
    assert r.processed == 0
    # Every instance must use one consumer config: other settings are refused with the reason.
    with pytest.raises(EngineConfigError, match="exists with other settings"):
        await run_static_partition(nc, stream, "g", 0, keyed.processor(), sink,
                                   EngineOptions(**FAST), filters=(f"{stream}.>",))
