"""Typed errors for raw JetStream API calls.

The JetStream API answers failures with JSON ``{"error": {"code": 404, "err_code": 10059,
"description": "stream not found"}}``: ``code`` is an HTTP-like status, ``err_code`` the
server's stable JetStream error code. :func:`error_from_response` turns such a response into the
most specific :class:`JetStreamError` subclass. Pull requests and direct gets report problems as
status messages instead (headers ``NATS/1.0 423 Nats-Pin-Id Mismatch``); those map to
:func:`error_from_status`.

Error codes seen from nats-server 2.15.1 (by experiment; status in brackets):

- 10059 [404] stream not found -> :class:`StreamNotFoundError`
- 10014 [404] consumer not found -> :class:`ConsumerNotFoundError`
- 10149 [400] consumer does not exist (action ``update``) -> :class:`ConsumerNotFoundError`
- 10148 [400] consumer already exists (action ``create``, different config; an identical
  config succeeds) -> :class:`ConsumerAlreadyExistsError`; so do 10013 "consumer name already
  in use" and 10105 "consumer already exists and is still active" (older create paths)
- 10100 [400] filtered consumer not unique on workqueue stream, 10099 [400] multiple
  non-filtered consumers not allowed on workqueue stream -> :class:`WorkQueueConsumerNotUniqueError`
- 10037 [404] no message found -> :class:`NoMessageFoundError`
- 10160 [400] provided priority group does not exist for this consumer (unpin) and 10025 [400]
  invalid JSON (e.g. unknown config field ``pinned_ttl``) -> plain :class:`JetStreamError`

Pull statuses: 423 ``Nats-Pin-Id mismatch`` (a pull carried an id that is not the current pin)
and 423 ``Nats-Wrong-Pin-Id`` (the pin was released: unpin or ``priority_timeout``) ->
:class:`NotPinnedError`; 409 ``Leadership Change`` (a clustered consumer's new leader ends the
pulls that were waiting at the old one) and 409 ``Server Shutdown`` (the node serving the pull
stops) -> :class:`JetStreamUnavailableError`, like 503: the same pull succeeds again once the
consumer has its leader (nats-server ``server/consumer.go`` ``checkPendingRequests``,
``server/jetstream.go``); 400 ``Bad Request - Priority Group missing`` / ``Invalid Priority
Group`` and other 409s (``Consumer Deleted``...) -> :class:`JetStreamError`.
"""

from __future__ import annotations

from typing import Any

from cg_pipelines.core.errors import CgError

__all__ = [
    "ConsumerAlreadyExistsError",
    "ConsumerNotFoundError",
    "JetStreamError",
    "JetStreamUnavailableError",
    "NoMessageFoundError",
    "NotPinnedError",
    "RequestTimeoutError",
    "StreamNotFoundError",
    "WorkQueueConsumerNotUniqueError",
    "error_from_response",
    "error_from_status",
]

# JetStream error codes (server/errors.json in nats-server).
ERR_STREAM_NOT_FOUND = 10059
ERR_CONSUMER_NOT_FOUND = 10014
ERR_CONSUMER_DOES_NOT_EXIST = 10149  # action "update" on a consumer that does not exist
ERR_CONSUMER_ALREADY_EXISTS = 10148  # action "create", existing consumer, different config
ERR_CONSUMER_EXISTS_ACTIVE = 10105  # "consumer already exists and is still active"
ERR_CONSUMER_NAME_EXISTS = 10013  # "consumer name already in use"
ERR_WQ_CONSUMER_NOT_UNIQUE = 10100
ERR_WQ_MULTIPLE_UNFILTERED = 10099
ERR_NO_MESSAGE_FOUND = 10037


class JetStreamError(CgError):
    """A JetStream API call failed.

    Attributes:
        status: HTTP-like status code (the API's ``error.code``, or a pull/direct-get status
            header such as 423); 0 when unknown.
        err_code: JetStream error code (``error.err_code``, e.g. 10148); 0 when the server sent
            none (status messages carry none).
        description: the server's description, e.g. ``"stream not found"``.
    """

    def __init__(self, status: int = 0, err_code: int = 0, description: str = "") -> None:
        self.status = status
        self.err_code = err_code
        self.description = description
        super().__init__(status, err_code, description)

    def __str__(self) -> str:
        return f"{self.description} (status {self.status}, err_code {self.err_code})"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status}, err_code={self.err_code}, "
            f"description={self.description!r})"
        )


