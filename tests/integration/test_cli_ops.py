"""The operator commands against a real server: ``cg backlog``, ``cg halt show|skip`` (the
halt -> skip -> resume workflow), ``cg dlq ls|show|replay|purge`` and ``cg reconcile`` (ok case;
the gap case is tests/integration/test_reconcile.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed
from tests.support.wait import wait_for

CG = [sys.executable, "-m", "cg_pipelines.cli"]
FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=3.0)


def cg(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CG, "--server", url, *args], capture_output=True, text=True,
                          timeout=60)


def cg_json(url: str, *args: str) -> object:
    r = cg(url, "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def assert_aligned(text: str) -> None:
    """A ``cg`` table: a header, a rule, rows; each right-aligned column's cells end where
    its header ends (``partition``, ``pending`` ...)."""
    header, rule, *rows = text.splitlines()
    assert set(rule) == {"─"}, rule
    assert rows
    for name in ("partition", "pending"):
        end = header.index(name) + len(name)
        for row in rows:
            assert row[end - 1] != " " and (len(row) == end or row[end] == " "), (name, text)


async def _wq_last_seq(api: JetStreamAPI, s: str, seq: int) -> bool:
    """The work queue of group g has received origin sequence ``seq`` (the work queue keeps
    the origin's sequences here: it sources every message)."""
    return int((await api.stream_info(f"{s}-g"))["state"]["last_seq"]) >= seq


async def test_backlog_halt_skip_resume_dead_letters_and_reconcile(
        nats_server: NatsServer, nc: Client, js: JetStreamContext, unique_name: str,
        tmp_path: Path) -> None:
    url, s = nats_server.url, unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"], allow_direct=True))
    await admin.create_elastic(js, s, "g", ElasticConfig(
        2, (PartitioningFilter(f"{s}.*", (1,)),), members=("m1",)))
    evs = keyed.events(6, 60)
    key = evs[0][0]
    p = partition_for([key], 2)
    await keyed.publish(js, s, evs[:30])
    bad = (await js.publish(f"{s}.{key}", b'{"key": "' + key.encode() + b'", "n": oops}')).seq
    await keyed.publish(js, s, evs[30:])
    api = JetStreamAPI.from_js(js)
    await wait_for(lambda: _wq_last_seq(api, s, len(evs) + 1), 30,
                   f"{len(evs) + 1} messages in the work queue {s}-g")

    # backlog: every message pending, the oldest's age, nobody holding a partition yet
    rows = cg_json(url, "backlog", s, "g")
    assert [r["partition"] for r in rows] == [0, 1]
    assert sum(r["pending"] for r in rows) == len(evs) + 1
    assert all(r["first_seq"] >= 1 and r["oldest_age_s"] >= 0 for r in rows)
    assert all(r["holders"] == [] for r in rows)
    text = cg(url, "backlog", s, "g").stdout
    assert text.splitlines()[0].split() == ["partition", "pending", "first", "seq", "oldest",
                                           "holder"]
    assert_aligned(text)

    # halt: the run stops at the bad message (work-queue sequence == origin sequence here)
    sink = DeltaSink(str(tmp_path / "t"))
    halt = EngineOptions(dead_letter_policy="halt", **FAST)
    r = await run_partition(nc, s, "g", p, keyed.processor(), sink, halt)
    assert r.status == "halted" and r.halted_at == bad, r
    holders = cg_json(url, "backlog", s, "g", "-p", str(p))[0]["holders"]
    assert [h["consumer"] for h in holders] == [f"partition-{p}"]
    shown = cg_json(url, "halt", "show", s, "g", str(p))
    assert shown["seq"] == bad and "oops" in shown["payload_preview"]
    decode_error = r.detail.split(": ", 1)[1]  # "halted at sequence N: <decode error>"
    assert shown["halted_with"] == decode_error, (shown, r.detail)
    assert f"the run halted with: {decode_error}" in cg(url, "halt", "show", s, "g",
                                                        str(p)).stdout
    # skip: wrong partition refused, then moved with the reason; the rerun goes on
    r2 = cg(url, "halt", "skip", s, "g", str(1 - p), "--seq", str(bad), "--reason", "x")
    assert r2.returncode == 2 and f"is in partition {p}, not {1 - p}" in r2.stderr, r2.stderr
    r2 = cg(url, "halt", "skip", s, "g", str(p), "--seq", str(bad), "--reason", "malformed n")
    assert r2.returncode == 0, r2.stderr
    assert f"moved work-queue sequence {bad}" in r2.stdout and "next run goes on" in r2.stdout
    again = cg(url, "halt", "skip", s, "g", str(p), "--seq", str(bad), "--reason", "again")
    assert again.returncode == 2 and f"no message at sequence {bad}" in again.stderr
    for q in (0, 1):
        r = await run_partition(nc, s, "g", q, keyed.processor(), sink, halt)
        assert r.status == "drained", r
    assert keyed.mismatches(sink.read(), evs) is None

    # dead letters: listed and shown with the reason, headers and payload
    (d,) = cg_json(url, "dlq", "ls", s, "g")
    # the original decode error kept as the reason, the operator's reason next to it
    assert (d["partition"], d["source_seq"], d["reason"], d["skip_reason"]) == (
        p, bad, decode_error, "malformed n")
    assert f"{decode_error} [skipped: malformed n]" in cg(url, "dlq", "ls", s, "g").stdout
    # the halt note is gone with the skip
    assert await api.msg_get(f"{s}-g-dlq", last_by_subj=f"{s}-g-dlq.halted.{p}") is None
    assert d["headers"]["Cg-Origin-Sequence"] == str(bad)
    shown = cg(url, "dlq", "show", s, "g", str(d["seq"]))
    assert shown.returncode == 0, shown.stderr
    assert f"reason:     {decode_error}" in shown.stdout and "oops" in shown.stdout
    assert "skipped:    malformed n" in shown.stdout
    assert "Cg-Subject: " + f"{s}.{key}" in shown.stdout
    assert cg(url, "dlq", "show", s, "g", "99").returncode == 2

    # every origin message reached the work queue: reconcile is ok (exit 0)
    rec = cg(url, "--json", "reconcile", s, "g", "--table", str(tmp_path / "t"),
             "--seq-column", "seq")  # the keyed test transform names it seq
    assert rec.returncode == 0, rec.stdout + rec.stderr
    rep = json.loads(rec.stdout)
    assert rep["ok"] and rep["expected"] == len(evs) + 1 and rep["in_dlq"] == 1, rep
    # (the commits' coverage needs no row column; a column asked for must exist)
    assert cg(url, "reconcile", s, "g", "--table", str(tmp_path / "t")).returncode == 0
    r5 = cg(url, "reconcile", s, "g", "--table", str(tmp_path / "t"), "--seq-column", "_seq",
            "--all")
    assert r5.returncode == 2 and "the table has no usable '_seq' column" in r5.stderr

    # replay: refused without the flag (the ordering consequence stated), then published again
    r3 = cg(url, "dlq", "replay", s, "g", str(d["seq"]))
    assert r3.returncode == 2 and "per-key order is NOT kept" in r3.stderr, r3.stderr
    out = cg_json(url, "dlq", "replay", s, "g", "--all", "--reorder-ok")
    (rp,) = out["replayed"]
    assert rp["subject"] == f"{s}.{key}" and rp["origin_seq"] == len(evs) + 2
    assert cg_json(url, "dlq", "ls", s, "g") == []
    msg = await api.msg_get(s, seq=rp["origin_seq"])
    assert msg is not None and msg.headers["Cg-Replay-Of"] == str(bad)
    # still bad: the next run (dlq policy) dead-letters it again; the table is unchanged
    await wait_for(lambda: _wq_last_seq(api, s, rp["origin_seq"]), 30,
                   f"the replayed message (origin seq {rp['origin_seq']}) in the work queue")
    r = await run_partition(nc, s, "g", p, keyed.processor(), sink, EngineOptions(**FAST))
    assert r.dead_lettered == 1, r
    assert keyed.mismatches(sink.read(), evs) is None

    # purge: refused without --force, then done
    r4 = cg(url, "dlq", "purge", s, "g")
    assert r4.returncode == 2 and "--force" in r4.stderr
    assert cg_json(url, "dlq", "purge", s, "g", "--force") == {"purged": 1}
    assert cg_json(url, "dlq", "ls", s, "g") == []
