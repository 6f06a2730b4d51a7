"""``cg static|elastic consume|join``: run a streaming member of a group from the shell."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass

import click
import nats.errors
from nats.js import JetStreamContext

from cg_pipelines.cli.context import Ctx, fail
from cg_pipelines.jetstream.members import (
    ConsumeHandle,
    GroupMsg,
    MemberConfig,
    elastic_consume,
    static_consume,
)

__all__ = ["MemberRun", "add_member_commands", "message_line", "payload_text"]


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



def add_member_commands(kind: str, grp: click.Group) -> None:
    """Add ``consume`` and ``join`` to the ``static`` or ``elastic`` command group."""
    for name in ("consume", "join"):
        _member_command(kind, grp, name)
