"""The executor-read protocol: a processor that processes a whole sequence range read on the
Spark executors (:class:`RangeProcessor`), what it returns (:class:`RangeProcessed`), how the
executors reach NATS (:func:`executor_connect_options`) and the checks the engine holds the
result to before committing it (:func:`check_range`).

The engine uses it for a large backlog (``EngineOptions.executor_read_min_msgs``): the range is
read, decoded and transformed on the executors (the ``jetstream`` data source); only the output
rows and the dead letters come to the driver, and the commit, purge and ack are those of any
batch (:mod:`cg_pipelines.engine.drain`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import pyarrow as pa
from nats.aio.client import Client

from cg_pipelines.engine.model import BatchContext, Processed

__all__ = [
    "RangeProcessed",
    "RangeProcessor",
    "check_range",
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
            :data:`~cg_pipelines.engine.model.RECORD_SCHEMA` rows (user headers only, partition
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
    source options (e.g. TLS files, which the engine cannot derive from its connection).
    """

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed: ...

    def process_range(self, source: Mapping[str, str], ctx: BatchContext) -> RangeProcessed: ...


def executor_connect_options(nc: Client, *, tls_files: bool = False) -> dict[str, str] | None:
    """How executors reach the NATS that ``nc`` is connected to, as ``jetstream`` source options
    (``servers`` with any URL credentials, ``user``/``password``/``token``, ``creds`` and
    ``nkey_seed`` file paths), or None when that cannot be shipped: a TLS connection (its
    SSL context stays here) unless ``tls_files`` (the processor's ``read_options`` name the TLS
    files), or credentials given as callbacks or in memory. Holds secrets: never log it."""
    if nc.options.get("tls") is not None and not tls_files:
        return None
    # nats-py keeps the credentials file and nkey seed given to connect() only on private
    # attributes (``nc.options`` holds user, password, token and tls, not these): read them
    # here, in this one place, as attributes that may be missing.
    if getattr(nc, "_nkeys_seed_str", None) is not None:
        return None
    creds = getattr(nc, "_user_credentials", None)
    seed = getattr(nc, "_nkeys_seed", None)
    if (creds is not None and not isinstance(creds, str)) or (
            seed is not None and not isinstance(seed, str)):
        return None
    urls = [u.geturl() for u in nc.servers] or (
        [nc.connected_url.geturl()] if nc.connected_url else [])
    if not urls:
        return None
    out = {"servers": ",".join(urls)}
    for key, value in (("user", nc.options.get("user")), ("password", nc.options.get("password")),
                       ("token", nc.options.get("token")), ("creds", creds),
                       ("nkey_seed", None if creds else seed)):
        if value:
            out[key] = str(value)
    return out


def check_range(got: RangeProcessed, first: int, last: int) -> None:
    """An executor batch's facts must be consistent: within the range ``[first, last]`` asked
    for, every dead letter in ``dead_records`` and in the range, no more dead letters than
    messages. Raises ValueError otherwise (nothing is committed)."""
    if got.first_seq is None or got.last_seq is None:
        raise ValueError("range processing returned no sequences for a non-empty range")
    span_first, span_last = got.first_seq, got.last_seq
    if not first <= span_first <= span_last <= last:
        raise ValueError(f"range processing returned sequences {span_first}..{span_last} "
                         f"outside the range {first}..{last}")
    dead = [d.seq for d in got.processed.dead]
    known = set(got.dead_records["seq"].to_pylist())
    unknown = [q for q in dead if q not in known or not span_first <= q <= span_last]
    if unknown or len(set(dead)) != len(dead) or len(dead) > got.messages:
        raise ValueError(f"range processing dead-lettered sequences it did not read or twice: "
                         f"{(unknown or dead)[:5]}")
