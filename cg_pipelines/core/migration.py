"""Migrating an elastic group to a new partition count: the plan, the exact cut and the
partition lineage (issue 51; ``notes/REPARTITIONING.md`` §2.3, §3 "Barrier", §8). Pure: the
NATS steps are :mod:`cg_pipelines.jetstream.migration`.

**The barrier migration.** NATS partitions with ``{{Partition(N, ...)}}`` in the work queue's
source transform; a new count means a new transform, and a source whose transform changes is
a new source (its identity holds the transform) that the server starts by time unless told a
sequence. So the migration cuts the origin stream at an exact sequence and orders the two
layouts with a barrier:

1. ``planned``: the migration is recorded (from ``N`` to ``V`` partitions).
2. ``source_removed``: the work queue's source is removed; no origin message reaches the work
   queue from now on. Its last sequence ``L`` is final for the old layout, and the **cut**
   ``C`` (the first origin sequence the new layout sources) is read exactly
   (:func:`decide_cut`, :func:`anchors`).
3. ``drained``: runs of the old layout drain the work queue (nothing changes for them: the
   group still has ``N`` partitions); the step ends when it holds no message. Every message of
   the old layout is then committed (a run acknowledges after its commit), so no key's newer
   message can run before its older ones, whatever ``V`` is (a multiple, a divisor or
   neither).
4. ``config_written``: the reference KV config gets ``max_members = V`` (first, as the
   reference's maintainers ask, orbit.net#45): reference members see a configuration change
   and stop (the reference's rule; restart them on the new config).
5. ``source_added``: the source is added back with the new transform and
   ``opt_start_seq = C``: every origin message from ``C`` on is sourced once, under ``V``.
6. ``done``: once the new source has stored a message, ``opt_start_seq`` is cleared (so the
   work queue's config is again exactly what the reference's ``CreateElastic`` makes, and a
   restart of the source resumes from its own state, never from the cut again) and the
   group's :class:`Lineage` gains the new epoch.

Each step is recorded before the next starts and checks what is already done, so a migration
killed at any step is finished by running it again.

**Lineage.** Keys move between partitions: a key's last committed row (its per-key state) may
be under a partition of an earlier epoch. :meth:`Lineage.parents` names them: partition ``c``
of ``V`` holds keys of partition ``q`` of ``N`` exactly when ``c ≡ q (mod gcd(N, V))``
(``h mod gcd`` is the same for both, for the hash ``h`` of the key; the notes §2.1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from cg_pipelines.core.config import ElasticConfig, MemberMapping
from cg_pipelines.core.errors import ConfigError, StateError

__all__ = ["STEPS", "Cut", "Epoch", "Lineage", "Migration", "Observation", "Step",
           "anchors", "check_target", "decide_cut", "migrated_config", "plan_lines"]

Step = Literal["planned", "source_removed", "drained", "config_written", "source_added", "done"]
STEPS: tuple[Step, ...] = ("planned", "source_removed", "drained", "config_written",
                           "source_added", "done")
"""The migration's steps, in order (module docstring)."""


@dataclass(frozen=True, slots=True)
class Epoch:
    """One partition count of a group's life.

    Attributes:
        partitions: the count (``max_members``).
        first_origin_seq: the first origin-stream sequence sourced under it (1 for the first).
        first_wq_seq: the first work-queue sequence under it (1 for the first).
    """

    partitions: int
    first_origin_seq: int = 1
    first_wq_seq: int = 1

    def to_dict(self) -> dict[str, int]:
        return {"partitions": self.partitions, "first_origin_seq": self.first_origin_seq,
                "first_wq_seq": self.first_wq_seq}


