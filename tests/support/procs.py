"""Processes a test run started, found by an environment token they inherit.

A process started by the suite (directly, or by a server, a Dagster run or a script it
started) inherits the suite's environment, so a variable set to a fresh token at the start
finds every one of them in ``/proc/<pid>/environ``, whatever its parent is now (a process
whose parent died is re-parented to init and no longer looks like a child of pytest).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def with_token(var: str, token: str) -> list[tuple[int, str]]:
    """Processes ``(pid, command line)`` whose environment has ``var=token``, this process
    excluded. Processes that vanish or cannot be read while scanning are left out."""
    found = []
    needle = f"{var}={token}".encode()
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    "utf-8", "replace")
                if cmd:  # a zombie (already exited, not yet reaped) has no command line
                    found.append((int(entry.name), cmd.strip()[:300]))
        except OSError:  # gone, or not ours to read
            continue
    return found


def kill(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each pid; pids already gone are no error."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_gateway_jvm() -> None:
    """End the JVM pyspark launched in this process, if it did (idempotent).

    ``SparkSession.stop()`` keeps that JVM for a later session of the same process; it exits
    only with this process, which is after the suite's check that nothing it started is still
    running. pyspark has no public call for it: its gateway object and the process it launched
    (``SparkContext._gateway``, ``.proc``) are used here."""
    if "pyspark" not in sys.modules:
        return
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)
    gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is not None:
        if proc.stdin is not None:
            proc.stdin.close()  # the JVM exits when its stdin closes
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` or one of its descendants listens on TCP ``port`` (a server
    started on a port picked free beforehand may find it taken; a probe of the port alone
    could then be answered by the other process)."""
    import psutil

    try:
        family = {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               and c.pid in family for c in psutil.net_connections(kind="tcp"))
