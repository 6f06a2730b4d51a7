"""Direct-get hits -> Arrow columns, in bulk.

:func:`reply_columns` turns the byte strings a :class:`~cg_pipelines.jetstream.frames.Reply`
collected into :class:`Columns`: ``split_pattern`` and casts for the direct-get header lines, a
vectorised check for the common own-headers block ``Nats-Stream-Source: ...``; only other own
headers take nats-py's header parser, message by message. :func:`stored_columns` builds the
same columns from :class:`~cg_pipelines.jetstream.api.StoredMessage` objects (the plain path).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from nats.aio.client import Client

from cg_pipelines.core.errors import DecodeError
from cg_pipelines.jetstream.api import DIRECT_GET_HEADERS, StoredMessage, parse_rfc3339_ns
from cg_pipelines.jetstream.errors import JetStreamError

__all__ = [
    "Columns",
    "header_columns",
    "int_or_none",
    "origin_of",
    "reply_columns",
    "stored_columns",
    "strip_prefix",
]

_BIG = 1 << 30
_HDR_LINE = b"NATS/1.0\r\n"
_STREAM_SOURCE = "Nats-Stream-Source"
_SOURCE_LINE = "Nats-Stream-Source: "
# The direct-get header lines, in the order the server appends them, and the value offsets.
_SERVER_LINES = (
    "Nats-Stream: ", "Nats-Subject: ", "Nats-Sequence: ", "Nats-Time-Stamp: ",
    "Nats-Num-Pending: ", "Nats-Last-Sequence: ",
)
_ORIGIN_RE = r"\ANats-Stream-Source: [^ ]+ (?P<o>[0-9]{1,18})(?: |\z)"
_JSON_SAFE_RE = r"\A[ !#-\[\]-~]*\z"  # printable ASCII without '"' and '\\'

_parse_header_lines = Client._parse_header_lines


@dataclass
class Columns:
    """Equal-length Arrow arrays of direct-get hits, in sequence order: ``seq`` (int64),
    ``subject``, ``time`` (timestamp[ns, UTC]), ``headers`` (JSON string or null),
    ``origin_seq`` (int64 or null), ``data`` (binary), ``pending`` (``Nats-Num-Pending``)."""

    seq: pa.Array
    subject: pa.Array
    time: pa.Array
    headers: pa.Array
    origin_seq: pa.Array
    data: pa.Array
    pending: pa.Array

    def __len__(self) -> int:
        return len(self.seq)

    def arrays(self) -> tuple[pa.Array, ...]:
        return (self.seq, self.subject, self.time, self.headers, self.origin_seq, self.data,
                self.pending)

    def filter(self, mask: pa.Array) -> Columns:
        return Columns(*(pc.filter(a, mask) for a in self.arrays()))

    def head(self, n: int) -> Columns:
        return Columns(*(a.slice(0, n) for a in self.arrays()))

    @staticmethod
    def concat(parts: list[Columns]) -> Columns:
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return Columns(
                pa.array([], pa.int64()), pa.array([], pa.string()),
                pa.array([], pa.timestamp("ns", tz="UTC")), pa.array([], pa.string()),
                pa.array([], pa.int64()), pa.array([], pa.binary()), pa.array([], pa.int64()))
        return Columns(*(pa.concat_arrays(list(a)) for a in zip(*(p.arrays() for p in parts),
                                                                   strict=True)))


def _user_dict(block: bytes, drop_nats: bool) -> dict[str, str] | None:
    hdrs = _parse_header_lines(block)
    if drop_nats:
        out = {k: v for k, v in hdrs.items() if not k.startswith("Nats-")}
    else:
        out = {k: v for k, v in hdrs.items() if k not in DIRECT_GET_HEADERS}
    return out or None


def origin_of(hdrs: Mapping[str, str] | None) -> int | None:
    """The origin stream sequence (second token of ``Nats-Stream-Source``), or ``None``."""
    v = hdrs.get(_STREAM_SOURCE) if hdrs else None
    if v is None:
        return None
    parts = v.split(" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def header_columns(blocks: list[bytes], arr: pa.Array, drop_nats: bool
                    ) -> tuple[pa.Array, pa.Array]:
    """``headers`` (JSON object string or null) and ``origin_seq`` (int64 or null) of the
    messages' own header blocks (``arr``: the lines after ``NATS/1.0``; ``blocks``: the same as
    Python bytes, with the ``NATS/1.0`` line). Empty blocks and blocks holding only a
    ``Nats-Stream-Source`` line (every sourced message without headers of its own) are done
    with Arrow compute; any other block with nats-py's header parser, one by one."""
    n = len(arr)
    nonempty = pc.greater(pc.binary_length(arr), 0)
    if not pc.any(nonempty).as_py():
        return pa.nulls(n, pa.string()), pa.nulls(n, pa.int64())
    lines = pc.split_pattern(arr, "\r\n")
    first = pc.list_element(lines, 0)
    src_only = pc.and_(pc.equal(pc.list_value_length(lines), 2),
                       pc.starts_with(first, _SOURCE_LINE))
    origin = pc.struct_field(pc.extract_regex(first, _ORIGIN_RE), "o").cast(pa.int64())
    # The common form: one "Nats-Stream-Source: <value>" line, the value printable ASCII
    # without '"' or '\\' and not padded (nats-py strips the padding).
    value = pc.binary_slice(first, len(_SOURCE_LINE), _BIG)
    fast = pc.and_(src_only, pc.and_(
        pc.match_substring_regex(value, _JSON_SAFE_RE),
        pc.invert(pc.or_(pc.starts_with(value, " "), pc.ends_with(value, " ")))))
    if drop_nats:
        headers = pa.nulls(n, pa.string())
    else:
        js = pc.binary_join_element_wise(
            pa.scalar(b'{"Nats-Stream-Source": "'), value, pa.scalar(b'"}'), pa.scalar(b""))
        headers = pc.if_else(fast, js, pa.scalar(None, pa.binary())).cast(pa.string())
    slow = pc.and_(nonempty, pc.invert(fast))
    if pc.any(slow).as_py():
        h_list: list[str | None] = headers.to_pylist()
        o_list: list[int | None] = origin.to_pylist()
        for i in np.flatnonzero(slow.to_numpy(zero_copy_only=False)).tolist():
            block = blocks[i][len(_HDR_LINE):]
            d = _user_dict(block, drop_nats)
            h_list[i] = json.dumps(d) if d else None
            o_list[i] = origin_of(_parse_header_lines(block))
        headers = pa.array(h_list, pa.string())
        origin = pa.array(o_list, pa.int64())
    else:
        origin = pc.if_else(fast, origin, pa.scalar(None, pa.int64()))
    return headers, origin


