"""NATS credentials from an Airflow Connection (``ConsumerGroupDag(nats_conn_id=...)``): the
mapping onto ``ConnectOptions``, and a password-protected nats-server reached by the backlog
trigger and by a task with the connection's credentials, which the trigger's stored arguments
and the Dag never hold. Connections come from ``AIRFLOW_CONN_<ID>`` (Airflow's own lookup)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import nats
import pytest
from airflow.sdk import Connection

from cg_pipelines.airflow import ConsumerGroupDag, NatsBacklogTrigger, build_dags
from cg_pipelines.airflow.connection import options_from
from cg_pipelines.airflow.tasks import backlog_now
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.support import keyed

PASSWORD = "pa55-w0rd-for-the-test"


def _conn(**kw: Any) -> Connection:
    return Connection(conn_id="n", conn_type="nats", **kw)


BASE = ConnectOptions("nats://base:4222", creds="/base.creds", connect_timeout=7.0)


@pytest.mark.parametrize(("conn", "want"), [
    (_conn(), {}),
    (_conn(host="h", port=4333, login="u", password="p"),
     {"servers": "nats://h:4333", "user": "u", "password": "p"}),
    (_conn(host="h"), {"servers": "nats://h:4222"}),
    (_conn(host="h", extra=json.dumps({"servers": "nats://a:1,nats://b:2", "token": "tk"})),
     {"servers": "nats://a:1,nats://b:2", "token": "tk"}),
    (_conn(extra=json.dumps({"creds": "/c.creds", "nkey_seed": "/seed"})),
     {"creds": "/c.creds", "nkey_seed": "/seed"}),
])
def test_connection_fields_map_onto_connect_options(conn: Connection,
                                                    want: dict[str, Any]) -> None:
    got = options_from(BASE, conn)
    fields = ("servers", "user", "password", "token", "creds", "nkey_seed", "connect_timeout")
    base = {f: getattr(BASE, f) for f in fields}
    assert {f: getattr(got, f) for f in fields} == {**base, **want}


@pytest.mark.parametrize(("extra", "match"), [
    ({"pasword": "x"}, r"extra keys \['pasword'\] are not read"),
    ({"token": 5}, "extra 'token' must be a string, got int"),
])
def test_a_connection_with_unknown_or_bad_extra_is_refused(extra: dict[str, Any],
                                                           match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        options_from(BASE, _conn(extra=json.dumps(extra)))
    assert e.value.field == "nats_conn_id"


def test_an_empty_connection_id_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        ConsumerGroupDag("legs", "S", "g", 2, keyed.processor(), "/tmp/t", nats_conn_id=" ")
    assert e.value.field == "nats_conn_id"


@pytest.fixture
def secured(tmp_path: Path) -> NatsServer:
    conf = f'authorization {{ user: "cg", password: "{PASSWORD}" }}\n'
    with NatsServer(tmp_path / "nats", config_text=conf) as server:
        yield server


def _set_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, server: NatsServer) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({
        "conn_type": "nats", "host": "127.0.0.1", "port": server.port, "login": "cg",
        "password": PASSWORD}))


@pytest.mark.integration
async def test_trigger_and_task_read_backlog_with_the_connection_s_credentials(
        secured: NatsServer, monkeypatch: pytest.MonkeyPatch, unique_name: str,
        caplog: pytest.LogCaptureFixture) -> None:
    nc = await nats.connect(secured.url, user="cg", password=PASSWORD)
    try:
        js = nc.jetstream()
        await h.create_group(js, unique_name)
        evs = h.events_on({1, 3})
        await h.publish(js, unique_name, evs, len(evs))
    finally:
        await nc.close()

    # the server refuses a client without credentials: the connection is what lets them in
    with pytest.raises(Exception, match="[Aa]uthorization"):
        await ConnectOptions(secured.url, reconnect_attempts=0).connect()

    spec = ConsumerGroupDag("legs", unique_name, "g", h.PARTITIONS, keyed.processor(),
                            "/tmp/t", nats=ConnectOptions("nats://127.0.0.1:1"),
                            nats_conn_id="nats_cg_test")
    dags = build_dags([spec])  # the Dag holds the connection's id, not its secret
    assert PASSWORD not in repr(dags) and PASSWORD not in json.dumps(spec.connect_kwargs())

    # a missing connection: logged, retried, no event and no exception out of the trigger
    trig = NatsBacklogTrigger("legs", [["g", unique_name, "g"]], h.PARTITIONS,
                              spec.connect_kwargs(), conn_id="nats_cg_test", recheck_s=0.05,
                              repeat_s=600.0)
    gen = trig.run().__aiter__()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(gen.__anext__(), 1.0)
    assert any("connection 'nats_cg_test' not read" in r.getMessage() for r in caplog.records)
    await gen.aclose()

    _set_connection(monkeypatch, "nats_cg_test", secured)
    path, kwargs = trig.serialize()
    assert kwargs["conn_id"] == "nats_cg_test" and PASSWORD not in json.dumps(kwargs)
    gen = NatsBacklogTrigger(**kwargs).run().__aiter__()
    event = await asyncio.wait_for(gen.__anext__(), 30)
    assert event.payload["partitions"] == [1, 3]
    await gen.aclose()

    # a task's read of the backlog (the dispatcher's) connects the same way
    assert [b.partition for b in await asyncio.to_thread(backlog_now, spec)] == [1, 3]
    assert PASSWORD not in caplog.text
