"""What :class:`~cg_pipelines.testing.MemorySink` adds to the contract the conformance suite
checks: the commits it records, the rows it hands over, its errors, a whole engine run through
it (a real nats-server; per-key state across batches), and the example of
``docs/guides/testing.md`` as written."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pytest

from cg_pipelines.core.errors import ContractError, StateError, UsageError
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.sinks.base import FenceConflictError, origin_marker
from cg_pipelines.testing import MemoryCommit, MemorySink
from tests.integration.test_engine import FAST, _setup
from tests.support import keyed

ROOT = Path(__file__).resolve().parents[2]


def _rows(p: int, seqs: list[int]) -> pa.Table:
    return pa.table({"key": [f"k{s}" for s in seqs], "seq": seqs, "_partition": [p] * len(seqs)})


def test_it_records_each_commit_for_assertions() -> None:
    sink = MemorySink("t")
    assert repr(sink) == "MemorySink('t', write=Append())" and sink.uri == "memory:t"
    assert sink.rows().num_columns == 0 and sink.commits == []
    sink.commit(_rows(0, [1, 2]), {"a": (0, 2), "b": (0, 0)}, markers={origin_marker("a"): 9},
                lineage={"stream": "S", "first_seq": 1})
    sink.commit(None, {"a": (2, 3)})
    replay = pa.RecordBatchReader.from_batches(_rows(0, [1]).schema, _rows(0, [1]).to_batches())
    assert sink.replace_partition(replay, 0, "a", 3) == 2
    assert sink.commits == [
        MemoryCommit(1, "append", _rows(0, [1, 2]), {"a": 2, "b": 0}, {origin_marker("a"): 9},
                     {"stream": "S", "first_seq": 1}),
        MemoryCommit(2, "empty", None, {"a": 3}, {}, {}),
        MemoryCommit(3, "replace_partition", _rows(0, [1]), {"a": 3}, {}, {"partition": 0}),
    ]
    assert sink.versions_written == [1, 2, 3] and sink.stats().version == 3
    assert sink.rows().to_pylist() == [{"key": "k1", "seq": 1, "_partition": 0}]


def test_its_errors() -> None:
    sink = MemorySink(write=Merge(key="key", order_by="seq"))
    with pytest.raises(StateError):
        sink.stats()
    with pytest.raises(StateError):
        sink.replace_partition(pa.RecordBatchReader.from_batches(pa.schema([]), []), 0, "a", 0)
    with pytest.raises(UsageError, match="write must be"):
        MemorySink(write="merge")  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="seq"):  # merge mode needs its order column
        sink.commit(pa.table({"key": ["x"], "_partition": [0]}), {"a": (0, 1)})
    assert not sink.exists()
    sink.commit(_rows(0, [1]), {"a": (0, 1)})
    with pytest.raises(ContractError, match="differ"):
        sink.commit(pa.table({"key": ["x"], "seq": [2], "other": [1], "_partition": [0]}),
                    {"a": (1, 2)})
    with pytest.raises(FenceConflictError) as err:
        sink.commit(None, {"a": (0, 5)})
    assert (err.value.app_id, err.value.expected, err.value.found) == ("a", 0, 1)
    assert sink.watermark("a") == 1 and sink.rows().num_rows == 1


async def test_a_run_commits_through_it_with_state_across_batches(nc, js,
                                                                  unique_name) -> None:
    stream = unique_name
    evs = keyed.events(n_keys=7, n_events=300)
    await _setup(js, stream, evs, n=1)
    sink = MemorySink("keyed")
    result = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                                 EngineOptions(batch_max_msgs=41, **FAST))
    assert result.status == "drained" and result.processed == len(evs)
    assert keyed.mismatches(sink.rows(), evs) is None  # state carried over between batches
    assert sink.watermark(f"{stream}/g/0") == result.last_seq
    assert len(sink.commits) == result.commits > 1
    assert all(c.lineage["stream"] == stream for c in sink.commits)
    again = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                                EngineOptions(**FAST))
    assert again.status == "empty" and len(sink.commits) == result.commits


def test_the_guide_example_runs_as_written() -> None:
    page = (ROOT / "docs" / "guides" / "testing.md").read_text()
    [block] = re.findall(r"```python\n(# test_memory_sink_example\.py\n.*?)```", page, re.S)
    scope: dict[str, object] = {}
    exec(compile(block, "test_memory_sink_example.py", "exec"), scope)
    tests = [f for name, f in scope.items() if name.startswith("test_") and callable(f)]
    assert tests
    for test in tests:
        test()
