"""A throwaway PostgreSQL server on 127.0.0.1, for tests and local development.

Uses the PostgreSQL binaries on the machine (Debian's ``postgresql`` package: ``initdb`` and
``postgres`` on ``PATH`` or under ``/usr/lib/postgresql/<version>/bin``; ``bin_dir`` names the
directory explicitly). PostgreSQL refuses to run as root, so when this process is root the
cluster is created and run as the ``postgres`` user (or ``nobody``) in a new directory under
the system temp dir that this user owns.

The server process is ``postgres`` itself (not ``pg_ctl``), started with default signal
handlers and stopped by PID: SIGINT (fast shutdown), then SIGKILL after a timeout. Clients
connect over TCP with ``trust`` authentication as the superuser ``cg``: for tests only.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from cg_pipelines.core.errors import CgError, UsageError

__all__ = ["PostgresServer", "PostgresServerError", "find_postgres_bin"]

_SUPERUSER = "cg"


class PostgresServerError(CgError, RuntimeError):
    """PostgreSQL binaries are missing, or the server did not start."""


def find_postgres_bin(bin_dir: str | Path | None = None) -> Path:
    """The directory holding ``initdb`` and ``postgres``.

    Looks at ``bin_dir`` when given (and only there), else ``initdb``/``pg_ctl`` on ``PATH``
    (resolving symlinks, as Debian's wrappers are), then the newest
    ``/usr/lib/postgresql/*/bin``.

    Raises:
        PostgresServerError: none found (install Debian's ``postgresql`` package).
    """
    if bin_dir is not None:
        if (Path(bin_dir) / "initdb").is_file() and (Path(bin_dir) / "postgres").is_file():
            return Path(bin_dir)
        raise PostgresServerError(f"{bin_dir}: no initdb and postgres binaries there")
    candidates: list[Path] = []
    for name in ("pg_ctl", "initdb"):
        found = shutil.which(name)
        if found:
            candidates.append(Path(os.path.realpath(found)).parent)
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                                           key=_version_key, reverse=True)]
    for c in candidates:
        if (c / "initdb").is_file() and (c / "postgres").is_file():
            return c
    raise PostgresServerError(
        "PostgreSQL binaries (initdb, postgres) not found: install Debian's postgresql "
        "package (apt-get install postgresql) or pass their directory as bin_dir")


def _version_key(path: str) -> tuple[int, ...]:
    ver = Path(path).parent.name
    return tuple(int(x) for x in ver.split(".") if x.isdigit()) or (0,)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> pwd.struct_passwd | None:
    """The user to run PostgreSQL as when we are root (``postgres``, else ``nobody``)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise PostgresServerError("running as root and neither a 'postgres' nor a 'nobody' user "
                              "exists to run PostgreSQL as")


class PostgresServer:
    """A PostgreSQL server with its own data directory on 127.0.0.1 (stopped by PID).

    Args:
        port: TCP port; 0 picks a free one.
        bin_dir: the directory of ``initdb`` and ``postgres`` (default: found by
            :func:`find_postgres_bin`).
        ready_timeout_s: seconds to wait for the server to accept connections.
        stop_timeout_s: seconds between SIGINT (fast shutdown) and SIGKILL on :meth:`stop`.

    Use as a context manager, or :meth:`start` / :meth:`stop`. :meth:`create_database` makes a
    database and returns its SQLAlchemy-style URL (``postgresql://cg@127.0.0.1:<port>/<name>``).
    """

    def __init__(self, port: int = 0, ready_timeout_s: float = 30.0,
                 stop_timeout_s: float = 10.0, bin_dir: str | Path | None = None) -> None:
        self.port, self.bin_dir = port, bin_dir
        self.ready_timeout_s, self.stop_timeout_s = ready_timeout_s, stop_timeout_s
        self._bin: Path | None = None
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The ``postgres`` process id while running."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (exists after :meth:`start`)."""
        if self._dir is None:
            raise PostgresServerError("server not started")
        return self._dir / "data"

    def url(self, database: str = "postgres", driver: str = "postgresql") -> str:
        """A connection URL, e.g. ``postgresql://cg@127.0.0.1:5433/postgres``; ``driver`` may be
        ``postgresql+psycopg2`` and the like for SQLAlchemy."""
        return f"{driver}://{_SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _popen_kwargs(self) -> dict[str, object]:
        user = _run_as()
        # A session of its own (stopped by its group), and no preexec_fn: it can hang a process
        # with threads (cg_pipelines.local.spawn). The postmaster installs its own handlers for
        # the signals it is stopped with (SIGINT, SIGTERM, SIGQUIT), so dispositions it
        # inherits do not matter, and it runs as another user who may not reach this Python.
        kw: dict[str, object] = {"start_new_session": True, "env": {
            "PATH": os.environ.get("PATH", ""), "LC_ALL": "C", "LANG": "C"}}
        if user is not None:
            kw.update(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
        return kw

    def start(self) -> PostgresServer:
        """initdb a new cluster in a new temp directory and start ``postgres`` on it.

        Raises:
            PostgresServerError: binaries missing, initdb failed, or not ready in time
                (with the log's tail).
        """
        if self.pid is not None:
            return self
        self._bin = find_postgres_bin(self.bin_dir)
        self._dir = Path(tempfile.mkdtemp(prefix="cg-pg-"))
        try:
            user = _run_as()
            if user is not None:
                os.chown(self._dir, user.pw_uid, user.pw_gid)
            init = subprocess.run(
                [str(self._bin / "initdb"), "-D", str(self.data_dir), "-U", _SUPERUSER,
                 "--auth=trust", "--encoding=UTF8", "--no-sync"],
                capture_output=True, timeout=120, **self._popen_kwargs())  # type: ignore[call-overload]
            if init.returncode != 0:
                raise PostgresServerError(
                    f"initdb failed (exit {init.returncode}): "
                    f"{init.stderr.decode(errors='replace')[-2000:]}")
            auto_port = self.port == 0
            for _ in range(5 if auto_port else 1):
                if auto_port:
                    # chosen before postgres binds it: another process may take it in between,
                    # and postgres then exits at once ("could not bind"), so try another
                    self.port = _free_port()
                self._spawn()
                if self._wait_ready():
                    return self
            raise PostgresServerError(f"postgres could not listen on 127.0.0.1:{self.port}; "
                                      f"log tail:\n{self.log_tail()}")
        except BaseException:
            self.stop()  # what it started, and its directory
            raise

    def _spawn(self) -> None:
        assert self._bin is not None and self._dir is not None
        log = open(self._dir / "postgres.log", "ab")  # handed to the child
        try:
            self._proc = subprocess.Popen(  # type: ignore[call-overload]
                [str(self._bin / "postgres"), "-D", str(self.data_dir), "-p", str(self.port),
                 "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self._dir}",
                 "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT, **self._popen_kwargs())
        finally:
            log.close()

    def _wait_ready(self) -> bool:
        """True once this server's own ``postmaster.pid`` says it listens on :attr:`port` and
        is ready (its 4th line is the port, its 8th the status; PostgreSQL 10+): a probe of
        the port could be answered by another server that holds it. False if it exited
        because the port was taken."""
        deadline = time.monotonic() + self.ready_timeout_s
        pidfile = self.data_dir / "postmaster.pid"
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                if "could not bind" in self.log_tail(50):
                    return False
                raise PostgresServerError(f"postgres exited at start; log tail:\n{self.log_tail()}")
            try:
                lines = pidfile.read_text().splitlines()
            except OSError:
                lines = []
            if len(lines) >= 8 and lines[3].strip() == str(self.port) \
                    and lines[7].strip() == "ready":
                return True
            time.sleep(0.1)
        raise PostgresServerError(
            f"postgres not ready after {self.ready_timeout_s:g} s; log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` of the server's log."""
        if self._dir is None or not (self._dir / "postgres.log").exists():
            return ""
        text = (self._dir / "postgres.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run ``sql`` with ``psql`` (tuples only, unaligned) and return its output.

        Raises:
            PostgresServerError: psql failed (with its error text).
        """
        psql = shutil.which("psql") or (str(self._bin / "psql") if self._bin else "psql")
        out = subprocess.run(
            [psql, "-h", "127.0.0.1", "-p", str(self.port), "-U", _SUPERUSER, "-d", database,
             "-v", "ON_ERROR_STOP=1", "-tAc", sql], capture_output=True, timeout=60)
        if out.returncode != 0:
            raise PostgresServerError(f"psql failed: {out.stderr.decode(errors='replace')}")
        return out.stdout.decode()

    def create_database(self, name: str, driver: str = "postgresql") -> str:
        """Create database ``name`` (letters, digits, ``_``) and return its URL.

        Raises:
            UsageError: an unsafe name. PostgresServerError: psql failed (e.g. it exists).
        """
        if not name.replace("_", "").isalnum():
            raise UsageError(f"database name {name!r}: use letters, digits and _ only")
        self.psql(f'CREATE DATABASE "{name}"')
        return self.url(name, driver)

    def stop(self) -> None:
        """Stop the server (SIGINT = fast shutdown, SIGKILL after ``stop_timeout_s``) and remove
        its directory. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGINT, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"PostgresServer(port={self.port}, pid={self.pid})"
