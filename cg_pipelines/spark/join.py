"""The Spark processing step of a co-partitioned run (:mod:`cg_pipelines.engine.join`).

:class:`SparkJoinProcessor` decodes each input's batch on the driver in one call per input (a
rejected payload becomes that input's dead letter), attaches the state shared by the inputs
(``last_<column>`` columns by the join key, in Arrow), hands the transform one Spark DataFrame
per input (built from Arrow; an input with nothing in the batch is an empty DataFrame with its
decoded schema), and brings the result back as Arrow for the one fenced commit. Types across
the boundary as for :class:`~cg_pipelines.spark.SparkProcessor` (timestamps keep microseconds).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from cg_pipelines.core.decode import JsonDecoder
from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.state import KeyedState
from cg_pipelines.engine.join_processor import (
    JoinContext,
    JoinProcessed,
    JoinProcessor,
    attach_join_state,
    decode_inputs,
)
from cg_pipelines.engine.processing import Validate
from cg_pipelines.spark.session import get_spark

__all__ = ["SparkJoinProcessor", "SparkJoinTransform"]

SparkJoinTransform = Callable[[SparkSession, dict[str, DataFrame], JoinContext], DataFrame]
"""``transform(spark, {input name: df}, ctx) -> DataFrame``: each ``df`` holds that input's
decoded fields, ``_seq``/``_subject``/``_time`` and the shared state's ``last_<column>``
columns."""


class SparkJoinProcessor(JoinProcessor):
    """Co-partitioned processing on Spark (see the module docstring).

    Args:
        decoders: ``{input name: JsonDecoder}``; the keys are the processor's inputs.
        transform: :data:`SparkJoinTransform`; deterministic for the same rows and committed
            state (a batch may be processed again after a crash or a fence).
        state: the per-key state shared by the inputs (its key a decoded column of each).
        spark: the session; usually bound per run with :meth:`bind` (the Dagster asset binds
            its Spark resource's); unbound, :func:`~cg_pipelines.spark.session.get_spark`'s.
        validate: optional record checks per input name.
        order_by: when the result has this column, the Arrow result is sorted by it (stable).
        schema: when given, the result is cast to it (Spark reports computed columns nullable).

    Raises:
        UsageError: fewer than two inputs.
    """

    uses_spark = True

    def __init__(
        self, decoders: Mapping[str, JsonDecoder], transform: SparkJoinTransform, *,
        state: KeyedState | None = None, spark: SparkSession | None = None,
        validate: Mapping[str, Validate] | None = None, order_by: str | None = None,
        schema: pa.Schema | None = None,
    ) -> None:
        if len(decoders) < 2:
            raise UsageError(f"a join needs at least two inputs, got {sorted(decoders)}")
        self.inputs = tuple(decoders)
        self.decoders, self.transform, self.state = dict(decoders), transform, state
        self._spark, self.validate = spark, validate
        self.order_by, self.schema = order_by, schema

    def bind(self, spark: SparkSession) -> SparkJoinProcessor:
        """A copy of this processor that uses ``spark`` (this one is left unchanged)."""
        bound = copy.copy(self)
        bound._spark = spark
        return bound

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            self._spark = get_spark()
        return self._spark

    def process_inputs(self, batches: Mapping[str, pa.Table], ctx: JoinContext
                       ) -> JoinProcessed:
        """Decode every input, attach the state, run the transform on Spark; the result as
        Arrow (``JoinProcessed(None, dead)`` when no row of any input decodes).

        Raises:
            UsageError: the state key is not a decoded column of an input.
            Whatever the transform or Spark raises; nothing of the batch is committed.
        """
        tables, dead = decode_inputs(batches, self.decoders, self.validate)
        if not any(t.num_rows for t in tables.values()):
            return JoinProcessed(None, dead)
        frames = {n: self.spark.createDataFrame(attach_join_state(t, self.state, ctx, n))
                  for n, t in tables.items()}
        out = self.transform(self.spark, frames, ctx).toArrow()
        if self.order_by is not None and self.order_by in out.column_names:
            out = out.sort_by(self.order_by)
        if self.schema is not None:
            out = out.select(self.schema.names).cast(self.schema)
        return JoinProcessed(out, dead)
