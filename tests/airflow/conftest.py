"""One real Airflow 3 per test module (a PostgreSQL metadatabase of its own, as in production;
LocalExecutor; its four services), Dags written per test into its Dags folder."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cg_pipelines.local.postgres import PostgresServer
from tests.support.airflow_stack import AirflowStack

START_TIMEOUT_S = 240.0
"""Seconds the four services may take to report healthy (about 60-80 on a loaded 2-core host,
``db migrate`` included)."""


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory,
            postgres_server: PostgresServer) -> Iterator[AirflowStack]:
    """A started Airflow (api-server, scheduler, dag-processor, triggerer) on a new database
    of the session's PostgreSQL server, stopped by PID."""
    root = tmp_path_factory.mktemp("airflow")
    dags = root / "dags"
    dags.mkdir()
    home = root / "home"
    home.mkdir()
    database = f"airflow_{root.name.replace('-', '_')}"
    stack = AirflowStack(home, dags,
                         postgres_server.create_database(database, "postgresql+psycopg2"))
    stack.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not stack.healthy():
            dead = stack.dead()
            assert not dead, f"Airflow service(s) exited {dead}:\n" + "\n".join(
                f"--- {n}\n{stack.log_tail(n)}" for n in dead)
            assert time.monotonic() < deadline, "Airflow not healthy after " \
                f"{START_TIMEOUT_S:g} s:\n" + "\n".join(
                    f"--- {n}\n{stack.log_tail(n, 1500)}" for n in stack.procs)
            time.sleep(0.5)  # poll interval (deadline: START_TIMEOUT_S)
        yield stack
    finally:
        stack.stop()


def write_dag_file(dags: Path, name: str, body: str) -> Path:
    """Write Dag file ``<name>.py`` atomically (the dag-processor never reads half a file)."""
    path = dags / f"{name}.py"
    tmp = dags / f".{name}.tmp"
    tmp.write_text(body)
    os.replace(tmp, path)
    return path
