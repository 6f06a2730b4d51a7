"""One input or a co-partitioned set, the same for every orchestrator: what a Dagster asset and
an Airflow Dag both call, so their runs, reads and names cannot drift apart.

- :func:`run_inputs`: THE call into the engine for a partition run, drain or rebuild, one input
  (:func:`~cg_pipelines.engine.runner.run_partition`) or a set
  (:func:`~cg_pipelines.engine.join.run_copartitioned`);
- :func:`read_input_configs`: every input's elastic config, the partition count and a set's
  co-partitioning checked;
- :func:`inputs_backlog`: every input's backlog at the served partitions and the backlog merged
  over the inputs (:func:`~cg_pipelines.core.triggers.merge_backlog`);
- :func:`check_spec_inputs`: what a spec's inputs must be;
- :func:`inputs_label`, :func:`inputs_title`, :func:`inputs_code_version`: the names and the
  code version derived from the inputs.

A set is told from one input by its processor: a
:class:`~cg_pipelines.engine.join_processor.JoinProcessor` over two or more inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from nats.aio.client import Client

from cg_pipelines.core.config import ElasticConfig, work_queue_stream_name
from cg_pipelines.core.copartition import SetGroup, check_copartitioned
from cg_pipelines.core.errors import ConfigError, UsageError
from cg_pipelines.core.fingerprint import code_version
from cg_pipelines.core.triggers import PartitionBacklog, merge_backlog
from cg_pipelines.engine.join import JoinInput, run_copartitioned
from cg_pipelines.engine.join_processor import JoinProcessor
from cg_pipelines.engine.options import EngineOptions, Hook
from cg_pipelines.engine.processor import Processor
from cg_pipelines.engine.rebuild import rebuild_copartitioned, rebuild_partition
from cg_pipelines.engine.result import RunResult, SideResult
from cg_pipelines.engine.runner import run_partitions
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import partition_backlog
from cg_pipelines.jetstream.kv import Versioned
from cg_pipelines.sinks.base import TableSink

__all__ = ["check_spec_inputs", "inputs_backlog", "inputs_code_version", "inputs_label",
           "inputs_title", "is_set", "read_input_configs", "run_inputs", "sides_by_input",
           "sides_by_partition"]


def is_set(processor: Processor | JoinProcessor) -> bool:
    """Whether a run with ``processor`` is a co-partitioned set's (a ``JoinProcessor``)."""
    return isinstance(processor, JoinProcessor)


async def run_inputs(
    nc: Client, inputs: Sequence[JoinInput], partitions: int | Sequence[int],
    processor: Processor | JoinProcessor, sink: TableSink, options: EngineOptions, *,
    rebuild: bool = False, allow_partial: bool = False, hook: Hook | None = None,
) -> RunResult:
    """Drain (or with ``rebuild`` rebuild) ``partitions`` (one partition, or several in one
    run) of ``inputs``: one input with a :class:`~cg_pipelines.engine.processor.Processor`
    (several partitions: :func:`~cg_pipelines.engine.runner.run_partitions`, a side per
    partition), or a set with a ``JoinProcessor`` (every input's partition in one run, one
    commit per batch).

    Returns:
        The engine's :class:`~cg_pipelines.engine.result.RunResult` (each input's
        :class:`~cg_pipelines.engine.result.SideResult` by input name for one partition:
        :func:`sides_by_input`; by app id ``<stream>/<group>/<p>`` over several).

    Raises:
        UsageError: several inputs without a ``JoinProcessor`` (or a set's inputs refused by
            :func:`~cg_pipelines.engine.join.check_inputs`); a set, or a rebuild, over
            several partitions (one partition per such run); ``partitions`` empty or
            repeating one.
        What the engine's run functions raise.
    """
    parts = [partitions] if isinstance(partitions, int) else list(partitions)
    if len(parts) != 1 and (rebuild or isinstance(processor, JoinProcessor)):
        what = "a rebuild" if rebuild else "a co-partitioned set"
        raise UsageError(f"{what} runs over one partition per run, got partitions {parts}")
    if isinstance(processor, JoinProcessor):
        if rebuild:
            return await rebuild_copartitioned(nc, inputs, parts[0], processor, sink, options,
                                               allow_partial=allow_partial, hook=hook)
        return await run_copartitioned(nc, inputs, parts[0], processor, sink, options,
                                       hook=hook)
    if len(inputs) != 1:
        raise UsageError(f"{len(inputs)} inputs need a JoinProcessor, got "
                         f"{type(processor).__name__}")
    inp = inputs[0]
    if rebuild:
        return await rebuild_partition(nc, inp.stream, inp.group, parts[0], processor, sink,
                                       options, allow_partial=allow_partial, hook=hook)
    return await run_partitions(nc, inp.stream, inp.group, parts, processor, sink, options,
                                hook=hook)


def sides_by_input(inputs: Sequence[JoinInput], result: RunResult) -> dict[str, SideResult]:
    """``{input name: SideResult}`` of a one-partition :func:`run_inputs` result, in the
    inputs' order (the engine names a lone input's side by its app id, a set's by input
    name)."""
    if len(inputs) == 1:
        return {inputs[0].name: next(iter(result.inputs.values()))}
    return {i.name: result.inputs[i.name] for i in inputs}


def sides_by_partition(result: RunResult) -> dict[int, SideResult]:
    """``{partition: SideResult}`` of a one-input :func:`run_inputs` result over one or
    several partitions."""
    return {side.partition: side for side in result.inputs.values()}


