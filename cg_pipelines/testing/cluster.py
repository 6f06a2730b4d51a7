"""A 3-node (or N-node) JetStream cluster on loopback, for tests of replicated streams.

Each node is a :class:`~cg_pipelines.local.nats_server.NatsServer` (same binary lookup, same
reliable stop: SIGTERM then SIGKILL by PID) with its own store directory, server name
(``n1``, ``n2``, ...), client port, route port and HTTP monitoring port, all on 127.0.0.1 and
chosen free when the cluster is made. Clients without credentials land in the account ``APP``
(JetStream enabled; ``no_auth_user``), so ``nats.connect(cluster.url)`` just works; the system
account ``SYS`` (user ``sys``, password :attr:`NatsCluster.system_password`) is only used by
:meth:`NatsCluster.step_down_meta`.

Usage (in an async test)::

    with NatsCluster(tmp_path / "cluster") as cluster:
        nc = await nats.connect(servers=cluster.urls)  # every node's URL
        leader = await cluster.stream_leader("orders")  # a node index, 0-based
        cluster.kill(leader)                            # kill -9
        cluster.restart(leader)                         # same store and ports
        await cluster.wait_healthy()

Or the ``nats_cluster`` pytest fixture of :mod:`cg_pipelines.testing.fixtures`.

All durations are seconds (``float``). Node indexes are 0-based; server names are 1-based
(``n1`` is node 0).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from cg_pipelines.core.errors import UsageError
from cg_pipelines.local.nats_server import NatsServer, NatsServerError

__all__ = ["NatsCluster", "NatsClusterError", "free_ports"]


class NatsClusterError(NatsServerError):
    """The cluster did not become healthy in time, or a helper found no leader/node."""


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (bound to 0, read back, closed).

    Routes must name their peers' ports before any node starts, so the cluster cannot let each
    server pick its own port as :class:`NatsServer` does; another process could take one of
    these in between (then :meth:`NatsCluster.start` fails with the node's log).
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class NatsCluster:
    """``size`` nats-server processes forming one JetStream cluster on 127.0.0.1.

    Args:
        base_dir: parent of the nodes' store directories (``<base_dir>/n1``, ...); each holds
            the node's ``nats-server.conf``, ``nats-server.log`` and ``jetstream/``.
        size: number of nodes (default 3; at least 1).
        name: the cluster name (``cluster { name }``).
        binary: nats-server binary (default: :func:`~cg_pipelines.testing.find_nats_server`).
        ready_timeout_s: seconds :meth:`start` waits for each node, then for a meta leader.
        stop_timeout_s: seconds :meth:`stop` waits for each node after SIGTERM before SIGKILL.
        die_with_parent: as :class:`NatsServer` (Linux: nodes die with the starting thread).

    Attributes:
        nodes: the :class:`NatsServer` of each node, index ``i`` has server name ``n<i+1>``.
        system_password: the ``sys`` user's password (random per cluster).
    """

    def __init__(
        self,
        base_dir: Path | str,
        size: int = 3,
        *,
        name: str = "cg",
        binary: str | None = None,
        ready_timeout_s: float = 20.0,
        stop_timeout_s: float = 3.0,
        die_with_parent: bool = False,
    ) -> None:
        if size < 1:
            raise UsageError(f"size must be >= 1, got {size}")
        self.base_dir = Path(base_dir)
        self.size = size
        self.name = name
        self.ready_timeout_s = ready_timeout_s
        self.system_password = secrets.token_hex(8)
        ports = free_ports(3 * size)
        self._client_ports = ports[:size]
        self._route_ports = ports[size:2 * size]
        self._monitor_ports = ports[2 * size:]
        routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in self._route_ports)
        self.nodes: list[NatsServer] = []
        for i in range(size):
            conf = _CONF.format(
                server_name=self.server_name(i), cluster=name, route_port=self._route_ports[i],
                routes=routes, sys_password=self.system_password)
            self.nodes.append(NatsServer(
                self.base_dir / self.server_name(i), port=self._client_ports[i],
                monitor_port=self._monitor_ports[i], config_text=conf, binary=binary,
                ready_timeout_s=ready_timeout_s, stop_timeout_s=stop_timeout_s,
                die_with_parent=die_with_parent))

    # -- names and addresses -------------------------------------------------------------------

    @staticmethod
    def server_name(index: int) -> str:
        """Server name of node ``index`` (0-based): ``n<index+1>``."""
        return f"n{index + 1}"

    def index_of(self, server_name: str) -> int:
        """Node index of a server name such as ``"n2"``.

        Raises:
            NatsClusterError: no node has that name.
        """
        for i in range(self.size):
            if self.server_name(i) == server_name:
                return i
        raise NatsClusterError(f"no node named {server_name!r} in cluster {self.name}")

    @property
    def urls(self) -> list[str]:
        """Client URLs of all nodes, ``["nats://127.0.0.1:<port>", ...]`` (running or not)."""
        return [f"nats://127.0.0.1:{p}" for p in self._client_ports]

    @property
    def url(self) -> str:
        """All client URLs comma separated: what ``--server``, ``NATS_URL`` and
        :class:`~cg_pipelines.jetstream.connect.ConnectOptions` take."""
        return ",".join(self.urls)

    @property
    def pids(self) -> list[int | None]:
        """Process id of each node (``None`` for a stopped one)."""
        return [n.pid for n in self.nodes]

    def running(self) -> list[int]:
        """Indexes of the nodes whose process is alive."""
        return [i for i, n in enumerate(self.nodes) if n.running]

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> NatsCluster:
        """Start every node, then wait (``ready_timeout_s``) until the cluster has a JetStream
        meta leader and every node reports healthy. Returns ``self``.

        Raises:
            NatsServerStartError: a node did not start (its log tail in the message).
            NatsClusterError: no healthy cluster in time; every node is stopped.
        """
        try:
            for node in self.nodes:
                node.start()
            self.wait_healthy_sync(self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every node: SIGTERM, then SIGKILL by PID after ``stop_timeout_s``.
        Idempotent."""
        for node in self.nodes:
            node.stop()

    def kill(self, index: int) -> None:
        """``kill -9`` node ``index`` (its store is left as a crash leaves it)."""
        self.nodes[index].kill()

    def restart(self, index: int) -> None:
        """Start node ``index`` again (killing it first if alive), same store and ports; does
        not wait for the cluster to catch up (see :meth:`wait_healthy`).

        Raises:
            NatsServerStartError: the node did not come back.
        """
        self.nodes[index].kill()
        self.nodes[index].start()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"NatsCluster({self.name}, {self.size} nodes, running={self.running()})"

    # -- monitoring (HTTP, per node) -----------------------------------------------------------

    def monitor(self, index: int, path: str, timeout_s: float = 2.0) -> dict[str, Any]:
        """GET ``http://127.0.0.1:<monitor port of node index>/<path>`` and decode the JSON
        (e.g. ``"jsz"``, ``"healthz?js-enabled-only=true"``). A non-2xx answer's JSON body is
        returned too (``/healthz`` answers 503 with ``{"status": "unavailable", ...}``).

        Raises:
            OSError: the node does not answer (stopped, starting).
        """
        url = f"http://127.0.0.1:{self._monitor_ports[index]}/{path.lstrip('/')}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # loopback
                return dict(json.loads(resp.read() or b"{}"))
        except urllib.error.HTTPError as e:
            return dict(json.loads(e.read() or b"{}"))

    def meta_leader(self) -> int | None:
        """Index of the JetStream meta leader as a running node reports it, or ``None``."""
        for i in self.running():
            try:
                leader = (self.monitor(i, "jsz").get("meta_cluster") or {}).get("leader")
            except (OSError, ValueError):
                continue
            if leader:
                return self.index_of(str(leader))
        return None

    def healthy(self) -> bool:
        """Every running node answers ``/healthz`` ok (JetStream current, streams and consumers
        caught up) and a meta leader is known. ``False`` when no node runs."""
        nodes = self.running()
        if not nodes:
            return False
        for i in nodes:
            try:
                if self.monitor(i, "healthz").get("status") != "ok":
                    return False
            except (OSError, ValueError):
                return False
        return self.meta_leader() is not None

    def wait_healthy_sync(self, timeout_s: float = 30.0) -> None:
        """Block until :meth:`healthy` (polling every 0.1 s) for at most ``timeout_s`` seconds.

        Raises:
            NatsClusterError: not healthy in time; the message has each node's health.
        """
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() >= deadline:
                raise NatsClusterError(
                    f"cluster {self.name} not healthy after {timeout_s:g} s: {self._states()}")
            time.sleep(0.1)

    async def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """:meth:`wait_healthy_sync` without blocking the event loop."""
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self.healthy):
            if time.monotonic() >= deadline:
                raise NatsClusterError(
                    f"cluster {self.name} not healthy after {timeout_s:g} s: "
                    f"{await asyncio.to_thread(self._states)}")
            await asyncio.sleep(0.1)

    def _states(self) -> str:
        out = []
        for i, node in enumerate(self.nodes):
            if not node.running:
                out.append(f"{self.server_name(i)} stopped")
                continue
            try:
                h = self.monitor(i, "healthz")
                why = f"{h.get('status')} {h.get('error') or ''}".strip()
                out.append(f"{self.server_name(i)} {why}")
            except (OSError, ValueError) as e:
                out.append(f"{self.server_name(i)} no answer ({e})")
        return "; ".join(out)

    # -- JetStream requests (async, short-lived connection) -----------------------------------

    async def request(
        self, subject: str, payload: dict[str, Any] | None = None, *, system: bool = False,
        timeout_s: float = 5.0,
    ) -> dict[str, Any]:
        """One JSON request to the running nodes (a new connection, closed after), as the
        ``APP`` account or, with ``system``, the system account. Returns the decoded answer.

        Raises:
            NatsClusterError: the answer carries an ``error`` (its description in the message).
            nats.errors.NoServersError, TimeoutError: no node reachable / no answer.
        """
        import nats  # deferred: nats-py is a dependency of the library, not of this module's import

        servers = [self.urls[i] for i in self.running()] or self.urls
        kw: dict[str, Any] = {"user": "sys", "password": self.system_password} if system else {}
        nc = await nats.connect(servers=servers, connect_timeout=2, max_reconnect_attempts=1,
                                allow_reconnect=False, **kw)
        try:
            body = json.dumps(payload or {}).encode()
            msg = await nc.request(subject, body, timeout=timeout_s)
        finally:
            await nc.close()
        resp: dict[str, Any] = json.loads(msg.data) if msg.data else {}
        if resp.get("error"):
            raise NatsClusterError(f"{subject}: {resp['error'].get('description')} "
                                   f"(status {resp['error'].get('code')})")
        return resp

    async def stream_info(self, stream: str, timeout_s: float = 15.0) -> dict[str, Any]:
        """``$JS.API.STREAM.INFO.<stream>`` as a dict (``cluster.leader``, ``cluster.replicas``,
        ``config.num_replicas`` ...). Unanswered requests (a stream electing a leader after a
        restart) are retried for up to ``timeout_s`` seconds.

        Raises:
            NatsClusterError: an error answer (e.g. stream not found).
            TimeoutError: no answer within ``timeout_s``.
        """
        return await self._info(f"$JS.API.STREAM.INFO.{stream}", timeout_s)

    async def consumer_info(self, stream: str, consumer: str, timeout_s: float = 15.0
                            ) -> dict[str, Any]:
        """``$JS.API.CONSUMER.INFO.<stream>.<consumer>`` as a dict (``cluster.leader``,
        ``num_pending``, ``priority_groups`` ...), retried as :meth:`stream_info`.

        Raises:
            NatsClusterError: an error answer (e.g. consumer not found).
            TimeoutError: no answer within ``timeout_s``.
        """
        return await self._info(f"$JS.API.CONSUMER.INFO.{stream}.{consumer}", timeout_s)

    async def stream_leader(self, stream: str, timeout_s: float = 15.0) -> int:
        """Index of the node leading ``stream``, waiting up to ``timeout_s`` seconds for one
        to be elected.

        Raises:
            NatsClusterError: no leader in time.
        """
        return await self._leader(f"$JS.API.STREAM.INFO.{stream}", f"stream {stream}",
                                  timeout_s)

    async def consumer_leader(self, stream: str, consumer: str, timeout_s: float = 15.0) -> int:
        """Index of the node leading consumer ``consumer`` of ``stream`` (a clustered
        consumer has its own leader), waiting up to ``timeout_s`` seconds for one.

        Raises:
            NatsClusterError: no leader in time.
        """
        return await self._leader(f"$JS.API.CONSUMER.INFO.{stream}.{consumer}",
                                  f"consumer {stream} > {consumer}", timeout_s)

    async def step_down_stream(self, stream: str, timeout_s: float = 15.0) -> int:
        """Make the leader of ``stream`` step down (``$JS.API.STREAM.LEADER.STEPDOWN``), wait
        until another node leads it, and return that node's index.

        Raises:
            NatsClusterError: the request failed, or no new leader within ``timeout_s``.
        """
        return await self._step_down(f"$JS.API.STREAM.INFO.{stream}",
                                     f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                                     f"stream {stream}", timeout_s)

    async def step_down_consumer(self, stream: str, consumer: str, timeout_s: float = 15.0
                                 ) -> int:
        """Make the leader of consumer ``consumer`` of ``stream`` step down
        (``$JS.API.CONSUMER.LEADER.STEPDOWN``), wait until another node leads it, and return
        that node's index. Pulls waiting at the old leader are ended by the new one with
        status 409 ``Leadership Change``.

        Raises:
            NatsClusterError: the request failed, or no new leader within ``timeout_s``.
        """
        return await self._step_down(f"$JS.API.CONSUMER.INFO.{stream}.{consumer}",
                                     f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}",
                                     f"consumer {stream} > {consumer}", timeout_s)

    async def _info(self, subject: str, timeout_s: float) -> dict[str, Any]:
        """A JetStream info request, retried while unanswered for up to ``timeout_s``."""
        import nats.errors

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.request(subject,
                                          timeout_s=max(0.5, min(5.0, deadline - time.monotonic())))
            except (TimeoutError, nats.errors.NoRespondersError, nats.errors.NoServersError):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)

    async def _leader(self, info_subject: str, what: str, timeout_s: float) -> int:
        """The node named as ``cluster.leader`` by the info at ``info_subject``."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while True:
            try:
                info = await self._info(info_subject,
                                        max(0.5, deadline - time.monotonic()))
                leader = (info.get("cluster") or {}).get("leader")
                if leader:
                    return self.index_of(str(leader))
            except Exception as e:  # retried until the deadline
                last = e
            if time.monotonic() >= deadline:
                raise NatsClusterError(f"{what} has no leader after {timeout_s:g} s"
                                       + (f" (last error: {last})" if last else ""))
            await asyncio.sleep(0.1)

    async def _step_down(self, info_subject: str, step_down_subject: str, what: str,
                         timeout_s: float) -> int:
        """Ask the leader named by ``info_subject`` to step down; the new leader's index."""
        old = await self._leader(info_subject, what, timeout_s)
        await self.request(step_down_subject)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                new = await self._leader(info_subject, what,
                                         max(0.1, deadline - time.monotonic()))
            except NatsClusterError:
                new = old
            if new != old:
                return new
            if time.monotonic() >= deadline:
                raise NatsClusterError(f"{what} still led by {self.server_name(old)} after "
                                       "its step-down")
            await asyncio.sleep(0.1)

    async def step_down_meta(self, timeout_s: float = 15.0) -> int:
        """Make the JetStream meta leader step down (``$JS.API.META.LEADER.STEPDOWN``, system
        account), wait for another node to lead, and return its index.

        Raises:
            NatsClusterError: no meta leader before, or no other one within ``timeout_s``.
        """
        old = await asyncio.to_thread(self.meta_leader)
        if old is None:
            raise NatsClusterError(f"cluster {self.name} has no meta leader")
        await self.request("$JS.API.META.LEADER.STEPDOWN", system=True)
        deadline = time.monotonic() + timeout_s
        while True:
            new = await asyncio.to_thread(self.meta_leader)
            if new is not None and new != old:
                return new
            if time.monotonic() >= deadline:
                raise NatsClusterError(f"meta leader still {self.server_name(old)} after its "
                                       "step-down")
            await asyncio.sleep(0.1)

    async def kill_stream_leader(self, stream: str) -> int:
        """``kill -9`` the node leading ``stream``; returns its index (restart it with
        :meth:`restart`)."""
        i = await self.stream_leader(stream)
        await asyncio.to_thread(self.kill, i)
        return i


_CONF = """
server_name: {server_name}
accounts {{
  SYS {{ users: [{{user: "sys", password: "{sys_password}"}}] }}
  APP {{ jetstream: enabled, users: [{{user: "app", password: "app"}}] }}
}}
system_account: SYS
no_auth_user: app
cluster {{
  name: {cluster}
  listen: "127.0.0.1:{route_port}"
  routes: [{routes}]
}}
"""
