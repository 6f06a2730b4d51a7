"""``cg runs show|set|unset``: a group's run layout in NATS (the run parallelism D, partitions
one run drains; :mod:`cg_pipelines.jetstream.run_layout`), picked up by the backlog sensor at
its next tick, no code change or restart. ``set --dry-run`` prints the runs' blocks and
writes nothing.

Exit codes as every ``cg`` command: 0 ok; 2 invalid input or a missing group; 1 server or
connection failure.
"""

from __future__ import annotations

from typing import Any

import click
from nats.js import JetStreamContext

from cg_pipelines.cli.context import Ctx, fail, table
from cg_pipelines.core.blocks import blocks
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.run_layout import (
    RUNS_BUCKET,
    RunLayout,
    delete_run_layout,
    get_run_layout,
    set_run_layout,
)

__all__ = ["runs"]


@click.group("runs")
def runs() -> None:
    """Run layout of an elastic group: partitions per run (D), read by the backlog sensor."""


def _plan(partitions: int, d: int) -> dict[str, Any]:
    ranges = blocks(partitions, d)
    return {"partitions": partitions, "partitions_per_run": d, "runs": len(ranges),
            "blocks": [f"{a}-{b}" if a != b else f"{a}" for a, b in ranges]}


def _text(stream: str, group: str, plan: dict[str, Any], source: str) -> str:
    return (f"{stream}.{group}: {plan['partitions_per_run']} partition(s) per run ({source}): "
            f"at most {plan['runs']} run(s) over its {plan['partitions']} partitions\n"
            + table(["run", "partitions"], [[i, b] for i, b in enumerate(plan["blocks"])],
                    right=["run"]))


@runs.command("show")
@click.argument("stream")
@click.argument("group")
@click.pass_obj
def runs_show(c: Ctx, stream: str, group: str) -> None:
    """The layout set in NATS, or that none is (each deployment's own then applies)."""
    async def go(js: JetStreamContext) -> tuple[int, RunLayout | None]:
        n = (await admin.get_elastic(js, stream, group, timeout=c.timeout)).config.max_members
        return n, await get_run_layout(js, stream, group)

    n, layout = c.run(go)
    if layout is None:
        c.out({"partitions": n, "partitions_per_run": None},
              f"{stream}.{group}: no run layout set in NATS: each deployment's own "
              "partitions_per_run applies (default 1: one run per partition)")
        return
    plan = _plan(n, layout.partitions_per_run)
    c.out(plan, _text(stream, group, plan, f"set in NATS, {RUNS_BUCKET}"))


@runs.command("set")
@click.argument("stream")
@click.argument("group")
@click.argument("partitions_per_run", type=int)
@click.option("--dry-run", is_flag=True, help="Print the runs' blocks; write nothing.")
@click.pass_obj
def runs_set(c: Ctx, stream: str, group: str, partitions_per_run: int, dry_run: bool) -> None:
    """Make runs of GROUP drain PARTITIONS_PER_RUN partitions each (aligned blocks). A block
    waits while any of its partitions is in a run of the old layout: nothing is processed
    twice or out of order."""
    try:
        layout = RunLayout(partitions_per_run)
    except ConfigError as e:
        fail(str(e), 2)

    async def go(js: JetStreamContext) -> tuple[int, RunLayout | None]:
        n = (await admin.get_elastic(js, stream, group, timeout=c.timeout)).config.max_members
        before = await get_run_layout(js, stream, group)
        if not dry_run:
            await set_run_layout(js, stream, group, layout)
        return n, before

    n, before = c.run(go)
    plan = _plan(n, layout.partitions_per_run)
    was = before.partitions_per_run if before is not None else None
    plan["was"] = was
    plan["written"] = not dry_run
    head = "dry run, nothing written" if dry_run else f"set in NATS, {RUNS_BUCKET}"
    text = _text(stream, group, plan, head)
    text += f"\nbefore: {was if was is not None else 'not set'}"
    c.out(plan, text)


@runs.command("unset")
@click.argument("stream")
@click.argument("group")
@click.pass_obj
def runs_unset(c: Ctx, stream: str, group: str) -> None:
    """Remove the layout from NATS: each deployment's own partitions_per_run applies again."""
    async def go(js: JetStreamContext) -> bool:
        await admin.get_elastic(js, stream, group, timeout=c.timeout)
        return await delete_run_layout(js, stream, group)

    removed = c.run(go)
    c.out({"removed": removed}, f"{stream}.{group}: run layout "
          + ("removed" if removed else "was not set"))