def _slow_server_columns(
    users: list[bytes], servers: list[bytes]
) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array]:
    """Sequence, subject, time, pending row by row (nats-py's header parser)."""
    seqs: list[int] = []
    subjects: list[str] = []
    times: list[int] = []
    pendings: list[int | None] = []
    for user, server in zip(users, servers, strict=True):
        raw = user + server
        hdrs = _parse_header_lines(raw[len(_HDR_LINE):] if raw.startswith(_HDR_LINE) else raw)
        try:
            seqs.append(int(hdrs["Nats-Sequence"]))
            subjects.append(hdrs["Nats-Subject"])
            times.append(parse_rfc3339_ns(hdrs["Nats-Time-Stamp"]))
        except (KeyError, ValueError) as e:
            raise JetStreamError(
                0, 0, f"direct get reply without a valid {e} header: {raw[:300]!r}") from None
        pendings.append(int_or_none(hdrs.get("Nats-Num-Pending")))
    return (
        pa.array(seqs, pa.int64()),
        pa.array(subjects, pa.string()),
        pa.array(times, pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
        pa.array(pendings, pa.int64()),
    )


def _server_columns(srv: pa.Array) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array]:
    """Sequence, subject, time, pending from the direct-get header lines, in bulk.

    Raises DecodeError (or an Arrow error) when any block is not laid out as expected."""
    lines = pc.split_pattern(srv, "\r\n")
    # Six header lines, the blank line and what follows the final CRLF.
    if not pc.all(pc.equal(pc.list_value_length(lines), 8)).as_py():
        raise DecodeError("direct-get headers not in the expected layout")
    cols = []
    for i, name in enumerate(_SERVER_LINES):
        line = pc.list_element(lines, i)
        if not pc.all(pc.starts_with(line, name)).as_py():
            raise DecodeError(f"{name!r} not where expected")
        cols.append(pc.binary_slice(line, len(name), _BIG))
    _, subject, seq, stamp, pending, _ = cols
    return (
        seq.cast(pa.int64()),
        subject.cast(pa.string()),
        stamp.cast(pa.string()).cast(pa.timestamp("ns", tz="UTC")),
        pending.cast(pa.int64()),
    )


