"""Migrating an elastic group to a new partition count, online and resumable: the NATS steps
of :mod:`cg_pipelines.core.migration` (read it first: the barrier, the exact cut, the lineage).

State lives in cg's own KV bucket (:data:`~cg_pipelines.jetstream.run_layout.RUNS_BUCKET`,
never a reference bucket): key ``<stream>.<group>.migration`` holds the running migration's
record (deleted when it is done), ``<stream>.<group>.lineage`` the group's epochs, which runs
read to find a moved key's state (:func:`get_lineage`).

Requires nats-server 2.15 or later for an R3 work queue with ``js_snapshot_sources`` on
(``notes/REPARTITIONING.md`` §2.5): the new source's position must survive a leader change
once the work queue is emptied.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import nats.js.errors as jserr
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    StorageType,
)
from nats.js.kv import KeyValue

from cg_pipelines.core.config import config_key, work_queue_stream_name
from cg_pipelines.core.errors import ConfigError, MigrationError, StateError, UsageError
from cg_pipelines.core.migration import (
    Epoch,
    Lineage,
    Migration,
    Observation,
    Step,
    anchors,
    check_target,
    decide_cut,
    migrated_config,
)
from cg_pipelines.jetstream.admin import work_queue_stream_config
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.columns import origin_of
from cg_pipelines.jetstream.kv import ConfigStore
from cg_pipelines.jetstream.run_layout import RUNS_BUCKET

__all__ = ["MigrationOptions", "get_lineage", "get_migration", "migrate", "migrate_set"]

PROBE = 64
"""Work-queue sequences below the last one probed for a message still stored (an anchor of
the counted cut rule, :func:`~cg_pipelines.core.migration.anchors`) before the first stored
message is used."""

Hook = Callable[[str, Migration], None]
"""Called with ``"<step>:start"`` before a step's action, ``"<step>:acted"`` after its NATS
change and before its record (steps that change NATS), and ``"<step>"`` once it is recorded
(progress, and the tests' kill -9 at every step)."""


@dataclass(frozen=True, slots=True)
class MigrationOptions:
    """How long the waiting steps wait (seconds) before :class:`MigrationError` (the migration
    stays where it is; run it again to go on).

    Attributes:
        drain_timeout_s: for the old layout's runs to empty the work queue.
        first_message_timeout_s: for the new source's first stored message (then
            ``opt_start_seq`` is cleared).
        poll_s: between checks.
        cut_origin_seq: the first origin sequence of the new layout, when the work queue
            cannot tell it (:func:`~cg_pipelines.core.migration.decide_cut` ``given``).
    """

    drain_timeout_s: float = 600.0
    first_message_timeout_s: float = 600.0
    poll_s: float = 0.25
    cut_origin_seq: int | None = None


def _key(stream: str, group: str, what: str) -> str:
    return f"{config_key(stream, group)}.{what}"


async def _bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    try:
        return await js.key_value(RUNS_BUCKET)
    except jserr.BucketNotFoundError:
        return await js.create_key_value(KeyValueConfig(
            bucket=RUNS_BUCKET, history=1, storage=StorageType.FILE, replicas=replicas,
            description="cg-pipelines: run layouts of consumer groups (cg runs set)"))


async def _get(js: JetStreamContext, key: str) -> bytes | None:
    try:
        kv = await js.key_value(RUNS_BUCKET)
        entry = await kv.get(key)
    except (jserr.BucketNotFoundError, jserr.KeyNotFoundError, jserr.KeyDeletedError):
        return None
    return entry.value


async def get_lineage(js: JetStreamContext, stream: str, group: str) -> Lineage | None:
    """The group's epochs, or ``None`` when it was never migrated.

    Raises:
        ConfigError: the stored value is not a lineage.
        nats errors, TimeoutError: the KV read failed.
    """
    key = _key(stream, group, "lineage")
    data = await _get(js, key)
    return None if data is None else Lineage.decode(data, f"{RUNS_BUCKET}/{key}")


async def get_migration(js: JetStreamContext, stream: str, group: str) -> Migration | None:
    """The group's running migration, or ``None``.

    Raises:
        ConfigError: the stored value is not a migration record.
    """
    key = _key(stream, group, "migration")
    data = await _get(js, key)
    return None if data is None else Migration.decode(data, f"{RUNS_BUCKET}/{key}")


class _Run:
    """One call of :func:`migrate`: its clients, names and hook."""

    def __init__(self, js: JetStreamContext, stream: str, group: str,
                 options: MigrationOptions, hook: Hook | None) -> None:
        self.js, self.api = js, JetStreamAPI.from_js(js)
        self.stream, self.group, self.opt, self.hook = stream, group, options, hook
        self.wq = work_queue_stream_name(stream, group)
        self.store = ConfigStore(self.js, "elastic")

    async def record(self, rec: Migration) -> Migration:
        kv = await _bucket(self.js)
        await kv.put(_key(self.stream, self.group, "migration"), rec.encode())
        if self.hook is not None:
            self.hook(rec.step, rec)
        return rec

    def starting(self, step: Step, rec: Migration, what: str = "start") -> None:
        if self.hook is not None:
            self.hook(f"{step}:{what}", rec)

    async def wq_info(self) -> dict[str, Any]:
        return await self.api.stream_info(self.wq)

    async def observe(self) -> tuple[Observation, dict[str, Any]]:
        info = await self.wq_info()
        origin = await self.api.stream_info(self.stream)
        state = info["state"]
        held = await self.stored(int(state["last_seq"]), int(state["first_seq"])) \
            if int(state.get("messages") or 0) else None
        return Observation(int(origin["state"]["last_seq"]), int(state["last_seq"]),
                           held), info

    async def stored(self, last: int, first: int) -> tuple[int, int] | None:
        """``(work-queue sequence, origin sequence)`` of a message the work queue holds: the
        nearest below ``last`` within :data:`PROBE`, else its first; ``None`` for none."""
        msg = None
        for seq in range(last, max(first, last - PROBE) - 1, -1):
            msg = await self.api.msg_get(self.wq, seq=seq)
            if msg is not None:
                break
        if msg is None:
            msg = await self.api.msg_get(self.wq, seq=first, next_by_subj=">")
        s = origin_of(msg.headers) if msg is not None else None
        return None if msg is None or s is None else (msg.seq, s)

    async def count_origin(self, after: int, k: int, filters: list[str]) -> int | None:
        """The origin sequence of the ``k``-th message on ``filters`` after origin sequence
        ``after`` (``after`` itself for ``k = 0``), read with an ephemeral consumer
        (headers only, no acks, memory); ``None`` when the origin holds fewer."""
        if k == 0:
            return after
        info = await self.js.add_consumer(self.stream, ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1,
            ack_policy=AckPolicy.NONE, filter_subjects=filters, headers_only=True,
            mem_storage=True, inactive_threshold=60.0))
        try:
            sub = await self.js.pull_subscribe_bind(consumer=info.name, stream=self.stream)
            seq, left = after, k
            while left:
                try:
                    msgs = await sub.fetch(min(left, 1000), timeout=2.0)
                except TimeoutError:
                    return None  # fewer messages than the source took: the origin lost some
                for m in msgs[:left]:
                    seq = m.metadata.sequence.stream
                left -= min(left, len(msgs))
            await sub.unsubscribe()
            return seq
        finally:
            await self.api.delete_consumer(self.stream, info.name)

    # ------------------------------------------------------------------------------ steps

    async def plan(self, to: int) -> Migration:
        cfg = (await self.store.get(self.stream, self.group)).config
        check_target(cfg, to)
        before, info = await self.observe()
        sources = info["config"].get("sources") or []
        if len(sources) != 1 or sources[0].get("name") != self.stream:
            raise StateError(f"work queue {self.wq} does not source {self.stream} alone "
                             f"(sources: {[s.get('name') for s in sources]}): not a group "
                             "this migration knows how to cut")
        rec = Migration(cfg.max_members, to, "planned", before, None, sources[0])
        self.starting("planned", rec)
        return await self.record(rec)

    async def remove_source(self, rec: Migration) -> Migration:
        self.starting("source_removed", rec)
        info = await self.wq_info()
        config = info["config"]
        if config.get("sources"):
            before, _ = await self.observe()  # the freshest anchor, recorded before the removal
            rec = await self.record(Migration(rec.from_partitions, rec.to_partitions,
                                              "planned", before, None, rec.source))
            await self.api.update_stream({**config, "sources": []})
            self.starting("source_removed", rec, "acted")
            info = await self.wq_info()
        state = info["state"]
        last = int(state["last_seq"])
        msg = await self.api.msg_get(self.wq, seq=last) if last else None
        last_origin = origin_of(msg.headers) if msg is not None else None
        counted = None
        if last_origin is None and self.opt.cut_origin_seq is None:
            origin = await self.api.stream_info(self.stream)
            held = await self.stored(last, int(state["first_seq"])) \
                if int(state.get("messages") or 0) else None
            filters = [t["src"] for t in rec.source.get("subject_transforms") or []] or [">"]
            for w, s in anchors(stored=held, recorded=rec.before,
                                lineage=await get_lineage(self.js, self.stream, self.group),
                                origin_first_seq=int(origin["state"]["first_seq"]),
                                wq_last_seq=last):
                counted = await self.count_origin(s, last - w, filters)
                if counted is not None:
                    break
        cut = decide_cut(wq_last_seq=last, last_origin=last_origin, counted_origin=counted,
                         given=self.opt.cut_origin_seq)
        if cut is None:
            raise MigrationError(
                f"{self.stream}.{self.group}: the work queue's source is removed, but the exact "
                f"cut cannot be read (its last message {last} was consumed, and the origin "
                "stream no longer holds every message after one whose position is known): run "
                "the migration again with --cut-origin-seq N, N one above the highest origin "
                "sequence your table's commits recorded (cg.last_origin_seq)")
        return await self.record(rec.at("source_removed", cut=cut))

    async def drain(self, rec: Migration) -> Migration:
        self.starting("drained", rec)
        deadline = time.monotonic() + self.opt.drain_timeout_s
        while True:
            info = await self.wq_info()
            if info["config"].get("sources"):
                # the removal did not last (e.g. a server killed before it stored the
                # update): the old source sourced on, so cut again, from what is there now
                rec = await self.remove_source(Migration(
                    rec.from_partitions, rec.to_partitions, "planned", rec.before, None,
                    rec.source))
                continue
            left = int(info["state"].get("messages") or 0)
            if not left:
                return await self.record(rec.at("drained"))
            if time.monotonic() >= deadline:
                raise MigrationError(
                    f"{self.stream}.{self.group}: {left:,} messages of the "
                    f"{rec.from_partitions}-partition layout are still in {self.wq} after "
                    f"{self.opt.drain_timeout_s:g} s (are its runs launched?); run the "
                    "migration again to go on waiting")
            await asyncio.sleep(self.opt.poll_s)

    async def write_config(self, rec: Migration) -> Migration:
        self.starting("config_written", rec)
        to = rec.to_partitions
        await self.store.update(self.stream, self.group,
                                lambda c: c if c.max_members == to else migrated_config(c, to))
        self.starting("config_written", rec, "acted")
        return await self.record(rec.at("config_written"))

    async def add_source(self, rec: Migration) -> Migration:
        self.starting("source_added", rec)
        assert rec.cut is not None  # recorded at source_removed
        cfg = (await self.store.get(self.stream, self.group)).config
        lineage = await get_lineage(self.js, self.stream, self.group) or \
            Lineage((Epoch(rec.from_partitions),))
        kv = await _bucket(self.js)
        # the lineage first: a run of the new layout must find its keys' old partitions
        await kv.put(_key(self.stream, self.group, "lineage"), lineage.then(Epoch(
            rec.to_partitions, rec.cut.first_origin_seq, rec.cut.first_wq_seq)).encode())
        info = await self.wq_info()
        config = info["config"]
        want = work_queue_stream_config(
            self.stream, self.group, cfg, replicas=int(config.get("num_replicas") or 1),
            storage=str(config.get("storage") or "file"))["sources"][0]
        there = config.get("sources") or []
        if there and [s.get("subject_transforms") for s in there] != \
                [want["subject_transforms"]]:
            raise StateError(
                f"{self.wq} sources {[s.get('name') for s in there]} with transforms "
                f"{[s.get('subject_transforms') for s in there]}, not the migration's "
                f"{want['subject_transforms']}: the source's removal was undone (a server "
                "restart before it was stored?) after the config changed; remove that source "
                "(its messages are of the old layout) and run the migration again")
        if not there:
            await self._drop_retired_consumers(rec.to_partitions)
            source = {**rec.source, "subject_transforms": want["subject_transforms"],
                      "opt_start_seq": rec.cut.first_origin_seq}
            await self.api.update_stream({**config, "sources": [source]})
            self.starting("source_added", rec, "acted")
        return await self.record(rec.at("source_added"))

    async def _drop_retired_consumers(self, partitions: int) -> None:
        """Delete the work queue's consumers whose every filter is a partition that no longer
        exists (``<p>.…`` with ``p >= partitions``, after a migration to fewer)."""
        for c in await self.api.list_consumers(self.wq):
            cc = c.get("config") or {}
            filters = cc.get("filter_subjects") or ([cc["filter_subject"]]
                                                    if cc.get("filter_subject") else [])
            parts = [re.match(r"(\d+)\.", f) for f in filters]
            if filters and all(m is not None and int(m.group(1)) >= partitions for m in parts):
                await self.api.delete_consumer(self.wq, str(c["name"]))

    async def finish(self, rec: Migration) -> None:
        self.starting("done", rec)
        assert rec.cut is not None
        deadline = time.monotonic() + self.opt.first_message_timeout_s
        while True:
            info = await self.wq_info()
            if int(info["state"]["last_seq"]) >= rec.cut.first_wq_seq:
                break
            if time.monotonic() >= deadline:
                raise MigrationError(
                    f"{self.stream}.{self.group}: the new source has stored no message yet "
                    f"(none published from origin sequence {rec.cut.first_origin_seq} on, in "
                    f"{self.opt.first_message_timeout_s:g} s); runs go on meanwhile; run the "
                    "migration again to finish (it clears opt_start_seq)")
            await asyncio.sleep(self.opt.poll_s)
        config = info["config"]
        sources = [{k: v for k, v in s.items() if k != "opt_start_seq"}
                   for s in config.get("sources") or []]
        if sources != config.get("sources"):
            await self.api.update_stream({**config, "sources": sources})
            self.starting("done", rec, "acted")
        if self.hook is not None:
            self.hook("done", rec.at("done"))
        kv = await _bucket(self.js)
        await kv.delete(_key(self.stream, self.group, "migration"))


