"""cg_pipelines: NATS JetStream partitioned consumer groups as ordered, exactly-once batch runs.

The names most programs need are importable from here:

- decoding and state: :class:`JsonField`, :class:`JsonDecoder`, :class:`BadMessage`,
  :class:`KeyedState`;
- the engine: :func:`run_partition`, :func:`run_static_partition`, :class:`EngineOptions`,
  :class:`ArrowProcessor`, :class:`RunResult`;
- the sink: :class:`DeltaSink` and its write modes :class:`Append` (the default: the table is
  the history) and :class:`Merge` (a fenced MERGE by key: the table is each key's current
  row); connections: :class:`ConnectOptions`; errors: :class:`CgError`
  (the base of every exception the library raises).

They are loaded on first use (importing ``cg_pipelines`` or a light submodule such as the
``cg`` CLI's does not import pyarrow or deltalake); the ``TYPE_CHECKING`` imports below are the
same names for readers, IDEs and type checkers. ``Field`` is a deprecated alias of
:class:`JsonField` (it collided with ``pydantic.Field``).

Subpackages: ``core`` (pure logic), ``jetstream`` (NATS adapters, admin, streaming members),
``engine``, ``sinks``, ``spark`` (extra ``spark``), ``dagster`` (extra ``dagster``), ``cli``
(the ``cg`` command), ``local`` (local nats-server and Spark processes for development),
``testing`` (extra ``testing``: real servers and pytest fixtures for tests).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cg_pipelines.core.decode import BadMessage, JsonDecoder, JsonField
    from cg_pipelines.core.errors import CgError
    from cg_pipelines.core.state import KeyedState
    from cg_pipelines.core.write import Append, Merge
    from cg_pipelines.engine.model import RunResult
    from cg_pipelines.engine.processing import ArrowProcessor
    from cg_pipelines.engine.runner import EngineOptions, run_partition
    from cg_pipelines.engine.static import run_static_partition
    from cg_pipelines.jetstream.connect import ConnectOptions
    from cg_pipelines.sinks.delta import DeltaSink

from cg_pipelines.version import __version__

_EXPORTS = {
    "JsonField": "cg_pipelines.core.decode",
    "JsonDecoder": "cg_pipelines.core.decode",
    "BadMessage": "cg_pipelines.core.decode",
    "CgError": "cg_pipelines.core.errors",
    "KeyedState": "cg_pipelines.core.state",
    "Append": "cg_pipelines.core.write",
    "Merge": "cg_pipelines.core.write",
    "run_partition": "cg_pipelines.engine.runner",
    "run_static_partition": "cg_pipelines.engine.static",
    "EngineOptions": "cg_pipelines.engine.runner",
    "ArrowProcessor": "cg_pipelines.engine.processing",
    "RunResult": "cg_pipelines.engine.model",
    "DeltaSink": "cg_pipelines.sinks.delta",
    "ConnectOptions": "cg_pipelines.jetstream.connect",
}

__all__ = [
    "Append",
    "ArrowProcessor",
    "BadMessage",
    "CgError",
    "ConnectOptions",
    "DeltaSink",
    "EngineOptions",
    "JsonDecoder",
    "JsonField",
    "KeyedState",
    "Merge",
    "RunResult",
    "__version__",
    "run_partition",
    "run_static_partition",
]


def __getattr__(name: str) -> Any:
    if name == "Field":
        warnings.warn("cg_pipelines.Field is deprecated: use cg_pipelines.JsonField (the old "
                      "name collides with pydantic.Field)", DeprecationWarning, stacklevel=2)
        name = "JsonField"
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cg_pipelines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
