"""What a Delta commit pays for the entries in ``_delta_log`` (issue 28's open question).

Grows one local table (``delta.checkpointInterval`` = 10, as the sink creates tables) to each
of ``--versions`` and times one small append there (median of ``--repeats``) three ways:
delta-rs' default post-commit hooks (checkpoint, then expired-log cleanup, which lists the
log), a checkpoint without the cleanup, and no hooks. Prints one line per level.

    .venv/bin/python bench/delta_log_cost.py --versions 20 500 1000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

import pyarrow as pa
from deltalake import DeltaTable, PostCommitHookProperties, write_deltalake

ROW = pa.table({"k": pa.array([1], pa.int64())})


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, nargs="+", default=[20, 500, 1000])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="20 versions, 3 repeats")
    args = ap.parse_args()
    if args.smoke:
        args.versions, args.repeats = [20], 3
    path = os.path.join(tempfile.mkdtemp(prefix="cg-log-cost-"), "t")
    write_deltalake(path, ROW, configuration={"delta.checkpointInterval": "10"})
    no_cleanup = PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False)
    no_hooks = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)
    for target in sorted(args.versions):
        version = DeltaTable(path).version()
        while version < target:  # checkpoints on, cleanup off: a fast fill
            write_deltalake(path, ROW, mode="append", post_commithook_properties=no_cleanup)
            version += 1
        default = median_ms(lambda: write_deltalake(path, ROW, mode="append"), args.repeats)
        checkpoint = median_ms(lambda: write_deltalake(
            path, ROW, mode="append", post_commithook_properties=no_cleanup), args.repeats)
        bare = median_ms(lambda: write_deltalake(
            path, ROW, mode="append", post_commithook_properties=no_hooks), args.repeats)
        entries = len(os.listdir(os.path.join(path, "_delta_log")))
        print(f"versions {target:6,d} ({entries:6,d} log files): default hooks {default:6.1f} ms"
              f"  checkpoint without cleanup {checkpoint:6.1f} ms  no hooks {bare:6.1f} ms",
              flush=True)


if __name__ == "__main__":
    main()
