"""Waiting on a page the Dagster UI renders (selenium), for the UI tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def page_text(driver: Any) -> str:
    """The visible text of the page's ``<body>``."""
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.TAG_NAME, "body").text)


def wait_for_page(driver: Any, url: str, what: str, ok: Callable[[str], bool],
                  screenshot: Path, timeout_s: float = 60.0) -> str:
    """Wait until the page's text satisfies ``ok`` and then stays the same across two polls
    half a second apart (rendered, not mid-update), and return it. On a timeout, save a
    screenshot to ``screenshot`` and raise ``AssertionError`` naming ``url``, ``what`` and the
    page's text."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, timeout_s, 0.25).until(lambda d: ok(page_text(driver)))
        last = [""]

        def settled(_: object) -> bool:
            now = page_text(driver)
            same = now == last[0] and ok(now)
            last[0] = now
            return same

        WebDriverWait(driver, timeout_s, 0.5).until(settled)
    except TimeoutException as e:
        driver.save_screenshot(str(screenshot))
        raise AssertionError(f"{url}: {what} not shown; page text:\n{page_text(driver)}") from e
    return page_text(driver)
