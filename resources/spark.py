"""Spark resource built on dagster-pyspark: lazy session, ``PYSPARK_PYTHON`` set, stopped on
teardown.

``dagster_pyspark``'s resources call ``getOrCreate()`` and never stop the session; this one
creates it through :func:`cg_pipelines.spark.session.get_spark` (Java check, the venv's Python
for workers, Arrow on, UTC) only when a batch needs Spark, and stops it when the run ends
(``stop_on_teardown``), even if the run failed.
"""

from __future__ import annotations

from typing import Any

from dagster import InitResourceContext
from dagster_pyspark import LazyPySparkResource
from pydantic import Field

from cg_pipelines.spark.session import get_spark, stop_spark


class SparkResource(LazyPySparkResource):
    """A SparkSession for partition runs (``spark_config`` holds extra Spark settings)."""

    spark_config: dict[str, Any] = Field(default_factory=dict)
    master: str = Field("local[2]", description="Spark master URL.")
    stop_on_teardown: bool = Field(
        True, description="Stop the session when the run ends. A process that launches many "
        "runs in-process (the main job) keeps one session and stops it itself.")

    def _init_session(self) -> None:
        if self._spark_session is None:
            conf = {k: str(v) for k, v in self.spark_config.items()}
            self._spark_session = get_spark(self.master, app_name="cg_pipelines", conf=conf)

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        # Processing steps may start the process's session themselves (lazily, through
        # get_spark): stop whatever session this process has, not only one made here.
        if self.stop_on_teardown:
            stop_spark()
            self._spark_session = None
