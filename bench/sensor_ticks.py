"""Benchmark: a consumer group's backlog sensor tick against its partition count, on a SQLite
and on a Postgres-backed Dagster instance, and the events it writes.

On its own nats-server, elastic groups of 256 and 4096 partitions (``--no-max``: 16, 64 and
256; ``--smoke``: 16 and 64, one repeat, fewer messages), each on its own origin stream
``s<n>`` with ``--messages`` messages (20,000) spread over about 4,000 subjects, so every
partition has a backlog. Each Dagster instance (a SQLite one in a temp dir; a Postgres one on a
throwaway PostgreSQL server, :class:`cg_pipelines.local.postgres.PostgresServer`, through
``dagster-postgres``) first gets a run history: ``--history`` successful runs per partition
and 5 failed runs (the retry limit) on 1% of the partitions.

Each tick is evaluated as the daemon evaluates it (``build_sensor_context(instance=...,
cursor=..., definitions=defs)`` + ``evaluate_tick``), with the definitions' own resources (a
fresh NATS connection per tick, as in production) and Dagster's log output sent to
``/dev/null``. The first tick (no cursor: every partition's lag observed, every partition's
first check results recorded run-less, at most ``CHECKS_PER_TICK`` of them), the ticks that
record the remaining first results (up to ``--max-converge``; at 4096 partitions, 8,192
checks), and then steady ticks (the cursor carried: nothing changed, so nothing recorded and
no check run requested; run keys requested less than 300 s ago not requested again) are
timed; Dagster storage calls per tick are counted (run-records queries, per-run event reads,
check-state reads, run-less event writes, check results recorded) and a steady tick's time
is split into its parts (:class:`Phases`: NATS read, run history, check states, check writes,
the rest of the sensor, Dagster's own processing).

Prints, per instance and size, ``sensor tick <n> partitions: <s> s`` (SQLite; the line
``bench/scale.py`` reads) or ``sensor tick <n> partitions (postgres): <s> s`` (the median
steady tick), a detail line (first tick, storage calls per tick, parts, run requests), and the
lag observations per day at a 30 s tick (the bound the sensor keeps, and what the previous
one-observation-per-changed-partition-per-tick rule gave under steady traffic).

Run: ``.venv/bin/python bench/sensor_ticks.py [--smoke] [--no-max] [--repeats 5]
[--messages 20000] [--history 2] [--max-converge 200] [--no-postgres]``
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
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
from nats.js.api import StreamConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dagster import (  # noqa: E402
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    Definitions,
    build_sensor_context,
    instance_for_test,
)

from cg_pipelines.core.config import (  # noqa: E402
    ElasticConfig,
    PartitioningFilter,
    work_queue_stream_name,
)
from cg_pipelines.core.lag import DEFAULT_LAG_REFRESH_S, lag_events_per_day  # noqa: E402
from cg_pipelines.core.subjects import partition_for  # noqa: E402
from cg_pipelines.dagster import (  # noqa: E402
    ConsumerGroupAsset,
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
    build_definitions,
    checks,
    triggers,
)
from cg_pipelines.dagster.checks import (  # noqa: E402
    CHECK_RUNS_PER_TICK,
    CHECKS_PER_TICK,
)
from cg_pipelines.dagster.history import CODE_TAG  # noqa: E402
from cg_pipelines.jetstream import admin  # noqa: E402
from cg_pipelines.jetstream.api import JetStreamAPI  # noqa: E402
from cg_pipelines.local.nats_server import NatsServer  # noqa: E402
from cg_pipelines.local.postgres import PostgresServer  # noqa: E402
from tests.support import keyed  # noqa: E402

CARRIERS = 4
TAILS = 1000


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
        api = JetStreamAPI.from_js(js)
        out = {}
        for n in sizes:
            state = (await api.stream_info(work_queue_stream_name(f"s{n}", f"g{n}")))["state"]
            out[n] = int(state["num_subjects"])
        return out
    finally:
        await nc.close()


# ------------------------------------------------------------------------------------ ticks


def spec(stream: str, group: str, partitions: int) -> ConsumerGroupAsset:
    return ConsumerGroupAsset(name=f"{stream}_{group}", stream=stream, group=group,
                              partitions=partitions, processor=keyed.processor(),
                              lag_objective_s=3600.0, code_version="v1")


def definitions(specs: list[ConsumerGroupAsset], url: str, warehouse: str) -> Definitions:
    return build_definitions(specs, resources={
        "nats": NatsResource(servers=url),
        "warehouse": DeltaWarehouseResource(root=warehouse),
        "partition_runs": PartitionRunsResource(retry_max_failures=5)})


def add_history(instance: DagsterInstance, s: ConsumerGroupAsset, per_partition: int) -> None:
    """``per_partition`` successful runs of each partition, then 5 failed ones (the retry
    limit) of 1% of them (at least one)."""
    job = f"{s.name}_job"
    failing = set(range(0, s.partitions, 100))
    for p in range(s.partitions):
        key = s.partition_key(p)
        statuses = [DagsterRunStatus.SUCCESS] * per_partition + (
            [DagsterRunStatus.FAILURE] * 5 if p in failing else [])
        for st in statuses:
            instance.add_run(DagsterRun(job_name=job, run_id=str(uuid.uuid4()), status=st,
                                        tags={"dagster/partition": key, CODE_TAG: "v1"}))


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


class StorageCalls:
    """Counts a Dagster instance's storage calls made by a tick, and the first check results
    it records (``checks.record_first_checks``: results, and the seconds it took)."""

    NAMES = ("get_run_records", "get_records_for_run", "report_runless_asset_event")
    STORED = "check results recorded"

    def __init__(self, instance: DagsterInstance) -> None:
        self.instance, self.counts = instance, dict.fromkeys(
            [*self.NAMES, "get_asset_check_partition_info", self.STORED], 0)
        self.write_s = 0.0
        for name in self.NAMES:
            self._wrap(instance, name)
        self._wrap(instance.event_log_storage, "get_asset_check_partition_info")
        real = checks.record_first_checks

        def stored(inst: DagsterInstance, evaluations: Any, log: Any) -> list[Any]:
            t0 = time.perf_counter()
            try:
                done = real(inst, evaluations, log)
                self.counts[self.STORED] += len(done)
                return done
            finally:
                self.write_s += time.perf_counter() - t0

        checks.record_first_checks = stored  # type: ignore[assignment]

    def _wrap(self, obj: Any, name: str) -> None:
        real = getattr(obj, name)

        def counted(*a: Any, **k: Any) -> Any:
            self.counts[name] += 1
            return real(*a, **k)

        setattr(obj, name, counted)

    def take(self) -> dict[str, int]:
        out = {k: v for k, v in self.counts.items() if v}
        for k in self.counts:
            self.counts[k] = 0
        return out

    def take_write_s(self) -> float:
        out, self.write_s = self.write_s, 0.0
        return out


class Phases:
    """Wall-clock seconds a tick spends in each part: ``read`` (the NATS session:
    ``triggers.read_inputs``), ``history`` (run history: ``triggers.partition_runs``), ``check
    states`` (``checks.check_states``), ``check writes``
    (``checks.record_first_checks``),
    ``other`` (the rest of ``triggers.backlog_tick``: planning, run requests, observations,
    cursor) and ``dagster`` (the rest of the tick: Dagster resolving the run requests and the
    result)."""

    WRAPPED = {"read_inputs": "read", "partition_runs": "history",
               "check_states": "check states", "record_first_checks": "check writes",
               "backlog_tick": "tick"}
    #: Where each wrapped name is looked up when called (the tick's module otherwise).
    MODULES = {"check_states": checks, "record_first_checks": checks}

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        for name, label in self.WRAPPED.items():
            self._wrap(name, label)

    def _wrap(self, name: str, label: str) -> None:
        module = self.MODULES.get(name, triggers)
        real = getattr(module, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0

        setattr(module, name, timed)

    def take(self, total: float) -> dict[str, float]:
        """The parts of a tick that took ``total`` seconds; resets."""
        got, self.seconds = self.seconds, {}
        tick = got.pop("tick", 0.0)
        parts = {k: got.get(k, 0.0) for k in ("read", "history", "check states",
                                              "check writes")}
        parts["other"] = tick - sum(parts.values())
        parts["dagster"] = total - tick
        return parts


def fmt_phases(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in parts.items())


def backlog_tick(defs: Definitions, name: str, instance: DagsterInstance,
                 cursor: str | None) -> tuple[int, list[Any], str | None]:
    """One tick as the daemon evaluates it: (run requests, asset events, next cursor)."""
    reqs, events, cursor, _ = backlog_tick_checks(defs, name, instance, cursor)
    return reqs, events, cursor


def backlog_tick_checks(defs: Definitions, name: str, instance: DagsterInstance,
                        cursor: str | None) -> tuple[int, list[Any], str | None, int]:
    """:func:`backlog_tick`, plus how many check-only runs it requested."""
    with build_sensor_context(instance=instance, cursor=cursor, definitions=defs,
                              resources=dict(defs.resources or {})) as ctx:
        data = defs.resolve_sensor_def(name).evaluate_tick(ctx)
    reqs = list(data.run_requests or [])
    checks = sum(1 for r in reqs if (r.job_name or "").endswith("_checks"))
    return len(reqs), list(data.asset_events or []), data.cursor, checks


def measure(instance: DagsterInstance, label: str, s: ConsumerGroupAsset, url: str,
            warehouse: str, repeats: int, history: int, max_converge: int) -> str:
    defs = definitions([s], url, warehouse)
    t0 = time.perf_counter()
    add_history(instance, s, history)
    t_hist = time.perf_counter() - t0
    calls = StorageCalls(instance)
    phases = Phases()
    name = f"{s.name}_backlog"
    with quiet_stderr():
        calls.take_write_s()
        t0 = time.perf_counter()
        reqs, first_events, cursor = backlog_tick(defs, name, instance, None)
        first = time.perf_counter() - t0
        first_w = calls.take_write_s()
        first_calls = calls.take()
        t0 = time.perf_counter()
        written = first_events if s.partitions <= 256 else []
        for ev in written:  # what the daemon does with them, after the tick
            instance.report_runless_asset_event(ev)
        t_write = time.perf_counter() - t0
        calls.take()
        calls.take_write_s()
        # The next ticks record the first results the first one left (CHECKS_PER_TICK a tick).
        converge, t_converge = 0, 0.0
        while converge < max_converge:
            t0 = time.perf_counter()
            reqs, ev2, cursor = backlog_tick(defs, name, instance, cursor)
            dt = time.perf_counter() - t0
            if not calls.take().get(StorageCalls.STORED):
                break
            converge, t_converge = converge + 1, t_converge + dt
        calls.take_write_s()
        steady, steady_w, steady_calls = [], [], {}
        steady_stored: list[int] = []
        check_runs: list[int] = []
        parts: list[dict[str, float]] = []
        for _ in range(repeats):
            phases.take(0.0)
            t0 = time.perf_counter()
            reqs, ev2, cursor, n_checks = backlog_tick_checks(defs, name, instance, cursor)
            steady.append(time.perf_counter() - t0)
            parts.append(phases.take(steady[-1]))
            steady_w.append(calls.take_write_s())
            steady_calls = calls.take()
            steady_stored.append(steady_calls.get(StorageCalls.STORED, 0))
            check_runs.append(n_checks)
    n = s.partitions
    tag = "" if label == "sqlite" else f" ({label})"
    med = statistics.median(steady)
    med_w = statistics.median(steady_w)
    med_parts = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    return (f"sensor tick {n} partitions{tag}: {med:.3f} s"
            + (f" ({med - med_w:.3f} s without recording its "
               f"{statistics.median(steady_stored):g} check results)" if med_w else "")
            + f"; steady ticks recorded {sum(steady_stored)} check results and requested "
            f"{sum(check_runs)} check runs\n"
            f"  detail {label} {n}: first tick {first:.3f} s, {first - first_w:.3f} s without "
            f"its check writes (storage calls {first_calls}); the daemon writes "
            f"{len(written)} of its {len(first_events)} observations: {t_write:.1f} s; "
            f"{converge} more tick(s) recording checks ({t_converge:.1f} s"
            f"{'' if converge < max_converge else ', stopped there'}); "
            f"steady tick storage calls {steady_calls}, {len(ev2)} events; steady tick parts "
            f"(medians, s): {fmt_phases(med_parts)}; "
            f"{reqs} run requests; history {history} run(s) per partition + 5 failures on 1% "
            f"(added in {t_hist:.1f} s)")


def sqlite_instance(tmp: str) -> contextlib.AbstractContextManager[DagsterInstance]:
    return instance_for_test(temp_dir=tempfile.mkdtemp(dir=tmp))


@contextlib.contextmanager
def postgres_instance(server: PostgresServer) -> Iterator[DagsterInstance]:
    name = f"bench_{uuid.uuid4().hex[:8]}"
    url = server.create_database(name).replace("postgresql://", "postgresql+psycopg2://", 1)
    # Loading the history is one transaction per run: without waiting for each commit's
    # flush (a bench-only setting of this throwaway database; reads are unaffected).
    server.psql(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    with instance_for_test(overrides={"storage": {"postgres": {"postgres_url": url}}}) as inst:
        yield inst


# ------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--history", type=int, default=2,
                    help="successful runs per partition in each instance's history")
    ap.add_argument("--no-max", action="store_true", help="16, 64, 256 partitions")
    ap.add_argument("--max-converge", type=int, default=200,
                    help="ticks recording the first tick's leftover first results, at most")
    ap.add_argument("--no-postgres", action="store_true", help="SQLite instance only")
    ap.add_argument("--smoke", action="store_true", help="16 and 64 partitions, one repeat")
    args = ap.parse_args()
    if args.smoke:
        sizes, args.repeats, args.messages = [16, 64], 1, 2_000
    else:
        sizes = [16, 64, 256] if args.no_max else [256, 4096]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "store") as srv, \
            contextlib.ExitStack() as stack:
        pg = None if args.no_postgres else stack.enter_context(PostgresServer())
        asyncio.run(setup(srv.url, sizes, args.messages))
        print(f"setup {time.perf_counter() - t_start:.1f} s: {args.messages} messages per "
              f"stream (every partition has a backlog); CHECKS_PER_TICK {CHECKS_PER_TICK}, "
              f"CHECK_RUNS_PER_TICK {CHECK_RUNS_PER_TICK}",
              flush=True)
        kinds = ["sqlite"] + ([] if pg is None else ["postgres"])
        for kind in kinds:
            for n in sizes:
                cm = sqlite_instance(tmp) if kind == "sqlite" else postgres_instance(pg)
                with cm as instance:
                    print(measure(instance, kind, spec(f"s{n}", f"g{n}", n), srv.url,
                                  f"{tmp}/wh", args.repeats, args.history,
                                  args.max_converge), flush=True)
        for n in sizes:
            print(f"lag observations per day at a 30 s tick, {n} partitions with a backlog all "
                  f"day: {lag_events_per_day(n, 30.0, steady=True):,} under steady traffic "
                  f"(once per partition per lag_refresh_s = {DEFAULT_LAG_REFRESH_S:g} s), at "
                  f"most {lag_events_per_day(n, 30.0):,} whatever the traffic (the per-partition "
                  f"budget); none for idle partitions; the one-per-60-s rule of before "
                  f"{n * 1440:,}", flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
