"""The Spark resource is honoured: its master and settings reach the session even when the
process already runs a session with another master; Spark Connect (``remote="sc://..."``)
works against a Connect server started from the pip pyspark package, and teardown stops it
without errors. Each case runs in a child interpreter (one JVM per process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from cg_pipelines.testing.spark_cluster import SparkConnectServer


def _child(code: str, timeout: float = 240) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_master_and_config_win_over_a_running_session() -> None:
    out = _child("""
        import logging
        from dagster import build_init_resource_context
        from cg_pipelines.dagster import SparkResource
        from cg_pipelines.spark.session import get_spark
        logging.basicConfig(level=logging.WARNING)
        first = get_spark("local[2]", app_name="someone-elses")
        res = SparkResource(master="local[1]", app_name="mine",
                            spark_config={"spark.sql.shuffle.partitions": "3",
                                          "spark.driver.memory": "700m"})
        s = res.spark_session
        print("master", s.sparkContext.master)
        print("app", s.sparkContext.appName)
        print("shuffle", s.conf.get("spark.sql.shuffle.partitions"))
        print("memory", s.sparkContext.getConf().get("spark.driver.memory"))
        print("old_stopped", first.sparkContext._jsc is None)
        res.teardown_after_execution(build_init_resource_context())
        print("stopped", s.sparkContext._jsc is None)
    """)
    lines = dict(ln.split(" ", 1) for ln in out.strip().splitlines())
    assert lines == {"master": "local[1]", "app": "mine", "shuffle": "3", "memory": "700m",
                     "old_stopped": "True", "stopped": "True"}, out


@pytest.fixture(scope="module")
def connect_server() -> SparkConnectServer:
    with SparkConnectServer("local[1]") as server:
        yield server


def test_spark_connect_remote(connect_server: SparkConnectServer) -> None:
    out = _child(f"""
        import logging, io
        buf = io.StringIO()
        logging.basicConfig(stream=buf, level=logging.WARNING)
        import pyarrow as pa
        from dagster import build_init_resource_context
        from cg_pipelines.dagster import SparkResource
        res = SparkResource(remote={connect_server.url!r}, app_name="connect-client")
        s = res.spark_session
        print("kind", type(s).__module__)
        df = s.createDataFrame(pa.table({{"k": ["a", "b", "a"], "v": [1, 2, 3]}}))
        print("sum", df.groupBy("k").sum("v").orderBy("k").toArrow().to_pylist())
        res.teardown_after_execution(build_init_resource_context())
        print("errors", [ln for ln in buf.getvalue().splitlines() if "ERROR" in ln])
    """)
    assert "kind pyspark.sql.connect.session" in out, out
    assert "sum [{'k': 'a', 'sum(v)': 4}, {'k': 'b', 'sum(v)': 2}]" in out, out
    assert "errors []" in out, out