async def read_input_configs(nc: Client, inputs: Sequence[JoinInput], partitions: int, *,
                             name: str, timeout: float) -> list[Versioned[ElasticConfig]]:
    """Every input's elastic config (in the inputs' order), read with ``timeout`` seconds per
    request; a set's co-partitioning and the partition count checked against ``partitions``
    (``name``: the set's name in the error).

    Raises:
        GroupNotFoundError: an input's group does not exist.
        CoPartitionError: a set's groups are not co-partitioned.
        ConfigError: the groups' partition count (``max_members``) is not ``partitions``.
        JetStreamError, TimeoutError: as reading fails.
    """
    got = [await admin.get_elastic(nc.jetstream(timeout=timeout), i.stream, i.group,
                                   timeout=timeout) for i in inputs]
    if len(got) > 1:
        n = check_copartitioned([SetGroup(i.stream, i.group, v.config)
                                 for i, v in zip(inputs, got, strict=True)])
        where = f"the set of {name}"
    else:
        n, where = got[0].config.max_members, f"group {inputs[0].stream}.{inputs[0].group}"
    if n != partitions:
        raise ConfigError("max_members", f"{where} has {n} partitions in KV but the code "
                          f"declares {partitions}")
    return got


async def inputs_backlog(api: JetStreamAPI, inputs: Sequence[JoinInput], served: Iterable[int]
                         ) -> tuple[dict[str, list[PartitionBacklog]], list[PartitionBacklog]]:
    """``(by_input, merged)``: each input's backlog at the ``served`` partitions
    (:func:`~cg_pipelines.jetstream.backlog.partition_backlog`, by input name, in partition
    order) and the backlog merged over the inputs (a set's run key changes when any input's
    first pending message does; one input's as it is). A set adds one ``STREAM.INFO`` per
    input (its work queue's last sequence).

    Raises:
        StreamNotFoundError, JetStreamError, TimeoutError: as reading fails.
    """
    wanted = sorted(set(served))
    by_input: dict[str, list[PartitionBacklog]] = {}
    lasts: dict[str, int] = {}
    for inp in inputs:
        rows = await partition_backlog(api, inp.stream, inp.group, wanted)
        by_input[inp.name] = sorted(rows, key=lambda b: b.partition)
        if len(inputs) > 1:
            info: dict[str, Any] = await api.stream_info(
                work_queue_stream_name(inp.stream, inp.group))
            lasts[inp.name] = int((info.get("state") or {}).get("last_seq") or 0)
    return by_input, merge_backlog(by_input, lasts)


def check_spec_inputs(inputs: Sequence[JoinInput], processor: Processor | JoinProcessor
                      ) -> None:
    """Refuse a spec's inputs when it is made (every orchestrator's spec calls this).

    Raises:
        ConfigError: a stream or group that is not a NATS name (field ``stream``/``group``);
            no input, names empty or repeated, or a group twice (``inputs``); several inputs
            without a ``JoinProcessor`` (``processor``); names that are not the
            ``JoinProcessor``'s inputs (``inputs``).
    """
    for inp in inputs:
        for what, value in (("stream", inp.stream), ("group", inp.group)):
            if not value or any(c in value for c in " .*>"):
                raise ConfigError(what, f"{value!r} is not a NATS name")
    names = [i.name for i in inputs]
    if not names or len(set(names)) != len(names) or not all(names):
        raise ConfigError("inputs", f"one or more inputs with unique names, got {names}")
    groups = [(i.stream, i.group) for i in inputs]
    if len(set(groups)) != len(groups):
        raise ConfigError("inputs", f"each input must be its own group, got {groups}")
    if isinstance(processor, JoinProcessor):
        if set(names) != set(processor.inputs):
            raise ConfigError("inputs", f"input names {sorted(names)} are not the "
                              f"processor's inputs {sorted(processor.inputs)}")
    elif len(names) > 1:
        raise ConfigError("processor", "a co-partitioned set needs a JoinProcessor")


def inputs_label(inputs: Sequence[JoinInput]) -> str:
    """The input groups, distinct, joined by ``+`` (run keys and partition keys start with
    it: ``totals``, ``orders+payments``)."""
    return "+".join(dict.fromkeys(i.group for i in inputs))


def inputs_title(inputs: Sequence[JoinInput], name: str) -> str:
    """What messages call the inputs: ``consumer group <stream>.<group>``, or
    ``co-partitioned set <name> (<stream>.<group>, ...)``."""
    groups = ", ".join(f"{i.stream}.{i.group}" for i in inputs)
    return f"consumer group {groups}" if len(inputs) == 1 else \
        f"co-partitioned set {name} ({groups})"


def inputs_code_version(processor: Processor | JoinProcessor, inputs: Sequence[JoinInput],
                        partitions: int) -> str:
    """The code version of a run's code (:func:`~cg_pipelines.core.fingerprint.code_version`):
    a digest of the processor (code and settings), the inputs and the partition count; one
    input's is that of ``(processor, stream, group, partitions)``, so it is the same whichever
    orchestrator computes it."""
    if len(inputs) == 1 and not is_set(processor):
        return code_version(processor, inputs[0].stream, inputs[0].group, partitions)
    return code_version(processor, [(i.name, i.stream, i.group) for i in inputs], partitions)
