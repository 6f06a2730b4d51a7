"""``bench/join.py --smoke`` runs and prints its headline: the join run's and the two single
runs' msg/s and their ratio, a finite positive figure (issue 39), and leaves nothing running.
Behaviour only: the figures at smoke size mean nothing and are not asserted."""

from __future__ import annotations

import math
import re

from tests.bench.test_smoke import BENCH, LEFTOVER_GRACE_S, run_smoke


def test_join_bench_smoke() -> None:
    run = run_smoke(BENCH / "join.py", timeout_s=300.0)
    tail = f"\n--- stdout ---\n{run.stdout[-3000:]}\n--- stderr ---\n{run.stderr[-3000:]}"
    assert run.returncode == 0, f"bench/join.py --smoke exited {run.returncode}{tail}"
    for line in (r"^join run: [\d,]+ msg/s \(\d+ commits\)$",
                 r"^two single runs: [\d,]+ msg/s \(\d+ commits\)$"):
        assert re.search(line, run.stdout, re.M), f"no line matching {line!r}{tail}"
    m = re.search(r"^join run / two single runs: ([\d.]+)$", run.stdout, re.M)
    assert m, f"no ratio line{tail}"
    ratio = float(m.group(1))
    assert math.isfinite(ratio) and ratio > 0, ratio
    assert not run.leftovers, (f"bench/join.py --smoke left processes running "
                               f"{LEFTOVER_GRACE_S:.0f} s after it exited: {run.leftovers}")
