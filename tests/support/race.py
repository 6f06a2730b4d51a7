"""Run callables in threads released together (for commit races in tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def race(n: int, fn: Callable[[int], None]) -> dict[int, BaseException | None]:
    """Run ``fn(i)`` for i in range(n) in threads released together; each one's outcome."""
    barrier = threading.Barrier(n, timeout=30)
    out: dict[int, BaseException | None] = {}

    def run(i: int) -> None:
        barrier.wait()
        try:
            fn(i)
            out[i] = None
        except BaseException as e:  # recorded for the assertions
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "racer hung"
    return out
