"""Which partition of an elastic group an origin-stream subject belongs to, computed the way the
group's work-queue stream computes it (pure; used to rebuild a partition from the origin
stream's history).

The work-queue stream sources the origin stream with one subject transform per partitioning
filter, as the reference implementation (synadia-io/orbit.go ``pcgroups`` v0.2.1) creates it: a
``{{Partition(N,i,j)}}`` transform, which nats-server evaluates with 32-bit FNV-1a over the
selected tokens concatenated without separator. So a subject matching filter ``f`` goes to
partition ``FNV-1a(selected wildcard tokens joined) mod max_members``; a subject matching no
filter is not sourced at all. With no partitioning filter the whole subject is hashed.
"""

from __future__ import annotations

from cg_pipelines.core.config import ElasticConfig
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.subjects import partition_for

__all__ = ["SubjectPartitioner", "partition_key", "partition_keys", "partition_of",
           "subject_matches"]


def partition_key(prefix: str, partition: int) -> str:
    """The orchestrator's partition key of group partition ``partition``: ``<prefix><p>``
    (Dagster partition key, Airflow ``partition_key``; e.g. ``legs-3``)."""
    return f"{prefix}{partition}"


def partition_keys(prefix: str, partitions: int) -> list[str]:
    """All ``partitions`` keys (:func:`partition_key`), in partition order."""
    return [partition_key(prefix, p) for p in range(partitions)]


def partition_of(prefix: str, key: str, partitions: int, name: str) -> int:
    """The partition of key ``key`` (``<prefix><p>``, ``0 <= p < partitions``, no leading
    zeros); ``name`` names the asset or Dag in the error.

    Raises:
        ConfigError: ``key`` is not one of the ``partitions`` keys with ``prefix``.
    """
    tail = key[len(prefix):] if key.startswith(prefix) else ""
    if not tail.isdigit() or int(tail) >= partitions or str(int(tail)) != tail:
        raise ConfigError("partition_key", f"{key!r} is not a partition key of "
                          f"{name} ({partition_key(prefix, 0)} .. "
                          f"{partition_key(prefix, partitions - 1)})")
    return int(tail)


def subject_matches(subject: str, filter_subject: str) -> bool:
    """Whether the literal ``subject`` matches ``filter_subject`` (NATS wildcards: ``*`` one
    token, ``>`` one or more trailing tokens)."""
    sub, flt = subject.split("."), filter_subject.split(".")
    for i, f in enumerate(flt):
        if f == ">":
            return len(sub) > i
        if i >= len(sub) or (f != "*" and f != sub[i]):
            return False
    return len(sub) == len(flt)


class SubjectPartitioner:
    """``partitioner(subject)``: the group partition of an origin subject, or ``None`` when no
    partitioning filter matches it (the work queue never held it). Results are cached per
    subject (streams repeat subjects; the cache holds at most ``max_cached`` of them)."""

    def __init__(self, config: ElasticConfig, max_cached: int = 1_000_000) -> None:
        self.n = config.max_members
        self.filters = [(p.filter, tuple(p.partitioning_wildcards))
                        for p in config.partitioning_filters]
        self._cache: dict[str, int | None] = {}
        self._max = max_cached

    def __call__(self, subject: str) -> int | None:
        got = self._cache.get(subject, -1)
        if got != -1:
            return got
        p = self._compute(subject)
        if len(self._cache) < self._max:
            self._cache[subject] = p
        return p

    def _compute(self, subject: str) -> int | None:
        if not self.filters:
            return partition_for([subject], self.n)
        for flt, wildcards in self.filters:
            if not subject_matches(subject, flt):
                continue
            if not wildcards:
                return partition_for([subject], self.n)
            tokens = subject.split(".")
            stars = [i for i, tok in enumerate(flt.split(".")) if tok == "*"]
            return partition_for([tokens[stars[w - 1]] for w in wildcards], self.n)
        return None
