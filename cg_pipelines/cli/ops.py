"""Operator commands: ``cg backlog``, ``cg dlq ls|show|replay|purge``, ``cg halt show|skip`` and
``cg reconcile`` (elastic groups). Each takes the connection options and ``--json``.

- ``cg backlog S G``: per partition, pending messages, first pending sequence, age of the
  oldest, and the consumer holding it (pinned client id, messages awaiting ack).
- ``cg dlq ls S G [-p P]``: the dead letters (sequence, partition, source sequence, subject,
  reason; at most ``--limit``, saying when there are more); ``cg dlq show S G SEQ``: one of
  them with every header and a payload preview;
  ``cg dlq replay S G SEQ... | --all --reorder-ok``: publish them again on their subject into
  the origin stream (they are processed after everything already in their partition: later
  than newer events of the same key), then remove them from the dead-letter stream;
  ``cg dlq purge S G [-p P | --seq N] --force``.
- ``cg halt show S G P``: the message a partition stops at (its first pending one) and, when
  the halted run left its note, the error it halted with;
  ``cg halt skip S G P --seq N --reason TEXT``: move it to the dead-letter stream (``Cg-Error``:
  the error it halted with; ``Cg-Skip-Reason``: TEXT), so the partition's next run goes on
  after it.
- ``cg reconcile S G --table T``: origin messages the group's filters match that never reached
  the work queue or were never accounted for by a commit, from the cursor stored beside the
  table (or ``--from-seq/--to-seq``, ``--all``); exit 1 with the origin ranges, partitions and
  repair when there are any; a sourcing stall is reported as such, not as a gap
  (docs/reconcile.md).

Every command first checks the group exists (a typo names stream and group and says how to
list the groups) and that a named partition is one of its partitions (the error names the
valid range). A group that never dead-lettered a message has no dead-letter stream:
``dlq ls`` says there are none, ``dlq show|replay|purge`` say so with exit 2.

Exit codes as every ``cg`` command: 0 ok; 2 invalid input or missing group/stream/message;
1 server or connection failure (and, for ``reconcile``, a gap found).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
import pyarrow.fs as pafs
from nats.js import JetStreamContext

from cg_pipelines.cli.context import Ctx, fail, table
from cg_pipelines.core.config import dlq_stream_name, work_queue_stream_name
from cg_pipelines.core.errors import UsageError
from cg_pipelines.engine import deadletter as dl
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import partition_backlog, partition_holders
from cg_pipelines.jetstream.errors import StreamNotFoundError

__all__ = ["OPS_COMMANDS", "backlog", "dlq", "halt", "reconcile"]

T = TypeVar("T")

REORDER_NOTE = (
    "a replayed message is published again into the origin stream, so it is processed after "
    "every message already in its partition, including later events of its own key: per-key "
    "order is NOT kept for it")


def _run(c: Ctx, fn: Callable[[JetStreamContext, JetStreamAPI], Awaitable[T]]) -> T:
    """``c.run`` with a raw API on the same connection; ``ValueError`` is invalid input
    (exit 2)."""
    async def go(js: JetStreamContext) -> T:
        api = JetStreamAPI.from_js(js, c.timeout)
        try:
            return await fn(js, api)
        finally:
            await api.close()
    try:
        return c.run(go)
    except ValueError as e:
        fail(str(e), 2)


async def _partitions(c: Ctx, js: JetStreamContext, stream: str, group: str,
                      partitions: tuple[int, ...] | list[int] = ()) -> int:
    """The elastic group's partition count, after checking it exists (``GroupNotFoundError``
    names it) and that every one of ``partitions`` is in range (``UsageError`` naming the
    valid range)."""
    n = (await admin.get_elastic(js, stream, group, timeout=c.timeout)).config.max_members
    bad = [p for p in partitions if not 0 <= p < n]
    if bad:
        raise UsageError(f"partition {bad[0]} out of range: {stream}.{group} has partitions "
                         f"0..{n - 1}")
    return n


def _no_work_queue(stream: str, group: str) -> UsageError:
    return UsageError(f"work-queue stream {work_queue_stream_name(stream, group)} of group "
                      f"{group} on stream {stream} does not exist: the group's config is there "
                      "but its stream is not (recreate the group, e.g. `cg elastic delete` then "
                      "`cg elastic create`)")


def _no_dlq(stream: str, group: str) -> UsageError:
    return UsageError(f"no dead letters: {dlq_stream_name(stream, group)} does not exist "
                      f"(group {group} on stream {stream} never dead-lettered a message)")


# ------------------------------------------------------------------------------------- backlog


@click.command("backlog")
@click.argument("stream")
@click.argument("group")
@click.option("--partition", "-p", "partitions", type=int, multiple=True,
              help="Only these partitions (repeat); default all.")
@click.pass_obj
def backlog(c: Ctx, stream: str, group: str, partitions: tuple[int, ...]) -> None:
    """Per-partition backlog of elastic GROUP: pending, oldest age, holder."""
    async def go(js: JetStreamContext, api: JetStreamAPI) -> list[dict[str, Any]]:
        n = await _partitions(c, js, stream, group, partitions)
        parts = list(partitions) or list(range(n))
        rows = await partition_backlog(api, stream, group, parts)
        holders = await partition_holders(api, work_queue_stream_name(stream, group), parts)
        out = []
        for r in rows:
            hs = holders.get(r.partition, [])
            out.append({
                "partition": r.partition, "pending": r.pending, "first_seq": r.first_seq,
                "oldest_age_s": round(r.age_s, 3),
                "holders": [{"consumer": h.consumer, "pinned_id": h.pinned_id,
                             "pinned_since": h.pinned_since, "ack_pending": h.ack_pending}
                            for h in hs],
            })
        return out

    rows = _run(c, go)
    lines = []
    for r in rows:
        hs = r["holders"]
        if not hs:
            who = "-"
        else:
            h = hs[0]
            who = h["consumer"] + (f" (pinned {h['pinned_id']}" if h["pinned_id"]
                                   else " (not pinned")
            who += f", {h['ack_pending']} awaiting ack)" + (
                f" +{len(hs) - 1} more" if len(hs) > 1 else "")
        age = f"{r['oldest_age_s']:.1f} s" if r["pending"] else "-"
        lines.append([r["partition"], r["pending"], r["first_seq"], age, who])
    c.out(rows, table(["partition", "pending", "first seq", "oldest", "holder"], lines,
                      right=["partition", "pending", "first seq", "oldest"]))


# ------------------------------------------------------------------------------------------ dlq


@click.group("dlq")
def dlq() -> None:
    """Dead letters of an elastic group (stream <stream>-<group>-dlq)."""


@dlq.command("ls")
@click.argument("stream")
@click.argument("group")
@click.option("--partition", "-p", type=int, default=None, help="Only this partition.")
@click.option("--start", "start_seq", type=int, default=1, show_default=True,
              help="First dead-letter sequence to list.")
@click.option("--limit", type=int, default=100, show_default=True, help="Most to list.")
@click.pass_obj
def dlq_ls(c: Ctx, stream: str, group: str, partition: int | None, start_seq: int,
           limit: int) -> None:
    """List dead letters: sequence, partition, source sequence, subject, reason."""
    if limit < 1:
        fail("--limit must be >= 1", 2)
    async def go(js: JetStreamContext, api: JetStreamAPI) -> list[dl.StoredDeadLetter]:
        await _partitions(c, js, stream, group, [] if partition is None else [partition])
        try:
            # one more than shown: whether there are more than --limit
            return await dl.list_dead_letters(api, stream, group, partition=partition,
                                              start_seq=start_seq, limit=limit + 1)
        except StreamNotFoundError:
            return []  # nothing was ever dead-lettered: no dead-letter stream yet

    got = _run(c, go)
    rows, more = got[:limit], len(got) > limit
    name = dlq_stream_name(stream, group)
    text = table(["seq", "partition", "source seq", "subject", "reason"],
                 [[d.seq, d.partition, d.source_seq, d.origin_subject or d.subject,
                   (d.reason or "") + (f" [skipped: {d.skip_reason}]" if d.skip_reason else "")]
                  for d in rows], right=["seq", "partition", "source seq"])
    if more:
        where = "" if partition is None else f" -p {partition}"
        text += (f"\nmore dead letters than the {limit} shown; the next ones: "
                 f"cg dlq ls {stream} {group}{where} --start {rows[-1].seq + 1}")
    c.out([d.as_dict() for d in rows], text if rows else f"no dead letters in {name}")


async def _dlq(c: Ctx, js: JetStreamContext, stream: str, group: str,
               call: Callable[[], Awaitable[T]], partition: int | None = None) -> T:
    """``call`` on the group's dead-letter stream after checking the group exists (and
    ``partition`` is one of its partitions); a missing dead-letter stream is a ``UsageError``
    saying there are none."""
    await _partitions(c, js, stream, group, [] if partition is None else [partition])
    try:
        return await call()
    except StreamNotFoundError:
        raise _no_dlq(stream, group) from None


@dlq.command("show")
@click.argument("stream")
@click.argument("group")
@click.argument("seq", type=int)
@click.option("--preview", "preview_bytes", type=int, default=512, show_default=True,
              help="Payload bytes to show.")
@click.pass_obj
def dlq_show(c: Ctx, stream: str, group: str, seq: int, preview_bytes: int) -> None:
    """Show dead letter SEQ: subject, reason, headers, payload preview."""
    d = _run(c, lambda js, api: _dlq(c, js, stream, group,
                                     lambda: dl.get_dead_letter(api, stream, group, seq)))
    lines = [f"dead letter {d.seq} of {dlq_stream_name(stream, group)}",
             f"  partition:  {d.partition}",
             f"  source:     {d.source_stream} sequence {d.source_seq}",
             f"  subject:    {d.origin_subject}",
             f"  reason:     {d.reason}",
             *([f"  skipped:    {d.skip_reason}"] if d.skip_reason else []),
             f"  stored:     {d.as_dict()['time']}",
             "  headers:"]
    lines += [f"    {k}: {v}" for k, v in sorted(d.headers.items())]
    lines += [f"  payload ({len(d.data)} bytes): {d.preview(preview_bytes)}"]
    c.out(d.as_dict(preview_bytes), "\n".join(lines))


@dlq.command("replay")
@click.argument("stream")
@click.argument("group")
@click.argument("seqs", type=int, nargs=-1)
@click.option("--all", "replay_all", is_flag=True, help="Every dead letter (of --partition).")
@click.option("--partition", "-p", type=int, default=None, help="With --all: only this one.")
@click.option("--reorder-ok", is_flag=True,
              help="Required: accept that replayed messages lose their per-key order.")
@click.pass_obj
def dlq_replay(c: Ctx, stream: str, group: str, seqs: tuple[int, ...], replay_all: bool,
               partition: int | None, reorder_ok: bool) -> None:
    """Publish dead letters again into the origin stream (then remove them here).

    They are processed after everything already in their partition: after newer events of
    the same key. Pass --reorder-ok to accept that.
    """
    if not seqs and not replay_all:
        fail("name dead-letter sequences or give --all", 2)
    if seqs and replay_all:
        fail("give sequences or --all, not both", 2)
    if not reorder_ok:
        fail(f"{REORDER_NOTE}; pass --reorder-ok to replay anyway", 2)

    async def go(js: JetStreamContext, api: JetStreamAPI) -> list[dl.Replayed]:
        await _partitions(c, js, stream, group, [] if partition is None else [partition])
        try:
            await api.stream_info(dlq_stream_name(stream, group))
        except StreamNotFoundError:
            raise _no_dlq(stream, group) from None
        todo = list(seqs)
        if replay_all:
            start = 1
            while True:
                batch = await dl.list_dead_letters(api, stream, group, partition=partition,
                                                   start_seq=start, limit=1000)
                todo += [d.seq for d in batch]
                if len(batch) < 1000:
                    break
                start = batch[-1].seq + 1
        return [await dl.replay_dead_letter(js, api, stream, group, s, timeout=c.timeout)
                for s in todo]

    done = _run(c, go)
    text = [f"replayed dead letter {r.dlq_seq} on {r.subject} as origin sequence "
            f"{r.origin_seq if r.origin_seq is not None else '(duplicate of an earlier replay)'}"
            for r in done] or ["no dead letters to replay"]
    c.out({"replayed": [{"dlq_seq": r.dlq_seq, "subject": r.subject,
                         "origin_seq": r.origin_seq} for r in done],
           "ordering": REORDER_NOTE}, "\n".join(text))


@dlq.command("purge")
@click.argument("stream")
@click.argument("group")
@click.option("--partition", "-p", type=int, default=None, help="Only this partition's.")
@click.option("--seq", type=int, default=None, help="Only this dead letter.")
@click.option("--force", "-f", is_flag=True, help="Required: really remove them.")
@click.pass_obj
def dlq_purge(c: Ctx, stream: str, group: str, partition: int | None, seq: int | None,
              force: bool) -> None:
    """Remove dead letters (all, one partition's, or one) for good."""
    if partition is not None and seq is not None:
        fail("give --partition or --seq, not both", 2)
    if not force:
        what = (f"dead letter {seq}" if seq is not None else
                f"partition {partition}'s dead letters" if partition is not None
                else "every dead letter")
        fail(f"this removes {what} of {dlq_stream_name(stream, group)} for good; pass "
             "--force", 2)
    n = _run(c, lambda js, api: _dlq(c, js, stream, group, lambda: dl.purge_dead_letters(
        api, stream, group, partition=partition, seq=seq), partition))
    c.out({"purged": n}, f"purged {n} dead letter(s) from {dlq_stream_name(stream, group)}")


# ----------------------------------------------------------------------------------------- halt


@click.group("halt")
def halt() -> None:
    """A partition halted at a bad message (dead_letter_policy="halt"): show it, skip it."""


@halt.command("show")
@click.argument("stream")
@click.argument("group")
@click.argument("partition", type=int)
@click.pass_obj
def halt_show(c: Ctx, stream: str, group: str, partition: int) -> None:
    """The message PARTITION stops at: its first pending message in the work queue."""
    async def go(js: JetStreamContext, api: JetStreamAPI) -> dict[str, Any]:
        await _partitions(c, js, stream, group, [partition])
        wq = work_queue_stream_name(stream, group)
        try:
            got = await api.msg_get(wq, seq=1, next_by_subj=f"{partition}.>")
        except StreamNotFoundError:
            raise _no_work_queue(stream, group) from None
        if got is None:
            return {"partition": partition, "seq": None}
        d = dl.StoredDeadLetter.of(got)
        note = await dl.halt_note(api, stream, group, partition, got.seq)
        return {"partition": partition, "seq": got.seq, "subject": got.subject.partition(".")[2],
                "size": len(got.data), "payload_preview": d.preview(512),
                "headers": {k: v for k, v in (got.headers or {}).items()},
                "halted_with": (note.headers or {}).get("Cg-Error") if note else None}

    r = _run(c, go)
    if r["seq"] is None:
        c.out(r, f"partition {partition} has no pending message")
        return
    c.out(r, f"partition {partition} stops at work-queue sequence {r['seq']} on "
             f"{r['subject']} ({r['size']} bytes): {r['payload_preview']}"
             + (f"\nthe run halted with: {r['halted_with']}" if r["halted_with"] else ""))


@halt.command("skip")
@click.argument("stream")
@click.argument("group")
@click.argument("partition", type=int)
@click.option("--seq", type=int, default=None,
              help="Work-queue sequence the run halted at (its 'halted at sequence N'); "
                   "default: the partition's first pending message.")
@click.option("--reason", required=True,
              help="Why (stored as the dead letter's Cg-Skip-Reason; its Cg-Error keeps the "
                   "error the run halted with).")
@click.pass_obj
def halt_skip(c: Ctx, stream: str, group: str, partition: int, seq: int | None,
              reason: str) -> None:
    """Move the message PARTITION halted at to the dead-letter stream; the next run goes on."""
    async def go(js: JetStreamContext, api: JetStreamAPI) -> dl.Skipped:
        await _partitions(c, js, stream, group, [partition])
        try:
            return await dl.skip_message(js, api, stream, group, partition, reason, seq=seq,
                                         timeout=c.timeout)
        except StreamNotFoundError:
            raise _no_work_queue(stream, group) from None

    s = _run(c, go)
    c.out({"partition": s.partition, "seq": s.seq, "subject": s.subject, "dlq_seq": s.dlq_seq,
           "dlq": dlq_stream_name(stream, group)},
          f"moved work-queue sequence {s.seq} ({s.subject}) of partition {s.partition} to "
          f"{dlq_stream_name(stream, group)}"
          + (f" as sequence {s.dlq_seq}" if s.dlq_seq is not None else " (already there)")
          + "; the partition's next run goes on after it")


# ------------------------------------------------------------------------------------ reconcile


@click.command("reconcile")
@click.argument("stream")
@click.argument("group")
@click.option("--table", default=None,
              help="The group's Delta table (directory or s3://...): the coverage each commit "
                   "records proves which messages were accounted for, and the check's cursor "
                   "is stored beside it. Without it, only valid before any run.")
@click.option("--storage-option", "storage_options", multiple=True,
              help="key=value for the table's object store (e.g. AWS_ENDPOINT_URL=...); "
                   "repeat.")
@click.option("--seq-column", default=None,
              help="Also count this column of the table's rows (each row's origin sequence) "
                   "as covered: for an append table written before coverage was recorded.")
@click.option("--from-seq", type=int, default=None,
              help="Check from this origin sequence (a range check: the stored cursor is "
                   "neither used nor changed).")
@click.option("--to-seq", type=int, default=None,
              help="Check up to this origin sequence (default: the origin's last).")
@click.option("--all", "whole", is_flag=True,
              help="Check the whole history from the origin's first message (the stored "
                   "cursor is neither used nor changed).")
@click.option("--restart", is_flag=True,
              help="Forget the stored cursor first (e.g. after a log cleanup error).")
@click.option("--max-messages", type=int, default=500_000, show_default=True,
              help="Origin messages read per chunk (the check goes on chunk after chunk).")
@click.option("--grace", "grace_s", type=float, default=10.0, show_default=True,
              help="Seconds a message may take to reach the work queue before a missing one "
                   "at the origin's very end counts as a gap.")
@click.pass_obj
def reconcile(c: Ctx, stream: str, group: str, table: str | None,
              storage_options: tuple[str, ...], seq_column: str | None, from_seq: int | None,
              to_seq: int | None, whole: bool, restart: bool, max_messages: int,
              grace_s: float) -> None:
    """Origin messages of GROUP's filters that reached its work queue but no commit accounted
    for, over the history since the stored cursor (or a range, or --all): exit 1 with the
    origin ranges, partitions and repair when there are any. A sourcing stall (the work
    queue's source behind) is reported as such, never as a gap (exit 0)."""
    from cg_pipelines.core.coverage import ReconcileCursor
    from cg_pipelines.core.reconcile import ReconcileReport
    from cg_pipelines.engine.coverage_log import DeltaLogCoverage
    from cg_pipelines.jetstream.reconcile import reconcile_group, sink_table_seqs
    from cg_pipelines.sinks.delta import DeltaSink
    from cg_pipelines.sinks.storage import table_filesystem

    opts: dict[str, str] = {}
    for item in storage_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--storage-option takes key=value, got {item!r}", 2)
        opts[key] = value
    if whole and from_seq is not None:
        fail("--all and --from-seq exclude each other", 2)
    log = seqs = None
    if table is not None:
        fs = table_filesystem(table, opts)
        if fs is None:
            fail(f"--table {table!r}: only local paths and s3:// tables are supported", 2)
        assert fs is not None
        try:
            found = fs.get_file_info("_delta_log").type
        except OSError as e:
            fail(f"--table {table!r}: cannot read it: {e}", 1)
            raise
        if found != pafs.FileType.Directory:
            fail(f"--table {table!r}: no Delta table there (no _delta_log): check the path "
                 "(and --storage-option for s3://)", 2)
        log = DeltaLogCoverage(fs, stream, group)
        if seq_column is not None:
            seqs = sink_table_seqs(DeltaSink(table, storage_options=opts or None), seq_column)
    ranged = whole or from_seq is not None or to_seq is not None
    if restart and log is not None:
        log.delete_cursor()
    cursor = None if ranged or log is None else log.load_cursor()
    if cursor is None:
        first = 1 if whole or log is not None else None
        cursor = ReconcileCursor(origin_through=max(0, (from_seq or first or 1) - 1))
        if from_seq is None and first is None:  # no table: the last --max-messages
            cursor = None

    async def check(js: JetStreamContext, api: JetStreamAPI) -> ReconcileReport:
        nonlocal cursor
        first_from = None
        while True:
            rep = await reconcile_group(js, api, stream, group, coverage=log, cursor=cursor,
                                        table_seqs=seqs, to_seq=to_seq,
                                        max_messages=max_messages, grace_s=grace_s)
            first_from = rep.from_seq if first_from is None else first_from
            if cursor is None or not rep.partial or rep.stall is not None:
                return dataclasses.replace(rep, from_seq=first_from)

    rep = _run(c, check)
    if log is not None and cursor is not None and not ranged:
        log.save_cursor(cursor)
    c.out(rep.as_dict(), rep.text())
    if not rep.ok:
        raise SystemExit(1)


OPS_COMMANDS: tuple[click.Command, ...] = (backlog, dlq, halt, reconcile)
"""The commands this module adds to ``cg`` (registered in :mod:`cg_pipelines.cli`)."""
