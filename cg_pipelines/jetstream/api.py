"""Raw JetStream API calls that nats-py 2.16 lacks.

nats-py 2.16 has no priority groups (pinned pulls, unpin), no batched direct get and no
``action`` on consumer create, so this module speaks the JSON API directly:

- :class:`JetStreamAPI` — request/response calls (consumer create/info/list/delete, unpin,
  stream create/info/purge/delete), pinned pull requests (:meth:`JetStreamAPI.pull`) and
  batched direct gets (:meth:`JetStreamAPI.direct_get_batch`).
- :func:`consumer_config` — builds a consumer config wire dict.

The code is split by concern: wire forms and result types in :mod:`.api_wire`, the shared
request and reply-inbox plumbing in :mod:`.api_base`, stream/consumer admin in
:mod:`.api_admin`, pulls in :mod:`.api_pull`, direct gets in :mod:`.api_direct`;
:class:`JetStreamAPI` combines them, and every name stays importable from here.

Units: durations are **seconds** (``float``) in the Python API and **integer nanoseconds** on
the wire (``ack_wait``, ``priority_timeout``, ``expires`` ...). Sequences are stream sequences
(``int``, first message is 1).

Pull requests and direct gets reply with several messages on one reply inbox. Messages a pull
delivers carry their *stream* subject (not the inbox), so replies are told apart by subscription
(SID), not by subject: each in-flight pull or direct get owns one inbox subscription, taken from
a small pool of idle ones and put back when the request ended cleanly (batch filled, or a
terminating status such as 404/408/423/204 EOB, after which the server sends nothing more to
that inbox). A request abandoned early (client deadline, missed heartbeats, cancellation) drops
its subscription instead, so a late reply can never reach a later request; JetStream messages
still queued on it are nak'ed so the server redelivers them at once instead of after
``ack_wait``. Messages delivered by a pull are plain ``nats.aio.msg.Msg`` objects:
``await msg.ack()`` and ``msg.metadata.sequence.stream`` work as usual.

Errors: API error responses raise the typed errors of :mod:`cg_pipelines.jetstream.errors`
(:class:`StreamNotFoundError`, :class:`ConsumerAlreadyExistsError`, ...); a request that gets no
answer within ``timeout`` raises :class:`RequestTimeoutError`; no responders (JetStream off, or
direct get not enabled on the stream) raises :class:`JetStreamUnavailableError`.
"""


from __future__ import annotations

from cg_pipelines.jetstream.api_admin import ConsumerRequests, StreamRequests
from cg_pipelines.jetstream.api_direct import DirectGetRequests
from cg_pipelines.jetstream.api_pull import PullRequests
from cg_pipelines.jetstream.api_wire import (
    DEFAULT_PREFIX,
    DIRECT_GET_HEADERS,
    NANOS_PER_SECOND,
    PullResult,
    StoredMessage,
    consumer_config,
    parse_header_block,
    parse_rfc3339_ns,
    seconds_to_ns,
)

__all__ = [
    "DEFAULT_PREFIX",
    "DIRECT_GET_HEADERS",
    "NANOS_PER_SECOND",
    "JetStreamAPI",
    "PullResult",
    "StoredMessage",
    "consumer_config",
    "parse_header_block",
    "parse_rfc3339_ns",
    "seconds_to_ns",
]


class JetStreamAPI(ConsumerRequests, StreamRequests, PullRequests, DirectGetRequests):
    """Raw JetStream API over a connected nats-py client.

    Args:
        nc: a connected ``nats.aio.client.Client`` (``await nats.connect(url)``).
        prefix: API subject prefix, ``"$JS.API"`` by default (``"$JS.<domain>.API"`` for a
            domain).
        timeout: seconds each request waits for its answer (default 5). Pulls wait
            ``expires_s + timeout``.

    Use ``await api.close()`` (or ``async with``) to drop the reply subscription; the connection
    itself is the caller's.
    """