async def migrate(js: JetStreamContext, stream: str, group: str, to_partitions: int,
                  options: MigrationOptions | None = None, *,
                  hook: Hook | None = None) -> Lineage:
    """Migrate elastic group ``stream``/``group`` to ``to_partitions`` partitions, or finish
    a migration to it that stopped (the steps of :mod:`cg_pipelines.core.migration`).

    While it runs, runs of the old layout must go on draining the work queue (the Dagster
    sensors and Airflow triggers do); reference members of the group stop when the KV config
    changes (the reference's rule) and are restarted on the new config; your code's partition
    count must then become ``to_partitions`` (runs with the old count are refused with a
    ``ConfigError`` naming both).

    Returns:
        The group's lineage, the new epoch last.

    Raises:
        ConfigError: a target that cannot be (:func:`~cg_pipelines.core.migration.
            check_target`), e.g. the current count.
        StateError: a migration to another count is running (finish it first), or the work
            queue does not have one source, the origin stream.
        MigrationError: a step must wait longer (the work queue not drained, no message of
            the new layout yet) or the cut cannot be read: run it again.
        GroupNotFoundError, nats errors: as the reads and writes fail.
    """
    (lineage,) = await migrate_set(js, [(stream, group)], to_partitions, options, hook=hook)
    return lineage


