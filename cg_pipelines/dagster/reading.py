"""The one bounded NATS read a backlog tick and a check executed by hand start from
(:func:`read_inputs`): every input's config, backlog and dead letters, and the backlog merged
over the inputs; per input a constant number of requests plus one direct get per partition
that may hold messages (:mod:`cg_pipelines.jetstream.backlog`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.config import ElasticConfig, dlq_stream_name
from cg_pipelines.core.triggers import PartitionBacklog, served_partitions
from cg_pipelines.core.triggers import dead_slot as core_dead_slot
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import StreamAsset, read_configs
from cg_pipelines.engine.inputs import inputs_backlog
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import (
    DeadLetterSummary,
    dead_letter_counts,
    latest_dead_letters,
)
from cg_pipelines.jetstream.run_layout import RunLayout, get_run_layout

__all__ = ["Reading", "dead_slot", "read_inputs"]


def dead_slot(spec: StreamAsset, index: int, partition: int) -> int:
    """The key of input ``index``'s partition in the cursor's ``dead_letters``
    (:func:`cg_pipelines.core.triggers.dead_slot` with the spec's partitions)."""
    return core_dead_slot(spec.partitions, index, partition)


@dataclass(frozen=True)
class Reading:
    """One read of a spec's inputs: the configs' newest KV ``revision``, the first input's
    ``config`` (a set's groups share their member mappings), the ``served`` partitions,
    ``by_input`` (``{input name: [PartitionBacklog per served partition]}``), the merged
    ``backlog`` (:func:`~cg_pipelines.engine.inputs.inputs_backlog`), and when dead letters
    were read ``dead_counts`` (``{dead_slot: count}``) and ``dead_changed`` (``{input name:
    [latest dead letter of each partition whose count changed]}``)."""

    revision: int
    config: ElasticConfig
    served: list[int]
    by_input: dict[str, list[PartitionBacklog]]
    backlog: list[PartitionBacklog]
    dead_counts: dict[int, int] = field(default_factory=dict)
    dead_changed: dict[str, list[DeadLetterSummary]] = field(default_factory=dict)
    layout: RunLayout | None = None


def read_inputs(spec: StreamAsset, nats_res: NatsResource, runs: PartitionRunsResource, *,
                dead_letters_seen: Mapping[int, int] | None = None,
                only: Iterable[int] | None = None, any_owner: bool = False) -> Reading:
    """One bounded NATS session: every input's config, then its backlog at the served
    partitions (with ``only``: of those; with ``any_owner`` too: all of ``only``); with
    ``dead_letters_seen`` (``{dead_slot: count}``), its dead-letter counts and the latest dead
    letter of each partition whose count changed.

    Raises:
        GroupNotFoundError, CoPartitionError, ConfigError, JetStreamError, TimeoutError,
        OSError: as reading fails (all in :data:`~cg_pipelines.dagster.spec.TICK_ERRORS`).
    """
    served_members = runs.served()

    async def read(nc: Any) -> Reading:
        configs = await read_configs(nc, spec, nats_res.call_timeout_s)
        layout = None if len(spec.inputs) > 1 else await get_run_layout(
            nc.jetstream(timeout=nats_res.call_timeout_s), spec.inputs[0].stream,
            spec.inputs[0].group)
        served = served_partitions(assignment(configs[0].config), served_members)
        if only is not None:
            wanted = set(only)
            served = sorted(wanted) if any_owner else [p for p in served if p in wanted]
        counts: dict[int, int] = {}
        changed: dict[str, list[DeadLetterSummary]] = {}
        async with JetStreamAPI(nc, timeout=nats_res.call_timeout_s) as api:
            by_input, merged = await inputs_backlog(api, spec.inputs, served)
            for i, inp in enumerate(spec.inputs):
                if dead_letters_seen is None:
                    continue
                dlq = dlq_stream_name(inp.stream, inp.group)
                mine = {p: dead_slot(spec, i, p) for p in served}
                got = {p: n for p, n in (await dead_letter_counts(api, dlq)).items()
                       if p in mine}
                counts.update({mine[p]: n for p, n in got.items()})
                moved = {p: got.get(p, 0) for p in mine
                         if got.get(p, 0) != dead_letters_seen.get(mine[p], 0)}
                changed[inp.name] = await latest_dead_letters(api, dlq, moved)
        return Reading(max(c.revision for c in configs), configs[0].config, served, by_input,
                       merged, counts, changed, layout)

    return nats_res.run(read)
