"""``cg spark-connect start|status|stop``: a real Spark Connect server started in the
background from the pyspark package, outliving the command, used by a thin client in another
process through ``SparkResource(remote=...)``, and stopped by pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

CG = Path(sys.executable).with_name("cg")


def _cg(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CG), "spark-connect", *args], capture_output=True, text=True,
                          timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[1].startswith("Z"))


def test_start_status_client_stop(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    assert _cg("status", "--state-dir", state).returncode == 3
    started = _cg("start", "--state-dir", state, "--port", "0", "--master", "local[1]",
                  "--driver-memory", "1g", "--warm-up", "1")
    info = json.loads((tmp_path / "state" / "spark-connect" / "server.json").read_text())
    pid = int(info["pid"])
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        assert f"export CG_SPARK_REMOTE={info['url']}" in started.stdout
        assert "warm-up jobs: " in started.stdout, started.stdout + started.stderr
        assert _alive(pid)
        status = _cg("status", "--state-dir", state, "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["running"] is True
        # a second start finds it running and starts nothing
        again = _cg("start", "--state-dir", state, "--port", "0")
        assert again.returncode == 0 and "already running" in again.stdout
        client = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from dagster import build_init_resource_context
            from cg_pipelines.dagster import SparkResource
            res = SparkResource(remote={info['url']!r})
            s = res.spark_session
            print(type(s).__module__, s.range(10).selectExpr("sum(id) AS s").collect()[0]["s"])
            res.teardown_after_execution(build_init_resource_context())
        """)], capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr[-3000:]
        assert client.stdout.split() == ["pyspark.sql.connect.session", "45"], client.stdout
        # the client's teardown released its session only: the server is still up
        assert _cg("status", "--state-dir", state).returncode == 0
    finally:
        stopped = _cg("stop", "--state-dir", state, "--timeout", "5")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout
    assert not _alive(pid)
    assert _cg("status", "--state-dir", state).returncode == 3
    assert (tmp_path / "state" / "spark-connect" / "connect.log").stat().st_size > 0


def test_a_port_in_use_is_refused_not_taken_for_the_server(tmp_path: Path) -> None:
    # something else listens on the asked port: the server must not report that listener as
    # itself (Spark binds the next port instead); it is stopped and the start refused
    import socket

    import pytest

    from cg_pipelines.core.errors import StateError
    from cg_pipelines.local.spark_cluster import SparkConnectServer

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        server = SparkConnectServer("local[1]", port=port, log_dir=tmp_path)
        with pytest.raises(StateError, match=f"port {port} is in use"):
            server.start()
        assert server.pid is None
    # asked for no port, it reports the one it bound
    with SparkConnectServer("local[1]", log_dir=tmp_path / "free") as free:
        assert free.port > 0 and free.url == f"sc://127.0.0.1:{free.port}"
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", free.port)) == 0
