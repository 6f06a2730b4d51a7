"""Every auth mode works end to end: user/password, token, NKey seed file, creds file (operator
mode), TLS with the server certificate checked against the CA, mutual TLS. For each: the library
does a JetStream round trip (an elastic group created, listed, deleted), the ``cg`` CLI does the
same from the shell (flags, and once with environment variables), and the Dagster
``NatsResource`` (secrets through ``EnvVar``) connects inside a materialization."""

from __future__ import annotations

import asyncio
import json

from dagster import DagsterInstance, EnvVar, materialize
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig
from cg_pipelines.jetstream import admin
from tests.security.modes import AuthMode, cg, clean_env
from tests.security.probe import nats_probe


async def test_library_round_trip(mode: AuthMode, unique_name: str) -> None:
    s = unique_name
    nc = await mode.options.connect()
    try:
        js = nc.jetstream(timeout=5)
        await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
        v = await admin.create_elastic(js, s, "g", ElasticConfig(4, members=("m1",)))
        assert v.config.max_members == 4
        assert await admin.list_elastic(js, s, timeout=5) == ["g"]
        await js.publish(f"{s}.k1", b"x")
        assert await admin.delete_elastic(js, s, "g", timeout=5)
        assert (await js.stream_info(s)).state.messages == 1
        await js.delete_stream(s)
    finally:
        await nc.close()


def test_cli_round_trip(mode: AuthMode, unique_name: str) -> None:
    s, base = unique_name, ["--server", mode.url, *mode.cli_args]
    r = cg(*base, "--json", "elastic", "ls", s)
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
    _create_stream(mode, s)
    r = cg(*base, "elastic", "create", s, "g", "--max-members", "4", "--members", "m1")
    assert r.returncode == 0, r.stderr
    assert "max members: 4" in r.stdout
    r = cg(*base, "--json", "elastic", "ls", s)
    assert r.returncode == 0 and json.loads(r.stdout) == ["g"], r.stderr
    assert cg(*base, "elastic", "delete", s, "g").returncode == 0


def test_cli_reads_connection_from_environment(mode: AuthMode, unique_name: str) -> None:
    """The same settings through NATS_* variables instead of flags."""
    flag_env = {"--server": "NATS_URL", "--user": "NATS_USER", "--password": "NATS_PASSWORD",
                "--token": "NATS_TOKEN", "--nkey": "NATS_NKEY", "--creds": "NATS_CREDS",
                "--tls-ca": "NATS_CA", "--tls-cert": "NATS_CERT", "--tls-key": "NATS_KEY"}
    args = ["--server", mode.url, *mode.cli_args]
    env = clean_env(**{flag_env[args[i]]: args[i + 1] for i in range(0, len(args), 2)})
    _create_stream(mode, unique_name)
    r = cg("elastic", "create", unique_name, "g", "--max-members", "2", env=env)
    assert r.returncode == 0, r.stderr
    r = cg("elastic", "ls", unique_name, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["g"], r.stderr


def test_dagster_resource_connects(mode: AuthMode, unique_name: str) -> None:
    secret_fields = {k: v for k, v in mode.resource.__dict__.items() if isinstance(v, EnvVar)}
    assert set(mode.env) == {v.env_var_name for v in secret_fields.values()}  # secrets are EnvVars
    _create_stream(mode, unique_name)  # so the account has at least one stream to count
    with DagsterInstance.ephemeral() as instance:
        res = materialize([nats_probe], resources={"nats": mode.resource}, instance=instance)
    assert res.success
    (mat,) = res.asset_materializations_for_node("nats_probe")
    # the resource read the same account the library sees (an independent connection)
    assert mat.metadata["streams"].value == _stream_count(mode) >= 1
    assert mat.metadata["auth_mode"].value == mode.options.auth_mode


def _create_stream(mode: AuthMode, name: str) -> None:
    async def create() -> None:
        nc = await mode.options.connect()
        try:
            await nc.jetstream(timeout=5).add_stream(StreamConfig(name=name,
                                                                  subjects=[f"{name}.>"]))
        finally:
            await nc.close()

    asyncio.run(create())


def _stream_count(mode: AuthMode) -> int:
    async def count() -> int:
        nc = await mode.options.connect()
        try:
            return int((await nc.jetstream(timeout=5).account_info()).streams)
        finally:
            await nc.close()

    return asyncio.run(count())
