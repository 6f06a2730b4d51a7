"""The engine's declared contracts: every processor hook has a default (a processor written
with only ``process`` runs as before), the library's processors declare theirs, and the Delta
sink is a table sink."""

from __future__ import annotations

import pyarrow as pa

from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.engine.executor_read import RangeProcessor
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext, Processed, ProcessorBase, with_defaults
from cg_pipelines.sinks.base import TABLE_SINK_MEMBERS, TableSink, missing_members
from cg_pipelines.sinks.delta import DeltaSink


class _OnlyProcess:
    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        return Processed(None)


class _WithRange(_OnlyProcess):
    state = None
    read_options = {"tls_ca": "/ca.pem"}

    def process_range(self, source: object, ctx: BatchContext) -> object:
        return source


def test_a_processor_with_only_process_gets_every_default() -> None:
    p = with_defaults(_OnlyProcess())
    assert (p.state, p.uses_spark, p.cost_model, dict(p.read_options)) == (None, False, None, {})
    assert p.bind(object()) is p
    assert p.process(pa.table({}), None).table is None  # type: ignore[arg-type]
    assert not isinstance(p, RangeProcessor)


def test_the_hooks_a_processor_has_are_kept() -> None:
    p = with_defaults(_WithRange())
    assert dict(p.read_options) == {"tls_ca": "/ca.pem"}
    assert isinstance(p, RangeProcessor)


def test_library_processors_declare_their_hooks() -> None:
    p = ArrowProcessor(JsonDecoder([JsonField("a", "int")]), lambda t, ctx: t)
    assert isinstance(p, ProcessorBase) and with_defaults(p) is p
    assert p.cost_model is not None and p.uses_spark is False and p.bind(object()) is p


def test_the_delta_sink_serves_state_and_rebuilds(tmp_path) -> None:
    sink = DeltaSink(str(tmp_path / "t"))
    assert isinstance(sink, TableSink) and missing_members(sink) == []
    assert missing_members(_OnlyProcess()) == list(TABLE_SINK_MEMBERS)


def test_the_member_list_is_the_protocol() -> None:
    """:data:`TABLE_SINK_MEMBERS` (what a run checks a sink for) names every member of the
    contract: the fenced commit, the state read, the rebuild's replace and the reads."""
    assert list(TABLE_SINK_MEMBERS) == [
        "uri", "write", "versions_written", "last_rows_written", "watermark", "watermarks",
        "commit", "last_rows", "replace_partition", "exists", "stats", "read_partitions"]
