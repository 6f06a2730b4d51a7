"""What a user declares for Airflow: ONE spec, :class:`StreamDag`, whose inputs are one
consumer group or a co-partitioned set (constructor forms :class:`ConsumerGroupDag` and
:class:`CoPartitionedDag`; nothing downstream asks which made it), checked when it is made: the
inputs, their partitions, the processor, the table and how runs are retried.
:func:`~cg_pipelines.airflow.dags.build_dags` turns it into Dags. The names, the code version
and the run are the Dagster integration's (:mod:`cg_pipelines.engine.inputs`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.partitioning import partition_key, partition_keys, partition_of
from cg_pipelines.core.triggers import REPEAT_REQUEST_S, RetryPolicy
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.engine.inputs import (
    check_spec_inputs,
    inputs_code_version,
    inputs_label,
    inputs_title,
)
from cg_pipelines.engine.join import JoinInput
from cg_pipelines.engine.join_processor import JoinProcessor
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.processor import Processor, with_defaults
from cg_pipelines.jetstream.connect import ConnectOptions

__all__ = ["CoPartitionedDag", "ConsumerGroupDag", "JoinInput", "StreamDag"]

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
"""An Airflow Dag id (letters, digits, ``_``, ``.``, ``-``); also the table asset's name."""


@dataclass(frozen=True)
class StreamDag:
    """One elastic consumer group or a co-partitioned set of them, processed by Airflow: one
    Dag run per partition with backlog, the partition as the run's ``partition_key``; a run
    of partition ``p`` drains partition ``p`` of every input and commits once.

    Args:
        name: the worker Dag's id and the table asset's name (letters, digits, ``_.-``).
        inputs: ``JoinInput(name, stream, group)`` s (each group created beforehand, e.g. with
            ``cg elastic create``). One: a group. Several: a co-partitioned set (checked
            against the groups' configs in NATS by the trigger and each run,
            :func:`~cg_pipelines.core.copartition.check_copartitioned`), whose processor is a
            ``JoinProcessor`` over these names.
        partitions: the groups' partitions (their ``max_members``), ``>= 1``.
        processor: the processing step (an :class:`~cg_pipelines.engine.processor.Processor`,
            e.g. an ``ArrowProcessor``, for one input; a
            :class:`~cg_pipelines.engine.join_processor.JoinProcessor` for a set), the same
            object a Dagster deployment uses.
        table_uri: the Delta table's root (a local directory or ``s3://bucket/path``).
        write: :class:`~cg_pipelines.core.write.Append` (default) or
            :class:`~cg_pipelines.core.write.Merge`.
        storage_options: delta-rs object store options of ``table_uri`` (S3 keys ...).
        nats: how to reach NATS. Only ``servers`` without credentials and file paths
            (``creds``, ``nkey_seed``, ``tls_*``) are allowed: the backlog trigger's arguments
            are stored in Airflow's database, and a password or token there would be a secret
            at rest: put them in an Airflow Connection (``nats_conn_id``).
        nats_conn_id: an Airflow Connection holding NATS credentials (and optionally the
            servers), read where a connection is made, never stored with the Dag or the
            trigger (:mod:`cg_pipelines.airflow.connection` says which fields are read).
        spark_master, spark_remote, spark_config: the Spark session a Spark processor
            (``uses_spark``, e.g. a ``SparkProcessor``) runs on in the drain task, as
            :func:`~cg_pipelines.spark.session.get_spark` takes them: a master
            (``"local[2]"`` default, ``"spark://host:7077"``), or a Spark Connect URL
            (``"sc://host:15002"``, then no JVM runs in the worker), and extra Spark settings.
            Other processors start no session. Needs the ``spark`` extra (``spark-connect``
            for a remote).
        members: the members whose partitions this deployment runs (``None``: every member).
        retry: core's retry rule (:class:`~cg_pipelines.core.triggers.RetryPolicy`): a run is
            tried ``max_failures`` times, the ``k``-th retry after
            ``min(backoff_s * 2**(k-1), max_backoff_s)`` seconds (Airflow's own retry delay,
            which adds a deterministic jitter of up to the same again), then the run fails.
        engine: the engine's options (batch sizes, ack wait, ...).
        recheck_s: seconds between two backlog reads of the trigger (> 0).
        repeat_s: seconds before the trigger announces an unchanged backlog again (its run
            may have been lost or failed; > 0).
        min_pending: a partition runs once it has this many pending messages (>= 1).
        run_timeout_s: a drain task's Airflow ``execution_timeout``, seconds (> 0).
        partition_key_prefix: run keys are ``<prefix><p>``; default the input groups
            (distinct, joined by ``+``) and ``-``: the Dagster keys of the same group or set.
        tags: the Dags' tags.
        code: the code version (default: a digest of the processor, the inputs and the
            partitions); a partition given up on runs again once it changes.

    Raises:
        ConfigError: a field out of range, a bad name, no input, duplicate input names or
            groups, several inputs without a ``JoinProcessor`` over their names, or a secret
            in ``nats``.
    """

    name: str
    inputs: Sequence[JoinInput]
    partitions: int
    processor: Processor | JoinProcessor
    table_uri: str
    _: KW_ONLY
    write: Append | Merge = field(default_factory=Append)
    storage_options: dict[str, str] | None = None
    nats: ConnectOptions = field(default_factory=ConnectOptions)
    nats_conn_id: str | None = None
    spark_master: str = "local[2]"
    spark_remote: str | None = None
    spark_config: dict[str, str] | None = None
    members: tuple[str, ...] | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    engine: EngineOptions = field(default_factory=EngineOptions)
    recheck_s: float = 30.0
    repeat_s: float = REPEAT_REQUEST_S
    min_pending: int = 1
    run_timeout_s: float = 3600.0
    partition_key_prefix: str | None = None
    tags: tuple[str, ...] = ("cg_pipelines",)
    code: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not _NAME.match(self.name) or len(self.name) > 200:
            raise ConfigError("name", f"{self.name!r} is not a Dag id (letters, digits, _.-; "
                                      "at most 200 characters)")
        check_spec_inputs(self.inputs, self.processor)
        if self.partitions < 1:
            raise ConfigError("partitions", f"must be >= 1, got {self.partitions}")
        if not self.table_uri:
            raise ConfigError("table_uri", "must not be empty")
        for what, num in (("recheck_s", self.recheck_s), ("repeat_s", self.repeat_s),
                          ("run_timeout_s", self.run_timeout_s)):
            if not num > 0:
                raise ConfigError(what, f"must be > 0 seconds, got {num!r}")
        if self.min_pending < 1:
            raise ConfigError("min_pending", f"must be >= 1, got {self.min_pending}")
        if self.nats.user or self.nats.password or self.nats.token or "@" in self.nats.servers:
            raise ConfigError("nats", "user, password, token and URL credentials would be "
                              "stored in Airflow's database with the trigger's arguments: put "
                              "them in an Airflow Connection (nats_conn_id=), or use a creds "
                              "file (creds=) or an NKey seed file (nkey_seed=)")
        if self.nats_conn_id is not None and not self.nats_conn_id.strip():
            raise ConfigError("nats_conn_id", "must not be empty (None: no connection)")
        if not self.spark_master:
            raise ConfigError("spark_master", "must not be empty")
        if self.spark_remote is not None and not self.spark_remote.startswith("sc://"):
            raise ConfigError("spark_remote", f"{self.spark_remote!r} is not a Spark Connect "
                                              "URL (sc://host:port)")
        bad = [k for k, v in (self.spark_config or {}).items()
               if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ConfigError("spark_config", f"keys and values must be strings: {bad}")
        if self.members is not None and not self.members:
            raise ConfigError("members", "an empty tuple serves nothing (None: every member)")

    @property
    def label(self) -> str:
        """The input groups, distinct, joined by ``+`` (run keys start with it)."""
        return inputs_label(self.inputs)

    @property
    def prefix(self) -> str:
        """The partition key prefix in effect (``"<label>-"`` unless given)."""
        return f"{self.label}-" if self.partition_key_prefix is None \
            else self.partition_key_prefix

    @property
    def uses_spark(self) -> bool:
        """Whether the processor runs on Spark (the drain task then starts a session)."""
        p = self.processor
        return p.uses_spark if isinstance(p, JoinProcessor) else with_defaults(p).uses_spark

    def partition_key(self, partition: int) -> str:
        """The Airflow ``partition_key`` of partition ``partition`` (``<prefix><p>``)."""
        return partition_key(self.prefix, partition)

    def partition_keys(self) -> list[str]:
        """All partition keys, in partition order."""
        return partition_keys(self.prefix, self.partitions)

    def partition_of(self, key: str) -> int:
        """The partition of ``partition_key`` ``key``.

        Raises:
            ConfigError: not one of this Dag's keys.
        """
        return partition_of(self.prefix, key, self.partitions, self.name)

    def code_version(self) -> str:
        """``code`` when declared, else a digest of the processor (code and settings), the
        inputs and the partition count
        (:func:`~cg_pipelines.engine.inputs.inputs_code_version`, the Dagster layer's):
        failures under older code do not count."""
        if self.code is not None:
            return self.code
        return inputs_code_version(self.processor, self.inputs, self.partitions)

    @property
    def title(self) -> str:
        """``consumer group <stream>.<group>`` or ``co-partitioned set <name> (<stream>.<group>,
        ...)`` (what messages call the inputs)."""
        return inputs_title(self.inputs, self.name)

    @property
    def groups(self) -> str:
        """The inputs as ``<stream>.<group>, ...`` (what a failure names)."""
        return ", ".join(f"{i.stream}.{i.group}" for i in self.inputs)

    def connect_options(self) -> ConnectOptions:
        """``nats`` completed by the ``nats_conn_id`` connection (in a task; see
        :func:`~cg_pipelines.airflow.connection.connect_options` for errors)."""
        from cg_pipelines.airflow.connection import connect_options

        return connect_options(self.nats, self.nats_conn_id)

    def connect_kwargs(self) -> dict[str, Any]:
        """The non-secret :class:`~cg_pipelines.jetstream.connect.ConnectOptions` fields, as
        JSON values (the trigger's arguments)."""
        o = self.nats
        return {"servers": o.servers, "creds": o.creds, "tls_ca": o.tls_ca,
                "tls_cert": o.tls_cert, "tls_key": o.tls_key, "nkey_seed": o.nkey_seed,
                "connect_timeout": o.connect_timeout, "name": o.name}


@dataclass(frozen=True, init=False)
class ConsumerGroupDag(StreamDag):
    """The one-input form of :class:`StreamDag`: ``ConsumerGroupDag(name, stream, group,
    partitions, processor, table_uri, **options)``, its one input named after the group;
    ``options`` are :class:`StreamDag`'s keyword fields."""

    stream: str = ""
    group: str = ""
    inputs: Sequence[JoinInput] = field(init=False, default=())

    def __init__(self, name: str, stream: str, group: str, partitions: int,
                 processor: Processor, table_uri: str, **options: Any) -> None:
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "group", group)
        StreamDag.__init__(self, name, (), partitions, processor, table_uri, **options)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", (JoinInput(self.group, self.stream, self.group),))
        super().__post_init__()


@dataclass(frozen=True)
class CoPartitionedDag(StreamDag):
    """The set form of :class:`StreamDag`: ``CoPartitionedDag(name, inputs, partitions,
    processor, table_uri, **options)`` with two or more ``inputs`` and a ``JoinProcessor``
    over their names (the Joins guide); one Dag run of partition ``p`` drains partition
    ``p`` of every input and commits once.

    Raises:
        ConfigError: fewer than two inputs, and what :class:`StreamDag` refuses.
    """

    def __post_init__(self) -> None:
        if len(tuple(self.inputs)) < 2:
            raise ConfigError("inputs", "a co-partitioned set needs two or more inputs, got "
                              f"{[i.name for i in self.inputs]}")
        super().__post_init__()
