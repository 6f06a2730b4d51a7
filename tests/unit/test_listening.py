"""``tests.support.procs.listening``: readiness of a test server is its own listening socket,
not any answer on its port (another process may hold a port picked free beforehand)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.support.procs import listening

CHILD = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


def test_the_listener_of_a_port_is_told_apart_from_other_processes() -> None:
    # a grandchild holds the port: the child (its parent) counts, another process does not
    child = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys\n"
                              f"subprocess.run([sys.executable, '-c', {CHILD!r}])"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert listening(child.pid, port)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert not listening(other.pid, port)
        finally:
            other.kill()
            other.wait()
        with socket.socket() as mine:
            mine.bind(("127.0.0.1", 0))
            mine.listen()
            assert listening(os.getpid(), mine.getsockname()[1])
            assert not listening(child.pid, mine.getsockname()[1])
    finally:
        for p in __import__("psutil").Process(child.pid).children(recursive=True):
            p.kill()
        child.kill()
        child.wait()
    assert not listening(child.pid, port)  # gone
