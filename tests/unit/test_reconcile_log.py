"""The coverage reader of a real local Delta table (cg_pipelines.engine.coverage_log): data
commits' coverage read version by version, version 0 / OPTIMIZE / other groups skipped,
commits without coverage trusted through their last origin sequence, the cursor stored beside
the table, and a cleaned-up log refused with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cg_pipelines.core.coverage import ReconcileCursor, encode_seqs
from cg_pipelines.engine.coverage_log import CoverageLogError, DeltaLogCoverage
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.storage import table_filesystem

SCHEMA = pa.schema([("x", pa.int64()), ("_partition", pa.int32())])


def _rows(n: int, p: int) -> pa.Table:
    return pa.table({"x": pa.array(range(n), pa.int64()),
                     "_partition": pa.array([p] * n, pa.int32())})


def test_reads_data_commits_skips_the_rest(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    sink = DeltaSink(uri, schema=SCHEMA)
    sink.ensure_table(SCHEMA)  # version 0: no cg.* keys
    lin = {"stream": "S", "group": "g"}
    sink.commit(_rows(3, 0), {"S/g/0": (0, 3)}, lineage={
        **lin, "partition": 0, "first_seq": 1, "last_seq": 3, "last_origin_seq": 7,
        "coverage": encode_seqs([2, 5, 7])})
    sink.commit(_rows(2, 1), {"S/g/1": (0, 2)}, lineage={  # no coverage: trusted through 9
        **lin, "partition": 1, "first_seq": 4, "last_seq": 5, "last_origin_seq": 9})
    sink.commit(_rows(2, 0), {"T/g/0": (0, 2)}, lineage={  # another group
        "stream": "T", "group": "g", "partition": 0, "coverage": encode_seqs([1])})
    DeltaTable(uri).optimize.compact()  # a maintenance commit: no coverage
    sink.commit(None, {"S/g/0": (3, 4)}, lineage={
        **lin, "partition": 0, "first_seq": 4, "last_seq": 4, "last_origin_seq": 11,
        "coverage": encode_seqs([11])})  # an empty commit (all filtered out)
    fs = table_filesystem(uri, {})
    assert fs is not None
    log = DeltaLogCoverage(fs, "S", "g")
    commits, last, done = log.read(-1, 100)
    assert done and last == DeltaTable(uri).version()
    got = [(c.partition, None if c.seqs is None else c.seqs.tolist(), c.through, c.wq_last)
           for c in commits]
    assert got == [(0, [2, 5, 7], None, 3), (1, None, 9, 5), (0, [11], None, 4)]
    # in chunks: two versions at a time, then on from there
    part, upto, done = log.read(-1, 2)
    assert (upto, done) == (1, False) and [c.version for c in part] == [1]
    assert log.read(last, 10) == ([], last, True)

    # the cursor lives beside the table
    assert log.load_cursor() is None
    cur = ReconcileCursor(origin_through=7, version=last)
    cur.add_gaps(np.array([3]), np.array([0]), [(3, 3)])
    assert log.save_cursor(cur)
    back = log.load_cursor()
    assert back is not None and back.gap_runs() == [(3, 3, 1, (0,))] and back.version == last
    assert (tmp_path / "t" / "_cg_reconcile" / "S.g.json").exists()
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 7  # the table is untouched


def test_no_table_stores_nothing(tmp_path: Path) -> None:
    fs = table_filesystem(str(tmp_path / "none"), {})
    assert fs is not None
    log = DeltaLogCoverage(fs, "S", "g")
    assert log.read(-1, 10) == ([], -1, True)
    assert not log.save_cursor(ReconcileCursor())
    assert not (tmp_path / "none").exists()


def test_cleaned_log_is_refused(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    sink = DeltaSink(uri, schema=SCHEMA)
    for v in range(1, 4):
        sink.commit(_rows(1, 0), {"S/g/0": (v - 1, v)}, lineage={
            "stream": "S", "group": "g", "partition": 0, "coverage": encode_seqs([v])})
    log_dir = tmp_path / "t" / "_delta_log"
    (log_dir / f"{1:020d}.json").unlink()  # as log cleanup after a checkpoint at 2
    (log_dir / "_last_checkpoint").write_text(json.dumps({"version": 2, "size": 1}))
    fs = table_filesystem(uri, {})
    assert fs is not None
    with pytest.raises(CoverageLogError, match="version 1 is no longer in the table's log"):
        DeltaLogCoverage(fs, "S", "g").read(0, 10)



def test_range_commit_read_per_partition_entry(tmp_path: Path) -> None:
    """A run over several partitions of one group commits ``cg.join`` with one entry per
    partition, each naming its ``partition``: each entry is read as that partition's coverage
    (not only the first, not under a commit-level partition). A co-partitioned commit (entries
    without ``partition``) still gives the group's one entry under the commit's partition."""
    uri = str(tmp_path / "t")
    sink = DeltaSink(uri, schema=SCHEMA)
    sink.ensure_table(SCHEMA)
    entries = [{"name": f"S/g/{p}", "stream": "S", "group": "g", "app_id": f"S/g/{p}",
                "partition": p, "first_seq": f, "last_seq": la, "last_origin_seq": la,
                "coverage": encode_seqs(seqs)}
               for p, f, la, seqs in [(0, 1, 4, [1, 4]), (2, 2, 3, [2, 3]), (3, 5, 5, [5])]]
    sink.commit(pa.concat_tables([_rows(2, 0), _rows(2, 2), _rows(1, 3)]),
                {"S/g/0": (0, 4), "S/g/2": (0, 3), "S/g/3": (0, 5)}, lineage={
                    "stream": "S", "group": "g", "partitions": "0,2,3",
                    "join": json.dumps(entries)})
    joint = [{"name": "a", "stream": "S", "group": "g", "app_id": "S/g/1", "first_seq": 6,
              "last_seq": 6, "last_origin_seq": 6, "coverage": encode_seqs([6])},
             {"name": "b", "stream": "T", "group": "g", "app_id": "T/g/1", "first_seq": 1,
              "last_seq": 1, "last_origin_seq": 1, "coverage": encode_seqs([1])}]
    sink.commit(_rows(1, 1), {"S/g/1": (0, 6), "T/g/1": (0, 1)},
                lineage={"partition": 1, "join": json.dumps(joint)})
    fs = table_filesystem(uri, {})
    assert fs is not None
    commits, _, done = DeltaLogCoverage(fs, "S", "g").read(-1, 100)
    assert done
    got = [(c.version, c.partition, None if c.seqs is None else c.seqs.tolist(), c.wq_last)
           for c in commits]
    assert got == [(1, 0, [1, 4], 4), (1, 2, [2, 3], 3), (1, 3, [5], 5), (2, 1, [6], 6)]
    other, _, _ = DeltaLogCoverage(fs, "T", "g").read(-1, 100)
    assert [(c.version, c.partition, c.seqs.tolist() if c.seqs is not None else None)
            for c in other] == [(2, 1, [1])]
