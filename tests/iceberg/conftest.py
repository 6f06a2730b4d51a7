"""Iceberg test backends: pyiceberg's SQL catalog on SQLite (embedded) or on a throwaway
PostgreSQL (the ``postgres_database`` fixture), data on local disk or on moto S3. A backend is
asked for by name, so a test starts only the servers it uses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.iceberg import IcebergSink, iceberg_s3_properties
from cg_pipelines.sinks.iceberg_read import sqlite_wal

BACKENDS = ("sqlite-local", "sqlite-s3", "postgres-local", "postgres-s3")


@dataclass(frozen=True)
class Backend:
    """Where an Iceberg table lives: ``catalog`` (``load_catalog`` properties) and the table
    ``identifier``."""

    name: str
    catalog: dict[str, str]
    identifier: str = "cg.events"

    def sink(self, merge: Merge | None = None, **kw: object) -> IcebergSink:
        return IcebergSink(self.identifier, catalog=dict(self.catalog), write=merge, **kw)  # type: ignore[arg-type]

    def spec(self, mode: str) -> str:
        """The worker's sink argument."""
        return json.dumps({"catalog": self.catalog, "identifier": self.identifier, "mode": mode})


def make_backend(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    db, store = name.split("-")
    props: dict[str, str] = {"type": "sql", "init_catalog_tables": "true"}
    if db == "sqlite":
        sqlite_wal(str(tmp_path / "catalog.db"))  # as sqlite_catalog() does
        props["uri"] = f"sqlite:///{tmp_path / 'catalog.db'}"
    else:
        url: str = request.getfixturevalue("postgres_database")
        props["uri"] = url.replace("postgresql://", "postgresql+psycopg2://", 1)
    if store == "local":
        (tmp_path / "wh").mkdir()
        props["warehouse"] = f"file://{tmp_path / 'wh'}"
    else:
        bucket = request.getfixturevalue("moto_s3")
        props["warehouse"] = f"s3://{bucket.bucket}/wh"
        props.update(iceberg_s3_properties(bucket.options))
    return Backend(name, props)


@pytest.fixture
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """The backend named by the test's ``backend`` parameter (indirect parametrization)."""
    return make_backend(request.param, request, tmp_path)
