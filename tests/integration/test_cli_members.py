"""``cg static|elastic consume|join`` against the session's nats-server, run as subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    ElasticConfig,
    PartitioningFilter,
    StaticConfig,
    config_key,
    work_queue_stream_name,
)
from cg_pipelines.core.subjects import partition_of_subject
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from tests.support.wait import wait_for

CG = [sys.executable, "-m", "cg_pipelines.cli"]


async def cg(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``cg`` without blocking the event loop (the test publishes meanwhile)."""
    proc = await asyncio.create_subprocess_exec(
        *CG, "--server", url, *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


async def elastic_group(js: JetStreamContext, s: str, members: tuple[str, ...] = ("m1",),
                        max_members: int = 2) -> None:
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    await admin.create_elastic(js, s, "g", ElasticConfig(
        max_members, (PartitioningFilter(f"{s}.*", (1,)),), members=members))


async def wait_buffered(js: JetStreamContext, wq: str, n: int) -> None:
    api = JetStreamAPI.from_js(js)
    try:
        for _ in range(100):
            if (await api.stream_info(wq))["state"]["messages"] >= n:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{wq}: {n} messages never sourced")
    finally:
        await api.close()


async def _member_up(js: JetStreamContext, s: str, group: str, member: str,
                     run: asyncio.Task[subprocess.CompletedProcess[str]]) -> bool:
    """True once elastic member ``member`` of ``s.group`` is up: its consumer exists on the
    work-queue stream and a watcher of the group's config key exists on the KV bucket. Fails
    at once if ``cg`` (the ``run`` task) already ended."""
    if run.done():
        r = run.result()
        raise AssertionError(f"cg ended ({r.returncode}) before the member was up: "
                             f"{r.stdout}{r.stderr}")
    api = JetStreamAPI.from_js(js)
    try:
        if member not in await api.list_consumer_names(work_queue_stream_name(s, group)):
            return False
        key = f"$KV.{ELASTIC_BUCKET}.{config_key(s, group)}"
        return any(key == c["config"].get("filter_subject")
                   or key in (c["config"].get("filter_subjects") or [])
                   for c in await api.list_consumers(f"KV_{ELASTIC_BUCKET}"))
    finally:
        await api.close()


async def wq_messages(js: JetStreamContext, wq: str) -> int:
    api = JetStreamAPI.from_js(js)
    try:
        return int((await api.stream_info(wq))["state"]["messages"])
    finally:
        await api.close()


async def test_elastic_consume_prints_one_line_per_message(nats_server, js, unique_name) -> None:
    url, s = nats_server.url, unique_name
    await elastic_group(js, s, max_members=2)
    keys = ["a", "b", "c", "d"]
    long = "x" * 250
    for i, k in enumerate(keys):
        await js.publish(f"{s}.{k}", f"payload {i}".encode())
    await js.publish(f"{s}.a", long.encode())
    await js.publish(f"{s}.b", b"two\nlines")
    await wait_buffered(js, f"{s}-g", 6)
    r = await cg(url, "elastic", "consume", s, "g", "m1", "--count", "6")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 6, r.stdout
    part = {k: partition_of_subject(f"{s}.{k}", f"{s}.*", (1,), 2) for k in "abcd"}
    expected = {f"[{part[k]}] #{i + 1} {s}.{k}: payload {i}" for i, k in enumerate(keys)}
    expected.add(f"[{part['a']}] #5 {s}.a: {'x' * 200}…")
    expected.add(f"[{part['b']}] #6 {s}.b: two\\nlines")
    assert set(lines) == expected
    # Per partition, in stream order (one member owns both partitions, max_ack_pending=1).
    for p in (0, 1):
        seqs = [int(x.split()[1][1:]) for x in lines if x.startswith(f"[{p}]")]
        assert seqs == sorted(seqs)
    assert await wq_messages(js, f"{s}-g") == 0  # all acked (work queue)


async def test_exec_acks_on_zero_and_naks_on_failure(nats_server, js, unique_name,
                                                     tmp_path: Path) -> None:
    url, s = nats_server.url, unique_name
    await elastic_group(js, s, max_members=1)
    seen = tmp_path / "seen.txt"
    marker = tmp_path / "failed-once"
    # Payload "bad" fails on its first delivery only; every run is logged as "seq subject data".
    script = (f'data=$(cat); echo "$CG_SEQUENCE $CG_PARTITION $CG_SUBJECT $data" >> {seen}; '
              f'if [ "$data" = bad ] && [ ! -e {marker} ]; then touch {marker}; exit 3; fi')
    for payload in (b"ok1", b"bad", b"ok2"):
        await js.publish(f"{s}.k", payload)
    await wait_buffered(js, f"{s}-g", 3)
    r = await cg(url, "elastic", "consume", s, "g", "m1", "--exec", script, "--count", "4",
                 "--double-ack")
    assert r.returncode == 0, r.stderr
    runs = seen.read_text().splitlines()
    assert runs == [f"1 0 {s}.k ok1", f"2 0 {s}.k bad", f"2 0 {s}.k bad", f"3 0 {s}.k ok2"]
    assert [x.split(": ")[1] for x in r.stdout.splitlines()] == ["ok1", "bad", "bad", "ok2"]
    assert "--exec exited 3 for #2" in r.stderr
    assert await wq_messages(js, f"{s}-g") == 0  # exit 0 acked all, the nak'ed one included


async def test_static_consume_of_a_non_member_is_exit_2(nats_server, js, unique_name) -> None:
    url, s = nats_server.url, unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"0.{s}.>", f"1.{s}.>"]))
    await admin.create_static(js, s, "g", StaticConfig(2, (), ("m1",)))
    for args, words in [
        (["static", "consume", s, "g", "zz"], "'zz' is not in the membership"),
        (["static", "join", s, "nogroup", "m1"], "not found"),
        (["elastic", "consume", s, "nogroup", "m1"], "not found"),
    ]:
        r = await cg(url, *args, timeout=30)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("cg: error: ") and words in lines[0], (
            args, r.stderr)
    api = JetStreamAPI.from_js(js)
    try:
        assert await api.list_consumer_names(s) == []  # nothing created
    finally:
        await api.close()


