"""Shared fixtures of the months tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A Delta table's location, ``(uri, storage options)``: a local directory (no options)
    or a moto S3 bucket (the real server, see ``tests/conftest.py``'s ``moto_s3``)."""
    if request.param == "local":
        return str(tmp_path / "t"), {}
    moto = request.getfixturevalue("moto_s3")
    return f"s3://{moto.bucket}/t", moto.options
