"""cg_pipelines: NATS JetStream partitioned consumer groups as ordered, exactly-once batch runs.

The names most programs need are importable from here (loaded on first use, so importing a
submodule stays light):

- decoding and state: :class:`Field`, :class:`JsonDecoder`, :class:`BadMessage`,
  :class:`KeyedState`;
- the engine: :func:`run_partition`, :func:`run_static_partition`, :class:`EngineOptions`,
  :class:`ArrowProcessor`, :class:`RunResult`;
- the sink: :class:`DeltaSink`; connections: :class:`ConnectOptions`.

Subpackages: ``core`` (pure logic), ``jetstream`` (NATS adapters, admin, streaming members),
``engine``, ``sinks``, ``spark`` (extra ``spark``), ``dagster`` (extra ``dagster``), ``cli``
(the ``cg`` command), ``testing`` (extra ``testing``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "Field": "cg_pipelines.core.decode",
    "JsonDecoder": "cg_pipelines.core.decode",
    "BadMessage": "cg_pipelines.core.decode",
    "KeyedState": "cg_pipelines.core.state",
    "run_partition": "cg_pipelines.engine.runner",
    "run_static_partition": "cg_pipelines.engine.static",
    "EngineOptions": "cg_pipelines.engine.runner",
    "ArrowProcessor": "cg_pipelines.engine.processing",
    "RunResult": "cg_pipelines.engine.model",
    "DeltaSink": "cg_pipelines.sinks.delta",
    "ConnectOptions": "cg_pipelines.jetstream.connect",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cg_pipelines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
