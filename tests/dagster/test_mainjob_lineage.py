"""The main job's Delta table says where each version came from: ``python -m mainjob`` on a
2,000-flight slice (real nats-server, Dagster runs, local Spark, Delta), then
``DeltaTable.history()`` of its table shows, on every version the runs wrote, the stream,
group, partition, first and last sequence, the Dagster run id and the library version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable

from cg_pipelines import __version__
from cg_pipelines.local.spawn import with_default_signals
from tests.support.dagster_dev import stop_process_group

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 2000
TIMEOUT_S = 420.0  # about 40 s on an idle 2-core machine


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def test_main_job_history_shows_lineage(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("CG_") or (k.startswith("NATS_") and k != "NATS_SERVER_BIN")
                   or k == "DAGSTER_HOME")}
    env.update({"CG_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1",
                "CG_BATCH_MAX_MSGS": "100", "CG_ADAPTIVE_MAX_MSGS": "0"})
    log_path = tmp_path / "mainjob.log"
    # Output to a file, the job in its own process group: a child left behind (nats-server,
    # Spark's JVM) can neither hold a pipe open nor outlive the test.
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            with_default_signals([sys.executable, "-m", "mainjob", "--limit", str(LIMIT)]),
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, 20.0, first=signal.SIGINT)
            pytest.fail(f"main job still running after {TIMEOUT_S:g} s:\n{_tail(log_path)}")
        finally:
            stop_process_group(proc, 5.0)
    assert rc == 0, _tail(log_path)
    table = tmp_path / "state" / "mainjob" / "warehouse" / "aircraft_legs"
    hist = DeltaTable(str(table)).history()
    writes = [h for h in hist if h["operation"] in ("WRITE", "MERGE")]
    assert len(writes) >= 8  # at least one commit per partition
    partitions = set()
    runs = set()
    for h in writes:
        assert h["cg.stream"] == "flights" and h["cg.group"] == "legs", h
        assert 1 <= int(h["cg.first_seq"]) <= int(h["cg.last_seq"]) <= LIMIT
        assert h["cg.watermark"] == h["cg.last_seq"]
        assert h["cg.library_version"] == __version__
        assert h["cg.dagster_run_id"]
        partitions.add(int(h["cg.partition"]))
        runs.add(h["cg.dagster_run_id"])
    assert partitions == set(range(8))
    assert len(runs) >= 8  # one Dagster run per partition
    # the batches of one partition tile its sequence range without gaps or overlaps
    for p in partitions:
        spans = sorted((int(h["cg.first_seq"]), int(h["cg.last_seq"]))
                       for h in writes if h["cg.partition"] == str(p))
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
