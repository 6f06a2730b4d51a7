"""``cg_pipelines.local.spawn.with_default_signals``: a program started through it has SIGINT,
SIGTERM and SIGHUP at their default dispositions and unblocked, whatever the starting process
ignores or blocks, keeps the PID it was started with, and runs no Python in the forked child
(no ``preexec_fn``). Linux (/proc/<pid>/status)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cg_pipelines.core.errors import UsageError
from cg_pipelines.local.spawn import with_default_signals

SIGS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _masks(pid: int, program: str) -> tuple[int, int]:
    """(SigIgn, SigBlk) of ``pid`` once it runs ``program`` (waited for: the exec)."""
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/comm").read_text().strip() != program:
        assert time.monotonic() < deadline, "the program was never exec'd"
        time.sleep(0.01)  # poll interval (deadline above)
    fields = dict(line.split(":\t", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return int(fields["SigIgn"], 16), int(fields["SigBlk"], 16)


@contextmanager
def _ignoring_and_blocking() -> Iterator[None]:
    old = {s: signal.signal(s, signal.SIG_IGN) for s in SIGS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(SIGS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in old.items():
            signal.signal(s, h)


def test_the_child_gets_default_signals_whatever_its_parent_ignores_or_blocks() -> None:
    bits = [1 << (int(s) - 1) for s in SIGS]
    with _ignoring_and_blocking():
        plain = subprocess.Popen(["sleep", "30"])
        ours = subprocess.Popen(with_default_signals(["sleep", "30"]))
    try:
        ign, blk = _masks(plain.pid, "sleep")  # what exec alone keeps: the test can fail
        assert all(ign & b and blk & b for b in bits)
        ign, blk = _masks(ours.pid, "sleep")  # the same PID, now the program
        assert not any(ign & b or blk & b for b in bits)
        ours.terminate()
        assert ours.wait(10) == -signal.SIGTERM
    finally:
        for p in (plain, ours):
            p.kill()
            p.wait(10)


def test_the_program_is_looked_up_on_the_path_and_gets_its_arguments() -> None:
    out = subprocess.run(with_default_signals(["sh", "-c", 'echo "$0|$1"', "a b", "c"]),
                         capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout == "a b|c\n"


def test_no_program_is_refused() -> None:
    with pytest.raises(UsageError, match="must name a program"):
        with_default_signals([])
