"""Apache Iceberg tables for the Dagster integration: :class:`IcebergWarehouseResource` (a
drop-in for :class:`~cg_pipelines.dagster.DeltaWarehouseResource`, chosen by configuration)
and :class:`IcebergTableIOManager` (downstream assets get the table: the history in append
mode, each key's current row in merge mode).

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
assets (it asks the warehouse resource for its IO manager). The tables are
``<namespace>.<asset name>``; see :mod:`cg_pipelines.sinks.iceberg` for the fence and what
maintenance pyiceberg 0.12 offers.
"""

from __future__ import annotations

import os
import threading
from typing import Any, ClassVar

import pyarrow as pa
from dagster import ConfigurableIOManager, ConfigurableResource, InputContext, OutputContext
from pydantic import Field
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.expressions import In

from cg_pipelines.core.errors import ConfigError, UsageError, WrongTypeError
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.dagster.io_manager import partitions_to_load, upstream_table
from cg_pipelines.dagster.resources import SparkResource
from cg_pipelines.sinks.base import PARTITION_COLUMN
from cg_pipelines.sinks.iceberg import IcebergSink, iceberg_s3_properties
from cg_pipelines.sinks.iceberg_read import sqlite_wal
from cg_pipelines.sinks.storage import s3_options

__all__ = ["IcebergTableIOManager", "IcebergWarehouseResource", "spark_frame"]

_CATALOGS: dict[tuple[tuple[str, str], ...], Catalog] = {}
_CATALOGS_LOCK = threading.Lock()


class IcebergWarehouseResource(ConfigurableResource):
    """Where a deployment's Iceberg tables live: catalog + warehouse (see module docstring).

    Secrets (S3 keys, a REST token) are handed to pyiceberg's catalog and FileIO properties
    and never logged (:class:`~cg_pipelines.sinks.iceberg.IcebergSink` masks them in
    ``repr``); give them as ``EnvVar``.
    """

    supports_state: ClassVar[bool] = True  # its sinks serve per-key state (last_rows)

    warehouse: str = Field(description="Data root: a local directory or s3://bucket/prefix.")
    catalog_type: str = Field("sql", description="'sql' (SQLite/Postgres) or 'rest'.")
    catalog_uri: str | None = Field(
        None, description="SQLAlchemy URL (sqlite:///..., postgresql+psycopg2://...) or REST "
        "URI; default: SQLite in <warehouse>/catalog.db (local warehouse only).")
    catalog_name: str = Field("cg")
    namespace: str = Field("cg", description="Namespace of the group tables.")
    rest_token: str | None = Field(None, description="REST catalog bearer token; use EnvVar.")
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL (e.g. MinIO, moto).")
    aws_access_key_id: str | None = Field(None, description="Use EnvVar.")
    aws_secret_access_key: str | None = Field(None, description="Use EnvVar.")
    aws_region: str = Field("us-east-1")
    allow_http: bool = Field(False, description="Allow a plain-http S3 endpoint.")

    def _root(self) -> str:
        if "://" in self.warehouse:
            return self.warehouse
        return "file://" + os.path.abspath(self.warehouse)

    def catalog_properties(self) -> dict[str, str]:
        """The ``load_catalog`` properties (secrets included: do not log them).

        Raises:
            UsageError: no ``catalog_uri`` with an S3 warehouse or a REST catalog, or an
                unknown ``catalog_type``.
        """
        if self.catalog_type not in ("sql", "rest"):
            raise UsageError(f"catalog_type must be 'sql' or 'rest', got {self.catalog_type!r}")
        uri = self.catalog_uri
        if uri is None:
            if self.catalog_type != "sql" or "://" in self.warehouse:
                raise UsageError("catalog_uri is required with an s3:// warehouse or a REST "
                                 "catalog")
            os.makedirs(self.warehouse, exist_ok=True)
            db = os.path.abspath(os.path.join(self.warehouse, "catalog.db"))
            sqlite_wal(db)
            uri = f"sqlite:///{db}"
        props = {"type": self.catalog_type, "uri": uri, "warehouse": self._root()}
        if self.catalog_type == "sql":
            props["init_catalog_tables"] = "true"
        if self.rest_token:
            props["token"] = self.rest_token
        if self.warehouse.startswith("s3://"):
            props.update(iceberg_s3_properties(s3_options(
                self.s3_endpoint, self.aws_access_key_id, self.aws_secret_access_key,
                region=self.aws_region, allow_http=self.allow_http)))
        return props

    def catalog(self) -> Catalog:
        """The catalog (one per distinct configuration in this process)."""
        props = self.catalog_properties()
        key = tuple(sorted({**props, "name": self.catalog_name}.items()))
        with _CATALOGS_LOCK:
            cat = _CATALOGS.get(key)
            if cat is None:
                cat = _CATALOGS[key] = load_catalog(self.catalog_name, **props)
            return cat

    def identifier(self, table: str) -> str:
        return f"{self.namespace}.{table}"

    def table_uri(self, table: str) -> str:
        """``iceberg://<catalog>/<namespace>.<table>`` (the table's location once it exists
        is :attr:`IcebergSink.uri`)."""
        return f"iceberg://{self.catalog_name}/{self.identifier(table)}"

    def storage_options(self) -> dict[str, str] | None:
        return None

    def sink(self, table: str, write: Append | Merge | None = None,
             commit_metadata: dict[str, str] | None = None,
             maintenance: object | None = None) -> IcebergSink:
        """A fenced Iceberg sink for ``table`` (identity-partitioned by ``_partition``).

        Raises:
            ConfigError: ``maintenance`` given: those settings (compaction, vacuum, Delta log
                cleanup, :class:`~cg_pipelines.sinks.maintenance.Maintenance`) are Delta's; an
                Iceberg sink's upkeep is snapshot expiry (docs/iceberg.md).
        """
        if maintenance is not None:
            raise ConfigError("maintenance", "Delta table upkeep settings (Maintenance) do not "
                              "apply to an Iceberg warehouse: leave ConsumerGroupAsset."
                              "maintenance unset (Iceberg upkeep is snapshot expiry)")
        return IcebergSink(self.identifier(table), catalog=self.catalog(), write=write,
                           commit_metadata=commit_metadata)

    def io_manager(self, spark: SparkResource | None = None) -> IcebergTableIOManager:
        """The IO manager ``build_definitions`` adds for the group's downstream assets."""
        return IcebergTableIOManager(warehouse=self, spark=spark)


