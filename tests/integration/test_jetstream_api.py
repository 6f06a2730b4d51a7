"""The raw JetStream API (cg_pipelines.jetstream.api) against a real nats-server.

Wire facts these tests pin down (nats-server 2.15.1): action ``create`` is idempotent for an
identical config and answers err_code 10148 otherwise; a pinned priority group serves only the
pinned client, reports it in consumer info, and answers 423 to a stale pin id; batched direct get
ends with status 204; purge with filter+seq removes only that filter's messages below seq, and on
a work-queue stream the lease consumer's ack floor moves past the purged range (DESIGN §5).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js.api import StreamConfig

from cg_pipelines.jetstream.api import JetStreamAPI, consumer_config
from cg_pipelines.jetstream.errors import (
    ConsumerAlreadyExistsError,
    ConsumerNotFoundError,
    JetStreamError,
    JetStreamUnavailableError,
    NotPinnedError,
    RequestTimeoutError,
    StreamNotFoundError,
    WorkQueueConsumerNotUniqueError,
)
from cg_pipelines.local.nats_server import NatsServer
from tests.support.wait import SentRequests, pulls_waiting

PCG = "PCG"


@pytest_asyncio.fixture(loop_scope="session")
async def api(nc: Client) -> AsyncIterator[JetStreamAPI]:
    async with JetStreamAPI(nc, timeout=5.0) as a:
        yield a


@pytest_asyncio.fixture(loop_scope="session")
async def nc2(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A second connection: the other instance of a member."""
    conn = await nats.connect(nats_server.url, connect_timeout=5, max_reconnect_attempts=2)
    try:
        yield conn
    finally:
        await conn.close()


def pinned_config(name: str, filters: list[str], **kw: object) -> dict:
    opts: dict = dict(
        ack_wait_s=30.0,
        max_ack_pending=1,
        priority_groups=[PCG],
        priority_policy="pinned_client",
        priority_timeout_s=5.0,
    )
    opts.update(kw)
    return consumer_config(name, durable_name=name, filter_subjects=filters, **opts)


# ------------------------------------------------------------------------------- consumers


async def test_create_consumer_action_create(js, api, unique_name) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    cfg = pinned_config("m1", [f"{s}.a", f"{s}.b"])
    info = await api.create_consumer(s, cfg)
    assert info["name"] == "m1" and info["stream_name"] == s
    c = info["config"]
    assert c["filter_subjects"] == [f"{s}.a", f"{s}.b"]
    assert c["ack_wait"] == 30_000_000_000 and c["priority_timeout"] == 5_000_000_000
    assert c["priority_groups"] == [PCG] and c["priority_policy"] == "pinned_client"
    # Same config again with action create: fine (every instance of a member does this).
    again = await api.create_consumer(s, cfg)
    assert again["created"] == info["created"]
    # A different config: 10148.
    with pytest.raises(ConsumerAlreadyExistsError) as ei:
        await api.create_consumer(s, pinned_config("m1", [f"{s}.a", f"{s}.b"], max_ack_pending=2))
    e = ei.value
    assert (e.status, e.err_code) == (400, 10148)
    assert str(e) == f"{e.description} (status 400, err_code 10148)"
    # Update of a missing consumer: 10149.
    with pytest.raises(ConsumerNotFoundError) as ei2:
        await api.create_consumer(s, pinned_config("nope", [f"{s}.c"]), action="update")
    assert ei2.value.err_code == 10149
    # One filter is still sent (and kept) as filter_subjects.
    one = await api.create_consumer(s, consumer_config("one", filter_subjects=[f"{s}.a"]))
    assert one["config"]["filter_subjects"] == [f"{s}.a"]
    assert "filter_subject" not in one["config"]
    # Listing (paged) and deleting.
    assert sorted(await api.list_consumer_names(s)) == ["m1", "one"]
    assert sorted(i["name"] for i in await api.list_consumers(s)) == ["m1", "one"]
    assert await api.delete_consumer(s, "one") is True
    with pytest.raises(ConsumerNotFoundError) as ei3:
        await api.consumer_info(s, "one")
    assert (ei3.value.status, ei3.value.err_code) == (404, 10014)
    with pytest.raises(ValueError):
        await api.create_consumer(s, cfg, action="upsert")


