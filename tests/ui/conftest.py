"""The browser the UI tests drive: headless Debian Chromium through the system chromedriver
(Selenium; nothing downloaded). A missing binary fails the test, never skips it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def chrome(tmp_path: Path) -> Iterator[object]:
    """A headless Chromium driven by Selenium through the system chromedriver."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for binary in (CHROMIUM, CHROMEDRIVER):
        assert os.access(binary, os.X_OK), (
            f"{binary} missing: the UI test needs Debian's Chromium and ChromeDriver; "
            "install them with `bash scripts/setup.sh --tests` (or apt-get install -y "
            "chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--no-first-run", f"--user-data-dir={profile}", "--window-size=1600,1000"):
        opts.add_argument(arg)
    # An explicit driver path: Selenium Manager (which would download drivers) is not used.
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
