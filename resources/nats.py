"""NATS connection resource: URL, user/password, token, creds file, TLS CA; per-call timeouts.

Secrets (password, token) come from the environment through Dagster ``EnvVar`` and are never
logged or put in run metadata. Dagster ops and sensors are synchronous; :meth:`NatsResource.run`
runs one asyncio coroutine against a fresh connection, bounded by ``call_timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from dagster import ConfigurableResource
from nats.aio.client import Client
from pydantic import Field

from cg_pipelines.jetstream.connect import ConnectOptions

T = TypeVar("T")


class NatsResource(ConfigurableResource):
    """How this deployment reaches NATS.

    Example: ``NatsResource(servers=EnvVar("NATS_URL"), password=EnvVar("NATS_PASSWORD"))``.
    """

    servers: str = Field("nats://127.0.0.1:4222", description="NATS URL(s), comma separated.")
    user: str | None = Field(None, description="User name for user/password auth.")
    password: str | None = Field(None, description="Password (use EnvVar).")
    token: str | None = Field(None, description="Auth token (use EnvVar).")
    creds_file: str | None = Field(None, description="Path of a .creds (JWT + NKey) file.")
    tls_ca: str | None = Field(None, description="CA file to verify the server's certificate.")
    tls_cert: str | None = Field(None, description="Client certificate file (optional).")
    tls_key: str | None = Field(None, description="Client key file (optional).")
    connect_timeout_s: float = Field(5.0, description="Seconds to connect.")
    call_timeout_s: float = Field(10.0, description="Seconds allowed for one bounded call "
                                  "(sensor ticks make a few; keep well under 60).")

    def connect_options(self) -> ConnectOptions:
        """The library's connection options (secrets stay out of ``repr``)."""
        return ConnectOptions(
            servers=self.servers, user=self.user, password=self.password, token=self.token,
            creds=self.creds_file, tls_ca=self.tls_ca, tls_cert=self.tls_cert,
            tls_key=self.tls_key, connect_timeout=self.connect_timeout_s,
            name="cg_pipelines-dagster",
        )

    def run(self, fn: Callable[[Client], Awaitable[T]], *, timeout_s: float | None = None) -> T:
        """Connect, run ``fn(nc)``, close — all within ``timeout_s`` (default
        ``call_timeout_s``) seconds. Raises ``TimeoutError`` past it, and connection errors
        (``nats.errors.NoServersError``, auth errors) unchanged."""

        async def main() -> T:
            nc = await self.connect_options().connect()
            try:
                return await fn(nc)
            finally:
                await nc.close()

        async def bounded() -> T:
            return await asyncio.wait_for(main(), timeout_s or self.call_timeout_s)

        return asyncio.run(bounded())