async def test_consumer_info_lists_page_past_the_server_limit(js, api, unique_name) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    names = [f"c{i:03d}" for i in range(260)]  # NAMES pages at 1024, LIST at 256
    await asyncio.gather(
        *[api.create_consumer(s, consumer_config(n, filter_subjects=[f"{s}.{n}"])) for n in names]
    )
    assert sorted(i["name"] for i in await api.list_consumers(s)) == names
    assert sorted(await api.list_consumer_names(s)) == names


# ------------------------------------------------------------------------------- pinned pulls


async def test_pinned_group_unpin_and_423(js, api, nc2, unique_name) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    for i in range(10):
        await js.publish(f"{s}.k", str(i).encode())
    await api.create_consumer(s, pinned_config("m1", [f"{s}.>"]))
    a, b = api, JetStreamAPI(nc2)
    try:
        info = await a.consumer_info(s, "m1")
        assert info["priority_groups"][0]["group"] == PCG
        assert "pinned_client_id" not in info["priority_groups"][0]

        # A pulls without an id and becomes the pinned client.
        ra = await a.pull(s, "m1", batch=1, expires_s=1.0)
        assert [m.data for m in ra.messages] == [b"0"] and ra.status is None
        pin_a = ra.pin_id
        assert pin_a and ra.messages[0].headers["Nats-Pin-Id"] == pin_a
        assert ra.messages[0].metadata.sequence.stream == 1
        await ra.messages[0].ack()
        pg = (await a.consumer_info(s, "m1"))["priority_groups"][0]
        assert pg["group"] == PCG and pg["pinned_client_id"] == pin_a
        assert pg["pinned_ts"].startswith("20")  # RFC 3339, set when pinned

        # B (no id) waits while A holds the pin and gets nothing; with a made-up id: 423 at once.
        rb = await b.pull(s, "m1", batch=1, expires_s=0.5)
        assert rb.messages == [] and rb.status == 408 and rb.error is None
        rb = await b.pull(s, "m1", batch=1, expires_s=2.0, pin_id="not-the-pin")
        assert rb.status == 423 and rb.pin_id is None and rb.pin_lost
        assert isinstance(rb.error, NotPinnedError)
        with pytest.raises(NotPinnedError):
            rb.raise_for_status()

        # A keeps getting messages with its pin.
        ra = await a.pull(s, "m1", batch=1, expires_s=1.0, pin_id=pin_a)
        assert [m.data for m in ra.messages] == [b"1"] and ra.pin_id == pin_a
        await ra.messages[0].ack()

        # B waits (no id); A steps down (unpin): B is pinned and served while still waiting.
        waiting = asyncio.create_task(b.pull(s, "m1", batch=1, expires_s=3.0))
        await pulls_waiting(a, s, "m1", what="B's pull waiting at the server")  # A pulls none
        t0 = time.monotonic()
        await a.unpin(s, "m1", PCG)
        rb = await waiting
        # served while still waiting: before its 3 s expiry (a liveness bound, not a timing)
        assert time.monotonic() - t0 < 3.0
        assert [m.data for m in rb.messages] == [b"2"]
        pin_b = rb.pin_id
        assert pin_b and pin_b != pin_a
        await rb.messages[0].ack()
        pg = (await a.consumer_info(s, "m1"))["priority_groups"][0]
        assert pg["pinned_client_id"] == pin_b

        # A's old pin id now gets 423 and no messages; the PullResult says drop the pin.
        ra = await a.pull(s, "m1", batch=1, expires_s=1.0, pin_id=pin_a)
        assert ra.messages == [] and ra.status == 423 and ra.pin_id is None
        # B carries on.
        rb = await b.pull(s, "m1", batch=1, expires_s=1.0, pin_id=pin_b)
        assert [m.data for m in rb.messages] == [b"3"] and rb.pin_id == pin_b
        await rb.messages[0].ack()

        # Unpin with no holder is fine; an unknown group is a typed error.
        await a.unpin(s, "m1", PCG)
        await a.unpin(s, "m1", PCG)
        with pytest.raises(JetStreamError) as ei:
            await a.unpin(s, "m1", "nope")
        assert ei.value.err_code == 10160
        # A pull without a group on a grouped consumer: 400.
        r = await a.pull(s, "m1", batch=1, expires_s=1.0, group=None)
        assert r.status == 400 and isinstance(r.error, JetStreamError)
    finally:
        await b.close()


