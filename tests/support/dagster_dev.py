"""Test helper: a ``dagster-webserver`` process (no daemon) on a free loopback port, GraphQL
queries against it, and stopping process groups by PID.

The server runs with ``cwd`` = the project root (``workspace.yaml`` loads
``definitions`` with ``working_directory: .``), its own ``DAGSTER_HOME``, default
signal handlers restored in the child and its own session (``start_new_session=True``);
:meth:`DagsterWebserver.stop` sends SIGTERM to the process group by the leader's PID, then
SIGKILL after ``stop_timeout_s`` (5 s). All durations are seconds.
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

import yaml

from cg_pipelines.local.spawn import with_default_signals
from tests.support.procs import listening

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def configure_dagster_home(home: Path) -> Path:
    """Create ``home`` and set, in its ``dagster.yaml`` (kept otherwise), ``telemetry.enabled``
    and ``nux.enabled`` to false.

    ``nux`` off keeps the "Join the Dagster community" dialog, which the UI opens on
    ``http://127.0.0.1`` / ``localhost`` origins, from covering the page. Returns ``home``.
    """
    home.mkdir(parents=True, exist_ok=True)
    path = home / "dagster.yaml"
    config = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
    config.setdefault("telemetry", {})["enabled"] = False
    config.setdefault("nux", {})["enabled"] = False
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return home


def stop_process_group(proc: subprocess.Popen[bytes], timeout_s: float = 5.0,
                       first: signal.Signals = signal.SIGTERM) -> None:
    """Stop a process started with ``start_new_session=True``, and its group, by PID.

    Sends ``first`` (SIGTERM) to the group whose id is the leader's PID, waits ``timeout_s``,
    then SIGKILLs the group; finally SIGKILLs any member still in the group (e.g. the code
    server the webserver spawned). Never signals a bare PID that ``proc`` has already reaped.
    """
    if proc.poll() is None:
        _killpg(proc, first)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _killpg(proc, signal.SIGKILL)
            proc.wait(timeout=10)
    try:  # the group id stays valid while any member lives
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.send_signal(sig)


def _webserver_binary() -> str:
    exe = Path(sys.executable).parent / "dagster-webserver"
    return str(exe) if exe.exists() else "dagster-webserver"


class PortTaken(RuntimeError):
    """The web server exited at start: its port was taken by another process."""


class DagsterWebserver:
    """``dagster-webserver -w workspace.yaml -h 127.0.0.1 -p <port>`` as a context manager.

    Args:
        dagster_home: the instance directory (``DAGSTER_HOME``).
        log_path: file that receives the server's stdout+stderr.
        port: 0 picks a free port.
        cwd: working directory (default: the project root).
        env: the child's environment (default ``os.environ``); ``DAGSTER_HOME`` is set on top.
        ready_timeout_s: :meth:`start` waits this long for the server and the code location.
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
        self._auto_port = not port
        self.port = port or free_port()
        self.cwd = Path(cwd) if cwd else PROJECT_ROOT
        self.env = dict(os.environ if env is None else env)
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
        """Launch the server and wait until it answers on its own port and the code location
        is loaded. A port picked here (``port=0``) that another process took before the
        server bound it is replaced by another, up to 3 times."""
        env = {**self.env, "DAGSTER_HOME": str(self.dagster_home)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(3 if self._auto_port else 1):
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    with_default_signals(self.argv()), cwd=self.cwd, env=env,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, close_fds=True)
            try:
                self.wait_ready()
                return self
            except PortTaken:
                self.stop()
                if attempt == 2 or not self._auto_port:
                    raise
                self.port = free_port()
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self) -> None:
        """Wait until ``GET /server_info`` answers 200 and every code location is LOADED."""
        deadline = time.monotonic() + self.ready_timeout_s
        last = ""
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                tail = self.log_tail()
                error = PortTaken if "address already in use" in tail.lower() else RuntimeError
                raise error(f"dagster-webserver exited with {self.proc.returncode}; "
                            f"log tail:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/server_info", timeout=5) as r:
                    if r.status == 200 and self._locations_loaded():
                        if listening(self.proc.pid, self.port):
                            return
                        last = f"port {self.port} answered, but not by this server"
                    else:
                        last = "code location not loaded yet"
            except (urllib.error.URLError, OSError, ValueError, RuntimeError) as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise TimeoutError(f"dagster-webserver not ready after {self.ready_timeout_s} s "
                                   f"({last}); log tail:\n{self.log_tail()}")
            time.sleep(0.5)  # poll interval (deadline above)

    def _locations_loaded(self) -> bool:
        data = self.graphql("""{ workspaceOrError { __typename ... on Workspace {
              locationEntries { name loadStatus } } } }""")
        entries = data["workspaceOrError"].get("locationEntries") or []
        return bool(entries) and all(e["loadStatus"] == "LOADED" for e in entries)

    def graphql(self, query: str, variables: Mapping[str, Any] | None = None,
                timeout_s: float = 30.0) -> dict[str, Any]:
        """POST ``/graphql``; returns ``data`` (raises on GraphQL errors)."""
        return graphql(self.url, query, variables, timeout_s)

    def stop(self) -> None:
        """SIGTERM the process group (led by the server's PID), SIGKILL after the timeout."""
        if self.proc is not None:
            stop_process_group(self.proc, self.stop_timeout_s)
            self.proc = None

    def __enter__(self) -> DagsterWebserver:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def graphql(base_url: str, query: str, variables: Mapping[str, Any] | None = None,
            timeout_s: float = 30.0) -> dict[str, Any]:
    """POST a GraphQL query to ``<base_url>/graphql``; returns ``data``.

    Raises:
        RuntimeError: the answer carries GraphQL ``errors``.
    """
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
    """``assetOrError`` for ``asset``: partition keys, partition stats, materializations."""
    return graphql(base_url, ASSET_PARTITIONS_QUERY, {"key": {"path": [asset]}})["assetOrError"]
