"""One record schema: the engine's, the range reader's and the Spark data source's schemas are
all derived from ``cg_pipelines.core.record`` and agree with it field by field (name, order,
nullability, type). Written out here independently, as a table."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import BinaryType, DataType, LongType, StringType, TimestampType

from cg_pipelines.core.record import RECORD_FIELDS, RECORD_SCHEMA, record_schema
from cg_pipelines.engine.processor import Record, records_to_arrow
from cg_pipelines.jetstream.rangeread import RANGE_SCHEMA, RangeBatch
from cg_pipelines.spark.datasource import ARROW_READ_SCHEMA, SPARK_RECORD_SCHEMA

# name, Arrow type (nanosecond times), Spark type, nullable
TABLE: list[tuple[str, pa.DataType, DataType, bool]] = [
    ("seq", pa.int64(), LongType(), False),
    ("subject", pa.string(), StringType(), False),
    ("time", pa.timestamp("ns", tz="UTC"), TimestampType(), False),
    ("headers", pa.string(), StringType(), True),
    ("data", pa.binary(), BinaryType(), False),
    ("origin_seq", pa.int64(), LongType(), True),
]


def test_core_fields_are_the_table() -> None:
    assert [(f.name, f.arrow_type(), f.nullable) for f in RECORD_FIELDS] == [
        (name, arrow, nullable) for name, arrow, _, nullable in TABLE]


@pytest.mark.parametrize("schema", [RECORD_SCHEMA, RANGE_SCHEMA],
                         ids=["core", "rangeread.RANGE_SCHEMA"])
def test_arrow_schemas_agree_field_by_field(schema: pa.Schema) -> None:
    assert [(f.name, f.type, f.nullable) for f in schema] == [
        (name, arrow, nullable) for name, arrow, _, nullable in TABLE]
    assert schema.equals(RECORD_SCHEMA)


def test_spark_schema_agrees_field_by_field() -> None:
    assert [(f.name, f.dataType, f.nullable) for f in SPARK_RECORD_SCHEMA.fields] == [
        (name, spark, nullable) for name, _, spark, nullable in TABLE]


def test_spark_schema_maps_to_the_arrow_read_schema_exactly() -> None:
    # PySpark compares the first batch's schema with this, exactly (types and nullability).
    assert to_arrow_schema(SPARK_RECORD_SCHEMA, timezone="UTC").equals(ARROW_READ_SCHEMA)
    assert [(f.name, f.type, f.nullable) for f in ARROW_READ_SCHEMA] == [
        (name, pa.timestamp("us", tz="UTC") if name == "time" else arrow, nullable)
        for name, arrow, _, nullable in TABLE]


def test_tables_built_by_the_engine_and_the_reader_carry_the_schema() -> None:
    t = records_to_arrow([Record(3, "a.b", b"x", 5, {"k": "v"}, 7)])
    assert t.schema.equals(RECORD_SCHEMA)
    arrays = [pa.array([3], pa.int64()), pa.array(["a.b"]),
              pa.array([5], pa.timestamp("ns", tz="UTC")), pa.array([None], pa.string()),
              pa.array([7], pa.int64()), pa.array([b"x"])]
    batch = RangeBatch(*arrays, num_pending=0, ended=True, next_seq=4)
    assert batch.table(origin=True).schema.equals(RANGE_SCHEMA)
    assert batch.table().schema.equals(record_schema(origin=False))
    assert batch.table().schema.names == RECORD_SCHEMA.names[:-1]
