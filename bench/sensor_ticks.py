"""Benchmark: a consumer group's sensor and schedule ticks against its partition count.

On its own nats-server, elastic groups of 16, 64 and 256 partitions (and, unless
``--no-max``, 4096, the most a group can have), each on its own origin stream ``s<n>`` with
subjects ``s<n>.<carrier>.<tail>`` partitioned on the tail wildcard: about 4,000 distinct subjects
(4 carriers x 1,000 tails; 4,096 tails for 4096 partitions) and ``--messages`` messages (20,000)
spread over them, so every partition has a backlog. Plus one Dagster code location with 8 groups
of 64 partitions (stream ``loc``, groups ``g0``..``g7``, partition keys ``g<i>-<p>``).

Each tick is evaluated as the daemon evaluates it: ``build_sensor_context(instance=...,
cursor=..., definitions=defs)`` + ``defs.resolve_sensor_def(name).evaluate_tick(ctx)`` (the drain
schedule through ``build_schedule_context``), with the definitions' own resources (a fresh NATS
connection per tick, as in production) and Dagster's log output sent to ``/dev/null`` (still
formatted). The membership sensor is ticked without a cursor, its worst case: every partition is
gained (one run request and one observation each). Medians of ``--repeats`` ticks.

Prints, per group size, ``sensor tick <n> partitions: <s> s`` (the slower of the membership and
backlog sensors), a detail line per size (membership, backlog, drain schedule, and the backlog
tick of the previous implementation: one direct get per partition, each on its own reply
subscription, all partitions at once, read even when not served), and for the location
``sensor tick 8 groups x 64 partitions (one location): <slowest> s; all 16 sensors in turn <s> s``.
A final part compares the backlog reads alone (no Dagster) with backlog on 10% of the partitions.

Run: ``.venv/bin/python bench/sensor_ticks.py [--repeats 5] [--messages 20000] [--no-max]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
from nats.js.api import StreamConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dagster import (  # noqa: E402
    DagsterInstance,
    Definitions,
    RunRequest,
    SkipReason,
    build_schedule_context,
    build_sensor_context,
)

import cg_pipelines.dagster.sensors as sensors_mod  # noqa: E402
from cg_pipelines.core.assignment import assignment  # noqa: E402
from cg_pipelines.core.config import (  # noqa: E402
    ElasticConfig,
    PartitioningFilter,
    work_queue_stream_name,
)
from cg_pipelines.core.subjects import partition_for  # noqa: E402
from cg_pipelines.core.triggers import (  # noqa: E402
    PartitionBacklog,
    backlog_requests,
    served_partitions,
)
from cg_pipelines.dagster import (  # noqa: E402
    ConsumerGroupAsset,
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
    build_definitions,
)
from cg_pipelines.dagster.assets import TICK_ERRORS, check_partitions  # noqa: E402
from cg_pipelines.jetstream import admin  # noqa: E402
from cg_pipelines.jetstream.api import JetStreamAPI  # noqa: E402
from cg_pipelines.jetstream.backlog import partition_backlog  # noqa: E402
from cg_pipelines.local.nats_server import NatsServer  # noqa: E402
from tests.support import keyed  # noqa: E402

CARRIERS = 4
TAILS = 1000
LOCATION_GROUPS = 8
LOCATION_PARTITIONS = 64


# ------------------------------------------------------------------ the previous implementation


async def old_partition_backlog(api: JetStreamAPI, stream: str, group: str,
                                partitions: range | list[int]) -> list[PartitionBacklog]:
    """cg_pipelines.jetstream.backlog.partition_backlog before issue 13 (kept for comparison)."""
    wq = work_queue_stream_name(stream, group)
    now_ns = time.time_ns()

    async def one(p: int) -> PartitionBacklog:
        msgs = await api.direct_get_batch(wq, 1, f"{p}.>", 1)
        if not msgs:
            return PartitionBacklog(p, 0, None, 0.0)
        m = msgs[0]
        pending = 1 + (m.num_pending or 0)
        return PartitionBacklog(p, pending, m.seq, max(0.0, (now_ns - m.time_ns) / 1e9))

    return list(await asyncio.gather(*(one(p) for p in partitions)))


def old_backlog_tick(spec: ConsumerGroupAsset, nats_res: NatsResource,
                     runs: PartitionRunsResource, log: Any) -> list[RunRequest] | SkipReason:
    """cg_pipelines.dagster.sensors.backlog_tick before issue 13 (kept for comparison)."""

    async def read(nc: Any) -> Any:
        v = await admin.get_elastic(nc.jetstream(), spec.stream, spec.group,
                                    timeout=nats_res.call_timeout_s)
        async with JetStreamAPI(nc, timeout=nats_res.call_timeout_s) as api:
            return v, await old_partition_backlog(api, spec.stream, spec.group,
                                                  range(spec.partitions))

    try:
        v, backlog = nats_res.run(read)
        check_partitions(v.config, spec)
    except TICK_ERRORS as e:
        return SkipReason(f"consumer group {spec.stream}.{spec.group}: {e}")
    served = served_partitions(assignment(v.config), runs.served())
    reqs = backlog_requests(spec.group, backlog, min_pending=runs.min_pending,
                            max_age_s=runs.max_age_s, partitions=served)
    for r in reqs:
        log.info(f"partition {r.partition}: {r.reason}")
    return [sensors_mod._request(spec, r.partition, r.run_key) for r in reqs] or SkipReason(
        "no partition with backlog")


@contextlib.contextmanager
def old_implementation() -> Iterator[None]:
    """The sensors and schedule call ``backlog_tick`` through the module: swap it."""
    new = sensors_mod.backlog_tick
    sensors_mod.backlog_tick = old_backlog_tick
    try:
        yield
    finally:
        sensors_mod.backlog_tick = new


# ------------------------------------------------------------------------------------ setup


def tails_covering(partitions: int, total: int) -> list[str]:
    """``total`` tail tokens, the first ones chosen so that every partition gets one."""
    first: dict[int, str] = {}
    i = 0
    while len(first) < partitions:
        t = f"t{i}"
        first.setdefault(partition_for([t], partitions), t)
        i += 1
    out = list(first.values())
    j = 0
    while len(out) < total:
        out.append(f"u{j}")
        j += 1
    return out


async def make_stream(js: Any, stream: str, partitions: int, messages: int,
                      groups: list[str]) -> None:
    """Origin stream ``stream`` with ``messages`` messages on about 4,000 subjects
    ``<stream>.c<carrier>.<tail>`` and elastic groups ``groups`` on it (member ``m1``)."""
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    for g in groups:
        await admin.create_elastic(js, stream, g, ElasticConfig(
            partitions, (PartitioningFilter(f"{stream}.*.*", (2,)),), members=("m1",)))
    n_tails = max(TAILS, partitions)
    carriers = max(1, (CARRIERS * TAILS) // n_tails)
    tails = tails_covering(partitions, n_tails)
    payload = b'{"key":"k","n":1}'
    for base in range(0, messages, 10_000):
        acks = []
        for i in range(base, min(messages, base + 10_000)):
            # every tail once per block of len(tails) messages, the carrier changing per block
            tail = tails[(i * 7919) % len(tails)]
            carrier = (i // len(tails)) % carriers
            acks.append(await js.publish_async(f"{stream}.c{carrier}.{tail}", payload))
        await asyncio.gather(*acks)
    api = JetStreamAPI.from_js(js, timeout=30)
    for g in groups:
        wq = work_queue_stream_name(stream, g)
        while (await api.stream_info(wq))["state"]["last_seq"] < messages:
            await asyncio.sleep(0.05)


async def setup(url: str, sizes: list[int], messages: int) -> dict[int, int]:
    """The streams and groups; returns the distinct subjects of each size's work queue."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for n in sizes:
            await make_stream(js, f"s{n}", n, messages, [f"g{n}"])
        await make_stream(js, "loc", LOCATION_PARTITIONS, messages,
                          [f"g{i}" for i in range(LOCATION_GROUPS)])
        api = JetStreamAPI.from_js(js)
        out = {}
        for n in sizes:
            state = (await api.stream_info(work_queue_stream_name(f"s{n}", f"g{n}")))["state"]
            out[n] = int(state["num_subjects"])
        return out
    finally:
        await nc.close()


