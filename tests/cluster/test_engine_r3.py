"""The ordered partition engine on a 3-node cluster (R3 origin, work queue, dead-letter stream
and KV bucket) while the work queue's leader steps down, the meta leader steps down, and the
work queue's leader is killed with SIGKILL and restarted, all during partition runs: the table
equals the pandas reference (lost 0, duplicates 0, order violations 0), the work queue ends
empty, the dead letters are stored once each, on R3, and reconciliation finds every origin
message accounted for."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client
from nats.js import JetStreamContext

from cg_pipelines.core.config import dlq_stream_name, work_queue_stream_name
from cg_pipelines.engine.context import RunContext
from cg_pipelines.engine.deadletter import ensure_dlq_stream
from cg_pipelines.engine.lease import (
    LeaseHolder,
    ensure_lease_consumer,
    lease_consumer_name,
)
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.result import RunResult
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.api_admin import pinned_client_id
from cg_pipelines.jetstream.reconcile import reconcile_group, sink_table_seqs
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.testing.cluster import NatsCluster
from tests.cluster import checks
from tests.support import keyed
from tests.support.wait import pulls_waiting, wait_for

T = TypeVar("T")

P = 4
OPTIONS = EngineOptions(batch_max_msgs=60, max_messages=400, ack_wait_s=2.0,
                        priority_timeout_s=2.0, hold_wait_s=2.0, timeout_s=2.0,
                        nats_retry_max_s=30.0)
BAD = [b"{not json", b"", b'{"key": "kbad", "n": "x"}']


async def test_engine_survives_step_downs_and_leader_kill(
        cnc: Client, cjs: JetStreamContext, nats_cluster: NatsCluster, tmp_path: Path,
        report: list[str]) -> None:
    t0 = time.monotonic()
    stream = "EngR3"
    wq = work_queue_stream_name(stream, "g")
    api = JetStreamAPI(cnc, timeout=5)
    await checks.create_r3_group(cjs, stream, P)
    evs = keyed.events(n_keys=40, n_events=3600)
    # Published in four parts, one before each wait for commits: a wait always has work to
    # see committed, however fast the runs drained what came before (they drained 2,400
    # messages in 3.4 s once, before the first fault's step-down returned).
    parts = [evs[:1200], evs[1200:2400], evs[2400:3000], evs[3000:]]
    await keyed.publish(cjs, stream, parts[0])
    for body in BAD:
        await cjs.publish(f"{stream}.kbad", body)
    await checks.wait_sourced(api, stream, len(parts[0]) + len(BAD))

    sink = DeltaSink(str(tmp_path / "t"), schema=keyed.OUT_SCHEMA)
    commits = {"n": 0}
    faults: list[str] = []
    results: list[RunResult] = []
    errors: list[str] = []
    faults_done = asyncio.Event()

    last_step: dict[int, str] = {}

    def hook_for(p: int) -> Callable[[str, dict], None]:
        def hook(step: str, info: dict) -> None:
            last_step[p] = f"{step} at {time.monotonic() - t0:.1f} s"
            if step == "committed":
                commits["n"] += 1
        return hook

    async def state() -> str:
        """What the runs and the lease consumers looked like, for a timeout's message."""
        lines = [f"faults so far: {faults}", f"last step per partition: {last_step}",
                 f"errors: {errors[-8:]}"]
        lines += [f"  {r.partition}: {r.status} {r.processed} in {r.seconds:.1f} s, "
                  f"{r.nats_retries} NATS retries, {r.repins} repins {r.detail}"
                  for r in results[-8:]]
        with contextlib.suppress(Exception):
            cluster = (await api.stream_info(wq)).get("cluster") or {}
            lines.append(f"  {wq}: leader {cluster.get('leader')}, replicas "
                         + ", ".join(f"{r.get('name')} current {r.get('current')} lag "
                                     f"{r.get('lag')}" for r in cluster.get("replicas") or []))
        for p in range(P):
            with contextlib.suppress(Exception):
                i = await api.consumer_info(wq, lease_consumer_name(p))
                lines.append(f"  partition-{p}: pending {i.get('num_pending')}, ack pending "
                             f"{i.get('num_ack_pending')}, pinned {pinned_client_id(i)}, "
                             f"cluster {i.get('cluster')}")
        return "\n".join(lines)

    async def after_commits(k: int) -> None:
        target = commits["n"] + k
        try:
            await wait_for(lambda: commits["n"] >= target, 60, f"{k} more commits")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{await state()}") from None

    async def inject() -> None:
        try:
            await after_commits(2)
            new = await nats_cluster.step_down_stream(wq)
            faults.append(f"stream leader step-down -> {nats_cluster.server_name(new)}")
            await keyed.publish(cjs, stream, parts[1])
            await after_commits(3)
            new = await nats_cluster.step_down_meta()
            faults.append(f"meta leader step-down -> {nats_cluster.server_name(new)}")
            await keyed.publish(cjs, stream, parts[2])
            await after_commits(3)
            killed = await nats_cluster.kill_stream_leader(wq)
            faults.append(f"kill -9 of work-queue leader {nats_cluster.server_name(killed)}")
            await asyncio.sleep(1.5)  # the node stays down 1.5 s: runs go on (or wait) on
            # the other two nodes meanwhile
            await asyncio.to_thread(nats_cluster.restart, killed)
            await nats_cluster.wait_healthy(60)
            faults.append(f"restart of {nats_cluster.server_name(killed)}")
            await keyed.publish(cjs, stream, parts[3])
            # A run that finds the partition empty ends its loop only once everything
            # published is in the work queue (sourcing is asynchronous).
            # After a restart the work queue's source can back off for tens of seconds
            # (37 s seen under load): sourcing is the server's, not the engine's.
            await checks.wait_sourced(api, stream, len(evs) + len(BAD), timeout_s=120)
        finally:
            faults_done.set()

    async def drive(p: int) -> None:
        while True:
            done_before = faults_done.is_set()
            try:
                r = await run_partition(cnc, stream, "g", p, keyed.processor(), sink, OPTIONS,
                                        hook=hook_for(p))
            except Exception as e:  # a failed run is retried, as Dagster would
                errors.append(f"partition {p}: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)  # a retry's backoff, as Dagster's would be
                continue
            results.append(r)
            if done_before and r.status == "empty":
                return
            if r.status in ("empty", "held"):
                await asyncio.sleep(0.1)

    await asyncio.wait_for(asyncio.gather(inject(), *(drive(p) for p in range(P))), 300)
    # Each loop ended on an empty run that started after the last publish was sourced: a
    # final pass finds nothing.
    for p in range(P):
        r = await run_partition(cnc, stream, "g", p, keyed.processor(), sink, OPTIONS)
        assert r.status == "empty", f"{r}\n{await state()}"

    got = checks.effects(sink.read(), evs)
    report.append(f"cluster engine: {len(results)} runs, {commits['n']} commits, faults: "
                  f"{'; '.join(faults)}; {got.line()}; failed runs retried: {len(errors)}; "
                  f"{time.monotonic() - t0:.1f} s")
    assert len(faults) == 4, faults
    assert (got.lost, got.duplicates, got.order_violations) == (0, 0, 0), got.line()
    assert got.rows == len(evs)
    assert keyed.mismatches(sink.read(), evs) is None
    assert await checks.wq_messages(api, stream) == 0
    dlq = await api.stream_info(dlq_stream_name(stream, "g"))
    assert dlq["state"]["messages"] == len(BAD)
    assert await checks.replicas(api, stream) == {
        stream: 3, wq: 3, dlq_stream_name(stream, "g"): 3, checks.KV_STREAM: 3}
    # Every origin message reached the work queue through the faults (dead letters included).
    rep = await reconcile_group(cjs, api, stream, "g", table_seqs=sink_table_seqs(sink, "seq"))
    assert rep.ok and rep.expected == len(evs) + len(BAD) and rep.in_dlq == len(BAD), rep.text()
    # Failed runs are allowed (a rerun resumes), but each must say what happened in one line.
    for e in errors:
        assert "\n" not in e.strip(), e
    await api.close()


async def test_existing_r1_dead_letter_stream_is_raised_to_the_origin_replicas(
        cnc: Client, cjs: JetStreamContext) -> None:
    stream = "DlqR1"
    api = JetStreamAPI(cnc, timeout=5)
    await checks.create_r3_group(cjs, stream, 2)
    name = await ensure_dlq_stream(api, stream, "g", replicas=1)  # as earlier versions made it
    assert (await api.stream_info(name))["config"]["num_replicas"] == 1
    await ensure_dlq_stream(api, stream, "g")
    assert (await api.stream_info(name))["config"]["num_replicas"] == 3
    await api.close()


async def test_kv_bucket_made_r1_is_raised_by_an_r3_group(cnc: Client,
                                                           cjs: JetStreamContext) -> None:
    api = JetStreamAPI(cnc, timeout=5)
    await checks.create_r3_group(cjs, "KvR3a", 2)  # makes sure the bucket exists
    cfg = (await api.stream_info(checks.KV_STREAM))["config"]
    await api.update_stream({**cfg, "num_replicas": 1})  # as an R1 first group leaves it
    assert (await api.stream_info(checks.KV_STREAM))["config"]["num_replicas"] == 1
    await checks.create_r3_group(cjs, "KvR3b", 2)
    assert (await api.stream_info(checks.KV_STREAM))["config"]["num_replicas"] == 3
    await api.close()

async def seen_waiting(start: Callable[[], Awaitable[T]], api: JetStreamAPI, stream: str,
                       consumer: str, what: str, timeout_s: float = 60.0) -> asyncio.Task[T]:
    """Start the pull ``start()`` makes and return its task once the server counts it waiting
    at ``consumer``; a pull that ended first (answered at once, or expired on a loaded machine
    before a consumer info saw it) is sent again, until ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        task = asyncio.ensure_future(start())
        seen = asyncio.ensure_future(pulls_waiting(api, stream, consumer, what=what,
                                                   timeout=max(1.0, deadline - time.monotonic())))
        await asyncio.wait({task, seen}, return_when=asyncio.FIRST_COMPLETED)
        if seen.done():
            seen.result()  # raises when timed out
            return task
        seen.cancel()
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: every pull ended before it was seen waiting: "
                                 f"{task.result()!r}")



async def test_a_pull_ended_by_a_consumer_leader_change_is_sent_again(
        cnc: Client, cjs: JetStreamContext, nats_cluster: NatsCluster, tmp_path: Path) -> None:
    """The wire fact: a pull waiting at a clustered lease consumer whose leader steps down is
    ended with nothing delivered and an "unavailable" status: 409 ``Leadership Change`` from the
    new leader, or 503 (no responders) when the pull reaches the consumer while it moves —
    which of the two depends on timing, so either passes. The engine sends such a pull again
    (a NATS retry) instead of failing the run with it."""
    stream = "ConsLeader"
    wq = work_queue_stream_name(stream, "g")
    api = JetStreamAPI(cnc, timeout=5)
    await checks.create_r3_group(cjs, stream, 1)
    await ensure_lease_consumer(api, wq, 0, OPTIONS)
    cname = lease_consumer_name(0)

    # a pull sent before the new consumer's leader is elected is answered 503 at once and never
    # waits: wait for the leader, then (re)send until the pull is seen waiting there
    await nats_cluster.consumer_leader(wq, cname)
    waiting = await seen_waiting(lambda: api.pull(wq, cname, batch=1, expires_s=30.0), api, wq,
                                 cname, "the pull waiting at the consumer leader")
    await nats_cluster.step_down_consumer(wq, cname)
    got = await waiting
    assert got.unavailable and not got.messages, got
    assert (got.status, got.description) == (409, "Leadership Change") or got.status == 503, got

    ctx = RunContext(cnc, stream, "g", 0, keyed.processor(),
                     DeltaSink(str(tmp_path / "t"), schema=keyed.OUT_SCHEMA), OPTIONS, None)
    holder = LeaseHolder(ctx, cname)
    pulling = await seen_waiting(
        lambda: holder.pull("pull the lease", batch=1, expires_s=10.0), api, wq, cname,
        "the run's pull waiting at the new leader")
    retries_before = ctx.res.nats_retries
    await nats_cluster.step_down_consumer(wq, cname)
    again = await pulling  # sent again after the unavailable answer, then expired empty
    assert again.status in (404, 408) and not again.messages, again
    assert ctx.res.nats_retries > retries_before
    await ctx.api.close()
    await api.close()
