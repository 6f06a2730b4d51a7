"""What importing the Dagster integration loads: every Dagster run worker (``dagster api
execute_run``), code server and sensor evaluation imports the code location, so modules that
only some calls need are imported by those calls, not by the library's modules.

Behaviour, not timing (timings belong in ``bench/``): each test imports in a fresh interpreter
and checks ``sys.modules``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: Not imported by ``import cg_pipelines.dagster`` (nor by the sink alone):
#: ``pyarrow.dataset`` imports pandas (together ~0.3 s); delta-rs imports it when a read
#: builds a dataset. pyspark comes with a Spark processor or resource, not with the library.
DEFERRED = ("pandas", "pyarrow.dataset", "pyspark", "cg_pipelines.spark")


def _run(code: str, cwd: Path | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_dagster_integration_defers_heavy_modules() -> None:
    loaded = _run(f"""
import sys
import cg_pipelines.dagster
print(sorted(m for m in {DEFERRED!r} if m in sys.modules))
""")
    assert loaded == "[]", f"imported by cg_pipelines.dagster: {loaded}"


def test_importing_the_sink_defers_heavy_modules() -> None:
    loaded = _run(f"""
import sys
import cg_pipelines.sinks
from cg_pipelines.sinks.delta import DeltaSink
print(sorted(m for m in {DEFERRED!r} if m in sys.modules))
""")
    assert loaded == "[]", f"imported by cg_pipelines.sinks: {loaded}"


def test_a_read_in_a_fresh_interpreter_imports_what_it_needs(tmp_path: Path) -> None:
    # The deferred module is imported by the read itself (no test process has it preloaded):
    # a filtered read and a keyed last-row read work right after importing only the sink.
    out = _run("""
import sys
import pyarrow as pa
import pyarrow.compute as pc
from cg_pipelines.sinks.delta import DeltaSink
assert "pyarrow.dataset" not in sys.modules
sink = DeltaSink("table")
sink.commit(pa.table({"k": ["a", "b", "a"], "n": [1, 2, 3]}), {"app": (0, 3)})
print(sink.read(filter=pc.field("k") == "a").column("n").to_pylist(),
      sink.last_rows("k", ["a", "b"], ["k", "n"], "n").column("n").to_pylist(),
      "pyarrow.dataset" in sys.modules)
""", cwd=tmp_path)
    assert out == "[1, 3] [3, 2] True"