def spec(stream: str, group: str, partitions: int) -> ConsumerGroupAsset:
    return ConsumerGroupAsset(name=f"{stream}_{group}", stream=stream, group=group,
                              partitions=partitions, processor=keyed.processor())


def definitions(specs: list[ConsumerGroupAsset], url: str, warehouse: str) -> Definitions:
    return build_definitions(specs, resources={"nats": NatsResource(servers=url),
                                               "warehouse": DeltaWarehouseResource(
                                                   root=warehouse)})


# ------------------------------------------------------------------------------------ ticks


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Dagster's console log lines still get formatted and written, to /dev/null."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def sensor_tick(defs: Definitions, name: str, instance: DagsterInstance) -> int:
    """One tick as the daemon evaluates it; returns the number of run requests."""
    with build_sensor_context(instance=instance, cursor=None, definitions=defs,
                              resources=dict(defs.resources or {})) as ctx:
        data = defs.resolve_sensor_def(name).evaluate_tick(ctx)
    return len(data.run_requests or [])


def schedule_tick(defs: Definitions, name: str, instance: DagsterInstance) -> int:
    with build_schedule_context(instance=instance, resources=dict(defs.resources or {}),
                                repository_def=defs.get_repository_def()) as ctx:
        data = defs.resolve_schedule_def(name).evaluate_tick(ctx)
    return len(data.run_requests or [])


