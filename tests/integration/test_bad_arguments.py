"""Bad CLI and API arguments (issue 6, "Bad input"): unknown stream, unknown group, bad member
mapping syntax, max_members 0 or negative; and (issue 16) a stored config that breaks the limits:
max_members of 10**30 or 10**8 (above MAX_MEMBERS; they used to hang or take over 30 s) or
duplicate member names, put into KV directly.

Each CLI case exits 2 with exactly one stderr line ``cg: error: <reason>`` naming the problem
(no traceback, nothing on stdout); each API case raises its typed exception. After all of them
the KV buckets are untouched (same keys, same revisions, no new writes) and no stream or
consumer was created.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    MAX_MEMBERS,
    STATIC_BUCKET,
    ElasticConfig,
    MemberMapping,
    StaticConfig,
)
from cg_pipelines.core.errors import ConfigError, GroupNotFoundError, MembershipError
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import StreamNotFoundError
from cg_pipelines.jetstream.members import elastic_consume, static_consume

CG = [sys.executable, "-m", "cg_pipelines.cli"]
NOSTREAM = "NOSUCHSTREAM"


async def _setup(js: JetStreamContext, s: str) -> None:
    """Stream ``s`` with elastic group ``g`` (2 partitions, member m1) and static group ``st``."""
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>", f"0.{s}.>", f"1.{s}.>"]))
    await admin.create_elastic(js, s, "g", ElasticConfig(2, members=("m1",)))
    await admin.create_static(js, s, "st", StaticConfig(2, members=("m1",)))


async def _snapshot(js: JetStreamContext, s: str) -> dict[str, Any]:
    """Each KV bucket's keys with their revisions and its last write (any write moves it), the
    streams, and s's consumers."""
    out: dict[str, Any] = {}
    api = JetStreamAPI.from_js(js)
    for bucket in (ELASTIC_BUCKET, STATIC_BUCKET):
        kv = await js.key_value(bucket)
        info = await api.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.>")
        keys = [k.removeprefix(f"$KV.{bucket}.") for k in info["state"]["subjects"]]
        out[bucket] = {k: (await kv.get(k)).revision for k in keys if k.startswith(f"{s}.")}
        out[f"{bucket} last_seq"] = info["state"]["last_seq"]
    out["streams"] = sorted(si.config.name for si in await js.streams_info())
    out["consumers"] = {name: sorted(await api.list_consumer_names(name))
                        for name in (s, f"{s}-g")}
    return out


