"""Group configs written into KV by another tool, as streaming members see them (issue 6).

"Another tool" is a raw ``kv.put(key, bytes)`` into ``elastic-consumer-groups`` /
``static-consumer-groups`` at ``<stream>.<group>``, bypassing every check of this library.

- invalid (not JSON, wrong shapes, broken rules such as mappings missing a partition): the
  member keeps consuming with the last valid config, logs a warning naming the revision and
  the reason, exposes it (``config_error``, ``config_revision``), and applies the next valid
  revision;
- an elastic group's ``max_members`` / ``partitioning_filters`` / buffer limits changed: the
  member stops with a ``ConfigError`` saying what changed from what to what, and that the group
  must be deleted and created again;
- a static group's config changed: the member stops with a ``MembershipError`` (and its
  consumer is deleted) — covered in test_members.py; an identical rewrite is no change.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.assignment import generate_partition_filters
from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    STATIC_BUCKET,
    ElasticConfig,
    PartitioningFilter,
    StaticConfig,
    config_key,
)
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.members import (
    GroupMsg,
    MemberConfig,
    elastic_consume,
    static_consume,
)
from tests.support.wait import still_running, wait_for

N = 4
FAST = MemberConfig(ack_wait_s=1.0)


class Received:
    """Keys delivered to a member (acked)."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    async def handle(self, msg: GroupMsg) -> None:
        self.keys.append(json.loads(msg.data)["key"])
        await msg.ack()


def _pf(stream: str) -> tuple[PartitioningFilter, ...]:
    return (PartitioningFilter(f"{stream}.*", (1,)),)


def _elastic_json(stream: str, **fields: Any) -> bytes:
    """Elastic config JSON as another tool might write it (no validation)."""
    d: dict[str, Any] = {"max_members": N, "partitioning_filters": [
        {"filter": f"{stream}.*", "partitioning_wildcards": [1]}], **fields}
    return json.dumps(d).encode()


# (case id, bytes written given the stream, words the reason must contain)
INVALID: list[tuple[str, Callable[[str], bytes], str]] = [
    ("not-json", lambda s: b"{oops", "config: not valid JSON"),
    ("empty-value", lambda s: b"", "config: not valid JSON"),
    ("not-an-object", lambda s: b"[1, 2]", "config: must be a JSON object"),
    ("max-members-string", lambda s: _elastic_json(s, max_members="4"),
     "max_members: must be an integer"),
    ("max-members-zero", lambda s: _elastic_json(s, max_members=0),
     "max_members: must be >= 1, got 0"),
    ("mapping-misses-a-partition", lambda s: _elastic_json(s, member_mappings=[
        {"member": "m1", "partitions": [0, 1, 2]}]),
     "member_mappings: every partition in [0, 4) must be mapped; missing [3]"),
    ("members-and-mappings", lambda s: _elastic_json(s, members=["m1"], member_mappings=[
        {"member": "m1", "partitions": [0, 1, 2, 3]}]), "either members or member_mappings"),
    ("bad-filter", lambda s: _elastic_json(s, partitioning_filters=[
        {"filter": f"{s}.x", "partitioning_wildcards": []}]), "must have at least one '*'"),
]


async def _publish(js: JetStreamContext, subject_of: Callable[[str], str], keys: list[str]
                   ) -> None:
    for k in keys:
        await js.publish(subject_of(k), json.dumps({"key": k}).encode())


async def test_elastic_member_keeps_last_valid_config_and_applies_the_next(
        js: JetStreamContext, unique_name: str, caplog: pytest.LogCaptureFixture) -> None:
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    v = await admin.create_elastic(js, stream, "g", ElasticConfig(N, _pf(stream),
                                                                  members=("m1",)))
    kv = await js.key_value(ELASTIC_BUCKET)
    got = Received()
    h = await elastic_consume(js, stream, "g", "m1", got.handle, FAST)
    caplog.set_level(logging.WARNING, logger="cg_pipelines.jetstream.members")
    try:
        await wait_for(lambda: h.joined, 10, "m1 joined")
        assert h.config_revision == v.revision and h.config_error is None
        sent: list[str] = []
        for i, (case, make, words) in enumerate(INVALID):
            rev = await kv.put(config_key(stream, "g"), make(stream))
            err = await wait_for(lambda rev=rev: h.config_error is not None and
                                 f"revision {rev} ignored" in str(h.config_error)
                                 and h.config_error, 5, f"{case} rejected")
            assert isinstance(err, ConfigError)
            assert words in str(err), (case, str(err))
            assert f"still applying revision {v.revision}" in str(err), (case, str(err))
            assert h.config_revision == v.revision
            assert await still_running(h), case
            # The warning names the revision and the reason.
            assert any(f"revision {rev} ignored" in r.getMessage() and words in r.getMessage()
                       for r in caplog.records), (case, [r.getMessage() for r in caplog.records])
            # ... and messages still flow with the last valid config (every partition to m1).
            keys = [f"{case}-{j}" for j in range(3)]
            await _publish(js, lambda k: f"{stream}.{k}", keys)
            sent.extend(keys)
            await wait_for(lambda: set(sent) <= set(got.keys), 10, f"messages after {case}")
            assert i + 1 == len({k.rsplit("-", 1)[0] for k in got.keys})
        # The next valid revision is applied: m2 joins the membership, m1 keeps 0 and 1.
        good = ElasticConfig(N, _pf(stream), members=("m1", "m2"))
        rev = await kv.put(config_key(stream, "g"), good.to_json())
        await wait_for(lambda: h.config_revision == rev, 5, "valid revision applied")
        assert h.config_error is None
        want = generate_partition_filters(good.members, N, (), "m1", good.consumer_filters())
        api = JetStreamAPI.from_js(js)

        async def m1_filters() -> bool:
            info = await api.consumer_info(f"{stream}-g", "m1")
            return sorted(info["config"].get("filter_subjects") or []) == sorted(want)

        await wait_for(m1_filters, 10, "m1's consumer re-created for partitions 0 and 1")
        assert await still_running(h)
    finally:
        h.stop()
        assert await asyncio.wait_for(h.done(), 10) is None


