"""Rebuilding partition p of a co-partitioned set (issue 39) replays every input's origin
history into one fenced replace; compared with the independent pandas join."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from cg_pipelines.engine.coverage_log import DeltaLogCoverage
from cg_pipelines.engine.join import run_copartitioned
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.rebuild import rebuild_copartitioned
from cg_pipelines.jetstream.reconcile import reconcile_group
from cg_pipelines.sinks.base import FenceConflictError, app_id_for
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.storage import table_filesystem
from tests.support import joined

FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0)
N = 2


async def _drain(nc, stream: str, sink) -> None:
    for p in range(N):
        r = await run_copartitioned(nc, joined.inputs(stream), p, joined.processor(), sink,
                                    EngineOptions(batch_max_msgs=41, **FAST))
        assert r.status in ("drained", "empty"), r.detail


async def test_rebuild_replays_every_input(nc, js, unique_name, tmp_path) -> None:
    evs = joined.events(240)
    api = await joined.setup(js, unique_name, evs, n_partitions=N)
    sink = DeltaSink(str(tmp_path / "t"), write=joined.WRITE)
    await _drain(nc, unique_name, sink)
    wms = {(n, p): sink.watermark(app_id_for(f"{unique_name}_{n}", "g", p))
           for n in (joined.IMP, joined.CLK) for p in range(N)}
    # messages still queued when the rebuild runs are left to the drain (no duplicate)
    more = {joined.IMP: [], joined.CLK: [{"auction": "a10"}, {"auction": "a11"}]}
    for m in more[joined.CLK]:
        await js.publish(f"{unique_name}_{joined.CLK}.{m['auction']}", json.dumps(m).encode())
    await joined.wait_sourced(api, f"{unique_name}_{joined.CLK}-g", 2)
    for p in range(N):
        steps: list[tuple[str, object]] = []
        r = await rebuild_copartitioned(nc, joined.inputs(unique_name), p, joined.processor(),
                                        DeltaSink(sink.uri, write=joined.WRITE),
                                        EngineOptions(batch_max_msgs=37, **FAST),
                                        hook=lambda s, i, steps=steps: steps.append(
                                            (s, i.get("input"))))
        assert r.status == "rebuilt", r.detail
        assert all(x.origin_last_seq for x in r.inputs.values())
        # the hook reports the rebuild's steps: each batch, and each input rebuilt
        assert ("processed", None) in steps
        assert {i for s, i in steps if s == "rebuilt"} == {joined.IMP, joined.CLK}
    assert joined.mismatches(sink.read(), evs) is None  # the queued two are not in yet
    assert {k: sink.watermark(app_id_for(f"{unique_name}_{k[0]}", "g", k[1]))
            for k in wms} == wms  # watermarks kept
    await _drain(nc, unique_name, sink)
    total = {n: evs[n] + more[n] for n in evs}
    assert joined.mismatches(sink.read(), total) is None
    assert await joined.left(api, unique_name) == 0
    # reconcile per input on the set's table: every origin message of each input covered
    # (by the drains' joint commits and the rebuilds' coverage_through)
    fs = table_filesystem(sink.uri, {})
    assert fs is not None
    for name in (joined.IMP, joined.CLK):
        s = f"{unique_name}_{name}"
        rep = await reconcile_group(js, api, s, "g", coverage=DeltaLogCoverage(fs, s, "g"),
                                    from_seq=1, grace_s=0)
        assert rep.ok and rep.expected == len(total[name]) == rep.in_table, rep.text()
        assert rep.versions_read > 0


async def test_rebuild_of_nothing_committed_is_empty(nc, js, unique_name, tmp_path) -> None:
    await joined.setup(js, unique_name, joined.events(10), n_partitions=N)
    sink = DeltaSink(str(tmp_path / "t"), write=joined.WRITE)
    r = await rebuild_copartitioned(nc, joined.inputs(unique_name), 0, joined.processor(), sink,
                                    EngineOptions(**FAST))
    assert r.status == "empty"


def test_replace_is_fenced_on_every_kept_watermark(tmp_path) -> None:
    rows = pa.table({"auction": ["x"], "ad": ["a"], "clicks": [1], "value": [0],
                     "updates": [1], "_partition": [0]})
    sink = DeltaSink(str(tmp_path / "t"), write=joined.WRITE)
    a, b = "s_a/g/0", "s_b/g/0"
    sink.watermark(a)
    sink.commit(rows, {a: (0, 5), b: (0, 3)})
    sink.watermark(a)
    DeltaSink(sink.uri, write=joined.WRITE).commit(None, {a: (5, 5), b: (3, 4)})
    with pytest.raises(FenceConflictError) as e:
        sink.replace_partition(pa.RecordBatchReader.from_batches(rows.schema,
                                                                  rows.to_batches()),
                               0, a, 5, fenced={b: 3})
    assert (e.value.app_id, e.value.expected, e.value.found) == (b, 3, 4)
    assert sink.watermark(b) == 4 and sink.read().num_rows == 1