async def test_pull_batches_statuses_and_concurrency(js, api, unique_name) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    await api.create_consumer(
        s, consumer_config("c", durable_name="c", filter_subjects=[f"{s}.>"], ack_wait_s=30)
    )
    for i in range(10):
        await js.publish(f"{s}.x", b"%d" % i, headers={"k": str(i)})
    r = await api.pull(s, "c", batch=4, expires_s=1.0, group=None)
    assert [m.data for m in r.messages] == [b"0", b"1", b"2", b"3"] and r.status is None
    assert r.messages[2].headers == {"k": "2"} and r.pin_id is None
    assert [m.metadata.sequence.stream for m in r.messages] == [1, 2, 3, 4]
    for m in r.messages:
        await m.ack()
    # Fewer available than asked: the rest, then 408 at expiry.
    t0 = time.monotonic()
    r = await api.pull(s, "c", batch=50, expires_s=0.5, group=None)
    # the rest at once, then the server's 408 at expiry (not before it; bounded for liveness)
    assert len(r.messages) == 6 and r.status == 408 and 0.4 < time.monotonic() - t0 < 10.0
    assert r.error is None
    for m in r.messages:
        await m.ack()
    # no_wait on an empty consumer: 404 at once.
    r = await api.pull(s, "c", batch=5, expires_s=0, no_wait=True, group=None)
    assert r.messages == [] and r.status == 404 and r.error is None
    # Heartbeats are swallowed.
    r = await api.pull(s, "c", batch=5, expires_s=1.0, heartbeat_s=0.2, group=None)
    assert r.messages == [] and r.status == 408
    # max_bytes ends a batch with 409 after what fits; not an error when something came.
    for _ in range(5):
        await js.publish(f"{s}.y", b"x" * 100)
    r = await api.pull(s, "c", batch=5, expires_s=1.0, max_bytes=250, group=None)
    assert 1 <= len(r.messages) < 5 and r.status == 409 and r.error is None
    for m in r.messages:
        await m.ack()
    # Concurrent pulls through one API object each get their own messages (routed by SID).
    r = await api.pull(s, "c", batch=10, expires_s=0.3, group=None)
    for m in r.messages:
        await m.ack()
    for i in range(6):
        await js.publish(f"{s}.z", b"%d" % i)
    rs = await asyncio.gather(
        *[api.pull(s, "c", batch=2, expires_s=2.0, group=None) for _ in range(3)]
    )
    got = sorted(m.data for r in rs for m in r.messages)
    assert got == [b"0", b"1", b"2", b"3", b"4", b"5"]
    assert all(len(r.messages) == 2 for r in rs)
    with pytest.raises(ValueError):
        await api.pull(s, "c", batch=0)
    with pytest.raises(ValueError):
        await api.pull(s, "c", expires_s=0)


async def test_a_filled_batch_s_trailing_409_never_ends_the_next_pull(js, api, unique_name
                                                                     ) -> None:
    """With ``max_bytes``, nats-server ends a filled batch with 409 ``Batch Completed`` (bytes
    to spare) right after its last message. The pull returns at the last message, so that
    status can still be on its way: the reply inbox must not serve the next pull before it
    came (a static run failed with ``Batch Completed (status 409)`` and no messages on a
    loaded machine). Back-to-back pulls through one API object, each with one message: every
    pull gets exactly the next message and no error."""
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    await api.create_consumer(
        s, consumer_config("c", durable_name="c", filter_subjects=[f"{s}.>"], ack_wait_s=30))
    n = 300
    acks = [await js.publish_async(f"{s}.x", b"%d" % i) for i in range(n)]
    await asyncio.gather(*acks)
    got = []
    for _ in range(n):
        r = await api.pull(s, "c", batch=1, expires_s=1.0, max_bytes=1 << 20, group=None)
        assert r.error is None and len(r.messages) == 1, (len(got), r)
        got.append(int(r.messages[0].data))
        await r.messages[0].ack()
    assert got == list(range(n))
    # the status itself, when it ends the request, is a normal end
    r = await api.pull(s, "c", batch=1, expires_s=0.3, max_bytes=1 << 20, group=None)
    assert r.messages == [] and r.status == 408 and r.error is None


async def test_cancelled_pull_does_not_strand_a_message(nc, js, api, unique_name) -> None:
    """A pull cancelled while the server still holds it must not strand a message until
    ack_wait: its inbox is unsubscribed, so the server drops the request instead of delivering
    into the void, and the next pull gets the message at once."""
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
    await api.create_consumer(s, pinned_config("m", [f"{s}.>"], ack_wait_s=60.0))
    task = asyncio.create_task(api.pull(s, "m", batch=1, expires_s=10.0))
    await pulls_waiting(api, s, "m", what="the pull waiting at the server")
    async with SentRequests(nc, f"$JS.API.CONSUMER.INFO.{s}.m") as infos:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await infos.wait(10, "the cancelled pull's sweep (a consumer info request)")
    # the server dropped the abandoned request: no waiting pull left
    await pulls_waiting(api, s, "m", lambda n: n == 0, what="the cancelled pull dropped")
    await js.publish(f"{s}.k", b"late")
    t0 = time.monotonic()
    r = await api.pull(s, "m", batch=1, expires_s=3.0)
    assert [m.data for m in r.messages] == [b"late"], r
    assert time.monotonic() - t0 < 3.0  # delivered while the pull waited (expiry 3 s)
    assert r.messages[0].metadata.num_delivered == 1
    await r.messages[0].ack()


# ------------------------------------------------------------------------------- direct get


async def test_direct_get_batch(js, api, unique_name) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"], allow_direct=True))
    t_start = time.time_ns()
    for i in range(30):
        sub = f"{s}.a" if i % 3 else f"{s}.b"
        await js.publish(sub, b"%d" % i, headers={"n": str(i)} if i % 2 else None)
    t_end = time.time_ns()
    want = [(i + 1, b"%d" % i) for i in range(30) if i % 3]  # (seq, data) on .a

    got = await api.direct_get_batch(s, 1, f"{s}.a", 5)
    assert [(m.seq, m.data) for m in got] == want[:5]
    assert all(m.subject == f"{s}.a" for m in got)
    # User headers only; Nats-* direct-get headers stripped.
    by_seq = {m.seq: m for m in got}
    assert by_seq[2].headers == {"n": "1"} and by_seq[3].headers is None
    assert all(t_start - 1_000_000_000 <= m.time_ns <= t_end + 1_000_000_000 for m in got)
    assert [m.num_pending for m in got] == [len(want) - k - 1 for k in range(5)]

    # Walk the whole filter in batches; it ends with an empty batch.
    seen: list[tuple[int, bytes]] = []
    seq = 1
    while batch := await api.direct_get_batch(s, seq, f"{s}.a", 7):
        assert len(batch) <= 7
        seen += [(m.seq, m.data) for m in batch]
        seq = batch[-1].seq + 1
    assert seen == want
    # Wildcards, no match, start past the end.
    assert len(await api.direct_get_batch(s, 1, f"{s}.>", 100)) == 30
    assert await api.direct_get_batch(s, 1, f"{s}.none", 10) == []
    assert await api.direct_get_batch(s, 1000, f"{s}.>", 10) == []
    # max_bytes: at least one message, fewer than the batch.
    few = await api.direct_get_batch(s, 1, f"{s}.>", 30, max_bytes=10)
    assert 1 <= len(few) < 30 and few[0].seq == 1
    with pytest.raises(ValueError):
        await api.direct_get_batch(s, 0, f"{s}.>", 1)

    # Direct get not allowed on the stream (or no stream): no responders.
    await js.add_stream(StreamConfig(name=f"{s}_nd", subjects=[f"{s}_nd.>"]))
    await js.publish(f"{s}_nd.x", b"x")
    with pytest.raises(JetStreamUnavailableError):
        await api.direct_get_batch(f"{s}_nd", 1, f"{s}_nd.>", 10)
    with pytest.raises(JetStreamUnavailableError):
        await api.direct_get_batch(f"{s}_missing", 1, ">", 10)


# ------------------------------------------------------------------------------- purge / streams


