"""Shared fixtures: ONE real nats-server per test session (JetStream, temp store, loopback) and
moto S3 — the library's own fixtures, :mod:`cg_pipelines.testing.fixtures`, which users' tests
enable the same way — plus per-test NATS connections, unique names and a figures report.

A missing nats-server binary fails the run (the fixture raises): nothing here ever skips.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext

from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.testing.s3 import MotoS3Server

pytest_plugins = ["cg_pipelines.testing.fixtures"]

_REPORT: list[str] = []
_COUNTER = itertools.count()


@pytest_asyncio.fixture(loop_scope="session")
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A nats-py connection to the session's server, closed after the test."""
    conn = await nats.connect(nats_server.url, connect_timeout=5, max_reconnect_attempts=2)
    try:
        yield conn
    finally:
        await conn.close()


@pytest_asyncio.fixture(loop_scope="session")
async def js(nc: Client) -> JetStreamContext:
    """A JetStream context on :func:`nc`."""
    return nc.jetstream(timeout=5)


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A short name unique in this session (streams and groups share one server)."""
    base = "".join(c for c in request.node.name.split("[")[0] if c.isalnum())[-16:]
    return f"T{os.getpid() % 1000}{next(_COUNTER)}{base}"


@dataclass(frozen=True)
class MotoBucket:
    server: MotoS3Server
    bucket: str
    options: dict[str, str]


@pytest.fixture
def moto_s3(moto_server: MotoS3Server, unique_name: str) -> MotoBucket:
    """A fresh bucket on the session's moto server, with delta-rs storage options."""
    name = unique_name.lower()[:40]
    moto_server.create_bucket(name)
    return MotoBucket(moto_server, name, moto_server.storage_options())


@pytest.fixture
def report() -> list[str]:
    """Lines appended here are printed in the terminal summary ("cg_pipelines figures")."""
    return _REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _REPORT:
        terminalreporter.section("cg_pipelines figures")
        for line in _REPORT:
            terminalreporter.write_line(line)