class IcebergTableIOManager(ConfigurableIOManager):
    """Loads a consumer-group asset's Iceberg table for downstream assets, typed by the
    argument's annotation: ``pyarrow.Table`` (or none), ``pandas.DataFrame``,
    ``pyspark.sql.DataFrame`` (:func:`spark_frame`), ``polars.DataFrame``.
    Append mode: the history; merge mode: each key's current row. When the downstream asset
    is partitioned like the group asset only its partitions' rows are read."""

    warehouse: IcebergWarehouseResource
    spark: SparkResource | None = None

    def handle_output(self, context: OutputContext, obj: Any) -> None:
        """Nothing to store (the engine committed the rows). Raises ``WrongTypeError`` for a
        returned value."""
        if obj is not None:
            raise WrongTypeError(f"{context.asset_key.to_user_string()}: IcebergTableIOManager "
                                 "only loads consumer-group tables; it does not store values")

    def load_input(self, context: InputContext) -> Any:
        """The upstream group asset's table (or its loaded partitions), typed as asked.

        Raises:
            UsageError: the upstream asset is no consumer-group asset, or a Spark DataFrame
                is asked for without ``spark``.
            WrongTypeError: an annotation this IO manager cannot produce.
        """
        table, md = upstream_table(context)
        sink = self.warehouse.sink(table)
        parts = partitions_to_load(context, md)
        flt = In(PARTITION_COLUMN, parts) if parts is not None else None
        want = context.dagster_type.typing_type
        name = f"{getattr(want, '__module__', '')}.{getattr(want, '__qualname__', '')}"
        if name.startswith("pyspark.sql") and name.endswith("DataFrame"):
            if self.spark is None:
                raise UsageError("a Spark DataFrame input needs IcebergTableIOManager(spark=...)")
            return spark_frame(self.spark.spark_session, sink, parts)
        arrow = sink.read(row_filter=flt)
        if name.startswith("polars"):
            import polars as pl

            return pl.from_arrow(arrow)
        if name.startswith("pandas") and name.endswith("DataFrame"):
            return arrow.to_pandas()
        if want in (Any, pa.Table, object) or name in (".", "builtins.object", "typing.Any"):
            return arrow
        raise WrongTypeError(f"IcebergTableIOManager loads pyarrow.Table, pandas/pyspark/polars "
                             f"DataFrame; {context.asset_key.to_user_string()} is annotated "
                             f"{want!r}")


def spark_frame(spark: Any, sink: IcebergSink, parts: list[int] | None = None) -> Any:
    """The table (or ``parts``' rows) as a Spark DataFrame: local tables are read on the
    executors from the current snapshot's Parquet files (pyiceberg writes copy-on-write only,
    so those files are the table); tables on object storage (Spark needs hadoop-aws and
    ``s3a://`` settings for them) are read by pyiceberg on the driver and handed over."""
    flt = In(PARTITION_COLUMN, parts) if parts is not None else None
    files = sink.data_files(flt)
    if not files or not all(f.startswith(("file:", "/")) for f in files):
        return spark.createDataFrame(sink.read(row_filter=flt))  # pyspark 4 takes Arrow
    df = spark.read.parquet(*files)
    return df if parts is None else df.where(df[PARTITION_COLUMN].isin(parts))
