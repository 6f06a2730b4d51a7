"""A group's run layout in NATS (``cg runs show|set|unset``, jetstream/run_layout.py) on a
real nats-server: the dry run writes nothing, bad input is refused with the reason, the value
lives in cg's own bucket (never the reference's). The backlog sensor picking a change up:
``tests/dagster/test_range_runs.py``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from nats.js import JetStreamContext

from cg_pipelines.core.config import ELASTIC_BUCKET
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.jetstream.run_layout import (
    RUNS_BUCKET,
    RunLayout,
    get_run_layout,
)
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h

pytestmark = pytest.mark.integration

CG = [sys.executable, "-m", "cg_pipelines.cli"]


def cg(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CG, "--server", url, *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("bad", [b"not json", b"[]", b"{}", b'{"partitions_per_run": 0}',
                                 b'{"partitions_per_run": true}',
                                 b'{"partitions_per_run": "4"}'])
def test_a_bad_stored_layout_is_refused_naming_the_key(bad: bytes) -> None:
    with pytest.raises(ConfigError) as e:
        RunLayout.decode(bad, "cg-runs/S.g")
    assert e.value.field == "partitions_per_run" and "cg-runs/S.g" in str(e.value)


async def test_cg_runs_set_show_unset(js: JetStreamContext, nats_server: NatsServer,
                                      unique_name: str) -> None:
    url, stream = nats_server.url, unique_name
    await h.create_group(js, stream)  # group g, 4 partitions
    r = await asyncio.to_thread(cg, url, "runs", "show", stream, "g", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"partitions": 4, "partitions_per_run": None}

    r = await asyncio.to_thread(cg, url, "runs", "set", stream, "g", "3", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert (plan["blocks"], plan["runs"], plan["written"]) == (["0-2", "3"], 2, False)
    assert await get_run_layout(js, stream, "g") is None  # the dry run wrote nothing

    r = await asyncio.to_thread(cg, url, "runs", "set", stream, "g", "2")
    assert r.returncode == 0, r.stderr
    assert "2 partition(s) per run" in r.stdout and "before: not set" in r.stdout
    assert await get_run_layout(js, stream, "g") == RunLayout(2)
    # cg's own bucket: the reference's bucket holds only the group's config
    ref = await js.key_value(ELASTIC_BUCKET)
    assert [k for k in await ref.keys() if k.startswith(f"{stream}.")] == [f"{stream}.g"]
    assert b"max_members" in (await ref.get(f"{stream}.g")).value
    assert (await (await js.key_value(RUNS_BUCKET)).get(f"{stream}.g")).value == \
        b'{"partitions_per_run": 2}'

    for args, needle in ((("0",), "must be an integer >= 1"),
                         (("x",), "is not a valid integer")):
        r = await asyncio.to_thread(cg, url, "runs", "set", stream, "g", *args)
        assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)
    r = await asyncio.to_thread(cg, url, "runs", "set", stream, "nope", "2")
    assert r.returncode == 2 and "nope" in r.stderr
    assert await get_run_layout(js, stream, "g") == RunLayout(2)  # nothing written by those

    r = await asyncio.to_thread(cg, url, "runs", "unset", stream, "g")
    assert r.returncode == 0 and "removed" in r.stdout, r.stderr
    assert await get_run_layout(js, stream, "g") is None
    r = await asyncio.to_thread(cg, url, "runs", "unset", stream, "g")
    assert r.returncode == 0 and "was not set" in r.stdout

