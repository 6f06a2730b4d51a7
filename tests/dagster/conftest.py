"""Fixtures of the Dagster tests (the session's nats-server comes from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import DagsterInstance


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    """An in-memory Dagster instance (runs execute in-process)."""
    with DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture
def warehouse(tmp_path: Path) -> str:
    """Warehouse root for the test's Delta tables."""
    return str(tmp_path / "wh")
