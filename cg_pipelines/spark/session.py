"""SparkSessions for partition runs: one classic session (local or cluster master) per process,
or a Spark Connect client session; configured for Arrow and small jobs.

:func:`get_spark` checks Java (17+ on ``$JAVA_HOME/bin/java`` or ``java`` on ``PATH``) before
the JVM starts, points Spark's Python workers at this interpreter (``PYSPARK_PYTHON`` and
``PYSPARK_DRIVER_PYTHON`` = ``sys.executable``, so workers see the venv's packages), and starts
(or reuses, or replaces when its master differs) the process-wide session; with ``remote=`` it
returns a Spark Connect session instead. :func:`stop_session` stops either kind.

Defaults: Arrow transfers on (``spark.sql.execution.arrow.pyspark.enabled``), 4 shuffle
partitions (``spark.sql.shuffle.partitions``; the Spark default of 200 makes small batch jobs
slow), a batch's Arrow data turned into rows on the executors rather than into a driver-side
local relation (``spark.sql.execution.arrow.localRelationThreshold`` 0), and the optimizer
rule that evaluates projections over a local relation on the driver, interpreted, left out
(``spark.sql.optimizer.excludedRules`` = ``ConvertToLocalRelation``; a Spark Connect
session's uploaded batch is always a local relation) — measured on the example's legs
transform, 40,000 rows on ``local[2]``, 2 cores: a classic session's batch 1.15-1.43 s and
1.7-2.0 JVM CPU-seconds become 0.71-0.84 s and 1.0-1.3, a Connect session's 1.26-1.44 s and
1.7-2.2 become 0.63-0.84 s and 0.9-1.2; no difference at 200 or 2,000 rows (a ``conf``
giving ``spark.sql.optimizer.excludedRules`` replaces this value: keep the rule in it),
adaptive query execution off (``spark.sql.adaptive.enabled``: at a few shuffle partitions
there is nothing for it to coalesce, and re-planning each stage costs a run-sized job time:
the legs transform on a Connect session that compiled it before, 0.63 -> 0.57 s and 1.04 ->
0.95 JVM CPU-s, medians of 10; on a classic session 0.90 -> 0.82 s), UI off,
session time zone UTC, log level WARN; the driver bound to 127.0.0.1 for local and loopback
masters (:data:`LOOPBACK_CONF`).

Starting a local JVM takes several seconds (≈7 s for ``local[2]``, measured on 2 cores):
:func:`session_start_seconds` returns what the last start took.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from pyspark.sql import SparkSession

from cg_pipelines.core.errors import CgError, InvariantError
from cg_pipelines.core.record import SEQ_COLUMN

__all__ = [
    "DEFAULT_CONF",
    "LOOPBACK_CONF",
    "MIN_JAVA_VERSION",
    "QUIET_CDS_OPTIONS",
    "JavaNotFoundError",
    "class_archive_options",
    "find_java",
    "get_spark",
    "java_version",
    "session_start_seconds",
    "stop_session",
    "stop_spark",
    "warm_up",
    "warm_up_connect",
    "with_session_id",
]

MIN_JAVA_VERSION = 17
"""Spark 4 needs Java 17 or newer."""

DEFAULT_CONF: dict[str, str] = {
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.execution.arrow.localRelationThreshold": "0",
    "spark.sql.optimizer.excludedRules":
        "org.apache.spark.sql.catalyst.optimizer.ConvertToLocalRelation",
    "spark.sql.adaptive.enabled": "false",
    "spark.default.parallelism": "4",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
}
"""Configuration applied by :func:`get_spark` before the caller's ``conf`` (which wins)."""

LOOPBACK_CONF: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}
"""Added for ``local[...]`` masters and ``spark://`` masters on 127.0.0.1/localhost: the driver
listens on loopback only (a remote cluster's executors must reach the driver's host name)."""


def _on_loopback(master: str) -> bool:
    return master.startswith("local") or master.startswith(("spark://127.", "spark://localhost"))

_log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_SESSION: SparkSession | None = None
_START_SECONDS: float | None = None
_VERSION_RE = re.compile(r'version "(\d+)(?:\.(\d+))?[^"]*"')


class JavaNotFoundError(CgError, RuntimeError):
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
    """The process-wide classic session if it is still alive (its SparkContext not stopped)."""
    s = _SESSION or SparkSession.getActiveSession()
    if s is None:
        return None
    sc = s.sparkContext
    if sc._jsc is None:  # stopped
        return None
    return s


def _mismatch(s: SparkSession, master: str, conf: dict[str, str]) -> str | None:
    """Why the running session ``s`` cannot serve ``master``/``conf`` (a different master or
    static setting), or None when it can."""
    have = s.sparkContext.master
    if have != master:
        return f"master {have!r}, wanted {master!r}"
    for k, v in conf.items():
        running = s.sparkContext.getConf().get(k)
        if s.conf.isModifiable(k) or running in (None, v):
            continue
        if k.endswith(".extraJavaOptions") and v in running:
            continue  # pyspark adds its own JVM options before the ones asked for
        return f"{k}={running!r}, wanted {v!r}"
    return None


