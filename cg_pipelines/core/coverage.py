"""Coverage: which origin sequences a commit accounted for, in a compact text form (pure).

Every data commit of a drain records in its Delta commit info (``cg.coverage``, beside the
other ``cg.*`` lineage keys) the origin sequences of **all** the work-queue messages it settled:
the ones whose rows it wrote, the ones it dead-lettered, and the ones the transform filtered out
(no row). A rebuild records instead that it covers every message of its partition through an
origin sequence (``cg.coverage_through``). The reconcile check (:mod:`cg_pipelines.core.
reconcile`) reads these instead of the table's rows, so merge tables, filtering transforms and
dead letters are covered exactly.

Format of ``cg.coverage`` (version 1): ``"1:" + base64(zlib(deltas))`` where ``deltas`` are the
sorted, distinct sequences' differences (the first one from 0) as little-endian unsigned 32-bit
integers (or 64-bit, prefix ``"2:"``, when a difference does not fit). One partition's
sequences within a batch are close together, so the differences are small and repeat: zlib
(RFC 1950/1951, level 6) stores them in about 1-2 bytes per message, and a contiguous run in a
few bytes. base64 is RFC 4648's standard alphabet.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from cg_pipelines.core.errors import DecodeError, UsageError

__all__ = ["COVERAGE_KEY", "COVERAGE_THROUGH_KEY", "JOIN_LINEAGE_KEY", "MAX_TRACKED_GAP_MESSAGES",
           "CommitCoverage",
           "ReconcileCursor", "decode_seqs", "encode_seqs"]

COVERAGE_KEY = "coverage"
"""Lineage key (``cg.coverage`` in the commit info) of a drain commit's covered sequences."""

COVERAGE_THROUGH_KEY = "coverage_through"
"""Lineage key (``cg.coverage_through``) of a rebuild: every message of its partition with an
origin sequence at or below this one is covered."""

JOIN_LINEAGE_KEY = "join"
"""Lineage key (``cg.join``) of a co-partitioned commit (:mod:`cg_pipelines.engine.join`): a
JSON list, one object per input in the run's order: ``name``, ``stream``, ``group``,
``app_id``, and for a drain ``first_seq``/``last_seq`` (work-queue sequences, null when the input
had nothing in the batch), ``last_origin_seq`` and ``coverage`` (:data:`COVERAGE_KEY`'s encoding,
or null); for a rebuild ``origin_first_seq``, ``origin_last_seq`` and ``coverage_through``. The
commit's ``cg.partition`` is the partition of every input."""

_U32 = "1:"
_U64 = "2:"


def _sorted_distinct(arr: np.ndarray) -> np.ndarray:
    """``arr`` sorted, repeats dropped (a sort: numpy 2.4's ``unique`` is ~15x slower)."""
    arr = np.sort(np.asarray(arr, dtype=np.int64))
    if len(arr) < 2:
        return arr
    return arr[np.concatenate(([True], arr[1:] != arr[:-1]))]


def encode_seqs(seqs: Iterable[int] | np.ndarray) -> str:
    """The compact text of a set of positive sequences (any order, repeats dropped).

    Raises:
        UsageError: a sequence is below 1.
    """
    arr = _sorted_distinct(np.asarray(
        list(seqs) if not isinstance(seqs, np.ndarray) else seqs, dtype=np.int64))
    if len(arr) and arr[0] < 1:
        raise UsageError(f"sequences must be >= 1, got {int(arr[0])}")
    deltas = np.diff(arr, prepend=np.int64(0))
    if len(deltas) and int(deltas.max()) > 0xFFFFFFFF:
        prefix, raw = _U64, deltas.astype("<u8").tobytes()
    else:
        prefix, raw = _U32, deltas.astype("<u4").tobytes()
    return prefix + base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def decode_seqs(text: str) -> np.ndarray:
    """The sequences (int64, ascending, distinct) of an :func:`encode_seqs` text.

    Raises:
        DecodeError: ``text`` is not such a text (names what is wrong).
    """
    if text.startswith(_U32):
        dtype = "<u4"
    elif text.startswith(_U64):
        dtype = "<u8"
    else:
        raise DecodeError(f"coverage text must start with {_U32!r} or {_U64!r}, got "
                          f"{text[:8]!r}")
    try:
        raw = zlib.decompress(base64.b64decode(text[2:], validate=True))
    except (binascii.Error, zlib.error) as e:
        raise DecodeError(f"coverage text is not base64 of zlib data: {e}") from e
    width = np.dtype(dtype).itemsize
    if len(raw) % width:
        raise DecodeError(f"coverage data is {len(raw)} bytes, not a multiple of {width}")
    deltas = np.frombuffer(raw, dtype=dtype).astype(np.int64)
    if len(deltas) and (deltas[0] < 1 or (deltas[1:] < 1).any()):
        raise DecodeError("coverage data is not strictly increasing positive sequences")
    return np.cumsum(deltas, dtype=np.int64)


