"""``scripts/setup.sh``: the main job's setup installs no system package; ``--tests`` installs
the test suite's (Chromium, ChromeDriver, PostgreSQL) when missing.

The script runs in a scratch copy of the repo layout with stand-ins for what it calls
(``java``, ``apt-get``, the venv's ``python`` and ``cg``), so it never touches this machine's
packages or the shared venv; the stand-in ``apt-get`` records its arguments.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def scratch(tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    root, bin_dir, log = tmp_path / "repo", tmp_path / "bin", tmp_path / "apt.log"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    (root / "pyproject.toml").write_text("")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    _stub(venv_bin / "python", "exit 0")  # pip install and the nats-server check
    _stub(venv_bin / "cg", "exit 0")      # cg spark-archive
    (root / ".venv" / ".cg-installed").touch()
    os.utime(root / "pyproject.toml", (1, 1))  # older than the stamp: no pip install
    bin_dir.mkdir()
    _stub(bin_dir / "java", "echo 'openjdk version \"17.0.9\" 2023-10-17' >&2")
    _stub(bin_dir / "apt-get", f'echo "$@" >> {log}')
    _stub(bin_dir / "sudo", '"$@"')
    _stub(bin_dir / "python3", f'exec {sys.executable} "$@"')
    for tool in ("sed", "head", "dirname", "id", "ls", "touch", "mkdir", "cat"):
        found = shutil.which(tool)
        assert found, tool
        os.symlink(found, bin_dir / tool)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "CG_STATE_DIR": str(tmp_path / "state")}
    return root, env, log


def test_main_job_setup_installs_no_system_package(scratch: tuple[Path, dict[str, str], Path]
                                                   ) -> None:
    root, env, log = scratch
    proc = subprocess.run(["/bin/bash", "scripts/setup.sh"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "setup: ok (java 17" in proc.stdout
    assert not log.exists(), log.read_text()  # apt-get never ran


def test_tests_setup_installs_the_browser_and_postgres(
        scratch: tuple[Path, dict[str, str], Path]) -> None:
    root, env, log = scratch
    proc = subprocess.run(["/bin/bash", "scripts/setup.sh", "--tests"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text()
    assert "install -y -qq chromium chromium-driver" in calls, calls
    if not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        assert "install -y -qq postgresql" in calls, calls


def test_unknown_option_is_refused(scratch: tuple[Path, dict[str, str], Path]) -> None:
    root, env, _ = scratch
    proc = subprocess.run(["/bin/bash", "scripts/setup.sh", "--test"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "unknown option --test (known: --tests)" in proc.stderr
