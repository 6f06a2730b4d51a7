"""The lineage every commit of a :class:`~cg_pipelines.sinks.delta.DeltaSink` carries in its
Delta commit info (``custom_metadata``), shared by its writer (data, empty and replace commits)
and its maintainer (compaction and VACUUM commits); an
:class:`~cg_pipelines.sinks.iceberg.IcebergSink`'s snapshot summaries carry the same keys
(without ``userMetadata``).

Keys: ``cg.stream``, ``cg.group``, ``cg.partition``, ``cg.first_seq``, ``cg.last_seq`` (what
the caller passes as ``lineage``), ``cg.app_id``, ``cg.watermark``, ``cg.write_mode``,
``cg.operation``, ``cg.library_version``, the sink's own ``commit_metadata`` (the Dagster
integration adds ``cg.dagster_run_id``), and the same, less the machine-read ``cg.coverage``,
as one JSON object in ``userMetadata`` (the column Spark's ``DESCRIBE HISTORY`` shows).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

from cg_pipelines.core.coverage import COVERAGE_KEY
from cg_pipelines.version import __version__

__all__ = ["LINEAGE_PREFIX", "CommitLineage", "lineage_key"]

LINEAGE_PREFIX: Final = "cg."
"""Prefix of the lineage keys in each Delta version's commit info (``cg.stream`` ...)."""


def lineage_key(name: str) -> str:
    """``name`` with the ``cg.`` prefix (kept when present)."""
    return name if name.startswith(LINEAGE_PREFIX) else LINEAGE_PREFIX + name


def _user_metadata(md: Mapping[str, str]) -> str:
    """``md`` less the prefix and the coverage, as compact JSON with sorted keys."""
    return json.dumps({k[len(LINEAGE_PREFIX):]: v for k, v in sorted(md.items())
                       if k != lineage_key(COVERAGE_KEY)}, separators=(",", ":"))


class CommitLineage:
    """Builds the ``custom_metadata`` of a sink's commits (see the module docstring)."""

    def __init__(self, write_mode: str, commit_metadata: Mapping[str, str] | None, *,
                 user_metadata: bool = True) -> None:
        """
        Args:
            write_mode: the sink's write mode name (``append``/``merge``).
            commit_metadata: extra lineage for every commit (keys get the ``cg.`` prefix).
            user_metadata: also the human-facing ``userMetadata`` copy (Delta's commit info;
                an Iceberg snapshot summary has no such field).
        """
        self._mode = write_mode
        self._extra = {lineage_key(k): str(v) for k, v in (commit_metadata or {}).items()}
        self._user = user_metadata

    def commit(self, app_id: str, watermark: int, operation: str,
               lineage: Mapping[str, object] | None) -> dict[str, str]:
        """A commit's ``custom_metadata``: ``lineage`` (``None`` values dropped), the app id,
        the ``watermark`` it leaves, the ``operation`` (``append``, ``merge``, ``empty``,
        ``replace_partition``, ``compact``, ``vacuum``) and the sink's own keys."""
        md = {lineage_key(k): str(v) for k, v in (lineage or {}).items() if v is not None}
        md.update({"cg.app_id": app_id, "cg.watermark": str(watermark),
                   "cg.write_mode": self._mode, "cg.operation": operation,
                   "cg.library_version": __version__})
        md.update(self._extra)
        if self._user:
            # The coverage (up to ~3 bytes a message, machine-read by reconcile) is written
            # once: userMetadata is the human-facing copy (Spark's DESCRIBE HISTORY).
            md["userMetadata"] = _user_metadata(md)
        return md

    def create(self) -> dict[str, str]:
        """Version 0's ``custom_metadata``: ``cg.operation`` = ``create``, ``cg.write_mode``,
        ``cg.library_version`` and the sink's own keys (no partition, app id or watermark:
        the table is created for every partition)."""
        md = {"cg.operation": "create", "cg.write_mode": self._mode,
              "cg.library_version": __version__, **self._extra}
        md["userMetadata"] = _user_metadata(md)
        return md
