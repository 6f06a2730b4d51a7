"""Connection options for NATS: URL, user/password, token, creds (NKey/JWT) file, TLS.

Shared by the library, the ``cg`` CLI and the Dagster NATS resource. Secrets are kept out of
``repr`` and error messages.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

import nats
from nats.aio.client import Client


@dataclass(frozen=True)
class ConnectOptions:
    """How to reach NATS.

    Args:
        servers: comma-separated URL list, e.g. ``"nats://127.0.0.1:4222"``.
        user, password: user/password auth. token: token auth.
        creds: path of a ``.creds`` file (JWT + NKey seed).
        tls_ca: CA bundle path to verify the server's certificate (implies TLS).
        tls_cert, tls_key: optional client certificate and key paths.
        connect_timeout: seconds for the initial connection.
        name: client name shown by the server.
    """

    servers: str = "nats://127.0.0.1:4222"
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout: float = 5.0
    name: str = "cg_pipelines"

    def tls_context(self) -> ssl.SSLContext | None:
        """An SSL context checking the server against ``tls_ca`` (None when TLS is not set)."""
        if not (self.tls_ca or self.tls_cert):
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    async def connect(self) -> Client:
        """Connect once (no reconnect loop at start): raises on failure within the timeout.

        Raises ``nats.errors.NoServersError`` (unreachable), ``nats.errors.Error`` subclasses
        for authentication failures, ``ssl.SSLError`` for TLS failures.
        """
        return await nats.connect(
            servers=[s.strip() for s in self.servers.split(",") if s.strip()],
            user=self.user,
            password=self.password,
            token=self.token,
            user_credentials=self.creds,
            tls=self.tls_context(),
            connect_timeout=self.connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=3,
            name=self.name,
        )
