"""Apache Iceberg tables for the Dagster integration: :class:`IcebergWarehouseResource` (a
drop-in for :class:`~cg_pipelines.dagster.DeltaWarehouseResource`, chosen by configuration)
and :class:`IcebergTableIOManager` (downstream assets get the table: the history in append
mode, each key's current row in merge mode). They are defined beside their Delta
counterparts, in :mod:`cg_pipelines.dagster.warehouse` and :mod:`cg_pipelines.dagster.
io_manager`, and importable here.

Requires the ``iceberg`` extra (``pip install cg-pipelines[dagster,iceberg]``)::

    from cg_pipelines.dagster import build_definitions
    from cg_pipelines.dagster.iceberg import IcebergWarehouseResource

    defs = build_definitions([totals], resources={
        "nats": ..., "spark": ...,
        # embedded SQLite catalog in <warehouse>/catalog.db (no server):
        "warehouse": IcebergWarehouseResource(warehouse="/data/lake"),
        # or a Postgres-backed SQL catalog, data on S3:
        # IcebergWarehouseResource(catalog_uri=EnvVar("CG_ICEBERG_CATALOG"),
        #                          warehouse="s3://lake/tables", s3_endpoint=...,
        #                          aws_access_key_id=EnvVar(...), ...)
        # or a REST catalog: IcebergWarehouseResource(catalog_type="rest",
        #                          catalog_uri="https://catalog:8181", warehouse="...")
    })

``build_definitions`` then adds an :class:`IcebergTableIOManager` for the group's downstream
assets (:func:`~cg_pipelines.dagster.io_manager.table_io_manager`). The tables are
``<namespace>.<asset name>``; see :mod:`cg_pipelines.sinks.iceberg` for the fence and what
maintenance pyiceberg 0.12 offers.
"""

from cg_pipelines.dagster.io_manager import IcebergTableIOManager, spark_frame
from cg_pipelines.dagster.warehouse import IcebergWarehouseResource

__all__ = ["IcebergTableIOManager", "IcebergWarehouseResource", "spark_frame"]
