"""Stream and consumer admin requests of :class:`~cg_pipelines.jetstream.api.JetStreamAPI`:
consumer create/info/list/delete and unpin, stream create/update/info/purge/delete, leader
message get and delete (one JSON request, one JSON answer each)."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from cg_pipelines.core.config import PRIORITY_GROUP
from cg_pipelines.core.errors import UsageError
from cg_pipelines.jetstream.api_base import ApiBase
from cg_pipelines.jetstream.api_wire import StoredMessage, parse_header_block, parse_rfc3339_ns
from cg_pipelines.jetstream.errors import JetStreamError, NoMessageFoundError

__all__ = ["ConsumerRequests", "StreamRequests", "pinned_client_id"]


def pinned_client_id(info: Mapping[str, Any]) -> str | None:
    """The pinned client id of the ``PCG`` priority group in a consumer info, or None."""
    for g in info.get("priority_groups") or []:
        if g.get("group") == PRIORITY_GROUP and g.get("pinned_client_id"):
            return str(g["pinned_client_id"])
    return None


class ConsumerRequests(ApiBase):
    """Consumer admin: ``$JS.API.CONSUMER.{CREATE,DELETE,INFO,NAMES,LIST,UNPIN}``."""

    async def create_consumer(
        self, stream: str, config: Mapping[str, Any], action: str = "create"
    ) -> dict[str, Any]:
        """Create (or update) a consumer: ``$JS.API.CONSUMER.CREATE.<stream>.<name>``.

        The unfiltered subject form is used even with several ``filter_subjects`` (the server
        accepts that; the ``.<filter>`` suffix form only exists for a single filter). Without
        ``name``/``durable_name`` the ephemeral form ``CONSUMER.CREATE.<stream>`` is used.

        Args:
            stream: stream name.
            config: wire config, see :func:`consumer_config`.
            action: ``"create"`` (fail if it exists with a different config; an identical config
                is fine), ``"update"`` (fail if missing) or ``""`` (create or update).

        Returns:
            The consumer info (``{"stream_name", "name", "config", "created", "delivered",
            "ack_floor", "num_pending", "priority_groups"?, ...}``).

        Raises:
            ConsumerAlreadyExistsError: ``create`` and a different config exists (err_code 10148).
            ConsumerNotFoundError: ``update`` of a missing consumer (10149).
            WorkQueueConsumerNotUniqueError: overlapping filters on a work-queue stream (10100).
            StreamNotFoundError: no such stream (10059).
            UsageError: unknown ``action``.
        """
        if action not in ("create", "update", ""):
            raise UsageError(f"action must be 'create', 'update' or '', got {action!r}")
        name = config.get("name") or config.get("durable_name")
        subject = (
            self._subject("CONSUMER", "CREATE", stream, name)
            if name
            else self._subject("CONSUMER", "CREATE", stream)
        )
        body: dict[str, Any] = {"stream_name": stream, "config": dict(config)}
        if action:
            body["action"] = action
        resp = await self.request(subject, body)
        resp.pop("type", None)
        return resp

    async def delete_consumer(self, stream: str, name: str) -> bool:
        """Delete a consumer; returns the server's ``success`` flag.

        Raises:
            ConsumerNotFoundError: no such consumer (10014).
            StreamNotFoundError: no such stream (10059).
        """
        resp = await self.request(self._subject("CONSUMER", "DELETE", stream, name))
        return bool(resp.get("success"))

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any]:
        """Consumer info dict.

        With a priority group it has ``"priority_groups": [{"group": <PRIORITY_GROUP>,
        "pinned_client_id": "<id>", "pinned_ts": "<RFC 3339>"}]``; ``pinned_client_id`` is absent
        and ``pinned_ts`` is ``"0001-01-01T00:00:00Z"`` while nobody is pinned.

        Raises:
            ConsumerNotFoundError: no such consumer (10014).
            StreamNotFoundError: no such stream (10059).
        """
        resp = await self.request(self._subject("CONSUMER", "INFO", stream, name))
        resp.pop("type", None)
        return resp

    async def _paged(self, subject: str, key: str, body: Mapping[str, Any] | None) -> list[Any]:
        items: list[Any] = []
        offset = 0
        while True:
            payload = dict(body or {})
            payload["offset"] = offset
            resp = await self.request(subject, payload)
            page = resp.get(key) or []
            items.extend(page)
            offset += len(page)
            total = int(resp.get("total") or 0)
            if not page or offset >= total:
                return items

    async def list_consumer_names(self, stream: str) -> list[str]:
        """All consumer names of a stream (follows the API's paging).

        Raises:
            StreamNotFoundError: no such stream.
        """
        names: list[str] = await self._paged(
            self._subject("CONSUMER", "NAMES", stream), "consumers", None
        )
        return names

    async def list_consumers(self, stream: str) -> list[dict[str, Any]]:
        """Consumer info dicts of all consumers of a stream (paged).

        Raises:
            StreamNotFoundError: no such stream.
        """
        infos: list[dict[str, Any]] = await self._paged(
            self._subject("CONSUMER", "LIST", stream), "consumers", None
        )
        return infos

    async def unpin(self, stream: str, consumer: str, group: str = PRIORITY_GROUP) -> None:
        """Unpin the current pinned client of ``group``: ``$JS.API.CONSUMER.UNPIN.<s>.<c>``.

        The next pull request without (or with a stale) pin id gets the pin; the old holder's
        pulls get status 423. Unpinning a group nobody holds succeeds.

        Raises:
            ConsumerNotFoundError: no such consumer.
            JetStreamError: err_code 10160 when the group is not one of the consumer's.
        """
        await self.request(self._subject("CONSUMER", "UNPIN", stream, consumer), {"group": group})


class StreamRequests(ApiBase):
    """Stream admin: ``$JS.API.STREAM.{CREATE,UPDATE,DELETE,INFO,PURGE,MSG.GET,MSG.DELETE}``."""

    async def create_stream(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Create a stream from a raw wire config (``$JS.API.STREAM.CREATE.<name>``).

        Durations in ``config`` are nanoseconds (wire form). Returns the stream info dict
        (``{"config", "created", "state", ...}``).

        Raises:
            JetStreamError: e.g. err_code 10058 (name in use with a different config), 10065
                (subjects overlap).
            KeyError: ``config`` has no ``"name"``.
        """
        resp = await self.request(self._subject("STREAM", "CREATE", config["name"]), config)
        resp.pop("type", None)
        return resp

    async def update_stream(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Update a stream (``$JS.API.STREAM.UPDATE.<name>``); returns the stream info dict.

        Raises:
            StreamNotFoundError: no such stream.
        """
        resp = await self.request(self._subject("STREAM", "UPDATE", config["name"]), config)
        resp.pop("type", None)
        return resp

    async def delete_stream(self, name: str) -> bool:
        """Delete a stream; returns the server's ``success`` flag.

        Raises:
            StreamNotFoundError: no such stream.
        """
        resp = await self.request(self._subject("STREAM", "DELETE", name))
        return bool(resp.get("success"))

    async def stream_info(self, stream: str, subjects_filter: str | None = None) -> dict[str, Any]:
        """Stream info dict (``{"config", "created", "state": {"messages", "first_seq",
        "last_seq", ...}, ...}``).

        With ``subjects_filter`` (a subject, wildcards allowed) ``state["subjects"]`` maps each
        matching subject to its message count; pages are fetched and merged.

        Raises:
            StreamNotFoundError: no such stream.
        """
        subject = self._subject("STREAM", "INFO", stream)
        if subjects_filter is None:
            resp = await self.request(subject)
            resp.pop("type", None)
            return resp
        merged: dict[str, int] = {}
        offset = 0
        while True:
            resp = await self.request(
                subject, {"subjects_filter": subjects_filter, "offset": offset}
            )
            resp.pop("type", None)
            page: dict[str, int] = (resp.get("state") or {}).get("subjects") or {}
            merged.update(page)
            offset += len(page)
            total = int(resp.get("total") or 0)
            if not page or offset >= total:
                break
        resp.setdefault("state", {})["subjects"] = merged
        for k in ("total", "offset", "limit"):
            resp.pop(k, None)
        return resp

    async def purge(
        self,
        stream: str,
        *,
        filter: str | None = None,  # the API's name
        seq: int | None = None,
        keep: int | None = None,
    ) -> int:
        """Purge messages: ``$JS.API.STREAM.PURGE.<stream>`` ``{"filter", "seq", "keep"}``.

        Args:
            filter: only messages on this subject (wildcards allowed).
            seq: remove messages with sequence **below** ``seq`` (``seq`` itself stays).
            keep: keep this many newest messages (per filter); exclusive with ``seq``.

        Returns:
            The number of messages purged.

        Raises:
            UsageError: both ``seq`` and ``keep``.
            StreamNotFoundError: no such stream.
        """
        if seq is not None and keep is not None:
            raise UsageError("purge takes seq or keep, not both")
        body: dict[str, Any] = {}
        if filter is not None:
            body["filter"] = filter
        if seq is not None:
            body["seq"] = seq
        if keep is not None:
            body["keep"] = keep
        resp = await self.request(self._subject("STREAM", "PURGE", stream), body)
        return int(resp.get("purged") or 0)

    async def msg_get(
        self,
        stream: str,
        *,
        seq: int | None = None,
        next_by_subj: str | None = None,
        last_by_subj: str | None = None,
    ) -> StoredMessage | None:
        """One stored message, answered by the stream's **leader** (``$JS.API.STREAM.MSG.GET``,
        not a direct get, which any replica may answer a little behind the leader).

        Body ``{"seq"}`` (that sequence), ``{"seq", "next_by_subj"}`` (the first message at or
        after ``seq`` on that subject filter) or ``{"last_by_subj"}``.

        Returns:
            The message (all its headers, ``Nats-*`` included, in ``headers``; ``num_pending``
            ``None``), or ``None`` when nothing matches (err_code 10037).

        Raises:
            StreamNotFoundError: no such stream.
            JetStreamError: another API error (e.g. 503 while the stream has no leader).
            RequestTimeoutError: no answer within ``self.timeout`` seconds.
        """
        body: dict[str, Any] = {}
        if seq is not None:
            body["seq"] = seq
        if next_by_subj is not None:
            body["next_by_subj"] = next_by_subj
        if last_by_subj is not None:
            body["last_by_subj"] = last_by_subj
        try:
            resp = await self.request(self._subject("STREAM", "MSG", "GET", stream), body)
        except NoMessageFoundError:
            return None
        m = resp.get("message") or {}
        raw_hdrs = base64.b64decode(m["hdrs"]) if m.get("hdrs") else b""
        return StoredMessage(
            int(m["seq"]), str(m["subject"]), parse_header_block(raw_hdrs) or None,
            base64.b64decode(m["data"]) if m.get("data") else b"",
            parse_rfc3339_ns(str(m["time"])) if m.get("time") else 0)

    async def delete_msg(self, stream: str, seq: int, *, erase: bool = False) -> bool:
        """Delete one message (``$JS.API.STREAM.MSG.DELETE``; ``erase`` overwrites it too).

        Returns:
            True when deleted, False when there was no such message (err_code 10043 on
            nats-server 2.15.1).

        Raises:
            StreamNotFoundError: no such stream.
            JetStreamError: another API error.
        """
        body: dict[str, Any] = {"seq": seq}
        if not erase:
            body["no_erase"] = True
        try:
            resp = await self.request(self._subject("STREAM", "MSG", "DELETE", stream), body)
        except JetStreamError as e:
            # 10043 sequence not found (2.15.1), 10057 / 10037: no such message
            if e.err_code in (10037, 10043, 10057) or (e.status == 404
                                                       and e.err_code != 10059):
                return False
            raise
        return bool(resp.get("success"))
