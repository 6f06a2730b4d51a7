"""cg_pipelines.local.nats_server: finding, starting, crashing and restarting nats-server."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from cg_pipelines.local.nats_server import (
    MIN_NATS_SERVER_VERSION,
    NatsServer,
    NatsServerNotFoundError,
    NatsServerStartError,
    find_nats_server,
    nats_server_version,
)


def test_find_nats_server_and_version() -> None:
    binary = find_nats_server()
    assert os.access(binary, os.X_OK)
    assert nats_server_version(binary) >= MIN_NATS_SERVER_VERSION == (2, 12, 2)


def test_find_nats_server_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NATS_SERVER_BIN", raising=False)
    real = find_nats_server()
    monkeypatch.setenv("NATS_SERVER_BIN", str(tmp_path / "missing"))
    with pytest.raises(NatsServerNotFoundError, match="NATS_SERVER_BIN"):
        find_nats_server()
    old = tmp_path / "old-nats-server"
    old.write_text("#!/bin/sh\necho 'nats-server: v2.10.3'\n")
    old.chmod(old.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("NATS_SERVER_BIN", str(old))
    with pytest.raises(NatsServerNotFoundError, match="2.10.3"):
        find_nats_server()
    monkeypatch.setenv("NATS_SERVER_BIN", real)
    assert find_nats_server() == real


async def test_start_kill_restart_keeps_store_and_port(tmp_path: Path) -> None:
    srv = NatsServer(tmp_path / "store", monitor_port=0)
    with srv:
        assert srv.running and srv.pid and srv.port > 0
        assert srv.url == f"nats://127.0.0.1:{srv.port}"
        assert srv.monitor_url and srv.monitor_port
        port = srv.port
        nc = await nats.connect(srv.url)
        js = nc.jetstream()
        await js.add_stream(name="D", subjects=["d.>"])
        await js.publish("d.x", b"kept")
        await nc.close()

        srv.kill()  # crash: SIGKILL
        assert not srv.running and srv.pid is None
        srv.start()
        assert srv.port == port
        srv.restart()  # graceful
        assert srv.port == port and srv.running

        nc = await nats.connect(srv.url)
        js = nc.jetstream()
        msg = await js.get_msg("D", 1)
        assert msg.data == b"kept"
        await nc.close()
    assert not srv.running
    srv.stop()  # idempotent
    assert "Server is ready" in srv.log_path.read_text()


def test_stop_works_when_the_parent_ignores_sigterm(tmp_path: Path) -> None:
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        srv = NatsServer(tmp_path / "store", stop_timeout_s=3)
        srv.start()
        pid = srv.pid
        assert pid is not None
    finally:
        signal.signal(signal.SIGTERM, old)
    srv.stop()
    assert not srv.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_config_text_and_start_failure(tmp_path: Path) -> None:
    srv = NatsServer(tmp_path / "a", config_text="max_payload: 65536\n")
    with srv:
        assert srv.config_path.read_text() == "max_payload: 65536\n"
    bad = NatsServer(tmp_path / "b", config_text="this is { not valid\n", ready_timeout_s=5)
    with pytest.raises(NatsServerStartError, match="exited"):
        bad.start()
    assert not bad.running


def test_die_with_parent_leaves_no_orphan(tmp_path: Path) -> None:
    """A process killed by SIGKILL (e.g. a CI timeout) takes its die_with_parent server along."""
    code = (
        "import sys, time\n"
        "from cg_pipelines.local.nats_server import NatsServer\n"
        f"s = NatsServer({str(tmp_path / 'store')!r}, die_with_parent=True).start()\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(60)\n"  # the parent only has to live until it is killed
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        server_pid = int(child.stdout.readline())
        os.kill(server_pid, 0)  # running
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 5
    while _alive(server_pid):
        if time.monotonic() > deadline:
            os.kill(server_pid, signal.SIGKILL)
            pytest.fail("nats-server outlived its parent")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Running and not a zombie waiting for a reaper."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"
