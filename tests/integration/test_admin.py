"""Admin calls against a real nats-server: every call, every validation rule, CAS, fixes."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import StreamConfig

from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    STATIC_BUCKET,
    ElasticConfig,
    MemberMapping,
    PartitioningFilter,
    StaticConfig,
)
from cg_pipelines.core.errors import (
    ConfigError,
    GroupExistsError,
    GroupNotFoundError,
    MembershipError,
)
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI, consumer_config
from cg_pipelines.jetstream.errors import StreamNotFoundError
from cg_pipelines.jetstream.kv import ConfigStore

MM = MemberMapping
PF = PartitioningFilter


async def _stream(js, name: str) -> str:
    await js.add_stream(StreamConfig(name=name, subjects=[f"{name}.>"]))
    return name


async def _kv_value(js, bucket: str, key: str) -> bytes | None:
    kv = await js.key_value(bucket)
    try:
        return (await kv.get(key)).value
    except Exception:
        return None


async def test_elastic_lifecycle(js, unique_name) -> None:
    stream = await _stream(js, unique_name)
    cfg = ElasticConfig(4, (PF(f"{stream}.*.*", (2,)),))
    v = await admin.create_elastic(js, stream, "g", cfg)
    assert v.config == cfg
    # KV holds the reference JSON, byte for byte.
    assert await _kv_value(js, ELASTIC_BUCKET, f"{stream}.g") == cfg.to_json()
    # The work-queue stream exists with the partition transform.
    wq = (await JetStreamAPI.from_js(js).stream_info(f"{stream}-g"))["config"]
    assert wq["retention"] == "workqueue" and not wq.get("subjects")
    assert wq["sources"][0]["name"] == stream
    assert wq["sources"][0]["subject_transforms"] == [{
        "src": f"{stream}.*.*",
        "dest": f"{{{{Partition(4,2)}}}}.{stream}.{{{{Wildcard(1)}}}}.{{{{Wildcard(2)}}}}"}]
    assert wq["allow_direct"] and wq["discard"] == "new"
    # Idempotent create; a different shape is refused.
    assert (await admin.create_elastic(js, stream, "g", cfg)).revision == v.revision
    with pytest.raises(GroupExistsError):
        await admin.create_elastic(js, stream, "g", ElasticConfig(5, cfg.partitioning_filters))
    assert await admin.list_elastic(js, stream) == ["g"]

    v = await admin.add_members(js, stream, "g", ["m3", "m1", "m1"])
    assert v.config.members == ("m1", "m3")
    v2 = await admin.add_members(js, stream, "g", ["m2"])
    assert v2.config.members == ("m1", "m2", "m3") and v2.revision > v.revision
    # Adding an existing member writes nothing (no spurious revision for watchers).
    assert (await admin.add_members(js, stream, "g", ["m2"])).revision == v2.revision
    v3 = await admin.drop_members(js, stream, "g", ["m3", "nobody"])
    assert v3.config.members == ("m1", "m2")
    assert (await admin.get_elastic(js, stream, "g")).config == v3.config

    v4 = await admin.set_member_mappings(js, stream, "g", [MM("b", (2, 3)), MM("a", (0, 1))])
    assert [m.member for m in v4.config.member_mappings] == ["a", "b"]
    assert v4.config.members == ()
    with pytest.raises(MembershipError):
        await admin.add_members(js, stream, "g", ["c"])
    v5 = await admin.delete_member_mappings(js, stream, "g")
    assert v5.config.member_mappings == () and v5.config.members == ()

    assert await admin.delete_elastic(js, stream, "g")
    with pytest.raises(StreamNotFoundError):
        await JetStreamAPI.from_js(js).stream_info(f"{stream}-g")
    with pytest.raises(GroupNotFoundError):
        await admin.get_elastic(js, stream, "g")
    assert not await admin.delete_elastic(js, stream, "g")


async def test_sticky_membership_is_written_as_mappings(js, unique_name) -> None:
    stream = await _stream(js, unique_name)
    await admin.create_elastic(js, stream, "g", ElasticConfig(6, members=("a", "b")))
    v = await admin.add_members(js, stream, "g", ["c"], sticky=True)
    got = {m.member: m.partitions for m in v.config.member_mappings}
    # a had 0,1,2 and b 3,4,5: each keeps two, c gets one released by each.
    assert got == {"a": (0, 1), "b": (3, 4), "c": (2, 5)}
    v = await admin.drop_members(js, stream, "g", ["a"], sticky=True)
    got = {m.member: m.partitions for m in v.config.member_mappings}
    assert got == {"b": (0, 3, 4), "c": (1, 2, 5)}  # survivors keep theirs; a's are shared


INVALID = [  # (config, the field it breaks, words of the rule it breaks, as the reference)
    (ElasticConfig(0), "max_members", ">= 1"),
    (ElasticConfig(2, members=("a",), member_mappings=(MM("a", (0, 1)),)), "members",
     "not both"),
    (ElasticConfig(2, member_mappings=(MM("a", (0,)),)), "member_mappings", "missing [1]"),
    (ElasticConfig(2, member_mappings=(MM("a", (0, 0)), MM("b", (1,)))), "member_mappings",
     "partition 0 is mapped more than once"),
    (ElasticConfig(2, member_mappings=(MM("a", (0,)), MM("a", (1,)))), "member_mappings",
     "member 'a' is mapped twice"),
    (ElasticConfig(2, member_mappings=(MM("a", (0, 5)), MM("b", (1,)))), "member_mappings",
     "partition 5 of 'a' is outside [0, 2)"),
    (ElasticConfig(2, (PF(""),)), "partitioning_filters", "must not be empty"),
    (ElasticConfig(2, (PF("foo.bar"),)), "partitioning_filters", "or end with '>'"),
    (ElasticConfig(2, (PF("foo.*", (1, 2)),)), "partitioning_filters",
     "1 '*' wildcards but 2 partitioning wildcards"),
    (ElasticConfig(2, (PF("foo.*.*", (1, 1)),)), "partitioning_filters", "must be unique"),
    (ElasticConfig(2, (PF("foo.*", (2,)),)), "partitioning_filters",
     "index 2 of 'foo.*' must be between 1 and 1"),
    (ElasticConfig(2, members=("bad.name",)), "members", "must not contain '.'"),
]


@pytest.mark.parametrize(("cfg", "field", "rule"), INVALID)
async def test_invalid_elastic_create_writes_nothing(js, unique_name, cfg, field, rule) -> None:
    stream = await _stream(js, unique_name)
    with pytest.raises(ConfigError) as ei:
        await admin.create_elastic(js, stream, "g", cfg)
    assert ei.value.field == field and rule in ei.value.rule, (ei.value.field, ei.value.rule)
    assert await admin.list_elastic(js, stream) == []
    with pytest.raises(StreamNotFoundError):
        await JetStreamAPI.from_js(js).stream_info(f"{stream}-g")


async def test_invalid_updates_leave_kv_unchanged(js, unique_name) -> None:
    stream = await _stream(js, unique_name)
    await admin.create_elastic(js, stream, "g", ElasticConfig(3, members=("a",)))
    before = await _kv_value(js, ELASTIC_BUCKET, f"{stream}.g")
    bad_calls = [
        admin.set_member_mappings(js, stream, "g", [MM("a", (0, 1))]),  # misses 2
        admin.set_member_mappings(js, stream, "g", [MM("a", (0, 1, 2)), MM("a", ())]),
        admin.set_member_mappings(js, stream, "g", [MM("a", (0, 1, 2, 3))]),
        admin.add_members(js, stream, "g", ["has space"]),
        admin.add_members(js, stream, "g", []),
    ]
    for call in bad_calls:
        with pytest.raises(ConfigError):
            await call
    assert await _kv_value(js, ELASTIC_BUCKET, f"{stream}.g") == before
    for call in (admin.add_members(js, stream, "nope", ["x"]),
                 admin.get_elastic(js, stream, "nope")):
        with pytest.raises(GroupNotFoundError):
            await call
    with pytest.raises(StreamNotFoundError):
        await admin.create_elastic(js, f"{stream}x", "g", ElasticConfig(2))


async def test_concurrent_membership_updates_are_compare_and_set(js, unique_name) -> None:
    stream = await _stream(js, unique_name)
    await admin.create_elastic(js, stream, "g", ElasticConfig(16))
    names = [f"m{i:02d}" for i in range(12)]
    await asyncio.gather(*(admin.add_members(js, stream, "g", [n]) for n in names))
    # The reference's non-CAS writes lose members here; ours keeps every one.
    assert (await admin.get_elastic(js, stream, "g")).config.members == tuple(names)


async def test_corrupt_kv_value_is_reported_with_reason(js, unique_name) -> None:
    stream = await _stream(js, unique_name)
    await admin.create_elastic(js, stream, "g", ElasticConfig(2))
    kv = await js.key_value(ELASTIC_BUCKET)
    await kv.put(f"{stream}.g", b'{"max_members":2,"member_mappings":[{"member":"a",'
                                b'"partitions":[0]}]}')
    with pytest.raises(ConfigError, match="missing \\[1\\].*revision"):
        await admin.get_elastic(js, stream, "g")
    await kv.put(f"{stream}.g", b"{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        await ConfigStore(js, "elastic").get(stream, "g")


async def test_static_lifecycle_and_scoped_delete(js, unique_name) -> None:
    stream = await _stream(js, unique_name)
    cfg = StaticConfig(4, (f"{stream}.>",), ("m1", "m2"))
    v = await admin.create_static(js, stream, "g", cfg)
    assert await _kv_value(js, STATIC_BUCKET, f"{stream}.g") == cfg.to_json()
    assert (await admin.create_static(js, stream, "g", cfg)).revision == v.revision
    with pytest.raises(GroupExistsError):
        await admin.create_static(js, stream, "g", StaticConfig(4, (), ("m1",)))
    await admin.create_static(js, stream, "g-x", StaticConfig(1, (), ("m1",)))
    assert await admin.list_static(js, stream) == ["g", "g-x"]

    api = JetStreamAPI.from_js(js)
    # Member consumers of both groups, plus a user consumer sharing the "g-" prefix.
    for name in ("g-m1", "g-m2", "g-x-m1", "g-keep"):
        await api.create_consumer(stream, consumer_config(
            durable_name=name, filter_subjects=[f"0.{name}.>"], ack_wait_s=5.0))
    deleted = await admin.delete_static(js, stream, "g")
    assert deleted == ["g-m1", "g-m2"]
    left = set(await api.list_consumer_names(stream))
    assert {"g-x-m1", "g-keep"} <= left and not {"g-m1", "g-m2"} & left
    assert await admin.list_static(js, stream) == ["g-x"]
    with pytest.raises(ConfigError):
        await admin.create_static(js, stream, "h", StaticConfig(2, (), ("a",), (MM("a", (0, 1)),)))


async def test_member_status_and_step_down(js, nc, unique_name) -> None:
    stream = await _stream(js, unique_name)
    await admin.create_elastic(js, stream, "g", ElasticConfig(2, members=("m1", "m2")))
    wq = f"{stream}-g"
    api = JetStreamAPI.from_js(js)
    # Only m1 joins: create its consumer as a member would and pull (pinning this client).
    await api.create_consumer(wq, consumer_config(
        name="m1", filter_subjects=["0.>"], ack_wait_s=5.0, max_ack_pending=1,
        inactive_threshold_s=5.0, priority_groups=["PCG"], priority_policy="pinned_client",
        priority_timeout_s=5.0))
    for key in range(200):  # plenty of keys land in partition 0
        await js.publish(f"{stream}.k{key}", b"x")
    got = None
    for _ in range(20):
        got = await api.pull(wq, "m1", batch=1, expires_s=1.0)
        if got.messages:
            break
    assert got is not None and got.messages and got.pin_id
    status = {s.member: s for s in await admin.member_status(js, "elastic", stream, "g")}
    assert status["m1"].active and status["m1"].pinned_id == got.pin_id
    # The reference says m2 is active because *some* member consumer exists; it is not.
    assert status["m2"].in_membership and not status["m2"].consumer_exists
    assert not status["m2"].active
    assert await admin.active_members(js, "elastic", stream, "g") == ["m1"]
    # Step down: the pin is released.
    await admin.elastic_step_down(js, stream, "g", "m1")
    ci = await api.consumer_info(wq, "m1")
    pins = [pg.get("pinned_client_id") for pg in ci.get("priority_groups") or []]
    assert got.pin_id not in pins
