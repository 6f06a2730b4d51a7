"""Co-partitioned sets on a real nats-server (issue 39): the set's sticky mappings written as
each group's Go-format config, the filters reference members compute from it, where the work
queues put a shared key, and a mismatched set refused with nothing written."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.assignment import generate_partition_filters
from cg_pipelines.core.config import ELASTIC_BUCKET, ElasticConfig, PartitioningFilter
from cg_pipelines.core.copartition import CoPartitionError, same_partition, set_key_tokens
from cg_pipelines.core.partitioning import SubjectPartitioner
from cg_pipelines.core.subjects import strip_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.members import GroupMsg, MemberConfig, elastic_consume
from tests.integration.test_cli import cg
from tests.integration.test_wire_reference import reference_filters
from tests.support.wait import wait_for

PF = PartitioningFilter
SEED_RANGE = {"A": [0, 1, 2], "B": [3, 4, 5], "C": [6, 7], "D": [8, 9]}
AFTER_D_LEFT = {"A": [0, 1, 2, 8], "B": [3, 4, 5], "C": [6, 7, 9]}


async def make_set(js: JetStreamContext, s: str, n_payments: int = 10) -> list[tuple[str, str]]:
    """Orders ``<s>o.<customer>.created`` and payments ``<s>p.<method>.<customer>``, each an
    elastic group ``join`` partitioned on the customer token (10 and ``n_payments``
    partitions, no members)."""
    orders, payments = f"{s}o", f"{s}p"
    for name in (orders, payments):
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name}.>"]))
    await admin.create_elastic(js, orders, "join",
                               ElasticConfig(10, (PF(f"{orders}.*.created", (1,)),)))
    await admin.create_elastic(js, payments, "join",
                               ElasticConfig(n_payments, (PF(f"{payments}.*.*", (2,)),)))
    return [(orders, "join"), (payments, "join")]


def go_json(filter_: str, wildcard: int, assign: dict[str, list[int]]) -> bytes:
    """The reference's JSON for an elastic group of 10 partitions, one filter, mappings."""
    maps = ",".join(f'{{"member":"{m}","partitions":[{",".join(map(str, ps))}]}}'
                    for m, ps in assign.items())
    return (f'{{"max_members":10,"partitioning_filters":[{{"filter":"{filter_}",'
            f'"partitioning_wildcards":[{wildcard}]}}],'
            f'"member_mappings":[{maps}]}}').encode()


async def test_the_set_is_written_as_go_json_and_reference_filters_agree(
        js: JetStreamContext, unique_name: str) -> None:
    groups = await make_set(js, unique_name)
    (orders, _), (payments, _) = groups
    first = await admin.set_set_mappings(js, groups, ["D", "C", "B", "A"])
    assert first.previous == {} and first.assignment == SEED_RANGE
    assert first.moved == {p: (None, m) for m, ps in SEED_RANGE.items() for p in ps}
    after = await admin.set_set_mappings(js, groups, ["A", "B", "C"])
    assert after.previous == SEED_RANGE and after.assignment == AFTER_D_LEFT
    assert after.moved == {8: ("D", "A"), 9: ("D", "C")}  # KIP-315's example
    kv = await js.key_value(ELASTIC_BUCKET)
    stored = {}
    filters = [(f"{orders}.*.created", 1), (f"{payments}.*.*", 2)]
    for (stream, group), (flt, wildcard) in zip(groups, filters, strict=True):
        entry = await kv.get(f"{stream}.{group}")
        assert entry.value == go_json(flt, wildcard, AFTER_D_LEFT), entry.value
        assert entry.revision == after.configs[(stream, group)].revision
        stored[stream] = ElasticConfig.from_json(entry.value or b"").validate()
    for member in "ABCD":
        want = [f"{p}.>" for p in AFTER_D_LEFT.get(member, [])]
        for cfg in stored.values():
            assert reference_filters(cfg, member) == want, (member, cfg)
            assert generate_partition_filters(cfg.members, cfg.max_members,
                                              cfg.member_mappings, member,
                                              cfg.consumer_filters()) == want
    # A member joining both groups gets a consumer on each work queue with those filters.
    handles = [await elastic_consume(js, s, g, "A", _ack, MemberConfig(ack_wait_s=1.0))
               for s, g in groups]
    try:
        api = JetStreamAPI.from_js(js)
        for s, g in groups:
            ci = await wait_for(lambda s=s, g=g: _consumer(api, f"{s}-{g}", "A"), 10,
                                f"member A's consumer on {s}-{g}")
            assert ci["config"]["filter_subjects"] == ["0.>", "1.>", "2.>", "8.>"]
    finally:
        for h in handles:
            h.stop()
        await asyncio.gather(*(asyncio.wait_for(h.done(), 10) for h in handles))