def _cli_cases(s: str) -> list[tuple[list[str], str]]:
    """(arguments, words the one-line error must contain)."""
    nf = "not found"
    return [
        # unknown stream
        (["elastic", "create", NOSTREAM, "h", "--max-members", "2"],
         f"stream '{NOSTREAM}' not found"),
        (["static", "create", NOSTREAM, "h", "--max-members", "2", "-m", "m1"],
         f"stream '{NOSTREAM}' not found"),
        (["elastic", "info", NOSTREAM, "g"], f"group 'g' on stream '{NOSTREAM}': {nf}"),
        (["elastic", "add", NOSTREAM, "g", "m2"], f"group 'g' on stream '{NOSTREAM}': {nf}"),
        (["static", "consume", NOSTREAM, "st", "m1"], f"group 'st' on stream '{NOSTREAM}': {nf}"),
        # unknown group, every command that names one
        (["elastic", "info", s, "nog"], f"elastic consumer group 'nog' on stream '{s}': {nf}"),
        (["static", "info", s, "nog"], f"static consumer group 'nog' on stream '{s}': {nf}"),
        (["elastic", "delete", s, "nog"], f"elastic consumer group 'nog' on stream '{s}': {nf}"),
        (["static", "delete", s, "nog"], f"static consumer group 'nog' on stream '{s}': {nf}"),
        (["elastic", "add", s, "nog", "m1"], f"group 'nog' on stream '{s}': {nf}"),
        (["elastic", "drop", s, "nog", "m1"], f"group 'nog' on stream '{s}': {nf}"),
        (["elastic", "create-mapping", s, "nog", "m1:0-1"], f"group 'nog' on stream '{s}': {nf}"),
        (["elastic", "delete-mapping", s, "nog"], f"group 'nog' on stream '{s}': {nf}"),
        (["elastic", "member-info", s, "nog"], f"group 'nog' on stream '{s}': {nf}"),
        (["static", "member-info", s, "nog", "m1"], f"group 'nog' on stream '{s}': {nf}"),
        (["elastic", "step-down", s, "nog", "m1"], f"group 'nog' on stream '{s}': {nf}"),
        (["static", "step-down", s, "nog", "m1"], f"group 'nog' on stream '{s}': {nf}"),
        (["elastic", "consume", s, "nog", "m1"], f"group 'nog' on stream '{s}': {nf}"),
        (["static", "join", s, "nog", "m1"], f"group 'nog' on stream '{s}': {nf}"),
        # unknown member / nothing to step down
        (["elastic", "step-down", s, "g", "zz"], f"'zz' is not a member of elastic consumer "
                                                 f"group {s}.g"),
        (["elastic", "step-down", s, "g", "m1"], "has no consumer 'm1'"),
        (["static", "step-down", s, "st", "m1"], "has no consumer 'st-m1'"),
        (["static", "consume", s, "st", "zz"], "'zz' is not in the membership"),
        # bad member mapping syntax (and mappings that break the rules)
        (["elastic", "create-mapping", s, "g", "m1:0,1;m2"], "'1;m2' is not a partition number"),
        (["elastic", "create-mapping", s, "g", "m1=x"], "'m1=x' must look like 'member:0,1,2'"),
        (["elastic", "create-mapping", s, "g", "m1:"], "'m1:' must look like"),
        (["elastic", "create-mapping", s, "g", ":0-1"], "':0-1' must look like"),
        (["elastic", "create-mapping", s, "g", "m1:1-0"], "range '1-0' is reversed"),
        (["elastic", "create-mapping", s, "g", "m1:0,,1"], "'' is not a partition number"),
        (["elastic", "create-mapping", s, "g", "m1:0"], "must be mapped; missing [1]"),
        (["elastic", "create-mapping", s, "g", "m1:0-1", "m2:1"],
         "partition 1 is mapped more than once"),
        (["elastic", "create-mapping", s, "g", "m1:0-2"], "partition 2 of 'm1' is outside [0, 2)"),
        (["elastic", "create-mapping", s, "g", "m1:0", "m1:1"], "member 'm1' is mapped twice"),
        (["elastic", "create-mapping", s, "g", "a.b:0-1"], "member name 'a.b'"),
        (["elastic", "create", s, "h", "--max-members", "2", "--mapping", "m1=0"],
         "must look like"),
        (["static", "create", s, "h", "--max-members", "2", "--mapping", "m1:0;1"],
         "'0;1' is not a partition number"),
        # max_members 0 or negative
        (["elastic", "create", s, "h", "--max-members", "0"], "max_members: must be >= 1, got 0"),
        (["elastic", "create", s, "h", "--max-members", "-3"],
         "max_members: must be >= 1, got -3"),
        (["static", "create", s, "h", "--max-members", "0", "-m", "m1"],
         "max_members: must be >= 1, got 0"),
        (["static", "create", s, "h", "--max-members", "-1", "-m", "m1"],
         "max_members: must be >= 1, got -1"),
    ]


async def _cg(url: str, args: list[str], timeout: float = 60) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *CG, "--server", url, "--timeout", "10", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:  # timed out (a hang), or cancelled: never leave it running
        if proc.returncode is None:
            proc.kill()
            with contextlib.suppress(BaseException):
                await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_bad_arguments_exit_2_with_one_line_and_touch_nothing(
        nats_server, js: JetStreamContext, unique_name: str) -> None:
    s = unique_name
    await _setup(js, s)
    before = await _snapshot(js, s)
    cases = _cli_cases(s)
    limit = asyncio.Semaphore(4)

    async def run(args: list[str]) -> tuple[int, str, str]:
        async with limit:
            return await _cg(nats_server.url, args)

    results = await asyncio.gather(*(run(args) for args, _ in cases))
    failures = []
    for (args, words), (code, out, err) in zip(cases, results, strict=True):
        lines = err.strip().splitlines()
        ok = (code == 2 and out == "" and len(lines) == 1
              and lines[0].startswith("cg: error: ") and words in lines[0])
        if not ok:
            failures.append(f"{args}: exit {code}, stdout {out!r}, stderr {err!r}")
    assert not failures, "\n".join(failures)
    assert await _snapshot(js, s) == before


