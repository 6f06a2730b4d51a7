"""Lag in the catalog without a run (issue 19): a group with a backlog and no run ever; the
backlog sensor ticks under a real daemon (its run threshold set out of reach, so it requests
nothing); the asset's page in headless Chromium then shows each partition's pending count,
oldest pending age and the failing ``lag_within_objective`` check.

Screenshot: ``<tmp_path>/devices_lag.png``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from dagster import AssetKey, DagsterInstance
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.jetstream import admin
from tests.support import keyed
from tests.support.daemon import ROOT, daemon, make_home, start_sensor, wait_until
from tests.support.dagster_dev import DagsterWebserver

pytestmark = pytest.mark.ui

LOCATION = '''\
import os

from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource, NatsResource,
                                  PartitionRunsResource, build_definitions)
from cg_pipelines.engine.processing import ArrowProcessor
from tests.support import keyed

devices = ConsumerGroupAsset(
    name="devices", stream=os.environ["CG_TEST_STREAM"], group="g", partitions=3,
    processor=ArrowProcessor(keyed.DECODER, keyed.transform, state=keyed.STATE),
    sensor_interval_s=1, schedule_cron=None, lag_objective_s=1.0)

defs = build_definitions([devices], resources={
    "nats": NatsResource(servers=os.environ["CG_TEST_NATS"]),
    "warehouse": DeltaWarehouseResource(root=os.environ["CG_TEST_WAREHOUSE"]),
    # never request a run: this test looks at lag only
    "partition_runs": PartitionRunsResource(min_pending=10**9),
})
'''


def _observations(instance: DagsterInstance) -> dict[str, dict]:
    records = instance.fetch_observations(AssetKey("devices"), limit=50).records
    out: dict[str, dict] = {}
    for r in reversed(records):  # oldest first: the newest wins
        obs = r.asset_observation
        if obs is not None and obs.partition:
            out[obs.partition] = {k: v.value for k, v in obs.metadata.items()}
    return out


async def test_partition_lag_shows_on_the_asset_page(js, nats_server, unique_name, tmp_path,
                                                     chrome) -> None:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    stream = unique_name
    evs = keyed.events(n_keys=12, n_events=90)
    pending = {f"g-{p}": sum(1 for k, _ in evs if partition_for([k], 3) == p) for p in range(3)}
    assert all(pending.values())
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        3, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await keyed.publish(js, stream, evs)
    await asyncio.sleep(1.5)  # older than the 1 s lag objective

    home = make_home(tmp_path / "home")
    location = tmp_path / "location.py"
    location.write_text(LOCATION)
    (tmp_path / "workspace.yaml").write_text(
        f"load_from:\n  - python_file:\n      relative_path: {location}\n"
        f"      working_directory: {ROOT}\n")
    env = {"CG_TEST_STREAM": stream, "CG_TEST_NATS": nats_server.url,
           "CG_TEST_WAREHOUSE": str(tmp_path / "warehouse")}

    def observe() -> dict[str, dict]:
        start_sensor(home, location, env, "devices_backlog")
        with DagsterInstance.from_config(str(home)) as instance, daemon(home, location, env):
            return wait_until("lag observations of 3 partitions", lambda: (
                o := _observations(instance)) and len(o) == 3 and o, 120, home)

    seen = await asyncio.to_thread(observe)
    assert {k: v["pending"] for k, v in seen.items()} == pending
    assert all(v["oldest_pending_age_s"] >= 1.0 for v in seen.values()), seen
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_runs() == []  # no run: the lag came from the sensor alone

    server = DagsterWebserver(home, tmp_path / "webserver.log", cwd=tmp_path,
                              env={**__import__("os").environ, **env})
    try:
        await asyncio.to_thread(server.start)
        driver = chrome

        def body() -> str:
            return driver.find_element(By.TAG_NAME, "body").text

        # The asset's events: each partition's observation with its lag figures.
        url = f"{server.url}/assets/devices?view=events"
        driver.get(url)
        try:
            WebDriverWait(driver, 60, 0.25).until(
                lambda d: "oldest_pending_age_s" in body() or "Observation" in body())
        except TimeoutException as e:
            driver.save_screenshot(str(tmp_path / "devices_lag_failure.png"))
            raise AssertionError(f"{url}: no observation shown; page text:\n{body()}") from e
        time.sleep(1.0)
        text = body()
        (tmp_path / "events_page.txt").write_text(text)
        for key in pending:
            assert key in text, f"{key} not on {url}:\n{text}"
        for expected in ("observed", "pending", "oldest_pending_age_s", "first_pending_seq"):
            assert expected in text, f"{expected!r} not on {url}:\n{text}"
        assert "Join the Dagster community" not in text  # nux off: nothing covers the page
        assert driver.save_screenshot(str(tmp_path / "devices_lag.png"))

        # The asset's checks: lag_within_objective failed (1 s objective), with no run.
        url = f"{server.url}/assets/devices?view=checks"
        driver.get(url)
        try:
            WebDriverWait(driver, 60, 0.25).until(lambda d: "lag_within_objective" in body())
        except TimeoutException as e:
            raise AssertionError(f"{url}: check not shown; page text:\n{body()}") from e
        time.sleep(1.0)
        text = body()
        (tmp_path / "checks_page.txt").write_text(text)
        lines = [ln.strip() for ln in text.splitlines()]
        i = lines.index("lag_within_objective")
        assert lines[i + 1] == "Failed", text  # the check list: name, then its status
    except BaseException:
        print(f"webserver log tail:\n{server.log_tail()}")
        raise
    finally:
        server.stop()
