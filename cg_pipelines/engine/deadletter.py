"""Dead-letter stream ``<stream>-<group>-dlq`` for messages the processing step rejects.

Each dead letter keeps the original payload and headers and adds ``Cg-Origin-Stream``,
``Cg-Stream`` (the stream it was read from), ``Cg-Sequence``, ``Cg-Subject`` (partition token
stripped), ``Cg-Partition`` and ``Cg-Error``. It is published with ``Nats-Msg-Id =
<stream read from>:<sequence>`` so a batch re-processed after a crash or by a newer holder
dead-letters each message once (within the stream's duplicate window, default 7 days).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from nats.js import JetStreamContext

from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.engine.model import DeadLetter
from cg_pipelines.jetstream.api import JetStreamAPI, seconds_to_ns
from cg_pipelines.jetstream.errors import JetStreamError

DLQ_DUPLICATE_WINDOW_S = 7 * 24 * 3600.0


def dlq_stream_name(stream: str, group: str) -> str:
    """``<stream>-<group>-dlq``."""
    return f"{stream}-{group}-dlq"


async def ensure_dlq_stream(
    api: JetStreamAPI, stream: str, group: str, *, replicas: int | None = None,
    duplicate_window_s: float = DLQ_DUPLICATE_WINDOW_S,
) -> str:
    """Create the dead-letter stream if missing (subjects ``<name>.>``); returns its name.

    ``replicas`` defaults to the origin stream's replica count (the work queue's when the
    origin cannot be read), so on a cluster the dead letters survive a node as the group's
    other streams do. An existing dead-letter stream with fewer replicas (made by an earlier
    version, always R1) is updated to that count; when the update is refused (e.g. a node is
    down) the stream is used as it is and the next run tries again.

    Raises:
        JetStreamError: the stream cannot be read or created (503 while it has no leader).
    """
    name = dlq_stream_name(stream, group)
    try:
        info: dict[str, Any] | None = await api.stream_info(name)
    except JetStreamError as e:
        if e.status != 404:
            raise
        info = None
    want = replicas if replicas is not None else await group_replicas(api, stream, group)
    if info is None:
        await api.create_stream({
            "name": name, "subjects": [f"{name}.>"], "storage": "file",
            "num_replicas": want, "retention": "limits",
            "duplicate_window": seconds_to_ns(duplicate_window_s), "allow_direct": True,
        })
        return name
    config = dict(info.get("config") or {})
    if int(config.get("num_replicas") or 1) < want:
        config["num_replicas"] = want
        with contextlib.suppress(JetStreamError):
            await api.update_stream(config)
    return name


async def group_replicas(api: JetStreamAPI, stream: str, group: str) -> int:
    """The replica count a group's streams should carry: the origin stream's, else its
    work-queue stream's, else 1 (neither readable)."""
    for name in (stream, work_queue_stream_name(stream, group)):
        try:
            info = await api.stream_info(name)
        except JetStreamError:
            continue
        return max(1, int((info.get("config") or {}).get("num_replicas") or 1))
    return 1


async def publish_dead_letters(
    js: JetStreamContext,
    *,
    origin_stream: str,
    read_stream: str,
    group: str,
    partition: int,
    batch: pa.Table,
    dead: Sequence[DeadLetter],
    timeout: float = 5.0,
) -> int:
    """Publish each dead letter (awaiting the stream's acks). Returns how many were stored.

    ``batch`` is the batch the dead letters came from
    (:data:`~cg_pipelines.engine.model.RECORD_SCHEMA`: its ``data``, ``subject`` and user
    ``headers`` are what is published).

    Raises ``ValueError`` if a dead letter names a sequence not in ``batch`` (the processing
    step must only reject messages it was given).
    """
    index = {seq: i for i, seq in enumerate(batch["seq"].to_pylist())}
    name = dlq_stream_name(origin_stream, group)
    acks = []
    for d in dead:
        i = index.get(d.seq)
        if i is None:
            raise ValueError(f"dead letter for sequence {d.seq} which is not in the batch")
        raw = batch["headers"][i].as_py()
        headers = dict(json.loads(raw)) if raw else {}
        headers.update({
            "Nats-Msg-Id": f"{read_stream}:{d.seq}",
            "Cg-Origin-Stream": origin_stream,
            "Cg-Stream": read_stream,
            "Cg-Sequence": str(d.seq),
            "Cg-Subject": batch["subject"][i].as_py(),
            "Cg-Partition": str(partition),
            "Cg-Error": " ".join(d.reason.split())[:1000],
        })
        acks.append(await js.publish_async(f"{name}.{partition}", batch["data"][i].as_py(),
                                           headers=headers))
    if acks:
        await asyncio.wait_for(asyncio.gather(*acks), timeout)
    return len(acks)
