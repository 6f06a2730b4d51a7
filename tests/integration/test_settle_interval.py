"""Settling several commits at once (``EngineOptions.settle_interval_s``): a run purges the
work queue and acknowledges its lease after its commits, each commit at once or, within the
interval of the last settle, together with the commits after it (one purge: a work queue's
purge costs per call, not per message, ``notes/RANGE_RUNS.md`` §13); never before a commit,
always before the run ends. Against a real nats-server and real Delta tables: the table equals
the pandas reference, the work queue ends empty, and a run that fails with commits owed leaves
committed messages that the next run purges unread. (SIGKILLs with commits owed: the chaos
tests, which run the defaults.)"""

from __future__ import annotations

from collections import Counter

import pytest

from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition, run_partitions
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed

# a settle is put off at most a sixth of the pin timeout: 60 s lets every batch here wait
FAST = dict(ack_wait_s=1.5, priority_timeout_s=60.0, hold_wait_s=6.0)


class Crash(Exception):
    pass


async def _left(api: JetStreamAPI, wq: str) -> int:
    return int((await api.stream_info(wq))["state"]["messages"])


@pytest.mark.parametrize(("interval", "settles"), [(0.0, 10), (3600.0, 1)])
async def test_one_partition_settles_each_commit_or_all_at_the_end(
        nc, js, unique_name, tmp_path, interval: float, settles: int) -> None:
    stream = unique_name
    evs = keyed.events(11, 400)
    api = await keyed.elastic_group(js, stream, evs, 1)
    steps: Counter[str] = Counter()
    sink = DeltaSink(str(tmp_path / "t"))
    r = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                            EngineOptions(batch_max_msgs=40, settle_interval_s=interval, **FAST),
                            hook=lambda s, _: steps.update([s]))
    assert r.status == "drained" and r.processed == 400 and r.commits == 10
    assert (steps["committed"], steps["purged"], steps["acked"]) == (10, settles, settles)
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _left(api, f"{stream}-g") == 0


@pytest.mark.parametrize(("interval", "most"), [(0.0, 12), (3600.0, 1)])
async def test_a_range_run_settles_every_partition_together(
        nc, js, unique_name, tmp_path, interval: float, most: int) -> None:
    stream = unique_name
    evs = keyed.events(40, 1200)
    api = await keyed.elastic_group(js, stream, evs, 4)
    purges: Counter[int] = Counter()

    def hook(step: str, info: dict) -> None:
        if step == "purged":
            purges[info["partition"]] += 1

    sink = DeltaSink(str(tmp_path / "t"))
    r = await run_partitions(nc, stream, "g", range(4), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=100, settle_interval_s=interval,
                                           **FAST), hook=hook)
    assert r.status == "drained" and r.processed == 1200 and r.commits == 12
    assert sorted(purges) == [0, 1, 2, 3]
    # each partition's purges: one per commit holding it, or one in all
    assert all(n <= most for n in purges.values()), purges
    if interval:
        assert set(purges.values()) == {1}
    else:
        assert sum(purges.values()) > 12  # most commits hold several partitions
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _left(api, f"{stream}-g") == 0


async def test_a_run_failing_with_commits_owed_leaves_them_to_the_next_run(
        nc, js, unique_name, tmp_path) -> None:
    stream = unique_name
    evs = keyed.events(11, 400)
    api = await keyed.elastic_group(js, stream, evs, 1)
    sink = DeltaSink(str(tmp_path / "t"))
    steps: Counter[str] = Counter()

    def fail_at_third_commit(step: str, info: dict) -> None:
        steps.update([step])
        if step == "committed" and steps[step] == 3:
            raise Crash("after the third commit")

    with pytest.raises(Crash):
        await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                            EngineOptions(batch_max_msgs=40, settle_interval_s=3600, **FAST),
                            hook=fail_at_third_commit)
    assert steps["purged"] == 0  # three commits, none settled
    assert sink.watermark(f"{stream}/g/0") == 120
    assert await _left(api, f"{stream}-g") == 400  # committed, owed a settle, still queued
    r = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                            EngineOptions(batch_max_msgs=40, **FAST))
    assert r.status == "drained" and r.processed == 280, r
    assert r.duplicates_skipped == 1  # the lease (sequence 1), at or below the watermark
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _left(api, f"{stream}-g") == 0


def test_a_settle_is_put_off_at_most_a_sixth_of_the_pin_timeout() -> None:
    assert EngineOptions(settle_interval_s=3600, priority_timeout_s=60).settle_after_s() == 10
    assert EngineOptions(settle_interval_s=1, priority_timeout_s=60).settle_after_s() == 1
    assert EngineOptions(settle_interval_s=0).settle_after_s() == 0
