"""Session helper: Java check (no JVM needed) and the shared session's configuration."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from cg_pipelines.spark import session as sess
from cg_pipelines.spark.session import JavaNotFoundError, find_java, get_spark, java_version


def _fake_java(tmp_path: Path, banner: str) -> Path:
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho '{banner}' >&2\n")
    java.chmod(0o755)
    return home


@pytest.mark.parametrize(
    ("banner", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_392"', 8),
        ('openjdk version "11.0.2" 2019-01-15', 11),
    ],
)
def test_java_version_parsing(tmp_path, banner, major) -> None:
    home = _fake_java(tmp_path, banner)
    assert java_version(str(home / "bin" / "java")) == major


def test_old_or_missing_java_is_refused_before_the_jvm(tmp_path, monkeypatch) -> None:
    home = _fake_java(tmp_path, 'openjdk version "11.0.2" 2019-01-15')
    monkeypatch.setenv("JAVA_HOME", str(home))
    assert find_java() == str(home / "bin" / "java")
    with pytest.raises(JavaNotFoundError, match="Java 11; Spark 4 needs Java 17"):
        sess._check_java()
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(JavaNotFoundError, match="has no executable bin/java"):
        find_java()
    monkeypatch.delenv("JAVA_HOME")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(JavaNotFoundError, match="no `java` on PATH"):
        find_java()


def test_shared_session_configuration(spark) -> None:
    assert get_spark() is spark  # one session per process
    conf = spark.conf
    assert conf.get("spark.sql.execution.arrow.pyspark.enabled") == "true"
    assert conf.get("spark.sql.shuffle.partitions") == "4"
    assert conf.get("spark.sql.execution.arrow.localRelationThreshold") == "0"
    assert conf.get("spark.sql.optimizer.excludedRules").endswith(".ConvertToLocalRelation")
    assert conf.get("spark.sql.session.timeZone") == "UTC"
    assert spark.sparkContext.getConf().get("spark.ui.enabled") == "false"
    assert os.environ["PYSPARK_PYTHON"] == sys.executable
    assert os.environ["PYSPARK_DRIVER_PYTHON"] == sys.executable
    # Runtime-modifiable conf is applied to the running session; restore it after.
    assert get_spark(conf={"spark.sql.shuffle.partitions": "3"}) is spark
    assert conf.get("spark.sql.shuffle.partitions") == "3"
    conf.set("spark.sql.shuffle.partitions", "4")


def test_extra_java_options_do_not_restart_the_session() -> None:
    """pyspark prepends its own JVM options to ``spark.driver.extraJavaOptions``: asking again
    for the options the running session was started with reuses it (it used to be stopped and
    restarted on every call). A child interpreter: one JVM per process."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        from cg_pipelines.spark.session import get_spark, stop_spark
        conf = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"}
        first = get_spark("local[1]", conf=conf)
        jvm_opts = first.sparkContext.getConf().get("spark.driver.extraJavaOptions")
        second = get_spark("local[1]", conf=conf)
        print(second is first, first.sparkContext._jsc is not None,
              jvm_opts.endswith("-XX:TieredStopAtLevel=1"), jvm_opts != conf[next(iter(conf))])
        stop_spark()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True", "True", "True"], out.stdout + out.stderr[-2000:]
