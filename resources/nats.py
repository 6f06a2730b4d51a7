"""NATS connection resource: URL, user/password, token, NKey seed file, creds file, TLS (CA,
optional client certificate); per-call timeouts.

Secrets (password, token) come from the environment through Dagster ``EnvVar`` and are never
logged, shown in ``repr`` or put in run metadata; connection failures raise the library's typed
errors (:class:`~cg_pipelines.jetstream.connect.NatsAuthError`, ``NatsTLSError``), whose
messages name the server and the auth mode but not the secret. Dagster ops and sensors are
synchronous; :meth:`NatsResource.run` runs one asyncio coroutine against a fresh connection,
bounded by ``call_timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from dagster import ConfigurableResource, EnvVar
from nats.aio.client import Client
from pydantic import Field

from cg_pipelines.jetstream.connect import ConnectOptions, close_quietly, redact_url

T = TypeVar("T")


class NatsResource(ConfigurableResource):
    """How this deployment reaches NATS.

    Example: ``NatsResource(servers=EnvVar("NATS_URL"), user="app",
    password=EnvVar("NATS_PASSWORD"))``. Give secrets only as ``EnvVar``: a plain string would
    be stored in the code location's snapshot.
    """

    servers: str = Field("nats://127.0.0.1:4222", description="NATS URL(s), comma separated.")
    user: str | None = Field(None, description="User name for user/password auth.")
    password: str | None = Field(None, description="Password (use EnvVar).", repr=False)
    token: str | None = Field(None, description="Auth token (use EnvVar).", repr=False)
    nkey_seed_file: str | None = Field(None, description="Path of an NKey seed file.")
    creds_file: str | None = Field(None, description="Path of a .creds (JWT + NKey) file.")
    tls_ca: str | None = Field(None, description="CA file to verify the server's certificate.")
    tls_cert: str | None = Field(None, description="Client certificate file (optional).")
    tls_key: str | None = Field(None, description="Client key file (optional).")
    connect_timeout_s: float = Field(5.0, description="Seconds to connect.")
    call_timeout_s: float = Field(10.0, description="Seconds allowed for one bounded call "
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
        ``NatsConnectError``, ``nats.errors.NoServersError`` (unreachable)."""

        async def main() -> T:
            nc = await self.connect_options().connect()
            try:
                return await fn(nc)
            finally:
                await close_quietly(nc)

        async def bounded() -> T:
            return await asyncio.wait_for(main(), timeout_s or self.call_timeout_s)

        return asyncio.run(bounded())
