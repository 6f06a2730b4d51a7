"""A local Airflow 3 for the main job (``python -m mainjob --orchestrator airflow``): ``airflow
db migrate`` on SQLite, then ``api-server``, ``scheduler``, ``dag-processor`` and ``triggerer``
with the LocalExecutor, all under ``home`` (logs in ``home/<service>.log``), read over the REST
API, and stopped by process group.

What a user trying Airflow on one machine gets: a SQLite metadatabase, the simple auth
manager's "all admins" mode (no login), Dags unpaused when created, no example Dags. The
api-server and both log servers (worker, triggerer) take free ports, so this runs beside
another Airflow. Each service runs in a session of its own; a task process Airflow starts
takes a process group of its own (with the Spark JVM it starts), so :meth:`stop` also signals
every descendant it finds. Durations are seconds.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psutil

AIRFLOW = str(Path(sys.executable).with_name("airflow"))
SERVICES = ("api-server", "scheduler", "dag-processor", "triggerer")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AirflowServices:
    """Airflow's four services over ``home`` (created), Dags from ``dags``, at most
    ``parallelism`` task processes at a time; ``pythonpath``: where the Dag files' imports
    are."""

    def __init__(self, home: Path, dags: Path, pythonpath: Path, parallelism: int) -> None:
        self.home, self.dags = home, dags
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "AIRFLOW_HOME": str(home),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(pythonpath),
                                                        os.environ.get("PYTHONPATH")])),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(parallelism),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__BASE_URL": self.base,
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            # a new Dag file is seen within 2 s; a parsed one is parsed again after 60 s
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "2",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "60",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.error: str | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- processes -------------------------------------------------------------------------

    def start(self) -> AirflowServices:
        """Migrate the database and start the services, in a thread (start-up overlaps what
        the caller does next; :meth:`wait_healthy` waits for it)."""
        self.home.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._start, name="airflow-start", daemon=True)
        self._thread.start()
        return self

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes] | None:
        """Start ``airflow <args>`` in a session of its own, output to ``<home>/<name>.log``
        (``None`` once stopping). No ``preexec_fn``: without one Python starts the child with
        vfork and exec, and no fork handler runs in it (with one, a fork while the Spark
        Connect warm-up's gRPC threads ran aborted the child: "epoll_wait error: Bad file
        descriptor", exit -6). Signal handlers are reset by exec."""
        with self._lock:
            if self._stopping:
                return None
            with open(self.home / f"{name}.log", "ab") as log:
                proc = subprocess.Popen([AIRFLOW, *args], env=self.env, cwd=self.home,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs[name] = proc
            return proc

    def _start(self) -> None:
        migrate = self._spawn("db-migrate", ["db", "migrate"])
        if migrate is None or migrate.wait() != 0:
            self.error = f"airflow db migrate failed:\n{self.log_tail('db-migrate')}"
            return
        for name in SERVICES:
            self._spawn(name, [name])

    def dead(self) -> dict[str, int]:
        """Services that exited: ``{name: exit code}`` (``db migrate`` is not a service)."""
        return {n: p.returncode for n, p in self.procs.items()
                if n in SERVICES and p.poll() is not None}

    def log_tail(self, name: str, chars: int = 2000) -> str:
        """The end of ``name``'s log (a service, or ``db-migrate``)."""
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def logs_tail(self, chars: int = 1500) -> str:
        """The end of every service's log, one after another."""
        return "\n".join(f"--- {n} ({self.home / (n + '.log')})\n{self.log_tail(n, chars)}"
                         for n in self.procs)

    def check(self) -> None:
        """Raise ``RuntimeError`` (with the logs' tails) if start-up failed or a service
        exited."""
        if self.error is not None:
            raise RuntimeError(self.error)
        dead = self.dead()
        if dead:
            raise RuntimeError(f"Airflow service(s) exited {dead}:\n{self.logs_tail()}")

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until the api-server reports the metadatabase, scheduler, triggerer and
        dag-processor healthy.

        Raises:
            RuntimeError: start-up failed, a service exited, or not healthy in
                ``timeout_s`` seconds (the logs' tails in the message).
        """
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"Airflow not healthy after {timeout_s:g} s:\n"
                                   f"{self.logs_tail()}")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every process group started here and every descendant's group, SIGKILL
        whatever is left after ``timeout_s``."""
        with self._lock:
            self._stopping = True
        procs = list(self.procs.values())
        found: dict[int, psutil.Process] = {}
        for p in procs:
            try:
                for c in psutil.Process(p.pid).children(recursive=True):
                    found[c.pid] = c
            except psutil.Error:
                pass
        groups = {p.pid for p in procs if p.poll() is None}
        for c in found.values():
            try:
                groups.add(os.getpgid(c.pid))
            except OSError:
                pass
        groups.discard(os.getpgid(0))  # never this process's own group
        _signal_groups(groups, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        psutil.wait_procs(list(found.values()), timeout=max(0.1, deadline - time.monotonic()))
        _signal_groups(groups, signal.SIGKILL)
        for c in found.values():
            try:
                c.kill()
            except psutil.Error:
                pass
        for p in procs:
            if p.poll() is None:
                p.wait(10)

    # -- REST ------------------------------------------------------------------------------

    def api(self, path: str, timeout_s: float = 30.0) -> Any:
        """``GET /api/v2<path>``; the decoded JSON (``None`` on HTTP 404)."""
        try:
            with urllib.request.urlopen(f"{self.base}/api/v2{path}", timeout=timeout_s) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise RuntimeError(f"GET {path}: HTTP {e.code}: "
                               f"{e.read().decode(errors='replace')[:1000]}") from None

    def healthy(self) -> bool:
        """Whether every component reports healthy."""
        try:
            h = self.api("/monitor/health", timeout_s=5) or {}
        except (OSError, RuntimeError):
            return False
        return all((h.get(k) or {}).get("status") == "healthy"
                   for k in ("metadatabase", "scheduler", "triggerer", "dag_processor"))

    def dag_runs(self, dag_id: str) -> list[dict[str, Any]]:
        """The runs of ``dag_id``, oldest first (none before the Dag is parsed)."""
        got = self.api(f"/dags/{dag_id}/dagRuns?limit=100&order_by=id")
        return list(got["dag_runs"]) if got else []

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        """``{task_id: state}`` of one run."""
        quoted = urllib.parse.quote(run_id, safe="")
        got = self.api(f"/dags/{dag_id}/dagRuns/{quoted}/taskInstances?limit=100") or {}
        return {t["task_id"]: t["state"] for t in got.get("task_instances", [])}


def _signal_groups(groups: set[int], sig: signal.Signals) -> None:
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass
