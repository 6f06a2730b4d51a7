"""Leader-served reads (STREAM.MSG.GET) and the empty-range confirmation the engine makes before
acknowledging a lease whose range read came back empty."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.leader import confirm_empty_range, leader_first_seq


async def test_msg_get_and_empty_range_confirmation(js: JetStreamContext,
                                                    unique_name: str) -> None:
    s = unique_name
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"], allow_direct=True))
    for i in range(6):
        await js.publish(f"{s}.{i % 2}", f"m{i}".encode(), headers={"X-N": str(i)})
    api = JetStreamAPI.from_js(js)
    got = await api.msg_get(s, seq=3)
    assert got is not None and (got.seq, got.subject, got.data) == (3, f"{s}.0", b"m2")
    assert got.headers is not None and got.headers["X-N"] == "2"
    nxt = await api.msg_get(s, seq=3, next_by_subj=f"{s}.1")
    assert nxt is not None and nxt.seq == 4
    assert await api.msg_get(s, seq=99) is None
    assert await leader_first_seq(api, s, f"{s}.1", 5) == 6
    assert await leader_first_seq(api, s, f"{s}.1", 7) is None
    # a range the leader holds something in is not empty (a stale replica answered): read again
    assert await confirm_empty_range(api, s, f"{s}.1", 1, 6) is True
    # removed messages (purged after a commit): the range is really empty
    assert await api.delete_msg(s, 6)
    assert not await api.delete_msg(s, 6)
    assert await confirm_empty_range(api, s, f"{s}.1", 5, 6) is False
    # a message after the range does not count
    assert await confirm_empty_range(api, s, f"{s}.0", 6, 6) is False
    await api.close()