def reply_columns(
    users: list[bytes],
    servers: list[bytes],
    datas: list[bytes],
    *,
    prefix: str | None = None,
    drop_nats_headers: bool = False,
) -> Columns:
    """Arrow columns of direct-get hits (the lists a :class:`Reply` collected).

    ``subject`` has ``prefix`` stripped, and rows whose subject does not start with ``prefix``
    are dropped. ``headers``: the message's own headers without the direct-get ones (without
    every ``Nats-*`` header with ``drop_nats_headers``) as ``json.dumps`` of the dict nats-py
    builds, or null when none. ``origin_seq``: the second token of ``Nats-Stream-Source``, or
    null. ``pending``: ``Nats-Num-Pending`` of each hit.

    Raises:
        JetStreamError: a hit without a valid ``Nats-Sequence``, ``Nats-Subject`` or
            ``Nats-Time-Stamp`` header.
    """
    user_arr = pa.array(users, pa.binary())
    if not pc.all(pc.starts_with(user_arr, "NATS/1.0\r\n")).as_py():
        raise JetStreamError(0, 0, "direct get reply without a NATS/1.0 header line")
    try:
        seq, subject, stamp, pending = _server_columns(pa.array(servers, pa.binary()))
    except (ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        seq, subject, stamp, pending = _slow_server_columns(users, servers)
    headers, origin = header_columns(
        users, pc.binary_slice(user_arr, len(_HDR_LINE), _BIG), drop_nats_headers)
    cols = Columns(seq, subject, stamp, headers, origin, pa.array(datas, pa.binary()), pending)
    if prefix:
        cols = strip_prefix(cols, prefix)
    return cols


def strip_prefix(cols: Columns, prefix: str) -> Columns:
    """``cols`` without the rows whose subject lacks ``prefix``, and ``prefix`` cut off the
    subjects of the others."""
    starts = pc.starts_with(cols.subject, prefix)
    if not pc.all(starts).as_py():
        cols = cols.filter(starts)
    cols.subject = pc.utf8_slice_codeunits(cols.subject, len(prefix))
    return cols


def int_or_none(v: str | None) -> int | None:
    """``int(v)`` for a string of digits, else ``None``."""
    return int(v) if v is not None and v.isdigit() else None


def stored_columns(msgs: list[StoredMessage], drop_nats: bool) -> Columns:
    """The plain path's messages as columns (the same values as :func:`reply_columns`)."""
    heads: list[str | None] = []
    origins: list[int | None] = []
    for m in msgs:
        h = m.headers
        if h and drop_nats:
            h = {k: v for k, v in h.items() if not k.startswith("Nats-")}
        heads.append(json.dumps(h) if h else None)
        origins.append(origin_of(m.headers))
    return Columns(
        pa.array([m.seq for m in msgs], pa.int64()),
        pa.array([m.subject for m in msgs], pa.string()),
        pa.array([m.time_ns for m in msgs], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
        pa.array(heads, pa.string()),
        pa.array(origins, pa.int64()),
        pa.array([m.data for m in msgs], pa.binary()),
        pa.array([m.num_pending for m in msgs], pa.int64()),
    )
