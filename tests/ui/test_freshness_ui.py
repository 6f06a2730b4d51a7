"""Freshness that tells the truth, in the UI (issue 40): a 4-partition group; partition g-1 is
drained by a run (it then idles: nothing pending), partition g-2 is stuck (its messages wait
past the 2 s objective, no run ever: the sensor's run threshold is out of reach). The backlog
sensor ticks under a real daemon. In headless Chromium:

- the ``lag_within_objective`` check (a partition's freshness) shows g-1 passed and g-2 failed
  (each partition's state, clicked in the check's Partitions tab), g-1's result being its
  drain run's own, current against its materialization;
- the asset shows no Dagster freshness failure (it carries no per-asset FreshnessPolicy, which
  would read "Failed (more than ... since last materialization)" for an idle group);
- no check plots a ``partition`` series: the run checks' pages plot their numeric metadata
  (``fence_conflicts``, ``dead_lettered``) and nothing named ``partition``.

Screenshots: ``<tmp_path>/freshness_partitions.png``, ``fence_check_plots.png``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dagster import AssetKey, DagsterInstance
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.dagster.history import check_states
from cg_pipelines.jetstream import admin
from tests.support import keyed
from tests.support.daemon import ROOT, daemon, make_home, start_sensor, wait_until
from tests.support.dagster_dev import DagsterWebserver
from tests.support.page import page_text, wait_for_page

pytestmark = pytest.mark.ui

LOCATION = '''\
import os

from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource, NatsResource,
                                  PartitionRunsResource, build_definitions)
from cg_pipelines.engine.processing import ArrowProcessor
from tests.support import keyed

devices = ConsumerGroupAsset(
    name="devices", stream=os.environ["CG_TEST_STREAM"], group="g", partitions=4,
    processor=ArrowProcessor(keyed.DECODER, keyed.transform, state=keyed.STATE),
    sensor_interval_s=1, schedule_cron=None, lag_objective_s=2.0)

defs = build_definitions([devices], resources={
    "nats": NatsResource(servers=os.environ["CG_TEST_NATS"]),
    "warehouse": DeltaWarehouseResource(root=os.environ["CG_TEST_WAREHOUSE"]),
    # the sensor never requests a run: g-1 is drained by the test, g-2 stays stuck
    "partition_runs": PartitionRunsResource(min_pending=10**9, ack_wait_s=1.5,
                                            priority_timeout_s=1.5, hold_wait_s=3),
})
'''

DRAINED, STUCK = "g-1", "g-2"
LAG = "lag_within_objective"


def _load(location: Path, env: dict[str, str]) -> object:
    """The location's ``defs``, imported in this process with ``env`` set."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        spec = importlib.util.spec_from_file_location("freshness_location", location)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules.pop("freshness_location", None)
        spec.loader.exec_module(module)
        return module.defs
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _lag(instance: DagsterInstance) -> dict[str, tuple[bool | None, bool, str]]:
    return {p: (s.passed, s.current, s.run_id)
            for (_, p), s in check_states(instance, AssetKey("devices"), [LAG]).items()}


