"""Benchmark: what a failing partition run prints (issue 29, point 3).

On its own nats-server, one elastic group of 1 partition with ``--events`` (200) keyed events,
and a Dagster code location whose transform raises ``ValueError("amount feed under
investigation: ...")`` on the first batch. Runs ``dagster asset materialize --partition g-0``
(a temp ``DAGSTER_HOME``) and prints:

- ``output lines: <n>`` (stdout + stderr of the command),
- ``lines repeating the partition facts: <n>`` (lines containing ``"in flight"``),
- ``tracebacks: <n>`` (``Traceback (most recent call last)`` lines),
- the run's ``STEP_FAILURE`` description, first line (it should start with the cause).

Run: ``.venv/bin/python bench/failure_output.py [--show] [--events 200] [--smoke]`` (``--show``
prints the whole output; ``--smoke``: 20 events, the same run otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nats
from nats.js.api import StreamConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter  # noqa: E402
from cg_pipelines.jetstream import admin  # noqa: E402
from cg_pipelines.local.nats_server import NatsServer  # noqa: E402
from tests.support import keyed  # noqa: E402

LOCATION = '''\
import os

from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource, NatsResource,
                                  PartitionRunsResource, build_definitions)
from cg_pipelines.engine.processing import ArrowProcessor
from tests.support import keyed


def transform(table, ctx):
    raise ValueError("amount feed under investigation: negative amounts in batch "
                     f"{ctx.first_seq}..{ctx.last_seq}")


orders = ConsumerGroupAsset(
    name="orders", stream=os.environ["CG_BENCH_STREAM"], group="g", partitions=1,
    processor=ArrowProcessor(keyed.DECODER, transform, state=keyed.STATE),
    sensor_interval_s=30, schedule_cron=None)

defs = build_definitions([orders], resources={
    "nats": NatsResource(servers=os.environ["CG_BENCH_NATS"]),
    "warehouse": DeltaWarehouseResource(root=os.environ["CG_BENCH_WAREHOUSE"]),
    "partition_runs": PartitionRunsResource(hold_wait_s=2.0),
})
'''


async def _setup(url: str, stream: str, n_events: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await keyed.publish(js, stream, keyed.events(n_keys=5, n_events=n_events))
    await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--show", action="store_true", help="print the whole output")
    ap.add_argument("--events", type=int, default=200, help="keyed events in the partition")
    ap.add_argument("--smoke", action="store_true", help="20 events")
    args = ap.parse_args()
    if args.smoke:
        args.events = 20
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        server = NatsServer(t / "nats", port=0).start()
        try:
            asyncio.run(_setup(server.url, "orders", args.events))
            (t / "home").mkdir()
            (t / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
            loc = t / "location.py"
            loc.write_text(LOCATION)
            env = {**os.environ, "DAGSTER_HOME": str(t / "home"), "CG_BENCH_STREAM": "orders",
                   "CG_BENCH_NATS": server.url, "CG_BENCH_WAREHOUSE": str(t / "wh"),
                   "PYTHONPATH": str(ROOT)}
            out = subprocess.run(
                [str(Path(sys.executable).parent / "dagster"), "asset", "materialize", "-f",
                 str(loc), "-d", str(ROOT), "--select", "orders", "--partition", "g-0"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        finally:
            server.stop()
    text = out.stdout + out.stderr
    lines = text.splitlines()
    if args.show:
        print(text)
    print(f"exit code: {out.returncode}")
    print(f"output lines: {len(lines)}")
    print(f"lines repeating the partition facts: {sum('in flight' in ln for ln in lines)}")
    print(f"tracebacks: {sum('Traceback (most recent call last)' in ln for ln in lines)}")
    first = next((ln for ln in lines if "STEP_FAILURE" in ln), "(no STEP_FAILURE line)")
    print(f"STEP_FAILURE line: {first[:400]}")


if __name__ == "__main__":
    main()
