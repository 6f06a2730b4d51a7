"""The layering is enforced (issue 41): ``lint-imports`` (import-linter, the contracts of
``[tool.importlinter]`` in pyproject.toml, run by ``.ci/run``) passes on the package as it is,
and fails on a copy of it where one module imports a higher floor or the example deployment,
even from inside a function (grimp reads every import statement, none is executed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")
# The root packages of [tool.importlinter]: the library and the example deployment.
PACKAGES = ("cg_pipelines", "flights", "mainjob", "joinjob", "resources", "assets")


def _lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the packages under ``cwd`` (its pyproject.toml's contracts)."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_the_package_keeps_its_floors() -> None:
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.parametrize(("module", "statement", "contract"), [
    # a floor below imports one above it (core -> sinks)
    ("cg_pipelines/core/errors.py", "from cg_pipelines.sinks import base", "The floors"),
    # the engine reaches up into the Dagster layer
    ("cg_pipelines/engine/runner.py", "import cg_pipelines.dagster.spec", "The floors"),
    # two rooms of one floor that stay apart (dagster and cli)
    ("cg_pipelines/dagster/spec.py", "import cg_pipelines.cli.ops", "The floors"),
    # the library imports the example deployment
    ("cg_pipelines/sinks/storage.py", "import mainjob.run", "never imports the example"),
])
def test_a_floor_breaking_import_fails(tmp_path: Path, module: str, statement: str,
                                       contract: str) -> None:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _lint(tmp_path).returncode == 0  # the copy passes as it is
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n\ndef _probe() -> None:\n    {statement}\n")
    run = _lint(tmp_path)
    assert run.returncode != 0, run.stdout
    broken = [line for line in run.stdout.splitlines() if line.rstrip().endswith("BROKEN")]
    assert broken, run.stdout
    assert contract in run.stdout.split("Broken contracts")[-1], run.stdout
