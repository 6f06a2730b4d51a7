"""Apache Iceberg tables for the Dagster integration (``pip install
cg-pipelines[dagster,iceberg]``): :class:`IcebergWarehouseResource` (a drop-in for
:class:`~cg_pipelines.dagster.DeltaWarehouseResource`, chosen by configuration: embedded
SQLite, Postgres or REST catalog) and :class:`IcebergTableIOManager`, defined beside their
Delta counterparts in :mod:`~cg_pipelines.dagster.warehouse` and
:mod:`~cg_pipelines.dagster.io_manager` and importable here (docs/iceberg.md)."""

from cg_pipelines.dagster.io_manager import IcebergTableIOManager, spark_frame
from cg_pipelines.dagster.warehouse import IcebergWarehouseResource

__all__ = ["IcebergTableIOManager", "IcebergWarehouseResource", "spark_frame"]
