"""Connection options for NATS: URL, user/password, token, NKey seed file, creds (JWT + NKey)
file, TLS (server certificate checked against a CA; optional client certificate).

Shared by the library, the ``cg`` CLI and the Dagster NATS resource.

Secrets (password, token, credentials embedded in a URL, seed contents) never appear in
``repr``, exception messages or log records written by this module:

- they are never echoed: messages are built from :attr:`ConnectOptions.display_servers` (URLs
  with their userinfo replaced by ``***``) and :attr:`ConnectOptions.auth_mode` (the mode and
  the user name, never a password or token);
- text that comes from elsewhere (an exception's message) goes through
  :meth:`ConnectOptions.scrub` before it is shown: URL credentials are removed where they stand
  (the userinfo before the ``@`` of each URL, see :func:`redact_credentials`), never by
  searching the text for the user name, which garbled messages (user ``a`` turned
  "authorization violation" into "***uthoriz***tion viol***tion"); a password or
  token is also replaced where it occurs whole, if it has at least
  :data:`MIN_SCRUBBED_SECRET_LEN` characters (a shorter value cannot be told apart from an
  ordinary word, and searching for it is what garbles text; it is still never echoed).

nats-py's own error callback (which logs whole tracebacks) is replaced by one that logs a single
scrubbed line.

Failures of the first connection are typed (:class:`NatsConnectError` and subclasses) and
bounded in time: the server rejecting the credentials (:class:`NatsAuthError`) or the TLS
handshake failing (:class:`NatsTLSError`) fail at the first attempt, without the reconnect loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import nats.errors
from nats.aio.client import Client, ErrorCallback

from cg_pipelines.core.errors import CgError

__all__ = [
    "ConnectOptions",
    "connect_options_of",
    "NatsAuthError",
    "NatsConnectError",
    "NatsTLSError",
    "drop_ssl_eof_notice",
    "redact_credentials",
    "redact_url",
]

_log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 1.0
_MAX_RECONNECT_ATTEMPTS = 3
_RECONNECT_TIME_WAIT_S = 2.0
_CREDS_JWT_MARK = "BEGIN NATS USER JWT"
_CREDS_SEED_MARK = "BEGIN USER NKEY SEED"

MIN_SCRUBBED_SECRET_LEN = 8
"""A password or token is searched for in foreign text (and replaced where it occurs whole) only
if it is at least this long: shorter values are ordinary words ("a", "nats", "admin") whose
replacement garbles messages without protecting anything."""

# Characters that may stand in a URL's userinfo (RFC 3986: unreserved, pct-encoded,
# sub-delims, ":"), and a URL with userinfo: scheme "://" userinfo "@".
_UI = r"A-Za-z0-9\-._~%!$&*+=:"
_URL_WITH_USERINFO = re.compile(rf"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://)[{_UI}]+@")


class _DropSslEofNotice(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl" each time
    a TLS connection of nats-py's stream protocol closes: harmless, and noise on ``cg``'s
    stderr. This drops exactly that record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


def drop_ssl_eof_notice() -> None:
    """Install the filter dropping asyncio's "returning true from eof_received() has no effect
    when using ssl" warning on the ``asyncio`` logger (idempotent). Importing this module
    changes no other library's logging: an application (the ``cg`` CLI) calls this at start."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropSslEofNotice) for f in asyncio_log.filters):
        asyncio_log.addFilter(_DropSslEofNotice())


class NatsConnectError(CgError, ConnectionError):
    """The first connection to NATS failed for a reason retrying will not fix (bad
    credentials, TLS, an unreadable credentials file).

    The message names the server (URL without credentials) and the authentication mode, and
    never contains a secret.

    Attributes:
        server: the server URL(s), credentials removed.
        mode: the authentication mode tried, e.g. ``"user/password (user 'app')"``.
    """

    def __init__(self, message: str, *, server: str = "", mode: str = "") -> None:
        super().__init__(message)
        self.server = server
        self.mode = mode


class NatsAuthError(NatsConnectError):
    """The server rejected the credentials (``Authorization Violation``)."""


class NatsTLSError(NatsConnectError):
    """TLS failed: the server's certificate did not verify against the CA, the server wants a
    client certificate, the server does not speak TLS although TLS was asked for, or the TLS
    files cannot be loaded."""


class _Fatal(Exception):
    """Raised from the error callback to stop nats-py's connect loop at once."""

    def __init__(self, cause: BaseException, error: NatsConnectError) -> None:
        super().__init__(type(cause).__name__)
        self.cause, self.error = cause, error


