"""The package's ``__version__`` is pyproject's ``version`` (one number, two places)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import cg_pipelines
from cg_pipelines.version import __version__


def test_version_matches_pyproject() -> None:
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert __version__ == meta["project"]["version"]
    assert cg_pipelines.__version__ is __version__
