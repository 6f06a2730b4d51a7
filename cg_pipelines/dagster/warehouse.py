"""The warehouse resources (:class:`DeltaWarehouseResource`: ``<root>/<table>``;
:class:`IcebergWarehouseResource`: ``<namespace>.<table>`` of a catalog, the ``iceberg`` extra)
and the contract the layer uses them through (:class:`Warehouse`; their tables only through
:class:`~cg_pipelines.sinks.base.TableSink`). Secrets: ``EnvVar``, masked in ``repr``."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from dagster import ConfigurableResource
from pydantic import Field

from cg_pipelines.core.errors import ConfigError, UsageError
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN, TableSink
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.maintenance import Maintenance
from cg_pipelines.sinks.storage import s3_options

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

    from cg_pipelines.sinks.iceberg import IcebergSink

__all__ = ["DeltaWarehouseResource", "IcebergWarehouseResource", "Warehouse"]


@runtime_checkable
class Warehouse(Protocol):
    """Where a deployment's tables live, as the Dagster layer uses it (structural: a resource
    of your own may implement it): ``table_format`` (``"delta"``, ``"iceberg"``) and
    ``supports_state`` (its sinks serve the per-key state a ``KeyedState`` needs)."""

    table_format: ClassVar[str]
    supports_state: ClassVar[bool]

    def table_uri(self, table: str) -> str:
        """Where ``table`` lives (a path or URL), also before it exists."""
        ...

    def storage_options(self) -> dict[str, str] | None:
        """The object-store options its tables are read with (``None``: none needed)."""
        ...

    def sink(self, table: str, write: Append | Merge | None = None,
             commit_metadata: Mapping[str, str] | None = None,
             maintenance: Maintenance | None = None) -> TableSink:
        """A fenced sink for ``table`` in write mode ``write`` (``None``: append), recording
        ``commit_metadata`` (e.g. the Dagster run id) in every commit, maintained by
        ``maintenance`` (``None``: the warehouse's upkeep).

        Raises:
            ConfigError: ``maintenance`` does not apply to the format.
            UsageError: a ``write`` or table name the sink refuses.
        """
        ...


class DeltaWarehouseResource(ConfigurableResource):
    """Where a deployment's Delta tables live: ``<root>/<table>``, ``root`` a local directory
    or ``s3://bucket/prefix`` (endpoint and credentials as ``EnvVar``: delta-rs storage options,
    masked); partitioned by ``_partition``."""

    table_format: ClassVar[str] = "delta"
    supports_state: ClassVar[bool] = True  # its sinks serve per-key state (last_rows)

    root: str = Field(description="Local directory or s3://bucket/prefix.")
    s3_endpoint: str | None = Field(default=None, description="S3 endpoint URL (e.g. MinIO, moto).")
    aws_access_key_id: str | None = Field(default=None, description="Use EnvVar.")
    aws_secret_access_key: str | None = Field(default=None, description="Use EnvVar.")
    aws_region: str = Field(default="us-east-1")
    allow_http: bool = Field(default=False, description="Allow a plain-http S3 endpoint.")
    compaction: bool = Field(default=True, description="Runs compact their partition's small files "
                             "(a group's ConsumerGroupAsset.maintenance overrides all four).")
    compact_min_files: int = Field(default=16,
                                   description="Small files a partition may have before "
                                   "its run compacts them (>= 2).")
    target_file_size_mb: int = Field(default=128, description="MiB compaction aims for.")
    vacuum_retention_hours: int | None = Field(default=168, description="VACUUM keeps unreferenced "
                                               "files this long (hours; null: never vacuum).")

    def maintenance(self) -> Maintenance:
        """The table maintenance of this warehouse's sinks
        (:class:`~cg_pipelines.sinks.maintenance.Maintenance`)."""
        return Maintenance(compact=self.compaction, compact_min_files=self.compact_min_files,
                           target_size=self.target_file_size_mb * 1024 * 1024,
                           vacuum_retention_hours=self.vacuum_retention_hours)

    def table_uri(self, table: str) -> str:
        """URI of ``table`` under the root (local roots are made absolute)."""
        if self.root.startswith("s3://"):
            return f"{self.root.rstrip('/')}/{table}"
        return os.path.join(os.path.abspath(self.root), table)

    def storage_options(self) -> dict[str, str] | None:
        """delta-rs storage options (``None`` for a local root)."""
        if not self.root.startswith("s3://"):
            return None
        return s3_options(self.s3_endpoint, self.aws_access_key_id,
                          self.aws_secret_access_key, region=self.aws_region,
                          allow_http=self.allow_http)

    def sink(self, table: str, write: Append | Merge | None = None,
             commit_metadata: Mapping[str, str] | None = None,
             maintenance: Maintenance | None = None) -> DeltaSink:
        """A fenced Delta sink for ``table``, partitioned by ``_partition``, in write mode
        ``write`` (default append), adding ``commit_metadata`` (e.g. the Dagster run id) to
        every commit's lineage, maintained after each run by ``maintenance`` (default: this
        resource's :meth:`maintenance`)."""
        return DeltaSink(self.table_uri(table), storage_options=self.storage_options(),
                         partition_by=[PARTITION_COLUMN], write=write,
                         commit_metadata=commit_metadata,
                         maintenance=maintenance or self.maintenance())


