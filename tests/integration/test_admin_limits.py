"""Stored configs that break the limits (issue 16): ``max_members`` beyond
:data:`~cg_pipelines.core.config.MAX_MEMBERS` (10**30 used to hang ``info``, ``member-info``,
``add`` (after writing), ``drop``, ``create-mapping``; 10**8 took over 30 s) and duplicate member
names. Every admin call and both consume calls refuse them with a typed one-line ``ConfigError``
naming the field and the rule, before computing any assignment, and write nothing (the deletes
still remove such a config: they are the remedy). The bound
itself is usable: a lone member of a group with MAX_MEMBERS partitions gets its consumer (one
filter per partition) and its messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    MAX_MEMBERS,
    STATIC_BUCKET,
    ElasticConfig,
    MemberMapping,
    PartitioningFilter,
    StaticConfig,
)
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import StreamNotFoundError
from cg_pipelines.jetstream.members import GroupMsg, MemberConfig, elastic_consume, static_consume
from tests.support.wait import wait_for

HANG_GUARD_S = 20  # a hang guard, not a timing test: each call returns at once
# hang_guard owns SIGALRM here: pytest-timeout watches these tests from a thread instead.
pytestmark = pytest.mark.timeout(method="thread")


class Hung(Exception):
    pass


@contextlib.contextmanager
def hang_guard(seconds: float) -> Iterator[None]:
    """Raise :class:`Hung` in the main thread after ``seconds``: unlike ``asyncio.wait_for``
    this also interrupts a CPU-bound loop (e.g. an assignment over 10**30 partitions)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


BIG = 10**30
# (id, kind, stored JSON, field, words in the rule)
BAD_STORED = [
    ("elastic max_members 10**30", "elastic",
     f'{{"max_members":{BIG},"partitioning_filters":null,"members":["m1"]}}', "max_members",
     f"must be <= {MAX_MEMBERS}, got 100000000000...(31 digits)"),
    ("elastic max_members 10**8", "elastic",
     '{"max_members":100000000,"partitioning_filters":null,"members":["m1"]}', "max_members",
     f"must be <= {MAX_MEMBERS}, got 100000000"),
    ("elastic duplicate members", "elastic",
     '{"max_members":2,"partitioning_filters":null,"members":["m1","m2","m1"]}', "members",
     "member 'm1' is listed more than once"),
    ("static max_members 10**30", "static", f'{{"max_members":{BIG},"members":["m1"]}}',
     "max_members", f"must be <= {MAX_MEMBERS}"),
    ("static max_members 10**8", "static", '{"max_members":100000000,"members":["m1"]}',
     "max_members", f"must be <= {MAX_MEMBERS}, got 100000000"),
    ("static duplicate members", "static", '{"max_members":2,"members":["m1","m1"]}', "members",
     "member 'm1' is listed more than once"),
]


async def _snapshot(js: JetStreamContext, s: str) -> dict[str, Any]:
    """Both buckets' last sequence (any write moves it) and this test's keys' revisions, the
    streams, and the consumers on s and its work-queue stream."""
    api = JetStreamAPI.from_js(js)
    out: dict[str, Any] = {}
    for bucket in (ELASTIC_BUCKET, STATIC_BUCKET):
        kv = await js.key_value(bucket)
        info = await api.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.{s}.>")
        out[bucket] = info["state"]["last_seq"]
        out[f"{bucket} keys"] = {
            k: (await kv.get(k.removeprefix(f"$KV.{bucket}."))).revision
            for k in info["state"].get("subjects") or {}}
    out["streams"] = sorted(si.config.name for si in await js.streams_info())
    out["consumers"] = {n: sorted(await api.list_consumer_names(n)) for n in (s, f"{s}-g")}
    return out


