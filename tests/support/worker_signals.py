"""What the one-partition worker processes (crash and zombie tests) share: the engine hook that
signals the worker itself at the N-th time a step is reached, and the engine options they run
with."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from cg_pipelines.engine.options import EngineOptions


def signal_at(step: str, at: str, sig: str) -> Callable[[str, dict], None]:
    """An engine ``hook`` that sends this process SIGKILL (``sig == "KILL"``) or SIGSTOP (else)
    the ``at``-th time step ``step`` is reached (``"-"``: never)."""
    seen = {"n": 0}

    def hook(name: str, info: dict) -> None:
        if name == step:
            seen["n"] += 1
            if seen["n"] == int(at):
                os.kill(os.getpid(), signal.SIGKILL if sig == "KILL" else signal.SIGSTOP)

    return hook


def worker_options(batch: str, ack_wait: str, settle_interval: str | None = None
                   ) -> EngineOptions:
    """Engine options from the worker's ``BATCH``, ``ACK_WAIT_S`` and optional
    ``SETTLE_INTERVAL_S`` arguments. Without the last, every commit is settled at once
    (``settle_interval_s=0``), so that the N-th ``purged`` or ``acked`` step, where the tests
    kill a worker, is the N-th batch's (the default settles several commits together; its
    kill test passes an interval)."""
    return EngineOptions(batch_max_msgs=int(batch), ack_wait_s=float(ack_wait),
                         priority_timeout_s=float(ack_wait), hold_wait_s=4 * float(ack_wait),
                         settle_interval_s=float(settle_interval or 0))
