"""A Spark standalone cluster (one master, N workers) on 127.0.0.1 from the pip ``pyspark``
package, for tests and local runs against a real ``spark://`` master; and a Spark Connect
server.

Both start the JVM classes the way ``sbin/start-master.sh`` / ``start-worker.sh`` do
(``bin/spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker``,
``org.apache.spark.sql.connect.service.SparkConnectServer``) but in the foreground, each in its
own process group, and stop them by PID (SIGTERM, then SIGKILL after a timeout): processes
started in the background in some sandboxes ignore signals.

Usage::

    with SparkStandaloneCluster(workers=2) as cluster:
        spark = get_spark(cluster.master_url)
        ...
        cluster.applications()   # what ran on the master (its JSON endpoint)

Needs Java 17+ and the ``spark`` extra. Durations are seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from cg_pipelines.core.errors import StateError

__all__ = ["CONNECT_SERVER_CONF", "SparkConnectServer", "SparkStandaloneCluster", "spark_home",
           "stop_pid"]


def spark_home() -> Path:
    """The pip ``pyspark`` package directory (it holds ``bin/spark-class`` and ``jars/``)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _env(log_dir: Path) -> dict[str, str]:
    home = spark_home()
    return {**os.environ, "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOG_DIR": str(log_dir), "SPARK_NO_DAEMONIZE": "1",
            "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
            # the master's REST submission server would take the fixed port 6066
            "SPARK_MASTER_OPTS": " ".join(filter(None, [
                os.environ.get("SPARK_MASTER_OPTS"), "-Dspark.master.rest.enabled=false"]))}


def stop_pid(pid: int, timeout_s: float = 10.0) -> bool:
    """Stop the process group led by ``pid`` (SIGTERM, then SIGKILL after ``timeout_s``
    seconds; processes started in the background here may ignore SIGTERM) and wait until it is
    gone. For a process that is not this one's child (e.g. a server started by an earlier
    ``cg spark-connect start``). Returns False if it was not running."""
    def alive() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie child of ours counts as gone
            done, _ = os.waitpid(pid, os.WNOHANG)
            return done == 0
        except ChildProcessError:
            return True

    if not alive():
        return False
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive():
                return True
            time.sleep(0.1)
    return True


