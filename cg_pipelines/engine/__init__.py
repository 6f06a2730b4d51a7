"""The ordered partition engine: lease-and-range drains with fenced, exactly-once commits."""

from cg_pipelines.core.errors import PartitionRunError
from cg_pipelines.engine.model import (
    PARTITION_COLUMN,
    BatchContext,
    DeadLetter,
    FenceConflictError,
    Processed,
    Processor,
    ProcessorBase,
    Record,
    ReplaceSink,
    RunResult,
    RunStatus,
    Sink,
    StateSink,
)
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.rebuild import RebuildError, rebuild_partition
from cg_pipelines.engine.retry import NatsUnavailableError
from cg_pipelines.engine.runner import (
    EngineConfigError,
    EngineOptions,
    run_partition,
)
from cg_pipelines.engine.static import run_static_partition

__all__ = [
    "PARTITION_COLUMN",
    "ArrowProcessor",
    "BatchContext",
    "DeadLetter",
    "EngineConfigError",
    "EngineOptions",
    "FenceConflictError",
    "NatsUnavailableError",
    "PartitionRunError",
    "Processed",
    "Processor",
    "ProcessorBase",
    "RebuildError",
    "Record",
    "ReplaceSink",
    "RunResult",
    "RunStatus",
    "Sink",
    "StateSink",
    "rebuild_partition",
    "run_partition",
    "run_static_partition",
]
