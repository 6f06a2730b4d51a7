"""A run lost together with its host is found by its heartbeat and lease, from another host
(issue 49), and a live run on a host the sensor cannot see is never failed.

Three "hosts" on one machine, each a UTS namespace with its own host name (``unshare --uts``,
root): the Dagster daemon stays on this machine's; a gRPC code server (``dagster api grpc``) on
``host-a`` launches the partition runs, so their run workers live on ``host-a``. No Dagster run
monitoring; the library's defaults otherwise, with short lease/heartbeat settings:

1. Both partitions' runs start on ``host-a`` and block inside their transform (a gate file).
2. ``host-a``'s code server is lost and replaced by one on ``host-b`` (the port the workspace
   names): the sensor now ticks on ``host-b`` and cannot see ``host-a``'s processes. Both runs
   stay in progress past the lost-run bound (heartbeat TTL, pin timeout, grace, ticks): their
   heartbeats are live, so they are never failed; partition 0's gate opens and its run
   succeeds.
3. ``host-a`` is lost whole (every process of it SIGKILLed, partition 1's run worker among
   them). The sensor on ``host-b`` finds the run lost (no heartbeat, no pinned lease), marks it
   failed, and retries the partition on ``host-b``; the table then equals the pandas reference.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus
from dagster._core.scheduler.instigation import InstigatorType
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.jetstream import admin
from cg_pipelines.local.spawn import with_default_signals
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed
from tests.support.daemon import BIN, ROOT, make_home, partition_runs, wait_until
from tests.support.dagster_dev import stop_process_group
from tests.support.procs import kill, with_token

LOCATION = '''\
import os
import time
from pathlib import Path

from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource, NatsResource,
                                  PartitionRunsResource, build_definitions)
from cg_pipelines.engine.processing import ArrowProcessor
from tests.support import keyed

GATE = Path(os.environ["CG_TEST_GATE"])


def transform(table, ctx):
    gate = GATE / str(ctx.partition)
    if gate.exists():
        (GATE / f"{ctx.partition}.entered").write_text(os.uname().nodename)
        while gate.exists():  # held here until the test opens the gate (or the host dies)
            time.sleep(0.1)
    return keyed.transform(table, ctx)


devices = ConsumerGroupAsset(
    name="devices", stream=os.environ["CG_TEST_STREAM"], group="g", partitions=2,
    processor=ArrowProcessor(keyed.DECODER, transform, state=keyed.STATE),
    sensor_interval_s=1, schedule_cron=None, lag_objective_s=3600.0)

defs = build_definitions([devices], resources={
    "nats": NatsResource(servers=os.environ["CG_TEST_NATS"]),
    "warehouse": DeltaWarehouseResource(root=os.environ["CG_TEST_WAREHOUSE"]),
    "partition_runs": PartitionRunsResource(
        hold_wait_s=2.0, ack_wait_s=5.0, priority_timeout_s=5.0, retry_backoff_s=1.0,
        retry_max_backoff_s=2.0, heartbeat_ttl_s=TTL_S, lost_run_grace_s=GRACE_S),
})
'''
TTL_S = 3.0
GRACE_S = 20.0
PIN_S = 5.0
"""The run's heartbeat TTL, the lost-run grace and the lease's pin timeout (seconds)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _host(name: str, port: int, location: Path, env: dict[str, str],
          log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A code server on host ``name``: ``dagster api grpc`` in a new UTS namespace whose host
    name is ``name``; every process of the host (the code server, the run workers
    it launches) carries ``CG_TEST_HOST=<name>``. Ready when its health check answers."""
    full = {**os.environ, **env, "CG_TEST_HOST": name}
    cmd = ["unshare", "--uts", "--", "sh", "-c",
           f'hostname {name} && exec "$@"', "sh", str(BIN / "dagster"), "api", "grpc",
           "--host", "127.0.0.1", "--port", str(port), "-f", str(location), "-d", str(ROOT),
           "--location-name", "loc"]
    with log.open("ab") as out:
        proc = subprocess.Popen(with_default_signals(cmd), cwd=ROOT, env=full, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([str(BIN / "dagster"), "api", "grpc-health-check", "--port",
                              str(port), "--host", "127.0.0.1"], capture_output=True,
                             timeout=60).returncode != 0:
            assert proc.poll() is None, f"code server on {name} exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"code server on {name} not up after 120 s"
            time.sleep(0.5)  # a poll interval: the loop waits for the health check
        yield proc
    finally:
        lose_host(name)
        stop_process_group(proc, 5.0)


def lose_host(name: str) -> None:
    """SIGKILL every process of host ``name`` (a node failure)."""
    kill([pid for pid, _ in with_token("CG_TEST_HOST", name)], signal.SIGKILL)


def _sensor_ticks_since(instance: DagsterInstance, since: float) -> int:
    n = 0
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        if state.instigator_name == "devices_backlog":
            n += sum(t.timestamp >= since for t in instance.get_ticks(
                state.instigator_origin_id, state.selector_id, limit=200))
    return n


async def test_run_lost_with_its_host_is_retried_and_a_live_one_is_not(
        js, nats_server, unique_name: str, tmp_path: Path) -> None:
    stream = unique_name
    evs = keyed.events(n_keys=16, n_events=400)
    assert {partition_for([k], 2) for k, _ in evs} == {0, 1}
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        2, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await keyed.publish(js, stream, evs)

    home = make_home(tmp_path / "home")
    gate = tmp_path / "gate"
    gate.mkdir()
    for p in (0, 1):
        (gate / str(p)).write_text("closed")
    location = tmp_path / "location.py"
    location.write_text(LOCATION.replace("TTL_S", repr(TTL_S)).replace("GRACE_S", repr(GRACE_S)))
    port = _free_port()
    (tmp_path / "workspace.yaml").write_text(
        f"load_from:\n  - grpc_server:\n      host: 127.0.0.1\n      port: {port}\n"
        "      location_name: loc\n")
    warehouse = tmp_path / "warehouse"
    env = {"CG_TEST_STREAM": stream, "CG_TEST_NATS": nats_server.url,
           "CG_TEST_WAREHOUSE": str(warehouse), "CG_TEST_GATE": str(gate),
           "DAGSTER_HOME": str(home)}
    full = {**os.environ, **env}

    def scenario() -> dict[str, float]:
        instance = DagsterInstance.from_config(str(home))
        figures: dict[str, float] = {}
        with _host("host-a", port, location, env, tmp_path / "host-a.log"):
            out = subprocess.run([str(BIN / "dagster"), "sensor", "start", "devices_backlog",
                                  "-w", str(tmp_path / "workspace.yaml")], cwd=ROOT, env=full,
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
            with (home / "daemon.log").open("ab") as log:
                daemon = subprocess.Popen(
                    with_default_signals([str(BIN / "dagster-daemon"), "run", "-w",
                                          str(tmp_path / "workspace.yaml")]),
                    cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
            try:
                # 1. both runs block inside their transform, on host-a
                for p in (0, 1):
                    wait_until(f"partition {p}'s run entered its transform", lambda p=p: (
                        gate / f"{p}.entered").exists(), 240, home)
                    assert (gate / f"{p}.entered").read_text() == "host-a"
                first = {p: partition_runs(instance, f"g-{p}")[0] for p in (0, 1)}
                assert all(r.status == DagsterRunStatus.STARTED for r in first.values())
                assert all(r.tags["cg/run_worker"].startswith("host-a ")
                           and r.tags["cg/heartbeat_ttl_s"] == "3" for r in first.values())
                # 2. host-a's code server is replaced by one on host-b; the runs live on
                kill([pid for pid, cmd in with_token("CG_TEST_HOST", "host-a")
                      if " api grpc " in f" {cmd} "], signal.SIGKILL)
                with _host("host-b", port, location, env, tmp_path / "host-b.log"):
                    since = time.time()
                    # Time must pass: past the lost-run bound (grace, heartbeat TTL, pin
                    # timeout) by several sensor ticks, so a wrong rule would have failed them.
                    time.sleep(GRACE_S + TTL_S + PIN_S + 5)
                    assert _sensor_ticks_since(instance, since) >= 3, "the sensor did not tick"
                    for p in (0, 1):
                        run = instance.get_run_by_id(first[p].run_id)
                        assert run is not None and run.status == DagsterRunStatus.STARTED, (
                            p, run and run.status)
                    (gate / "0").unlink()
                    wait_until("partition 0's live run succeeded", lambda: (
                        instance.get_run_by_id(first[0].run_id).status  # type: ignore[union-attr]
                        == DagsterRunStatus.SUCCESS), 120, home)
                    assert len(partition_runs(instance, "g-0")) == 1

                    # 3. host-a is lost whole: partition 1's run worker dies with it
                    lose_host("host-a")
                    lost_at = time.time()
                    (gate / "1").unlink()  # the retry (on host-b) must not block
                    wait_until("partition 1's lost run marked failed", lambda: (
                        instance.get_run_by_id(first[1].run_id).status  # type: ignore[union-attr]
                        == DagsterRunStatus.FAILURE), 180, home)
                    figures["marked failed after (s)"] = time.time() - lost_at
                    retry = wait_until("partition 1's retry succeeded", lambda: next(
                        (r for r in partition_runs(instance, "g-1")[1:]
                         if r.status == DagsterRunStatus.SUCCESS), None), 180, home)
                    rec = instance.get_run_record_by_id(retry.run_id)
                    assert rec is not None and rec.start_time is not None
                    figures["next run started after (s)"] = rec.start_time - lost_at
                    assert retry.tags["cg/run_worker"].startswith("host-b ")
                    (failure,) = instance.all_logs(first[1].run_id,
                                                   of_type=DagsterEventType.RUN_FAILURE)
                    assert "is lost: no heartbeat" in (failure.message or ""), failure.message
            finally:
                stop_process_group(daemon, 10.0)
                instance.dispose()
        return figures

    figures = await asyncio.to_thread(scenario)
    print(f"lost host: {figures}")
    assert keyed.mismatches(DeltaSink(str(warehouse / "devices")).read(), evs) is None
