"""Wire compatibility with the reference, synadia-io/orbit.go pcgroups v0.2.1 (issue 11), on a
real nats-server.

Reference facts used (read from the v0.2.1 tag):

- pcgroups/stream_consumer_group.go, ``GeneratePartitionFilters``: with member mappings (and no
  members) every partition of the member gives ``fmt.Sprintf("%d.>", pn)``: the ``filter``
  argument is ignored. ``ElasticGetPartitionFilters`` (elastic_stream_consumer_group.go) and
  ``joinMemberConsumerStatic`` (static_stream_consumer_group.go) call it once per filter, so
  with N filters the reference asks for every ``"<p>.>"`` N times; we ask once.
- elastic_stream_consumer_group.go, ``instanceRoutine``: a new config whose
  ``PartitioningFilters`` differ by ``reflect.DeepEqual`` (nil != ``[]int{}``) stops the member;
  ``AddMembers`` / ``DeleteMembers`` / ``SetMemberMappings`` rewrite the whole struct with
  ``json.Marshal``, so the reference itself keeps ``null`` and ``[]`` as read.
"""

from __future__ import annotations

import asyncio

import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.assignment import generate_partition_filters
from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    ElasticConfig,
    MemberMapping,
    PartitioningFilter,
    StaticConfig,
)
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI, consumer_config
from cg_pipelines.jetstream.errors import JetStreamError
from cg_pipelines.jetstream.members import GroupMsg, MemberConfig, elastic_consume, static_consume
from tests.support.wait import wait_for

MM = MemberMapping
PF = PartitioningFilter
FAST = MemberConfig(ack_wait_s=1.0)


def reference_filters(cfg: StaticConfig | ElasticConfig, member: str) -> list[str]:
    """What the reference computes, duplicates included (ElasticGetPartitionFilters /
    joinMemberConsumerStatic over GeneratePartitionFilters)."""
    flts = (list(cfg.filters) if isinstance(cfg, StaticConfig)
            else [p.filter for p in cfg.partitioning_filters]) or [">"]
    out: list[str] = []
    for f in flts:
        if cfg.members:
            out += generate_partition_filters(cfg.members, cfg.max_members, (), member, [f])
        else:
            for mm in cfg.member_mappings:
                if mm.member == member:
                    out += [f"{p}.>" for p in mm.partitions]
    return out


async def test_reference_duplicate_filters_are_refused_ours_are_not(
        js: JetStreamContext, unique_name: str) -> None:
    """Why we write each "<p>.>" once: the reference's duplicates overlap, and nats-server
    refuses overlapping consumer filters (10138)."""
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>", f"0.{s}.>", f"1.{s}.>"]))
    cfg = StaticConfig(2, (f"{s}.a.>", f"{s}.b.>"), member_mappings=(MM("x", (1, 0)),))
    ref = reference_filters(cfg, "x")
    assert ref == ["1.>", "0.>", "1.>", "0.>"]
    api = JetStreamAPI.from_js(js)
    with pytest.raises(JetStreamError) as ei:
        await api.create_consumer(s, consumer_config(durable_name="ref", filter_subjects=ref))
    assert ei.value.err_code == 10138, ei.value
    ours = generate_partition_filters((), 2, cfg.member_mappings, "x", cfg.filters)
    assert ours == ["1.>", "0.>"]
    await api.create_consumer(s, consumer_config(durable_name="ours", filter_subjects=ours))


async def test_mapped_static_member_filters_are_partition_wildcards(
        js: JetStreamContext, unique_name: str) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"0.{s}.>", f"1.{s}.>"]))
    cfg = StaticConfig(2, (f"{s}.a.>", f"{s}.b.>"),
                       member_mappings=(MM("x", (1,)), MM("y", (0,))))
    await admin.create_static(js, s, "g", cfg)
    got: list[GroupMsg] = []

    async def handler(msg: GroupMsg) -> None:
        got.append(msg)
        await msg.ack()

    h = await static_consume(js, s, "g", "x", handler, FAST)
    try:
        ci = await JetStreamAPI.from_js(js).consumer_info(s, "g-x")
        assert ci["config"]["filter_subjects"] == ["1.>"]
        # As the reference: the filters are not applied to a mapped member's partitions.
        for subject in (f"1.{s}.a.k", f"1.{s}.c.k", f"0.{s}.a.k"):
            await js.publish(subject, b"{}")
        await wait_for(lambda: len(got) == 2, 10, "partition 1's two messages")
        await asyncio.sleep(0.2)  # time for a third (wrong) delivery to show up: none may
        assert sorted(m.subject for m in got) == [f"{s}.a.k", f"{s}.c.k"]
    finally:
        h.stop()
        await asyncio.wait_for(h.done(), 10)


