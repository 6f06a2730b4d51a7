"""The parts of an Airflow task's context that ``cg_pipelines.airflow.tasks`` reads, for
calling a task function as Airflow's worker calls it, without the Airflow services (those are
tested in ``tests/airflow/test_airflow_runs.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class StateStore:
    """An asset state store (``context["asset_state_store"][asset]``): ``get``/``set``."""

    def __init__(self) -> None:
        self.rows: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        return self.rows.get(key)

    def set(self, key: str, value: Any) -> None:
        self.rows[key] = value


class Outlet:
    """An outlet event accessor (``context["outlet_events"][asset]``): partition keys, extra."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.extra: dict[str, Any] = {}

    def add_partitions(self, keys: list[str]) -> None:
        self.keys += keys


def run_context(key: str, stores: dict[Any, StateStore], outlets: dict[Any, Outlet]
                ) -> dict[str, Any]:
    """A worker Dag run's task context: run ``key`` (its ``partition_key``), try 1, no conf;
    ``stores``/``outlets``: each asset's state store and outlet event."""
    return {"dag_run": SimpleNamespace(partition_key=key, run_id=f"manual__{key}", conf={}),
            "ti": SimpleNamespace(try_number=1), "asset_state_store": stores,
            "outlet_events": outlets}
