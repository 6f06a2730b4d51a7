"""A real backfill through the ``dagster job backfill`` CLI: one run per selected partition,
launched by the DefaultRunCoordinator (no daemon) in run-worker subprocesses against the
session's nats-server; the Delta table then equals the pandas reference for every event."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus
from nats.js import JetStreamContext

from assets.factory import PARTITION_TAG
from cg_pipelines.devserver import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import GROUP, JOB, PARTITIONS
from tests.support import keyed

ROOT = Path(__file__).resolve().parents[2]
DAGSTER = str(Path(sys.executable).with_name("dagster"))
DAGSTER_YAML = """\
run_coordinator:
  module: dagster._core.run_coordinator
  class: DefaultRunCoordinator
telemetry:
  enabled: false
"""
FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """Kill what is left of the CLI's process group (its gRPC server and run workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _wait_runs(home: Path, n: int, timeout_s: float) -> list[DagsterRun]:
    deadline = time.monotonic() + timeout_s
    with DagsterInstance.from_config(str(home)) as instance:
        while True:
            runs = instance.get_runs()
            if len(runs) >= n and all(r.status in FINISHED for r in runs):
                return list(runs)
            if time.monotonic() > deadline:
                raise AssertionError(f"runs not finished after {timeout_s} s: "
                                     f"{[(r.run_id, r.status) for r in runs]}")
            time.sleep(0.25)


def _backfill(home: Path, env: dict[str, str]) -> list[DagsterRun]:
    """Run the CLI (its code server and run workers outlive it, in its process group), then
    wait for the runs."""
    cmd = [DAGSTER, "job", "backfill", "-f", "tests/dagster/backfill_location.py",
           "-d", str(ROOT), "-j", JOB, "--partitions",
           ",".join(str(p) for p in range(PARTITIONS)), "--noprompt"]
    log = home / "cli.log"
    with log.open("w") as out:  # a file, not a pipe: the children keep the CLI's stdout open
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(timeout=60)
        text = log.read_text()
        assert proc.returncode == 0, text
        assert "Launched backfill job" in text, text
        return _wait_runs(home, PARTITIONS, 60)
    finally:
        _stop_group(proc)


async def test_cli_backfill_runs_every_partition(js: JetStreamContext, nats_server: NatsServer,
                                                 unique_name: str, warehouse: str,
                                                 tmp_path: Path) -> None:
    stream = unique_name
    await h.create_group(js, stream, members=("m1", "m2"))
    evs = keyed.events(n_keys=30, n_events=600)
    assert {h.partition_of(k) for k, _ in evs} == set(range(PARTITIONS))
    await h.publish(js, stream, evs, len(evs))

    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    env = {**os.environ, "DAGSTER_HOME": str(home), "CG_TEST_STREAM": stream,
           "NATS_URL": nats_server.url, "CG_WAREHOUSE": warehouse}
    env.pop("CG_MEMBERS", None)

    t0 = time.perf_counter()
    runs = await asyncio.to_thread(_backfill, home, env)
    print(f"backfill of {PARTITIONS} partitions: {time.perf_counter() - t0:.1f} s")

    assert len(runs) == PARTITIONS
    assert sorted(r.tags["dagster/partition"] for r in runs) == [str(p) for p in
                                                                  range(PARTITIONS)]
    for r in runs:
        assert r.job_name == JOB
        assert r.status == DagsterRunStatus.SUCCESS, r
        assert "dagster/backfill" in r.tags
        assert r.tags[PARTITION_TAG] == f"{stream}/{GROUP}/{r.tags['dagster/partition']}"
    assert len({r.tags["dagster/backfill"] for r in runs}) == 1
    h.assert_table_equals_reference(warehouse, evs)
    await h.assert_work_queue_empty(js, stream)
