"""pytest fixtures with real servers, for your own tests.

Enable them in your ``conftest.py``::

    pytest_plugins = ["cg_pipelines.testing.fixtures"]

Fixtures:

- ``nats_server`` (session): a :class:`~cg_pipelines.testing.NatsServer` with JetStream on
  127.0.0.1, a random port and a temporary store. A missing ``nats-server`` binary fails the
  test (:class:`~cg_pipelines.testing.NatsServerNotFoundError`), it never skips.
- ``nats_url`` (session): its URL, e.g. ``"nats://127.0.0.1:40211"``.
- ``nats_cluster`` (session): a :class:`~cg_pipelines.testing.NatsCluster`, 3 JetStream nodes on
  127.0.0.1 (free ports, temporary stores), healthy when handed out; tests may kill, restart and
  step down its nodes (wait with ``await nats_cluster.wait_healthy()`` before handing it on).
- ``nats_cluster_url`` (session): every node's URL, comma separated (for ``ConnectOptions``,
  ``cg --server``, ``NatsResource(servers=...)``; nats-py's own ``connect`` takes
  ``servers=nats_cluster.urls``).
- ``moto_server`` (session): a :class:`~cg_pipelines.testing.MotoS3Server`.
- ``s3_bucket``: a new bucket on it, as ``(name, storage_options)`` ready for
  :class:`~cg_pipelines.sinks.delta.DeltaSink` (``"s3://<name>/<table>"``).
- ``postgres_server`` (session): a :class:`~cg_pipelines.local.postgres.PostgresServer` on
  127.0.0.1 (Debian's ``postgresql`` binaries; missing binaries fail the test, never skip).
- ``postgres_database``: a new, empty database on it, as its URL
  (``postgresql://cg@127.0.0.1:<port>/<name>``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.local.postgres import PostgresServer
from cg_pipelines.testing.cluster import NatsCluster
from cg_pipelines.testing.s3 import MotoS3Server

_BUCKETS = itertools.count()
_DATABASES = itertools.count()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server with JetStream on 127.0.0.1 (random port, temporary store)."""
    server = NatsServer(tmp_path_factory.mktemp("nats"), port=0)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    """The session server's client URL."""
    return nats_server.url


@pytest.fixture(scope="session")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """A 3-node JetStream cluster on 127.0.0.1 (random ports, temporary stores), stopped by PID
    (SIGKILL after 3 s) at the end of the session. A test that kills a node restarts it and
    waits for ``wait_healthy()`` before it ends, so the next test gets the whole cluster."""
    cluster = NatsCluster(tmp_path_factory.mktemp("nats-cluster"), size=3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def nats_cluster_url(nats_cluster: NatsCluster) -> str:
    """The cluster's client URLs, comma separated."""
    return nats_cluster.url


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3Server]:
    """moto's S3 server mode on 127.0.0.1 (one per session)."""
    with MotoS3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(moto_server: MotoS3Server) -> tuple[str, dict[str, str]]:
    """A fresh bucket: ``(name, delta-rs storage options)``."""
    name = f"cg-test-{next(_BUCKETS)}"
    moto_server.create_bucket(name)
    return name, moto_server.storage_options()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server on 127.0.0.1 (one per session), stopped by PID."""
    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_database(postgres_server: PostgresServer) -> str:
    """A fresh database on the session's server, as its URL."""
    return postgres_server.create_database(f"cg_test_{next(_DATABASES)}")
