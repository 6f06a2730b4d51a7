"""Origin <-> work-queue reconciliation of an elastic group: the reads (the judgement is
:mod:`cg_pipelines.core.reconcile_window`, pure, over :mod:`cg_pipelines.core.reconcile`; the
cursor :class:`~cg_pipelines.core.coverage.ReconcileCursor`).

One check (a "tick") goes on from its cursor and reads, in this order (so a message a run
commits and purges meanwhile is still seen: the coverage is read after the work queue):

1. the origin stream's info (the window: from the cursor on, at most ``max_messages`` origin
   sequences) and the work queue's (its source's ``lag`` and ``active``);
2. the work queue's backlog up to the window's end (``Nats-Stream-Source`` origin sequences;
   sourcing is in origin order, so the scan stops past the window);
3. the coverage the engine recorded with each commit since the cursor's Delta version
   (``coverage``: e.g. :class:`~cg_pipelines.engine.coverage_log.DeltaLogCoverage`), at most
   ``max_versions`` versions;
4. the dead-letter stream (``Cg-Origin-Sequence``: dead letters of commits older than
   coverage);
5. the origin window's subjects, times and headers (batched direct get: the origin needs
   ``allow_direct``), partitioned as the work queue's transform does, and judged
   (:func:`~cg_pipelines.core.reconcile_window.judge_window`): a matching message nobody
   covers is a gap only when the source has passed it; otherwise it is "not yet sourced" (a
   stall or a lag, reported as :class:`~cg_pipelines.core.reconcile.SourcingStall`), and the
   cursor stops before it.

The source has passed origin sequence ``s`` when a message at or after ``s`` was in the work
queue before the backlog scan (sourcing is in order): still queued, or settled by a commit read
by an earlier check or of work-queue sequences stored when this check began; or when the source
is active (contact within ``stall_after_s``) with lag 0 and ``s`` was published more than
``grace_s`` ago (a gap at the very end of the origin).

Cost of a tick: at most ``max_messages`` origin messages, the work-queue backlog before the
window's end, at most ``max_versions`` small commit-file reads, and the dead letters; the
cursor's own size is bounded (see the class). Nothing is written here (the caller stores the
cursor).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from nats.js import JetStreamContext

from cg_pipelines.core.config import dlq_stream_name, work_queue_stream_name
from cg_pipelines.core.coverage import CommitCoverage, ReconcileCursor
from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.partitioning import SubjectPartitioner
from cg_pipelines.core.reconcile import ORIGIN_SEQ_HEADER, REPLAY_OF_HEADER, ReconcileReport
from cg_pipelines.core.reconcile_window import (
    ReconcileWindow,
    SourceState,
    fold_coverage,
    judge_window,
)
from cg_pipelines.core.record import SEQ_COLUMN
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import StreamNotFoundError
from cg_pipelines.jetstream.rangeread import read_range

__all__ = ["DEFAULT_MAX_MESSAGES", "DEFAULT_MAX_VERSIONS", "CoverageSource", "TableSeqs",
           "reconcile_group", "sink_table_seqs"]

DEFAULT_MAX_MESSAGES = 500_000
"""Origin messages one check reads at most (the window ends at the origin's last sequence)."""

DEFAULT_MAX_VERSIONS = 500
"""Delta versions whose coverage one check reads at most (one small object read each)."""


class CoverageSource(Protocol):
    """Where the engine's recorded coverage is read (blocking; run in a worker thread)."""

    def read(self, after: int, limit: int) -> tuple[list[CommitCoverage], int, bool]:
        """Coverage of the versions after ``after`` (at most ``limit``): ``(commits, last
        version read, caught up)``."""
        ...

TableSeqs = Callable[[int, int], "np.ndarray | pa.Array | pa.ChunkedArray | list[int]"]
"""``table_seqs(first, last)``: the ``_seq`` values (origin sequences) of the group's table rows
with ``first <= _seq <= last`` (blocking; run in a worker thread)."""

_CHUNK = 20_000  # messages per direct-get read (bench/range_read.py)


def sink_table_seqs(sink: Any, column: str = SEQ_COLUMN) -> TableSeqs:
    """A :data:`TableSeqs` reading ``column`` from a sink with
    ``read(columns=[...], filter=<pyarrow expression>)`` (e.g.
    :class:`~cg_pipelines.sinks.delta.DeltaSink`; a missing table reads as no rows). The reader
    raises ``UsageError`` when the table lacks ``column``."""
    def read(first: int, last: int) -> pa.ChunkedArray:
        flt = (pc.field(column) >= first) & (pc.field(column) <= last)
        try:
            table = sink.read(columns=[column], filter=flt)
        except (KeyError, pa.ArrowInvalid) as e:
            raise UsageError(f"the table has no usable {column!r} column (each row's origin "
                             f"sequence): {str(e).splitlines()[0]}") from e
        return table[column] if column in table.column_names else pa.chunked_array(
            [], pa.int64())
    return read


async def _scan(api: JetStreamAPI, stream: str, first: int, last: int,
                timeout_s: float) -> list[pa.Table]:
    """Every stored message of ``stream`` in ``[first, last]`` as record tables (with
    ``origin_seq``)."""
    out: list[pa.Table] = []
    seq = max(1, first)
    while seq <= last:
        got = await read_range(api.nc, stream, seq, filter_subject=">", max_msgs=_CHUNK,
                               last_seq=last, timeout_s=timeout_s, api_prefix=api.prefix,
                               drop_nats_headers=True)
        if got.num_rows:
            out.append(got.table(origin=True))
        if got.ended or not got.num_rows:
            break
        seq = got.next_seq
    return out


def _header_ints(headers: pa.ChunkedArray | pa.Array, name: str) -> list[int]:
    """The integer values of header ``name`` in a column of JSON header dicts."""
    col = headers if isinstance(headers, pa.ChunkedArray) else pa.chunked_array([headers])
    mask = pc.fill_null(pc.match_substring(col, f'"{name}"'), False)
    out: list[int] = []
    for text in col.filter(mask).to_pylist():
        value = json.loads(text).get(name)
        if isinstance(value, list):  # nats-py keeps repeated headers as a list
            value = value[-1] if value else None
        if value is not None and str(value).isdigit():
            out.append(int(value))
    return out


def _partitions(config: Any, subjects: pa.ChunkedArray) -> np.ndarray:
    """Each subject's group partition (-1: no filter matches), computed once per subject."""
    if not len(subjects):
        return np.array([], dtype=np.int64)
    part = SubjectPartitioner(config)
    enc = pc.dictionary_encode(subjects).combine_chunks()
    lut = np.array([-1 if (p := part(s)) is None else p for s in enc.dictionary.to_pylist()],
                   dtype=np.int64)
    out: np.ndarray = lut[enc.indices.to_numpy(zero_copy_only=False)]
    return out


async def _queued(api: JetStreamAPI, wq: str, state: dict[str, Any], upto: int,
                  timeout_s: float) -> np.ndarray:
    """Origin sequences of the work queue's backlog, up to the first one past ``upto``."""
    out: list[np.ndarray] = []
    if not int(state.get("messages") or 0):
        return np.array([], np.int64)
    seq, last = max(1, int(state.get("first_seq") or 1)), int(state.get("last_seq") or 0)
    while seq <= last:
        got = await read_range(api.nc, wq, seq, filter_subject=">", max_msgs=_CHUNK,
                               last_seq=last, timeout_s=timeout_s, api_prefix=api.prefix,
                               drop_nats_headers=True)
        if not got.num_rows:
            break
        o = got.table(origin=True)["origin_seq"].drop_null().to_numpy(zero_copy_only=False)
        out.append(o.astype(np.int64))
        if got.ended or (len(o) and int(o[-1]) > upto):
            break
        seq = got.next_seq
    return np.concatenate(out) if out else np.array([], np.int64)


async def _dead(api: JetStreamAPI, dlq: str) -> list[int]:
    """Origin sequences of the dead letters in dead-letter stream ``dlq``."""
    try:
        info = await api.stream_info(dlq)
    except StreamNotFoundError:
        return []
    st = info.get("state") or {}
    dead: list[int] = []
    if int(st.get("messages") or 0):
        for t in await _scan(api, dlq, int(st.get("first_seq") or 1),
                             int(st.get("last_seq") or 0), api.timeout):
            dead += _header_ints(t["headers"], ORIGIN_SEQ_HEADER)
    return dead


def _source(info: dict[str, Any], stream: str) -> SourceState:
    """The work queue's source for ``stream`` (``active`` is reported in nanoseconds)."""
    for s in info.get("sources") or []:
        if s.get("name") == stream:
            active = int(s.get("active") if s.get("active") is not None else -1)
            return SourceState(True, int(s.get("lag") or 0),
                               active / 1e9 if active >= 0 else -1.0)
    return SourceState(False)


async def reconcile_group(
    js: JetStreamContext,
    api: JetStreamAPI,
    stream: str,
    group: str,
    *,
    coverage: CoverageSource | None = None,
    cursor: ReconcileCursor | None = None,
    table_seqs: TableSeqs | None = None,
    from_seq: int | None = None,
    to_seq: int | None = None,
    max_messages: int = DEFAULT_MAX_MESSAGES,
    max_versions: int = DEFAULT_MAX_VERSIONS,
    grace_s: float = 10.0,
    stall_after_s: float = 30.0,
) -> ReconcileReport:
    """One check (tick) that every origin message of elastic ``group`` reached its work queue
    and was accounted for (see the module docstring).

    Args:
        coverage: the engine's recorded coverage (e.g. :class:`~cg_pipelines.engine.
            coverage_log.DeltaLogCoverage` of the group's table). ``None``: only the work
            queue, the dead letters and ``table_seqs`` count (before any run, or for an old
            table).
        cursor: where the previous check stopped; updated in place (the caller stores it).
            ``None``: a fresh cursor at ``from_seq`` (default: the last ``max_messages``
            origin sequences).
        table_seqs: an extra reader of covered origin sequences (:data:`TableSeqs`, e.g. the
            ``_seq`` column of an append table written before coverage was recorded).
        from_seq: with a fresh cursor, the first origin sequence to check.
        to_seq: last origin sequence to check (default: the origin's last).
        max_messages: origin messages read at most (>= 1).
        max_versions: Delta versions read at most (>= 1).
        grace_s: seconds a message may take to be sourced (see the module docstring).
        stall_after_s: seconds without contact after which the source counts as stalled.

    Returns:
        A :class:`~cg_pipelines.core.reconcile.ReconcileReport`: ``gaps`` are all the open gaps
        the cursor knows (repaired ones drop out as their coverage is read); ``stall`` when
        the source is behind; ``partial`` when the check should go on (the window stopped
        short of ``to_seq`` / the origin's end, or versions are left to read).

    Raises:
        GroupNotFoundError, ConfigError: no usable elastic group config.
        StreamNotFoundError: the origin or work-queue stream is missing.
        JetStreamUnavailableError: the origin (or work queue) does not allow direct get.
        JetStreamError, RequestTimeoutError: other API failures.
        CoverageLogError, OSError: the coverage cannot be read.
        UsageError: ``max_messages`` or ``max_versions`` < 1.
    """
    if max_messages < 1 or max_versions < 1:
        raise UsageError(f"max_messages and max_versions must be >= 1, got {max_messages} "
                         f"and {max_versions}")
    wq = work_queue_stream_name(stream, group)
    config = (await admin.get_elastic(js, stream, group, timeout=api.timeout)).config
    # 1. the streams' states
    origin_state = (await api.stream_info(stream)).get("state") or {}
    last = int(origin_state.get("last_seq") or 0)
    first_stored = max(1, int(origin_state.get("first_seq") or 1))
    if cursor is None:
        cursor = ReconcileCursor(origin_through=(from_seq - 1) if from_seq is not None
                                 else max(0, last - max_messages))
    end = last if to_seq is None else min(last, to_seq)
    lo = max(first_stored, cursor.origin_through + 1)
    hi = min(end, lo + max_messages - 1)
    wq_info = await api.stream_info(wq)
    source = _source(wq_info, stream)
    now = time.time()
    # 2. the work queue's backlog (before the coverage: a message committed meanwhile is
    # in the coverage read after)
    queued = await _queued(api, wq, wq_info.get("state") or {}, hi, api.timeout)
    # Evidence that the source passed an origin sequence must predate the backlog scan
    # (else a message sourced just after the scan and not committed yet would look lost):
    # commits read by earlier checks, commits of work-queue messages stored before this
    # check began (wq sequence <= wq_top), the backlog itself (sourcing is in order).
    wq_top = int((wq_info.get("state") or {}).get("last_seq") or 0)
    evidence = max([cursor.origin_through, *cursor.committed.values()])
    # 3. the recorded coverage
    read = 0
    done = coverage is None
    while coverage is not None and not done and read < max_versions:
        commits, upto, done = await asyncio.to_thread(
            coverage.read, cursor.version, min(500, max_versions - read))
        read += max(0, upto - cursor.version)
        evidence = fold_coverage(cursor, commits, wq_top, evidence)
        if upto == cursor.version:
            done = True
        cursor.version = upto
    # 4. dead letters (and an old table's rows)
    dead = np.asarray(await _dead(api, dlq_stream_name(stream, group)), np.int64)
    in_table = np.array([], np.int64)
    if table_seqs is not None and hi >= lo:
        got = await asyncio.to_thread(table_seqs, lo, hi)
        if isinstance(got, pa.ChunkedArray | pa.Array):
            got = got.drop_null().to_numpy(zero_copy_only=False)
        in_table = np.asarray(got, dtype=np.int64)
    # 5. the origin window, judged (cg_pipelines.core.reconcile_window)
    origin = await _scan(api, stream, lo, hi, api.timeout) if hi >= lo else []
    seqs = (np.concatenate([t["seq"].to_numpy() for t in origin]).astype(np.int64)
            if origin else np.array([], np.int64))
    subjects = pa.chunked_array([c for t in origin for c in t["subject"].chunks], pa.string())
    headers = pa.chunked_array([c for t in origin for c in t["headers"].chunks], pa.string())
    times = (np.concatenate([t["time"].cast(pa.int64()).to_numpy() for t in origin])
             if origin else np.array([], np.int64))
    replayed = np.asarray(_header_ints(headers, REPLAY_OF_HEADER) if len(headers) else [],
                          np.int64)
    window = ReconcileWindow(
        stream, group, lo, hi, end, seqs, _partitions(config, subjects), times, source,
        queued=queued, dead=dead, replayed=replayed, in_table=in_table, evidence=evidence,
        caught_up=bool(done), versions_read=read, now_s=now, grace_s=grace_s,
        stall_after_s=stall_after_s)
    return judge_window(window, cursor)
