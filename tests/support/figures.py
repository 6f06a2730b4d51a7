"""The figures tests report (printed in the terminal summary, "cg_pipelines figures").

Under pytest-xdist each worker collects its own and hands them to the controlling process when
it ends (``tests/conftest.py``), which prints them all.
"""

from __future__ import annotations

FIGURES: list[str] = []
"""Lines appended by tests (the ``report`` fixture) and session fixtures."""
