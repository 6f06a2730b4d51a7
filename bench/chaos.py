"""Benchmark: the fault-injection harness (tests/chaos/harness.py), longer than CI's run.

Runs ``--rounds`` chaos runs with consecutive seeds from ``--seed`` (random if not given) on a
bigger flights slice with more faults, prints each run's report and a total line:

``total: <rounds> runs, <events> events, faults <n>, lost 0, order violations 0, duplicate
effects 0, fence conflicts <n>, failed runs <k>``

Run: ``.venv/bin/python bench/chaos.py [--rounds 5] [--seed S] [--flights 20000]``.
Exit status 1 if any run broke a promise (or did not finish). ``--smoke``: one run (seed 0
unless given) of 1,000 flights on 4 partitions in 4 windows, batches of 100, one fault of each
kind (two membership changes): every fault path, in well under a minute.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flights.data import load_flights
from tests.chaos.harness import ChaosConfig, run_chaos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--flights", type=int, default=20_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--batch", type=int, default=400)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--smoke", action="store_true", help="one small run, one fault of each kind")
    args = ap.parse_args()
    faults = {"step_kills": 2, "random_kills": 4, "zombies": 2, "slow_runs": 2,
              "server_restarts": 3, "membership_changes": 6, "step_downs": 4}
    if args.smoke:
        args.rounds, args.flights, args.windows, args.partitions, args.batch = 1, 1_000, 4, 4, 100
        args.seed = 0 if args.seed is None else args.seed
        faults = {k: 2 if k == "membership_changes" else 1 for k in faults}
    seed0 = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    df = load_flights()
    totals: Counter[str] = Counter()
    failed = 0
    t0 = time.monotonic()
    for i in range(args.rounds):
        cfg = ChaosConfig(seed=seed0 + i, flights=args.flights, partitions=args.partitions,
                          batch=args.batch, windows=args.windows, window_pause_s=0.5,
                          max_runs=4, time_limit_s=600.0, **faults)
        with tempfile.TemporaryDirectory(prefix="cg-chaos-") as d:
            rep = run_chaos(cfg, Path(d), lambda s: None, df=df)
        print("\n".join(rep.lines()), flush=True)
        failed += not rep.ok
        totals.update(events=rep.events, faults=sum(rep.faults.values()), lost=rep.lost,
                      order=rep.order_violations, dups=rep.duplicates,
                      fence=rep.fence_conflicts, runs=rep.runs, retries=rep.nats_retries)
    print(f"total: {args.rounds} runs (seeds {seed0}..{seed0 + args.rounds - 1}), "
          f"{totals['events']:,} events, {totals['runs']} partition runs, "
          f"{totals['retries']} NATS retries, {time.monotonic() - t0:.0f} s; "
          f"faults {totals['faults']}, lost {totals['lost']}, order violations "
          f"{totals['order']}, duplicate effects {totals['dups']}, fence conflicts "
          f"{totals['fence']}, failed runs {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
