"""Standalone repro attempt for upstream: messages of an R3 stream never sourced into an R3
work-queue stream after the node leading both is killed with SIGKILL while publishing.

Needs only ``nats-server`` (>= 2.12; 2.15.1 checked) and ``nats-py``; no cg_pipelines code
runs in the data path (the cluster helper only starts/kills processes). Usage::

    python docs/repro/sourcing_gap.py --trials 5 --messages 40000

Each trial: a fresh 3-node cluster on loopback; stream ``O`` (subjects ``o.>``, R3, file); stream
``W`` (R3, retention workqueue, no subjects, ``sources: [{name: O, subject_transforms:
[{src: "o.*", dest: "{{partition(4,1)}}.o.{{wildcard(1)}}"}]}]``, discard new, allow_direct);
publish ``--messages`` messages on ``o.<k>`` (async, acks awaited in windows of 500, a failed
one republished with the same ``Nats-Msg-Id`` until stored); when a third are
published, SIGKILL the node leading ``W`` (``O``'s leader is first stepped down until the same
node leads both, as in the reported case; the trial says whether it did), restart it after
2 s, finish publishing, wait for sourcing to settle (``W``'s source lag 0 and ``W.last_seq``
stable for 5 s), then read every message of ``W`` and list the origin
sequences (``Nats-Stream-Source``) that are missing. A trial prints ``GAP`` with the ranges and
the restarted node's log lines about sourcing, or ``ok``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cg_pipelines.testing.cluster import NatsCluster  # process control only

W_CONFIG = {
    "name": "W", "retention": "workqueue", "storage": "file", "num_replicas": 3,
    "discard": "new", "allow_direct": True,
    "sources": [{"name": "O", "subject_transforms": [
        {"src": "o.*", "dest": "{{partition(4,1)}}.o.{{wildcard(1)}}"}]}],
}


async def req(nc: nats.NATS, subject: str, body: dict | None = None) -> dict:
    """A JSON API request, retried for 60 s while the cluster recovers."""
    deadline = time.monotonic() + 60
    while True:
        try:
            msg = await nc.request(subject, json.dumps(body or {}).encode(), timeout=5)
            resp = json.loads(msg.data)
            if "error" not in resp or time.monotonic() > deadline:
                return resp
        except Exception:  # timeouts / no responders while a node restarts
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.5)


async def sourced_origin_seqs(nc: nats.NATS, stream: str, last: int) -> set[int]:
    """Origin sequences (``Nats-Stream-Source``) of every message stored in ``stream``, read
    with batched direct gets (``$JS.API.DIRECT.GET``; a work-queue stream takes no R1
    consumer)."""
    seen: set[int] = set()
    seq = 1
    while seq <= last:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        body = {"seq": seq, "next_by_subj": ">", "batch": 1000}
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(body).encode(), reply=inbox)
        got = 0
        while True:
            m = await sub.next_msg(timeout=5)
            hdrs = m.headers or {}
            if "Status" in hdrs:
                break
            seq = int(hdrs["Nats-Sequence"]) + 1
            seen.add(int(hdrs["Nats-Stream-Source"].split(" ")[1]))
            got += 1
        await sub.unsubscribe()
        if not got:
            break
    return seen


async def trial(n: int, messages: int) -> bool:
    with NatsCluster(tempfile.mkdtemp(prefix=f"gap{n}-"), die_with_parent=True) as cluster:
        nc = await nats.connect(servers=cluster.urls, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.2)
        js = nc.jetstream(timeout=10)
        await req(nc, "$JS.API.STREAM.CREATE.O", {"name": "O", "subjects": ["o.>"],
                                                  "num_replicas": 3, "storage": "file"})
        await req(nc, "$JS.API.STREAM.CREATE.W", W_CONFIG)
        w_leader = await cluster.stream_leader("W")
        o_leader = await cluster.stream_leader("O")
        for _ in range(8):  # the reported case: one node leads both streams
            if o_leader == w_leader:
                break
            o_leader = await cluster.step_down_stream("O")
        killed = False
        sent = 0
        while sent < messages:
            ids = range(sent, min(sent + 500, messages))
            window = [(i, await js.publish_async(f"o.k{i % 97}", b"x" * 64,
                                                 headers={"Nats-Msg-Id": f"m{i}"}))
                      for i in ids]
            for i, f in window:
                try:
                    await f
                except Exception:  # retried until stored (de-duplicated by id)
                    while True:
                        try:
                            await js.publish(f"o.k{i % 97}", b"x" * 64, timeout=2,
                                             headers={"Nats-Msg-Id": f"m{i}"})
                            break
                        except Exception:
                            await asyncio.sleep(0.2)
            sent += len(window)
            if not killed and sent >= messages // 3:
                cluster.kill(w_leader)
                killed = True
                asyncio.get_running_loop().call_later(2.0, cluster.restart, w_leader)
        await cluster.wait_healthy(60)
        last, stable = -1, time.monotonic()
        while time.monotonic() - stable < 5:
            info = await req(nc, "$JS.API.STREAM.INFO.W")
            cur = info["state"]["last_seq"]
            lag = sum(s.get("lag", 0) for s in info.get("sources") or [])
            if cur != last or lag:
                last, stable = cur, time.monotonic()
            await asyncio.sleep(0.5)
        origin = (await req(nc, "$JS.API.STREAM.INFO.O"))["state"]
        seen = await sourced_origin_seqs(nc, "W", last)
        missing = sorted(set(range(1, origin["last_seq"] + 1)) - seen)
        await nc.close()
        where = (f"W led by {cluster.server_name(w_leader)}, O by "
                 f"{cluster.server_name(o_leader)}")
        if not missing:
            print(f"trial {n}: ok: {origin['messages']} origin, W last_seq {last} ({where})")
            return True
        ranges, start = [], missing[0]
        for a, b in zip(missing, missing[1:] + [None], strict=False):
            if b != a + 1:
                ranges.append(f"{start}..{a}")
                start = b
        w_state = (await req(nc, "$JS.API.STREAM.INFO.W"))["state"]
        print(f"trial {n}: GAP: {len(missing)} origin messages never sourced: "
              f"{', '.join(ranges[:10])} ({where}; W holds {w_state['messages']} messages, "
              f"sequences {w_state['first_seq']}..{w_state['last_seq']})")
        log = cluster.nodes[w_leader].log_path.read_text(errors="replace").splitlines()
        for line in log:
            if "ourc" in line:
                print("   ", line)
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--messages", type=int, default=40_000)
    args = ap.parse_args()
    gaps = errors = 0
    for i in range(args.trials):
        try:
            gaps += not asyncio.run(trial(i, args.messages))
        except Exception as e:  # a trial the client could not finish
            errors += 1
            print(f"trial {i}: not finished: {type(e).__name__}: {e}")
    print(f"{gaps} of {args.trials} trials lost messages between O and W "
          f"({errors} not finished)")


if __name__ == "__main__":
    main()
