"""Shared fixtures: ONE real nats-server per test session (JetStream, temp store, loopback) and
moto S3 — the library's own fixtures, :mod:`cg_pipelines.testing.fixtures`, which users' tests
enable the same way — plus per-test NATS connections, unique names and a figures report.

A missing nats-server binary fails the run (the fixture raises): nothing here ever skips.

No process outlives the suite: every process it starts inherits :data:`SESSION_TOKEN_VAR`
(set here at import, before any fixture starts a server), and at the end of the session any
such process still running after a short grace is listed, killed and fails the run.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext

from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.testing.s3 import MotoS3Server
from tests.support.figures import FIGURES
from tests.support.procs import end_gateway_jvm, kill, with_token

pytest_plugins = ["cg_pipelines.testing.fixtures"]

_COUNTER = itertools.count()

SESSION_TOKEN_VAR = "CG_TEST_SESSION_TOKEN"
"""Environment variable every process the suite starts inherits (one token per session)."""
_SESSION_TOKEN = os.environ.setdefault(SESSION_TOKEN_VAR, uuid.uuid4().hex)
# ``import airflow`` writes $AIRFLOW_HOME/airflow.cfg and logs/ (default ~/airflow): tests that
# import cg_pipelines.airflow (or walk the package) use a throwaway home instead, made by the
# controlling process (xdist workers inherit it) and removed at the end of its session.
_AIRFLOW_HOME_MADE = None if "AIRFLOW_HOME" in os.environ else tempfile.mkdtemp(
    prefix="cg-airflow-home-")
if _AIRFLOW_HOME_MADE is not None:
    os.environ["AIRFLOW_HOME"] = _AIRFLOW_HOME_MADE
LEFTOVER_GRACE_S = 10.0
"""Seconds a process may take to exit after the session's fixtures stopped it."""
_LEFTOVERS: list[str] = []


@pytest_asyncio.fixture(loop_scope="session")
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A nats-py connection to the session's server, closed after the test."""
    conn = await nats.connect(nats_server.url, connect_timeout=5, max_reconnect_attempts=2)
    try:
        yield conn
    finally:
        await conn.close()


@pytest_asyncio.fixture(loop_scope="session")
async def js(nc: Client) -> JetStreamContext:
    """A JetStream context on :func:`nc`."""
    return nc.jetstream(timeout=5)


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A short name unique in this session (streams and groups share one server)."""
    base = "".join(c for c in request.node.name.split("[")[0] if c.isalnum())[-16:]
    return f"T{os.getpid() % 1000}{next(_COUNTER)}{base}"


@dataclass(frozen=True)
class MotoBucket:
    server: MotoS3Server
    bucket: str
    options: dict[str, str]


@pytest.fixture
def moto_s3(moto_server: MotoS3Server, unique_name: str) -> MotoBucket:
    """A fresh bucket on the session's moto server, with delta-rs storage options."""
    name = unique_name.lower()[:40]
    moto_server.create_bucket(name)
    return MotoBucket(moto_server, name, moto_server.storage_options())


@pytest.fixture
def report() -> list[str]:
    """Lines appended here are printed in the terminal summary ("cg_pipelines figures")."""
    return FIGURES


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own (also trylast) has ended its workers
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process it started is still running (after every fixture's teardown
    and a grace of :data:`LEFTOVER_GRACE_S`); kill such processes so none outlives the run;
    remove the throwaway ``AIRFLOW_HOME``. Only in the controlling process (``xdist`` workers
    share its token and home and report there)."""
    end_gateway_jvm()  # a test's in-process Spark (the Spark fixture ends it too)
    if hasattr(session.config, "workerinput"):  # an xdist worker: its figures to the controller
        session.config.workeroutput["cg_figures"] = list(FIGURES)  # type: ignore[attr-defined]
        return
    if _AIRFLOW_HOME_MADE is not None:
        shutil.rmtree(_AIRFLOW_HOME_MADE, ignore_errors=True)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := with_token(SESSION_TOKEN_VAR, _SESSION_TOKEN)) and time.monotonic() < deadline:
        time.sleep(0.5)  # poll interval (deadline: LEFTOVER_GRACE_S)
    # Dagster's compute-log capture tails a run's log files with `tail -F`; when a test kills a
    # run worker with SIGKILL, Dagster's own watcher ends those tails on its next poll, which a
    # loaded machine can push past the grace: killed here, not counted as ours.
    tails = [(pid, cmd) for pid, cmd in left
             if cmd.startswith("tail -F ") and "/compute_logs/" in cmd]
    kill([pid for pid, _ in tails], signal.SIGKILL)
    left = [p for p in left if p not in tails]
    if left:
        _LEFTOVERS.extend(f"{pid} {cmd}" for pid, cmd in left)
        kill([pid for pid, _ in left], signal.SIGKILL)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist: a worker ended; keep the figures it collected."""
    FIGURES.extend(getattr(node, "workeroutput", {}).get("cg_figures", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LEFTOVERS:
        terminalreporter.section("processes left running by the suite (killed; the run fails)")
        for line in _LEFTOVERS:
            terminalreporter.write_line(line)
    if FIGURES:
        terminalreporter.section("cg_pipelines figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