async def test_purge_filter_below_seq(js, api, unique_name) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"], allow_direct=True))
    for i in range(20):
        await js.publish(f"{s}.{i % 2}.k", b"%d" % i)  # seq i+1; even i on .0, odd on .1
    info = await api.stream_info(s, subjects_filter=f"{s}.>")
    assert info["state"]["subjects"] == {f"{s}.0.k": 10, f"{s}.1.k": 10}
    # Below seq 11 on .0.>: seqs 1,3,5,7,9 go; .1 untouched; seq 11 itself stays.
    assert await api.purge(s, filter=f"{s}.0.>", seq=11) == 5
    left = await api.direct_get_batch(s, 1, f"{s}.0.>", 100)
    assert [m.seq for m in left] == [11, 13, 15, 17, 19]
    assert len(await api.direct_get_batch(s, 1, f"{s}.1.>", 100)) == 10
    info = await api.stream_info(s, subjects_filter=f"{s}.0.>")
    assert info["state"]["subjects"] == {f"{s}.0.k": 5}
    assert "total" not in info
    # keep
    assert await api.purge(s, filter=f"{s}.1.>", keep=2) == 8
    assert [m.seq for m in await api.direct_get_batch(s, 1, f"{s}.1.>", 100)] == [18, 20]
    with pytest.raises(ValueError):
        await api.purge(s, seq=1, keep=1)
    # Everything.
    assert await api.purge(s) == 7
    assert (await api.stream_info(s))["state"]["messages"] == 0


async def test_work_queue_purge_moves_the_lease_ack_floor(js, api, unique_name) -> None:
    """DESIGN §5 step 5 on a real work-queue stream fed by a partitioning source transform."""
    origin, wq = unique_name, f"{unique_name}-g"
    await js.add_stream(StreamConfig(name=origin, subjects=[f"{origin}.*"]))
    dest = f"{{{{Partition(2,1)}}}}.{origin}.{{{{Wildcard(1)}}}}"
    info = await api.create_stream(
        {
            "name": wq,
            "retention": "workqueue",
            "discard": "new",
            "allow_direct": True,
            "sources": [
                {
                    "name": origin,
                    "subject_transforms": [
                        {"src": f"{origin}.*", "dest": dest}
                    ],
                }
            ],
        }
    )
    assert info["config"]["retention"] == "workqueue"
    for i in range(40):
        await js.publish(f"{origin}.k{i}", b"%d" % i)
    deadline = time.monotonic() + 10
    while (await api.stream_info(wq))["state"]["messages"] < 40:
        assert time.monotonic() < deadline, "source did not copy the messages"
        await asyncio.sleep(0.05)
    counts = (await api.stream_info(wq, subjects_filter=">"))["state"]["subjects"]
    per_p = {p: sum(n for subj, n in counts.items() if subj.startswith(f"{p}.")) for p in (0, 1)}
    assert per_p[0] + per_p[1] == 40 and per_p[0] > 0 and per_p[1] > 0

    p = 0
    await api.create_consumer(wq, pinned_config("p0", [f"{p}.>"], ack_wait_s=30.0))
    # A second consumer overlapping the same partition is refused by the work queue.
    with pytest.raises(WorkQueueConsumerNotUniqueError) as ei:
        await api.create_consumer(wq, pinned_config("p0b", [f"{p}.>"]))
    assert ei.value.err_code == 10100

    # Lease: one message pulled, pinned; max_ack_pending=1 holds the rest of the partition.
    lease = await api.pull(wq, "p0", batch=1, expires_s=2.0)
    assert len(lease.messages) == 1 and lease.pin_id
    first = lease.messages[0].metadata.sequence.stream
    # Range: the whole partition from the lease on, in order, without consuming it.
    rng = await api.direct_get_batch(wq, first, f"{p}.>", 1000)
    assert rng[0].seq == first and len(rng) == per_p[0]
    assert [m.seq for m in rng] == sorted(m.seq for m in rng)
    last = rng[-1].seq
    # Acknowledge after commit: purge below last+1, then ack the lease.
    assert await api.purge(wq, filter=f"{p}.>", seq=last + 1) == per_p[0]
    await lease.messages[0].ack()
    deadline = time.monotonic() + 5
    while True:
        ci = await api.consumer_info(wq, "p0")
        if ci["ack_floor"]["stream_seq"] >= last or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert ci["ack_floor"]["stream_seq"] >= last
    assert ci["num_ack_pending"] == 0 and ci["num_pending"] == 0 and ci["num_redelivered"] == 0
    # Nothing purged is redelivered; partition 1 is untouched.
    r = await api.pull(wq, "p0", batch=1, expires_s=0.5, pin_id=lease.pin_id)
    assert r.messages == [] and r.status == 408 and r.pin_id == lease.pin_id
    counts = (await api.stream_info(wq, subjects_filter=">"))["state"]["subjects"]
    assert sum(counts.values()) == per_p[1]
    # New messages of the partition arrive, in order, delivered once.
    for i in range(40, 80):
        await js.publish(f"{origin}.k{i}", b"%d" % i)
    deadline = time.monotonic() + 10
    while (await api.stream_info(wq))["state"]["messages"] < per_p[1] + 40:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    pending = (await api.consumer_info(wq, "p0"))["num_pending"]
    assert pending > 0
    seqs = []
    pin = lease.pin_id
    for _ in range(pending):
        r = await api.pull(wq, "p0", batch=1, expires_s=2.0, pin_id=pin)
        assert len(r.messages) == 1, r
        m = r.messages[0]
        assert m.metadata.num_delivered == 1 and m.metadata.sequence.stream > last
        seqs.append(m.metadata.sequence.stream)
        pin = r.pin_id
        await m.ack()
    assert seqs == sorted(seqs)
    assert await api.delete_stream(wq) is True