SHAPE_CHANGES: list[tuple[str, Callable[[str], ElasticConfig], str]] = [
    ("max-members", lambda s: ElasticConfig(3, _pf(s), members=("m1",)),
     "max_members: changed from 4 to 3 at revision"),
    ("partitioning-filters", lambda s: ElasticConfig(
        N, (PartitioningFilter(f"{s}.*.*", (2,)),), members=("m1",)),
     'partitioning_filters: changed from [{"filter":"{s}.*","partitioning_wildcards":[1]}] '
     'to [{"filter":"{s}.*.*","partitioning_wildcards":[2]}] at revision'),
    ("buffer-limit", lambda s: ElasticConfig(N, _pf(s), max_buffered_msgs=100,
                                             members=("m1",)),
     "max_buffered_msg: changed from 0 to 100 at revision"),
]


@pytest.mark.parametrize(("case", "make", "words"), SHAPE_CHANGES,
                         ids=[c[0] for c in SHAPE_CHANGES])
async def test_elastic_shape_change_stops_the_member_with_the_reason(
        js: JetStreamContext, unique_name: str, case: str,
        make: Callable[[str], ElasticConfig], words: str) -> None:
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(N, _pf(stream), members=("m1",)))
    h = await elastic_consume(js, stream, "g", "m1", Received().handle, FAST)
    try:
        await wait_for(lambda: h.joined, 10, "m1 joined")
        kv = await js.key_value(ELASTIC_BUCKET)
        rev = await kv.put(config_key(stream, "g"), make(stream).to_json())
        err = await asyncio.wait_for(h.done(), 10)
        assert isinstance(err, ConfigError), err
        text = str(err)
        assert words.replace("{s}", stream) in text, text
        assert f"at revision {rev} of elastic consumer group {stream}.g" in text, text
        assert "delete the group and create it again" in text, text
    finally:
        h.stop()


async def test_static_member_keeps_last_valid_config(js: JetStreamContext,
                                                     unique_name: str) -> None:
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{p}.{stream}.>"
                                                            for p in range(N)]))
    cfg = StaticConfig(N, members=("m1",))
    v = await admin.create_static(js, stream, "g", cfg)
    kv = await js.key_value(STATIC_BUCKET)
    got = Received()
    h = await static_consume(js, stream, "g", "m1", got.handle, FAST)
    try:
        await wait_for(lambda: h.joined, 10, "m1 joined")
        bad = [(b"{oops", "not valid JSON"),
               (json.dumps({"max_members": N, "member_mappings": [
                   {"member": "m1", "partitions": [0, 1]}]}).encode(), "missing [2, 3]")]
        for data, words in bad:
            rev = await kv.put(config_key(stream, "g"), data)
            err = await wait_for(lambda rev=rev: h.config_error is not None and
                                 f"revision {rev} ignored" in str(h.config_error)
                                 and h.config_error, 5, f"revision {rev} rejected")
            assert words in str(err) and f"static config {stream}.g" in str(err), str(err)
            assert h.config_revision == v.revision and await still_running(h)
        await _publish(js, lambda k: f"{int(k[1:]) % N}.{stream}.{k}", ["k0", "k1", "k2", "k3"])
        await wait_for(lambda: sorted(got.keys) == ["k0", "k1", "k2", "k3"], 10, "messages")
        # The same valid config written again is no change: applied, error cleared.
        rev = await kv.put(config_key(stream, "g"), cfg.to_json())
        await wait_for(lambda: h.config_revision == rev, 5, "valid revision applied")
        assert h.config_error is None and await still_running(h)
    finally:
        h.stop()
        assert await asyncio.wait_for(h.done(), 10) is None
