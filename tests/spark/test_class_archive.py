"""The Spark JVM class-data-sharing archive: ``cg spark-archive`` builds one with this
interpreter's pyspark and Java; a session started with ``class_archive=`` maps it (the file is
in the driver JVM's memory maps); a missing archive is ignored; a failed build leaves nothing
behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from cg_pipelines.spark import session as sess
from cg_pipelines.spark.session import QUIET_CDS_OPTIONS

CG = Path(sys.executable).with_name("cg")
KEY = "spark.driver.extraJavaOptions"


def test_archive_options_follow_the_configured_ones(tmp_path: Path) -> None:
    archive = tmp_path / "classes.jsa"
    assert sess._archive_conf({KEY: "-Dx=1"}, archive) == {}  # no file yet: nothing added
    assert sess._archive_conf({}, None) == {}
    archive.write_bytes(b"x")
    assert sess._archive_conf({KEY: "-Dx=1"}, archive) == {
        KEY: f"-Dx=1 -XX:SharedArchiveFile={archive.resolve()} {QUIET_CDS_OPTIONS}"}
    assert sess._archive_conf({}, str(archive)) == {
        KEY: f"-XX:SharedArchiveFile={archive.resolve()} {QUIET_CDS_OPTIONS}"}


_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from cg_pipelines.spark.session import get_spark, stop_spark, warm_up

    spark = get_spark("local[1]", class_archive=sys.argv[1])
    took = warm_up(spark, rounds=1, rows=500)
    jvm = spark.sparkContext._jvm
    pid = jvm.java.lang.ProcessHandle.current().pid()
    maps = Path(f"/proc/{pid}/maps").read_text()
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    print(json.dumps({"mapped": str(Path(sys.argv[1]).resolve()) in maps, "args": args,
                      "jobs": len(took)}))
    stop_spark()
""")


def _session_facts(archive: Path) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(archive)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_built_archive_is_mapped_by_a_new_session(tmp_path: Path) -> None:
    archive = tmp_path / "spark" / "classes.jsa"
    built = subprocess.run([str(CG), "spark-archive", "--path", str(archive)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    assert str(archive) in built.stdout
    assert archive.stat().st_size > 10 * 2**20  # Spark's classes, not an empty file
    assert [p.name for p in archive.parent.iterdir()] == ["classes.jsa"]  # no temporary left

    facts = _session_facts(archive)
    assert facts["jobs"] == 1
    assert f"-XX:SharedArchiveFile={archive}" in facts["args"]
    assert facts["mapped"] is True  # the JVM really maps it (-Xshare:auto would fall back)

    missing = _session_facts(tmp_path / "none.jsa")  # ignored: a plain start
    assert missing["jobs"] == 1 and missing["mapped"] is False
    assert not any("SharedArchiveFile" in a for a in missing["args"])  # type: ignore[union-attr]


def test_failed_build_leaves_no_file(tmp_path: Path) -> None:
    archive = tmp_path / "classes.jsa"
    out = subprocess.run([str(CG), "spark-archive", "--path", str(archive), "--timeout", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "cannot build the Spark class archive" in out.stderr
    assert list(tmp_path.iterdir()) == []