@dataclass(frozen=True, slots=True)
class Lineage:
    """A group's epochs, oldest first (one epoch: never migrated).

    Raises:
        ConfigError: no epoch, a count below 1, or sequences not increasing.
    """

    epochs: tuple[Epoch, ...]

    def __post_init__(self) -> None:
        if not self.epochs:
            raise ConfigError("epochs", "a lineage has one epoch or more")
        for a, b in zip(self.epochs, self.epochs[1:], strict=False):
            if b.first_origin_seq <= a.first_origin_seq or b.first_wq_seq <= a.first_wq_seq:
                raise ConfigError("epochs", f"sequences must increase: {a} then {b}")
        bad = [e.partitions for e in self.epochs if e.partitions < 1]
        if bad:
            raise ConfigError("epochs", f"partition counts must be >= 1, got {bad}")

    @property
    def partitions(self) -> int:
        """The current partition count."""
        return self.epochs[-1].partitions

    def parents(self, partition: int) -> tuple[int, ...]:
        """The partitions of earlier epochs (other than ``partition`` itself, whose rows are
        the partition's own) that may hold the last rows of keys now in ``partition``: for an
        earlier count ``n`` and the current ``V``, ``{q < n : q ≡ partition (mod gcd(n, V))}``.
        Sorted; empty when never migrated."""
        v = self.partitions
        found: set[int] = set()
        for e in self.epochs[:-1]:
            g = math.gcd(e.partitions, v)
            found.update(q for q in range(partition % g, e.partitions, g))
        found.discard(partition)
        return tuple(sorted(found))

    def then(self, epoch: Epoch) -> Lineage:
        """This lineage with ``epoch`` appended (idempotent for an equal last epoch); it
        replaces the last epoch when that one held no message (``epoch`` starts at the same
        work-queue sequence): no key can be under its partitions."""
        last = self.epochs[-1]
        if last == epoch:
            return self
        if last.first_wq_seq == epoch.first_wq_seq:
            return Lineage((*self.epochs[:-1], epoch))
        return Lineage((*self.epochs, epoch))

    def encode(self) -> bytes:
        return json.dumps({"epochs": [e.to_dict() for e in self.epochs]}).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> Lineage:
        """Parse a stored lineage (``where`` names the key in errors).

        Raises:
            ConfigError: not a lineage (the stored text quoted).
        """
        try:
            return cls(tuple(Epoch(int(e["partitions"]), int(e["first_origin_seq"]),
                                   int(e["first_wq_seq"]))
                             for e in json.loads(data)["epochs"]))
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError("lineage", f"{where} holds {data[:200]!r}, not a lineage "
                              f"({type(e).__name__}: {e})") from None


@dataclass(frozen=True, slots=True)
class Observation:
    """What the migration saw just before removing the source.

    Attributes:
        origin_last_seq: the origin stream's last sequence.
        wq_last_seq: the work queue's last sequence.
        anchor: ``(work-queue sequence, origin sequence)`` of a message the work queue held
            then (its ``Nats-Stream-Source`` header), or ``None`` when it held none.
    """

    origin_last_seq: int
    wq_last_seq: int
    anchor: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Cut:
    """Where the new layout starts.

    Attributes:
        first_origin_seq: the first origin sequence the new source stores (``S + 1`` for the
            last origin sequence ``S`` the old source stored).
        first_wq_seq: the first work-queue sequence of the new layout (``L + 1``).
        how: which rule of :func:`decide_cut` found it (``header``, ``counted`` or
            ``given``).
    """

    first_origin_seq: int
    first_wq_seq: int
    how: str