def _api_cases(js: JetStreamContext, s: str
               ) -> list[tuple[str, Callable[[], Awaitable[Any]], type[Exception], str]]:
    """(id, call, typed exception, words in its message)."""

    def handler(msg: Any) -> None:
        raise AssertionError("no message may be delivered")

    nf = "not found"
    return [
        ("create_elastic unknown stream", lambda: admin.create_elastic(
            js, NOSTREAM, "h", ElasticConfig(2)), StreamNotFoundError,
         f"stream '{NOSTREAM}' not found"),
        ("create_static unknown stream", lambda: admin.create_static(
            js, NOSTREAM, "h", StaticConfig(2, members=("m1",))), StreamNotFoundError,
         f"stream '{NOSTREAM}' not found"),
        ("get_elastic", lambda: admin.get_elastic(js, s, "nog"), GroupNotFoundError, nf),
        ("get_static", lambda: admin.get_static(js, s, "nog"), GroupNotFoundError, nf),
        ("delete_static", lambda: admin.delete_static(js, s, "nog"), GroupNotFoundError, nf),
        ("add_members", lambda: admin.add_members(js, s, "nog", ["m1"]), GroupNotFoundError, nf),
        ("drop_members", lambda: admin.drop_members(js, s, "nog", ["m1"]), GroupNotFoundError,
         nf),
        ("set_member_mappings", lambda: admin.set_member_mappings(
            js, s, "nog", [MemberMapping("m1", (0, 1))]), GroupNotFoundError, nf),
        ("delete_member_mappings", lambda: admin.delete_member_mappings(js, s, "nog"),
         GroupNotFoundError, nf),
        ("member_status", lambda: admin.member_status(js, "elastic", s, "nog"),
         GroupNotFoundError, nf),
        ("elastic_step_down", lambda: admin.elastic_step_down(js, s, "nog", "m1"),
         GroupNotFoundError, nf),
        ("static_step_down", lambda: admin.static_step_down(js, s, "nog", "m1"),
         GroupNotFoundError, nf),
        ("elastic_step_down not a member", lambda: admin.elastic_step_down(js, s, "g", "zz"),
         MembershipError, "'zz' is not a member"),
        ("elastic_step_down not joined", lambda: admin.elastic_step_down(js, s, "g", "m1"),
         MembershipError, "has no consumer 'm1'"),
        ("elastic_consume", lambda: elastic_consume(js, s, "nog", "m1", handler),
         GroupNotFoundError, nf),
        ("static_consume unknown stream", lambda: static_consume(js, NOSTREAM, "st", "m1",
                                                                 handler),
         GroupNotFoundError, f"on stream '{NOSTREAM}': {nf}"),
        ("static_consume not a member", lambda: static_consume(js, s, "st", "zz", handler),
         MembershipError, "'zz' is not in the membership"),
        ("set_member_mappings misses a partition", lambda: admin.set_member_mappings(
            js, s, "g", [MemberMapping("m1", (0,))]), ConfigError, "missing [1]"),
        ("create_elastic max_members 0", lambda: admin.create_elastic(
            js, s, "h", ElasticConfig(0)), ConfigError, "max_members: must be >= 1, got 0"),
        ("create_elastic max_members -2", lambda: admin.create_elastic(
            js, s, "h", ElasticConfig(-2)), ConfigError, "got -2"),
        ("create_static max_members 0", lambda: admin.create_static(
            js, s, "h", StaticConfig(0, members=("m1",))), ConfigError, "got 0"),
    ]


