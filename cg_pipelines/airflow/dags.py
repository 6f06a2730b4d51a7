"""Dags from specs (:func:`build_dags`). Per :class:`~cg_pipelines.airflow.spec.StreamDag`
``<name>`` (one consumer group or a co-partitioned set: the same Dags), three assets and two
Dags::

    Asset <name>__nats     watched by NatsBacklogTrigger (the triggerer)
      -> Dag <name>__dispatch (schedule: that asset; one run at a time)
           dispatch: one partitioned event on <name>__backlog per partition with backlog
    Asset <name>__backlog  partitioned events, keys "<prefix><p>"
      -> Dag <name> (PartitionedAssetTimetable: one run per key)
           route (branch on the run's partition_key) -> drain_p0 .. drain_p<N-1>
           drain_p<k>: partition k of every input in one run; max_active_tis_per_dag=1 (at
                       most one run of partition k at a time), retries and backoff
                       from core's RetryPolicy, outlet <name>
    Asset <name>           one event per committed run, with the run's key and figures

A user's Dag file: ``globals().update(build_dags([ConsumerGroupDag(...),
CoPartitionedDag(...)]))``."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from airflow.sdk import DAG, Asset, AssetWatcher, PartitionedAssetTimetable, task

from cg_pipelines.airflow.retry import CoreRetryPolicy
from cg_pipelines.airflow.spec import StreamDag
from cg_pipelines.airflow.tasks import dispatch, drain, drain_task_id, route
from cg_pipelines.airflow.trigger import NatsBacklogTrigger
from cg_pipelines.core.errors import ConfigError

__all__ = ["build_dags", "dispatch_dag_id"]


def dispatch_dag_id(spec: StreamDag) -> str:
    """``<name>__dispatch``."""
    return f"{spec.name}__dispatch"


def build_dags(specs: Iterable[StreamDag]) -> dict[str, DAG]:
    """``{dag_id: DAG}``: the dispatch and worker Dags of each spec (see the module docstring).

    Raises:
        ConfigError: two specs share a name, or a group is driven twice (by two specs, as a
            group or in a set).
    """
    out: dict[str, DAG] = {}
    groups: dict[tuple[str, str], str] = {}
    for spec in specs:
        if spec.name in out:
            raise ConfigError("name", f"two specs are named {spec.name!r}")
        for inp in spec.inputs:
            other = groups.setdefault((inp.stream, inp.group), spec.name)
            if other != spec.name:
                raise ConfigError("inputs", f"group {inp.stream}.{inp.group} is in specs "
                                  f"{other!r} and {spec.name!r}: one Dag drives a group")
        out.update(_dags(spec))
    return out


def _dags(spec: StreamDag) -> dict[str, DAG]:
    trigger = NatsBacklogTrigger(
        spec.name, [[i.name, i.stream, i.group] for i in spec.inputs], spec.partitions,
        spec.connect_kwargs(), conn_id=spec.nats_conn_id,
        members=list(spec.members) if spec.members is not None else None,
        min_pending=spec.min_pending, recheck_s=spec.recheck_s, repeat_s=spec.repeat_s)
    nats_asset = Asset(name=f"{spec.name}__nats", uri="nats://" + ",".join(
                           f"{i.stream}/{i.group}" for i in spec.inputs),
                       watchers=[AssetWatcher(name=f"{spec.name}__backlog", trigger=trigger)])
    backlog = Asset(name=f"{spec.name}__backlog", uri=f"cg://{spec.name}/backlog")
    table = Asset(name=spec.name, uri=f"cg://{spec.name}/table")

    with DAG(dag_id=dispatch_dag_id(spec), schedule=[nats_asset], max_active_runs=1,
             catchup=False, tags=list(spec.tags),
             doc_md=f"Starts one run of `{spec.name}` per partition of {spec.title} with "
                    "backlog (cg_pipelines).") as dispatcher:
        def dispatch_body(**context: Any) -> list[str]:
            return dispatch(spec, backlog, table, context)
        task(task_id="dispatch", inlets=[table], outlets=[backlog])(dispatch_body)()

    policy = spec.retry
    with DAG(dag_id=spec.name, schedule=PartitionedAssetTimetable(assets=backlog),
             max_active_runs=max(2, 2 * spec.partitions), catchup=False,
             tags=list(spec.tags),
             doc_md=f"One run per partition of {spec.title} (cg_pipelines); trigger one by "
                    "hand with a partition_key, conf {\"mode\": \"rebuild\"} to rebuild it."
             ) as worker:
        def route_body(**context: Any) -> str:
            return route(spec, context)
        branch = task.branch(task_id="route")(route_body)()
        for k in range(spec.partitions):
            branch >> task(
                task_id=drain_task_id(k), outlets=[table], max_active_tis_per_dag=1,
                retries=policy.max_failures - 1,
                retry_delay=timedelta(seconds=policy.backoff_s),
                retry_exponential_backoff=2.0,
                max_retry_delay=timedelta(seconds=policy.max_backoff_s),
                retry_policy=CoreRetryPolicy(policy),
                execution_timeout=timedelta(seconds=spec.run_timeout_s),
            )(_drain_body(spec, k, table))()
    return {dispatcher.dag_id: dispatcher, worker.dag_id: worker}


def _drain_body(spec: StreamDag, k: int, table: Asset) -> Any:
    def drain_body(**context: Any) -> dict[str, Any]:
        return drain(spec, k, table, context)
    drain_body.__name__ = drain_task_id(k)
    return drain_body