def anchors(*, stored: tuple[int, int] | None, recorded: Observation | None,
            lineage: Lineage | None, origin_first_seq: int, wq_last_seq: int
            ) -> list[tuple[int, int]]:
    """Pairs ``(w, s)``: work-queue sequence ``w`` held origin sequence ``s`` (or, for a
    virtual pair, the source's first message after ``w`` is the origin's first matching
    message after ``s``), from which counting ``L - w`` origin messages gives the origin
    sequence of work-queue message ``L``. Best (fewest to count) first; only pairs the origin
    still holds every message after (``origin_first_seq <= s + 1``: a stream trimmed past
    ``s`` would be counted short, a cut too late).

    - ``stored``: a message the work queue holds now;
    - ``recorded``: the one it held before the source was removed;
    - the lineage's last epoch: its source started at ``first_origin_seq``, after work-queue
      sequence ``first_wq_seq - 1``;
    - ``(0, 0)`` for a group never migrated: its source started at the origin's beginning.
    """
    found = [a for a in (stored, recorded.anchor if recorded else None) if a is not None]
    if lineage is not None and len(lineage.epochs) > 1:
        e = lineage.epochs[-1]
        found.append((e.first_wq_seq - 1, e.first_origin_seq - 1))
    else:
        found.append((0, 0))
    ok = {a for a in found if a[0] <= wq_last_seq and origin_first_seq <= a[1] + 1}
    return sorted(ok, key=lambda a: wq_last_seq - a[0])


def decide_cut(*, wq_last_seq: int, last_origin: int | None, counted_origin: int | None,
               given: int | None = None) -> Cut | None:
    """The exact cut after the source was removed, or ``None`` when it cannot be known.

    The old source stored origin messages in order, one work-queue message each, and
    ``wq_last_seq`` (``L``) is its last. The rules, in order:

    - ``given``: the operator's first origin sequence (``cg elastic migrate
      --cut-origin-seq``).
    - ``header``: message ``L`` is still in the work queue: its ``Nats-Stream-Source`` origin
      sequence ``last_origin`` is ``S``.
    - ``counted``: ``counted_origin``, the origin sequence reached by counting the
      ``L - w`` origin messages on the source's filters after an anchor ``(w, s)``
      (:func:`anchors`; the I/O side counts them).

    (The source's reported ``lag`` is not used: the server updates it as messages arrive, so
    a source that has not yet received the newest messages reports 0.)
    """
    first_wq = wq_last_seq + 1
    if given is not None:
        if given < 1:
            raise ConfigError("cut_origin_seq", f"must be >= 1, got {given}")
        return Cut(given, first_wq, "given")
    if last_origin is not None:
        return Cut(last_origin + 1, first_wq, "header")
    if counted_origin is not None:
        return Cut(counted_origin + 1, first_wq, "counted")
    return None


def check_target(config: ElasticConfig, to_partitions: int) -> None:
    """Refuse a migration of ``config`` to ``to_partitions`` partitions that cannot be done.

    Raises:
        ConfigError: ``to_partitions`` below 1 or equal to the current count; or the group
            uses member mappings and the new count is not a multiple of the old (the
            mappings are carried over by ``q mod N``, which needs ``N | V``).
    """
    n = config.max_members
    if isinstance(to_partitions, bool) or not isinstance(to_partitions, int) or to_partitions < 1:
        raise ConfigError("partitions", f"must be an integer >= 1, got {to_partitions!r}")
    if to_partitions == n:
        raise ConfigError("partitions", f"the group already has {n} partitions")
    if config.member_mappings and to_partitions % n:
        raise ConfigError("partitions", (
            f"the group maps partitions to members (member_mappings): {to_partitions} is not a "
            f"multiple of {n}, so the mappings cannot be carried over; set members instead "
            "(cg elastic members) or migrate to a multiple"))
    ElasticConfig(max_members=to_partitions).validate()  # e.g. above MAX_MEMBERS


def migrated_config(config: ElasticConfig, to_partitions: int) -> ElasticConfig:
    """``config`` with ``to_partitions`` partitions: members kept; a member mapping of
    partition ``p`` gets every new partition ``q`` with ``q mod N = p`` (:func:`check_target`
    first)."""
    check_target(config, to_partitions)
    n = config.max_members
    mappings = tuple(
        MemberMapping(m.member, tuple(q for q in range(to_partitions) if q % n in m.partitions))
        for m in config.member_mappings)
    return replace(config, max_members=to_partitions, member_mappings=mappings).validate()


