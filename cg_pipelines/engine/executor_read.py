"""The executor-read protocol: a processor that processes a whole sequence range read on the Spark
executors (:class:`RangeProcessor`), what it returns (:class:`RangeProcessed`), how the
executors reach NATS (:func:`executor_connect_options`, :func:`credentials_shown`) and the
checks the engine holds the result to before committing it (:func:`check_range`).

The engine uses it for a large backlog (``EngineOptions.executor_read_min_msgs``): the range is
read, decoded and transformed on the executors (the ``jetstream`` data source); only the output
rows and the dead letters come to the driver, and the commit, purge and ack are those of any
batch (:mod:`cg_pipelines.engine.drain`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import pyarrow as pa
from nats.aio.client import Client

from cg_pipelines.core.errors import ContractError
from cg_pipelines.engine.processor import BatchContext, Processed
from cg_pipelines.jetstream.connect import ConnectOptions, connect_options_of

__all__ = [
    "USER_INFO_SUBJECT",
    "RangeProcessed",
    "RangeProcessor",
    "check_range",
    "credentials_shown",
    "executor_connect_options",
]


@dataclass
class RangeProcessed:
    """What :meth:`RangeProcessor.process_range` made of a sequence range read on the
    executors: the output and dead letters, and the range's facts the engine commits by.

    Attributes:
        processed: the rows to commit (``table``, ``None`` when no message decoded) and the
            dead letters (work-queue sequences, with their reasons).
        dead_records: the dead-lettered messages as
            :data:`~cg_pipelines.core.record.RECORD_SCHEMA` rows (user headers only, partition
            token stripped from ``subject``): what the dead-letter stream stores.
        messages: messages read (rows decoded + dead letters).
        first_seq, last_seq: work-queue sequences of the first and last message read (``None``
            when nothing was read); ``last_seq`` becomes the watermark.
        last_origin_seq: origin stream sequence of the last message (the ``<app_id>@origin``
            marker), ``None`` when it has none.
        timings: seconds by step (e.g. ``read_executors``, ``process``), added to the run's.
    """

    processed: Processed
    dead_records: pa.Table
    messages: int
    first_seq: int | None
    last_seq: int | None
    last_origin_seq: int | None
    timings: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class RangeProcessor(Protocol):
    """A processor that can also process a whole sequence range read on the executors.

    ``process_range(source, ctx)``: ``source`` holds the options of the ``jetstream`` Spark data
    source (:mod:`cg_pipelines.spark.datasource`: ``servers``, ``stream`` (the work queue),
    ``subject`` (``<p>.>``), ``first_seq``, ``last_seq``, ``strip_partition``, ``timeout`` and
    the connection's credentials; never log it); ``ctx`` is the batch context with
    ``first_seq``/``last_seq`` the range's bounds. It must give, message for message, what
    ``process`` gives for the same messages in one batch (same rows, same dead letters and
    reasons, ``_seq`` the origin sequence). Optional ``read_options`` (a mapping) are extra
    source options (e.g. the executors' own paths of TLS or credentials files, or TLS files
    when the engine does not know the connection's ``ConnectOptions``).
    """

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed: ...

    def process_range(self, source: Mapping[str, str], ctx: BatchContext) -> RangeProcessed: ...


USER_INFO_SUBJECT = "$SYS.REQ.USER.INFO"
"""nats-server (2.10 and later) answers a request here, from any client, with the user the
connection authenticated as: ``""`` without credentials, ``"[REDACTED]"`` for a token, the user
name, or the NKey public key of an NKey or creds (JWT) user."""

_TOKEN_USER = "[REDACTED]"


def executor_connect_options(nc: Client, *, connect: ConnectOptions | None = None,
                             tls_files: bool = False) -> dict[str, str] | None:
    """How executors reach the NATS that ``nc`` is connected to, as ``jetstream`` source
    options (``servers`` with any URL credentials, ``user``/``password``/``token``, ``creds``
    and ``nkey_seed`` file paths, TLS file paths), or None when that cannot be shipped.

    A TLS connection gives None unless ``tls_files`` (the processor's ``read_options`` name
    the TLS files as the executors see them): its SSL context stays here. Otherwise, from
    ``connect`` (the options ``nc`` was made with), else from
    :func:`~cg_pipelines.jetstream.connect.connect_options_of` (``nc`` was made by
    :meth:`ConnectOptions.connect <cg_pipelines.jetstream.connect.ConnectOptions.connect>`):
    :meth:`~cg_pipelines.jetstream.connect.ConnectOptions.spark_source_options`, files
    included. Without those, only what nats-py shows publicly (``nc.servers``,
    ``nc.options``' ``user``, ``password``, ``token``): nats-py does not show a creds file, an
    NKey seed or auth callbacks it was given, so these options may lack credentials the
    connection has: check :func:`credentials_shown` before using them, as the engine does.

    Holds secrets: never log it."""
    connect = connect or connect_options_of(nc)
    tls = nc.options.get("tls") is not None or (connect is not None and connect.uses_tls)
    if tls and not tls_files:
        return None
    if connect is not None:
        return connect.spark_source_options()
    urls = [u.geturl() for u in nc.servers] or (
        [nc.connected_url.geturl()] if nc.connected_url else [])
    if not urls:
        return None
    out = {"servers": ",".join(urls)}
    for key in ("user", "password", "token"):
        value = nc.options.get(key)
        if value:
            out[key] = str(value)
    return out


async def credentials_shown(nc: Client, timeout_s: float) -> bool:
    """Whether the user the server knows ``nc`` as (:data:`USER_INFO_SUBJECT`) is explained by
    credentials nats-py shows publicly: none (``""``), a token given in ``nc.options`` or a
    server URL, or the user name in ``nc.options`` or a URL. False for a user these do not
    explain (an NKey or creds user, a server's ``no_auth_user``) and when the server does not
    answer within ``timeout_s`` seconds (a server before 2.10, no permission): options from
    :func:`executor_connect_options` without ``connect`` are then not enough for executors.
    Never raises for the request (only cancellation passes)."""
    try:
        msg = await nc.request(USER_INFO_SUBJECT, b"", timeout=timeout_s)
        user = json.loads(msg.data)["data"]["user"]
    except Exception:  # no responders, timeout, permission, unexpected answer: unknown
        return False
    if user == "":
        return True
    users = {nc.options.get("user")} | {u.username for u in nc.servers if u.username}
    token = bool(nc.options.get("token")) or any(
        u.username and not u.password for u in nc.servers)
    return user in users or (user == _TOKEN_USER and token)


def check_range(got: RangeProcessed, first: int, last: int) -> None:
    """An executor batch's facts must be consistent: within the range ``[first, last]`` asked
    for, every dead letter in ``dead_records`` and in the range, no more dead letters than
    messages. Raises ContractError otherwise (nothing is committed)."""
    if got.first_seq is None or got.last_seq is None:
        raise ContractError("range processing returned no sequences for a non-empty range")
    span_first, span_last = got.first_seq, got.last_seq
    if not first <= span_first <= span_last <= last:
        raise ContractError(f"range processing returned sequences {span_first}..{span_last} "
                            f"outside the range {first}..{last}")
    dead = [d.seq for d in got.processed.dead]
    known = set(got.dead_records["seq"].to_pylist())
    unknown = [q for q in dead if q not in known or not span_first <= q <= span_last]
    if unknown or len(set(dead)) != len(dead) or len(dead) > got.messages:
        raise ContractError(f"range processing dead-lettered sequences it did not read or twice: "
                            f"{(unknown or dead)[:5]}")
