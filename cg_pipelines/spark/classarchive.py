"""A JVM class-data-sharing archive for Spark driver JVMs: a local Spark JVM that maps the
classes a partition run loads from an archive starts and warms up faster.

HotSpot's AppCDS (JDK 13+, "dynamic archive"): a JVM started with
``-XX:ArchiveClassesAtExit=<file>`` writes, when it exits, every class it loaded beyond the
JDK's own archive; later JVMs started with ``-XX:SharedArchiveFile=<file>`` map those classes
instead of loading, verifying and linking them from Spark's jars. Measured on 2 cores (OpenJDK
17, pyspark 4.3, ``local[2]``, the example's legs transform on 40,000 rows): session start 4.8-5.5
s -> 3.1-3.5 s, first batch 5.0-5.4 s -> 3.5-3.9 s, 5 fewer CPU-seconds per JVM; the archive is
≈160 MB.

:func:`build_class_archive` makes one by running a job shaped like a partition run's (an
Arrow table in, window functions over a shuffle, Arrow out:
:func:`~cg_pipelines.spark.session.warm_up`) in a child interpreter, and replaces the file
atomically. :func:`get_spark(class_archive=...)
<cg_pipelines.spark.session.get_spark>` (and ``SparkResource(class_archive=...)``) start the
JVM with it. An archive only serves the JVM and the class path it was made with: another Java
or pyspark version makes the JVM ignore it (``-Xshare:auto``, the default: a slower start, never
an error), so rebuild it after upgrading either (``cg spark-archive``). Spark Connect sessions
start no JVM here and do not use it.

Run as ``python -m cg_pipelines.spark.classarchive <file>`` it is that child (internal).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from cg_pipelines.core.errors import StateError
from cg_pipelines.spark.session import QUIET_CDS_OPTIONS, class_archive_options

__all__ = ["QUIET_CDS_OPTIONS", "build_class_archive", "class_archive_options"]


def build_class_archive(path: str | Path, *, timeout_s: float = 600.0) -> float:
    """Build the class archive for this interpreter's pyspark and Java at ``path``.

    Starts a child interpreter whose local Spark JVM (``local[2]``) runs two jobs shaped like a
    partition run's and writes the archive when it exits; waits for that JVM to exit, then
    moves the file to ``path`` (``os.replace``: readers see the old archive or the new one,
    never a partial file). Creates ``path``'s folder.

    Returns:
        Seconds taken.

    Raises:
        StateError: the child failed (its output's last lines in the message) or the JVM
            wrote no archive.
        subprocess.TimeoutExpired: past ``timeout_s`` seconds (the child is killed).
    """
    t0 = time.monotonic()
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", __name__, str(tmp)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        tmp.unlink(missing_ok=True)
        raise
    # The JVM (the child's child, in its process group) writes the archive as it exits, after
    # the child interpreter has gone.
    deadline = time.monotonic() + max(0.0, timeout_s - (time.monotonic() - t0))
    while _group_alive(proc.pid):
        if time.monotonic() > deadline:
            os.killpg(proc.pid, 9)
            raise subprocess.TimeoutExpired(str(tmp), timeout_s)
        time.sleep(0.2)
    if proc.returncode != 0 or not tmp.is_file() or tmp.stat().st_size == 0:
        tail = "\n".join(out.decode(errors="replace").splitlines()[-20:])
        tmp.unlink(missing_ok=True)
        raise StateError(f"building the Spark class archive failed (exit {proc.returncode}, "
                         f"archive {'written' if tmp.is_file() else 'not written'}):\n{tail}")
    os.replace(tmp, target)
    return time.monotonic() - t0


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: any member, zombie or not
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _child(tmp: str) -> None:
    from cg_pipelines.spark.session import get_spark, stop_spark, warm_up

    spark = get_spark("local[2]", app_name="cg_pipelines-class-archive", conf={
        "spark.driver.extraJavaOptions": f"-XX:ArchiveClassesAtExit={tmp} {QUIET_CDS_OPTIONS}"})
    warm_up(spark, rounds=2)
    stop_spark()


if __name__ == "__main__":
    _child(sys.argv[1])
