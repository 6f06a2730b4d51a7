"""A PySpark 4 Python data source that reads a sequence range of a JetStream stream.

Usage::

    register_jetstream_source(spark)          # spark.dataSource.register(JetStreamDataSource)
    df = (spark.read.format("jetstream")
          .option("servers", "nats://127.0.0.1:4222")
          .option("stream", "S")
          .option("subject", "3.>")           # subject filter, wildcards allowed; default ">"
          .option("first_seq", 1)             # inclusive; default 1
          .option("last_seq", 100000)         # inclusive; default: the stream's last sequence
          .option("partitions", 4)            # input partitions (contiguous sub-ranges)
          .load())
    ordered = df.orderBy("seq")

Schema (:data:`SPARK_RECORD_SCHEMA`, the Spark form of
:data:`cg_pipelines.core.record.RECORD_SCHEMA`): ``seq`` long, ``subject`` string (as stored;
the first token — the partition number of a work-queue stream — is removed only with option
``strip_partition="true"``), ``time`` timestamp (UTC; Spark keeps **microseconds**, the store
time's nanoseconds are truncated), ``origin_seq`` long (the origin stream sequence of a sourced
message, null otherwise), ``headers`` string (the user headers as a JSON object, or
null), ``data`` binary.

Partitioning and order: ``[first_seq, last_seq]`` is split into ``partitions`` contiguous
sub-ranges of (nearly) equal width in sequence numbers (not in matching messages: a filter that
matches unevenly gives uneven partitions). Each input partition is read on an executor by its
own NATS connection (nats-py, in a private asyncio event loop) with batched direct gets
(``$JS.API.DIRECT.GET``; the stream needs ``allow_direct: true``) cut into Arrow columns in bulk
(:func:`cg_pipelines.jetstream.rangeread.read_range`, the engine's driver read), and yields one
Arrow record batch per direct-get batch, rows in sequence order. Spark gives **no global
order** across partitions and any shuffle loses it: restore stream order with
``orderBy("seq")``.

Options (all strings, as Spark passes them):

=================  ==========================================================================
``servers``        NATS URL(s), comma-separated (required)
``stream``         stream name (required)
``subject``        subject filter for ``next_by_subj`` (default ``">"``)
``first_seq``      first sequence, inclusive (default 1)
``last_seq``       last sequence, inclusive (default: the stream's ``last_seq`` at planning)
``partitions``     number of input partitions (default 1; capped to the range's width)
``batch``          messages per direct-get request (default 1000)
``max_bytes``      byte budget per direct-get request (default none)
``strip_partition``  ``"true"`` drops the first subject token (default ``"false"``)
``timeout``        seconds per NATS request (default 10)
``user``, ``password``, ``token``, ``creds``, ``nkey_seed``, ``tls_ca``, ``tls_cert``, ``tls_key``
                   connection credentials, passed to nats-py; never logged or put in errors
=================  ==========================================================================

Errors (raised on the executor, surfacing as a Spark job failure with the Python traceback):
``UsageError`` (a ``ValueError``) for bad options (raised at planning), nats-py connection errors,
:class:`~cg_pipelines.jetstream.errors.JetStreamUnavailableError` (stream missing or
``allow_direct`` off), :class:`~cg_pipelines.jetstream.errors.RequestTimeoutError`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.record import RECORD_SCHEMA, record_schema
from cg_pipelines.jetstream.api import JetStreamAPI, StoredMessage
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.jetstream.rangeread import RangeBatch, read_range

__all__ = [
    "ARROW_READ_SCHEMA",
    "SOURCE_NAME",
    "SPARK_RECORD_SCHEMA",
    "JetStreamDataSource",
    "JetStreamReader",
    "SeqRange",
    "SourceOptions",
    "iter_range_batches",
    "messages_to_batch",
    "range_batches",
    "register_jetstream_source",
    "split_range",
]

SOURCE_NAME = "jetstream"

SPARK_RECORD_SCHEMA: StructType = from_arrow_schema(RECORD_SCHEMA)
"""Spark schema of the source: the record schema (:mod:`cg_pipelines.core.record`, the same
columns, order and nullability as :data:`~cg_pipelines.core.record.RECORD_SCHEMA`) with
``time`` in Spark's microsecond timestamps, derived from the Arrow schema by PySpark's own
``from_arrow_schema``."""

ARROW_READ_SCHEMA = record_schema(time_unit="us")
"""Arrow schema of the record batches ``read`` yields: the record schema with microsecond
times. PySpark checks it equals ``to_arrow_schema(SPARK_RECORD_SCHEMA, timezone="UTC")``
exactly (types and nullability)."""

_SECRET_OPTIONS = ("password", "token")
_CONNECT_OPTIONS = ("user", "password", "token", "creds", "tls_ca", "tls_cert", "tls_key",
                    "nkey_seed")


@dataclass
class SeqRange(InputPartition):
    """One input partition: the inclusive sequence range ``[first, last]`` (picklable)."""

    first: int
    last: int


def split_range(first: int, last: int, parts: int) -> list[SeqRange]:
    """Split ``[first, last]`` (inclusive) into at most ``parts`` contiguous, non-empty ranges
    whose widths differ by at most one, in order. An empty range (``last < first``) gives
    ``[]``.

    Raises:
        UsageError: ``parts < 1``.
    """
    if parts < 1:
        raise UsageError(f"partitions must be >= 1, got {parts}")
    width = last - first + 1
    if width <= 0:
        return []
    parts = min(parts, width)
    base, extra = divmod(width, parts)
    out: list[SeqRange] = []
    lo = first
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0) - 1
        out.append(SeqRange(lo, hi))
        lo = hi + 1
    return out


def _int_option(options: Mapping[str, str], key: str, default: int | None) -> int | None:
    raw = options.get(key)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        return int(str(raw).strip())
    except ValueError:
        raise UsageError(f"option {key!r} must be an integer, got {raw!r}") from None


def _bool_option(options: Mapping[str, str], key: str) -> bool:
    raw = str(options.get(key, "false")).strip().lower()
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no", ""):
        return False
    raise UsageError(f"option {key!r} must be true or false, got {raw!r}")


@dataclass(frozen=True)
class SourceOptions:
    """The source's options, parsed and checked (see the module docstring).

    Secrets live only in ``connect`` (:class:`ConnectOptions` keeps them out of its repr).
    ``timeout`` is seconds per NATS request and for connecting.
    """

    connect: ConnectOptions
    stream: str
    subject: str
    first_seq: int
    last_seq: int | None
    partitions: int
    batch: int
    max_bytes: int | None
    strip_partition: bool
    timeout: float

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> SourceOptions:
        """Parse Spark's string options (other scalars are accepted and ``str()``-ed).

        Raises:
            UsageError: a required option missing, or a value of the wrong form.
        """
        options = {str(k).lower(): str(v) for k, v in dict(options).items() if v is not None}
        servers = options.get("servers")
        stream = options.get("stream")
        if not servers:
            raise UsageError("jetstream source: option 'servers' is required")
        if not stream:
            raise UsageError("jetstream source: option 'stream' is required")
        first = _int_option(options, "first_seq", 1)
        last = _int_option(options, "last_seq", None)
        parts = _int_option(options, "partitions", 1)
        batch = _int_option(options, "batch", 1000)
        assert first is not None and parts is not None and batch is not None
        if first < 1:
            raise UsageError(f"option 'first_seq' must be >= 1, got {first}")
        if parts < 1:
            raise UsageError(f"option 'partitions' must be >= 1, got {parts}")
        if batch < 1:
            raise UsageError(f"option 'batch' must be >= 1, got {batch}")
        try:
            timeout = float(options.get("timeout", "10"))
        except ValueError:
            raise UsageError("option 'timeout' must be a number of seconds") from None
        conn: dict[str, str | None] = {k: options.get(k) or None for k in _CONNECT_OPTIONS}
        return cls(
            connect=ConnectOptions(
                servers=str(servers), connect_timeout=timeout, name="cg_pipelines-spark",
                **conn,  # type: ignore[arg-type]  # the str | None fields named in _CONNECT_OPTIONS
            ),
            stream=str(stream),
            subject=str(options.get("subject") or ">"),
            first_seq=first,
            last_seq=last,
            partitions=parts,
            batch=batch,
            max_bytes=_int_option(options, "max_bytes", None),
            strip_partition=_bool_option(options, "strip_partition"),
            timeout=timeout,
        )


def _origin_seq(headers: Mapping[str, str] | None) -> int | None:
    """The origin sequence of a sourced message (``Nats-Stream-Source``: ``<stream> <seq>
    ...``), or None."""
    parts = ((headers or {}).get("Nats-Stream-Source") or "").split(" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def messages_to_batch(msgs: list[StoredMessage], strip_partition: bool) -> pa.RecordBatch:
    """Stored messages -> one record batch with :data:`ARROW_READ_SCHEMA` (same order).

    ``time`` becomes µs (``time_ns // 1000``); ``headers`` a JSON object string or null;
    ``strip_partition`` drops the subject's first token (kept when it is the only one).
    """
    if strip_partition:
        subjects = [m.subject.partition(".")[2] or m.subject for m in msgs]
    else:
        subjects = [m.subject for m in msgs]
    return pa.RecordBatch.from_arrays(
        [
            pa.array([m.seq for m in msgs], pa.int64()),
            pa.array(subjects, pa.string()),
            pa.array([m.time_ns // 1000 for m in msgs], pa.int64()).cast(
                pa.timestamp("us", tz="UTC")
            ),
            pa.array([json.dumps(m.headers) if m.headers else None for m in msgs], pa.string()),
            pa.array([m.data for m in msgs], pa.binary()),
            pa.array([_origin_seq(m.headers) for m in msgs], pa.int64()),
        ],
        schema=ARROW_READ_SCHEMA,
    )


async def _stream_last_seq(s: SourceOptions) -> int:
    nc = await s.connect.connect()
    try:
        async with JetStreamAPI(nc, timeout=s.timeout) as api:
            info = await api.stream_info(s.stream)
        return int((info.get("state") or {}).get("last_seq") or 0)
    finally:
        await nc.close()


def iter_range_batches(
    settings: SourceOptions, first: int, last: int
) -> Iterator[list[StoredMessage]]:
    """Yield the messages of ``[first, last]`` matching ``settings.subject``, in sequence
    order, one list per direct-get request (non-empty lists only).

    Runs its own asyncio event loop and NATS connection for the life of the generator (closed
    when it is exhausted or closed). Not for use inside a running event loop.

    Raises:
        JetStreamUnavailableError, RequestTimeoutError, JetStreamError: from
            :meth:`JetStreamAPI.direct_get_batch`; nats-py errors when connecting.
    """
    if last < first:
        return
    loop = asyncio.new_event_loop()
    nc = None
    api: JetStreamAPI | None = None
    try:
        nc = loop.run_until_complete(settings.connect.connect())
        api = JetStreamAPI(nc, timeout=settings.timeout)
        seq = first
        while seq <= last:
            want = min(settings.batch, last - seq + 1)
            msgs = loop.run_until_complete(
                api.direct_get_batch(
                    settings.stream, seq, settings.subject, want, settings.max_bytes
                )
            )
            if not msgs:
                return
            if msgs[-1].seq > last:
                msgs = [m for m in msgs if m.seq <= last]
                if msgs:
                    yield msgs
                return
            yield msgs
            seq = msgs[-1].seq + 1
    finally:
        if api is not None:
            loop.run_until_complete(api.close())
        if nc is not None and not nc.is_closed:
            loop.run_until_complete(nc.close())
        loop.close()


_DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def _strip_first_token(subjects: pa.Array) -> pa.Array:
    """Each subject without its first token (kept whole when nothing follows the first dot),
    as :func:`messages_to_batch` does."""
    return pc.replace_substring_regex(subjects, pattern=r"^[^.]*\.(.+)$", replacement=r"\1")


def _range_to_batch(got: RangeBatch, strip_partition: bool) -> pa.RecordBatch:
    """One :func:`~cg_pipelines.jetstream.rangeread.read_range` result -> a record batch with
    :data:`ARROW_READ_SCHEMA` (the same values :func:`messages_to_batch` gives)."""
    subject = _strip_first_token(got.subject) if strip_partition else got.subject
    return pa.RecordBatch.from_arrays(
        [got.seq, subject, got.time.cast(pa.timestamp("us", tz="UTC"), safe=False),
         got.headers, got.data, got.origin_seq],
        schema=ARROW_READ_SCHEMA,
    )


def range_batches(settings: SourceOptions, first: int, last: int) -> Iterator[pa.RecordBatch]:
    """Record batches (:data:`ARROW_READ_SCHEMA`) of the messages of ``[first, last]`` matching
    ``settings.subject``, in sequence order, one per direct-get request of up to
    ``settings.batch`` messages (non-empty batches only), cut into Arrow columns in bulk by
    :func:`~cg_pipelines.jetstream.rangeread.read_range`.

    Runs its own asyncio event loop and NATS connection for the life of the generator (closed
    when it is exhausted or closed). Not for use inside a running event loop.

    Raises:
        JetStreamUnavailableError, RequestTimeoutError, JetStreamError: from the read;
            nats-py errors when connecting.
    """
    if last < first:
        return
    loop = asyncio.new_event_loop()
    nc = None
    try:
        nc = loop.run_until_complete(settings.connect.connect())
        seq = first
        while seq <= last:
            got = loop.run_until_complete(read_range(
                nc, settings.stream, seq, filter_subject=settings.subject,
                max_msgs=settings.batch, max_bytes=settings.max_bytes or _DEFAULT_MAX_BYTES,
                last_seq=last, timeout_s=settings.timeout))
            if got.num_rows:
                yield _range_to_batch(got, settings.strip_partition)
            if got.ended or got.next_seq <= seq:
                return
            seq = got.next_seq
    finally:
        if nc is not None and not nc.is_closed:
            loop.run_until_complete(nc.close())
        loop.close()


class JetStreamReader(DataSourceReader):
    """Reader for one ``load()``: plans :class:`SeqRange` partitions and reads each on an
    executor.

    Raises:
        UsageError: bad options, or a requested schema other than :data:`SPARK_RECORD_SCHEMA`.
    """

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        want = [(f.name, f.dataType) for f in SPARK_RECORD_SCHEMA.fields]
        if [(f.name, f.dataType) for f in schema.fields] != want:
            raise UsageError(
                f"jetstream source has a fixed schema {SPARK_RECORD_SCHEMA.simpleString()}; "
                f"got {schema.simpleString()}"
            )
        self.settings = SourceOptions.parse(options)
        # A user schema may differ in nullability only; PySpark wants the batches to match it.
        arrow = to_arrow_schema(schema, timezone="UTC")
        self._cast_to: pa.Schema | None = None if arrow.equals(ARROW_READ_SCHEMA) else arrow

    def partitions(self) -> list[InputPartition]:
        """Contiguous sub-ranges of ``[first_seq, last_seq]`` (see :func:`split_range`).

        ``last_seq`` unset: the stream's current last sequence (one NATS request, here at
        planning time, so the DataFrame reads a snapshot bounded at planning).
        """
        s = self.settings
        last = s.last_seq
        if last is None:
            last = asyncio.run(_stream_last_seq(s))
        ranges: list[InputPartition] = list(split_range(s.first_seq, last, s.partitions))
        # PySpark treats an empty list as one partition of value None: read() yields nothing.
        return ranges

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Record batches (:data:`ARROW_READ_SCHEMA`) of one sequence range, in order."""
        if not isinstance(partition, SeqRange):
            return
        for batch in range_batches(self.settings, partition.first, partition.last):
            yield batch if self._cast_to is None else batch.cast(self._cast_to)


class JetStreamDataSource(DataSource):
    """``spark.read.format("jetstream")``: see the module docstring for options and schema."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return SPARK_RECORD_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return JetStreamReader(self.options, schema)

    def __repr__(self) -> str:  # keep secrets out of plans and logs
        shown = {k: ("***" if k.lower() in _SECRET_OPTIONS else v)
                 for k, v in dict(self.options).items()}
        return f"JetStreamDataSource({shown})"


def _registered(spark: SparkSession) -> bool:
    """Whether ``"jetstream"`` is registered already (JVM DataSourceManager; ``False`` when
    that internal API is not reachable, e.g. on Spark Connect)."""
    try:
        manager = spark._jsparkSession.sessionState().dataSourceManager()
        return bool(manager.dataSourceExists(SOURCE_NAME))
    except Exception:  # internal API: any failure means "register again"
        return False


def register_jetstream_source(spark: SparkSession) -> None:
    """Register :class:`JetStreamDataSource` as ``"jetstream"`` on ``spark``.

    Idempotent: skipped when the name is registered already (re-registering works too, but
    Spark logs a "replaced a previously registered data source" warning each time).
    """
    if not _registered(spark):
        spark.dataSource.register(JetStreamDataSource)
