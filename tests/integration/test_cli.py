"""The ``cg`` command line against a real server: admin round trip, errors, ``cg dev``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ELASTIC_BUCKET

CG = [sys.executable, "-m", "cg_pipelines.cli"]


def cg(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CG, "--server", url, *args], capture_output=True, text=True,
                          timeout=60)


async def test_elastic_round_trip_from_shell(nats_server, js, unique_name) -> None:
    url, s = nats_server.url, unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    r = cg(url, "elastic", "create", s, "legs", "--max-members", "8", "--filter", f"{s}.*.*:2")
    assert r.returncode == 0, r.stderr
    assert "max members: 8" in r.stdout
    r = cg(url, "elastic", "add", s, "legs", "m1", "m2,m3")
    assert r.returncode == 0, r.stderr
    info = json.loads(cg(url, "--json", "elastic", "info", s, "legs").stdout)
    assert info["members"] == ["m1", "m2", "m3"]
    assert info["assignment"] == {"m1": [0, 1, 6], "m2": [2, 3, 7], "m3": [4, 5]}
    assert info["partitioning_filters"] == [{"filter": f"{s}.*.*", "partitioning_wildcards": [2]}]
    r = cg(url, "elastic", "member-info", s, "legs")
    assert r.returncode == 0 and "m1: member, inactive, partitions 0,1,6" in r.stdout, r.stdout
    rows = json.loads(cg(url, "--json", "elastic", "member-info", s, "legs", "m3", "zz").stdout)
    assert [(x["member"], x["in_membership"]) for x in rows] == [("m3", True), ("zz", False)]
    assert cg(url, "elastic", "ls", s).stdout.split() == ["legs"]
    r = cg(url, "elastic", "create-mapping", s, "legs", "a:0-3", "b:4-7")
    assert r.returncode == 0 and "a: 0,1,2,3" in r.stdout, r.stderr
    assert cg(url, "elastic", "delete-mapping", s, "legs").returncode == 0
    assert cg(url, "elastic", "delete", s, "legs").returncode == 0
    assert cg(url, "elastic", "ls", s).stdout.startswith("no elastic consumer groups")


async def test_invalid_input_is_one_line_exit_2_nothing_written(nats_server, js,
                                                                unique_name) -> None:
    url, s = nats_server.url, unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    assert cg(url, "elastic", "create", s, "g", "--max-members", "2").returncode == 0
    kv = await js.key_value(ELASTIC_BUCKET)
    before = (await kv.get(f"{s}.g")).revision
    cases = [
        (["elastic", "create", s, "h", "--max-members", "0"], "max_members"),
        (["elastic", "create", s, "h", "--max-members", "2", "--filter", "a.b"], "'*'"),
        (["elastic", "create", "nostream" + s, "h", "--max-members", "2"],
         f"stream 'nostream{s}' not found"),
        (["elastic", "create-mapping", s, "g", "a:0"], "missing [1]"),
        (["elastic", "create-mapping", s, "g", "a-0"], "must look like"),
        (["elastic", "add", s, "nogroup", "m1"], "not found"),
        (["elastic", "add", s, "g", "bad.name"], "must not contain '.'"),
        (["static", "info", s, "nope"], "not found"),
    ]
    for args, words in cases:
        r = cg(url, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("cg: error: ") and words in lines[0], (
            args, r.stderr)
    assert (await kv.get(f"{s}.g")).revision == before
    assert cg(url, "elastic", "ls", s).stdout.split() == ["g"]


def test_unreachable_server_is_a_clear_error() -> None:
    r = cg("nats://127.0.0.1:1", "elastic", "ls", "x")
    assert r.returncode == 1 and "cannot connect to nats://127.0.0.1:1" in r.stderr


async def test_cg_dev_serves_until_interrupted(tmp_path: Path) -> None:
    proc = subprocess.Popen([*CG, "dev", "--port", "0", "--store", str(tmp_path / "s")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()  # "nats-server nats://127.0.0.1:<port> (...)"
        url = line.split()[1]
        assert url.startswith("nats://127.0.0.1:"), line
        nc = await nats.connect(url)
        info = await nc.jetstream().account_info()
        assert info.limits is not None
        await nc.close()
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0 and "nats-server stopped" in out
        pid_gone = True
        for _ in range(50):
            pid_gone = subprocess.run(["pgrep", "-f", str(tmp_path / "s")],
                                      capture_output=True).returncode != 0
            if pid_gone:
                break
            time.sleep(0.1)
        assert pid_gone, "nats-server still running after cg dev stopped"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_stream_create_and_options_after_the_command(nats_server, unique_name) -> None:
    """``cg stream create`` makes the origin stream (idempotent; other settings: exit 2), and
    every command takes the connection options after it, overriding those before it."""
    url, s = nats_server.url, unique_name
    bad = "nats://127.0.0.1:1"
    run = [*CG, "--server", bad]  # the group-level server is wrong; the command's wins
    r = subprocess.run([*run, "stream", "create", s, "--subject", f"{s}.>", "--server", url,
                        "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    assert made["subjects"] == [f"{s}.>"] and made["retention"] == "limits"
    again = subprocess.run([*run, "stream", "create", s, "--subject", f"{s}.>", "-s", url],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and f"stream {s}: subjects {s}.>" in again.stdout, again.stderr
    other = subprocess.run([*run, "stream", "create", s, "--subject", "elsewhere.>", "-s", url],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert other.stderr.startswith(f"cg: error: stream {s!r}:")
    r = subprocess.run([*run, "elastic", "create", s, "g", "--max-members", "2", "--server", url],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*run, "elastic", "add", s, "g", "m1", "--server", url, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["members"] == ["m1"], r.stderr
    info = subprocess.run([*run, "stream", "info", s, "--server", url], capture_output=True,
                          text=True, timeout=60)
    assert info.returncode == 0 and "limits retention" in info.stdout
    missing = subprocess.run([*run, "stream", "info", s + "X", "--server", url],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not found" in missing.stderr
    # without the override, the group-level (wrong) server is used
    r = subprocess.run([*run, "stream", "info", s], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot connect to nats://127.0.0.1:1" in r.stderr
