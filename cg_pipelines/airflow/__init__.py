"""Airflow 3 as the orchestrator (extra ``airflow``): one Dag run per consumer-group partition
with backlog, the partition as the run's ``partition_key``, started by a NATS backlog trigger
in the triggerer; the same engine, table and guarantees as the Dagster integration.

A Dag file::

    from cg_pipelines.airflow import ConsumerGroupDag, build_dags
    globals().update(build_dags([ConsumerGroupDag("legs", "flights", "legs", 8,
                                                  legs_processor(), "/data/legs")]))

A co-partitioned set (a join) is one Dag the same way: ``CoPartitionedDag(name,
[JoinInput("orders", "orders", "by_customer"), JoinInput("payments", "payments",
"by_customer_pay")], 8, join_processor, "/data/joined")``; a run of partition ``p`` drains
partition ``p`` of every input and commits once.

Move a group between Dagster and Airflow by stopping one before starting the other; if both
run by mistake, the engine's lease and fence make the second driver harmless (it gets ``held``
runs or fenced commits, never double effects).
"""

from cg_pipelines.airflow.dags import build_dags, dispatch_dag_id
from cg_pipelines.airflow.retry import CoreRetryPolicy
from cg_pipelines.airflow.spec import ConsumerGroupDag, CoPartitionedDag, JoinInput, StreamDag
from cg_pipelines.airflow.tasks import drain_task_id, run_metadata
from cg_pipelines.airflow.trigger import NatsBacklogTrigger

__all__ = ["CoPartitionedDag", "ConsumerGroupDag", "CoreRetryPolicy", "JoinInput",
           "NatsBacklogTrigger", "StreamDag", "build_dags", "dispatch_dag_id", "drain_task_id",
           "run_metadata"]
