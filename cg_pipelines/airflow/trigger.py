"""The NATS backlog trigger (:class:`NatsBacklogTrigger`): runs in Airflow's triggerer, on its
event loop, and announces the partitions of one consumer group (or a co-partitioned set) that
have backlog.

Each round reads every input's config (so the served partitions follow membership, and a set's
co-partitioning is checked) and the backlog of those partitions, merged over the inputs
(:func:`~cg_pipelines.engine.inputs.inputs_backlog`, a bounded number of requests), applies
core's rules (:func:`~cg_pipelines.core.triggers.backlog_requests`,
:func:`~cg_pipelines.core.triggers.drop_repeated_requests`) and yields one event naming
exactly the partitions newly found with backlog; then it waits ``recheck_s`` seconds on the
event loop (``asyncio.sleep``: no busy polling). Events are hints: the drain task reads NATS
again, so a stale or repeated event costs one empty run at most."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import nats.errors
from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from nats.aio.client import Client

from cg_pipelines.airflow.connection import connect_options_async
from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.errors import CgError, ConfigError, one_line
from cg_pipelines.core.triggers import (
    BacklogRequest,
    PartitionBacklog,
    backlog_requests,
    drop_repeated_requests,
    served_partitions,
)
from cg_pipelines.engine.inputs import (
    inputs_backlog,
    inputs_label,
    inputs_title,
    read_input_configs,
)
from cg_pipelines.engine.join import JoinInput
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.connect import ConnectOptions

__all__ = ["NatsBacklogTrigger", "backlog_round", "served_backlog"]

log = logging.getLogger(__name__)

ROUND_ERRORS = (CgError, TimeoutError, OSError, nats.errors.Error)
"""What a round logs and waits out instead of ending the trigger."""


async def served_backlog(nc: Client, inputs: Sequence[JoinInput], partitions: int, *,
                         name: str, members: list[str] | None, timeout_s: float = 5.0
                         ) -> list[PartitionBacklog]:
    """One read: the backlog of each partition the ``members`` own (``None``: all), merged
    over the ``inputs`` (one input's as it is), in partition order (core's
    :class:`~cg_pipelines.core.triggers.PartitionBacklog`: pending messages, first pending
    sequence (a set's: the merged run token), its age in seconds). ``partitions``: the count
    the code declares (checked, with a set's co-partitioning; ``name`` names the set);
    ``timeout_s``: seconds per request.

    Raises:
        GroupNotFoundError, CoPartitionError, ConfigError, JetStreamError, TimeoutError,
        OSError: as reading fails (all in :data:`ROUND_ERRORS`).
    """
    configs = await read_input_configs(nc, inputs, partitions, name=name, timeout=timeout_s)
    served = served_partitions(assignment(configs[0].config), members)
    async with JetStreamAPI(nc, timeout=timeout_s) as api:
        _, merged = await inputs_backlog(api, inputs, served)
    return merged


async def backlog_round(nc: Client, inputs: Sequence[JoinInput], partitions: int, *,
                        name: str, members: list[str] | None, min_pending: int,
                        timeout_s: float = 5.0) -> list[BacklogRequest]:
    """:func:`served_backlog`'s partitions with at least ``min_pending`` pending messages, as
    core's :class:`~cg_pipelines.core.triggers.BacklogRequest` (run key
    ``<label>:<p>:<first pending seq>``, the label the input groups joined by ``+``), in
    partition order.

    Raises:
        as :func:`served_backlog`.
    """
    backlog = await served_backlog(nc, inputs, partitions, name=name, members=members,
                                   timeout_s=timeout_s)
    return backlog_requests(inputs_label(inputs), backlog, min_pending=min_pending)


class NatsBacklogTrigger(BaseEventTrigger):
    """Yields ``TriggerEvent({"name", "inputs": [[input, stream, group], ...], "partitions":
    [p, ...], "run_keys": {p: key}, "at": unix seconds})`` whenever partitions of the inputs
    have a backlog not announced in the last ``repeat_s`` seconds (a new first pending sequence
    of any input is a new announcement). Never raises from :meth:`run`: NATS errors, a missing
    group and a set no longer co-partitioned are logged and retried after ``recheck_s``
    seconds.

    Args (all JSON: Airflow stores them, and they are the watcher's identity):
        name: the spec's name (what a co-partitioning error names).
        inputs: ``[[input name, stream, group], ...]``: one elastic group, or a
            co-partitioned set's groups.
        partitions: the partition count the code declares (checked every round).
        connect: :class:`~cg_pipelines.jetstream.connect.ConnectOptions` fields without
            secrets (:meth:`~cg_pipelines.airflow.spec.StreamDag.connect_kwargs`).
        conn_id: an Airflow Connection completing ``connect`` with credentials, looked up
            at each (re)connection (:mod:`cg_pipelines.airflow.connection`); a lookup that
            fails is logged and tried again after ``recheck_s``.
        members: served members, ``None`` for all.
        min_pending: pending messages that make a partition run (>= 1).
        recheck_s: seconds between reads; repeat_s: seconds before an unchanged backlog is
            announced again; timeout_s: seconds per NATS request.
    """

    def __init__(self, name: str, inputs: Sequence[Sequence[str]], partitions: int,
                 connect: dict[str, Any], *, conn_id: str | None = None,
                 members: list[str] | None = None, min_pending: int = 1,
                 recheck_s: float = 30.0, repeat_s: float = 300.0, timeout_s: float = 5.0,
                 ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.name, self.partitions, self.connect = name, partitions, dict(connect)
        self.inputs = [[str(part) for part in inp] for inp in inputs]
        self._inputs = [JoinInput(*inp) for inp in self.inputs]
        self.conn_id = conn_id
        self.members = list(members) if members is not None else None
        self.min_pending, self.recheck_s, self.repeat_s = min_pending, recheck_s, repeat_s
        self.timeout_s = timeout_s
        self._clock: Callable[[], float] = time.time

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """``(classpath, kwargs)``: how the triggerer makes this trigger again."""
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "name": self.name, "inputs": self.inputs, "partitions": self.partitions,
            "connect": self.connect,
            "conn_id": self.conn_id, "members": self.members, "min_pending": self.min_pending,
            "recheck_s": self.recheck_s, "repeat_s": self.repeat_s,
            "timeout_s": self.timeout_s})

    async def _options(self) -> ConnectOptions:
        """The options to connect with, credentials from ``conn_id`` included.

        Raises:
            ConfigError: the connection could not be read (its id and the error's type and
                message; Airflow's errors name no secret).
        """
        try:
            return await connect_options_async(ConnectOptions(**self.connect), self.conn_id)
        except ConfigError:
            raise
        except Exception as e:  # Airflow's lookup errors have no common base across versions
            raise ConfigError("conn_id", f"connection {self.conn_id!r} not read: "
                              f"{type(e).__name__}: {one_line(str(e), 200)}") from e

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Read, announce, wait ``recheck_s``; forever (the triggerer cancels it)."""
        announced: dict[int, tuple[str, float]] = {}
        nc: Client | None = None
        try:
            while True:
                try:
                    if nc is None or nc.is_closed:
                        nc = await (await self._options()).connect()
                    reqs = await backlog_round(nc, self._inputs, self.partitions,
                                               name=self.name, members=self.members,
                                               min_pending=self.min_pending,
                                               timeout_s=self.timeout_s)
                    now = self._clock()
                    fresh, _, announced = drop_repeated_requests(
                        reqs, announced, [r.partition for r in reqs], now, self.repeat_s)
                    if fresh:
                        yield TriggerEvent({  # type: ignore[no-untyped-call]
                            "name": self.name, "inputs": self.inputs,
                            "partitions": [r.partition for r in fresh],
                            "run_keys": {str(r.partition): r.run_key for r in fresh},
                            "at": now})
                except ROUND_ERRORS as e:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise asyncio.CancelledError from e  # the triggerer cancels it
                    log.warning("backlog of %s not read: %s: %s",
                                inputs_title(self._inputs, self.name), type(e).__name__,
                                one_line(str(e), 300))
                await asyncio.sleep(self.recheck_s)
        finally:
            if nc is not None and not nc.is_closed:
                await nc.close()