async def test_mapped_elastic_member_filters_are_partition_wildcards(
        js: JetStreamContext, unique_name: str) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    cfg = ElasticConfig(4, (PF(f"{s}.a.*", (1,)), PF(f"{s}.b.*", (1,))),
                        member_mappings=(MM("x", (3, 0)), MM("y", (1, 2))))
    await admin.create_elastic(js, s, "g", cfg)
    got: list[GroupMsg] = []

    async def handler(msg: GroupMsg) -> None:
        got.append(msg)
        await msg.ack()

    hs = [await elastic_consume(js, s, "g", m, handler, FAST) for m in ("x", "y")]
    try:
        api = JetStreamAPI.from_js(js)
        for m, want in (("x", ["3.>", "0.>"]), ("y", ["1.>", "2.>"])):
            await wait_for(lambda m=m: _has_consumer(api, f"{s}-g", m), 10, f"consumer {m}")
            ci = await api.consumer_info(f"{s}-g", m)
            assert ci["config"]["filter_subjects"] == want
        keys = [f"k{i}" for i in range(20)]
        for k in keys:
            await js.publish(f"{s}.a.{k}", b"{}")
            await js.publish(f"{s}.b.{k}", b"{}")
        await wait_for(lambda: len(got) == 40, 15, "every message of both filters")
    finally:
        for h in hs:
            h.stop()
        await asyncio.gather(*(asyncio.wait_for(h.done(), 10) for h in hs))


async def _has_consumer(api: JetStreamAPI, stream: str, name: str) -> bool:
    return name in await api.list_consumer_names(stream)


# Stored as the reference writes them (see tests/unit/test_config.py for the byte tables).
GO_NULL_WC = ('{{"max_members":4,"partitioning_filters":[{{"filter":"{s}.\\u003e",'
              '"partitioning_wildcards":null}}],"members":["m2","m1"]}}')
GO_EMPTY_WC = GO_NULL_WC.replace("null", "[]")


@pytest.mark.parametrize("stored", [GO_NULL_WC, GO_EMPTY_WC], ids=["null", "empty"])
async def test_admin_updates_keep_what_they_do_not_change(
        js: JetStreamContext, unique_name: str, stored: str) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    await admin.create_elastic(js, s, "g", ElasticConfig(4, (PF(f"{s}.>"),)))
    kv = await js.key_value(ELASTIC_BUCKET)
    # With a field of a newer reference version at the end (kept in place, reported).
    data = stored.format(s=s)[:-1] + ',"future_field":{"a":[1,null]}}'
    rev = await kv.put(f"{s}.g", data.encode())
    v = await admin.get_elastic(js, s, "g")
    assert v.config.unknown_fields == {"future_field": {"a": [1, None]}}
    assert v.config.to_json() == data.encode()
    wc = "null" if "null}" in stored else "[]"
    head = (f'{{"max_members":4,"partitioning_filters":[{{"filter":"{s}.\\u003e",'
            f'"partitioning_wildcards":{wc}}}]')
    tail = ',"future_field":{"a":[1,null]}}'
    # Adding a member already there only reorders: nothing is written (a reference member
    # would otherwise rebuild its consumer for nothing).
    assert (await admin.add_members(js, s, "g", ["m1"])).revision == rev
    await admin.add_members(js, s, "g", ["m3"])
    assert (await kv.get(f"{s}.g")).value == (head + ',"members":["m1","m2","m3"]' + tail
                                              ).encode()
    await admin.drop_members(js, s, "g", ["m1", "m2", "m3"])
    assert (await kv.get(f"{s}.g")).value == (head + tail).encode()
    await admin.set_member_mappings(js, s, "g", [MM("b", (2, 3)), MM("a", (0, 1))])
    assert (await kv.get(f"{s}.g")).value == (
        head + ',"member_mappings":[{"member":"a","partitions":[0,1]},'
               '{"member":"b","partitions":[2,3]}]' + tail).encode()
    await admin.delete_member_mappings(js, s, "g")
    assert (await kv.get(f"{s}.g")).value == (head + tail).encode()
    # The idempotent create over it (same shape: null and [] are the same filter) writes nothing.
    before = (await kv.get(f"{s}.g")).revision
    await admin.create_elastic(js, s, "g", ElasticConfig(4, (PF(f"{s}.>"),)))
    assert (await kv.get(f"{s}.g")).revision == before
