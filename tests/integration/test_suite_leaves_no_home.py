"""The suite's own throwaway ``AIRFLOW_HOME`` (tests/conftest.py) goes at the end of the session
that made it: one per session would otherwise pile up in the temp dir, run after run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import SESSION_TOKEN_VAR

REPO = Path(__file__).resolve().parents[2]


def test_a_session_removes_the_airflow_home_it_made(tmp_path: Path) -> None:
    # A session of its own (its own token: it must never count this session's processes),
    # on two workers as the README's test command runs, with its temp dir here.
    env = {k: v for k, v in os.environ.items() if k not in ("AIRFLOW_HOME", SESSION_TOKEN_VAR)}
    env["TMPDIR"] = str(tmp_path)
    probe = ("tests/unit/test_sessionid.py", "-q", "-n", "2", "-p", "no:cacheprovider")
    out = subprocess.run([sys.executable, "-m", "pytest", *probe], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "passed" in out.stdout
    made = [p.name for p in tmp_path.iterdir() if p.name.startswith("cg-airflow-home-")]
    assert made == []
