"""Dagster resources of a deployment: :class:`NatsResource`, :class:`SparkResource` (or a
``dagster_pyspark.PySparkResource``: :func:`run_spark_session`), :class:`PartitionRunsResource`
and :class:`DeltaWarehouseResource` (from :mod:`~cg_pipelines.dagster.warehouse`). Secrets come
as ``EnvVar`` and are never logged, shown in ``repr`` or put in metadata."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import nats.errors
from dagster import ConfigurableResource, EnvVar, InitResourceContext
from nats.aio.client import Client
from pydantic import Field, PrivateAttr

from cg_pipelines.core.errors import StateError, WrongTypeError
from cg_pipelines.core.liveness import LOST_RUN_GRACE_S
from cg_pipelines.core.triggers import RetryPolicy
from cg_pipelines.dagster.warehouse import DeltaWarehouseResource
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.jetstream.connect import (
    ConnectOptions,
    NatsConnectError,
    close_quietly,
    redact_url,
)
from cg_pipelines.jetstream.liveness import RunHeartbeat

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "DeltaWarehouseResource",
    "NatsResource",
    "PartitionRunsResource",
    "SparkResource",
    "run_spark_session",
    "stopping_foreign_spark",
]

T = TypeVar("T")


class NatsResource(ConfigurableResource):
    """How this deployment reaches NATS.

    Example: ``NatsResource(servers=EnvVar("NATS_URL"), user="app",
    password=EnvVar("NATS_PASSWORD"))``. Give secrets only as ``EnvVar``: a plain string would
    be stored in the code location's snapshot.
    """

    servers: str = Field(default="nats://127.0.0.1:4222",
                         description="NATS URL(s), comma separated.")
    user: str | None = Field(default=None, description="User name for user/password auth.")
    password: str | None = Field(default=None, description="Password (use EnvVar).", repr=False)
    token: str | None = Field(default=None, description="Auth token (use EnvVar).", repr=False)
    nkey_seed_file: str | None = Field(default=None, description="Path of an NKey seed file.")
    creds_file: str | None = Field(default=None, description="Path of a .creds (JWT + NKey) file.")
    tls_ca: str | None = Field(default=None,
                               description="CA file to verify the server's certificate.")
    tls_cert: str | None = Field(default=None, description="Client certificate file (optional).")
    tls_key: str | None = Field(default=None, description="Client key file (optional).")
    connect_timeout_s: float = Field(default=5.0, description="Seconds to connect.")
    call_timeout_s: float = Field(default=10.0, description="Seconds allowed for one bounded call "
                                  "(sensor ticks make a few; keep well under 60).")

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """pydantic's repr fields, with credentials in ``servers`` URLs replaced by ``***``
        (``password`` and ``token`` are left out of the repr altogether)."""
        for name, value in super().__repr_args__():
            if name == "servers" and isinstance(value, str) and not isinstance(value, EnvVar):
                value = ",".join(redact_url(u.strip()) for u in value.split(","))
            yield name, value

    def connect_options(self) -> ConnectOptions:
        """The library's connection options (secrets stay out of ``repr``)."""
        return ConnectOptions(
            servers=self.servers, user=self.user, password=self.password, token=self.token,
            creds=self.creds_file, tls_ca=self.tls_ca, tls_cert=self.tls_cert,
            tls_key=self.tls_key, connect_timeout=self.connect_timeout_s,
            name="cg_pipelines-dagster", nkey_seed=self.nkey_seed_file,
        )

    def run(self, fn: Callable[[Client], Awaitable[T]], *, timeout_s: float | None = None) -> T:
        """Connect, run ``fn(nc)``, close — all within ``timeout_s`` (default
        ``call_timeout_s``) seconds. Raises ``TimeoutError`` past it, and connection errors
        unchanged: ``NatsAuthError`` (credentials rejected), ``NatsTLSError``,
        ``NatsConnectError`` (also for no server reachable: ``cannot connect to <servers>:
        ...``, the line ``cg`` prints)."""

        async def main() -> T:
            opts = self.connect_options()
            try:
                nc = await opts.connect()
            except (nats.errors.NoServersError, OSError) as e:
                if isinstance(e, NatsConnectError):
                    raise
                raise opts.unreachable_error(e) from e
            try:
                return await fn(nc)
            finally:
                await close_quietly(nc)

        async def bounded() -> T:
            return await asyncio.wait_for(main(), timeout_s or self.call_timeout_s)

        return asyncio.run(bounded())

    def heartbeat(self, run_id: str, ttl_s: float, first_beat_s: float = 30.0
                  ) -> RunHeartbeat:
        """A context manager keeping run ``run_id``'s heartbeat alive in NATS (a beat lives
        ``ttl_s`` seconds, one every ``ttl_s / 3``) on a connection of its own, the first beat
        tried for up to ``first_beat_s`` seconds:
        :class:`~cg_pipelines.jetstream.liveness.RunHeartbeat` (its ``started`` says whether
        it was stored)."""
        return RunHeartbeat(self.connect_options().connect, run_id, ttl_s,
                            timeout_s=self.call_timeout_s, first_beat_s=first_beat_s)