@dataclass(frozen=True, slots=True)
class Migration:
    """A migration's record (kept in NATS while it runs; the module docstring's steps).

    Attributes:
        from_partitions, to_partitions: the counts.
        step: the last step done.
        before: what was seen before the source was removed (set at ``planned``).
        cut: the exact cut (set at ``source_removed``).
        source: the origin stream's source entry as it was (its transforms and any other
            field), to add back with the new transform.
    """

    from_partitions: int
    to_partitions: int
    step: Step = "planned"
    before: Observation | None = None
    cut: Cut | None = None
    source: Mapping[str, Any] = field(default_factory=dict)

    def at(self, step: Step, **changes: Any) -> Migration:
        """This record at ``step`` (with ``changes``).

        Raises:
            StateError: ``step`` is earlier than the recorded one.
        """
        if STEPS.index(step) < STEPS.index(self.step):
            raise StateError(f"migration step {step!r} after {self.step!r}")
        return replace(self, step=step, **changes)

    def encode(self) -> bytes:
        b, c = self.before, self.cut
        return json.dumps({
            "from_partitions": self.from_partitions, "to_partitions": self.to_partitions,
            "step": self.step,
            "before": None if b is None else {"origin_last_seq": b.origin_last_seq,
                                              "wq_last_seq": b.wq_last_seq,
                                              "anchor": b.anchor},
            "cut": None if c is None else {"first_origin_seq": c.first_origin_seq,
                                           "first_wq_seq": c.first_wq_seq, "how": c.how},
            "source": dict(self.source),
        }).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> Migration:
        """Parse a stored record.

        Raises:
            ConfigError: not a migration record (the stored text quoted).
        """
        try:
            d = json.loads(data)
            step = d["step"]
            if step not in STEPS:
                raise ConfigError("step", f"unknown step {step!r}")
            b, c = d.get("before"), d.get("cut")
            return cls(int(d["from_partitions"]), int(d["to_partitions"]), step,
                       None if b is None else Observation(
                           int(b["origin_last_seq"]), int(b["wq_last_seq"]),
                           None if b.get("anchor") is None
                           else (int(b["anchor"][0]), int(b["anchor"][1]))),
                       None if c is None else Cut(int(c["first_origin_seq"]),
                                                  int(c["first_wq_seq"]), str(c["how"])),
                       dict(d.get("source") or {}))
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError("migration", f"{where} holds {data[:200]!r}, not a migration "
                              f"record ({type(e).__name__}: {e})") from None


def plan_lines(stream: str, group: str, from_partitions: int, to_partitions: int,
               backlog: int, done: Iterable[Step] = (), *, mapped: bool = False) -> list[str]:
    """What ``cg elastic migrate --dry-run`` prints: each step and what it does here
    (``backlog``: the work queue's messages now; ``done``: steps a recorded migration already
    did; ``mapped``: the group maps partitions to members). Check the target first
    (:func:`check_target`)."""
    n, v = from_partitions, to_partitions
    moved = 1 - min(n, v) / math.lcm(n, v)
    finished = set(done)
    what: dict[Step, str] = {
        "planned": f"record the migration of {stream}.{group} from {n} to {v} partitions",
        "source_removed": f"remove the work queue's source (origin {stream}): new messages wait "
                          "in the origin stream; read the exact cut",
        "drained": f"wait until runs of the {n}-partition layout drain the work queue "
                   f"({backlog:,} messages now)",
        "config_written": "write max_members=" + str(v) + (
            f" and member mappings by q mod {n}" if mapped else "")
            + " to the reference KV config: reference members stop (restart them on it)",
        "source_added": f"add the source back with {{{{Partition({v},...)}}}} from the cut "
                        "(opt_start_seq)",
        "done": "after the new source's first message: clear opt_start_seq; record the epoch",
    }
    lines = [f"{'done ' if s in finished else '     '}{i + 1}. {s}: {what[s]}"
             for i, s in enumerate(STEPS)]
    lines.append(f"keys that change partition: {moved:.0%} (their state is read from their "
                 f"old partitions); your code's partition count must become {v}")
    return lines