def get_spark(
    master: str = "local[2]",
    app_name: str = "cg_pipelines",
    conf: dict[str, str] | None = None,
    *,
    remote: str | None = None,
    class_archive: str | Path | None = None,
    session_id: str | None = None,
) -> SparkSession:
    """Return a SparkSession with these settings, starting it if needed.

    Args:
        master: Spark master URL (``"local[2]"``, ``"local[*]"``, ``"spark://host:7077"`` ...).
        app_name: application name.
        conf: extra Spark configuration; wins over :data:`DEFAULT_CONF`.
        remote: a Spark Connect URL (``"sc://host:15002"``): return a Connect client session
            (``SparkSession.builder.remote(...)``) instead; ``master`` is ignored and no JVM
            starts here. Needs pyspark's Connect client packages (``pyspark[connect]``).
        class_archive: a JVM class-data-sharing archive
            (:func:`~cg_pipelines.spark.classarchive.build_class_archive`, ``cg spark
            archive``): a JVM started here maps Spark's classes from it (its options are added
            to ``spark.driver.extraJavaOptions``); a missing file is logged and ignored.
        session_id: with ``remote``, the server-side session to use (a UUID string, e.g.
            :func:`cg_pipelines.core.sessionid.shared_session_id`): a session of that id that
            the server still holds is joined (with its compiled code, temporary views and
            settings), else the server makes it. An id the server closed (released, or idle
            past its timeout) cannot be used again: a fresh session is made instead (logged).

    One classic session (one JVM) exists per process. When it is running with the same
    ``master`` and no conflicting static setting, it is reused and the runtime-modifiable keys
    of ``conf`` (``spark.sql.*`` mostly) are applied to it; when its master or a static setting
    differs, it is stopped and a new one started (logged as a warning): the settings asked for
    always win.

    Returns:
        The session; time zone UTC, log level WARN.

    Raises:
        JavaNotFoundError: no Java 17+ (checked before the JVM is started).
    """
    global _SESSION, _START_SECONDS
    merged = {**DEFAULT_CONF, **(LOOPBACK_CONF if _on_loopback(master) else {}), **(conf or {})}
    if remote is not None:
        t0 = time.perf_counter()
        try:
            session = _connect_session(remote, app_name, merged, session_id)
        except Exception as e:
            if session_id is None or _condition(e) != "INVALID_HANDLE.SESSION_CLOSED":
                raise
            _log.warning("Spark Connect session %s was closed by the server: using a fresh "
                         "session", session_id)
            _forget_failed_connect_session()
            session = _connect_session(remote, app_name, merged, None)
        _START_SECONDS = time.perf_counter() - t0
        _log.info("Spark Connect session on %s in %.2f s", remote, _START_SECONDS)
        return session
    with _LOCK:
        existing = _active()
        if existing is not None:
            why = _mismatch(existing, master, conf or {})
            if why is None:
                _SESSION = existing
                for k, v in (conf or {}).items():
                    if existing.conf.isModifiable(k):
                        existing.conf.set(k, v)
                return existing
            _log.warning("stopping the process's SparkSession (%s) to start one with the "
                         "settings asked for", why)
            existing.stop()
            _SESSION = None
        _check_java()
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
        if _on_loopback(master):
            # Otherwise Spark resolves the host name, warns, and may bind a non-loopback address.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = SparkSession.builder.master(master).appName(app_name)
        merged.update(_archive_conf(merged, class_archive))
        for k, v in merged.items():
            builder = builder.config(k, v)
        t0 = time.perf_counter()
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
        _START_SECONDS = time.perf_counter() - t0
        _SESSION = spark
        return spark


def _connect_session(remote: str, app_name: str, conf: dict[str, str],
                     session_id: str | None) -> SparkSession:
    url = remote if session_id is None else with_session_id(remote, session_id)
    builder = SparkSession.builder.remote(url).appName(app_name)
    for k, v in conf.items():
        if k.startswith("spark.sql."):  # Connect sessions take runtime settings only
            builder = builder.config(k, v)
    return builder.getOrCreate()


def _forget_failed_connect_session() -> None:
    """Close the client of a Connect session whose settings the server refused (pyspark made
    it the process's active session before applying them), without releasing its id."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    broken = ConnectSession.getActiveSession()
    if broken is not None:
        stop_session(broken, release=False)


def _condition(e: BaseException) -> str | None:
    """A pyspark error's condition (``INVALID_HANDLE.SESSION_CLOSED`` ...), or None."""
    get = getattr(e, "getCondition", None)
    try:
        return get() if callable(get) else None
    except Exception:  # not a pyspark error after all
        return None


def with_session_id(remote: str, session_id: str) -> str:
    """The Spark Connect URL ``remote`` with its ``session_id`` parameter set to
    ``session_id`` (parameters follow ``/;`` and are ``;``-separated: ``sc://host:port/;
    token=...;session_id=...``; an existing ``session_id`` is replaced)."""
    base, _, params = remote.partition("/;")
    kept = [p for p in params.split(";") if p and not p.startswith("session_id=")]
    return f"{base.rstrip('/')}/;" + ";".join([*kept, f"session_id={session_id}"])