class SparkResource(ConfigurableResource):
    """The SparkSession of a partition run, made from these settings when a run first needs it,
    e.g. ``SparkResource(master="spark://spark-master:7077", spark_config={...})`` or
    ``SparkResource(remote="sc://host:15002")`` (Spark Connect; needs ``pyspark[connect]``).

    ``master`` and ``spark_config`` win over a classic session already running with other
    settings (replaced, with a warning). Teardown stops only a session it made, when
    ``stop_on_teardown``. ``session_reuse_s``: see its field. Needs the ``spark`` extra (Java
    17+ for a local or standalone master).
    """

    master: str = Field(default="local[*]", description="Spark master URL: local[*], local[N], "
                        "spark://host:port, yarn, k8s://... (ignored when remote is set).")
    remote: str | None = Field(default=None, description="Spark Connect URL, e.g. sc://host:15002.")
    app_name: str = Field(default="cg_pipelines", description="Spark application name.")
    spark_config: dict[str, str] = Field(default_factory=dict,
                                         description="Extra Spark settings (win over defaults).")
    stop_on_teardown: bool = Field(default=True, description="Stop the session this resource made "
                                   "when the run ends (also when it failed).")
    class_archive: str | None = Field(
        default=None,
        description="Path of a JVM class-data-sharing archive (`cg spark-archive` builds "
        "one): a local Spark JVM started by a run maps Spark's classes from it and starts "
        "faster; a missing file is ignored; unused with remote.")

    session_reuse_s: float = Field(
        default=0.0, ge=0.0,
        description="Spark Connect only: seconds of the window in which the runs of "
        "one job, asset selection and partition key share a server-side session (its compiled "
        "code stays warm); below the server's idle timeout (60 min by default). 0: a fresh "
        "session per run, released at its end.")

    _session: Any = PrivateAttr(default=None)
    _shared_id: str | None = PrivateAttr(default=None)

    @property
    def spark_session(self) -> SparkSession:
        """The session, started on first access (see class docstring).

        Raises:
            cg_pipelines.spark.session.JavaNotFoundError: no Java 17+ for a classic session.
            ImportError: pyspark (or, for ``remote``, its Connect client packages) missing.
        """
        if self._session is None:
            from cg_pipelines.spark.session import get_spark

            conf = {k: str(v) for k, v in self.spark_config.items()}
            t0 = time.monotonic()
            self._shared_id = self._run_session_id()
            self._session = get_spark(self.master, app_name=self.app_name, conf=conf,
                                      remote=self.remote, class_archive=self.class_archive,
                                      session_id=self._shared_id)
            self._log_session(time.monotonic() - t0)
        session: SparkSession = self._session
        return session

    def _run_session_id(self) -> str | None:
        """The shared server-side session id of this run (``session_reuse_s``), or None for a
        fresh session (no ``remote``, reuse off, no run or no partition key)."""
        if not self.remote or self.session_reuse_s <= 0:
            return None
        try:
            run = self.get_resource_context().dagster_run
        except Exception:  # used outside a run (no resource context)
            return None
        if run is None or (partition := run.tags.get("dagster/partition")) is None:
            return None
        from cg_pipelines.core.sessionid import shared_session_id

        assets = sorted(k.to_user_string() for k in (run.asset_selection or ()))
        key = json.dumps([self.remote, self.app_name, run.job_name, assets, partition])
        return shared_session_id(key, self.session_reuse_s, time.time())

    def _log_session(self, seconds: float) -> None:
        """One run log line: which session, and the seconds it took here (a reused classic
        session takes ~0; a new JVM several seconds; a Spark Connect session well under 1)."""
        try:
            log = self.get_resource_context().log
        except Exception:  # used outside a run (no resource context)
            return
        if log is not None:
            kind = f"Spark Connect {self.remote}" if self.remote else f"master {self.master}"
            if self._shared_id is not None:
                kind += (f", server session {self._shared_id} shared by this job's runs of "
                         f"the partition for up to {self.session_reuse_s:g} s")
            log.info(f"Spark session ({kind}) ready in {seconds:.2f} s")

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        session, self._session = self._session, None
        shared, self._shared_id = self._shared_id, None
        if session is not None and self.stop_on_teardown:
            from cg_pipelines.spark.session import stop_session

            stop_session(session, release=shared is None)


