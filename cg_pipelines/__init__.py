"""cg_pipelines: NATS JetStream partitioned consumer groups as ordered, exactly-once batch runs.

The names most programs need are importable from here:

- decoding and state: :class:`JsonField`, :class:`JsonDecoder`, :class:`BadMessage`,
  :class:`KeyedState`;
- the engine: :func:`run_partition`, :func:`run_partitions` (several partitions of a group in
  one run), :func:`run_static_partition`, :class:`EngineOptions`, :class:`ArrowProcessor`,
  :class:`RunResult`; co-partitioned joins: :func:`run_copartitioned`, :class:`JoinInput`,
  :class:`ArrowJoinProcessor`;
- the sink: :class:`DeltaSink` and its write modes :class:`Append` (the default: the table is
  the history) and :class:`Merge` (a fenced MERGE by key: the table is each key's current
  row); connections: :class:`ConnectOptions`; errors: :class:`CgError`
  (the base of every exception the library raises).

They are loaded on first use (importing ``cg_pipelines`` or a light submodule such as the
``cg`` CLI's does not import pyarrow or deltalake): :data:`EXPORTS` maps each name to the module
that defines it, and ``__all__``, ``dir()`` and attribute access all come from that one table.
Type checkers see these names as ``Any`` here; typed code imports them from their modules
(the table says which).

Subpackages: ``core`` (pure logic), ``jetstream`` (NATS adapters, admin, streaming members),
``engine``, ``sinks``, ``spark`` (extra ``spark``), ``dagster`` (extra ``dagster``), ``cli``
(the ``cg`` command), ``local`` (local nats-server and Spark processes for development),
``testing`` (extra ``testing``: real servers and pytest fixtures for tests).
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

from cg_pipelines.version import __version__

EXPORTS = MappingProxyType({
    "JsonField": "cg_pipelines.core.decode",
    "JsonDecoder": "cg_pipelines.core.decode",
    "BadMessage": "cg_pipelines.core.decode",
    "CgError": "cg_pipelines.core.errors",
    "KeyedState": "cg_pipelines.core.state",
    "Append": "cg_pipelines.core.write",
    "Merge": "cg_pipelines.core.write",
    "run_partition": "cg_pipelines.engine.runner",
    "run_partitions": "cg_pipelines.engine.runner",
    "run_static_partition": "cg_pipelines.engine.static",
    "EngineOptions": "cg_pipelines.engine.options",
    "ArrowProcessor": "cg_pipelines.engine.processing",
    "RunResult": "cg_pipelines.engine.result",
    "run_copartitioned": "cg_pipelines.engine.join",
    "JoinInput": "cg_pipelines.engine.join",
    "ArrowJoinProcessor": "cg_pipelines.engine.join_processor",
    "DeltaSink": "cg_pipelines.sinks.delta",
    "ConnectOptions": "cg_pipelines.jetstream.connect",
})
"""The names importable from ``cg_pipelines``: name -> the module that defines it."""

__all__ = ["__version__", *EXPORTS]


def __getattr__(name: str) -> Any:
    """``name`` from its module in :data:`EXPORTS`, imported on first use (then cached)."""
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cg_pipelines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's own globals and every name of :data:`EXPORTS` (loaded or not)."""
    return sorted({*globals(), *EXPORTS})
