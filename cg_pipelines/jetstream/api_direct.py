"""Batched direct gets of :class:`~cg_pipelines.jetstream.api.JetStreamAPI`
(``$JS.API.DIRECT.GET.<stream>`` with ``batch``, which nats-py 2.16 lacks), message by message;
:func:`cg_pipelines.jetstream.rangeread.read_range` is the bulk (Arrow) form."""

from __future__ import annotations

from typing import Any

from cg_pipelines.core.errors import UsageError
from cg_pipelines.jetstream.api_base import DESCRIPTION_HEADER, STATUS_HEADER, ApiBase, json_body
from cg_pipelines.jetstream.api_wire import DIRECT_GET_HEADERS, StoredMessage, parse_rfc3339_ns
from cg_pipelines.jetstream.errors import (
    JetStreamError,
    JetStreamUnavailableError,
    RequestTimeoutError,
    error_from_status,
)

__all__ = ["DirectGetRequests"]


class DirectGetRequests(ApiBase):
    """:meth:`direct_get_batch`: up to ``batch`` stored messages without consuming them."""

    async def direct_get_batch(
        self,
        stream: str,
        seq: int,
        next_by_subj: str,
        batch: int,
        max_bytes: int | None = None,
    ) -> list[StoredMessage]:
        """Read up to ``batch`` stored messages without consuming them (batched direct get).

        Sends ``{"seq", "next_by_subj", "batch"[, "max_bytes"]}`` to
        ``$JS.API.DIRECT.GET.<stream>``; the server answers with one message per hit (headers
        ``Nats-Stream``, ``Nats-Sequence``, ``Nats-Subject``, ``Nats-Time-Stamp``,
        ``Nats-Num-Pending``, ``Nats-Last-Sequence``) and ends with status 204 ``EOB``. The
        stream needs ``allow_direct: true``.

        Args:
            seq: first sequence to consider (inclusive).
            next_by_subj: subject filter (wildcards allowed), e.g. ``"3.>"``.
            batch: maximum number of messages (>= 1).
            max_bytes: byte budget; the server stops after the message that crosses it (at least
                one message is returned).

        Returns:
            Messages in stream-sequence order, ``seq`` <= each ``.seq``; empty when nothing
            matches (status 404).

        Raises:
            JetStreamUnavailableError: no responders (stream missing or ``allow_direct`` off).
            RequestTimeoutError: no reply (or the batch stalled) for ``self.timeout`` seconds.
            JetStreamError: another error status (e.g. 400 bad request).
            UsageError: ``batch < 1`` or ``seq < 1``.
        """
        if batch < 1:
            raise UsageError(f"batch must be >= 1, got {batch}")
        if seq < 1:
            raise UsageError(f"seq must be >= 1, got {seq}")
        body: dict[str, Any] = {"seq": seq, "next_by_subj": next_by_subj, "batch": batch}
        if max_bytes is not None:
            body["max_bytes"] = max_bytes
        subject = self._subject("DIRECT", "GET", stream)
        out: list[StoredMessage] = []
        box = await self._acquire()
        clean = False
        try:
            await self.nc.publish(subject, json_body(body), reply=box.subject)
            strip = DIRECT_GET_HEADERS
            while True:
                msg = await box.get(self.timeout)
                if msg is None:
                    raise RequestTimeoutError(subject, self.timeout)
                hdrs = msg.headers
                if not hdrs:
                    raise JetStreamError(0, 0, f"direct get reply without headers from {subject}")
                status = hdrs.get(STATUS_HEADER)
                if status is not None:
                    code = int(status)
                    clean = True  # a status always ends the reply stream
                    if code in (204, 404, 408):  # end of batch / nothing found / timed out
                        return out
                    if code == 503:
                        raise JetStreamUnavailableError(
                            503,
                            0,
                            f"no responders for {subject}: stream {stream!r} missing or "
                            "allow_direct not enabled",
                        )
                    raise error_from_status(code, hdrs.get(DESCRIPTION_HEADER, ""))
                user = {k: v for k, v in hdrs.items() if k not in strip}
                pending = hdrs.get("Nats-Num-Pending")
                out.append(
                    StoredMessage(
                        int(hdrs["Nats-Sequence"]),
                        hdrs["Nats-Subject"],
                        user or None,
                        msg.data,
                        parse_rfc3339_ns(hdrs["Nats-Time-Stamp"]),
                        int(pending) if pending is not None else None,
                    )
                )
                if len(out) > batch:  # defensive: never trust a runaway reply stream
                    return out[:batch]
        finally:
            await self._release(box, clean=clean)
