"""Real servers for your own tests, and a sink that needs none.

- A single ``nats-server``, Spark and PostgreSQL processes are development tools too: they
  live in :mod:`cg_pipelines.local` (:class:`~cg_pipelines.local.nats_server.NatsServer`,
  :class:`~cg_pipelines.local.spark_cluster.SparkStandaloneCluster`, ...), which ``cg dev``
  runs; import them from there.
- :class:`NatsCluster`: a 3-node JetStream cluster on 127.0.0.1 (own stores, routes, server
  names), with kill -9 / restart / stream and meta leader step-down helpers.
- :class:`MotoS3Server`: moto's S3 server mode in a thread, for Delta tables on ``s3://``.
- :class:`MemorySink`: a table sink held in memory that honours the sink contract (the fence,
  markers, per-key state, replace_partition) like the Delta and Iceberg sinks, to test a
  transform or a run without a table; :class:`MemoryCommit` is what it records per commit.
- pytest fixtures: add ``pytest_plugins = ["cg_pipelines.testing.fixtures"]`` to your
  ``conftest.py`` for ``nats_server`` (session-scoped), ``nats_url``, ``nats_cluster``,
  ``nats_cluster_url``, ``moto_server`` and ``s3_bucket`` (see
  :mod:`cg_pipelines.testing.fixtures`).

Install with ``pip install cg-pipelines[testing]``.
"""

from cg_pipelines.testing.cluster import NatsCluster, NatsClusterError
from cg_pipelines.testing.memory import MemoryCommit, MemorySink
from cg_pipelines.testing.s3 import MotoS3Server

__all__ = ["MemoryCommit", "MemorySink", "MotoS3Server", "NatsCluster", "NatsClusterError"]
