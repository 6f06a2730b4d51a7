"""NATS credentials from an Airflow Connection (``ConsumerGroupDag(nats_conn_id=...)``).

The Dag and the backlog trigger's stored arguments name the connection only; its secret is
read where a connection is made: by a task on the worker, by the trigger in the triggerer,
through Airflow's own connection lookup (the metadata database, ``AIRFLOW_CONN_<ID>``
environment variables or a secrets backend), so it is masked in task logs like every
Airflow connection secret.

A connection maps onto :class:`~cg_pipelines.jetstream.connect.ConnectOptions` as follows
(fields left empty keep the Dag's ``nats`` value):

================  ============================================================
connection        ``ConnectOptions``
================  ============================================================
host, port        ``servers = "nats://<host>:<port>"`` (port 4222 if empty)
extra ``servers``  ``servers`` as given (a comma-separated list; wins over host)
login, password   ``user``, ``password``
extra ``token``   ``token``
extra ``creds``    ``creds`` (a creds file path on the worker and the triggerer)
extra ``nkey_seed``  ``nkey_seed`` (an NKey seed file path)
================  ============================================================
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.jetstream.connect import ConnectOptions

__all__ = ["EXTRA_FIELDS", "connect_options", "connect_options_async", "options_from"]

EXTRA_FIELDS = ("servers", "token", "creds", "nkey_seed")
"""The keys of a connection's extra that are read; any other key is refused."""


def options_from(base: ConnectOptions, conn: Any) -> ConnectOptions:
    """``base`` with what connection ``conn`` (an Airflow ``Connection``: ``conn_id``,
    ``host``, ``port``, ``login``, ``password``, ``extra_dejson``) sets, as the module
    docstring's table says.

    Raises:
        ConfigError: the extra holds a key that is not in :data:`EXTRA_FIELDS`, or a value
            that is not a string (named, never the value).
    """
    extra = dict(conn.extra_dejson or {})
    unknown = sorted(set(extra) - set(EXTRA_FIELDS))
    if unknown:
        raise ConfigError("nats_conn_id", f"connection {conn.conn_id!r}: extra keys "
                          f"{unknown} are not read (known: {', '.join(EXTRA_FIELDS)})")
    for k, v in extra.items():
        if not isinstance(v, str):
            raise ConfigError("nats_conn_id", f"connection {conn.conn_id!r}: extra {k!r} "
                              f"must be a string, got {type(v).__name__}")
    out: dict[str, Any] = {}
    if conn.host:
        out["servers"] = f"nats://{conn.host}:{conn.port or 4222}"
    out.update({k: extra[k] for k in EXTRA_FIELDS if extra.get(k)})
    if conn.login:
        out["user"] = conn.login
    if conn.password:
        out["password"] = conn.password
    return dataclasses.replace(base, **out)


def connect_options(base: ConnectOptions, conn_id: str | None) -> ConnectOptions:
    """``base`` completed by connection ``conn_id`` (``base`` itself when None); in a task.

    Raises:
        airflow.sdk.exceptions.AirflowRuntimeError: no such connection (Airflow's error).
        ConfigError: see :func:`options_from`.
    """
    if conn_id is None:
        return base
    from airflow.sdk import BaseHook

    return options_from(base, BaseHook.get_connection(conn_id))


async def connect_options_async(base: ConnectOptions, conn_id: str | None) -> ConnectOptions:
    """:func:`connect_options` for the triggerer's event loop: Airflow's lookup runs in a
    thread (``BaseHook.aget_connection`` before Airflow 3.3.2 can fail with
    ``DeadlockImminentError`` when another call of the loop talks to the supervisor).

    Raises:
        as :func:`connect_options`.
    """
    if conn_id is None:
        return base
    return await asyncio.to_thread(connect_options, base, conn_id)
