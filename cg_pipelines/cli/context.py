"""What every ``cg`` command shares: connection options (accepted before the command group
and after the command, e.g. ``cg elastic add --server nats://host:4222 S G m1``), the connected
run with one-line errors and exit codes, and output as text or JSON.

Exit codes: 0 ok; 2 invalid input or a missing/conflicting group (one-line error, nothing
written); 1 server or connection failure.

Errors: one line ``cg: error: <message>`` on stderr; with ``--json`` instead one JSON object
``{"error": "<message>", "exit_code": <n>}`` on **stdout** (where a script reads the JSON
output), nothing on stderr. Tables are aligned (:func:`table`).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click
import nats.errors

from cg_pipelines.core.errors import (
    ConcurrentUpdateError,
    ConfigError,
    GroupExistsError,
    GroupNotFoundError,
    MembershipError,
)
from cg_pipelines.jetstream.connect import ConnectOptions, NatsConnectError
from cg_pipelines.jetstream.errors import JetStreamError

T = TypeVar("T")
INPUT_ERRORS = (ConfigError, GroupNotFoundError, GroupExistsError, MembershipError)

# (flags, destination, click options) of every connection setting; the group reads the
# environment and defaults, a command's own flags (no env, no default) override them.
_SETTINGS: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
    (("--server", "-s"), "server", dict(envvar="NATS_URL", default="nats://127.0.0.1:4222",
                                        help="NATS URL(s), comma separated (env NATS_URL).")),
    (("--user",), "user", dict(envvar="NATS_USER", help="User name (env NATS_USER).")),
    (("--password",), "password", dict(envvar="NATS_PASSWORD",
                                       help="Password (env NATS_PASSWORD).")),
    (("--token",), "token", dict(envvar="NATS_TOKEN", help="Auth token (env NATS_TOKEN).")),
    (("--creds",), "creds", dict(envvar="NATS_CREDS", type=click.Path(dir_okay=False),
                                 help="Credentials (.creds) file (env NATS_CREDS).")),
    (("--nkey",), "nkey", dict(envvar="NATS_NKEY", type=click.Path(dir_okay=False),
                               help="NKey seed file (env NATS_NKEY).")),
    (("--tls-ca",), "tls_ca", dict(envvar="NATS_CA", type=click.Path(dir_okay=False),
                                   help="CA file to verify the server's certificate "
                                   "(env NATS_CA).")),
    (("--tls-cert",), "tls_cert", dict(envvar="NATS_CERT", type=click.Path(dir_okay=False),
                                       help="Client certificate (env NATS_CERT).")),
    (("--tls-key",), "tls_key", dict(envvar="NATS_KEY", type=click.Path(dir_okay=False),
                                     help="Client key (env NATS_KEY).")),
    (("--timeout",), "timeout", dict(type=float, default=5.0,
                                     help="Seconds per server call (default 5).")),
    (("--json",), "as_json", dict(is_flag=True, default=False,
                                            help="JSON output for scripting.")),
]


class Ctx:
    """The settings of one ``cg`` invocation (group-level values, then command overrides)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = dict(settings)

    @property
    def opts(self) -> ConnectOptions:
        s = self.settings
        return ConnectOptions(s["server"], s["user"], s["password"], s["token"], s["creds"],
                              s["tls_ca"], s["tls_cert"], s["tls_key"],
                              connect_timeout=s["timeout"], name="cg", nkey_seed=s["nkey"])

    @property
    def timeout(self) -> float:
        return float(self.settings["timeout"])

    @property
    def as_json(self) -> bool:
        return bool(self.settings["as_json"])

    def run(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Connect, run ``fn(js)``, close; map errors to one-line messages and exit codes."""
        opts = self.opts

        async def main() -> T:
            nc = await opts.connect()
            try:
                return await fn(nc.jetstream(timeout=self.timeout))
            finally:
                await nc.close()

        try:
            return asyncio.run(main())
        except GroupNotFoundError as e:
            fail(f"{e}: check the stream and group names (`cg {e.kind} ls {e.stream}` lists "
                 "the stream's groups)", 2)
        except INPUT_ERRORS as e:
            fail(str(e), 2)
        except JetStreamError as e:
            fail(str(e), 2 if e.status in (400, 404) else 1)
        except NatsConnectError as e:  # rejected credentials, TLS: names the problem, no secret
            fail(str(e), 1)
        except (nats.errors.NoServersError, OSError) as e:
            fail(opts.unreachable_message(e), 1)
        except (TimeoutError, ConcurrentUpdateError, nats.errors.Error) as e:
            fail(opts.scrub(f"{type(e).__name__}: {e}"), 1)

    def out(self, obj: Any, text: str) -> None:
        click.echo(json.dumps(obj, indent=2, sort_keys=True) if self.as_json else text)


def json_wanted() -> bool:
    """Whether this invocation asked for ``--json`` (given before or after the command)."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_object(Ctx) if ctx is not None else None
    if obj is not None:
        return obj.as_json
    return "--json" in sys.argv[1:]


def fail(msg: str, code: int) -> NoReturn:
    """Print ``cg: error: <msg>`` on stderr (with ``--json``: ``{"error": msg, "exit_code":
    code}`` on stdout) and exit with ``code``."""
    if json_wanted():
        click.echo(json.dumps({"error": msg, "exit_code": code}))
    else:
        click.echo(f"cg: error: {msg}", err=True)
    sys.exit(code)


def table(columns: Sequence[str], rows: Sequence[Sequence[object]],
          right: Sequence[str] = ()) -> str:
    """``rows`` under ``columns`` as an aligned text table in the ``nats`` CLI's plain style: a
    header, a rule (``─``) under it, one line per row, columns three spaces apart, each as
    wide as its widest cell (never wrapped or cut), no trailing blanks. Columns named in
    ``right`` are right-aligned (numbers). ``None`` cells print as ``-``.

    Own code rather than ``rich``: rich's tables took ~5 s for a 4096-partition
    ``cg backlog`` on this machine; this takes milliseconds."""
    cells = [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "   ".join(v.rjust(w) if c in right else v.ljust(w)
                          for v, w, c in zip(values, widths, columns, strict=True)).rstrip()

    return "\n".join([line(list(columns)), "─" * (sum(widths) + 3 * (len(widths) - 1)),
                      *(line(r) for r in cells)])


def group_connection_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The connection options of the top-level group (environment and defaults)."""
    for flags, dest, kw in reversed(_SETTINGS):
        f = click.option(*flags, dest, show_default="default" in kw and not kw.get("is_flag"),
                         **kw)(f)
    return f


def _override(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is None or value is False:
        return
    obj = ctx.find_object(Ctx)
    if obj is not None and param.name is not None:
        obj.settings[param.name] = value


def add_command_connection_options(cmd: click.Command) -> None:
    """Give ``cmd`` (and, for a group, every command under it) the same connection options:
    given after the command, they override the group-level values."""
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            add_command_connection_options(sub)
        return
    for flags, dest, kw in _SETTINGS:
        own = {k: v for k, v in kw.items() if k in ("type", "is_flag", "help")}
        cmd.params.append(click.Option([*flags, dest], default=None, expose_value=False,
                                       callback=_override, **own))
