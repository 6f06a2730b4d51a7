"""Lag in the catalog without a run (issues 19, 29): a 4-partition group with a backlog on one
partition (stuck: no run ever); the backlog sensor ticks under a real daemon (its run threshold
set out of reach, so it requests nothing; the lag's slow cadence ``lag_refresh_s`` 1 s, its
budget out of reach); the stuck partition's oldest
pending age is observed again and again, growing, without any run; the asset's page in
headless Chromium then shows the partition's pending count and oldest pending age, and the
partitioned ``lag_within_objective`` check's per-partition states: one failed, three passed.

Screenshots: ``<tmp_path>/devices_lag.png``, ``devices_lag_later.png``,
``lag_check_partitions.png``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

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
    sensor_interval_s=1, schedule_cron=None, lag_objective_s=1.0, lag_refresh_s=1.0,
    lag_observations_per_day=86_400)  # the slow cadence at 1 s, its daily budget out of reach

defs = build_definitions([devices], resources={
    "nats": NatsResource(servers=os.environ["CG_TEST_NATS"]),
    "warehouse": DeltaWarehouseResource(root=os.environ["CG_TEST_WAREHOUSE"]),
    # never request a run: this test looks at lag only
    "partition_runs": PartitionRunsResource(min_pending=10**9),
})
'''


STUCK = "g-2"


def _observations(instance: DagsterInstance) -> list[tuple[str, dict]]:
    """Every lag observation, oldest first, as (partition, metadata)."""
    records = instance.fetch_observations(AssetKey("devices"), limit=200).records
    return [(r.asset_observation.partition, {k: v.value for k, v in
                                             r.asset_observation.metadata.items()})
            for r in reversed(records)
            if r.asset_observation is not None and r.asset_observation.partition]


def _lag_checks(instance: DagsterInstance) -> dict[str, bool | None]:
    return {p: s.passed for (_, p), s in check_states(
        instance, AssetKey("devices"), ["lag_within_objective"]).items()}


async def test_partition_lag_shows_on_the_asset_page(js, nats_server, unique_name, tmp_path,
                                                     chrome) -> None:
    from selenium.webdriver.common.by import By

    stream = unique_name
    evs = [(k, n) for k, n in keyed.events(n_keys=24, n_events=90)
           if partition_for([k], 4) == 2]
    assert evs
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        4, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
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

    def observe_and_browse() -> None:
        start_sensor(home, location, env, "devices_backlog")
        with DagsterInstance.from_config(str(home)) as instance, daemon(home, location, env):
            wait_until("lag checks of 4 partitions", lambda: len(_lag_checks(instance)) == 4,
                       120, home)
            seen = wait_until("the stuck partition observed on two ticks", lambda: (
                o := _observations(instance)) and len(o) >= 2 and o, 120, home)
            assert {p for p, _ in seen} == {STUCK}  # nothing pending elsewhere: not observed
            ages = [md["oldest_pending_age_s"] for _, md in seen]
            assert ages == sorted(ages) and ages[-1] > ages[0] >= 1.0, ages  # never frozen
            assert all(md["pending"] == len(evs) for _, md in seen)
            assert instance.get_runs() == []  # no run: the lag came from the sensor alone
            assert _lag_checks(instance) == {"g-0": True, "g-1": True, STUCK: False,
                                             "g-3": True}
            server = DagsterWebserver(home, tmp_path / "webserver.log", cwd=tmp_path,
                                      env={**os.environ, **env})
            try:
                server.start()
                browse(server.url, instance)
            except BaseException:
                print(f"webserver log tail:\n{server.log_tail()}")
                raise
            finally:
                server.stop()

    def browse(base: str, instance: DagsterInstance) -> None:
        driver = chrome

        def body() -> str:
            return page_text(driver)

        def wait_for(url: str, what: str, ok: Callable[[str], bool]) -> str:
            return wait_for_page(driver, url, what, ok, tmp_path / "failure.png")

        def shown_age(text: str) -> float:
            lines = [ln.strip() for ln in text.splitlines()]
            return float(lines[lines.index("oldest_pending_age_s") + 1])

        # The asset's events: the stuck partition's latest observation with its lag figures;
        # after another tick (still no run), a newer one with an older oldest pending message.
        url = f"{base}/assets/devices?view=events"
        driver.get(url)
        text = wait_for(url, "an observation", lambda t: "oldest_pending_age_s" in t)
        (tmp_path / "events_page.txt").write_text(text)
        assert f"Partition {STUCK} observed" in text, text
        for expected in ("pending", "oldest_pending_age_s", "first_pending_seq"):
            assert expected in text, f"{expected!r} not on {url}:\n{text}"
        assert "Join the Dagster community" not in text  # nux off: nothing covers the page
        assert driver.save_screenshot(str(tmp_path / "devices_lag.png"))
        age1 = shown_age(text)
        n = len(_observations(instance))
        wait_until("a later tick's observation", lambda: len(_observations(instance)) > n,
                   60, home)
        driver.get(url)
        text = wait_for(url, "a newer observation", lambda t: "oldest_pending_age_s" in t
                        and shown_age(t) > age1)
        (tmp_path / "events_page_later.txt").write_text(text)
        assert driver.save_screenshot(str(tmp_path / "devices_lag_later.png"))
        assert instance.get_runs() == []

        # The partitioned lag_within_objective check: its Partitions tab shows one failed
        # partition (the stuck one) and three passed.
        url = f"{base}/assets/devices?view=checks&checkDetail=lag_within_objective"
        driver.get(url)
        wait_for(url, "the check", lambda t: "lag_within_objective" in t)
        tabs = driver.find_elements(By.XPATH, "//*[text()='Partitions']")
        tabs[-1].click()  # the check's tab (the first one is the asset's)
        text = wait_for(url, "per-partition states", lambda t: "Failed (1)" in t
                        and "Passed (3)" in t)
        (tmp_path / "check_partitions_page.txt").write_text(text)
        for key in ("g-0", "g-1", STUCK, "g-3"):
            assert key in text, text
        assert driver.save_screenshot(str(tmp_path / "lag_check_partitions.png"))
        # the check list: the check's status (its partitions' worst: one failed)
        lines = [ln.strip() for ln in text.splitlines()]
        assert lines[lines.index("lag_within_objective") + 1] == "Failed", text

    await asyncio.to_thread(observe_and_browse)
