"""The keyed-events processor of :mod:`tests.support.keyed` that, once, stops in its second
batch to be killed: while ``marker`` exists, the second transform call of a process removes it,
writes the process id to ``pidfile`` and waits (the test kills it with SIGKILL). Used by the
Dag files the Airflow tests write."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa

from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext
from tests.support import keyed

STOP_S = 300.0
"""Seconds the stopped call waits for its SIGKILL (a bound: the test kills it in seconds)."""


def processor(marker: str, pidfile: str) -> ArrowProcessor:
    """The keyed processor, stopping once in its second batch while ``marker`` exists."""
    calls = 0

    def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
        nonlocal calls
        calls += 1
        if calls == 2 and os.path.exists(marker):
            os.remove(marker)
            Path(pidfile + ".tmp").write_text(str(os.getpid()))
            os.replace(pidfile + ".tmp", pidfile)
            time.sleep(STOP_S)  # stands for a long batch: the test kills this process
        return keyed.transform(table, ctx)

    return ArrowProcessor(keyed.DECODER, transform, state=keyed.STATE)


def failing(poison_key: str) -> ArrowProcessor:
    """The keyed processor, raising ``ValueError`` for every batch holding ``poison_key``."""

    def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
        if poison_key in table.column("key").to_pylist():
            raise ValueError(f"poisoned key {poison_key} in this batch")
        return keyed.transform(table, ctx)

    return ArrowProcessor(keyed.DECODER, transform, state=keyed.STATE)
