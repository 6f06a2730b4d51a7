"""The ordered partition engine: lease-and-range drains with fenced, exactly-once commits.

Entry points: :func:`run_partition` (elastic groups), :func:`run_partitions` (several
partitions of one elastic group in one run), :func:`run_static_partition`,
:func:`rebuild_partition`; co-partitioned sets (several groups, partition p of each in one
run, one commit): :func:`run_copartitioned`, :func:`rebuild_copartitioned`. One run loop serves
them all (:mod:`cg_pipelines.engine.drain`, over a run's sides) and one rebuild
(:mod:`cg_pipelines.engine.rebuild`); every run returns a :class:`RunResult` (each side's facts
in a :class:`SideResult`). Contracts: the
processing step in :mod:`cg_pipelines.engine.processor` (a co-partitioned one in
:mod:`cg_pipelines.engine.join_processor`), what a run returns in
:mod:`cg_pipelines.engine.result`; the sink's is :mod:`cg_pipelines.sinks.base`."""

from cg_pipelines.core.errors import PartitionRunError
from cg_pipelines.engine.join import JoinInput, run_copartitioned
from cg_pipelines.engine.join_processor import (
    ArrowJoinProcessor,
    JoinContext,
    JoinProcessed,
    JoinProcessor,
)
from cg_pipelines.engine.options import EngineConfigError, EngineOptions, WorkQueueLossError
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import (
    BatchContext,
    DeadLetter,
    Processed,
    Processor,
    ProcessorBase,
    Record,
)
from cg_pipelines.engine.rebuild import RebuildError, rebuild_copartitioned, rebuild_partition
from cg_pipelines.engine.result import RunResult, RunStatus, SideResult
from cg_pipelines.engine.retry import NatsUnavailableError
from cg_pipelines.engine.runner import run_partition, run_partitions
from cg_pipelines.engine.static import run_static_partition

__all__ = [
    "ArrowJoinProcessor",
    "ArrowProcessor",
    "BatchContext",
    "DeadLetter",
    "EngineConfigError",
    "EngineOptions",
    "JoinContext",
    "JoinInput",
    "JoinProcessed",
    "JoinProcessor",
    "NatsUnavailableError",
    "PartitionRunError",
    "Processed",
    "Processor",
    "ProcessorBase",
    "RebuildError",
    "Record",
    "RunResult",
    "RunStatus",
    "SideResult",
    "WorkQueueLossError",
    "rebuild_copartitioned",
    "rebuild_partition",
    "run_copartitioned",
    "run_partition",
    "run_partitions",
    "run_static_partition",
]