async def migrate_set(js: JetStreamContext, groups: Sequence[tuple[str, str]],
                      to_partitions: int, options: MigrationOptions | None = None, *,
                      hook: Hook | None = None) -> list[Lineage]:
    """Migrate several elastic groups together (a co-partitioned set: partition ``p`` of each
    is drained by one run), or finish such a migration: each step is done for every group
    before any group starts the next, so the groups' sources are all cut before the drain,
    all drained before a config changes, and all configs written before a source comes back
    (co-partitioned runs are refused meanwhile: the groups' counts differ). ``groups``:
    ``(stream, group)`` pairs. As :func:`migrate` otherwise; returns each group's lineage.

    Raises:
        ConfigError: as :func:`migrate`; every group already has ``to_partitions``
            partitions; or the groups' counts differ.
        UsageError: no group, or a group named twice.
    """
    if not groups or len(set(groups)) != len(groups):
        raise UsageError(f"migrate_set needs distinct groups, got {list(groups)}")
    opt = options or MigrationOptions()
    runs = [_Run(js, stream, group, opt, hook) for stream, group in groups]
    recs: list[Migration | None] = []
    for run in runs:
        rec = await get_migration(js, run.stream, run.group)
        if rec is not None and rec.to_partitions != to_partitions:
            raise StateError(
                f"{run.stream}.{run.group}: a migration from {rec.from_partitions} to "
                f"{rec.to_partitions} partitions is at step {rec.step!r}: finish it first "
                f"(cg elastic migrate {run.stream} {run.group} --partitions "
                f"{rec.to_partitions})")
        recs.append(rec)
    if all(r is None for r in recs) or len(runs) > 1:
        todo = [i for i, r in enumerate(recs) if r is None
                and not await _migrated_to(runs[i], to_partitions, started=any(recs))]
        counts = {(await runs[i].store.get(runs[i].stream, runs[i].group)).config.max_members
                  for i in todo}
        if len(counts) > 1:
            raise ConfigError("partitions", f"the groups {list(groups)} have different "
                              f"partition counts {sorted(counts)}: not one co-partitioned set")
        for i in todo:
            recs[i] = await runs[i].plan(to_partitions)
    steps = (("planned", _Run.remove_source), ("source_removed", _Run.drain),
             ("drained", _Run.write_config), ("config_written", _Run.add_source))
    for step, action in steps:
        for i, run in enumerate(runs):
            rec = recs[i]
            if rec is not None and rec.step == step:
                recs[i] = await action(run, rec)
    for run, rec in zip(runs, recs, strict=True):
        if rec is not None:
            await run.finish(rec)
    out = []
    for run in runs:
        lineage = await get_lineage(js, run.stream, run.group)
        assert lineage is not None  # written at source_added
        out.append(lineage)
    return out


async def _migrated_to(run: _Run, partitions: int, *, started: bool) -> bool:
    """Whether the group is done with a migration to ``partitions`` while others of its set
    are not (``started``): its count and its lineage's last epoch are ``partitions``."""
    if not started:
        return False
    cfg = (await run.store.get(run.stream, run.group)).config
    lineage = await get_lineage(run.js, run.stream, run.group)
    return cfg.max_members == partitions and lineage is not None \
        and lineage.partitions == partitions