def _calls(js: JetStreamContext, s: str, kind: str
           ) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    def handler(msg: GroupMsg) -> None:
        raise AssertionError("no message may be delivered")

    if kind == "elastic":
        return [
            ("get_elastic (info)", lambda: admin.get_elastic(js, s, "g")),
            ("member_status (member-info)", lambda: admin.member_status(js, "elastic", s, "g")),
            ("active_members", lambda: admin.active_members(js, "elastic", s, "g")),
            ("add_members", lambda: admin.add_members(js, s, "g", ["m9"])),
            ("add_members sticky", lambda: admin.add_members(js, s, "g", ["m9"], sticky=True)),
            ("drop_members", lambda: admin.drop_members(js, s, "g", ["m1"])),
            ("set_member_mappings (create-mapping)", lambda: admin.set_member_mappings(
                js, s, "g", [MemberMapping("m1", (0, 1))])),
            ("delete_member_mappings", lambda: admin.delete_member_mappings(js, s, "g")),
            ("elastic_step_down", lambda: admin.elastic_step_down(js, s, "g", "m1")),
            ("create_elastic over it", lambda: admin.create_elastic(js, s, "g",
                                                                    ElasticConfig(2))),
            ("elastic_consume", lambda: elastic_consume(js, s, "g", "m1", handler)),
        ]
    return [
        ("get_static (info)", lambda: admin.get_static(js, s, "st")),
        ("member_status (member-info)", lambda: admin.member_status(js, "static", s, "st")),
        ("static_step_down", lambda: admin.static_step_down(js, s, "st", "m1")),
        ("create_static over it", lambda: admin.create_static(
            js, s, "st", StaticConfig(2, members=("m1",)))),
        ("static_consume", lambda: static_consume(js, s, "st", "m1", handler)),
    ]


@pytest.mark.parametrize(("kind", "stored", "field", "words"),
                         [c[1:] for c in BAD_STORED], ids=[c[0] for c in BAD_STORED])
async def test_bad_stored_config_is_refused_by_every_call_and_nothing_is_written(
        js: JetStreamContext, unique_name: str, kind: str, stored: str, field: str,
        words: str) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>", f"0.{s}.>", f"1.{s}.>"]))
    await admin.create_elastic(js, s, "g", ElasticConfig(2, members=("m1",)))
    await admin.create_static(js, s, "st", StaticConfig(2, members=("m1",)))
    bucket, key = (ELASTIC_BUCKET, f"{s}.g") if kind == "elastic" else (STATIC_BUCKET, f"{s}.st")
    kv = await js.key_value(bucket)
    rev = await kv.put(key, stored.encode())
    before = await _snapshot(js, s)
    for name, call in _calls(js, s, kind):
        with hang_guard(HANG_GUARD_S), pytest.raises(ConfigError) as ei:
            await asyncio.wait_for(call(), HANG_GUARD_S)
        e = ei.value
        assert type(e) is ConfigError and e.field == field, (name, e)
        assert words in e.rule and f"at revision {rev}" in e.rule, (name, str(e))
        assert "\n" not in str(e) and str(e).startswith(f"{field}: "), (name, str(e))
    assert await _snapshot(js, s) == before
    assert (await kv.get(key)).value == stored.encode()


async def test_out_of_bound_create_and_update_write_nothing(js: JetStreamContext,
                                                            unique_name: str) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    with pytest.raises(ConfigError, match=f"max_members: must be <= {MAX_MEMBERS}, got 4097"):
        await admin.create_elastic(js, s, "g", ElasticConfig(MAX_MEMBERS + 1))
    with pytest.raises(ConfigError, match="max_members: must be <= "):
        await admin.create_static(js, s, "st", StaticConfig(10**30, members=("a",)))
    with pytest.raises(ConfigError, match="members: member 'a' is listed more than once"):
        await admin.create_static(js, s, "st", StaticConfig(2, members=("a", "a")))
    api = JetStreamAPI.from_js(js)
    with pytest.raises(StreamNotFoundError):  # the work-queue stream was never created
        await api.stream_info(f"{s}-g")
    for bucket, key in ((ELASTIC_BUCKET, f"{s}.g"), (STATIC_BUCKET, f"{s}.st")):
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            continue  # no bucket: nothing was written
        with pytest.raises(KeyNotFoundError):  # the bucket holds no config for this group
            await kv.get(key)


