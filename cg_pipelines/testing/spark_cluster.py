"""Moved to :mod:`cg_pipelines.local.spark_cluster` (local Spark processes are for development
as much as for tests); this module re-exports its names so existing imports keep working."""

from cg_pipelines.local.spark_cluster import (
    CONNECT_SERVER_CONF,
    SparkConnectServer,
    SparkStandaloneCluster,
    spark_home,
    stop_pid,
)

__all__ = ["CONNECT_SERVER_CONF", "SparkConnectServer", "SparkStandaloneCluster", "spark_home",
           "stop_pid"]