class _Proc:
    """One JVM in its own process group, output to a log file, stopped by PID."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.log = name, log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), *args], env=_env(log_dir),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def bound_port(self, service: str) -> int | None:
        """The port Spark's ``Utils.startServiceOnPort`` logged for ``service`` ("Successfully
        started service '<service>' on port N."; a class name matches with or without its
        package), or None while it has not bound yet. Reading the port the JVM itself bound
        (asked for port 0) leaves no window in which another process takes a port chosen for it
        beforehand."""
        return self.logged_int(rf"Successfully started service '(?:[\w.$]*\.)?"
                               rf"{re.escape(service)}\$?' on port (\d+)")

    def logged_int(self, pattern: str) -> int | None:
        """The number ``pattern``'s first group matched in the log (first match), or None."""
        if not self.log.exists():
            return None
        found = re.search(pattern, self.log.read_text(errors="replace"))
        return int(found.group(1)) if found else None

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class SparkStandaloneCluster:
    """A standalone master and ``workers`` workers on 127.0.0.1 (free ports).

    Args:
        workers: number of workers.
        cores: cores each worker offers.
        memory: memory each worker offers (Spark size string, e.g. ``"1g"``).
        log_dir: where the JVMs' logs go (a temporary directory by default).
        start_timeout_s: seconds to wait for the master and every worker to be up.

    Raises:
        StateError (from :meth:`start`): a JVM exited or the cluster was not up in time; the
            message holds the log tail.
    """

    def __init__(self, workers: int = 1, *, cores: int = 1, memory: str = "1g",
                 log_dir: Path | None = None, start_timeout_s: float = 90.0) -> None:
        self.workers, self.cores, self.memory = workers, cores, memory
        self._tmp = tempfile.TemporaryDirectory(prefix="cg-spark-") if log_dir is None else None
        self.log_dir = Path(self._tmp.name) if self._tmp else Path(log_dir)  # type: ignore[arg-type]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = start_timeout_s
        self.port = self.ui_port = 0  # the ports the master bound, known once started
        self._procs: list[_Proc] = []

    @property
    def master_url(self) -> str:
        """``spark://127.0.0.1:<port>`` (after :meth:`start`)."""
        return f"spark://127.0.0.1:{self.port}"

    @property
    def ui_url(self) -> str:
        """The master's web UI (its JSON endpoint is ``<ui_url>/json/``)."""
        return f"http://127.0.0.1:{self.ui_port}"

    @property
    def pids(self) -> list[int]:
        return [p.popen.pid for p in self._procs]

    def state(self) -> dict[str, Any]:
        """The master's JSON state: ``workers``, ``activeapps``, ``completedapps`` ...

        Raises:
            OSError: the master does not answer.
        """
        with urllib.request.urlopen(f"{self.ui_url}/json/", timeout=5) as r:
            state: dict[str, Any] = json.loads(r.read())
        return state

    def applications(self) -> list[dict[str, Any]]:
        """Applications the master has seen (active and completed), each with ``name``,
        ``id``, ``state`` ..."""
        st = self.state()
        return [*st.get("activeapps", []), *st.get("completedapps", [])]

    def start(self) -> SparkStandaloneCluster:
        """Start the master (on ports it picks itself), then the workers, and wait until every
        worker is ALIVE on the master (see the class docstring for errors). A failed start
        stops every JVM it started."""
        try:
            master = _Proc("master", [
                "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                "--port", "0", "--webui-port", "0"], self.log_dir)
            self._procs.append(master)
            self._wait(lambda: master.bound_port("sparkMaster") and master.bound_port("MasterUI"),
                       "master")
            self.port = master.bound_port("sparkMaster") or 0
            self.ui_port = master.bound_port("MasterUI") or 0
            self._wait(lambda: self.state() is not None, "master's JSON endpoint")
            for i in range(self.workers):
                self._procs.append(_Proc(f"worker{i}", [
                    "org.apache.spark.deploy.worker.Worker", self.master_url,
                    "--host", "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory,
                    "--webui-port", "0", "--work-dir", str(self.log_dir / f"w{i}")],
                    self.log_dir))
            self._wait(lambda: sum(w.get("state") == "ALIVE"
                                      for w in self.state().get("workers", []))
                       >= self.workers, f"{self.workers} worker(s)")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            dead = [p for p in self._procs if not p.alive()]
            if dead:
                raise StateError(f"Spark {dead[0].name} exited:\n{dead[0].tail()}")
            try:
                if ready():
                    return
            except OSError:  # the master's web UI is not answering yet
                pass
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {p.name}\n{p.tail(8)}" for p in self._procs)
                raise StateError(f"Spark {what} not up after {self.start_timeout_s:g} s\n"
                                 f"{tails}")
            time.sleep(0.3)

    def stop(self) -> None:
        """Stop every JVM (workers first), by PID (idempotent)."""
        for p in reversed(self._procs):
            p.stop()
        self._procs.clear()

    def __enter__(self) -> SparkStandaloneCluster:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


CONNECT_SERVER_CONF: dict[str, str] = {"spark.sql.codegen.cache.maxEntries": "2000"}
"""Server settings :class:`SparkConnectServer` starts with (its ``conf`` wins): room in Spark's
code-generation cache for the sessions that partition runs share
(``SparkResource(session_reuse_s=...)``): the cache is keyed by session, and Spark's default
of 100 entries holds the compiled code of about three sessions of the example's legs
transform (33 classes each)."""


class SparkConnectServer:
    """A Spark Connect server (``sc://127.0.0.1:<port>``) running a ``local[N]`` Spark, from the
    pip pyspark package (its ``spark-connect`` jar). Clients need ``pyspark[connect]``'s
    packages (``grpcio``, ``grpcio-status``, ``googleapis-common-protos``, ``zstandard``).

    Raises:
        StateError (from :meth:`start`): the server exited or did not listen in time.
    """

    def __init__(self, master: str = "local[2]", *, log_dir: Path | None = None,
                 start_timeout_s: float = 90.0, port: int | None = None,
                 conf: dict[str, str] | None = None, driver_memory: str | None = None) -> None:
        """Args: ``master`` the server's Spark master; ``log_dir`` where its log goes (a
        temporary directory by default); ``start_timeout_s`` seconds to wait for it to listen;
        ``port`` its gRPC port (by default one the server picks; :attr:`port` holds it once
        started); ``conf`` extra ``--conf`` settings of
        the server's Spark; ``driver_memory`` e.g. ``"2g"`` (Spark's default 1g otherwise)."""
        self.master = master
        self._tmp = tempfile.TemporaryDirectory(prefix="cg-connect-") if log_dir is None else None
        self.log_dir = Path(self._tmp.name) if self._tmp else Path(log_dir)  # type: ignore[arg-type]
        self.start_timeout_s = start_timeout_s
        self._asked_port = port or 0
        self.port = self._asked_port
        self.conf = dict(conf or {})
        self.driver_memory = driver_memory
        self._proc: _Proc | None = None

    @property
    def url(self) -> str:
        """``sc://127.0.0.1:<port>``."""
        return f"sc://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.popen.pid if self._proc else None

    @property
    def log(self) -> Path:
        """The server's log file."""
        return self.log_dir / "connect.log"

    def start(self) -> SparkConnectServer:
        """Start the server and wait until it listens (see the class docstring for errors)."""
        conf = {"spark.connect.grpc.binding.port": str(self._asked_port),
                "spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
                "spark.ui.showConsoleProgress": "false", **CONNECT_SERVER_CONF, **self.conf}
        args = ["org.apache.spark.deploy.SparkSubmit", "--master", self.master,
                "--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
        if self.driver_memory:
            args += ["--driver-memory", self.driver_memory]
        for k, v in conf.items():
            args += ["--conf", f"{k}={v}"]
        self._proc = _Proc("connect", [*args, "spark-internal"], self.log_dir)
        try:
            self.port = self._wait_bound(self._proc)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_bound(self, proc: _Proc) -> int:
        deadline = time.monotonic() + self.start_timeout_s
        def bound_port() -> int | None:  # Spark 4.0 may log only the second line
            return proc.bound_port("SparkConnectService") or proc.logged_int(
                r"Spark Connect server started at: \S+:(\d+)")

        while (bound := bound_port()) is None:
            if not proc.alive():
                tail = proc.tail(60)
                if self._asked_port and "java.net.BindException" in tail:
                    raise StateError(f"port {self._asked_port} is in use: the Spark Connect "
                                     f"server could not bind it (log: {self.log})")
                raise StateError(f"Spark Connect server exited:\n{proc.tail()}")
            if time.monotonic() > deadline:
                raise StateError(f"Spark Connect server not listening after "
                                 f"{self.start_timeout_s:g} s:\n{proc.tail()}")
            time.sleep(0.3)
        if self._asked_port and bound != self._asked_port:
            raise StateError(f"port {self._asked_port} is in use: the Spark Connect server "
                             f"bound {bound} instead (stopped; log: {self.log})")
        return bound

    def stop(self) -> None:
        """Stop the server by PID (idempotent)."""
        if self._proc is not None:
            self._proc.stop()
            self._proc = None

    def detach(self) -> int:
        """Forget the running server without stopping it (it keeps running after this process
        exits, in its own session; stop it later with :func:`stop_pid`). Returns its pid.

        Raises:
            StateError: not started, or started without a ``log_dir`` of its own (its
                temporary log directory would go with this object).
        """
        if self._proc is None:
            raise StateError("the Spark Connect server is not running")
        if self._tmp is not None:
            raise StateError("give SparkConnectServer a log_dir to detach it")
        pid = self._proc.popen.pid
        self._proc.popen.returncode = 0  # no "still running" warning when the Popen is freed
        self._proc = None
        return pid

    def __enter__(self) -> SparkConnectServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