async def test_max_members_bound_is_usable_by_a_lone_member(js: JetStreamContext,
                                                             unique_name: str) -> None:
    """At the bound, the group's first member owns every partition: its consumer has
    MAX_MEMBERS filters, which the server accepts within the API timeout, and it receives."""
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    cfg = ElasticConfig(MAX_MEMBERS, (PartitioningFilter(f"{s}.*", (1,)),), members=("solo",))
    await admin.create_elastic(js, s, "g", cfg)
    got: list[GroupMsg] = []

    async def handler(msg: GroupMsg) -> None:
        got.append(msg)
        await msg.ack()

    h = await elastic_consume(js, s, "g", "solo", handler, MemberConfig(ack_wait_s=2.0))
    try:
        ci = await JetStreamAPI.from_js(js, timeout=30).consumer_info(f"{s}-g", "solo")
        flt = ci["config"]["filter_subjects"]
        assert len(flt) == MAX_MEMBERS and flt[:2] == ["0." + s + ".*", "1." + s + ".*"]
        for k in ("a", "b", "c"):
            await js.publish(f"{s}.{k}", k.encode())
        await wait_for(lambda: len(got) == 3, 30, "3 messages at the lone member")
        assert sorted(m.subject for m in got) == [f"{s}.a", f"{s}.b", f"{s}.c"]
        assert all(0 <= m.partition < MAX_MEMBERS for m in got)
    finally:
        h.stop()
        await asyncio.wait_for(h.done(), 15)
    # A mapping covering every partition fits the KV value easily (about 25 KB).
    v = await admin.set_member_mappings(
        js, s, "g", [MemberMapping("solo", tuple(range(MAX_MEMBERS)))])
    assert len(v.config.to_json()) < 64 * 1024


async def test_a_bad_stored_config_can_still_be_deleted(js: JetStreamContext,
                                                        unique_name: str) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>", f"0.{s}.>", f"1.{s}.>"]))
    await admin.create_static(js, s, "st", StaticConfig(2, members=("m1",)))
    await admin.create_static(js, s, "other", StaticConfig(2, members=("m1",)))
    api = JetStreamAPI.from_js(js)
    for name in ("st-m1", "other-m1"):  # as members would create them
        await api.create_consumer(s, {"durable_name": name, "ack_policy": "explicit",
                                      "filter_subjects": [f"0.{s}.>"]})
    kv = await js.key_value(STATIC_BUCKET)
    await kv.put(f"{s}.st", f'{{"max_members":{BIG},"members":["m1","m1"]}}'.encode())
    with hang_guard(HANG_GUARD_S):
        assert await admin.delete_static(js, s, "st") == ["st-m1"]
    assert await api.list_consumer_names(s) == ["other-m1"]
    assert await admin.list_static(js, s) == ["other"]
    await admin.create_elastic(js, s, "g", ElasticConfig(2))
    ekv = await js.key_value(ELASTIC_BUCKET)
    await ekv.put(f"{s}.g", b'{"max_members":100000000,"members":["a","a"]}')
    with hang_guard(HANG_GUARD_S):
        assert await admin.delete_elastic(js, s, "g") is True
    assert await admin.list_elastic(js, s) == []


async def test_cli_reports_unknown_fields_and_keeps_them(js: JetStreamContext, nats_server,
                                                         unique_name: str) -> None:
    """``cg elastic info`` warns about fields the reference does not know (one stderr line,
    exit 0); ``cg elastic add`` keeps them in KV."""
    import json
    import subprocess
    import sys

    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    await admin.create_elastic(js, s, "g", ElasticConfig(2, members=("m1",)))
    kv = await js.key_value(ELASTIC_BUCKET)
    raw = (b'{"max_members":2,"partitioning_filters":null,"members":["m1"],'
           b'"max_memberz":5,"weight":{"m1":2}}')
    await kv.put(f"{s}.g", raw)
    cg = [sys.executable, "-m", "cg_pipelines.cli", "--server", nats_server.url]
    info = await asyncio.to_thread(subprocess.run, [*cg, "elastic", "info", s, "g"],
                                   capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    assert info.stderr.splitlines() == [
        f"cg: warning: elastic consumer group g on stream {s} (revision "
        f"{(await kv.get(f'{s}.g')).revision}) has fields unknown to pcgroups v0.2.1, kept as "
        "they are on rewrite: max_memberz, weight"]
    as_json = await asyncio.to_thread(subprocess.run, [*cg, "--json", "elastic", "info", s, "g"],
                                      capture_output=True, text=True, timeout=60)
    assert json.loads(as_json.stdout)["unknown_fields"] == ["max_memberz", "weight"]
    add = await asyncio.to_thread(subprocess.run, [*cg, "elastic", "add", s, "g", "m2"],
                                  capture_output=True, text=True, timeout=60)
    assert add.returncode == 0, add.stderr
    stored = json.loads((await kv.get(f"{s}.g")).value)
    assert stored["members"] == ["m1", "m2"]
    assert stored["max_memberz"] == 5 and stored["weight"] == {"m1": 2}
    assert stored["partitioning_filters"] is None
