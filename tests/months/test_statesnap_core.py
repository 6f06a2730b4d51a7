"""Table tests of the pure snapshot and compaction rules (cg_pipelines.core.statesnap) and of
reading a compaction's log entry (sinks.maintenance.rewritten_files)."""

from __future__ import annotations

import json

import pytest

from cg_pipelines.core.statesnap import after_rewrite, catch_up_files, needs_compaction
from cg_pipelines.sinks.maintenance import rewritten_files


@pytest.mark.parametrize(("covered", "live", "want"), [
    (set(), [], []),
    (set(), ["a", "b"], ["a", "b"]),
    ({"a"}, ["a", "b", "c"], ["b", "c"]),
    ({"a", "b"}, ["b", "a"], []),
    ({"a", "x"}, ["a", "b"], None),          # x was rewritten or replaced
    ({"a"}, [], None),                        # the partition was emptied (rebuild)
])
def test_catch_up_files(covered, live, want) -> None:
    assert catch_up_files(covered, live) == want


@pytest.mark.parametrize(("covered", "removed", "added", "want"), [
    ({"a", "b", "c"}, ["a", "b"], ["ab"], {"ab", "c"}),
    ({"a", "b"}, [], [], {"a", "b"}),
    ({"a"}, ["a", "b"], ["ab"], None),        # b's rows are in ab but not in the snapshot
    (set(), ["a"], ["a2"], None),
])
def test_after_rewrite(covered, removed, added, want) -> None:
    got = after_rewrite(covered, removed, added)
    assert (None if got is None else set(got)) == want


@pytest.mark.parametrize(("sizes", "min_files", "target", "want"), [
    ([], 2, 100, 0),
    ([10] * 15, 16, 100, 0),
    ([10] * 16, 16, 100, 16),
    ([10, 10, 200, 300], 2, 100, 2),
    ([200, 300], 2, 100, 0),
])
def test_needs_compaction(sizes, min_files, target, want) -> None:
    assert needs_compaction(sizes, min_files, target) == want


def test_needs_compaction_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="min_files"):
        needs_compaction([1], 1, 100)
    with pytest.raises(ValueError, match="target_size"):
        needs_compaction([1], 2, 0)


def _entry(*actions: dict) -> str:
    return "\n".join(json.dumps(a) for a in actions)


def test_rewritten_files_of_a_compaction_and_of_a_data_change() -> None:
    info = {"commitInfo": {"operation": "OPTIMIZE"}}
    compaction = _entry(
        info,
        {"remove": {"path": "_partition=0/a", "dataChange": False,
                    "partitionValues": {"_partition": "0"}}},
        {"remove": {"path": "_partition=1/z", "dataChange": False,
                    "partitionValues": {"_partition": "1"}}},
        {"add": {"path": "_partition=0/ab", "dataChange": False,
                 "partitionValues": {"_partition": "0"}}})
    assert rewritten_files(compaction, 0) == (["_partition=0/a"], ["_partition=0/ab"])
    assert rewritten_files(compaction, 1) == (["_partition=1/z"], [])
    replace = _entry(info, {"remove": {"path": "_partition=0/a", "dataChange": True,
                                       "partitionValues": {"_partition": "0"}}})
    assert rewritten_files(replace, 0) is None
    assert rewritten_files(_entry(info, {"txn": {"appId": "x", "version": 1}}), 0) == ([], [])
