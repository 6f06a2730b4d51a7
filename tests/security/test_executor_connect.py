"""How Spark executors reach NATS for the executor read, per auth mode, against real servers.

The engine ships the connection's options to the executors (``jetstream`` source options).
A connection made by ``ConnectOptions.connect`` ships its own options, credentials files
included (nats-py shows none of those publicly); a connection made by ``nats.connect`` ships
what nats-py shows (servers, user, password, token) only when the server confirms that is every
credential the connection authenticated with (``$SYS.REQ.USER.INFO``), else the range is read
on the driver.

The run test uses a processor whose ``process_range`` stands in for the executors: it connects
with exactly the options it was given and reads the work queue's info, then stops the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.engine.executor_read import (
    RangeProcessor,
    credentials_shown,
    executor_connect_options,
)
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.connect import ConnectOptions, close_quietly, connect_options_of
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from tests.security.modes import PKI, auth_mode
from tests.support import keyed

FAST = dict(ack_wait_s=3.0, priority_timeout_s=3.0, hold_wait_s=6.0)
FILES = {"nkey": "nkey_seed", "creds": "creds"}


def _options(name: str, url: str, pki: PKI) -> ConnectOptions:
    """The library's working options for the mode's server (``plain``: none needed)."""
    return ConnectOptions(url) if name == "plain" else auth_mode(name, url, pki).options


async def _raw_connect(name: str, url: str, pki: PKI) -> Client:
    """The same server's connection made with nats-py directly (no ConnectOptions)."""
    o = _options(name, url, pki)
    return await nats.connect(url, user=o.user, password=o.password, token=o.token,
                              user_credentials=o.creds, nkeys_seed=o.nkey_seed)


@pytest.mark.parametrize("name", ["plain", "user_password", "token", "nkey", "creds"])
async def test_options_follow_the_connection(name: str, pki: PKI,
                                             auth_server: Callable[[str], NatsServer]) -> None:
    url = auth_server(name).url
    opts = _options(name, url, pki)
    nc = await opts.connect()
    try:
        assert connect_options_of(nc) is opts
        got = executor_connect_options(nc)
        assert got == opts.spark_source_options()
        if name in FILES:  # the credentials file is named, as a path
            assert got[FILES[name]] == getattr(opts, FILES[name])
            assert Path(got[FILES[name]]).is_file()
    finally:
        await close_quietly(nc)
    raw = await _raw_connect(name, url, pki)
    try:
        assert connect_options_of(raw) is None
        public = executor_connect_options(raw)
        assert public is not None and not {"creds", "nkey_seed"} & set(public)
        # the server knows a creds / NKey user by its public key, which nothing public explains
        assert await credentials_shown(raw, 5.0) is (name not in FILES)
        # given the ConnectOptions the connection was made from, the file is named again
        assert executor_connect_options(raw, connect=opts) == opts.spark_source_options()
    finally:
        await raw.close()


class ExecutorStandIn(ArrowProcessor):
    """``keyed``'s processor, plus a ``process_range`` that connects with the source options
    it is given, as an executor would, reads the work queue's info, and stops the run."""

    def __init__(self) -> None:
        super().__init__(keyed.DECODER, keyed.transform, state=keyed.STATE)
        self.sources: list[dict[str, str]] = []
        self.messages: list[int] = []

    def process_range(self, source: Mapping[str, str], ctx: BatchContext) -> object:
        self.sources.append(dict(source))

        async def as_executor() -> int:
            conn = ConnectOptions(source["servers"], user=source.get("user"),
                                  password=source.get("password"), token=source.get("token"),
                                  creds=source.get("creds"), nkey_seed=source.get("nkey_seed"),
                                  reconnect_attempts=0)
            nc = await conn.connect()
            try:
                info = await JetStreamAPI(nc, timeout=5).stream_info(source["stream"])
                return int(info["state"]["messages"])
            finally:
                await close_quietly(nc)

        self.messages.append(asyncio.run(as_executor()))
        raise ExecutorsReached


class ExecutorsReached(Exception):
    """The stand-in's executors connected: the run stops here, nothing committed."""


async def _group(nc: Client, stream: str, evs: list[tuple[str, int]]) -> None:
    js = nc.jetstream(timeout=5)
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await keyed.publish(js, stream, evs)
    api = JetStreamAPI(nc, timeout=5)
    for _ in range(200):
        if (await api.stream_info(f"{stream}-g"))["state"]["messages"] >= len(evs):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("work queue not filled")


@pytest.mark.parametrize("name", ["nkey", "creds"])
async def test_authenticated_run_ships_the_credentials_file(
        name: str, pki: PKI, auth_server: Callable[[str], NatsServer], unique_name: str,
        tmp_path: Path) -> None:
    url = auth_server(name).url
    opts = auth_mode(name, url, pki).options
    evs = keyed.events(n_keys=5, n_events=60)
    options = EngineOptions(executor_read_min_msgs=10, **FAST)
    nc = await opts.connect()
    try:
        await _group(nc, unique_name, evs)
        proc = ExecutorStandIn()
        assert isinstance(proc, RangeProcessor)
        with pytest.raises(ExecutorsReached):
            await run_partition(nc, unique_name, "g", 0, proc,
                                DeltaSink(str(tmp_path / "t")), options)
        (source,) = proc.sources
        assert source[FILES[name]] == getattr(opts, FILES[name])
        assert (source["stream"], source["subject"]) == (f"{unique_name}-g", "0.>")
        assert proc.messages == [len(evs)]  # the executors' connection authenticated
    finally:
        await close_quietly(nc)

    # The same run on a connection made by nats-py directly: nothing public shows the file,
    # the server names a user nothing public explains, so the range is read on the driver.
    raw = await _raw_connect(name, url, pki)
    try:
        proc = ExecutorStandIn()
        sink = DeltaSink(str(tmp_path / "t"))
        r = await run_partition(raw, unique_name, "g", 0, proc, sink, options)
        assert r.status == "drained" and r.processed == len(evs)
        assert proc.sources == [] and "read_executors" not in r.timings
        assert keyed.mismatches(sink.read(), evs) is None
        # given its ConnectOptions, the same connection ships the file again
        assert executor_connect_options(raw, connect=opts)[FILES[name]] == getattr(
            opts, FILES[name])
    finally:
        await raw.close()