async def test_static_consume_prints_messages(nats_server, js, unique_name) -> None:
    url, s = nats_server.url, unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"0.{s}.>", f"1.{s}.>"]))
    await admin.create_static(js, s, "g", StaticConfig(2, (), ("m1", "m2")))
    for p in (0, 1, 0, 1):
        await js.publish(f"{p}.{s}.x", f"to {p}".encode())
    r = await cg(url, "static", "consume", s, "g", "m1", "--count", "2", "--double-ack")
    assert r.returncode == 0, r.stderr
    # m1 owns partition 0 of 2 (members sorted, partitions dealt round robin).
    assert r.stdout.splitlines() == [f"[0] #1 {s}.x: to 0", f"[0] #3 {s}.x: to 0"]


async def test_join_reports_progress_and_stops_cleanly_on_sigint(nats_server, js,
                                                                 unique_name) -> None:
    url, s = nats_server.url, unique_name
    await elastic_group(js, s, max_members=1)
    for i in range(20):
        await js.publish(f"{s}.k{i}", b"x")
    proc = subprocess.Popen([*CG, "--server", url, "elastic", "join", s, "g", "m1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        t = time.monotonic()
        while not lines or not lines[-1].startswith("member m1: 20 messages, pinned "):
            assert time.monotonic() - t < 30, f"no progress line for 20 messages: {lines}"
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            assert line, (lines, proc.communicate())
            lines.append(line.rstrip("\n"))
        assert await wq_messages(js, f"{s}-g") == 0
        os.kill(proc.pid, signal.SIGINT)
        out, err = await asyncio.to_thread(proc.communicate, timeout=20)
        assert proc.returncode == 0, (out, err)
        assert err == ""
        lines += out.splitlines()
        assert lines[-1] == "member m1: 20 messages, stopped", lines
        assert all(x.startswith("member m1: ") for x in lines), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_group_deleted_stops_cleanly(nats_server, js, unique_name) -> None:
    url, s = nats_server.url, unique_name
    await elastic_group(js, s, max_members=1)
    run = asyncio.create_task(cg(url, "elastic", "consume", s, "g", "m1", timeout=60))
    # Delete the group only once the member is up (on a loaded machine the CLI may take
    # seconds to start; deleted before it looks, it finds no group and exits 2): its consumer
    # is on the work-queue stream and it watches its config key.
    await wait_for(lambda: _member_up(js, s, "g", "m1", run), 45,
                   f"cg elastic consume {s} g m1 to create its consumer and watch its config",
                   interval=0.1)
    assert await admin.delete_elastic(js, s, "g")
    r = await run
    assert r.returncode == 0, r.stderr
    assert "was deleted" in r.stderr and len(r.stderr.strip().splitlines()) == 1
