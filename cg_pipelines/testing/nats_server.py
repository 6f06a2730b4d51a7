"""Moved to :mod:`cg_pipelines.local.nats_server` (a local nats-server is for development as
much as for tests); this module re-exports its names so existing imports keep working."""

from cg_pipelines.local.nats_server import (
    MIN_NATS_SERVER_VERSION,
    NatsServer,
    NatsServerError,
    NatsServerNotFoundError,
    NatsServerStartError,
    find_nats_server,
    nats_server_version,
    server_version,
)

__all__ = [
    "MIN_NATS_SERVER_VERSION",
    "NatsServer",
    "NatsServerError",
    "NatsServerNotFoundError",
    "NatsServerStartError",
    "find_nats_server",
    "nats_server_version",
    "server_version",
]
