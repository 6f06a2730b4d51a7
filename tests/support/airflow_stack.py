"""Test helper: a real Airflow 3 (``db migrate``, then ``api-server``, ``scheduler``,
``dag-processor`` and ``triggerer``) on a temp ``AIRFLOW_HOME``, a Postgres database and a free
loopback port, driven over its REST API; stopped by PID.

Every process runs in its own session (``start_new_session=True``), so :meth:`AirflowStack.stop`
ends each one's process group (the LocalExecutor's workers and their task processes with it):
SIGTERM, then SIGKILL after ``stop_timeout_s``. The simple auth manager's "all admins" mode
makes every request an admin's (no credentials in tests). Durations are seconds.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cg_pipelines.local.spawn import with_default_signals
from tests.support.dagster_dev import PROJECT_ROOT, free_port

AIRFLOW = str(Path(sys.executable).with_name("airflow"))
SERVICES = ("api-server", "scheduler", "dag-processor", "triggerer")


class AirflowStack:
    """Airflow's four services over ``home`` (logs in ``home/*.log``), Dags from ``dags``.

    Args:
        home: ``AIRFLOW_HOME`` (created).
        dags: the Dags folder.
        db_url: SQLAlchemy URL of an empty database (``postgresql+psycopg2://...``).
        extra_env: more environment (``AIRFLOW__SECTION__KEY`` settings ...).
    """

    def __init__(self, home: Path, dags: Path, db_url: str,
                 extra_env: Mapping[str, str] | None = None, stop_timeout_s: float = 10.0
                 ) -> None:
        self.home, self.dags, self.stop_timeout_s = home, dags, stop_timeout_s
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        home.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "AIRFLOW_HOME": str(home),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT),
                                                        os.environ.get("PYTHONPATH")])),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__BASE_URL": self.base,
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "60",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "60",
            "AIRFLOW__TRIGGERER__CAPACITY": "50",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            **(extra_env or {}),
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- processes ---------------------------------------------------------------------------

    def migrate(self, timeout_s: float = 300.0) -> None:
        """``airflow db migrate``.

        Raises:
            AssertionError: it failed (its output's tail in the message).
        """
        r = subprocess.run([AIRFLOW, "db", "migrate"], env=self.env, cwd=self.home,
                           capture_output=True, text=True, timeout=timeout_s)
        assert r.returncode == 0, f"airflow db migrate failed:\n{(r.stdout + r.stderr)[-3000:]}"

    def cli(self, *args: str, timeout_s: float = 300.0) -> str:
        """Run ``airflow <args>`` against this stack; its output.

        Raises:
            AssertionError: it failed (its output's tail in the message).
        """
        r = subprocess.run([AIRFLOW, *args], env=self.env, cwd=self.home, capture_output=True,
                           text=True, timeout=timeout_s)
        assert r.returncode == 0, f"airflow {' '.join(args)} failed:\n" \
                                  f"{(r.stdout + r.stderr)[-3000:]}"
        return r.stdout

    def start(self) -> AirflowStack:
        """Migrate the database, then start the four services (in the background)."""
        self.migrate()
        for name in SERVICES:
            log = open(self.home / f"{name}.log", "ab")  # the child keeps its own copy
            try:
                self.procs[name] = subprocess.Popen(
                    with_default_signals([AIRFLOW, name]), env=self.env, cwd=self.home,
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True)
            finally:
                log.close()
        return self

    def dead(self) -> dict[str, int]:
        """Services that exited: ``{name: exit code}``."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of service ``name``'s log."""
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        """SIGTERM every service's process group, SIGKILL after ``stop_timeout_s``."""
        for p in self.procs.values():
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p.pid, signal.SIGKILL)  # the group's leftovers (task processes)
            if p.poll() is None:
                p.wait(10)

    def __enter__(self) -> AirflowStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- REST ----------------------------------------------------------------------------------

    def api(self, method: str, path: str, body: Any = None, timeout_s: float = 30.0) -> Any:
        """``method`` ``/api/v2<path>`` with a JSON ``body``; the decoded JSON answer.

        Raises:
            AssertionError: an HTTP error (status and body in the message).
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base}/api/v2{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise HttpError(e.code, f"{method} {path}: HTTP {e.code}: "
                            f"{e.read().decode(errors='replace')[:2000]}") from None
        return json.loads(raw) if raw else None

    def healthy(self) -> bool:
        """Whether the api-server answers and reports the metadatabase, scheduler, triggerer
        and dag-processor healthy."""
        try:
            h = self.api("GET", "/monitor/health", timeout_s=5)
        except (OSError, AssertionError):
            return False
        return all((h.get(k) or {}).get("status") == "healthy"
                   for k in ("metadatabase", "scheduler", "triggerer", "dag_processor"))

    def dag_runs(self, dag_id: str) -> list[dict[str, Any]]:
        """Every run of ``dag_id`` (oldest first); none while the Dag is not parsed yet."""
        try:
            got = self.api("GET", f"/dags/{dag_id}/dagRuns?limit=100&order_by=id")
        except HttpError as e:
            if e.status == 404:
                return []
            raise
        return list(got["dag_runs"])

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        """The task instances of one run."""
        quoted = urllib.request.quote(run_id, safe="")
        got = self.api("GET", f"/dags/{dag_id}/dagRuns/{quoted}/taskInstances?limit=100")
        return list(got["task_instances"])

    def tries(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        """Every try of one task instance (oldest first)."""
        quoted = urllib.request.quote(run_id, safe="")
        got = self.api("GET", f"/dags/{dag_id}/dagRuns/{quoted}/taskInstances/{task_id}/tries")
        return sorted(got["task_instances"], key=lambda t: t["try_number"])

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """One try's task log, as text (one JSON record a line)."""
        quoted = urllib.request.quote(run_id, safe="")
        got = self.api("GET", f"/dags/{dag_id}/dagRuns/{quoted}/taskInstances/{task_id}/logs/"
                              f"{try_number}?full_content=true")
        content = got.get("content") if isinstance(got, dict) else got
        return "\n".join(json.dumps(c) if not isinstance(c, str) else c
                         for c in (content or []))

    def asset_events(self, name: str) -> list[dict[str, Any]]:
        """The events of asset ``name`` (oldest first)."""
        assets = self.api("GET", f"/assets?name_pattern={urllib.request.quote(name)}")["assets"]
        ids = [a["id"] for a in assets if a["name"] == name]
        if not ids:
            return []
        got = self.api("GET", f"/assets/events?asset_id={ids[0]}&limit=100&order_by=timestamp")
        return list(got["asset_events"])


class HttpError(AssertionError):
    """An HTTP error answer of the api-server: ``status`` and the text."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
