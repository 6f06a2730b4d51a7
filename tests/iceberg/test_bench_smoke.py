"""``bench/iceberg_vs_delta.py --smoke`` runs and prints all four figures (behaviour only;
the figures themselves are the bench's business)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke_prints_iceberg_and_delta_append_and_merge() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench/iceberg_vs_delta.py"), "--smoke"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    for name in ("delta append", "iceberg append", "delta merge", "iceberg merge"):
        assert name in out.stdout, out.stdout
    assert "append: Iceberg median commit" in out.stdout
    assert "merge: Iceberg median commit" in out.stdout