async def test_freshness_per_partition_in_the_ui(js, nats_server, unique_name, tmp_path,
                                                 chrome) -> None:
    from selenium.webdriver.common.by import By

    stream = unique_name
    evs = [(k, n) for k, n in keyed.events(n_keys=24, n_events=120)
           if partition_for([k], 4) in (1, 2)]
    assert {partition_for([k], 4) for k, _ in evs} == {1, 2}
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        4, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await keyed.publish(js, stream, evs)

    home = make_home(tmp_path / "home")
    location = tmp_path / "location.py"
    location.write_text(LOCATION)
    (tmp_path / "workspace.yaml").write_text(
        f"load_from:\n  - python_file:\n      relative_path: {location}\n"
        f"      working_directory: {ROOT}\n")
    env = {"CG_TEST_STREAM": stream, "CG_TEST_NATS": nats_server.url,
           "CG_TEST_WAREHOUSE": str(tmp_path / "warehouse")}

    def drain_then_observe_and_browse() -> None:
        defs = _load(location, env)
        with DagsterInstance.from_config(str(home)) as instance:
            # g-1 drained by a run of the asset's job: its lag check, evaluated by the run
            # after the materialization, passes and is current
            res = defs.resolve_job_def("devices_job").execute_in_process(  # type: ignore[attr-defined]
                partition_key=DRAINED, instance=instance)
            assert res.success
            assert _lag(instance)[DRAINED] == (True, True, res.run_id)
            time.sleep(2.5)  # g-2's messages now wait past the 2 s objective
            start_sensor(home, location, env, "devices_backlog")
            with daemon(home, location, env):
                wait_until("lag checks of 4 partitions", lambda: len(_lag(instance)) == 4,
                           120, home)
                lag = _lag(instance)
                assert {p: v[0] for p, v in lag.items()} == {
                    "g-0": True, DRAINED: True, STUCK: False, "g-3": True}
                assert lag[DRAINED] == (True, True, res.run_id)  # still the run's own
                server = DagsterWebserver(home, tmp_path / "webserver.log", cwd=tmp_path,
                                          env={**os.environ, **env})
                try:
                    server.start()
                    browse(server.url, res.run_id)
                except BaseException:
                    print(f"webserver log tail:\n{server.log_tail()}")
                    raise
                finally:
                    server.stop()

    def browse(base: str, drain_run: str) -> None:
        driver = chrome

        def body() -> str:
            return page_text(driver)

        def wait_for(url: str, what: str, ok: Callable[[str], bool]) -> str:
            return wait_for_page(driver, url, what, ok, tmp_path / "failure.png")

        # 1. The freshness check's partitions: one failed (the stuck g-2), three passed.
        url = f"{base}/assets/devices?view=checks&checkDetail={LAG}"
        driver.get(url)
        wait_for(url, "the check", lambda t: LAG in t)
        driver.find_elements(By.XPATH, "//*[text()='Partitions']")[-1].click()
        text = wait_for(url, "per-partition states", lambda t: "Failed (1)" in t
                        and "Passed (3)" in t)
        (tmp_path / "freshness_partitions.txt").write_text(text)
        assert driver.save_screenshot(str(tmp_path / "freshness_partitions.png"))
        assert "Execution Failed (0)" in text and "Missing (0)" in text, text
        # each partition's result, clicked in the list: g-1 passed by its drain run (current
        # against that run's materialization), g-2 failed with its age
        for key, state, says in ((DRAINED, "Passed", "under 2 s old (0 pending)"),
                                 (STUCK, "Failed", "more than the 2 s objective")):
            shown = [e for e in driver.find_elements(
                By.XPATH, f"//*[normalize-space(text())='{key}']") if e.is_displayed()]
            max(shown, key=lambda e: e.location["y"]).click()  # the list's, not the chip
            detail = wait_for(url, f"{key}'s result", lambda t: "Select a partition" not in t)
            lines = [ln.strip() for ln in detail.splitlines()]
            at = len(lines) - 1 - lines[::-1].index(key)  # the detail pane's heading
            assert lines[at + 1] == state, detail
            assert says in detail, detail
            if key == DRAINED:  # the result is the drain run's own
                assert lines[lines.index("Run", at) + 1] == drain_run[:8], detail
            driver.save_screenshot(str(tmp_path / f"freshness_{key}.png"))

        # 2. The asset: no per-asset freshness policy, so no "Failed (more than ... since last
        #    materialization)" for a group whose drained partitions idle.
        url = f"{base}/assets/devices"
        driver.get(url)
        text = wait_for(url, "the asset", lambda t: "Latest check results" in t)
        (tmp_path / "asset_page.txt").write_text(text)
        assert "Freshness" not in text and "since last materialization" not in text, text

        # 3. Each check's Plots (one per numeric metadata entry): never a "partition" series.
        plotted = {}
        for check in ("no_unexplained_fence_conflicts", "no_new_dead_letters",
                      "backlog_drained", LAG):
            url = f"{base}/assets/devices?view=checks&checkDetail={check}"
            driver.get(url)
            text = wait_for(url, f"{check}'s plots", lambda t: "Plots" in t)
            (tmp_path / f"{check}_page.txt").write_text(text)
            if check == "no_unexplained_fence_conflicts":
                assert driver.save_screenshot(str(tmp_path / "fence_check_plots.png"))
            lines = [ln.strip() for ln in text.splitlines()]
            plotted[check] = lines[lines.index("Plots") + 1:]
        assert plotted["no_unexplained_fence_conflicts"] == ["fence_conflicts"], plotted
        assert plotted["no_new_dead_letters"] == ["dead_lettered"], plotted
        assert plotted["backlog_drained"][0] == "Plots are automatically generated by metadata"
        assert not any("partition" in line for lines in plotted.values() for line in lines), \
            plotted

    await asyncio.to_thread(drain_then_observe_and_browse)
