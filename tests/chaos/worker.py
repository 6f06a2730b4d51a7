"""One aircraft-legs partition run (or a run over several partitions) in its own process, with
an optional injected fault.

Usage: ``python tests/chaos/worker.py '<json spec>'`` where the spec has ``url``, ``stream``,
``group``, ``partitions`` (one: ``run_partition``; several: one ``run_partitions`` run over
them), ``table`` (Delta table URI), ``options`` (EngineOptions fields) and
``fault``: ``null`` or ``{"kind": "kill" | "stop" | "slow", "step": <engine hook step>,
"at": <occurrence>, "slow_s": <seconds>}``:

- ``kill``: SIGKILL itself right after the ``at``-th ``step`` (``read`` = inside the read/
  transform boundary, ``processed`` = transformed but not committed, ``committed`` = committed
  but not purged, ``purged`` = purged but not acked, ``acked``);
- ``stop``: SIGSTOP itself there (a zombie: the harness resumes it later with SIGCONT);
- ``slow``: block the event loop for ``slow_s`` seconds there (a slow transform that starves
  the lease keep-alive, so the ack wait and the pin timeout expire).

Prints one JSON line: the run result plus ``fired`` (whether the fault was injected), or
``{"error": ...}`` when the run raised.

With ``CG_CHAOS_TRACE=<dir>`` in the environment, every engine hook call (step, partition,
sequences) is appended to ``<dir>/<pid>.jsonl`` with its time: what each run leased, read,
committed, purged and acked, to follow a failing schedule message by message.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nats.aio.client import Client

from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition, run_partitions
from cg_pipelines.jetstream.connect import ConnectOptions, close_quietly
from cg_pipelines.sinks.delta import DeltaSink
from flights.legs import legs_arrow_processor


async def _connect(url: str) -> Client:
    """Connect, waiting up to 30 s for a server being restarted."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await ConnectOptions(url, connect_timeout=2, reconnect_wait_s=0.2).connect()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def main(spec: dict) -> dict:
    fault = spec.get("fault")
    state = {"seen": 0, "fired": False}
    trace_dir = os.environ.get("CG_CHAOS_TRACE")
    trace = open(Path(trace_dir) / f"{os.getpid()}.jsonl", "a") if trace_dir else None

    def hook(step: str, info: dict) -> None:
        if trace is not None:
            trace.write(json.dumps({"t": time.time(), "step": step, "parts": spec["partitions"],
                                    **{k: v for k, v in info.items()
                                       if isinstance(v, (int, str, float))}}) + "\n")
            trace.flush()
        if not fault or state["fired"] or step != fault["step"]:
            return
        state["seen"] += 1
        if state["seen"] < fault["at"]:
            return
        state["fired"] = True
        print(json.dumps({"fired": fault, "info": info}), flush=True)
        if fault["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault["kind"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault["kind"] == "slow":
            time.sleep(fault["slow_s"])  # blocks the loop: no keep-alive, the lease expires

    nc = await _connect(spec["url"])
    try:
        parts = spec["partitions"]
        args = (nc, spec["stream"], spec["group"])
        rest = (legs_arrow_processor(), DeltaSink(spec["table"]), EngineOptions(**spec["options"]))
        res = await (run_partition(*args, parts[0], *rest, hook=hook) if len(parts) == 1
                     else run_partitions(*args, parts, *rest, hook=hook))
        out = res.as_dict()
        out.pop("timings", None)
    except Exception as e:  # reported to the harness
        out = {"error": f"{type(e).__name__}: {e}"}
    finally:
        await close_quietly(nc)
    out["fired"] = state["fired"]
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
