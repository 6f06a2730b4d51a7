"""The record schema: the one definition of a batch's columns (names, order, types, nullability).

Every batch the engine hands a processor, every range the range reader returns and every row
the ``jetstream`` Spark data source yields has these columns, in this order:

==============  =========================  ========  =============================================
column          Arrow type                 nullable  meaning
==============  =========================  ========  =============================================
``seq``         int64                      no        sequence in the stream read (an elastic
                                                     group's work-queue stream; a static group's
                                                     own stream); the first is 1
``subject``     string                     no        the message's subject (partition token
                                                     stripped where the reader is told to)
``time``        timestamp[ns, tz=UTC]      no        the store time (Spark keeps microseconds)
``headers``     string                     yes       the user headers as a JSON object, or null
``data``        binary                     no        the payload
``origin_seq``  int64                      yes       the sequence in the origin stream (from the
                                                     ``Nats-Stream-Source`` header the server
                                                     puts on sourced messages); null when the
                                                     stream read is the origin
==============  =========================  ========  =============================================

:data:`RECORD_FIELDS` is the table above as data; :func:`record_schema` builds the Arrow schema
from it (the batches the engine hands a processor, the range reader's
:data:`~cg_pipelines.jetstream.rangeread.RANGE_SCHEMA`, and the microsecond form Spark's Arrow
batches need); the Spark ``StructType`` is derived from that Arrow schema in
:mod:`cg_pipelines.spark.datasource`. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pyarrow as pa

__all__ = [
    "RECORD_FIELDS",
    "RECORD_SCHEMA",
    "SEQ_COLUMN",
    "RecordField",
    "record_schema",
    "user_headers",
]

SEQ_COLUMN = "_seq"
"""The output column holding each row's **origin** stream sequence (int64): the record's
``origin_seq`` (its ``seq`` when the stream read is the origin, as for a static group), never
the work-queue sequence that the record schema's ``seq`` column holds."""

TimeUnit = Literal["s", "ms", "us", "ns"]


@dataclass(frozen=True, slots=True)
class RecordField:
    """One column of the record schema.

    Attributes:
        name: the column name.
        kind: ``"int64"``, ``"string"``, ``"timestamp"`` (UTC; the unit is chosen when the
            schema is built) or ``"binary"``.
        nullable: whether the column may hold nulls.
        doc: what the column holds, in one line.
    """

    name: str
    kind: Literal["int64", "string", "timestamp", "binary"]
    nullable: bool
    doc: str

    def arrow_type(self, time_unit: TimeUnit = "ns") -> pa.DataType:
        """The Arrow type of this column (timestamps in ``time_unit``, time zone UTC)."""
        if self.kind == "timestamp":
            return pa.timestamp(time_unit, tz="UTC")
        return {"int64": pa.int64(), "string": pa.string(), "binary": pa.binary()}[self.kind]

    def arrow_field(self, time_unit: TimeUnit = "ns") -> pa.Field:
        """This column as an Arrow field (:meth:`arrow_type`, nullability)."""
        return pa.field(self.name, self.arrow_type(time_unit), nullable=self.nullable)


RECORD_FIELDS: tuple[RecordField, ...] = (
    RecordField("seq", "int64", False, "sequence in the stream read"),
    RecordField("subject", "string", False, "the message's subject"),
    RecordField("time", "timestamp", False, "the store time, UTC"),
    RecordField("headers", "string", True, "user headers as a JSON object, or null"),
    RecordField("data", "binary", False, "the payload"),
    RecordField("origin_seq", "int64", True, "origin stream sequence of a sourced message"),
)
"""The record schema's columns, in order (see the module docstring)."""


def record_schema(*, time_unit: TimeUnit = "ns", origin: bool = True) -> pa.Schema:
    """The Arrow schema of :data:`RECORD_FIELDS`: ``time`` in ``time_unit`` (``"ns"``, what
    NATS stores; ``"us"`` for Spark), and without the last column, ``origin_seq``, when
    ``origin`` is false."""
    fields = RECORD_FIELDS if origin else RECORD_FIELDS[:-1]
    return pa.schema([f.arrow_field(time_unit) for f in fields])


RECORD_SCHEMA: pa.Schema = record_schema()
"""Arrow schema of a batch of records (nanosecond times, with ``origin_seq``)."""


def user_headers(headers: dict[str, str] | None) -> dict[str, str] | None:
    """``headers`` without the server's ``Nats-*`` ones (stream source, pin id ...): what the
    ``headers`` column holds; None when none is left."""
    user = {k: v for k, v in (headers or {}).items() if not k.startswith("Nats-")}
    return user or None