def redact_credentials(text: str, urls: Iterable[str] = ()) -> str:
    """``text`` with URL credentials replaced by ``***`` where they stand.

    Each ``scheme://userinfo@`` in ``text`` becomes ``scheme://***@``; the userinfo of each of
    ``urls`` (which may contain characters a generic match would stop at, e.g. an unescaped
    ``@`` in a password) is also replaced wherever it stands before an ``@``, with or without
    the scheme. Nothing else changes: a user name elsewhere in the text is left alone.
    """
    for url in urls:
        try:
            netloc = urlsplit(url).netloc
        except ValueError:
            continue
        userinfo = netloc.rpartition("@")[0]
        if userinfo:
            text = re.sub(rf"(?<![A-Za-z0-9\-._~%]){re.escape(userinfo)}@", "***@", text)
    return _URL_WITH_USERINFO.sub(lambda m: f"{m['head']}***@", text)


def _replace_whole(text: str, secret: str) -> str:
    """``text`` with each whole occurrence of ``secret`` (not inside a longer word) replaced."""
    head = r"(?<![A-Za-z0-9_])" if secret[0].isalnum() or secret[0] == "_" else ""
    tail = r"(?![A-Za-z0-9_])" if secret[-1].isalnum() or secret[-1] == "_" else ""
    return re.sub(head + re.escape(secret) + tail, "***", text)


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` / ``token@`` part replaced by ``***@``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "***"
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


@dataclass(frozen=True, repr=False)
class ConnectOptions:
    """How to reach NATS.

    Args:
        servers: comma-separated URL list, e.g. ``"nats://127.0.0.1:4222"``.
        user, password: user/password auth. token: token auth.
        creds: path of a ``.creds`` file (user JWT + NKey seed; operator mode).
        tls_ca: CA bundle path to verify the server's certificate (implies TLS).
        tls_cert, tls_key: optional client certificate and key paths (mutual TLS).
        connect_timeout: seconds for each connection attempt.
        name: client name shown by the server.
        nkey_seed: path of a file holding a user NKey seed (``SU...``; NKey auth).
        reconnect_attempts: once connected, how many times to try each server again after the
            connection is lost, ``reconnect_wait_s`` seconds apart; ``-1`` (default): without
            end, so a server restart never closes the client — callers bound their own waits
            (the engine retries each NATS step for ``EngineOptions.nats_retry_max_s``, then fails
            the run).
        reconnect_wait_s: seconds between those reconnect attempts.
    """

    servers: str = "nats://127.0.0.1:4222"
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout: float = 5.0
    name: str = "cg_pipelines"
    nkey_seed: str | None = None
    reconnect_attempts: int = -1
    reconnect_wait_s: float = 0.5

    # -- describing (never the secrets) --------------------------------------------------------

    def __repr__(self) -> str:
        """Fields as the dataclass repr, but URLs without credentials, secrets as ``'***'``."""
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "servers":
                value = self.display_servers
            elif f.name in ("password", "token") and value is not None:
                value = "***"
            shown.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def server_list(self) -> list[str]:
        """The URLs of ``servers``, as given (may carry credentials: do not print them)."""
        return [s.strip() for s in self.servers.split(",") if s.strip()]

    @property
    def display_servers(self) -> str:
        """``servers`` with credentials in URLs replaced by ``***``."""
        return ",".join(redact_url(s) for s in self.server_list()) or "(no server)"

    @property
    def auth_mode(self) -> str:
        """The authentication mode in words, without secrets, e.g. ``"token"``."""
        if self.creds:
            return f"creds file {self.creds}"
        if self.nkey_seed:
            return f"NKey seed file {self.nkey_seed}"
        if self.token:
            return "token"
        if self.user or self.password:
            return f"user/password (user {self.user!r})"
        if any("@" in urlsplit(s).netloc for s in self.server_list()):
            return "credentials in the server URL"
        return "no credentials"

    @property
    def uses_tls(self) -> bool:
        """Whether TLS options were given (then a plaintext server is refused)."""
        return bool(self.tls_ca or self.tls_cert or self.tls_key)

    def _secrets(self) -> list[str]:
        """Password and token values, given separately or in a URL (a URL's user name without
        a password is a token to nats-py), longest first; only those of at least
        :data:`MIN_SCRUBBED_SECRET_LEN` characters."""
        out = [s for s in (self.password, self.token) if s]
        for url in self.server_list():
            try:
                parts = urlsplit(url)
            except ValueError:
                continue
            if parts.password:
                out.append(parts.password)
            elif parts.username:
                out.append(parts.username)
        return sorted({s for s in out if len(s) >= MIN_SCRUBBED_SECRET_LEN}, key=len,
                      reverse=True)

    def scrub(self, text: str) -> str:
        """``text`` (from elsewhere: an exception's message) fit to show: URL credentials
        replaced by ``***`` where they stand (:func:`redact_credentials`), and each password or
        token of these options of at least :data:`MIN_SCRUBBED_SECRET_LEN` characters replaced
        where it occurs whole. Text around them is never changed (a user name ``a`` leaves
        "authorization violation" as it is)."""
        text = redact_credentials(text, self.server_list())
        for s in self._secrets():
            text = _replace_whole(text, s)
        return text

    def unreachable_message(self, exc: BaseException) -> str:
        """One line for a connection that failed because no server could be reached
        (``nats.errors.NoServersError``, ``OSError``): ``cannot connect to <servers>: <error>``
        with the servers named (credentials removed) and the error's text scrubbed. What ``cg``
        prints and what :meth:`unreachable_error` carries."""
        return self.scrub(f"cannot connect to {self.display_servers}: "
                          f"{exc or type(exc).__name__}")

    def unreachable_error(self, exc: BaseException) -> NatsConnectError:
        """:class:`NatsConnectError` with :meth:`unreachable_message` (for callers that raise
        rather than print, e.g. the Dagster ``NatsResource``)."""
        return self._error(NatsConnectError, self.unreachable_message(exc))

    def _error(self, cls: type[NatsConnectError], message: str) -> NatsConnectError:
        """The typed error. ``message`` must be built only from parts that hold no secret
        (display servers, auth mode, file paths, fixed words) and :meth:`scrub`-bed foreign
        text; it is not scrubbed again, which could only garble the fixed words (a password
        ``password`` would turn "user/password" into "user/***")."""
        return cls(message, server=self.display_servers, mode=self.auth_mode)

    def spark_source_options(self) -> dict[str, str]:
        """These options as options of the ``jetstream`` Spark data source
        (:mod:`cg_pipelines.spark.datasource`): ``servers`` (as given, URL credentials
        included), ``user``, ``password``, ``token``, ``creds`` (path), ``nkey_seed`` (path;
        left out with ``creds``, as :meth:`connect` does), ``tls_ca``, ``tls_cert``,
        ``tls_key`` (paths); only those that are set. Paths are passed as they are: whoever
        connects with them (Spark executors) must see the same files there.

        Holds secrets (password, token, URL credentials): never log it or put it in an
        error.
        """
        out = {"servers": ",".join(self.server_list())}
        for key, value in (("user", self.user), ("password", self.password),
                           ("token", self.token), ("creds", self.creds),
                           ("nkey_seed", None if self.creds else self.nkey_seed),
                           ("tls_ca", self.tls_ca), ("tls_cert", self.tls_cert),
                           ("tls_key", self.tls_key)):
            if value:
                out[key] = value
        return out

    # -- checks before connecting -------------------------------------------------------------

    def tls_context(self) -> ssl.SSLContext | None:
        """An SSL context checking the server against ``tls_ca`` (the system CAs when only a
        client certificate is given), with the client certificate loaded; None without TLS
        options.

        Raises:
            NatsTLSError: a TLS file is missing or not a valid PEM certificate/key.
        """
        if not self.uses_tls:
            return None
        if self.tls_key and not self.tls_cert:
            raise self._error(NatsTLSError, "tls_key given without tls_cert")
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as e:
            files = ", ".join(f"{k} {v}" for k, v in (("tls_ca", self.tls_ca),
                                                       ("tls_cert", self.tls_cert),
                                                       ("tls_key", self.tls_key)) if v)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise self._error(NatsTLSError, f"cannot load TLS files ({files}): "
                              f"{type(e).__name__}: {self.scrub(reason)}") from None
        return ctx

    def _check_credential_files(self) -> None:
        """Read the creds / seed files now, so a bad file is a clear error (nats-py would loop
        forever on a creds file without a JWT block)."""
        if self.creds:
            text = self._read(self.creds, "creds file")
            missing = [m for m in (_CREDS_JWT_MARK, _CREDS_SEED_MARK) if m not in text]
            if missing:
                raise self._error(NatsConnectError, f"creds file {self.creds} is not a NATS "
                                  f"credentials file (no '{missing[0]}' block)")
        if self.nkey_seed:
            import nkeys  # type: ignore[import-untyped]  # nkeys ships no type hints

            seed = self._read(self.nkey_seed, "NKey seed file").strip()
            try:
                kp = nkeys.from_seed(bytearray(seed.encode()))
                kp.wipe()
            except Exception:
                hint = (" (it looks like a .creds file: use creds)"
                        if _CREDS_SEED_MARK in seed else "")
                raise self._error(NatsConnectError, f"NKey seed file {self.nkey_seed} does not "
                                  f"hold a valid NKey seed{hint}") from None
            finally:
                del seed

    def _read(self, path: str, what: str) -> str:
        try:
            return Path(path).read_text(errors="replace")
        except OSError as e:
            raise self._error(NatsConnectError, f"cannot read {what} {path}: "
                              f"{self.scrub(e.strerror or type(e).__name__)}") from None

    # -- connecting ---------------------------------------------------------------------------

    def _client_cert_hint(self) -> str:
        if self.tls_cert:
            return (f"check the client certificate {self.tls_cert}: the server's CA must have "
                    "signed it")
        return "the server requires a client certificate: give tls_cert and tls_key"

    def _explain(self, e: BaseException,
                 server_info: dict[str, object] | None = None) -> NatsConnectError | None:
        """The typed error for a failure that retrying will not fix, else None.

        ``server_info``: the INFO of the server of the failed attempt (``tls_verify``: it
        checks client certificates)."""
        text = str(e)
        low = text.lower()
        where = self.display_servers
        if "authorization violation" in low or "authentication" in low or isinstance(
                e, nats.errors.AuthorizationError):
            if self.auth_mode == "no credentials":
                return self._error(NatsAuthError, f"authorization violation at {where}: the "
                                   "server requires authentication but no credentials were "
                                   "given (user/password, token, NKey seed file or creds file)")
            if self.creds:
                hint = f"check the creds file {self.creds} (user JWT and seed)"
            elif self.nkey_seed:
                hint = (f"check the NKey seed file {self.nkey_seed}: its public key must be a "
                        "user of the server")
            elif self.token:
                hint = "check the token (NATS_TOKEN)"
            elif self.user or self.password:
                hint = "check the user and password (NATS_USER / NATS_PASSWORD)"
            else:
                hint = "check the credentials in the server URL"
            return self._error(NatsAuthError, f"authorization violation at {where}: the server "
                               f"rejected {self.auth_mode}; {hint}")
        if isinstance(e, ssl.SSLCertVerificationError):
            reason = self.scrub(e.verify_message or "certificate verify failed")
            hint = (f"check tls_ca ({self.tls_ca}): it must be the CA that signed the server's "
                    "certificate" if self.tls_ca else
                    "the server uses TLS: give tls_ca, the CA that signed its certificate")
            return self._error(NatsTLSError, f"TLS with {where}: certificate verify failed "
                               f"({reason}); {hint}")
        if isinstance(e, ssl.SSLError):
            reason = self.scrub(e.reason or text)
            if self.tls_cert or any(w in low for w in ("certificate required",
                                                       "certificate_required",
                                                       "handshake failure")):
                hint = self._client_cert_hint()
            else:
                hint = "check the TLS options (tls_ca, tls_cert, tls_key)"
            return self._error(NatsTLSError, f"TLS with {where} failed ({reason}); {hint}")
        if (server_info or {}).get("tls_verify") and isinstance(
                e, ConnectionResetError | BrokenPipeError | ConnectionAbortedError | EOFError):
            # TLS 1.3: the server checks our certificate after the handshake and drops the
            # connection; the client sees its alert (above) or, by timing, a reset.
            return self._error(NatsTLSError, f"TLS with {where}: the server closed the "
                               f"connection after the handshake ({type(e).__name__}); "
                               f"{self._client_cert_hint()}")
        return None

    def _error_cb(self, state: dict[str, bool], nc: Client) -> ErrorCallback:
        async def error_cb(e: Exception) -> None:
            if state["connecting"]:
                err = self._explain(e, nc._server_info)
                if err is not None:
                    raise _Fatal(e, err)  # stops nats-py's connect loop at this attempt
                _log.debug("nats %s: %s: %s", self.display_servers, type(e).__name__,
                           self.scrub(" ".join(str(e).split())))
                return
            _log.warning("nats %s: %s: %s", self.display_servers, type(e).__name__,
                         self.scrub(" ".join(str(e).split())))

        return error_cb

    async def connect(self) -> Client:
        """Connect; once connected, a lost connection is re-established as
        ``reconnect_attempts`` / ``reconnect_wait_s`` say (default: without end).

        An unreachable server is retried (2 s apart, 3 times) before failing; rejected
        credentials and TLS failures fail at the first attempt (within ``connect_timeout``
        seconds, plus up to 1 s to close). The whole call is bounded by
        ``4 * servers * (3 * connect_timeout + 2)`` seconds.

        Raises:
            NatsAuthError: the server rejected the credentials.
            NatsTLSError: TLS files unusable, certificate verification failed, a client
                certificate is required, or the server is not TLS though TLS was asked for.
            NatsConnectError: a creds / NKey seed file is unreadable or malformed, or no
                connection within the bound above.
            nats.errors.NoServersError: no server could be reached.
        """
        tls = self.tls_context()
        self._check_credential_files()
        state = {"connecting": True}
        nc = Client()
        servers = self.server_list()
        # Guard against a hang (e.g. a server that accepts TCP and never answers): every attempt
        # of every server, each up to 3 connect timeouts (TCP, INFO, TLS) plus the wait between.
        limit_s = ((_MAX_RECONNECT_ATTEMPTS + 1) * max(1, len(servers))
                   * (3 * self.connect_timeout + _RECONNECT_TIME_WAIT_S))
        try:
            await asyncio.wait_for(nc.connect(
                servers=servers,
                user=self.user,
                password=self.password,
                token=self.token,
                user_credentials=self.creds,
                nkeys_seed=self.nkey_seed if not self.creds else None,
                tls=tls,
                connect_timeout=self.connect_timeout,  # type: ignore[arg-type]
                allow_reconnect=True,
                max_reconnect_attempts=_MAX_RECONNECT_ATTEMPTS,
                reconnect_time_wait=_RECONNECT_TIME_WAIT_S,  # type: ignore[arg-type]
                name=self.name,
                error_cb=self._error_cb(state, nc),
            ), limit_s)
        except _Fatal as f:
            await close_quietly(nc)
            raise f.error from f.cause
        except TimeoutError:
            await close_quietly(nc)
            raise self._error(NatsConnectError, f"no NATS connection to {self.display_servers} "
                              f"within {limit_s:g} s ({self.auth_mode})") from None
        except BaseException:
            await close_quietly(nc)
            raise
        finally:
            state["connecting"] = False
        if not nc.is_connected:  # the server closed instead of answering PING (no PONG, no -ERR)
            await close_quietly(nc)
            if nc._server_info.get("tls_verify"):
                raise self._error(NatsTLSError, f"TLS with {self.display_servers}: the server "
                                  "closed the connection after the handshake; "
                                  f"{self._client_cert_hint()}")
            raise self._error(NatsConnectError, f"{self.display_servers} closed the connection "
                              f"during the handshake ({self.auth_mode})")
        # nats-py upgrades to TLS only when the server's INFO says tls_required.
        if tls is not None and not nc._server_info.get("tls_required"):
            await close_quietly(nc)
            raise self._error(NatsTLSError, f"{self.display_servers} does not use TLS but TLS "
                              "options were given; refusing a plaintext connection")
        # The first connection is bounded (above); a lost one is retried as configured
        # (nats-py reads these options at each reconnect).
        nc.options["max_reconnect_attempts"] = self.reconnect_attempts
        nc.options["reconnect_time_wait"] = self.reconnect_wait_s
        _MADE_WITH[nc] = self
        return nc


_MADE_WITH: weakref.WeakKeyDictionary[Client, ConnectOptions] = weakref.WeakKeyDictionary()
"""The options each live client made by :meth:`ConnectOptions.connect` was made with."""


def connect_options_of(nc: Client) -> ConnectOptions | None:
    """The :class:`ConnectOptions` whose :meth:`~ConnectOptions.connect` made ``nc``, or None
    for a client made otherwise (e.g. ``nats.connect``). nats-py keeps the credentials files,
    NKey seeds and callbacks a client was given on private attributes only; this is how the
    library knows them for a connection it made (the engine ships them to Spark executors).
    Holds secrets: never log it whole (its ``repr`` hides them)."""
    return _MADE_WITH.get(nc)


async def close_quietly(nc: Client) -> None:
    """Close a client, never raising and within 1 s: after a failed TLS upgrade nats-py waits
    forever for the plain socket's close, and closing a client whose connection was lost
    raises ``ConnectionResetError`` (nats-py 2.16). Use it in ``finally`` blocks so a close
    never hides the error that ended the work."""
    try:
        await asyncio.wait_for(nc.close(), _CLOSE_TIMEOUT_S)
    except Exception:  # best effort (TimeoutError included)
        pass
