"""Test helper: a ``dagster-webserver`` process (no daemon) on a free loopback port, and GraphQL.

Used by the UI tests. The server runs with ``cwd`` = the project root (``workspace.yaml``
loads ``cg_pipelines.definitions`` with ``working_directory: .``), its own ``DAGSTER_HOME``,
default signal handlers restored in the child and its own session; :meth:`DagsterWebserver.stop`
sends SIGTERM to the process group by PID, then SIGKILL after ``stop_timeout_s`` (5 s).
All durations are seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_dagster_home(home: Path, extra_yaml: str = "") -> Path:
    """Create ``home`` with a ``dagster.yaml`` that turns telemetry off; returns ``home``."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n" + extra_yaml)
    return home


def _default_signals() -> None:  # pragma: no cover - runs in the forked child
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def _webserver_binary() -> str:
    exe = Path(sys.executable).parent / "dagster-webserver"
    return str(exe) if exe.exists() else "dagster-webserver"


class DagsterWebserver:
    """``dagster-webserver -w workspace.yaml -h 127.0.0.1 -p <port>`` as a context manager.

    Args:
        dagster_home: the instance directory (``DAGSTER_HOME``).
        log_path: file that receives the server's stdout+stderr.
        port: 0 picks a free port.
        cwd: working directory (default: the project root).
        env: extra environment variables for the child.
        ready_timeout_s: :meth:`start` waits this long for ``/server_info`` to answer.
        stop_timeout_s: :meth:`stop` waits this long after SIGTERM before SIGKILL.
    """

    def __init__(
        self,
        dagster_home: Path,
        log_path: Path,
        *,
        port: int = 0,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 90.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.dagster_home = Path(dagster_home)
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.cwd = Path(cwd) if cwd else PROJECT_ROOT
        self.env = dict(env or {})
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None or self.proc.poll() is not None else self.proc.pid

    def argv(self) -> list[str]:
        return [_webserver_binary(), "-w", "workspace.yaml", "-h", "127.0.0.1",
                "-p", str(self.port)]

    def start(self) -> DagsterWebserver:
        env = {**os.environ, **self.env, "DAGSTER_HOME": str(self.dagster_home)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_default_signals,
                close_fds=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self) -> None:
        """Wait until ``GET /server_info`` answers 200 and the code location has loaded."""
        deadline = time.monotonic() + self.ready_timeout_s
        last = ""
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"dagster-webserver exited with {self.proc.returncode}; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/server_info", timeout=5) as r:
                    if r.status == 200 and self._location_loaded():
                        return
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise TimeoutError(f"dagster-webserver not ready after {self.ready_timeout_s} s "
                                   f"({last}); log tail:\n{self.log_tail()}")
            time.sleep(0.5)

    def _location_loaded(self) -> bool:
        data = self.graphql("""{ workspaceOrError { __typename ... on Workspace {
              locationEntries { name loadStatus } } } }""")
        entries = data["workspaceOrError"].get("locationEntries") or []
        return bool(entries) and all(e["loadStatus"] == "LOADED" for e in entries)

    def graphql(self, query: str, variables: Mapping[str, Any] | None = None,
                timeout_s: float = 30.0) -> dict[str, Any]:
        """POST ``/graphql``; returns ``data`` (raises on GraphQL errors)."""
        return graphql(self.url, query, variables, timeout_s)

    def stop(self) -> None:
        """SIGTERM the process group (by the leader's PID), then SIGKILL after the timeout."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # children left in the session (the code server) die with a SIGKILL to the group
        _signal_group(proc.pid, signal.SIGKILL)
        self.proc = None

    def __enter__(self) -> DagsterWebserver:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the process group led by ``pid`` (started with ``start_new_session``)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def graphql(base_url: str, query: str, variables: Mapping[str, Any] | None = None,
            timeout_s: float = 30.0) -> dict[str, Any]:
    """POST a GraphQL query to ``<base_url>/graphql``; returns ``data``."""
    body = json.dumps({"query": query, "variables": dict(variables or {})}).encode()
    req = urllib.request.Request(base_url + "/graphql", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        payload = json.loads(r.read())
    if payload.get("errors"):
        raise RuntimeError(f"GraphQL errors: {payload['errors']}")
    return payload["data"]


ASSET_PARTITIONS_QUERY = """
query AssetPartitions($key: AssetKeyInput!) {
  assetOrError(assetKey: $key) {
    __typename
    ... on Asset {
      key { path }
      definition {
        partitionKeys
        partitionStats { numMaterialized numPartitions numFailed numMaterializing }
      }
      assetMaterializations(limit: 100) { partition runId timestamp }
    }
    ... on AssetNotFoundError { message }
  }
}
"""


def asset_partitions(base_url: str, asset: str) -> dict[str, Any]:
    """The asset's partition keys, partition stats and materializations (GraphQL)."""
    return graphql(base_url, ASSET_PARTITIONS_QUERY, {"key": {"path": [asset]}})["assetOrError"]
