"""Downstream assets read an asset's table as an input (:class:`DeltaTableIOManager`,
:class:`IcebergTableIOManager`; :func:`table_io_manager` picks a warehouse's): loaded only
(the engine committed the rows), typed by the annotation (``pyarrow.Table`` or none,
``pandas``, ``pyspark.sql`` or ``polars`` DataFrame): the history in append mode, current rows
in merge mode, only its partitions' rows for a downstream asset partitioned alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from dagster import ConfigurableIOManager, InputContext, OutputContext

from cg_pipelines.core.errors import UsageError, WrongTypeError
from cg_pipelines.dagster.resources import SparkResource
from cg_pipelines.dagster.warehouse import (
    DeltaWarehouseResource,
    IcebergWarehouseResource,
    Warehouse,
)
from cg_pipelines.sinks.base import PARTITION_COLUMN
from cg_pipelines.sinks.delta import DeltaSink

if TYPE_CHECKING:
    from cg_pipelines.sinks.iceberg import IcebergSink

__all__ = ["DeltaTableIOManager", "IcebergTableIOManager", "partitions_to_load", "spark_frame",
           "table_io_manager", "upstream_table"]


def table_io_manager(warehouse: Warehouse, spark: SparkResource | None = None
                     ) -> ConfigurableIOManager:
    """The IO manager of ``warehouse``'s tables (Iceberg's for an Iceberg warehouse, else
    Delta's); ``spark`` serves the Spark DataFrame inputs.

    Raises:
        pydantic.ValidationError: a warehouse neither IO manager takes.
    """
    if isinstance(warehouse, IcebergWarehouseResource):
        return IcebergTableIOManager(warehouse=warehouse, spark=spark)
    return DeltaTableIOManager(warehouse=warehouse, spark=spark)


def _type_name(t: Any) -> str:
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', '')}"


def arrow_as(arrow: pa.Table, want: Any, manager: str, context: InputContext) -> Any:
    """``arrow`` (a table's loaded rows) as the input annotation ``want`` asks: polars or
    pandas DataFrame, or the Arrow table itself (also for ``Any``/``object``/no annotation).

    Raises:
        WrongTypeError: another annotation (the message names ``manager`` and the asset).
    """
    name = _type_name(want)
    if name.startswith("polars"):
        import polars as pl

        return pl.from_arrow(arrow)
    if name.startswith("pandas") and name.endswith("DataFrame"):
        return arrow.to_pandas()
    if want in (Any, pa.Table, object) or name in (".", "builtins.object", "typing.Any"):
        return arrow
    raise WrongTypeError(f"{manager} loads pyarrow.Table, pandas/pyspark/polars DataFrame; "
                         f"{context.asset_key.to_user_string()} is annotated {want!r}")


class _TableIOManager(ConfigurableIOManager):
    """What both IO managers share: nothing stored, the table loaded as annotated."""

    spark: SparkResource | None = None

    def handle_output(self, context: OutputContext, obj: Any) -> None:
        """Nothing to store: the asset committed its rows in the engine.

        Raises:
            WrongTypeError: the asset returned a value.
        """
        if obj is not None:
            raise WrongTypeError(f"{context.asset_key.to_user_string()}: {type(self).__name__} "
                                 "only loads consumer-group tables; it does not store values")

    def load_input(self, context: InputContext) -> Any:
        """The upstream asset's table (or its loaded partitions), typed as asked.

        Raises:
            UsageError: the upstream asset is not a consumer-group asset (no ``cg/table``
                definition metadata), or a Spark DataFrame is asked for without ``spark``.
            WrongTypeError: an annotation this IO manager cannot produce.
        """
        table, md = upstream_table(context)
        sink = self.warehouse.sink(table)  # type: ignore[attr-defined]
        parts = partitions_to_load(context, md)
        want = context.dagster_type.typing_type
        name = _type_name(want)
        if name.startswith("pyspark.sql") and name.endswith("DataFrame"):
            if self.spark is None:
                raise UsageError(f"a Spark DataFrame input needs {type(self).__name__}"
                                 "(spark=...)")
            return self._spark_frame(self.spark.spark_session, sink, parts)
        if name.startswith("polars") and isinstance(sink, DeltaSink):
            import polars as pl

            frame = pl.read_delta(sink.uri, storage_options=self.warehouse  # type: ignore[attr-defined]
                                  .storage_options())
            return frame if parts is None else frame.filter(pl.col(PARTITION_COLUMN).is_in(parts))
        return arrow_as(sink.read_partitions(parts), want, type(self).__name__, context)

    def _spark_frame(self, spark: Any, sink: Any, parts: list[int] | None) -> Any:
        raise NotImplementedError


class DeltaTableIOManager(_TableIOManager):
    """Loads an asset's Delta table for downstream assets (see the module docstring), e.g.
    ``DeltaTableIOManager(warehouse=warehouse, spark=spark)``; ``spark`` only for Spark
    DataFrame inputs."""

    warehouse: DeltaWarehouseResource

    def _spark_frame(self, spark: Any, sink: DeltaSink, parts: list[int] | None) -> Any:
        files = sink.file_uris()
        if not files:
            return spark.createDataFrame(sink.read())
        df = spark.read.option("basePath", sink.uri).parquet(*files)
        return df if parts is None else df.where(df[PARTITION_COLUMN].isin(parts))


class IcebergTableIOManager(_TableIOManager):
    """Loads an asset's Iceberg table for downstream assets (see the module docstring;
    Spark DataFrames: :func:`spark_frame`)."""

    warehouse: IcebergWarehouseResource

    def _spark_frame(self, spark: Any, sink: IcebergSink, parts: list[int] | None) -> Any:
        return spark_frame(spark, sink, parts)


def upstream_table(context: InputContext) -> tuple[str, Any]:
    """The upstream group asset's table name (its ``cg/table`` definition metadata) and that
    metadata.

    Raises:
        UsageError: the upstream asset is not a consumer-group asset (no ``cg/table``).
    """
    upstream = context.upstream_output
    md = upstream.definition_metadata if upstream is not None else {}
    table = md.get("cg/table")
    if table is None:
        raise UsageError(f"{context.asset_key.to_user_string()} is not a consumer-group "
                         "asset (no cg/table metadata)")
    return str(getattr(table, "value", table)), md


def partitions_to_load(context: InputContext, md: Any) -> list[int] | None:
    """The group partitions a downstream input loads: the group partitions of the input's
    partition keys (``<cg/partition_key_prefix><p>``, from the group asset's definition
    metadata ``md``), or None for all (the downstream asset is not partitioned alike)."""
    if not context.has_asset_partitions:
        return None
    prefix = md.get("cg/partition_key_prefix")
    prefix = str(getattr(prefix, "value", prefix) or "")
    out = []
    for key in context.asset_partition_keys:
        tail = key[len(prefix):] if key.startswith(prefix) else key
        if not tail.isdigit():
            return None
        out.append(int(tail))
    return out


def spark_frame(spark: Any, sink: IcebergSink, parts: Sequence[int] | None = None) -> Any:
    """The table (or ``parts``' rows) as a Spark DataFrame: local tables are read on the
    executors from the current snapshot's Parquet files (pyiceberg writes copy-on-write only,
    so those files are the table); tables on object storage (Spark needs hadoop-aws and
    ``s3a://`` settings for them) are read by pyiceberg on the driver and handed over."""
    files = sink.partition_data_files(parts)
    if not files or not all(f.startswith(("file:", "/")) for f in files):
        return spark.createDataFrame(sink.read_partitions(parts))  # pyspark 4 takes Arrow
    df = spark.read.parquet(*files)
    return df if parts is None else df.where(df[PARTITION_COLUMN].isin(parts))