def _flat_conf(conf: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"spark": {"sql": {"x": 1}}}`` -> ``{"spark.sql.x": "1"}`` (dagster-pyspark accepts
    nested and dotted ``spark_config``)."""
    out: dict[str, str] = {}
    for k, v in conf.items():
        if isinstance(v, Mapping):
            out.update(_flat_conf(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def run_spark_session(resource: Any) -> SparkSession:
    """The SparkSession a run processes on, from the asset's Spark resource: a
    :class:`SparkResource`'s, or the ``spark_session`` of any other resource that has one
    (``dagster_pyspark.PySparkResource``, its lazy form), classic or Spark Connect, with
    :data:`cg_pipelines.spark.session.DEFAULT_CONF`'s runtime SQL settings applied where its
    ``spark_config`` does not set them (such a session is stopped by
    :func:`stopping_foreign_spark`; its Python workers need ``PYSPARK_PYTHON``).

    Raises:
        WrongTypeError: ``resource`` has no ``spark_session``.
        StateError: its session is missing or already stopped.
    """
    if isinstance(resource, SparkResource):
        return resource.spark_session
    if not hasattr(resource, "spark_session"):
        raise WrongTypeError(f"{type(resource).__name__} is not a Spark resource (no "
                             "spark_session): use cg_pipelines.dagster.SparkResource or "
                             "dagster_pyspark.PySparkResource")
    session: SparkSession | None = resource.spark_session
    if session is None:
        raise StateError(f"{type(resource).__name__} has no SparkSession (was it set up "
                         "for this run?)")
    from cg_pipelines.spark.session import DEFAULT_CONF

    given = _flat_conf(getattr(resource, "spark_config", None) or {})
    for k, v in DEFAULT_CONF.items():
        if k in given or not k.startswith("spark.sql."):
            continue
        try:
            if session.conf.isModifiable(k):
                session.conf.set(k, v)
        except Exception as e:  # a stopped classic session: py4j/AttributeError
            raise StateError(f"the SparkSession of {type(resource).__name__} is not usable "
                             f"(stopped?): {e}") from e
    return session


def _later_steps_need(context: Any, resource_key: str) -> list[str]:
    """Other steps of this run (nodes of the run's job, within the run's step selection) that
    require ``resource_key``."""
    op_ctx = getattr(context, "op_execution_context", context)
    me = str(op_ctx.node_handle)
    selected = op_ctx.run.step_keys_to_execute
    names = []
    for node in op_ctx.job_def.nodes:
        if node.name == me or (selected is not None and node.name not in selected):
            continue
        if resource_key in (getattr(node.definition, "required_resource_keys", None) or ()):
            names.append(node.name)
    return names


@contextlib.contextmanager
def stopping_foreign_spark(context: Any, resource_key: str) -> Iterator[None]:
    """Around a run's work: afterwards (also when it raised), stop the session of the Spark
    resource under ``resource_key`` when that resource does not stop its own (anything but
    :class:`SparkResource`), unless another step of the same run also requires it (then it
    is logged and left to the run's process). ``context``: the asset's execution context."""
    try:
        yield
    finally:
        resource = getattr(context.resources, resource_key, None)
        session = None
        if resource is not None and not isinstance(resource, SparkResource):
            # dagster-pyspark's resources keep it in _spark_session: read that, so that a lazy
            # resource does not start a session now just to stop it
            if "_spark_session" in getattr(type(resource), "__private_attributes__", {}):
                session = getattr(resource, "_spark_session", None)
            else:
                session = getattr(resource, "spark_session", None)
        if session is not None:
            others = _later_steps_need(context, resource_key)
            if others:
                context.log.info(f"Spark resource {resource_key!r}: session left running for "
                                 f"step(s) {', '.join(others)} of this run")
            else:
                from cg_pipelines.spark.session import stop_session

                stop_session(session)
                context.log.info(f"Spark resource {resource_key!r} "
                                 f"({type(resource).__name__}): session stopped")


_ENGINE = EngineOptions()  # the engine's defaults, which the resource's engine fields share


class PartitionRunsResource(ConfigurableResource):
    """Which members this deployment serves (``members``; empty: every member of the
    configs), how its partition runs behave and how the backlog sensor schedules, retries and
    judges them. Durations are seconds.

    Every field of :class:`~cg_pipelines.engine.options.EngineOptions` is a field here, with
    its name, meaning and default (except ``adaptive_max_msgs``: 200,000 here), and reaches
    each run unchanged (:meth:`engine_options`). ``retry_backoff_s`` spaces the sensor's
    retries of a failed *run*, ``nats_retry_backoff_s`` a run's retries of a NATS request.
    ``run_retention_*``: what each asset's ``<asset>_run_retention`` sensor deletes
    (:mod:`cg_pipelines.dagster.retention`, docs/growth.md).
    """

    members: list[str] = Field(default_factory=list,
                               description="Members served here; empty: every member.")
    # ------------------------------------------------------------ engine options (EngineOptions)
    batch_max_msgs: int = Field(default=_ENGINE.batch_max_msgs, description="Messages of the first "
                                "batch of a run (one commit each batch).")
    adaptive_max_msgs: int | None = Field(
        default=200_000, description="Batches grow up to this many messages while the transform's "
        "fixed cost per batch is over a fifth of its time (None: fixed batch_max_msgs).")
    batch_max_bytes: int = Field(default=_ENGINE.batch_max_bytes,
                                 description="Payload bytes per batch.")
    read_chunk: int = Field(default=_ENGINE.read_chunk, description="Messages per pull when a "
                            "rebuild replays the origin stream.")
    ack_wait_s: float = Field(default=_ENGINE.ack_wait_s, description="Lease ack wait, seconds.")
    priority_timeout_s: float = Field(default=_ENGINE.priority_timeout_s,
                                      description="Pin timeout, seconds.")
    hold_wait_s: float = Field(default=_ENGINE.hold_wait_s, description="Seconds to wait when "
                               "another instance holds the partition.")
    max_messages: int | None = Field(default=_ENGINE.max_messages, description="Stop a run "
                                     "after about this many messages (None: drain).")
    max_seconds: float | None = Field(default=_ENGINE.max_seconds, description="Seconds after "
                                      "which a run starts no new batch (None: no limit).")
    dead_letter_policy: Literal["dlq", "halt"] = Field(
        default=_ENGINE.dead_letter_policy, description="dlq: a message the decoder rejects "
        "goes to the dead-letter stream; halt: the run commits what precedes it and stops.")
    timeout_s: float = Field(default=_ENGINE.timeout_s, description="Seconds allowed for each NATS "
                             "request of a run.")
    nats_retry_max_s: float = Field(default=_ENGINE.nats_retry_max_s, description="Seconds a run "
                                    "retries a NATS step while NATS is unreachable, then fails.")
    nats_retry_backoff_s: float = Field(default=_ENGINE.nats_retry_backoff_s, description="First "
                                        "pause between a run's NATS retries (doubling) ...")
    nats_retry_max_backoff_s: float = Field(default=_ENGINE.nats_retry_max_backoff_s,
                                            description="... up to this many seconds.")
    executor_read_min_msgs: int | None = Field(
        default=_ENGINE.executor_read_min_msgs, description="A backlog of at least this many "
        "messages is read, decoded and transformed as one batch on the Spark executors, then "
        "committed once on the driver (a Spark processor; None: off; bench/spark_read.py).")
    dlq_max_age_s: float | None = Field(default=_ENGINE.dlq_max_age_s, description="Seconds the "
                                        "dead-letter stream keeps a dead letter (None: for ever).")
    settle_interval_s: float = Field(
        default=_ENGINE.settle_interval_s, description="Seconds: a commit within this long of "
        "the run's last settle is purged and acknowledged with the commits after it, in one "
        "purge (0: after every commit); never before its commit.")
    # ------------------------------------------------------------ the deployment and the sensor
    run_timeout_s: float = Field(default=3600.0, description="Upper bound of one partition run.")
    partitions_per_run: int = Field(
        default=1, ge=1, description="Backlog sensor: the run parallelism D, partitions one run "
        "drains (one input): runs over aligned blocks of D partitions (notes/RANGE_RUNS.md); "
        "1: one run per partition. A block waits while any of its partitions is in a run. "
        "`cg runs set STREAM GROUP D` overrides it from NATS, no restart needed.")
    min_pending: int = Field(default=1, description="Backlog sensor: run a partition at this many "
                             "pending messages ...")
    max_age_s: float | None = Field(default=None, description="... or when its oldest pending "
                                    "message is this old (seconds).")
    retry_max_failures: int = Field(
        default=5,
        description="Backlog sensor and drain schedule: a partition whose runs failed this "
        "many times in a row (same code) is reported by a failing check and not retried until "
        "a run succeeds or new code is loaded.")
    retry_backoff_s: float = Field(default=15.0, description="Seconds to wait before retrying a "
                                   "failed partition run; doubles per consecutive failure ...")
    retry_max_backoff_s: float = Field(default=300.0, description="... up to this many seconds.")
    heartbeat_ttl_s: float = Field(
        default=30.0, ge=3.0, description="Lost runs: each partition run keeps a heartbeat in "
        "NATS that lives this many seconds (renewed every third); the backlog sensor marks "
        "failed an in-progress run with no heartbeat left and no pinned lease, on any host "
        "(cg_pipelines.core.liveness).")
    lost_run_grace_s: float = Field(
        default=LOST_RUN_GRACE_S, ge=0.0, description="... but not within this many seconds "
        "of the run's start (time to write its first heartbeat).")
    # ------------------------------------------------------------ run retention
    run_retention_hours: float | None = Field(
        default=24.0, gt=0, description="The <asset>_run_retention sensor deletes an asset's "
        "finished runs older than this many hours, except the newest run_retention_keep_runs, "
        "each partition's last success and failures since, and its latest checks' runs. None: "
        "off.")
    run_retention_keep_runs: int = Field(default=100, ge=0, description="... the newest runs "
                                         "of the asset that stay whatever their age ...")
    run_retention_max_deletes: int = Field(
        default=100, ge=1, description="... and the most runs one evaluation (every 60 s) deletes: "
        "keep it above the runs a group starts in a minute.")

    def served(self) -> list[str] | None:
        """Served member names, or ``None`` for every member."""
        return list(self.members) or None

    def retry_policy(self) -> RetryPolicy:
        """The sensor's retry settings as a :class:`~cg_pipelines.core.triggers.RetryPolicy`.

        Raises:
            ConfigError: invalid settings (the reason is in the message).
        """
        return RetryPolicy(self.retry_max_failures, self.retry_backoff_s,
                           self.retry_max_backoff_s)

    def engine_options(self) -> EngineOptions:
        """The engine fields as the engine's :class:`~cg_pipelines.engine.options.EngineOptions`
        (every field of it, by name).

        Raises:
            ConfigError: a field out of the engine's range (the message names it).
        """
        return EngineOptions(**{f.name: getattr(self, f.name)
                                for f in dataclasses.fields(EngineOptions)})
