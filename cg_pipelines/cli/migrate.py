"""``cg elastic migrate STREAM GROUP --partitions V``: move an elastic group to a new partition
count online (:mod:`cg_pipelines.jetstream.migration`); ``--dry-run`` prints the plan and
writes nothing; run it again to resume a migration that stopped or was killed.

Exit codes as every ``cg`` command: 0 done; 2 invalid input, a missing group, or a migration
to another count running; 1 server or connection failure; 3 a step must wait longer (the work
queue not drained yet, no message of the new layout yet, or the cut unknown): run it again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
from nats.js import JetStreamContext

from cg_pipelines.cli.context import Ctx, fail
from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.core.errors import MigrationError, StateError
from cg_pipelines.core.migration import STEPS, Lineage, check_target, plan_lines
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.migration import MigrationOptions, get_migration, migrate_set

__all__ = ["migrate_command"]

T = TypeVar("T")


def _run(c: Ctx, fn: Callable[[JetStreamContext], Awaitable[T]]) -> T:
    """``c.run(fn)`` with the migration's own exit codes (module docstring)."""
    try:
        return c.run(fn)
    except MigrationError as e:
        fail(str(e), 3)
    except StateError as e:
        fail(str(e), 2)


@click.command("migrate")
@click.argument("stream")
@click.argument("group")
@click.option("--partitions", "to_partitions", type=int, required=True,
              help="The new partition count (max_members).")
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")
@click.option("--drain-timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the old layout's runs to drain the work queue.")
@click.option("--first-message-timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the new layout's first message.")
@click.option("--co-partitioned", "others", type=(str, str), multiple=True,
              metavar="STREAM GROUP",
              help="Another group of GROUP's co-partitioned set, migrated with it step by step "
                   "(repeat for each).")
@click.option("--cut-origin-seq", type=int, default=None,
              help="The first origin sequence of the new layout, when the work queue cannot "
                   "tell it (the command says when).")
@click.pass_obj
def migrate_command(c: Ctx, stream: str, group: str, to_partitions: int, dry_run: bool,
                    drain_timeout: float, first_message_timeout: float,
                    others: tuple[tuple[str, str], ...], cut_origin_seq: int | None) -> None:
    """Migrate GROUP to --partitions partitions with traffic flowing: the work queue's source is
    cut at an exact origin sequence, runs of the old layout drain it, the reference KV config
    gets the new count (reference members stop: restart them), the source comes back with the
    new partitioning from the cut. Keep your runs going meanwhile; change your code's partition
    count when it is done. Resumable: run it again after any failure. A co-partitioned set
    migrates all its groups together (--co-partitioned for each other group)."""
    groups = [(stream, group), *others]
    if cut_origin_seq is not None and len(groups) > 1:
        fail("--cut-origin-seq names one group's cut: migrate the set without it, or finish "
             "the group that needs it alone", 2)
    if dry_run:
        async def plan(js: JetStreamContext) -> dict[str, Any]:
            cfg = (await admin.get_elastic(js, stream, group, timeout=c.timeout)).config
            rec = await get_migration(js, stream, group)
            if rec is None:
                check_target(cfg, to_partitions)
            elif rec.to_partitions != to_partitions:
                raise StateError(f"{stream}.{group}: a migration to {rec.to_partitions} "
                                 f"partitions is at step {rec.step!r}: finish it first")
            info = await JetStreamAPI.from_js(js).stream_info(
                work_queue_stream_name(stream, group))
            backlog = int(info["state"].get("messages") or 0)
            start = cfg.max_members if rec is None else rec.from_partitions
            done = () if rec is None else STEPS[:STEPS.index(rec.step) + 1]
            return {"from_partitions": start, "to_partitions": to_partitions,
                    "backlog": backlog, "done": list(done),
                    "lines": plan_lines(stream, group, start, to_partitions, backlog, done,
                                        mapped=bool(cfg.member_mappings))}

        got = _run(c, plan)
        c.out({k: v for k, v in got.items() if k != "lines"},
              "dry run, nothing written\n" + "\n".join(got["lines"]))
        return

    opts = MigrationOptions(drain_timeout_s=drain_timeout,
                            first_message_timeout_s=first_message_timeout,
                            cut_origin_seq=cut_origin_seq)

    def progress(name: str, rec: Any) -> None:
        if ":" not in name and not c.as_json:
            click.echo(f"{rec.from_partitions} -> {rec.to_partitions}: {name}", err=True)

    async def go(js: JetStreamContext) -> list[Lineage]:
        return await migrate_set(js, groups, to_partitions, opts, hook=progress)

    lineages = _run(c, go)
    lineage = lineages[0]
    epochs = [e.to_dict() for e in lineage.epochs]
    last = lineage.epochs[-1]
    names = ", ".join(f"{s}.{g}" for s, g in groups)
    c.out({"partitions": lineage.partitions, "epochs": epochs,
           "groups": {f"{s}.{g}": [e.to_dict() for e in lin.epochs]
                      for (s, g), lin in zip(groups, lineages, strict=True)}},
          f"{names}: migrated to {lineage.partitions} partitions (origin sequence "
          f"{last.first_origin_seq} on, work-queue sequence {last.first_wq_seq} on for "
          f"{stream}.{group}); set your code's partition count to {lineage.partitions}")
