"""Benchmark: streaming members (``static_consume`` / ``elastic_consume``) against a raw loop.

(1) Per-member throughput, ``max_ack_pending=1``: one member draining N pre-published
    messages of one partition (the handler acks each one) against the raw nats-py-level loop
    ``JetStreamAPI.pull(batch=1)`` + ``msg.ack()`` on a consumer with the same config as the
    member's (pinned priority group ``PCG``, ``max_ack_pending=1``, ``ack_wait`` 5 s, the same
    filters; checked: the two server-side configs are equal apart from the name). Static (the
    member reads the origin stream) and elastic (the work-queue stream of its own group, so
    member and raw each drain their own copy). Paths alternate, ``--repeats`` times; medians.
(2) Failover: two instances of one static member run as ``cg static consume`` subprocesses while
    the bench publishes continuously (one message every ``--publish-every-ms``); the pinned
    instance (the one printing messages) gets SIGKILL; the time from the kill to the first
    message the standby prints. ``--runs`` runs (default 5), median. Expected about
    ``priority_timeout = max(ack_wait, 1 s)``: the pin stays with the dead client until then.

Prints a table and the final line ``member/raw throughput: <x>; failover p50 <s> s``, where x is
the lower of the static and elastic ratios of median rates.

Run: ``.venv/bin/python bench/members.py [--messages 20000] [--repeats 3] [--runs 5]``;
``--smoke``: 300 messages, one run per path, one failover (checks the script runs, in seconds;
figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cg_pipelines.core.config import (  # noqa: E402
    PRIORITY_GROUP,
    ElasticConfig,
    PartitioningFilter,
    StaticConfig,
    work_queue_stream_name,
)
from cg_pipelines.jetstream import admin  # noqa: E402
from cg_pipelines.jetstream.api import JetStreamAPI, consumer_config  # noqa: E402
from cg_pipelines.jetstream.members import (  # noqa: E402
    GroupMsg,
    MemberConfig,
    elastic_consume,
    static_consume,
)
from cg_pipelines.local.nats_server import NatsServer  # noqa: E402

ACK_WAIT_S = 5.0
EXPIRES_S = max(1.0, min(ACK_WAIT_S / 2, 5.0))  # what the member's pull loop uses


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {one:.2f} (1 min) {five:.2f} (5 min)"


async def publish(js: JetStreamContext, subject: str, n: int) -> None:
    chunk = 2000
    for start in range(0, n, chunk):
        acks = [await js.publish_async(subject, f'{{"n": {i}}}'.encode())
                for i in range(start, min(n, start + chunk))]
        await asyncio.gather(*acks)


async def wait_messages(api: JetStreamAPI, stream: str, n: int) -> None:
    for _ in range(1200):
        if (await api.stream_info(stream))["state"]["messages"] >= n:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{stream}: {n} messages never arrived")


def raw_config(kind: str, name: str, filters: list[str]) -> dict[str, Any]:
    """The consumer config members.py creates (``_Member.consumer_wire_config``), named ``name``."""
    return consumer_config(
        **({"durable_name": name} if kind == "static" else {"name": name}),
        filter_subjects=filters, ack_wait_s=ACK_WAIT_S, max_ack_pending=1,
        inactive_threshold_s=ACK_WAIT_S if kind == "elastic" else None,
        priority_groups=[PRIORITY_GROUP], priority_policy="pinned_client",
        priority_timeout_s=max(ACK_WAIT_S, 1.0))


def comparable(info: dict[str, Any]) -> dict[str, Any]:
    cfg = dict(info["config"])
    for k in ("name", "durable_name", "created"):
        cfg.pop(k, None)
    return cfg


async def raw_drain(api: JetStreamAPI, kind: str, stream: str, name: str, filters: list[str],
                    n: int) -> tuple[float, dict[str, Any]]:
    """Seconds for the raw pull(batch=1)+ack loop to drain ``n`` messages; its config."""
    await api.create_consumer(stream, raw_config(kind, name, filters))
    pin = None
    done = 0
    t = time.monotonic()
    while done < n:
        got = await api.pull(stream, name, batch=1, expires_s=EXPIRES_S, pin_id=pin)
        if got.pin_lost:
            pin = None
            continue
        if not got.messages:
            raise RuntimeError(f"raw loop stalled at {done}: {got}")
        pin = got.pin_id
        for msg in got.messages:
            await msg.ack()
            done += 1
    secs = time.monotonic() - t
    return secs, comparable(await api.consumer_info(stream, name))


async def member_drain(js: JetStreamContext, api: JetStreamAPI, kind: str, stream: str,
                       group: str, n: int) -> tuple[float, dict[str, Any]]:
    """Seconds for one member (handler: ack) to drain ``n`` messages; its consumer config."""
    finished = asyncio.Event()
    count = 0

    async def handler(msg: GroupMsg) -> None:
        nonlocal count
        await msg.ack()
        count += 1
        if count >= n:
            finished.set()

    consume = static_consume if kind == "static" else elastic_consume
    handle = await consume(js, stream, group, "m1", handler,
                           MemberConfig(ack_wait_s=ACK_WAIT_S, max_ack_pending=1))
    t = time.monotonic()
    try:
        ended = asyncio.create_task(handle.done())
        await asyncio.wait([ended, asyncio.create_task(finished.wait())],
                           return_when=asyncio.FIRST_COMPLETED, timeout=600)
        secs = time.monotonic() - t
        if not finished.is_set():
            raise RuntimeError(f"member stopped at {count}/{n}: "
                               f"{ended.result() if ended.done() else 'timeout'}")
        on = stream if kind == "static" else work_queue_stream_name(stream, group)
        cname = f"{group}-m1" if kind == "static" else "m1"
        cfg = comparable(await api.consumer_info(on, cname))
    finally:
        handle.stop()
        err = await handle.done()
    if err is not None:
        raise RuntimeError(f"member ended with {err!r}")
    return secs, cfg


@dataclass
class Rates:
    member: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)

    def ratio(self) -> float:
        return statistics.median(self.member) / statistics.median(self.raw)


async def throughput(nc: Client, api: JetStreamAPI, n: int, repeats: int) -> dict[str, Rates]:
    js = nc.jetstream(timeout=30)
    out = {"static": Rates(), "elastic": Rates()}
    # static: partition 0 of 1 is the first token; member and raw read the same origin stream.
    await js.add_stream(StreamConfig(name="ST", subjects=["0.st.>"]))
    await publish(js, "0.st.k", n)
    # elastic: one origin stream; each run's group gets its own work-queue copy.
    await js.add_stream(StreamConfig(name="EL", subjects=["el.>"]))
    await publish(js, "el.k", n)
    ecfg = ElasticConfig(1, (PartitioningFilter("el.*", (1,)),), members=("m1",))
    configs: dict[tuple[str, str], dict[str, Any]] = {}
    for r in range(repeats):
        for path in ("raw", "member") if r % 2 == 0 else ("member", "raw"):
            for kind in ("static", "elastic"):
                group = f"{path}{r}"
                if kind == "static":
                    await admin.create_static(js, "ST", group, StaticConfig(1, (), ("m1",)))
                    stream, on, filters = "ST", "ST", ["0.>"]
                else:
                    await admin.create_elastic(js, "EL", group, ecfg)
                    stream, on, filters = "EL", f"EL-{group}", ["0.el.*"]
                    await wait_messages(api, on, n)
                if path == "raw":
                    secs, cfg = await raw_drain(api, kind, on, "m1" if kind == "elastic"
                                                else f"{group}-m1", filters, n)
                else:
                    secs, cfg = await member_drain(js, api, kind, stream, group, n)
                configs[(kind, path)] = cfg
                getattr(out[kind], path).append(n / secs)
                print(f"  {kind:<7} {path:<6} run {r + 1}: {n / secs:>8,.0f} msg/s", flush=True)
                if kind == "static":
                    await admin.delete_static(js, "ST", group)
                else:
                    await admin.delete_elastic(js, "EL", group)
    for kind in ("static", "elastic"):
        if configs[(kind, "member")] != configs[(kind, "raw")]:
            raise RuntimeError(f"{kind}: raw consumer config differs from the member's:\n"
                               f"{configs[(kind, 'member')]}\n{configs[(kind, 'raw')]}")
    return out


# ------------------------------------------------------------------------------------ failover


@dataclass
class Instance:
    proc: asyncio.subprocess.Process
    lines: list[tuple[float, str]] = field(default_factory=list)
    got_line: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task[None] | None = None

    async def read(self) -> None:
        assert self.proc.stdout is not None
        while True:
            raw = await self.proc.stdout.readline()
            if not raw:
                return
            self.lines.append((time.monotonic(), raw.decode().rstrip("\n")))
            self.got_line.set()


async def start_instance(url: str, group: str) -> Instance:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cg_pipelines.cli", "--server", url, "static", "consume", "FO",
        group, "m1", "--ack-wait", str(ACK_WAIT_S), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    inst = Instance(proc)
    inst.reader = asyncio.create_task(inst.read())
    return inst


async def stop_instance(inst: Instance) -> None:
    if inst.proc.returncode is None:
        inst.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(inst.proc.wait(), 20)
        except TimeoutError:
            inst.proc.kill()
            await inst.proc.wait()
    if inst.reader is not None:
        await inst.reader


async def wait_for(cond: Any, what: str, timeout: float = 30) -> None:
    t = time.monotonic()
    while not await cond():
        if time.monotonic() - t > timeout:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def failover_once(url: str, js: JetStreamContext, api: JetStreamAPI, run: int,
                        every_s: float) -> tuple[float, int, int]:
    """Seconds from SIGKILL of the pinned instance to the standby's first message; the last
    sequence the killed one printed and the first the standby printed."""
    group = f"fo{run}"
    await admin.create_static(js, "FO", group, StaticConfig(1, (), ("m1",)))
    stop_pub = asyncio.Event()

    async def publisher() -> None:
        i = 0
        while not stop_pub.is_set():
            await js.publish("0.fo.k", str(i).encode())
            i += 1
            await asyncio.sleep(every_s)

    pub = asyncio.create_task(publisher())
    a = await start_instance(url, group)
    b: Instance | None = None
    try:
        await asyncio.wait_for(a.got_line.wait(), 30)  # a is pinned: it prints messages
        b = await start_instance(url, group)
        standby = b

        async def b_waiting() -> bool:  # b's pull waits on the server next to a's
            info = await api.consumer_info("FO", f"{group}-m1")
            return int(info.get("num_waiting") or 0) >= 2

        await wait_for(b_waiting, "the standby's pull")
        await asyncio.sleep(0.5)
        if standby.lines:
            raise RuntimeError("the standby got messages before the kill")
        last_a = int(a.lines[-1][1].split()[1][1:]) if a.lines else 0
        t_kill = time.monotonic()
        a.proc.kill()
        await asyncio.wait_for(standby.got_line.wait(), 60)
        t_first, line = standby.lines[0]
        return t_first - t_kill, last_a, int(line.split()[1][1:])
    finally:
        stop_pub.set()
        await pub
        for inst in (a, b):
            if inst is not None:
                await stop_instance(inst)
        await admin.delete_static(js, "FO", group)


async def main(args: argparse.Namespace) -> None:
    print(f"machine: {load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="cg-bench-members-") as tmp, \
            NatsServer(Path(tmp) / "nats", port=0) as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream(timeout=30)
        api = JetStreamAPI(nc, timeout=30)
        try:
            print(f"throughput: {args.messages:,} messages per run, {args.repeats} runs per path",
                  flush=True)
            rates = await throughput(nc, api, args.messages, args.repeats)
            print(f"failover: {args.runs} runs, publishing every {args.publish_every_ms} ms",
                  flush=True)
            await js.add_stream(StreamConfig(name="FO", subjects=["0.fo.>"]))
            fo: list[float] = []
            for run in range(args.runs):
                secs, last_a, first_b = await failover_once(server.url, js, api, run,
                                                            args.publish_every_ms / 1000)
                fo.append(secs)
                print(f"  run {run + 1}: {secs:.2f} s (killed instance's last #{last_a}, "
                      f"standby's first #{first_b})", flush=True)
        finally:
            await api.close()
            await nc.close()

    print()
    print(f"{'per-member throughput, max_ack_pending=1':<44} {'median msg/s':>12} "
          f"{'min':>9} {'max':>9}")
    for kind in ("static", "elastic"):
        for path, label in (("raw", "raw pull(batch=1)+ack"), ("member", f"{kind}_consume")):
            xs = getattr(rates[kind], path)
            print(f"  {kind + ': ' + label:<42} {statistics.median(xs):>12,.0f} "
                  f"{min(xs):>9,.0f} {max(xs):>9,.0f}")
        print(f"  {kind + ': member/raw':<42} {rates[kind].ratio():>12.2f}")
    print(f"{'failover (SIGKILL pinned -> standby first msg)':<44} "
          f"{'p50 ' + format(statistics.median(fo), '.2f') + ' s':>12} {min(fo):>8.2f}s "
          f"{max(fo):>8.2f}s")
    print(f"ack_wait {ACK_WAIT_S:g} s, priority_timeout {max(ACK_WAIT_S, 1.0):g} s; "
          f"machine after: {load()}")
    ratio = min(rates["static"].ratio(), rates["elastic"].ratio())
    print(f"member/raw throughput: {ratio:.2f}; failover p50 {statistics.median(fo):.2f} s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=3, help="throughput runs per path")
    p.add_argument("--runs", type=int, default=5, help="failover runs")
    p.add_argument("--publish-every-ms", type=float, default=10.0)
    p.add_argument("--smoke", action="store_true", help="300 messages, one failover")
    args = p.parse_args()
    if args.smoke:
        args.messages, args.repeats, args.runs = 300, 1, 1
    asyncio.run(main(args))
