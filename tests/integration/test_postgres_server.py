"""The throwaway PostgreSQL server the Dagster-instance and Iceberg-catalog tests run on."""

from __future__ import annotations

import os

import pytest

from cg_pipelines.local.postgres import PostgresServer, PostgresServerError


def test_postgres_database_fixture_answers_sql(postgres_server: PostgresServer,
                                               postgres_database: str) -> None:
    name = postgres_database.rsplit("/", 1)[1]
    assert postgres_database.startswith(f"postgresql://cg@127.0.0.1:{postgres_server.port}/")
    postgres_server.psql("CREATE TABLE t (x int); INSERT INTO t VALUES (41), (1)", database=name)
    assert postgres_server.psql("SELECT sum(x) FROM t", database=name).strip() == "42"


def test_stop_ends_the_process_and_removes_the_directory() -> None:
    server = PostgresServer().start()
    pid, data = server.pid, server.data_dir
    assert pid is not None and data.is_dir()
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not data.exists()
    server.stop()  # idempotent


def test_unsafe_database_name_is_refused(postgres_server: PostgresServer) -> None:
    with pytest.raises(ValueError, match="letters, digits"):
        postgres_server.create_database("x; DROP DATABASE postgres")


def test_missing_binaries_fail_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    from cg_pipelines.local import postgres
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(postgres.glob, "glob", lambda pattern: [])
    with pytest.raises(PostgresServerError, match="apt-get install postgresql"):
        postgres.find_postgres_bin()


def test_an_explicit_directory_without_binaries_is_named() -> None:
    with pytest.raises(PostgresServerError, match="/nonexistent: no initdb"):
        PostgresServer(bin_dir="/nonexistent").start()
