"""The table state an Iceberg commit is built on, without the snapshots it does not read.

pyiceberg 0.12's ``Transaction.table_metadata`` applies the transaction's updates to a DEEP
copy of the whole table metadata on every read, and a commit reads it some 25 times (an
append; more for an overwrite, its upkeep). Most of what it copies is the kept snapshots with
their summaries (about 2/3 of a copy at 20 snapshots), which no commit of the sink reads: a
snapshot producer reads the branch head (its parent: manifests, summary totals, sequence
number), the refs, the schema, spec, sort order and properties. So an aged table, which keeps
``keep_snapshots``, paid a commit cost that grew with that number where a fresh one with a
few snapshots did not (issue 40, docs/iceberg.md "Figures").

:func:`commit_view` is the table with its metadata reduced to the snapshots its refs point at
(``main``'s head, branches, tags) and the last snapshot-log entry; everything else (metadata
log, properties, schemas, specs, sequence numbers) is kept as is. A commit built on it sends
the catalog exactly the updates and requirements it would send from the full state (the
parent snapshot, ``AssertRefSnapshotId`` on ``main``, the table UUID): the catalog applies
them to ITS current metadata, not to the view, so nothing is dropped from the table, and the
fence is the same. After the commit pyiceberg replaces the view's metadata by the full
metadata the catalog returned. Old metadata files are still deleted after a commit
(``write.metadata.delete-after-commit.enabled``: pyiceberg compares the metadata logs, which
the view keeps whole).
"""

from __future__ import annotations

from pyiceberg.table import Table

__all__ = ["commit_view"]


def commit_view(tbl: Table) -> Table:
    """A :class:`~pyiceberg.table.Table` for ``tbl``'s state to build ONE commit on: same
    identifier, metadata location, FileIO and catalog; metadata without the snapshots no ref
    points at (see the module docstring). ``tbl`` itself is left unchanged; after a
    successful commit the returned table holds the catalog's full new metadata. ``tbl`` when
    there is nothing to leave out."""
    md = tbl.metadata
    refs = {r.snapshot_id for r in md.refs.values()}
    if len(md.snapshots) <= len(refs):
        return tbl
    view = md.model_copy(update={
        "snapshots": [s for s in md.snapshots if s.snapshot_id in refs],
        "snapshot_log": md.snapshot_log[-1:],
    })
    return Table(tbl.name(), metadata=view, metadata_location=tbl.metadata_location,
                 io=tbl.io, catalog=tbl.catalog, config=tbl.config)
