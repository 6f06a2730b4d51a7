"""PySpark for partition runs (extra ``spark``): the Spark processing step, sessions, and the
``jetstream`` data source that reads a stream's sequence range on the executors."""

from cg_pipelines.spark.datasource import SOURCE_NAME, register_jetstream_source
from cg_pipelines.spark.join import SparkJoinProcessor, SparkJoinTransform
from cg_pipelines.spark.processor import SparkProcessor, SparkTransform, read_range_with_spark
from cg_pipelines.spark.session import JavaNotFoundError, get_spark, stop_session

__all__ = [
    "SOURCE_NAME",
    "JavaNotFoundError",
    "SparkJoinProcessor",
    "SparkJoinTransform",
    "SparkProcessor",
    "SparkTransform",
    "get_spark",
    "read_range_with_spark",
    "register_jetstream_source",
    "stop_session",
]
