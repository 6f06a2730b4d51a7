"""A Dagster partition run and the sensors against a group on the 3-node cluster (R3), with a
work-queue leader step-down, a meta-leader step-down and a kill -9 + restart of the work-queue
leader while partition runs execute: every partition run succeeds (a run the fault failed is
retried, as the backlog sensor retries it, and its error names the group), the table equals
the pandas reference (lost 0, duplicates 0, order violations 0), the sensors request exactly
the partitions with backlog and nothing once drained, and the work queue, dead-letter stream
and KV bucket are R3."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from dagster import DagsterInstance, ExecuteInProcessResult
from nats.aio.client import Client
from nats.js import JetStreamContext

from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.engine.lease import lease_consumer_name
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.api_admin import pinned_client_id
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.testing.cluster import NatsCluster
from tests.cluster import checks
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import (
    ASSET,
    BACKLOG_SENSOR,
    JOB,
    MEMBERSHIP_SENSOR,
    PARTITIONS,
    make_defs,
    pkey,
)
from tests.support import keyed
from tests.support.wait import wait_for


def failure_line(res: ExecuteInProcessResult) -> str:
    """The run's failure: the step's error message (one line)."""
    msgs = [e.step_failure_data.error.message.strip() for e in res.all_events
            if e.is_step_failure and e.step_failure_data.error is not None]
    return msgs[0] if msgs else "failed without a step error"


async def test_dagster_runs_and_sensors_on_r3_with_faults(
        cnc: Client, cjs: JetStreamContext, nats_cluster: NatsCluster, tmp_path: Path,
        report: list[str]) -> None:
    t0 = time.monotonic()
    stream = "DagR3"
    wq = work_queue_stream_name(stream, "g")
    api = JetStreamAPI(cnc, timeout=5)
    await checks.create_r3_group(cjs, stream, PARTITIONS)
    evs = keyed.events(n_keys=40, n_events=3000)
    first, second = evs[:2000], evs[2000:]
    await keyed.publish(cjs, stream, first)
    await checks.wait_sourced(api, stream, len(first))
    warehouse = str(tmp_path / "wh")
    defs = make_defs(stream, nats_cluster.url, warehouse)
    job = defs.resolve_job_def(JOB)
    faults: list[str] = []
    failed_runs: list[str] = []

    async def stream_step_down() -> None:
        new = await nats_cluster.step_down_stream(wq)
        faults.append(f"work-queue leader step-down -> {nats_cluster.server_name(new)}")

    async def meta_step_down() -> None:
        new = await nats_cluster.step_down_meta()
        faults.append(f"meta leader step-down -> {nats_cluster.server_name(new)}")

    killed: list[int] = []

    async def kill() -> None:  # before the run starts: the run begins with the leader gone
        killed.append(await nats_cluster.kill_stream_leader(wq))

    async def restart() -> None:  # while that run executes
        await asyncio.sleep(1.0)  # the killed leader stays down 1 s more, the run going on
        await asyncio.to_thread(nats_cluster.restart, killed[-1])
        faults.append(f"kill -9 + restart of work-queue leader "
                      f"{nats_cluster.server_name(killed[-1])}")

    async def leased(p: int) -> bool:
        try:
            info = await api.consumer_info(wq, lease_consumer_name(p))
        except Exception:  # not created yet, or no consumer leader at the moment
            return False
        return pinned_client_id(info) is not None

    with DagsterInstance.ephemeral() as instance:
        # The membership sensor sees m1 own every partition; the backlog sensor asks for all.
        member = await asyncio.to_thread(h.tick, defs, MEMBERSHIP_SENSOR, instance)
        assert h.partitions_of(list(member.run_requests or [])) == [
            pkey(p) for p in range(PARTITIONS)]
        backlog = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
        wanted = h.partitions_of(list(backlog.run_requests or []))
        assert wanted == [pkey(p) for p in range(PARTITIONS)]

        # (before the run, during the run) per partition
        plan: list[tuple[Callable[[], Awaitable[None]] | None,
                         Callable[[], Awaitable[None]] | None]] = [
            (None, stream_step_down), (None, meta_step_down), (kill, restart), (None, None)]
        for key, (before, during) in zip(wanted, plan, strict=True):
            if before is not None:
                await before()
            run = asyncio.create_task(asyncio.to_thread(
                job.execute_in_process, partition_key=key, instance=instance,
                raise_on_error=False))
            if during is not None:
                # the run holds the partition's lease (pinned), or is already over
                part = int(key.rsplit("-", 1)[1])
                await wait_for(lambda r=run, p=part: r.done() or leased(p), 120,
                               f"the run of {key} to lease its partition")
                await during()
            res = await run
            await nats_cluster.wait_healthy(60)
            for _ in range(3):  # a run failed by the fault is retried, as the backlog sensor does
                if res.success:
                    break
                failed_runs.append(f"{key}: {failure_line(res)}")
                res = await asyncio.to_thread(job.execute_in_process, partition_key=key,
                                              instance=instance, raise_on_error=False)
            assert res.success, failure_line(res)

        # New events after the faults: the backlog sensor asks again, runs drain them.
        await keyed.publish(cjs, stream, second)
        await checks.wait_sourced(api, stream, len(evs))
        again = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
        keys = h.partitions_of(list(again.run_requests or []))
        assert keys and set(keys) <= set(wanted)
        for key in keys:
            res = await asyncio.to_thread(job.execute_in_process, partition_key=key,
                                          instance=instance)
            assert res.success
        idle = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
        assert not idle.run_requests and idle.skip_message

    table = DeltaSink(f"{warehouse}/{ASSET}", schema=keyed.OUT_SCHEMA).read()
    got = checks.effects(table, evs)
    report.append(f"cluster dagster: faults: {'; '.join(faults)}; {got.line()}; "
                  f"runs failed by a fault and retried: {len(failed_runs)} "
                  f"{failed_runs}; {time.monotonic() - t0:.1f} s")
    assert len(faults) == 3, faults
    for line in failed_runs:  # what an operator sees: the group named, one line
        assert f"{stream}.g" in line or wq in line, line
        assert "\n" not in line.split(": ", 1)[1].strip(), line
    assert (got.lost, got.duplicates, got.order_violations) == (0, 0, 0), got.line()
    h.assert_table_equals_reference(warehouse, evs)
    assert await checks.wq_messages(api, stream) == 0
    # no dead letters here: the engine creates the DLQ stream only with the first one
    assert await checks.replicas(api, stream) == {stream: 3, wq: 3, checks.KV_STREAM: 3}
    await api.close()
