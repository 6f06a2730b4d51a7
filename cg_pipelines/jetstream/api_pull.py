"""Pinned pull requests of :class:`~cg_pipelines.jetstream.api.JetStreamAPI`
(``$JS.API.CONSUMER.MSG.NEXT``, with priority groups, which nats-py 2.16 lacks)."""

from __future__ import annotations

import time
from typing import Any

import nats.errors

from cg_pipelines.core.config import PRIORITY_GROUP
from cg_pipelines.core.errors import UsageError
from cg_pipelines.jetstream.api_base import (
    DESCRIPTION_HEADER,
    STATUS_HEADER,
    ApiBase,
    int_header,
    json_body,
)
from cg_pipelines.jetstream.api_wire import BATCH_COMPLETED, PullResult, seconds_to_ns
from cg_pipelines.jetstream.errors import JetStreamError

__all__ = ["PullRequests"]

_PIN_ID = "Nats-Pin-Id"


class PullRequests(ApiBase):
    """:meth:`pull`: one pull request, its replies collected on a pooled reply inbox."""

    async def pull(
        self,
        stream: str,
        consumer: str,
        *,
        batch: int = 1,
        expires_s: float = 5.0,
        group: str | None = PRIORITY_GROUP,
        pin_id: str | None = None,
        max_bytes: int | None = None,
        no_wait: bool = False,
        heartbeat_s: float | None = None,
    ) -> PullResult:
        """One pull request: ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``.

        Sends ``{"batch", "expires" (ns), "group", "id", "max_bytes", "no_wait",
        "idle_heartbeat" (ns)}`` (``None`` fields omitted) and collects replies until ``batch``
        messages arrived, a terminating status came (404/408/409/423/400...), or
        ``expires_s + self.timeout`` seconds passed.

        Pinned groups: a pull without ``pin_id`` competes for the pin and, while another client
        holds it, waits (ending with 408 at expiry). A pull whose ``pin_id`` is not the current
        pin gets 423 at once (``"Nats-Pin-Id mismatch"``, or ``"Nats-Wrong-Pin-Id"`` when the pin
        was released, e.g. by :meth:`unpin` or after ``priority_timeout`` without pulls).
        :attr:`PullResult.pin_id` tells what to send next time.

        A pull cancelled (or ended by missed heartbeats) while the server still holds it drops
        its inbox and asks the server, in the background, to sweep dead waiting requests: on a
        pinned group a dead request could otherwise be pinned by the next message and lock live
        pullers out for ``priority_timeout``.

        Args:
            batch: maximum messages (>= 1).
            expires_s: seconds the server keeps the request waiting (> 0 unless ``no_wait``).
            group: priority group, ``None`` for consumers without one.
            pin_id: the last ``Nats-Pin-Id`` seen, if any.
            max_bytes: byte budget for the batch; the server ends the batch with 409
                ``Message Size Exceeds MaxBytes`` when the next message does not fit (not an
                error in :attr:`PullResult.error` when messages came), and a filled batch
                with 409 ``Batch Completed`` when bytes remain (never an error; its messages
                are waited for when the status overtakes them, and the reply inbox is reused
                only after it, so it cannot end a later request).
            no_wait: answer at once (404 when nothing is available). With ``expires_s > 0``
                too, the server waits until expiry instead (408) when nothing is available.
            heartbeat_s: ask for idle heartbeats at this interval (seconds); if neither a message
                nor a heartbeat comes for twice this long the pull ends (status ``None``,
                description ``"missed heartbeats"``).

        Returns:
            A :class:`PullResult`; failures are reported in it, not raised (see
            :meth:`PullResult.raise_for_status`).

        Raises:
            UsageError: ``batch < 1`` or ``expires_s <= 0`` without ``no_wait``.
        """
        if batch < 1:
            raise UsageError(f"batch must be >= 1, got {batch}")
        if expires_s <= 0 and not no_wait:
            raise UsageError(f"expires_s must be > 0 seconds, got {expires_s}")
        body: dict[str, Any] = {"batch": batch}
        if expires_s > 0:
            body["expires"] = seconds_to_ns(expires_s)
        if no_wait:
            body["no_wait"] = True
        if max_bytes is not None:
            body["max_bytes"] = max_bytes
        if heartbeat_s is not None:
            body["idle_heartbeat"] = seconds_to_ns(heartbeat_s)
        if group is not None:
            body["group"] = group
        if pin_id is not None:
            body["id"] = pin_id

        result = PullResult(pin_id=pin_id)
        subject = self._subject("CONSUMER", "MSG", "NEXT", stream, consumer)
        box = await self._acquire()
        clean = False
        try:
            await self.nc.publish(subject, json_body(body), reply=box.subject)
            deadline = time.monotonic() + max(expires_s, 0.0) + self.timeout
            idle = 2 * heartbeat_s if heartbeat_s else None
            messages = result.messages
            want, completed = batch, False
            while True:
                if len(messages) >= want:
                    # Complete. With max_bytes the server ends a filled batch with 409 "Batch
                    # Completed" when bytes remain, possibly after this: the inbox serves the
                    # next request only once that status came (else a stale 409 would end it).
                    clean = completed or max_bytes is None
                    break
                remaining = deadline - time.monotonic()
                wait = remaining if idle is None else min(remaining, idle)
                msg = await box.get(wait)
                if msg is None:
                    if idle is not None and time.monotonic() < deadline:
                        result.description = "missed heartbeats"
                    break
                hdrs = msg.headers
                if hdrs is not None and STATUS_HEADER in hdrs:
                    status = int(hdrs[STATUS_HEADER])
                    if status == 100:  # idle heartbeat / flow control
                        continue
                    result.status = status
                    result.description = hdrs.get(DESCRIPTION_HEADER, "")
                    result.pending_messages = int_header(hdrs, "Nats-Pending-Messages")
                    result.pending_bytes = int_header(hdrs, "Nats-Pending-Bytes")
                    if status == 409 and BATCH_COMPLETED in result.description:
                        # the quota is used: the batch's messages are the ones the quota
                        # counted, which on a replicated stream may come after this status
                        completed = True
                        pending = result.pending_messages
                        want = len(messages) if pending is None else batch - pending
                        continue
                    if status == 423:
                        result.pin_id = None
                    elif status == 503:
                        result.description = result.description or "no responders"
                    clean = True
                    break
                messages.append(msg)
                if hdrs is not None:
                    pid = hdrs.get(_PIN_ID)
                    if pid is not None:
                        result.pin_id = pid
        finally:
            await self._release(box, clean=clean)
            if not clean:
                self._spawn(self._sweep_waiting(stream, consumer))
        return result

    async def _sweep_waiting(self, stream: str, consumer: str) -> None:
        """Make the server drop pull requests whose inbox is gone.

        A pull abandoned while the server still holds it (cancelled, missed heartbeats) leaves a
        waiting request on an unsubscribed inbox. On a ``pinned_client`` group the server may
        pin that ghost when the next message arrives, locking every live puller out for
        ``priority_timeout``. A consumer info request makes the server check the waiting
        requests' interest and drop the dead ones (checked on nats-server 2.15.1). A message
        published between the abandonment and this sweep can still pin the ghost.
        """
        try:
            await self.request(
                self._subject("CONSUMER", "INFO", stream, consumer),
                timeout=min(self.timeout, 2.0),
            )
        except (JetStreamError, nats.errors.Error):
            pass
