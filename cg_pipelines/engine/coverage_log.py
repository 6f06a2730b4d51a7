"""The coverage the engine recorded in a Delta table's log, read version by version, and the
reconcile check's cursor stored beside the table.

Reads ``_delta_log/<version, 20 digits>.json`` (the Delta protocol's commit files: one JSON
action per line, the ``commitInfo`` action holding the commit's ``custom_metadata`` keys, which
is where :class:`~cg_pipelines.sinks.delta.DeltaSink` puts the ``cg.*`` lineage) directly
through a pyarrow filesystem rooted at the table (:func:`~cg_pipelines.sinks.storage.
table_filesystem`): one small read per version, from the cursor's version on, so a check costs
the versions committed since the last one and no snapshot load. Versions that are not the
group's commits (version 0, a maintenance commit such as OPTIMIZE or VACUUM, another group's
commit) carry no coverage and are skipped. A co-partitioned commit (``cg.join``) holds one
entry per input: the group's entry is its coverage, so each input of a set is reconciled on
the set's table as a group is on its own. A commit of a run over several partitions of one
group (``cg.join`` whose entries carry their own ``partition``) holds one entry per partition:
each is that partition's coverage. A drain commit without ``cg.coverage`` (an executor
batch, whose records stay on the Spark executors, or a commit of a library before coverage) is
trusted to cover its partition through its ``cg.last_origin_seq``: not verified.

**Log window rule**: the sink's log cleanup (:mod:`cg_pipelines.sinks.logwindow`) keeps every
version a cursor stored under ``_cg_reconcile/`` has not read, but at most
``Maintenance.log_max_versions`` (500) versions behind the newest; other writers' cleanups go
by ``delta.logRetentionDuration`` (7 days on tables the sink creates, 30 on others). The cursor
never needs a version it already read; a check must therefore run at least once per
``log_max_versions`` commits of the table so it reads every version before cleanup removes it.
When a version after the cursor is gone, :class:`CoverageLogError` says so (the coverage of
those commits is lost; restart the cursor at the current origin position with
``cg reconcile --restart``).

The cursor (:class:`~cg_pipelines.core.coverage.ReconcileCursor`) is stored as
``_cg_reconcile/<stream>.<group>.json`` under the table root: it lives with the table it
describes (the ``cg reconcile`` command, the Dagster check and a sensor share it; nothing else
to deploy), and Delta ignores paths starting with ``_`` (VACUUM keeps them). Last writer wins:
two concurrent checks write about the same cursor, and a lost update only makes the next check
read a little again.
"""

from __future__ import annotations

import json

import pyarrow.fs as pafs

from cg_pipelines.core.coverage import (
    COVERAGE_KEY,
    COVERAGE_THROUGH_KEY,
    JOIN_LINEAGE_KEY,
    CommitCoverage,
    ReconcileCursor,
    decode_seqs,
)
from cg_pipelines.core.errors import CgError, DecodeError

__all__ = ["CoverageLogError", "DeltaLogCoverage", "cursor_path"]

_PREFIX = "cg."
_DATA_OPERATIONS = ("append", "merge", "empty")


class CoverageLogError(CgError, RuntimeError):
    """The table's log no longer holds versions the check has not read (log cleanup)."""


def cursor_path(stream: str, group: str) -> str:
    """Path of the group's reconcile cursor, relative to the table root."""
    return f"_cg_reconcile/{stream}.{group}.json"


