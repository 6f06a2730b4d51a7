"""Is an orchestrator's run that still shows as in progress lost? One rule for every driver.

A run worker can die without the orchestrator hearing of it: killed with its host (a node
failure, an evicted pod), its state stays "started" and the one-run-per-partition limit stalls
the partition until a run timeout ends it. Any host can tell such a run from a live one by what
NATS holds:

- the run's **heartbeat** (:mod:`cg_pipelines.jetstream.liveness`): while a run lives, a thread
  of its process publishes a message with a per-message TTL of ``ttl_s`` seconds every
  ``ttl_s / 3`` seconds on a subject named after the run; the server deletes it ``ttl_s``
  seconds after the last one (server clock: no clock of another host is compared);
- its partition's **lease** (:mod:`cg_pipelines.engine.lease`): a live run holding a partition
  is its pinned client (it pulls every third of the pin timeout);
- on the deciding host itself, the run worker's **process** (``/proc``): the fast path.

:func:`judge_run` decides from those; drivers (the Dagster backlog sensor, any other) read them
and act. The bound: a run is judged lost only when no heartbeat of it is left — its process
published none for ``ttl_s`` seconds, i.e. it stalled for at least ``2/3 ttl_s`` past a due
beat — **and** none of its partitions' leases has a pinned holder, **and** it started more than
``grace_s`` seconds ago (time for a run to write its first beat), or when its process is seen
gone on this host. Anything unknown (NATS not answering, no heartbeat written by this kind of
run) keeps it alive: a wrong "lost" fails a live run, while a missed one only waits for the
orchestrator's own timeout. Even a wrong verdict loses nothing: the engine's lease and fenced
commit keep a second run of the partition from double-committing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cg_pipelines.core.errors import ConfigError

__all__ = [
    "HEARTBEAT_SUBJECT_PREFIX",
    "LOST_RUN_GRACE_S",
    "RunSighting",
    "Verdict",
    "heartbeat_subject",
    "judge_run",
]

HEARTBEAT_SUBJECT_PREFIX = "cg.liveness"
"""Subjects of run heartbeats: ``cg.liveness.<run id>``."""

LOST_RUN_GRACE_S = 120.0
"""Seconds after a run started during which it is never judged lost for lack of a heartbeat
(a run writes its first beat when it starts working, after its process started)."""

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def heartbeat_subject(run_id: str) -> str:
    """The subject of a run's heartbeat, ``cg.liveness.<run_id>``.

    Raises:
        ConfigError: ``run_id`` is not 1-128 characters of ``[A-Za-z0-9_-]`` (one subject
            token; Dagster's run ids are UUIDs).
    """
    if not _TOKEN.match(run_id):
        raise ConfigError("run_id", f"must be 1-128 characters of [A-Za-z0-9_-] (one subject "
                                    f"token), got {run_id!r}")
    return f"{HEARTBEAT_SUBJECT_PREFIX}.{run_id}"


@dataclass(frozen=True, slots=True)
class RunSighting:
    """What a driver saw of one in-progress run.

    Attributes:
        run_id: the orchestrator's run id.
        age_s: seconds since the run started (the orchestrator's record; small clock skews
            between hosts only shift it by the skew, far below ``grace_s``).
        process_gone: the run worker's process on this host: ``True`` gone (or its pid now
            belongs to another process), ``False`` running, ``None`` cannot tell (another
            host, no ``/proc``, no worker recorded).
        heartbeat: ``True`` an unexpired heartbeat of the run exists, ``False`` none, ``None``
            not known (NATS did not answer, or the run writes none).
        pinned: ``True`` a lease of one of the run's partitions has a pinned holder, ``False``
            none has, ``None`` not known.
    """

    run_id: str
    age_s: float
    process_gone: bool | None = None
    heartbeat: bool | None = None
    pinned: bool | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """:func:`judge_run`'s answer: ``lost`` and the reason, one line naming the evidence."""

    lost: bool
    reason: str


def judge_run(seen: RunSighting, grace_s: float = LOST_RUN_GRACE_S) -> Verdict:
    """Whether an in-progress run is lost, from a :class:`RunSighting`.

    In order: a process seen gone on this host is lost, one seen running is alive; then a run
    with a heartbeat, with a pinned lease, with anything unknown, or younger than ``grace_s``
    seconds is alive; else it is lost (no heartbeat for its TTL and no pinned holder).

    Raises:
        ConfigError: ``grace_s`` is negative.
    """
    if grace_s < 0:
        raise ConfigError("grace_s", f"must be >= 0 seconds, got {grace_s!r}")
    if seen.process_gone is True:
        return Verdict(True, "its run worker process is gone from this host (killed or out of "
                             "memory)")
    if seen.process_gone is False:
        return Verdict(False, "its run worker process is running on this host")
    if seen.heartbeat is True:
        return Verdict(False, "its heartbeat is live")
    if seen.pinned is True:
        return Verdict(False, "its partition's lease has a pinned holder")
    if seen.heartbeat is None or seen.pinned is None:
        return Verdict(False, "its heartbeat or lease could not be read")
    if seen.age_s < grace_s:
        return Verdict(False, f"it started {seen.age_s:.0f} s ago (grace {grace_s:g} s)")
    return Verdict(True, "no heartbeat of it is left (its process published none for the "
                         "heartbeat's TTL: lost with its host, killed, or frozen) and its "
                         "partition's lease has no pinned holder")
