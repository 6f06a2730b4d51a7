"""Origin <-> work-queue reconciliation with a gap made on purpose: origin messages deleted from
the work queue before any run never reach the table. The check fails naming the exact origin
range and partitions (library call and ``cg reconcile``, exit 1); rebuilding those partitions
from the origin stream restores the table to the pandas reference, and the check passes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.coverage import ReconcileCursor, encode_seqs
from cg_pipelines.core.reconcile import OriginGap
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine.coverage_log import DeltaLogCoverage
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.rebuild import rebuild_partition
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.reconcile import reconcile_group, sink_table_seqs
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.storage import table_filesystem
from tests.support import keyed

P = 3
FAST = EngineOptions(batch_max_msgs=40, ack_wait_s=1.5, priority_timeout_s=1.5,
                     hold_wait_s=3.0)


async def test_gap_is_named_and_rebuild_repairs_it(nats_server: NatsServer, nc: Client,
                                                   js: JetStreamContext, unique_name: str,
                                                   tmp_path: Path) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"], allow_direct=True))
    await admin.create_elastic(js, s, "g", ElasticConfig(
        P, (PartitioningFilter(f"{s}.*", (1,)),), members=("m1",)))
    evs = keyed.events(n_keys=12, n_events=300)
    await keyed.publish(js, s, evs)
    for i in range(5):  # subjects the filter does not match: never expected in the queue
        await js.publish(f"{s}.not.partitioned", f"{i}".encode())
    api = JetStreamAPI.from_js(js)
    wq = f"{s}-g"
    for _ in range(200):
        if (await api.stream_info(wq))["state"]["messages"] >= len(evs):
            break
        await asyncio.sleep(0.05)
    # The gap: origin sequences 101..120 (= work-queue sequences here) removed before any run.
    for seq in range(101, 121):
        assert await api.delete_msg(wq, seq)
    gap_partitions = tuple(sorted({partition_for([k], P) for k, _ in evs[100:120]}))

    sink = DeltaSink(str(tmp_path / "t"))
    for p in range(P):
        r = await run_partition(nc, s, "g", p, keyed.processor(), sink, FAST)
        assert r.status == "drained", r
    assert keyed.mismatches(sink.read(), evs) is not None  # 20 events short
    seqs = sink_table_seqs(sink, "seq")  # the keyed transform keeps _seq as "seq"

    rep = await reconcile_group(js, api, s, "g", table_seqs=seqs)
    assert not rep.ok
    assert rep.gaps == [OriginGap(101, 120, 20, gap_partitions)]
    assert (rep.origin_messages, rep.expected, rep.in_table) == (305, 300, 280)
    assert rep.partitions == list(gap_partitions)
    line = rep.text()
    assert "\n" not in line
    assert "20 origin message(s) never reached " + wq in line
    assert (f"origin sequences 101..120 (20 messages, partition"
            f"{'s' if len(gap_partitions) > 1 else ''} "
            f"{', '.join(map(str, gap_partitions))})") in line, line
    # cg reconcile says the same, exit 1
    cli = subprocess.run([sys.executable, "-m", "cg_pipelines.cli", "--server", nats_server.url,
                          "--json", "reconcile", s, "g", "--table", str(tmp_path / "t"),
                          "--seq-column", "seq"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1, cli.stderr
    out = json.loads(cli.stdout)
    assert out["gaps"] == [{"first_seq": 101, "last_seq": 120, "messages": 20,
                            "partitions": list(gap_partitions)}]
    # a bounded window that stops before the gap sees none
    early = await reconcile_group(js, api, s, "g", table_seqs=seqs, from_seq=1, max_messages=100)
    assert early.ok and early.partial and early.to_seq == 100

    # repair: rebuild the named partitions from the origin stream
    for p in rep.partitions:
        r = await rebuild_partition(nc, s, "g", p, keyed.processor(), sink, FAST)
        assert r.status == "rebuilt", r
    assert keyed.mismatches(sink.read(), evs) is None
    after = await reconcile_group(js, api, s, "g", table_seqs=seqs)
    assert after.ok, after.text()
    assert after.in_table == 300

    def cg(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cg_pipelines.cli", "--server",
                               nats_server.url, "--json", "reconcile", s, "g", *args],
                              capture_output=True, text=True, timeout=60)

    # the stored cursor (from the first cg reconcile) goes on: the rebuild's coverage closed
    # the gap it kept; --all checks the whole history again from the coverage alone
    for args in ((), ("--all",), ("--from-seq", "90", "--to-seq", "130")):
        done = cg("--table", str(tmp_path / "t"), *args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        out = json.loads(done.stdout)
        assert out["ok"] and out["gaps"] == [] and out["stall"] is None, out
    assert json.loads(done.stdout)["to_seq"] == 130
    # a --table with no Delta table is refused, not read as "every message missing"
    nothing = cg("--table", str(tmp_path / "typo"))
    # (with --json the error is a JSON object on stdout)
    assert nothing.returncode == 2, nothing
    assert "no Delta table there" in json.loads(nothing.stdout)["error"], nothing


def test_on_s3(s3_bucket: tuple[str, dict[str, str]]) -> None:
    """The same reads and the cursor on an S3 table (moto)."""
    bucket, options = s3_bucket
    uri = f"s3://{bucket}/tables/t"
    fs = table_filesystem(uri, options)
    assert fs is not None
    log = DeltaLogCoverage(fs, "S", "g")
    assert log.read(-1, 10) == ([], -1, True) and not log.save_cursor(ReconcileCursor())
    sink = DeltaSink(uri, storage_options=options, schema=pa.schema([("x", pa.int64())]))
    sink.commit(pa.table({"x": pa.array([1, 2], pa.int64())}), {"S/g/0": (0, 2)}, lineage={
        "stream": "S", "group": "g", "partition": 0, "last_seq": 2,
        "coverage": encode_seqs([4, 8])})
    commits, last, done = log.read(-1, 10)
    assert done and [c.seqs.tolist() for c in commits if c.seqs is not None] == [[4, 8]]
    cur = ReconcileCursor(origin_through=8, version=last)
    assert log.save_cursor(cur)
    back = log.load_cursor()
    assert back is not None and (back.origin_through, back.version) == (8, last)