async def test_api_bad_arguments_raise_typed_errors_and_touch_nothing(
        js: JetStreamContext, unique_name: str) -> None:
    s = unique_name
    await _setup(js, s)
    before = await _snapshot(js, s)
    for case, call, exc, words in _api_cases(js, s):
        with pytest.raises(exc) as ei:
            await call()
        assert type(ei.value) is exc, (case, ei.value)
        assert words in str(ei.value), (case, str(ei.value))
    # delete_elastic of a missing group is idempotent: False, not an error (the CLI exits 2).
    assert await admin.delete_elastic(js, s, "nog") is False
    assert await _snapshot(js, s) == before


# Stored configs that break the limits, written into KV directly: (group, kind, JSON, words).
BAD_STORED = [
    ("big30", "elastic", '{"max_members":1000000000000000000000000000000,'
     '"partitioning_filters":null,"members":["m1"]}', f"max_members: must be <= {MAX_MEMBERS}"),
    ("big8", "elastic", '{"max_members":100000000,"partitioning_filters":null,"members":["m1"]}',
     f"max_members: must be <= {MAX_MEMBERS}, got 100000000"),
    ("dup", "elastic", '{"max_members":2,"partitioning_filters":null,"members":["m1","m1"]}',
     "members: member 'm1' is listed more than once"),
    ("sbig30", "static", '{"max_members":1000000000000000000000000000000,"members":["m1"]}',
     f"max_members: must be <= {MAX_MEMBERS}"),
    ("sbig8", "static", '{"max_members":100000000,"members":["m1"]}',
     f"max_members: must be <= {MAX_MEMBERS}, got 100000000"),
    ("sdup", "static", '{"max_members":2,"members":["m2","m2"]}',
     "members: member 'm2' is listed more than once"),
]


def _bad_stored_cases(s: str) -> list[tuple[list[str], str]]:
    out = []
    for group, kind, _, words in BAD_STORED:
        if kind == "elastic":
            commands = [["info", s, group], ["member-info", s, group], ["add", s, group, "m2"],
                        ["drop", s, group, "m1"], ["create-mapping", s, group, "m1:0-1"],
                        ["delete-mapping", s, group], ["step-down", s, group, "m1"]]
        else:
            commands = [["info", s, group], ["member-info", s, group],
                        ["step-down", s, group, "m1"]]
        out += [([kind, *c], words) for c in commands]
    return out


async def test_cli_bad_stored_config_exits_2_with_one_line_and_writes_nothing(
        nats_server, js: JetStreamContext, unique_name: str) -> None:
    """The stored config is refused on read, before any assignment is computed: each command
    returns (the subprocess timeout is the hang guard, not a timing test), exits 2 with one
    line naming the field and rule, and the KV entries keep their revisions."""
    s = unique_name
    await _setup(js, s)
    for group, kind, stored, _ in BAD_STORED:
        kv = await js.key_value(ELASTIC_BUCKET if kind == "elastic" else STATIC_BUCKET)
        await kv.put(f"{s}.{group}", stored.encode())
    before = await _snapshot(js, s)
    cases = _bad_stored_cases(s)
    limit = asyncio.Semaphore(4)

    async def run(args: list[str]) -> tuple[int, str, str]:
        async with limit:
            return await _cg(nats_server.url, args, timeout=20)

    results = await asyncio.gather(*(run(args) for args, _ in cases), return_exceptions=True)
    failures = []
    for (args, words), result in zip(cases, results, strict=True):
        if isinstance(result, BaseException):
            failures.append(f"{args}: {type(result).__name__} (did not return within 20 s)")
            continue
        code, out, err = result
        lines = err.strip().splitlines()
        ok = (code == 2 and out == "" and len(lines) == 1
              and lines[0].startswith("cg: error: ") and words in lines[0])
        if not ok:
            failures.append(f"{args}: exit {code}, stdout {out!r}, stderr {err!r}")
    assert not failures, "\n".join(failures)
    assert await _snapshot(js, s) == before
