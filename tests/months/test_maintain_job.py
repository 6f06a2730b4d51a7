"""The scheduled upkeep (``maintain_partition`` / ``cg maintain``): it takes the partition's
lease like a run, compacts, gives the lease back untouched (the backlog stays for the next
run)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.engine import EngineOptions, run_partition
from cg_pipelines.engine.maintain import maintain_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink, Maintenance
from tests.support import keyed


async def _wait(api: JetStreamAPI, stream: str, n: int) -> None:
    for _ in range(200):
        if int((await api.stream_info(f"{stream}-g"))["state"]["messages"]) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the work queue did not receive the events")


async def test_maintain_partition_under_the_lease(nats_server, nc, js, unique_name,
                                                  tmp_path) -> None:
    stream, uri = unique_name, str(tmp_path / "t")
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    api = JetStreamAPI.from_js(js)
    evs = keyed.events(7, 200)
    await keyed.publish(js, stream, evs[:100])
    await _wait(api, stream, 100)
    r = await run_partition(nc, stream, "g", 0, keyed.processor(),
                            DeltaSink(uri, maintenance=Maintenance.off()),
                            EngineOptions(batch_max_msgs=10))
    assert r.status == "drained" and r.maintenance == {"compact": "no", "vacuum": "no",
                                                      "files_live": 10,
                                                      "maintain_s": r.maintenance["maintain_s"]}
    await keyed.publish(js, stream, evs[100:])
    await _wait(api, stream, 100)
    # with a backlog: the job leases, compacts, gives the lease back
    res = await maintain_partition(nc, stream, "g", 0, DeltaSink(uri, maintenance=Maintenance(
        compact_min_files=5)), EngineOptions())
    assert res.status == "limit" and res.maintenance["compact"] == "done", res
    assert res.maintenance["files_live"] == 1 and res.processed == 0
    assert int((await api.stream_info(f"{stream}-g"))["state"]["messages"]) == 100
    # the CLI does the same (no backlog change; the next run drains it all)
    out = subprocess.run([sys.executable, "-m", "cg_pipelines.cli", "--server", nats_server.url,
                          "--json", "maintain", stream, "g", uri, "-p", "0",
                          "--compact-min-files", "2"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)[0]
    assert row["partition"] == 0 and row["status"] == "limit" and "error" not in row, row
    r = await run_partition(nc, stream, "g", 0, keyed.processor(), DeltaSink(uri),
                            EngineOptions(batch_max_msgs=50))
    assert r.status == "drained" and r.processed == 100, r
    assert keyed.mismatches(DeltaSink(uri).read(), evs) is None