_CATALOGS: dict[tuple[tuple[str, str], ...], Catalog] = {}
"""The catalogs loaded in this process, one per distinct configuration."""
_CATALOGS_LOCK = threading.Lock()


class IcebergWarehouseResource(ConfigurableResource):
    """Where a deployment's Iceberg tables live: catalog + warehouse, tables
    ``<namespace>.<table>`` (identity-partitioned by ``_partition``), e.g.
    ``IcebergWarehouseResource(warehouse="/data/lake")`` (SQLite catalog in catalog.db), with
    ``catalog_uri=EnvVar(...)`` a Postgres one, with ``catalog_type="rest"`` a REST catalog.

    Secrets (S3 keys, a REST token): ``EnvVar``; pyiceberg gets them, ``repr`` masks them.
    """

    table_format: ClassVar[str] = "iceberg"
    supports_state: ClassVar[bool] = True  # its sinks serve per-key state (last_rows)

    warehouse: str = Field(description="Data root: a local directory or s3://bucket/prefix.")
    catalog_type: str = Field(default="sql", description="'sql' (SQLite/Postgres) or 'rest'.")
    catalog_uri: str | None = Field(
        None, description="SQLAlchemy URL (sqlite:///..., postgresql+psycopg2://...) or REST "
        "URI; default: SQLite in <warehouse>/catalog.db (local warehouse only).")
    catalog_name: str = Field(default="cg")
    namespace: str = Field(default="cg", description="Namespace of the group tables.")
    rest_token: str | None = Field(default=None,
                                   description="REST catalog bearer token; use EnvVar.")
    s3_endpoint: str | None = Field(default=None, description="S3 endpoint URL (e.g. MinIO, moto).")
    aws_access_key_id: str | None = Field(default=None, description="Use EnvVar.")
    aws_secret_access_key: str | None = Field(default=None, description="Use EnvVar.")
    aws_region: str = Field(default="us-east-1")
    allow_http: bool = Field(default=False, description="Allow a plain-http S3 endpoint.")

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
            from cg_pipelines.sinks.iceberg_read import sqlite_wal

            sqlite_wal(db)
            uri = f"sqlite:///{db}"
        props = {"type": self.catalog_type, "uri": uri, "warehouse": self._root()}
        if self.catalog_type == "sql":
            props["init_catalog_tables"] = "true"
        if self.rest_token:
            props["token"] = self.rest_token
        if self.warehouse.startswith("s3://"):
            from cg_pipelines.sinks.iceberg import iceberg_s3_properties

            props.update(iceberg_s3_properties(s3_options(
                self.s3_endpoint, self.aws_access_key_id, self.aws_secret_access_key,
                region=self.aws_region, allow_http=self.allow_http)))
        return props

    def catalog(self) -> Catalog:
        """The catalog (one per distinct configuration in this process).

        Raises:
            UsageError: as :meth:`catalog_properties`.
            pyiceberg errors: the catalog cannot be loaded.
        """
        from cg_pipelines.sinks.iceberg_read import iceberg_catalog

        props = self.catalog_properties()
        key = tuple(sorted({**props, "name": self.catalog_name}.items()))
        with _CATALOGS_LOCK:
            cat = _CATALOGS.get(key)
            if cat is None:
                cat = _CATALOGS[key] = iceberg_catalog(self.catalog_name, props)
            return cat

    def identifier(self, table: str) -> str:
        """The table's catalog identifier: ``<namespace>.<table>``."""
        return f"{self.namespace}.{table}"

    def table_uri(self, table: str) -> str:
        """``iceberg://<catalog>/<namespace>.<table>`` (the table's location once it exists
        is :attr:`IcebergSink.uri`)."""
        return f"iceberg://{self.catalog_name}/{self.identifier(table)}"

    def storage_options(self) -> dict[str, str] | None:
        """``None``: the catalog's properties carry the storage settings."""
        return None

    def sink(self, table: str, write: Append | Merge | None = None,
             commit_metadata: Mapping[str, str] | None = None,
             maintenance: Maintenance | None = None) -> IcebergSink:
        """A fenced Iceberg sink for ``table`` (identity-partitioned by ``_partition``).

        Raises:
            ConfigError: ``maintenance`` given (Delta's settings; Iceberg's upkeep is snapshot
                expiry, docs/iceberg.md).
        """
        if maintenance is not None:
            raise ConfigError("maintenance", "Delta table upkeep settings (Maintenance) do not "
                              "apply to an Iceberg warehouse: leave ConsumerGroupAsset."
                              "maintenance unset (Iceberg upkeep is snapshot expiry)")
        from cg_pipelines.sinks.iceberg import IcebergSink

        return IcebergSink(self.identifier(table), catalog=self.catalog(), write=write,
                           commit_metadata=commit_metadata)


if TYPE_CHECKING:  # mypy (strict on this module) checks that both sides keep the contracts

    def _delta_keeps_them(w: DeltaWarehouseResource, s: DeltaSink) -> tuple[Warehouse, TableSink]:
        return w, s

    def _iceberg_keeps_them(w: IcebergWarehouseResource, s: IcebergSink
                            ) -> tuple[Warehouse, TableSink]:
        return w, s