async def _ack(msg: GroupMsg) -> None:
    await msg.ack()


async def _consumer(api: JetStreamAPI, stream: str, name: str) -> dict | None:
    return next((c for c in await api.list_consumers(stream) if c["name"] == name), None)


async def test_a_shared_key_lands_in_the_same_partition_of_both_work_queues(
        js: JetStreamContext, unique_name: str) -> None:
    groups = await make_set(js, unique_name)
    (orders, _), (payments, _) = groups
    keys = [f"cust{i}" for i in range(20)]
    for key in keys:
        await js.publish(f"{orders}.{key}.created", b"{}")
        await js.publish(f"{payments}.card.{key}", b"{}")
    cfg = {s: (await admin.get_elastic(js, s, g)).config for s, g in groups}
    seen = {}
    for s, g in groups:
        wq = f"{s}-{g}"
        await wait_for(lambda wq=wq: _count(js, wq, len(keys)), 10, f"{wq} holding every key")
        for seq in range(1, len(keys) + 1):
            p, subject = strip_partition((await js.get_msg(wq, seq)).subject or "")
            key = set_key_tokens(subject, cfg[s])
            assert key is not None and p == SubjectPartitioner(cfg[s])(subject)
            seen[(s, key[0])] = p
    for key in keys:
        assert seen[(orders, key)] == seen[(payments, key)], key
        assert same_partition(f"{orders}.{key}.created", cfg[orders],
                              f"{payments}.card.{key}", cfg[payments])
    assert len({seen[(orders, k)] for k in keys}) > 5  # the keys spread over the partitions


async def _count(js: JetStreamContext, stream: str, n: int) -> bool:
    return (await js.stream_info(stream)).state.messages == n


async def test_a_mismatched_set_is_refused_and_nothing_is_written(
        nats_server, js: JetStreamContext, unique_name: str) -> None:
    groups = await make_set(js, unique_name, n_payments=8)
    (orders, _), (payments, _) = groups
    kv = await js.key_value(ELASTIC_BUCKET)
    before = [(await kv.get(f"{s}.{g}")).revision for s, g in groups]
    message = (f"max_members: {orders}/join has 10 partitions but {payments}/join has 8: "
               "every group of a co-partitioned set needs the same max_members")
    with pytest.raises(CoPartitionError) as raised:
        await admin.set_set_mappings(js, groups, ["A", "B"])
    assert str(raised.value) == message
    r = cg(nats_server.url, "elastic", "set-members", f"{orders}/join", f"{payments}/join",
           "--members", "A,B")
    assert r.returncode == 2 and r.stderr == f"cg: error: {message}\n", r.stderr
    assert [(await kv.get(f"{s}.{g}")).revision for s, g in groups] == before


async def test_cg_elastic_set_members_prints_the_moved_partitions(
        nats_server, js: JetStreamContext, unique_name: str) -> None:
    groups = await make_set(js, unique_name)
    names = [f"{s}/{g}" for s, g in groups]
    r = cg(nats_server.url, "elastic", "set-members", *names, "-m", "A,B", "-m", "C,D")
    assert r.returncode == 0, r.stderr
    r = cg(nats_server.url, "elastic", "set-members", *names, "--members", "A,B,C")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"co-partitioned set {', '.join(names)}: the member mappings of every "
                        "group\n  A: 0,1,2,8\n  B: 3,4,5\n  C: 6,7,9\n"
                        "moved: 8 D -> A; 9 D -> C\n")
    r = cg(nats_server.url, "--json", "elastic", "set-members", *names, "--members", "A,B,C")
    out = json.loads(r.stdout)
    assert out["moved"] == {} and out["assignment"] == out["previous"] == AFTER_D_LEFT
    r = cg(nats_server.url, "elastic", "set-members", names[0], "--members", "A")
    assert r.returncode == 2 and "needs at least 2 groups" in r.stderr, r.stderr
    r = cg(nats_server.url, "elastic", "set-members", "nogroup", names[0], "--members", "A")
    assert r.returncode == 2 and "'nogroup' must look like 'STREAM/GROUP'" in r.stderr
