"""The Spark resource is honoured: its master and settings reach the session even when the
process already runs a session with another master; Spark Connect (``remote="sc://..."``)
works against a Connect server started from the pip pyspark package, and teardown stops it
without errors. Each case runs in a child interpreter (one JVM per process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from cg_pipelines.local.spark_cluster import SparkConnectServer


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


_REUSE_CHILD = """
    import json, logging, io
    buf = io.StringIO()
    logging.basicConfig(stream=buf, level=logging.WARNING)
    from dagster import StaticPartitionsDefinition, asset, materialize
    from pyspark.sql import SparkSession
    from cg_pipelines.dagster import SparkResource
    from cg_pipelines.spark.session import stop_session, with_session_id

    URL = {url!r}
    seen = []

    @asset(partitions_def=StaticPartitionsDefinition(["p0", "p1"]))
    def thing(context, spark: SparkResource) -> None:
        s = spark.spark_session
        views = sorted(t.name for t in s.catalog.listTables() if t.isTemporary)
        s.createDataFrame([(context.partition_key,)], "p string").createOrReplaceTempView("last")
        seen.append([context.partition_key, s.session_id, views])

    def views_of(session_id):
        s = SparkSession.builder.remote(with_session_id(URL, session_id)).create()
        try:
            return sorted(t.name for t in s.catalog.listTables() if t.isTemporary)
        except Exception as e:
            return getattr(e, "getCondition", lambda: type(e).__name__)()
        finally:
            s.release_session_on_close = False
            s.stop()

    # The shared session's window: one window from 1970 to the year 2286, so that no two runs
    # of this test fall in different windows (with 600 s, a loaded machine's runs straddled a
    # window's end: the fallback run got the next window's fresh id, with no warning).
    WINDOW = 1e10
    out = {{}}
    for name, reuse in (("shared", WINDOW), ("fresh", 0.0)):
        seen.clear()
        res = SparkResource(remote=URL, session_reuse_s=reuse)
        for p in ("p0", "p0", "p1"):
            assert materialize([thing], partition_key=p, resources={{"spark": res}}).success
        out[name] = {{"seen": [list(x) for x in seen], "after": views_of(seen[0][1])}}
    # the shared session closed by someone: the next run falls back to a fresh session
    shared = out["shared"]["seen"][0][1]
    stop_session(SparkSession.builder.remote(with_session_id(URL, shared)).create())
    seen.clear()
    res = SparkResource(remote=URL, session_reuse_s=WINDOW)
    assert materialize([thing], partition_key="p0", resources={{"spark": res}}).success
    out["fallback"] = [list(x) for x in seen]
    out["warnings"] = [ln for ln in buf.getvalue().splitlines() if "closed by the server" in ln]
    print("RESULT", json.dumps(out))
"""


def test_spark_connect_session_reuse(connect_server: SparkConnectServer) -> None:
    """``session_reuse_s``: the runs of one job and partition share one server-side session
    (what a run leaves in it, a temporary view, is there in the next run of the partition,
    and the session outlives the run), another partition gets its own; with 0 each run has a
    fresh session, released at its end; a shared session the server closed is replaced by a
    fresh one, with a warning."""
    out = _child(_REUSE_CHILD.format(url=connect_server.url))
    res = json.loads(out.split("RESULT ", 1)[1])
    (p0a, id0a, v0a), (p0b, id0b, v0b), (p1, id1, v1) = res["shared"]["seen"]
    assert (p0a, p0b, p1) == ("p0", "p0", "p1")
    assert id0a == id0b != id1
    assert (v0a, v0b, v1) == ([], ["last"], [])
    assert res["shared"]["after"] == ["last"]  # not released: the view is still there
    ids = [x[1] for x in res["fresh"]["seen"]]
    assert len(set(ids)) == 3 and not {*ids} & {id0a, id1}
    assert [x[2] for x in res["fresh"]["seen"]] == [[], [], []]
    assert res["fresh"]["after"] == "INVALID_HANDLE.SESSION_CLOSED"  # released at the run's end
    [(p, fresh, views)] = res["fallback"]
    assert p == "p0" and fresh != id0a and views == []
    assert len(res["warnings"]) == 1, res["warnings"]
