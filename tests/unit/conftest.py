"""Unit-test helpers: a report that prints figures in pytest's terminal summary."""

from __future__ import annotations

import pytest

_REPORT: list[str] = []


@pytest.fixture
def report() -> list[str]:
    """Lines appended here are printed in the terminal summary (``-q`` runs show them too)."""
    return _REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _REPORT:
        terminalreporter.section("cg_pipelines figures")
        for line in _REPORT:
            terminalreporter.write_line(line)
