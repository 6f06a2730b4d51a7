"""The Dagster UI in a real headless browser: the ``aircraft_legs`` asset page shows its 8
partitions, all materialized, with each partition's latest materialization.

Flow: the main job (``mainjob.run_main_job``) on a 3,000-flight slice materializes
all 8 partitions into ``<tmp>/state/dagster``; ``dagster-webserver -w workspace.yaml`` (no
daemon) serves that Dagster home on a free loopback port; headless Chromium (Selenium, the
Debian ``chromium`` + ``chromium-driver`` binaries, nothing downloaded) opens
``/assets/aircraft_legs?view=partitions``; GraphQL (``POST /graphql``) cross-checks the counts
and run ids. Screenshot: ``<tmp_path>/aircraft_legs.png``, copied to
``.state/ui/aircraft_legs.png``.

The main job runs in a child interpreter, not in the pytest process: it sets ``NATS_URL``,
``DAGSTER_HOME`` ... in ``os.environ`` and imports ``definitions``, whose
resources read the environment at import time, so in a pytest process that had already imported
that module (tests/dagster does) its runs would use the earlier NATS URL and warehouse; it also
stops the process-wide SparkSession. A child keeps the environment, the module cache and Spark of
this process untouched, and can be stopped (SIGINT, then SIGKILL of its group) on a timeout.

Needs: ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (Debian ``chromium``,
``chromium-driver``), PyPI ``selenium``. Missing pieces fail the test (it never skips).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cg_pipelines.local.spawn import with_default_signals
from tests.support.dagster_dev import (
    PROJECT_ROOT,
    DagsterWebserver,
    asset_partitions,
    configure_dagster_home,
    stop_process_group,
)

pytestmark = pytest.mark.ui

ASSET = "aircraft_legs"
PARTITION_KEYS = [f"legs-{p}" for p in range(8)]
LIMIT = 3000
MAIN_JOB_TIMEOUT_S = 420.0
BATCH = 120
SCREENSHOT_COPY = PROJECT_ROOT / ".state" / "ui" / "aircraft_legs.png"
# What the child interpreter prints last: the main job's return value (mismatches, -1 = failed run)
RESULT_PREFIX = "CG_UI_MAIN_JOB_RESULT "
_CHILD = (
    "import sys\n"
    "from pathlib import Path\n"
    "from mainjob import run_main_job\n"
    "n = run_main_job(Path(sys.argv[1]), limit=int(sys.argv[2]))\n"
    f"print({RESULT_PREFIX!r} + str(n), flush=True)\n"
)


def _clean_env() -> dict[str, str]:
    """This process's environment without the settings that would change what the main job or
    the code location do (served members, NATS credentials, Spark master, warehouse, home)."""
    return {k: v for k, v in os.environ.items()
            if not (k.startswith("CG_") or (k.startswith("NATS_") and k != "NATS_SERVER_BIN")
                    or k == "DAGSTER_HOME")}


def _run_main_job(state: Path, log_path: Path) -> int:
    """``run_main_job(state, limit=LIMIT)`` in a child interpreter; returns its result."""
    # Small batches: each partition's ~375 events commit in several batches, so every
    # aircraft's legs cross batch boundaries (state read back from the committed table).
    env = {**_clean_env(), "PYTHONUNBUFFERED": "1", "CG_BATCH_MAX_MSGS": str(BATCH),
           "CG_ADAPTIVE_MAX_MSGS": "0"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            with_default_signals([sys.executable, "-c", _CHILD, str(state), str(LIMIT)]),
            cwd=PROJECT_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=MAIN_JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGINT first: KeyboardInterrupt runs the main job's finally blocks (its
            # nats-server lives in its own session), then SIGKILL the group (Spark's JVM).
            stop_process_group(proc, 20.0, first=signal.SIGINT)
            pytest.fail(f"main job still running after {MAIN_JOB_TIMEOUT_S:g} s; log tail:\n"
                        f"{_tail(log_path)}")
        finally:
            stop_process_group(proc, 5.0)
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
             if ln.startswith(RESULT_PREFIX)]
    assert rc == 0 and lines, f"main job exited with {rc}; log tail:\n{_tail(log_path)}"
    commits = [int(m) for m in re.findall(r"partition \d+: run \w+ drained, [\d,]+ messages, "
                                          r"(\d+) commits", log_path.read_text(errors="replace"))]
    assert len(commits) == 8 and min(commits) >= 2, f"batches did not split: {commits}"
    return int(lines[-1][len(RESULT_PREFIX):])


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def test_asset_page_shows_eight_materialized_partitions(tmp_path: Path, chrome: object) -> None:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    driver: WebDriver = chrome  # type: ignore[assignment]
    t0 = time.monotonic()
    state = tmp_path / "state"
    home = configure_dagster_home(state / "dagster")

    # 1. Materialize the 8 partitions (the main job copies the project's dagster.yaml into
    #    the home; telemetry and the community dialog are switched off again afterwards).
    mismatches = _run_main_job(state, tmp_path / "mainjob.log")
    assert mismatches == 0, (
        f"main job: {mismatches} mismatches; log tail:\n{_tail(tmp_path / 'mainjob.log')}")
    configure_dagster_home(home)
    t_job = time.monotonic() - t0

    env = {**_clean_env(), "CG_STATE_DIR": str(state),
           "CG_WAREHOUSE": str(state / "mainjob" / "warehouse")}
    server = DagsterWebserver(home, tmp_path / "webserver.log", env=env)
    try:
        server.start()
        t_server = time.monotonic() - t0

        # 2. GraphQL: 8 of 8 partitions materialized, one materialization per partition.
        asset = asset_partitions(server.url, ASSET)
        assert asset["__typename"] == "Asset", asset
        definition = asset["definition"]
        assert definition["partitionKeys"] == PARTITION_KEYS
        assert definition["partitionStats"] == {"numMaterialized": 8, "numPartitions": 8,
                                                "numFailed": 0, "numMaterializing": 0}
        run_ids = {m["partition"]: m["runId"] for m in asset["assetMaterializations"]}
        assert sorted(run_ids) == PARTITION_KEYS
        assert len(set(run_ids.values())) == 8  # one run per partition

        # 3. The browser: the asset's Partitions tab.
        url = f"{server.url}/assets/{ASSET}?view=partitions"
        driver.get(url)

        def body() -> str:
            return driver.find_element(By.TAG_NAME, "body").text

        try:
            WebDriverWait(driver, 60, 0.25).until(lambda d: "Materialized (8)" in body())
        except TimeoutException as e:
            driver.save_screenshot(str(tmp_path / "aircraft_legs_failure.png"))
            raise AssertionError(
                f"{url} never showed 'Materialized (8)'; page text:\n{body()}") from e
        text = body()
        (tmp_path / "partitions_page.txt").write_text(text)
        assert driver.title == f"Assets | {ASSET}"
        for expected in ("8 Partitions Selected", "Materialized (8)", "Failed (0)",
                         "Materializing (0)", "Missing (0)"):
            assert expected in text, f"{expected!r} not on the page:\n{text}"
        assert "Join the Dagster community" not in text  # nux off: nothing covers the page
        # the partition list: exactly the keys legs-0..legs-7, in order (the only lines that
        # are a partition key while no partition is selected)
        assert [ln.strip() for ln in text.splitlines()
                if re.fullmatch(r"legs-\d+", ln.strip())] == PARTITION_KEYS, text

        # 4. Each partition, clicked in the list, shows its latest materialization: status
        #    "Materialized", the run (short id, as GraphQL reports it), the job, the metadata.
        for key in PARTITION_KEYS:
            driver.find_element(By.XPATH, f"//span[normalize-space(text())='{key}']").click()
            short = run_ids[key][:8]
            try:
                WebDriverWait(driver, 30, 0.1).until(
                    lambda d, k=key, s=short: f"partition={k}" in d.current_url and s in body())
            except TimeoutException as e:
                driver.save_screenshot(str(tmp_path / "aircraft_legs_failure.png"))
                raise AssertionError(f"partition {key}: run {short} not shown; page text:\n"
                                     f"{body()}") from e
            detail = body()
            for expected in ("Materialized", "Latest materialization", f"{ASSET}_job",
                             "drained", "messages"):
                assert expected in detail, f"partition {key}: {expected!r} missing:\n{detail}"

        # 5. Screenshot: the list of 8 partitions (all green) with partition 7's materialization.
        shot = tmp_path / "aircraft_legs.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT_COPY)
    except BaseException:
        print(f"webserver log tail:\n{server.log_tail()}")
        raise
    finally:
        server.stop()
    assert server.pid is None
    print(f"main job {t_job:.1f} s, webserver ready at {t_server:.1f} s, "
          f"total {time.monotonic() - t0:.1f} s; screenshot {shot} (copy {SCREENSHOT_COPY})")