def timed(fn: Callable[[], int], repeats: int, expect: int) -> float:
    """Median seconds of ``repeats`` calls (after one warm-up); each must request ``expect``."""
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        got = fn()
        dt = time.perf_counter() - t0
        if got != expect:
            raise AssertionError(f"{got} run requests, expected {expect}")
        if i:
            times.append(dt)
    return statistics.median(times)


def group_ticks(defs: Definitions, s: ConsumerGroupAsset, instance: DagsterInstance,
                repeats: int) -> dict[str, float]:
    n = s.partitions
    with quiet_stderr():
        out = {
            "membership": timed(lambda: sensor_tick(defs, f"{s.name}_membership", instance),
                                repeats, n),
            "backlog": timed(lambda: sensor_tick(defs, f"{s.name}_backlog", instance),
                             repeats, n),
            "drain": timed(lambda: schedule_tick(defs, f"{s.name}_drain", instance), repeats, n),
        }
        with old_implementation():
            out["old_backlog"] = timed(
                lambda: sensor_tick(defs, f"{s.name}_backlog", instance), repeats, n)
    return out


# ------------------------------------------------------------------------- backlog reads only


async def read_only(url: str, n: int, repeats: int) -> list[str]:
    """The backlog reads alone (no Dagster, one connection), new against old, with backlog on
    every partition and then on 10% of them (the rest purged)."""
    nc = await nats.connect(url)
    lines = []
    try:
        api = JetStreamAPI(nc, timeout=30)
        stream, group = f"s{n}", f"g{n}"

        async def median(read: Callable[[], Any]) -> float:
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                await read()
                if i:
                    times.append(time.perf_counter() - t0)
            return statistics.median(times)

        for label in ("every partition", "10% of partitions"):
            if label.startswith("10%"):
                wq = work_queue_stream_name(stream, group)
                for p in range(n):
                    if p % 10:
                        await api.purge(wq, filter=f"{p}.>")
            new = await partition_backlog(api, stream, group, range(n))
            old = await old_partition_backlog(api, stream, group, range(n))
            if new != [PartitionBacklog(b.partition, b.pending, b.first_seq, x.age_s)
                       for b, x in zip(old, new, strict=True)]:
                raise AssertionError("new and old backlog reads differ")
            t_new = await median(lambda: partition_backlog(api, stream, group, range(n)))
            t_old = await median(lambda: old_partition_backlog(api, stream, group, range(n)))
            lines.append(f"  backlog read {n} partitions, backlog on {label}: "
                         f"{t_new * 1000:.1f} ms (old {t_old * 1000:.1f} ms)")
    finally:
        await nc.close()
    return lines


# ------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--no-max", action="store_true", help="skip the 4096-partition group")
    args = ap.parse_args()
    sizes = [16, 64, 256] + ([] if args.no_max else [4096])
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "store") as srv:
        subjects = asyncio.run(setup(srv.url, sizes, args.messages))
        print(f"setup {time.perf_counter() - t_start:.1f} s: {args.messages} messages per "
              f"stream; work-queue subjects {subjects}", flush=True)
        with DagsterInstance.ephemeral() as instance:
            for n in sizes:
                s = spec(f"s{n}", f"g{n}", n)
                defs = definitions([s], srv.url, f"{tmp}/wh")
                t = group_ticks(defs, s, instance, args.repeats)
                old = max(t["membership"], t["old_backlog"])
                print(f"sensor tick {n} partitions: "
                      f"{max(t['membership'], t['backlog']):.3f} s", flush=True)
                print(f"  detail {n}: membership {t['membership']:.3f} s, backlog "
                      f"{t['backlog']:.3f} s, drain schedule {t['drain']:.3f} s; previous "
                      f"backlog {t['old_backlog']:.3f} s (slower of the two sensors then: "
                      f"{old:.3f} s)", flush=True)

            specs = [spec("loc", f"g{i}", LOCATION_PARTITIONS) for i in range(LOCATION_GROUPS)]
            defs = definitions(specs, srv.url, f"{tmp}/wh")
            per: dict[str, list[float]] = {}
            rounds: list[float] = []
            with quiet_stderr():
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    for s in specs:
                        for kind in ("membership", "backlog"):
                            name = f"{s.name}_{kind}"
                            t1 = time.perf_counter()
                            got = sensor_tick(defs, name, instance)
                            per.setdefault(name, []).append(time.perf_counter() - t1)
                            assert got == LOCATION_PARTITIONS, (name, got)
                    rounds.append(time.perf_counter() - t0)
            slowest = max(statistics.median(v) for v in per.values())
            print(f"sensor tick {LOCATION_GROUPS} groups x {LOCATION_PARTITIONS} partitions "
                  f"(one location): {slowest:.3f} s; all {2 * LOCATION_GROUPS} sensors in turn "
                  f"{statistics.median(rounds):.3f} s", flush=True)

        for n in [x for x in (256, 4096) if x in sizes]:
            for line in asyncio.run(read_only(srv.url, n, args.repeats)):
                print(line, flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
