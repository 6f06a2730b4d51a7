"""Pure rules of the per-partition state snapshot and of compaction (no I/O).

A state snapshot holds each key's last row (greatest order column) over the rows of a SET of
data files of one consumer-group partition, the files it *covers*. Delta data files are
immutable and their names unique (delta-rs names them with a UUID), so:

* while every covered file is still live, the partition's rows are the covered files' rows
  plus those of the live files not covered: the exact state is the snapshot merged with the
  last rows of the uncovered live files (:func:`catch_up_files`). Nothing else is needed, so
  a snapshot written late, twice, by a zombie or by a run killed halfway is still exact: it can
  only be older, never wrong.
* a covered file that is no longer live (a rebuild replaced the partition, a compaction
  rewrote it, someone deleted rows) makes the snapshot unusable (``None``): the state is then
  read from the table itself and a new snapshot written.
* a rewrite that changes no row (a compaction: Delta ``remove``/``add`` actions with
  ``dataChange = false``) of files that were ALL covered keeps the rows of the covered set:
  the snapshot covers ``covered - removed + added`` afterwards (:func:`after_rewrite`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from cg_pipelines.core.errors import UsageError

__all__ = ["after_rewrite", "catch_up_files", "needs_compaction"]


def catch_up_files(covered: Collection[str], live: Sequence[str]) -> list[str] | None:
    """The live files a snapshot covering ``covered`` does not cover (in ``live``'s order),
    or ``None`` when a covered file is no longer live (the snapshot is unusable).

    Args:
        covered: data file paths (relative to the table root, as in the Delta log) the
            snapshot was computed from.
        live: the partition's live data file paths in the current version.

    >>> catch_up_files({"a"}, ["a", "b"])
    ['b']
    >>> catch_up_files({"a", "x"}, ["a", "b"]) is None
    True
    """
    live_set = set(live)
    if any(f not in live_set for f in covered):
        return None
    cov = set(covered)
    return [f for f in live if f not in cov]


def after_rewrite(covered: Collection[str], removed: Iterable[str],
                  added: Iterable[str]) -> frozenset[str] | None:
    """The files a snapshot covers after a rewrite that kept every row (a compaction) removed
    ``removed`` and added ``added``; ``None`` when a removed file was not covered (its rows,
    now in the added files, are not in the snapshot: it is unusable).

    >>> sorted(after_rewrite({"a", "b", "c"}, ["a", "b"], ["ab"]))
    ['ab', 'c']
    >>> after_rewrite({"a"}, ["a", "b"], ["ab"]) is None
    True
    """
    cov = set(covered)
    gone = set(removed)
    if not gone <= cov:
        return None
    return frozenset((cov - gone) | set(added))


def needs_compaction(sizes: Iterable[int], min_files: int, target_size: int) -> int:
    """How many of a partition's live files are small (under ``target_size`` bytes) when
    there are at least ``min_files`` of them, else 0 (nothing to compact).

    Raises:
        UsageError: ``min_files < 2`` or ``target_size < 1``.

    >>> needs_compaction([10, 10, 10], 3, 100)
    3
    >>> needs_compaction([10, 10, 500], 3, 100)
    0
    """
    if min_files < 2:
        raise UsageError(f"min_files must be >= 2 (one file is not compacted), got {min_files}")
    if target_size < 1:
        raise UsageError(f"target_size must be >= 1 byte, got {target_size}")
    small = sum(1 for s in sizes if s < target_size)
    return small if small >= min_files else 0
