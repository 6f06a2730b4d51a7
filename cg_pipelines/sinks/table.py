"""The old home of :class:`~cg_pipelines.sinks.base.TableSink` and
:class:`~cg_pipelines.sinks.base.TableStats` (now in :mod:`cg_pipelines.sinks.base`, the one
sink contract): re-exported until the Dagster layer imports them from there."""

from cg_pipelines.sinks.base import TableSink, TableStats

__all__ = ["TableSink", "TableStats"]
