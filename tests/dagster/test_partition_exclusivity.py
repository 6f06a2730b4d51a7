"""Two runs of one partition never process at once, however they were launched: here one through
the asset job (what sensors, schedules and job backfills launch) and one through the implicit
asset job in the calling process (what ``dagster asset materialize --partition`` and UI
materializations run), started together against one persistent Dagster instance. The later one
waits for the earlier one before it touches NATS; both succeed; the table equals the reference.
A run of another partition does not wait."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from dagster import (
    DagsterInstance,
    DagsterRunStatus,
    ExecuteInProcessResult,
    RunsFilter,
    materialize,
)
from dagster._core.instance.methods.event_methods import EventMethods
from nats.js import JetStreamContext

from cg_pipelines.dagster import (
    ConsumerGroupAsset,
    PartitionRunsResource,
    build_definitions,
    build_group_definitions,
)
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import ASSET, GROUP, JOB, PARTITIONS, make_resources, pkey
from tests.support import keyed


def slow_transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    time.sleep(0.4)  # long enough that the two runs would overlap
    return keyed.transform(table, ctx)


def _persistent_instance(tmp_path: Path) -> DagsterInstance:
    home = tmp_path / "home"
    home.mkdir()
    # No compute log capture: Dagster's local compute log manager mirrors each step's output
    # with a `tail -F` process per stream, and in-process runs on threads side by side
    # redirect the same file descriptors, which left those processes running after the test.
    (home / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\n"
        "compute_logs:\n  module: dagster._core.storage.noop_compute_log_manager\n"
        "  class: NoOpComputeLogManager\n")
    return DagsterInstance.from_config(str(home))


async def test_two_runs_of_one_partition_do_not_overlap(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Dagster 1.13 builds each run's log handlers with logging.config.dictConfig (even with no
    # python_logs configured), which takes the logging module lock and then every handler's
    # lock, while another thread's event handler holds its own lock and asks for the module
    # lock (sqlalchemy's getLogger): threads running in-process runs side by side can
    # deadlock. Production runs are processes; here this instance has no yaml handlers, so
    # skipping that call changes nothing else.
    monkeypatch.setattr(EventMethods, "get_yaml_python_handlers", lambda self: [])
    stream = unique_name
    await h.create_group(js, stream)
    evs = h.events_on({1, 2}, n_keys=40, n_events=300)
    await h.publish(js, stream, evs, len(evs))
    spec = ConsumerGroupAsset(name=ASSET, stream=stream, group=GROUP, partitions=PARTITIONS,
                              processor=ArrowProcessor(keyed.DECODER, slow_transform,
                                                       state=keyed.STATE))
    resources = make_resources(nats_server.url, warehouse)
    # (a new resource: model_copy of a Dagster resource keeps its original config)
    resources["partition_runs"] = PartitionRunsResource(
        ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=3, batch_max_msgs=20,
        adaptive_max_msgs=None)
    defs = build_definitions([spec], resources=resources)
    job = defs.resolve_job_def(JOB)
    asset = build_group_definitions(spec).asset
    results: dict[str, ExecuteInProcessResult] = {}

    with _persistent_instance(tmp_path) as instance:
        def via_job() -> None:
            results["job"] = job.execute_in_process(partition_key=pkey(1), instance=instance)

        def via_materialize() -> None:
            results["materialize"] = materialize([asset], partition_key=pkey(1),
                                                 instance=instance, resources=resources)

        def other_partition() -> None:
            results["other"] = job.execute_in_process(partition_key=pkey(2), instance=instance)

        threads = [threading.Thread(target=f) for f in (via_job, via_materialize)]
        threads[0].start()
        # the job run starts first (waiting for it to be STARTED, not a fixed delay: creating
        # a run writes its planned materialization and check events, slow on a busy machine)
        deadline = time.monotonic() + 60
        while not instance.get_run_records(RunsFilter(
                tags={"dagster/partition": pkey(1)}, statuses=[DagsterRunStatus.STARTED])):
            assert time.monotonic() < deadline, "the job run did not start"
            time.sleep(0.05)
        threads[1].start()
        other = threading.Thread(target=other_partition)
        other.start()
        await asyncio.to_thread(lambda: [t.join(120) for t in [*threads, other]])

        assert all(r.success for r in results.values()), results
        md = {name: {k: v.value for k, v in
                     r.asset_materializations_for_node(ASSET)[0].metadata.items()}
              for name, r in results.items()}
        first, second = md["job"], md["materialize"]
        # the materialization waited for the job's run, which had started first ...
        assert second["waited_for_runs"] == results["job"].run_id
        assert first["waited_for_runs"] == ""
        # ... so it found the partition drained: every event of partition 1 was processed once,
        # by the first run
        mine = [e for e in evs if h.partition_of(e[0]) == 1]
        assert (first["status"], first["messages"]) == ("drained", len(mine))
        assert (second["status"], second["messages"]) == ("empty", 0)
        # the second run's engine work began after the first run had ended
        r1 = instance.get_run_record_by_id(results["job"].run_id)
        r2 = instance.get_run_record_by_id(results["materialize"].run_id)
        assert r1 is not None and r2 is not None and r1.end_time is not None
        assert r2.end_time is not None and r2.end_time > r1.end_time
        # another partition ran alongside without waiting
        assert md["other"]["waited_for_runs"] == "" and md["other"]["status"] == "drained"
        for name in ("job", "materialize"):
            assert results[name].dagster_run.tags["dagster/partition"] == pkey(1)
    h.assert_table_equals_reference(warehouse, evs)
