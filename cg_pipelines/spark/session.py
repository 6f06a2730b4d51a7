"""One local (or remote-master) SparkSession per process, configured for Arrow and small jobs.

:func:`get_spark` checks Java (17+ on ``$JAVA_HOME/bin/java`` or ``java`` on ``PATH``) before
the JVM starts, points Spark's Python workers at this interpreter (``PYSPARK_PYTHON`` and
``PYSPARK_DRIVER_PYTHON`` = ``sys.executable``, so workers see the venv's packages), and starts
(or reuses) the process-wide session. :func:`stop_spark` stops it.

Defaults: Arrow transfers on (``spark.sql.execution.arrow.pyspark.enabled``), 4 shuffle
partitions (``spark.sql.shuffle.partitions``; the Spark default of 200 makes small batch jobs
slow), UI off, driver bound to 127.0.0.1, session time zone UTC, log level WARN.

Starting a local JVM takes several seconds (≈7 s on 2 cores, DESIGN §7):
:func:`session_start_seconds` returns what the last start took.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from pyspark.sql import SparkSession

__all__ = [
    "DEFAULT_CONF",
    "MIN_JAVA_VERSION",
    "JavaNotFoundError",
    "find_java",
    "get_spark",
    "java_version",
    "session_start_seconds",
    "stop_spark",
]

MIN_JAVA_VERSION = 17
"""Spark 4 needs Java 17 or newer."""

DEFAULT_CONF: dict[str, str] = {
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}
"""Configuration applied by :func:`get_spark` before the caller's ``conf`` (which wins)."""

_LOCK = threading.Lock()
_SESSION: SparkSession | None = None
_START_SECONDS: float | None = None
_VERSION_RE = re.compile(r'version "(\d+)(?:\.(\d+))?[^"]*"')


class JavaNotFoundError(RuntimeError):
    """No Java runtime usable by Spark 4: missing, not runnable, or older than 17."""


def find_java() -> str:
    """Path of the ``java`` Spark will start: ``$JAVA_HOME/bin/java`` if ``JAVA_HOME`` is set
    (as ``spark-submit`` does), else ``java`` on ``PATH``.

    Raises:
        JavaNotFoundError: ``JAVA_HOME`` has no ``bin/java``, or no ``java`` on ``PATH``.
    """
    home = os.environ.get("JAVA_HOME")
    if home:
        cand = Path(home) / "bin" / ("java.exe" if os.name == "nt" else "java")
        if not (cand.is_file() and os.access(cand, os.X_OK)):
            raise JavaNotFoundError(
                f"JAVA_HOME={home} has no executable bin/java; Spark 4 needs Java "
                f"{MIN_JAVA_VERSION}+ (e.g. `apt-get install openjdk-17-jre-headless`)"
            )
        return str(cand)
    on_path = shutil.which("java")
    if on_path is None:
        raise JavaNotFoundError(
            f"no `java` on PATH and JAVA_HOME is not set; Spark 4 needs Java {MIN_JAVA_VERSION}+ "
            "(e.g. `apt-get install openjdk-17-jre-headless`, or set JAVA_HOME)"
        )
    return on_path


def java_version(java: str) -> int:
    """Major version of ``java`` (``17`` for ``openjdk version "17.0.15"``, ``8`` for
    ``"1.8.0_392"``), from ``java -version`` (which prints to stderr).

    Raises:
        JavaNotFoundError: it cannot be run or prints no version.
    """
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise JavaNotFoundError(f"cannot run `{java} -version`: {e}") from e
    text = (out.stderr or "") + (out.stdout or "")
    m = _VERSION_RE.search(text)
    if out.returncode != 0 or m is None:
        raise JavaNotFoundError(
            f"`{java} -version` failed (exit {out.returncode}): {text.strip()[:200]!r}"
        )
    major = int(m.group(1))
    if major == 1 and m.group(2) is not None:  # "1.8.0_392" -> 8
        major = int(m.group(2))
    return major


def _check_java() -> None:
    java = find_java()
    major = java_version(java)
    if major < MIN_JAVA_VERSION:
        raise JavaNotFoundError(
            f"{java} is Java {major}; Spark 4 needs Java {MIN_JAVA_VERSION}+ "
            "(install OpenJDK 17 and put it on PATH or set JAVA_HOME)"
        )


def _active() -> SparkSession | None:
    """The process-wide session if it is still alive (its SparkContext not stopped)."""
    s = _SESSION or SparkSession.getActiveSession()
    if s is None:
        return None
    sc = s.sparkContext
    if sc._jsc is None:  # stopped
        return None
    return s


def get_spark(
    master: str = "local[2]",
    app_name: str = "cg_pipelines",
    conf: dict[str, str] | None = None,
) -> SparkSession:
    """Return the process's SparkSession, starting it on first use.

    Args:
        master: Spark master URL (``"local[2]"``, ``"local[*]"``, ``"spark://host:7077"`` ...).
        app_name: application name.
        conf: extra Spark configuration; wins over :data:`DEFAULT_CONF`.

    When a session is already running, ``master``/``app_name`` are ignored (one JVM per
    process) and only the runtime-modifiable keys of ``conf`` (``spark.sql.*`` mostly) are
    applied to it; static keys (driver memory, master ...) need :func:`stop_spark` first.

    Returns:
        The session; time zone UTC, log level WARN.

    Raises:
        JavaNotFoundError: no Java 17+ (checked before the JVM is started).
    """
    global _SESSION, _START_SECONDS
    with _LOCK:
        existing = _active()
        if existing is not None:
            _SESSION = existing
            for k, v in (conf or {}).items():
                if existing.conf.isModifiable(k):
                    existing.conf.set(k, v)
            return existing
        _check_java()
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
        if master.startswith("local"):
            # Otherwise Spark resolves the host name, warns, and may bind a non-loopback address.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = SparkSession.builder.master(master).appName(app_name)
        for k, v in {**DEFAULT_CONF, **(conf or {})}.items():
            builder = builder.config(k, v)
        t0 = time.perf_counter()
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
        _START_SECONDS = time.perf_counter() - t0
        _SESSION = spark
        return spark


def session_start_seconds() -> float | None:
    """Seconds the last :func:`get_spark` start took (JVM + session), ``None`` if it never
    started one in this process (e.g. the session was created elsewhere)."""
    return _START_SECONDS


def stop_spark() -> None:
    """Stop the process's SparkSession and its JVM context (idempotent)."""
    global _SESSION
    with _LOCK:
        s = _active()
        _SESSION = None
        if s is not None:
            s.stop()
