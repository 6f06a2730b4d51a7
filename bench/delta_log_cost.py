"""What a Delta commit pays for the entries in ``_delta_log`` (issue 28's open question).

Grows one table (``delta.checkpointInterval`` = 10, as the sink creates tables; local disk, or
moto's S3 server mode in this process with ``--store s3``) to each of ``--versions`` and times,
at each level (medians of ``--repeats``):

* ``load``: a fresh snapshot load (``DeltaTable(uri)``: what a new process, the backlog
  sensor's tick, or ``watermarks()`` pays);
* ``incr``: ``update_incremental()`` of a snapshot held since the previous commit (loaded at
  this level, so it applies at most a few dozen versions, as the sink's held snapshots do);
* ``path default``: ``write_deltalake(uri, ...)``, one small append by path with delta-rs'
  default post-commit hooks (a fresh load, then a checkpoint every 10th version followed by
  the expired-log cleanup, which lists the whole log);
* ``held default`` / ``held no-cleanup`` / ``held no hooks``: the same append through a held
  ``DeltaTable`` (what :class:`~cg_pipelines.sinks.delta.DeltaSink` does within a run), with the
  default hooks, with ``PostCommitHookProperties(create_checkpoint=True,
  cleanup_expired_logs=False)`` (what the sink uses since issue 28: cleanup is ``maintain()``'s
  job), and with none;
* ``sink``: one :meth:`DeltaSink.commit` after :meth:`DeltaSink.watermark` on a fresh sink
  object (a run in a new process: one load and one fenced commit);
* ``sink held``: one :meth:`DeltaSink.commit` of the long-lived sink object that made every
  version of the table (a worker that keeps its sink, as ``bench/aging.py`` does).

The table keeps Delta's 30-day log retention, so nothing is cleaned up and ``log files`` is
what a table holds after that many commits within its retention. Prints one line per level and
a headline::

    delta_log_cost: sink commit <a> ms at <n> log files, <b> ms at <m> log files (x<b/a>)

Run: ``.venv/bin/python bench/delta_log_cost.py [--versions 20 1000 5000] [--repeats 9]
[--store local|s3]``; ``--smoke``: 20 and 200 versions, 3 repeats.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, PostCommitHookProperties, write_deltalake

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.storage import table_filesystem

ROW = pa.table({"k": pa.array([1], pa.int64())})
NO_CLEANUP = PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False)
NO_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall milliseconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1000


def log_files(uri: str, options: dict[str, str] | None) -> int:
    """Entries in the table's ``_delta_log`` (commits, checkpoints, ``_last_checkpoint``)."""
    import pyarrow.fs as pafs

    fs = table_filesystem(uri, options or {})
    assert fs is not None
    return len(fs.get_file_info(pafs.FileSelector("_delta_log")))


def measure(uri: str, options: dict[str, str] | None, versions: list[int], repeats: int
            ) -> list[tuple[int, float]]:
    """Print one line per level; return ``(log files, sink commit ms)`` per level."""
    write_deltalake(uri, ROW, configuration={"delta.checkpointInterval": "10"},
                    storage_options=options)
    held: DeltaTable
    long = DeltaSink(uri, storage_options=options)
    seq = [0]
    fill = [0]

    def long_commit() -> None:
        fill[0] += 1
        long.commit(ROW, {"fill": (fill[0] - 1, fill[0])})

    def held_append(hooks: PostCommitHookProperties | None) -> None:
        held.update_incremental()
        write_deltalake(held, ROW, mode="append", post_commithook_properties=hooks)

    def sink_commit() -> None:
        sink = DeltaSink(uri, storage_options=options)
        wm = sink.watermark("bench")
        seq[0] = wm + 1
        sink.commit(ROW, {"bench": (wm, seq[0])})

    out = []
    for target in sorted(versions):
        version = DeltaTable(uri, storage_options=options).version()
        while version < target:  # through the long-lived sink, as a worker's runs do
            long_commit()
            version += 1
        held = DeltaTable(uri, storage_options=options)  # loaded at this level
        load = median_ms(lambda: DeltaTable(uri, storage_options=options), repeats)
        incr = median_ms(held.update_incremental, repeats)
        by_path = median_ms(lambda: write_deltalake(uri, ROW, mode="append",
                                                    storage_options=options), repeats)
        default = median_ms(lambda: held_append(None), repeats)
        no_cleanup = median_ms(lambda: held_append(NO_CLEANUP), repeats)
        bare = median_ms(lambda: held_append(NO_HOOKS), repeats)
        sink = median_ms(sink_commit, repeats)
        sink_held = median_ms(long_commit, repeats)
        entries = log_files(uri, options)
        out.append((entries, sink))
        print(f"versions {target:6,d} ({entries:6,d} log files): load {load:6.1f}  incr "
              f"{incr:5.1f}  path default {by_path:6.1f}  held default {default:6.1f}  held "
              f"no-cleanup {no_cleanup:6.1f}  held no hooks {bare:6.1f}  sink {sink:6.1f}  "
              f"sink held {sink_held:6.1f} ms",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, nargs="+", default=[20, 1000, 5000])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--store", choices=["local", "s3"], default="local")
    ap.add_argument("--smoke", action="store_true", help="20 and 200 versions, 3 repeats")
    args = ap.parse_args()
    if args.smoke:
        args.versions, args.repeats = [20, 200], 3
    if args.store == "s3":
        from cg_pipelines.testing.s3 import MotoS3Server

        with MotoS3Server() as s3:
            bucket = f"cg-log-cost-{uuid.uuid4().hex[:8]}"
            s3.create_bucket(bucket)
            out = measure(f"s3://{bucket}/t", s3.storage_options(), args.versions,
                          args.repeats)
    else:
        with tempfile.TemporaryDirectory(prefix="cg-log-cost-") as tmp:
            out = measure(os.path.join(tmp, "t"), None, args.versions, args.repeats)
    (a_n, a), (b_n, b) = out[0], out[-1]
    print(f"delta_log_cost ({args.store}): sink commit {a:.1f} ms at {a_n:,d} log files, "
          f"{b:.1f} ms at {b_n:,d} log files (x{b / a:.2f})")


if __name__ == "__main__":
    main()
