"""Spark test fixtures: ONE SparkSession (one JVM) for the whole suite, and a nats-server of
their own (their streams use bare partition subjects such as ``0.>``, which would overlap other
tests' streams). Both session-scoped and started lazily."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.spark.session import get_spark, session_start_seconds, stop_spark
from tests.support.figures import FIGURES
from tests.support.procs import end_gateway_jvm


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The suite's SparkSession (local[2]); stopped at the end of the session."""
    session = get_spark("local[2]", app_name="cg_pipelines-tests")
    started = session_start_seconds()
    if started is not None:
        FIGURES.append(f"spark session start: {started:.1f} s")
    try:
        yield session
    finally:
        stop_spark()
        end_gateway_jvm()


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a nats-server with JetStream (temp store); stopped at the end of the session."""
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()