class DeltaLogCoverage:
    """Coverage of ``stream``.``group`` from the Delta log under ``fs`` (a filesystem rooted at
    the table, see the module docstring)."""

    def __init__(self, fs: pafs.FileSystem, stream: str, group: str) -> None:
        self.fs, self.stream, self.group = fs, stream, group

    def _commit_info(self, version: int) -> dict[str, object] | None:
        """The version's ``commitInfo`` action; None when the commit file does not exist."""
        try:
            with self.fs.open_input_stream(f"_delta_log/{version:020d}.json") as f:
                text = f.read().decode("utf-8")
        except FileNotFoundError:
            return None
        for line in text.splitlines():
            if '"commitInfo"' in line:
                info = json.loads(line).get("commitInfo")
                return info if isinstance(info, dict) else {}
        return {}

    def _last_checkpoint(self) -> int:
        try:
            with self.fs.open_input_stream("_delta_log/_last_checkpoint") as f:
                return int(json.loads(f.read().decode("utf-8")).get("version") or -1)
        except (FileNotFoundError, ValueError):
            return -1

    def read(self, after: int, limit: int) -> tuple[list[CommitCoverage], int, bool]:
        """The group's coverage in versions ``after + 1`` ... (at most ``limit`` versions).

        Returns:
            ``(commits, last, caught_up)``: the coverage found, the last version read (``after``
            when none), and whether the read reached the table's newest version.

        Raises:
            CoverageLogError: the next version is gone while a later one exists (log cleanup:
                see the module docstring).
            DecodeError: a commit's ``cg.coverage`` is malformed.
            OSError: the storage cannot be read.
        """
        out: list[CommitCoverage] = []
        last = after
        for v in range(after + 1, after + 1 + max(1, limit)):
            info = self._commit_info(v)
            if info is None:
                if self._last_checkpoint() >= v:
                    raise CoverageLogError(
                        f"Delta version {v} is no longer in the table's log (the log cleanup "
                        "holds unread versions for at most Maintenance.log_max_versions, "
                        "500 by default), so the coverage of "
                        "the commits after the reconcile cursor is lost: run the check more "
                        "often than that, and restart its cursor (cg reconcile --restart)")
                return out, last, True
            last = v
            out.extend(self._coverage(v, info))
        return out, last, self._commit_info(last + 1) is None

    def _coverage(self, version: int, info: dict[str, object]) -> list[CommitCoverage]:
        def get(name: str) -> str | None:
            value = info.get(_PREFIX + name)
            return None if value is None else str(value)

        joint = get(JOIN_LINEAGE_KEY)
        if joint is not None:
            return self._joint_coverage(version, get("partition"), joint)
        if get("stream") != self.stream or get("group") != self.group:
            return []
        part, seqs, through = get("partition"), get(COVERAGE_KEY), get(COVERAGE_THROUGH_KEY)
        if seqs is None and through is None and get("operation") in _DATA_OPERATIONS:
            # a commit without recorded coverage: an executor batch, or a library before
            # coverage; trusted to cover its partition through its last origin sequence
            through = get("last_origin_seq")
        if part is None or (seqs is None and through is None):
            return []
        wq_last = get("last_seq")
        return [CommitCoverage(version, int(part), None if seqs is None else decode_seqs(seqs),
                               None if through is None else int(through),
                               None if wq_last is None else int(wq_last))]

    def _joint_coverage(self, version: int, part: str | None, joint: str
                        ) -> list[CommitCoverage]:
        """This group's coverage in a commit over several sides (``cg.join``: one entry per
        side, :data:`~cg_pipelines.core.coverage.JOIN_LINEAGE_KEY`): of a co-partitioned
        commit, the group's one entry, of the commit's ``partition``; of a run over several
        partitions of the group, one per entry, each of its own ``partition``. Empty when the
        commit has no entry for the group or its entries settled nothing.

        Raises:
            DecodeError: ``cg.join`` or the entry's coverage is malformed.
        """
        try:
            entries = json.loads(joint)
            mine = [e for e in entries if isinstance(e, dict)
                    and e.get("stream") == self.stream and e.get("group") == self.group]
        except (ValueError, TypeError) as e:
            raise DecodeError(f"Delta version {version}: cg.{JOIN_LINEAGE_KEY} is not a "
                              f"JSON list of inputs: {e}") from e
        out: list[CommitCoverage] = []
        for entry in mine:
            p = entry.get("partition", part)
            seqs, through = entry.get(COVERAGE_KEY), entry.get(COVERAGE_THROUGH_KEY)
            if p is None or (seqs is None and through is None):
                continue
            wq_last = entry.get("last_seq")
            out.append(CommitCoverage(
                version, int(p), None if seqs is None else decode_seqs(str(seqs)),
                None if through is None else int(through),
                None if wq_last is None else int(wq_last)))
            if "partition" not in entry:
                break  # a co-partitioned commit: one entry per group
        return out

    def load_cursor(self) -> ReconcileCursor | None:
        """The stored cursor, or None (none yet).

        Raises:
            DecodeError: the stored cursor is unreadable (delete it to start over).
        """
        try:
            with self.fs.open_input_stream(cursor_path(self.stream, self.group)) as f:
                return ReconcileCursor.from_json(f.read().decode("utf-8"))
        except FileNotFoundError:
            return None

    def save_cursor(self, cursor: ReconcileCursor) -> bool:
        """Store ``cursor`` (replacing the previous one). Returns False (nothing stored) while
        the table does not exist yet (nothing is created before the table)."""
        if self.fs.get_file_info("_delta_log").type != pafs.FileType.Directory:
            return False
        path = cursor_path(self.stream, self.group)
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(path) as f:
            f.write(cursor.to_json().encode("utf-8"))
        return True

    def delete_cursor(self) -> None:
        """Forget the stored cursor (the next check starts from the beginning)."""
        try:
            self.fs.delete_file(cursor_path(self.stream, self.group))
        except FileNotFoundError:
            pass
