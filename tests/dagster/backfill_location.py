"""A code location for CLI tests: the keyed-events definitions of ``tests.dagster.defs_keyed``
built from the environment (``CG_TEST_STREAM``, ``NATS_URL``, ``CG_WAREHOUSE``, optional
``CG_MEMBERS``). Load it with ``-f tests/dagster/backfill_location.py -d <repo root>``."""

from __future__ import annotations

import os

from tests.dagster.defs_keyed import make_defs

defs = make_defs(
    os.environ["CG_TEST_STREAM"],
    os.environ["NATS_URL"],
    os.environ["CG_WAREHOUSE"],
    [m.strip() for m in os.environ.get("CG_MEMBERS", "").split(",") if m.strip()],
)
