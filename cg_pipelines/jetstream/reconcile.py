"""Origin <-> work-queue reconciliation of an elastic group: the reads (the logic is
:mod:`cg_pipelines.core.reconcile`).

One check reads, in this order (so a message a run commits and purges meanwhile is still seen
in the table, read last):

1. the origin stream's info (the window: at most ``max_messages`` origin sequences) and the
   work queue's (its source's lag);
2. the origin window's subjects and headers (batched direct get: the origin needs
   ``allow_direct``), partitioned as the work queue's transform does;
3. the work queue's whole backlog (``Nats-Stream-Source`` origin sequences);
4. the dead-letter stream (``Cg-Origin-Sequence``);
5. the table's ``_seq`` values in the window, through ``table_seqs`` (the caller's reader: the
   ``cg`` command and the Dagster check read the Delta table).

Cost: the window's origin messages plus the work queue's backlog plus the dead letters, each read
once in bulk, and one column of the table in the window; nothing is written.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from nats.js import JetStreamContext

from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.core.partitioning import SubjectPartitioner
from cg_pipelines.core.reconcile import (
    ORIGIN_SEQ_HEADER,
    REPLAY_OF_HEADER,
    ReconcileReport,
    find_gaps,
)
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import StreamNotFoundError
from cg_pipelines.jetstream.rangeread import read_range

__all__ = ["DEFAULT_MAX_MESSAGES", "TableSeqs", "reconcile_group", "sink_table_seqs"]

DEFAULT_MAX_MESSAGES = 500_000
"""Origin messages one check reads at most (the window ends at the origin's last sequence)."""

TableSeqs = Callable[[int, int], "np.ndarray | pa.Array | pa.ChunkedArray | list[int]"]
"""``table_seqs(first, last)``: the ``_seq`` values (origin sequences) of the group's table rows
with ``first <= _seq <= last`` (blocking; run in a worker thread)."""

_CHUNK = 10_000


def sink_table_seqs(sink: Any, column: str = "_seq") -> TableSeqs:
    """A :data:`TableSeqs` reading ``column`` from a sink with
    ``read(columns=[...], filter=<pyarrow expression>)`` (e.g.
    :class:`~cg_pipelines.sinks.delta.DeltaSink`; a missing table reads as no rows). The reader
    raises ``ValueError`` when the table lacks ``column``."""
    def read(first: int, last: int) -> pa.ChunkedArray:
        flt = (pc.field(column) >= first) & (pc.field(column) <= last)
        try:
            table = sink.read(columns=[column], filter=flt)
        except (KeyError, pa.ArrowInvalid) as e:
            raise ValueError(f"the table has no usable {column!r} column (each row's origin "
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
                               last_seq=last, timeout_s=timeout_s, api_prefix=api.prefix)
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


async def reconcile_group(
    js: JetStreamContext,
    api: JetStreamAPI,
    stream: str,
    group: str,
    *,
    table_seqs: TableSeqs | None = None,
    from_seq: int | None = None,
    max_messages: int = DEFAULT_MAX_MESSAGES,
) -> ReconcileReport:
    """Check that every origin message of elastic ``group`` reached its work queue, over the
    origin window ``[from_seq, from_seq + max_messages - 1]`` (default: the last
    ``max_messages`` origin sequences), capped at the origin's last sequence.

    Args:
        table_seqs: reader of the table's origin sequences (:data:`TableSeqs`). ``None``: no
            table (only before any run: processed messages would count as missing).
        from_seq: first origin sequence to check (e.g. a previous check's ``to_seq + 1``
            when it was ok).
        max_messages: most origin messages read (>= 1).

    Returns:
        A :class:`~cg_pipelines.core.reconcile.ReconcileReport` (``ok`` False with the gaps).

    Raises:
        GroupNotFoundError, ConfigError: no usable elastic group config.
        StreamNotFoundError: the origin or work-queue stream is missing.
        JetStreamUnavailableError: the origin (or work queue) does not allow direct get.
        JetStreamError, RequestTimeoutError: other API failures.
        ValueError: ``max_messages < 1``.
    """
    if max_messages < 1:
        raise ValueError(f"max_messages must be >= 1, got {max_messages}")
    wq = work_queue_stream_name(stream, group)
    config = (await admin.get_elastic(js, stream, group, timeout=api.timeout)).config
    origin_state = (await api.stream_info(stream)).get("state") or {}
    last = int(origin_state.get("last_seq") or 0)
    first_stored = max(1, int(origin_state.get("first_seq") or 1))
    lo = max(first_stored, from_seq if from_seq is not None else last - max_messages + 1)
    hi = min(last, lo + max_messages - 1)
    wq_info = await api.stream_info(wq)
    lag = sum(int(s.get("lag") or 0) for s in wq_info.get("sources") or [])

    # 2. the origin window
    origin = await _scan(api, stream, lo, hi, api.timeout) if hi >= lo else []
    if origin:
        seqs = pa.concat_arrays([t["seq"].combine_chunks() for t in origin])
        subjects = pa.chunked_array([t["subject"].combine_chunks() for t in origin])
        headers = pa.chunked_array([t["headers"].combine_chunks() for t in origin])
    else:
        seqs, subjects, headers = pa.array([], pa.int64()), pa.chunked_array(
            [], pa.string()), pa.chunked_array([], pa.string())
    part = SubjectPartitioner(config)
    enc = pc.dictionary_encode(subjects).combine_chunks() if len(subjects) else None
    if enc is not None:
        lut = np.array([-1 if (p := part(s)) is None else p
                        for s in enc.dictionary.to_pylist()], dtype=np.int64)
        parts = lut[enc.indices.to_numpy(zero_copy_only=False)]
    else:
        parts = np.array([], dtype=np.int64)
    replayed = _header_ints(headers, REPLAY_OF_HEADER) if len(headers) else []

    # 3. the work queue's backlog
    wq_state = wq_info.get("state") or {}
    queued_tables = await _scan(api, wq, int(wq_state.get("first_seq") or 1),
                                int(wq_state.get("last_seq") or 0), api.timeout) \
        if int(wq_state.get("messages") or 0) else []
    queued = np.concatenate([t["origin_seq"].drop_null().to_numpy() for t in queued_tables]) \
        if queued_tables else np.array([], np.int64)

    # 4. the dead letters
    dead: list[int] = []
    try:
        dlq_info = await api.stream_info(f"{wq}-dlq")
    except StreamNotFoundError:
        dlq_info = None
    if dlq_info is not None and int((dlq_info.get("state") or {}).get("messages") or 0):
        st = dlq_info["state"]
        for t in await _scan(api, f"{wq}-dlq", int(st.get("first_seq") or 1),
                             int(st.get("last_seq") or 0), api.timeout):
            dead += _header_ints(t["headers"], ORIGIN_SEQ_HEADER)

    # 5. the table
    in_table = np.array([], np.int64)
    if table_seqs is not None and hi >= lo:
        got = await asyncio.to_thread(table_seqs, lo, hi)
        if isinstance(got, pa.ChunkedArray | pa.Array):
            got = got.drop_null().to_numpy(zero_copy_only=False)
        in_table = np.asarray(got, dtype=np.int64)

    origin_seqs = seqs.to_numpy(zero_copy_only=False)
    expected = origin_seqs[parts >= 0]

    def count(covered: np.ndarray | list[int]) -> int:
        return int(np.isin(expected, np.asarray(covered, np.int64)).sum())

    covered = np.concatenate([queued.astype(np.int64), in_table,
                              np.asarray(dead, np.int64), np.asarray(replayed, np.int64)])
    gaps, tail = find_gaps(origin_seqs, parts, covered, sourcing_done=lag == 0)
    return ReconcileReport(
        stream, group, lo, hi, len(origin_seqs), len(expected), count(queued),
        count(in_table), count(dead), count(replayed), gaps, tail, lag, hi < last)