class StreamNotFoundError(JetStreamError):
    """The stream does not exist (err_code 10059)."""


class ConsumerNotFoundError(JetStreamError):
    """The consumer does not exist (err_code 10014, or 10149 on action ``update``)."""


class ConsumerAlreadyExistsError(JetStreamError):
    """Action ``create`` found a consumer of that name with a different config (10148; also
    10013, 10105).

    Every instance of a group member must send an identical config: the reference
    implementation (synadia-io/orbit.go ``pcgroups`` v0.2.1) creates member consumers with
    action ``create``, which the server refuses (10148) when the existing config differs.
    """


class WorkQueueConsumerNotUniqueError(JetStreamError):
    """A work-queue stream refused an overlapping consumer (10100; 10099 when unfiltered)."""


class NoMessageFoundError(JetStreamError):
    """No message matched a get request (err_code 10037, or status 404 from a direct get)."""


class NotPinnedError(JetStreamError):
    """A pull request's pin id is not the current pin (status 423, ``Nats-Pin-Id Mismatch``).

    The pin moved to another client (unpin, step-down or ``priority_timeout``): drop the pin id
    and pull without one to compete for the pin again.
    """


class JetStreamUnavailableError(JetStreamError):
    """No responders on the API subject (status 503): JetStream is off or the prefix is wrong."""


class RequestTimeoutError(JetStreamError):
    """An API request got no answer within its timeout.

    Attributes:
        subject: the request subject.
        timeout_s: the timeout that elapsed, in seconds.
    """

    def __init__(self, subject: str, timeout_s: float) -> None:
        super().__init__(408, 0, f"request to {subject} timed out after {timeout_s:g} s")
        self.subject = subject
        self.timeout_s = timeout_s


_BY_ERR_CODE: dict[int, type[JetStreamError]] = {
    ERR_STREAM_NOT_FOUND: StreamNotFoundError,
    ERR_CONSUMER_NOT_FOUND: ConsumerNotFoundError,
    ERR_CONSUMER_DOES_NOT_EXIST: ConsumerNotFoundError,
    ERR_CONSUMER_ALREADY_EXISTS: ConsumerAlreadyExistsError,
    ERR_CONSUMER_EXISTS_ACTIVE: ConsumerAlreadyExistsError,
    ERR_CONSUMER_NAME_EXISTS: ConsumerAlreadyExistsError,
    ERR_WQ_CONSUMER_NOT_UNIQUE: WorkQueueConsumerNotUniqueError,
    ERR_WQ_MULTIPLE_UNFILTERED: WorkQueueConsumerNotUniqueError,
    ERR_NO_MESSAGE_FOUND: NoMessageFoundError,
}


def error_from_response(resp: dict[str, Any]) -> JetStreamError:
    """Build the typed error for an API response that has an ``"error"`` object.

    Args:
        resp: the decoded JSON response, ``{"error": {"code", "err_code", "description"}}``;
            a bare error object (without the ``"error"`` wrapper) is accepted too.

    Returns:
        The most specific subclass for ``err_code`` (plain :class:`JetStreamError` otherwise).
        It is returned, not raised.
    """
    err = resp.get("error", resp)
    if not isinstance(err, dict):
        return JetStreamError(0, 0, str(err))
    status = int(err.get("code") or 0)
    err_code = int(err.get("err_code") or 0)
    description = str(err.get("description") or "")
    cls = _BY_ERR_CODE.get(err_code, JetStreamError)
    return cls(status, err_code, description)


#: 409 status descriptions that mean "JetStream is between leaders here: ask again" (see the
#: module docstring).
_TRANSIENT_409 = frozenset({"leadership change", "server shutdown"})


def error_from_status(status: int, description: str = "") -> JetStreamError:
    """Typed error for a status message (pull / direct get): 423 -> :class:`NotPinnedError`,
    404 -> :class:`NoMessageFoundError`, 503 and 409 ``Leadership Change`` / ``Server
    Shutdown`` -> :class:`JetStreamUnavailableError`, else the base class. Returned, not
    raised."""
    if status == 423:
        return NotPinnedError(status, 0, description)
    if status == 404:
        return NoMessageFoundError(status, 0, description)
    if status == 503 or (status == 409 and description.strip().lower() in _TRANSIENT_409):
        return JetStreamUnavailableError(status, 0, description)
    return JetStreamError(status, 0, description)
