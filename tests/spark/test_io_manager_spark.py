"""A downstream asset asks for the consumer-group table as a Spark DataFrame: read on the
executors from the Delta version's Parquet files (no Delta jars), on the Spark resource's
session, partition column recovered."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from dagster import AssetIn, asset, materialize
from pyspark.sql import DataFrame, SparkSession

from cg_pipelines.dagster import DeltaTableIOManager, DeltaWarehouseResource, SparkResource
from cg_pipelines.sinks.delta import DeltaSink


def test_spark_dataframe_input(spark: SparkSession, tmp_path: Path) -> None:
    warehouse = DeltaWarehouseResource(root=str(tmp_path))
    sink = warehouse.sink("events")
    for p, version in ((0, 3), (2, 5)):
        rows = pa.table({"key": [f"k{p}", f"k{p}x"], "n": [p, p + 1],
                         "_partition": pa.array([p, p], pa.int64())})
        sink.commit(rows, {f"S/g/{p}": (0, version)})
    io = DeltaTableIOManager(warehouse=warehouse,
                             spark=SparkResource(master="local[2]", stop_on_teardown=False))
    got: dict[str, DataFrame] = {}

    @asset(name="events", io_manager_key="cg_io_manager", metadata={"cg/table": "events"})
    def events() -> None:
        return None

    @asset(ins={"events": AssetIn(key="events")})
    def downstream(events: DataFrame) -> None:
        got["df"] = events

    res = materialize([events, downstream], selection=[downstream],
                      resources={"cg_io_manager": io})
    assert res.success
    df = got["df"]
    assert isinstance(df, DataFrame)
    rows = sorted((r["key"], r["n"], r["_partition"]) for r in df.collect())
    assert rows == [("k0", 0, 0), ("k0x", 1, 0), ("k2", 2, 2), ("k2x", 3, 2)]
    assert len(DeltaSink(sink.uri).file_uris()) == 2
