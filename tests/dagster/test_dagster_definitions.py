"""The code locations load: in-process (``Definitions.validate_loadable``) and through the
``dagster definitions validate`` CLI with no NATS server reachable (nothing connects to NATS at
import or load time)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from dagster import Definitions

from tests.dagster.defs_keyed import (
    ASSET,
    BACKLOG_SENSOR,
    DRAIN_SCHEDULE,
    JOB,
    MEMBERSHIP_SENSOR,
    PARTITIONS,
    make_defs,
    pkey,
)

ROOT = Path(__file__).resolve().parents[2]
DAGSTER = str(Path(sys.executable).with_name("dagster"))


def _closed_port_url() -> str:
    """A loopback URL where nothing listens (a port just released by the kernel)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"nats://127.0.0.1:{port}"


def test_project_definitions_load() -> None:
    from definitions import defs

    Definitions.validate_loadable(defs)
    job = defs.resolve_job_def("aircraft_legs_job")
    assert job.partitions_def is not None
    assert job.partitions_def.get_partition_keys() == [f"legs-{p}" for p in range(8)]
    assert {s.name for s in defs.sensors or []} == {"aircraft_legs_membership",
                                                     "aircraft_legs_backlog",
                                                     "aircraft_legs_run_retention"}


def test_test_definitions_load(tmp_path: Path) -> None:
    defs = make_defs("S", _closed_port_url(), str(tmp_path / "wh"))
    Definitions.validate_loadable(defs)
    job = defs.resolve_job_def(JOB)
    assert job.partitions_def is not None
    assert job.partitions_def.get_partition_keys() == [pkey(p) for p in range(PARTITIONS)]
    # every run of a partition carries dagster/partition = the group-qualified key, the tag the
    # instance's run-concurrency limit keys on
    assert job.get_tags_for_partition_key(pkey(2), None)["dagster/partition"] == "g-2"
    defs.resolve_sensor_def(MEMBERSHIP_SENSOR)
    defs.resolve_sensor_def(BACKLOG_SENSOR)
    assert defs.resolve_schedule_def(DRAIN_SCHEDULE).job_name == JOB
    asset = defs.resolve_assets_def(ASSET)
    assert {k.name for k in asset.check_keys} == {"backlog_drained",
                                                  "no_unexplained_fence_conflicts",
                                                  "no_new_dead_letters"}
    # partitioned like the asset (Dagster 1.13); no Dagster FreshnessPolicy (per asset, on the
    # last materialization: an idle drained group would read stale): a partition's freshness
    # is lag_within_objective, which each drain and rebuild run evaluates after its
    # materialization (issue 40); the other operational checks are the sensor's
    assert all(s.partitions_def == asset.partitions_def for s in asset.check_specs)
    assert asset.specs_by_key[asset.key].freshness_policy is None
    for name in (JOB, f"{ASSET}_rebuild"):
        assert sorted(n.name for n in defs.resolve_job_def(name).nodes) == [
            ASSET, f"{ASSET}_lag_within_objective"]


def test_cli_validate_without_nats(tmp_path: Path) -> None:
    """``dagster definitions validate`` for workspace.yaml and for the test location, in
    parallel, with NATS_URL pointing at a closed port."""
    env = {**os.environ, "NATS_URL": _closed_port_url(), "CG_STATE_DIR": str(tmp_path / "state"),
           "CG_TEST_STREAM": "S", "CG_WAREHOUSE": str(tmp_path / "wh")}
    commands = {
        "workspace": [DAGSTER, "definitions", "validate", "-w", "workspace.yaml"],
        "test location": [DAGSTER, "definitions", "validate", "-f",
                          "tests/dagster/backfill_location.py", "-d", str(ROOT)],
    }
    procs = {}
    for i, (name, cmd) in enumerate(commands.items()):
        home = tmp_path / f"home{i}"  # one each: two CLIs must not create one SQLite store
        home.mkdir()
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env={**env, "DAGSTER_HOME": str(home)},
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    outputs = {}
    try:
        for name, proc in procs.items():
            outputs[name] = proc.communicate(timeout=90)[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name]}"
        assert "All code locations passed validation" in outputs[name], outputs[name]
    assert not (tmp_path / "state").exists()  # loading wrote nothing