# ------------------------------------------------------------------------------- errors


async def test_errors_are_typed(js, api, nc, unique_name) -> None:
    missing = f"{unique_name}_missing"
    for call in (
        api.stream_info(missing),
        api.consumer_info(missing, "c"),
        api.purge(missing),
        api.delete_stream(missing),
        api.list_consumer_names(missing),
        api.create_consumer(missing, consumer_config("c")),
    ):
        with pytest.raises(StreamNotFoundError) as ei:
            await call
        assert (ei.value.status, ei.value.err_code) == (404, 10059)
        assert "stream not found" in str(ei.value)
    await js.add_stream(StreamConfig(name=unique_name, subjects=[f"{unique_name}.>"]))
    for call in (
        api.consumer_info(unique_name, "nope"),
        api.delete_consumer(unique_name, "nope"),
        api.unpin(unique_name, "nope"),
    ):
        with pytest.raises(ConsumerNotFoundError):
            await call
    # An invalid field is a plain JetStreamError with the server's code (10025 invalid JSON).
    with pytest.raises(JetStreamError) as ei2:
        await api.create_consumer(unique_name, consumer_config("c", extra={"pinned_ttl": 1}))
    assert ei2.value.err_code == 10025 and "pinned_ttl" in ei2.value.description

    # No answer in time: RequestTimeoutError naming the subject.
    silent = await nc.subscribe(f"silent.{unique_name}")
    try:
        with pytest.raises(RequestTimeoutError) as ei3:
            await api.request(f"silent.{unique_name}", {}, timeout=0.2)
        assert ei3.value.subject == f"silent.{unique_name}"
        assert f"silent.{unique_name}" in str(ei3.value)
    finally:
        await silent.unsubscribe()
    # No responders (e.g. a wrong domain prefix): JetStreamUnavailableError.
    with pytest.raises(JetStreamUnavailableError):
        await JetStreamAPI(nc, prefix="$JS.nodomain.API").stream_info(unique_name)


async def test_dead_letter_counts_leave_halt_notes_out(js, api, unique_name) -> None:
    from cg_pipelines.jetstream.backlog import dead_letter_counts, latest_dead_letters
    dlq = f"{unique_name}-dlq"
    assert await dead_letter_counts(api, dlq) == {}  # no stream yet: none
    await js.add_stream(name=dlq, subjects=[f"{dlq}.>"])
    for subject in (f"{dlq}.0", f"{dlq}.0", f"{dlq}.3", f"{dlq}.halted.3", f"{dlq}.halted.1"):
        await js.publish(subject, b"x", headers={"Cg-Error": subject})
    counts = await dead_letter_counts(api, dlq)
    assert counts == {0: 2, 3: 1}
    latest = {d.partition: d for d in await latest_dead_letters(api, dlq, counts)}
    assert latest[3].latest_reason == f"{dlq}.3" and latest[0].count == 2
