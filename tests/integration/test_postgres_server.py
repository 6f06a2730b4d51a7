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


def test_a_port_taken_before_postgres_binds_it_is_retried_not_shared(
        postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # the port picked for the new server is taken (by the fixture's server) before it binds:
    # it must start on another port, not report the other server's readiness as its own
    from cg_pipelines.local import postgres
    free = postgres._free_port
    picks = iter([postgres_server.port])
    monkeypatch.setattr(postgres, "_free_port", lambda: next(picks, None) or free())
    with PostgresServer() as mine:
        assert mine.pid is not None and mine.port != postgres_server.port
        mine.psql("CREATE TABLE only_mine (x int)")
        assert mine.psql("SELECT count(*) FROM pg_tables WHERE tablename = 'only_mine'"
                         ).strip() == "1"
    assert postgres_server.psql("SELECT count(*) FROM pg_tables WHERE tablename = 'only_mine'"
                                ).strip() == "0"


def test_an_explicit_port_in_use_is_refused_and_leaves_nothing(
        postgres_server: PostgresServer) -> None:
    server = PostgresServer(port=postgres_server.port)
    with pytest.raises(PostgresServerError, match=f"could not listen on 127.0.0.1:"
                                                  f"{postgres_server.port}"):
        server.start()
    assert server.pid is None and server._dir is None