QUIET_CDS_OPTIONS = "-Xlog:cds=off -Xlog:cds+dynamic=off"
"""JVM options that keep class-data sharing's per-class warnings (e.g. "Skipping ...: Signed
JAR") out of the driver's output."""


def class_archive_options(path: str | Path) -> str:
    """The driver JVM options that map the class archive at ``path``
    (``-XX:SharedArchiveFile=<path>`` and :data:`QUIET_CDS_OPTIONS`; the archive:
    :mod:`cg_pipelines.spark.classarchive`)."""
    return f"-XX:SharedArchiveFile={Path(path).resolve()} {QUIET_CDS_OPTIONS}"


def _archive_conf(conf: dict[str, str], archive: str | Path | None) -> dict[str, str]:
    """``spark.driver.extraJavaOptions`` with the class archive's options added (the
    configured options kept first), or nothing when there is no archive to use."""
    if archive is None:
        return {}
    if not Path(archive).is_file():
        _log.info("no Spark class archive at %s: the JVM starts without one (build it with "
                  "`cg spark-archive`)", archive)
        return {}
    key = "spark.driver.extraJavaOptions"
    return {key: f"{conf.get(key, '')} {class_archive_options(archive)}".strip()}


def session_start_seconds() -> float | None:
    """Seconds the last :func:`get_spark` start took (JVM + session, or a Spark Connect
    client session with its imports), ``None`` if it never started one in this process (e.g.
    the session was created elsewhere)."""
    return _START_SECONDS


def warm_up_connect(remote: str, rounds: int = 3, rows: int = 40_000) -> list[float]:
    """:func:`warm_up` on a session of the Spark Connect server at ``remote``
    (``sc://host:port``), stopped afterwards. A fresh server's JVM takes several seconds for
    the first job shaped like a run's and a fraction of that once its code is compiled;
    warming it at start keeps that off the first run.

    Returns:
        Seconds per job.

    Raises:
        Whatever pyspark raises when the server cannot be reached or fails a job.
    """
    spark = get_spark(remote=remote, app_name="cg_pipelines-warm-up")
    try:
        return warm_up(spark, rounds, rows)
    finally:
        stop_session(spark)


def warm_up(spark: SparkSession, rounds: int = 3, rows: int = 40_000) -> list[float]:
    """Run ``rounds`` jobs shaped like a partition run's on ``spark`` (classic or Connect): an
    Arrow table of ``rows`` rows uploaded, window functions over a shuffle by key (row number,
    lag, running sum), date arithmetic, the result downloaded as Arrow.

    Returns:
        Seconds per job.

    Raises:
        InvariantError: a job returned the wrong number of rows; whatever pyspark raises.
    """
    import pyarrow as pa
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    took: list[float] = []
    n = max(1, rows)
    table = pa.table({
        "key": pa.array([f"k{i % 2_000}" for i in range(n)]),
        SEQ_COLUMN: pa.array(range(n), pa.int64()),
        "value": pa.array([i % 97 for i in range(n)], pa.int64()),
        "name": pa.array([f"n{i % 31}" for i in range(n)]),
    })
    w = Window.partitionBy("key").orderBy(SEQ_COLUMN)
    upto = w.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    for _ in range(max(0, rounds)):
        t0 = time.perf_counter()
        df = spark.createDataFrame(table)
        rn = F.row_number().over(w)
        out = df.select(
            "key", SEQ_COLUMN, rn.alias("rn"),
            F.when(rn == 1, F.lit(None)).otherwise(F.lag("name").over(w)).alias("prev"),
            (F.col("value") - F.lag("value").over(w)).cast("long").alias("delta"),
            F.sum("value").over(upto).alias("running"),
            F.datediff(F.make_date(F.lit(2013), (F.col("value") % 12 + 1).cast("int"),
                                   F.lit(1)), F.lit("2013-01-01").cast("date"))
            .alias("days"),
        ).toArrow()
        if out.num_rows != n:
            raise InvariantError(f"warm-up job returned {out.num_rows} rows of {n}")
        took.append(time.perf_counter() - t0)
    return took


def stop_session(session: object, *, release: bool = True) -> None:
    """Stop ``session``, classic or Spark Connect, with its own API (idempotent; errors of an
    already-gone Connect server are ignored). ``release=False`` closes a Spark Connect
    client's connection but leaves its server-side session to other clients of the same
    session id (the server drops it after its idle timeout); a classic session ignores it."""
    global _SESSION
    if isinstance(session, SparkSession):
        with _LOCK:
            if session is _SESSION:
                _SESSION = None
            if session.sparkContext._jsc is not None:
                session.stop()
        return
    if not release and hasattr(session, "release_session_on_close"):
        session.release_session_on_close = False  # pyspark: stop() then only closes the channel
    try:
        session.stop()  # type: ignore[attr-defined]
    except Exception as e:  # the Connect server may be gone already
        _log.debug("stopping the Spark Connect session: %s", e)


def stop_spark() -> None:
    """Stop the process's SparkSession and its JVM context (idempotent)."""
    global _SESSION
    with _LOCK:
        s = _active()
        _SESSION = None
        if s is not None:
            s.stop()
