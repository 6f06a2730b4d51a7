"""The origin reconcile reads the coverage each commit records in the Delta log: an Iceberg
group asset gets no ``origin_reconciled`` check (it could only fail) and a sensor reconcile
asked for on one is refused at definition time; a Delta group asset keeps the check."""

from __future__ import annotations

from pathlib import Path

import pytest

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.dagster import (
    ConsumerGroupAsset,
    DeltaWarehouseResource,
    NatsResource,
    Warehouse,
    build_definitions,
)
from cg_pipelines.dagster.checks import RECONCILE_CHECK
from cg_pipelines.dagster.iceberg import IcebergWarehouseResource
from tests.support import keyed


def _spec(**kw: object) -> ConsumerGroupAsset:
    return ConsumerGroupAsset(name="g", stream="S", group="g", partitions=2,
                              processor=keyed.processor(), **kw)  # type: ignore[arg-type]


def _check_names(warehouse: Warehouse) -> set[str]:
    defs = build_definitions([_spec()], resources={"nats": NatsResource(),
                                                   "warehouse": warehouse})
    return {k.name for c in defs.asset_checks or [] for k in c.check_keys}


def test_the_reconcile_check_only_on_delta_tables(tmp_path: Path) -> None:
    delta = _check_names(DeltaWarehouseResource(root=str(tmp_path / "d")))
    iceberg = _check_names(IcebergWarehouseResource(warehouse=str(tmp_path / "i")))
    assert RECONCILE_CHECK in delta
    assert RECONCILE_CHECK not in iceberg
    assert delta - {RECONCILE_CHECK} == iceberg  # every other check on both


def test_a_sensor_reconcile_on_an_iceberg_warehouse_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Delta log") as e:
        build_definitions([_spec(reconcile_interval_s=60.0)], resources={
            "nats": NatsResource(),
            "warehouse": IcebergWarehouseResource(warehouse=str(tmp_path / "i"))})
    assert e.value.field == "reconcile_interval_s"
