"""Reads answered by a stream's leader, where a replica's answer is not enough.

With ``allow_direct`` any replica of a clustered stream may answer a direct get, possibly a few
milliseconds behind the leader (measured on a 3-node loopback cluster: 0.1-2.3 % of direct gets
right after a delivery came back empty for 1-6 ms). A partition run that reads its leased range
empty takes it as "already purged after a commit" and acknowledges the lease; before doing so it
asks the leader (:func:`confirm_empty_range`).
"""

from __future__ import annotations

import asyncio
import time

from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import JetStreamError

__all__ = ["StaleReplicaError", "confirm_empty_range", "leader_first_seq"]


class StaleReplicaError(JetStreamError):
    """The stream leader holds a message that direct gets kept missing for longer than the
    wait: a replica is stuck behind (status 0)."""


async def leader_first_seq(api: JetStreamAPI, stream: str, subject: str, first: int) -> int | None:
    """Sequence of the first message on ``subject`` (wildcards allowed) at or after ``first``,
    as the stream's leader answers (``STREAM.MSG.GET`` with ``next_by_subj``); ``None`` when it
    holds none.

    Raises:
        JetStreamError: the API failed (503 while the stream has no leader; retry that).
    """
    got = await api.msg_get(stream, seq=max(1, first), next_by_subj=subject)
    return None if got is None else got.seq


async def confirm_empty_range(
    api: JetStreamAPI, stream: str, subject: str, first: int, last: int, *,
    wait_s: float = 5.0, poll_s: float = 0.01,
) -> bool:
    """Whether a direct read of ``[first, last]`` on ``subject`` that came back empty was
    stale.

    Asks the leader for the first message on ``subject`` at or after ``first``. None, or one
    past ``last``: the range really is empty, returns ``False``. Otherwise waits (polling a
    direct get of that message every ``poll_s`` seconds, for at most ``wait_s`` seconds) until a
    replica serves it too, and returns ``True``: read the range again.

    Raises:
        StaleReplicaError: the replicas never served the message within ``wait_s`` seconds.
        JetStreamError: an API failure (503 while the stream has no leader: transient).
    """
    seq = await leader_first_seq(api, stream, subject, first)
    if seq is None or seq > last:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        seen = await api.direct_get_batch(stream, seq, subject, 1)
        if seen and seen[0].seq <= seq:
            return True
        if time.monotonic() >= deadline:
            raise StaleReplicaError(0, 0, (
                f"stream {stream}: its leader holds sequence {seq} of {subject} in "
                f"{first}..{last} but direct gets answered nothing for {wait_s:g} s (a replica "
                "is stuck behind: check the stream's replicas with `nats stream info "
                f"{stream}`)"))
        await asyncio.sleep(poll_s)
