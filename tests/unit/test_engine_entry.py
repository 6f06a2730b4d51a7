"""The engine's entry points share one preamble (:func:`cg_pipelines.engine.context.open_run`):
a bad partition is refused the same way by each, before anything is sent to NATS (the client
here is None) or read from the sink."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.engine.maintain import maintain_partition
from cg_pipelines.engine.options import EngineConfigError
from cg_pipelines.engine.processor import BatchContext, Processed, ProcessorBase
from cg_pipelines.engine.rebuild import rebuild_partition
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.engine.static import run_static_partition
from cg_pipelines.sinks.delta import DeltaSink


class _Nothing(ProcessorBase):
    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        return Processed(None)


ENTRY_POINTS: dict[str, Callable[[Any, int, Any], Awaitable[object]]] = {
    "run_partition": lambda nc, p, sink: run_partition(nc, "s", "g", p, _Nothing(), sink),
    "run_static_partition": lambda nc, p, sink: run_static_partition(
        nc, "s", "g", p, _Nothing(), sink),
    "rebuild_partition": lambda nc, p, sink: rebuild_partition(nc, "s", "g", p, _Nothing(), sink),
    "maintain_partition": lambda nc, p, sink: maintain_partition(nc, "s", "g", p, sink),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_negative_partition_is_refused_before_any_io(entry: str, tmp_path: Path) -> None:
    sink = DeltaSink(str(tmp_path / "t"))
    with pytest.raises(ConfigError, match=r"^partition: must be >= 0, got -1$") as err:
        asyncio.run(ENTRY_POINTS[entry](None, -1, sink))
    assert isinstance(err.value, ValueError)  # as before: bad input stays a ValueError
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(("entry", "reason"), [
    ("run_partition", r"Plain is not a table sink: it lacks uri, write, .*replace_partition"),
    ("rebuild_partition", r"Plain is not a table sink: it lacks uri, write, "),
    ("maintain_partition", r"Plain has no maintain")])
def test_a_sink_without_the_contract_is_refused_before_any_io(entry: str, reason: str) -> None:
    class Plain:
        def watermark(self, app_id: str) -> int:
            return 0

        def commit(self, *a: object, **kw: object) -> None: ...

    with pytest.raises(EngineConfigError, match=reason):
        asyncio.run(ENTRY_POINTS[entry](None, 0, Plain()))


def test_the_run_identity_reaches_every_state_sink() -> None:
    """The run's app id is an argument every sink accepts (TableSink.last_rows), not
    an optional keyword found by inspecting the sink's signature (issue 41)."""
    from cg_pipelines.core.state import KeyedState
    from cg_pipelines.core.write import Append
    from cg_pipelines.engine.context import state_cache

    class _Stateful(_Nothing):
        state = KeyedState("k", ("n",))

    class Recording:
        write = Append()

        def __init__(self) -> None:
            self.calls: list[tuple[int | None, str | None]] = []

        def watermark(self, app_id: str) -> int:
            return 0

        def commit(self, *a: object, **kw: object) -> None: ...

        def last_rows(self, key: str, keys: object, columns: object, order_by: str,
                      partition: int | None = None, *, app_id: str | None = None) -> pa.Table:
            self.calls.append((partition, app_id))
            return pa.table({"k": pa.array([], pa.string()), "n": pa.array([], pa.int64()),
                             "_seq": pa.array([], pa.int64())})

    sink = Recording()
    cache = state_cache(_Stateful(), sink, 2, "s/g/2")
    assert cache is not None
    cache.lookup(["a"])
    assert sink.calls == [(2, "s/g/2")]


def test_a_join_reads_state_from_the_runs_own_snapshot() -> None:
    """A co-partitioned run's state reads name its first input's app id (the snapshot its
    watermark read loaded and its commits advance), as a partition run's do: not the latest
    table version (issue 50)."""
    from types import SimpleNamespace
    from typing import cast

    from cg_pipelines.core.state import KeyedState
    from cg_pipelines.core.write import Append
    from cg_pipelines.engine.context import RunContext
    from cg_pipelines.engine.join_processor import ArrowJoinProcessor
    from cg_pipelines.engine.step import JoinStep

    calls: list[tuple[int | None, str | None]] = []

    class Recording:
        write = Append()

        def watermark(self, app_id: str) -> int:
            return 0

        def commit(self, *a: object, **kw: object) -> None: ...

        def last_rows(self, key: str, keys: object, columns: object, order_by: str,
                      partition: int | None = None, *, app_id: str | None = None) -> pa.Table:
            calls.append((partition, app_id))
            return pa.table({"k": pa.array([], pa.string()), "n": pa.array([], pa.int64()),
                             "_seq": pa.array([], pa.int64())})

    sink = Recording()
    sides = [cast(RunContext, SimpleNamespace(name=n, app_id=f"{n}/g/3", partition=3,
                                              sink=sink, parents=())) for n in ("a", "b")]
    proc = ArrowJoinProcessor({"a": None, "b": None}, lambda t, c: t,  # type: ignore[dict-item]
                              state=KeyedState("k", ("n",)))
    step = JoinStep(proc, sides)
    assert step.state is not None
    step.state.lookup(["x"])
    assert calls == [(3, "a/g/3")]
