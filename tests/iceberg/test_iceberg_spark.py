"""The Spark processor into Iceberg: the devices pipeline transformed on local Spark, drained
in small batches (per-key state read back from the Iceberg table between batches), committed
by the driver through pyiceberg in merge mode, equals the independent reference.

The SparkSession is the suite's one JVM (``get_spark`` with the settings of
``tests/spark/conftest.py``, which reuses it); it is not stopped here."""

from __future__ import annotations

import asyncio
import time

import pyarrow as pa
import pytest

from cg_pipelines.dagster.iceberg import spark_frame
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.spark.processor import SparkProcessor
from cg_pipelines.spark.session import get_spark
from tests.iceberg.conftest import Backend
from tests.iceberg.test_iceberg_engine import FAST, _left, _setup
from tests.support import devices


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
async def test_spark_merge_into_iceberg_equals_reference(nc, js, unique_name,
                                                         backend: Backend, report) -> None:
    t = time.monotonic()
    spark = await asyncio.to_thread(get_spark, "local[2]", "cg_pipelines-tests")
    report.append(f"iceberg spark test: get_spark {time.monotonic() - t:.1f} s (shared with "
                  "tests/spark in a full run)")
    stream = unique_name
    evs = devices.events(240, 20, seed=9, p_del=0.2)
    api = await _setup(js, stream, devices.publish, evs)
    proc = SparkProcessor(devices.DECODER, devices.spark_transform, state=devices.STATE,
                          spark=spark, schema=devices.OUT_SCHEMA)
    sink = backend.sink(devices.MERGE)
    r = await run_partition(nc, stream, "g", 0, proc, sink,
                            EngineOptions(batch_max_msgs=120, **FAST))
    assert r.status == "drained" and r.commits >= 2, r  # state read back in between
    assert devices.mismatches(sink.read(), evs) is None
    assert await _left(api, stream) == 0
    # what IcebergTableIOManager hands a Spark input: the current snapshot's Parquet files
    # read on the executors (copy-on-write: no delete files), all of them or one partition's
    frame = await asyncio.to_thread(lambda: spark_frame(spark, sink).toPandas())
    assert devices.mismatches(pa.Table.from_pandas(frame, preserve_index=False), evs) is None
    assert await asyncio.to_thread(lambda: spark_frame(spark, sink, [1]).count()) == 0