@dataclass(frozen=True)
class CommitCoverage:
    """The coverage one Delta version of the group records.

    Attributes:
        version: the Delta version.
        partition: the group partition it committed.
        seqs: origin sequences it settled (``cg.coverage``), or None.
        through: a rebuild's ``cg.coverage_through`` (every message of ``partition`` through
            this origin sequence), or None.
        wq_last: the last work-queue sequence it settled (``cg.last_seq``), or None.
    """

    version: int
    partition: int
    seqs: np.ndarray | None
    through: int | None
    wq_last: int | None = None


MAX_TRACKED_GAP_MESSAGES = 1_000_000
"""Gap messages a cursor keeps (to re-check them until repaired); beyond, only counted."""


@dataclass
class ReconcileCursor:
    """Where the incremental reconcile check stands (stored between checks, see
    :meth:`to_json`; the reads are :mod:`cg_pipelines.jetstream.reconcile`'s).

    Attributes:
        origin_through: every matching origin message at or below this sequence is settled:
            covered, or a gap kept in ``gap_seqs``.
        version: Delta versions at or below this one were read (-1: none).
        carry: covered origin sequences above ``origin_through`` from the versions read
            (ascending int64). Bounded by what the commits read cover ahead of the origin scan
            (the partitions' processing skew).
        committed: per partition, the highest origin sequence its commits read cover.
        rebuilt: per partition, a rebuild covers every message of it through this sequence.
        gap_seqs, gap_parts: origin sequences (ascending) and partitions of the open gaps
            (at most :data:`MAX_TRACKED_GAP_MESSAGES`; ``gaps_untracked`` counts the rest).
    """

    origin_through: int = 0
    version: int = -1
    carry: np.ndarray = field(default_factory=lambda: np.array([], np.int64))
    committed: dict[int, int] = field(default_factory=dict)
    rebuilt: dict[int, int] = field(default_factory=dict)
    gap_seqs: np.ndarray = field(default_factory=lambda: np.array([], np.int64))
    gap_parts: np.ndarray = field(default_factory=lambda: np.array([], np.int64))
    gaps_untracked: int = 0
    gap_ranges: list[tuple[int, int]] = field(default_factory=list)
    _more: list[np.ndarray] = field(default_factory=list, repr=False, compare=False)

    def gap_runs(self) -> list[tuple[int, int, int, tuple[int, ...]]]:
        """The open gaps as runs ``(first, last, messages, partitions)`` in origin order: each
        run as found (consecutive missing messages among the matching ones), shrunk to what is
        still open."""
        out = []
        for lo, hi in self.gap_ranges:
            a, b = np.searchsorted(self.gap_seqs, [lo, hi + 1])
            if b > a:
                out.append((int(self.gap_seqs[a]), int(self.gap_seqs[b - 1]), int(b - a),
                            tuple(int(p) for p in np.unique(self.gap_parts[a:b]))))
        return out

    def add_covered(self, seqs: np.ndarray, partition: int | None) -> None:
        """Take a commit's covered sequences (those above ``origin_through`` are kept)."""
        seqs = np.asarray(seqs, np.int64)
        if not len(seqs):
            return
        if partition is not None:
            self.committed[partition] = max(self.committed.get(partition, 0), int(seqs[-1]))
        keep = seqs[seqs > self.origin_through]
        if len(keep):
            self._more.append(keep)
        self.close_gaps(seqs)

    def covered(self) -> np.ndarray:
        """``carry`` with every sequence added since (merged once, here: ascending, distinct)."""
        if self._more:
            self.carry = _sorted_distinct(np.concatenate([self.carry, *self._more]))
            self._more = []
        return self.carry

    def add_rebuilt(self, partition: int, through: int) -> None:
        """A rebuild covered every message of ``partition`` through ``through``."""
        self.rebuilt[partition] = max(self.rebuilt.get(partition, 0), through)
        drop = (self.gap_parts == partition) & (self.gap_seqs <= through)
        self.gap_seqs, self.gap_parts = self.gap_seqs[~drop], self.gap_parts[~drop]

    def close_gaps(self, covered: np.ndarray) -> None:
        """Drop open gaps that ``covered`` (origin sequences) now covers."""
        if len(self.gap_seqs):
            hit = np.isin(self.gap_seqs, covered)
            self.gap_seqs, self.gap_parts = self.gap_seqs[~hit], self.gap_parts[~hit]

    def add_gaps(self, seqs: np.ndarray, parts: np.ndarray,
                 runs: list[tuple[int, int]]) -> None:
        """Keep newly found gap messages, found as ``runs`` (first, last) (beyond the bound:
        counted only)."""
        self.gap_ranges = [r for r in self.gap_ranges if r not in runs] + list(runs)
        room = MAX_TRACKED_GAP_MESSAGES - len(self.gap_seqs)
        if len(seqs) > room:
            self.gaps_untracked += len(seqs) - max(room, 0)
            seqs, parts = seqs[:max(room, 0)], parts[:max(room, 0)]
        order = np.argsort(np.concatenate([self.gap_seqs, seqs]), kind="stable")
        self.gap_seqs = np.concatenate([self.gap_seqs, seqs]).astype(np.int64)[order]
        self.gap_parts = np.concatenate([self.gap_parts, parts]).astype(np.int64)[order]

    def advance(self, through: int) -> None:
        """Everything at or below ``through`` is settled: forget its coverage."""
        self.origin_through = max(self.origin_through, through)
        carry = self.covered()
        self.carry = carry[carry > self.origin_through]

    def to_json(self) -> str:
        """The cursor as one JSON object (sequence sets as :func:`encode_seqs` texts)."""
        return json.dumps({
            "format": 1, "origin_through": self.origin_through, "version": self.version,
            "carry": encode_seqs(self.covered()),
            "committed": {str(k): v for k, v in sorted(self.committed.items())},
            "rebuilt": {str(k): v for k, v in sorted(self.rebuilt.items())},
            "gap_seqs": encode_seqs(self.gap_seqs),
            "gap_parts": [int(p) for p in self.gap_parts],
            "gaps_untracked": self.gaps_untracked,
            "gap_ranges": [[a, b] for a, b in self.gap_ranges if self._open(a, b)]},
            separators=(",", ":"))

    def _open(self, lo: int, hi: int) -> bool:
        a, b = np.searchsorted(self.gap_seqs, [lo, hi + 1])
        return bool(b > a)

    @classmethod
    def from_json(cls, text: str) -> ReconcileCursor:
        """The cursor of a :meth:`to_json` text.

        Raises:
            DecodeError: not such a text (names the problem).
        """
        try:
            d = json.loads(text)
            if d.get("format") != 1:
                raise DecodeError(f"unknown cursor format {d.get('format')!r}")
            gap_seqs = decode_seqs(d["gap_seqs"])
            gap_parts = np.asarray(d["gap_parts"], np.int64)
            if len(gap_parts) != len(gap_seqs):
                raise DecodeError(f"{len(gap_seqs)} gap sequences but {len(gap_parts)} "
                                  "partitions")
            return cls(int(d["origin_through"]), int(d["version"]), decode_seqs(d["carry"]),
                       {int(k): int(v) for k, v in d["committed"].items()},
                       {int(k): int(v) for k, v in d["rebuilt"].items()}, gap_seqs, gap_parts,
                       int(d.get("gaps_untracked") or 0),
                       [(int(a), int(b)) for a, b in d.get("gap_ranges") or []])
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise DecodeError(f"not a reconcile cursor: {type(e).__name__}: {e}") from e
