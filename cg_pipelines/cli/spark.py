"""``cg spark-connect start|stop|status``: a long-lived Spark Connect server for partition runs.

Queued Dagster runs each start a Python process; with a ``local[*]`` master each also starts
a Spark JVM of its own and warms it (5-10 s a run on 2 cores). With one long-lived Spark
Connect server (pyspark's own ``SparkConnectServer``, from the pip package's jars) a run is a
thin client: ``SparkResource(remote="sc://127.0.0.1:15002")`` (the example code location reads
``CG_SPARK_REMOTE``) opens a Connect session in well under a second, on a JVM that is already
warm. ``docs/SCALE.md`` has the measured costs.

Files under ``<state dir>/spark-connect/`` (state dir: ``--state-dir``, default ``./.state``,
as for ``cg dev``): ``server.json`` (pid, port, url, master, log, start time), ``connect.log``
(the server's output). ``start`` waits until the port listens and then warms the JVM with a
few small window-function jobs over Arrow data (``--warm-up 0`` skips it); ``stop`` stops the
server by pid (SIGTERM, then SIGKILL after ``--timeout`` seconds: servers started in the
background may ignore SIGTERM); ``status`` prints the state and exits 0 when the server is
up, 3 when it is not. Needs Java 17+ and ``pip install cg-pipelines[spark-connect]``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from cg_pipelines.cli.context import fail

__all__ = ["connect_dir", "default_archive", "read_state", "server_up", "spark_archive",
           "spark_connect"]

DEFAULT_PORT = 15002
"""Spark Connect's usual port."""

NOT_RUNNING = 3
"""Exit status of ``status`` when no server is up."""


def connect_dir(given: str | None) -> Path:
    """``<state dir>/spark-connect`` for ``--state-dir`` (default ``.state``), absolute."""
    return Path(given or ".state").resolve() / "spark-connect"


def read_state(folder: Path) -> dict[str, Any] | None:
    """The ``server.json`` of ``folder``, or ``None`` when there is none (or it is unreadable)."""
    try:
        state: dict[str, Any] = json.loads((folder / "server.json").read_text())
    except (OSError, ValueError):
        return None
    return state


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone (Linux)
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def server_up(state: dict[str, Any] | None) -> bool:
    """Whether the server ``state`` describes is running (its pid alive) and listening."""
    return (state is not None and _pid_alive(int(state["pid"]))
            and _listening(int(state["port"])))


@click.group("spark-connect")
def spark_connect() -> None:
    """A long-lived Spark Connect server for partition runs (thin-client runs)."""


_STATE_OPT = click.option("--state-dir", default=None,
                          help="State directory (default ./.state); files go to "
                          "<state dir>/spark-connect/.")


@spark_connect.command()
@_STATE_OPT
@click.option("--master", default="local[*]", show_default=True,
              help="The server's Spark master (local[N], spark://host:port ...).")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=int,
              help="gRPC port on 127.0.0.1 (0 = a free port).")
@click.option("--driver-memory", default="2g", show_default=True,
              help="The server JVM's memory (it runs every run's Spark work).")
@click.option("--conf", "confs", multiple=True, metavar="KEY=VALUE",
              help="Extra Spark setting of the server (repeatable).")
@click.option("--warm-up", "warm_up", default=3, show_default=True, type=int,
              help="Warm-up jobs after the start (0: none).")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True,
              help="Seconds to wait for the server to listen.")
def start(state_dir: str | None, master: str, port: int, driver_memory: str,
          confs: tuple[str, ...], warm_up: int, timeout_s: float) -> None:
    """Start the server in the background (it outlives this command) and print its URL."""
    from cg_pipelines.local.spark_cluster import SparkConnectServer

    folder = connect_dir(state_dir)
    old = read_state(folder)
    if server_up(old):
        assert old is not None
        click.echo(f"spark connect server already running: {old['url']} (pid {old['pid']})")
        click.echo(f"export CG_SPARK_REMOTE={old['url']}")
        return
    conf: dict[str, str] = {}
    for item in confs:
        if "=" not in item:
            fail(f"--conf {item!r}: expected KEY=VALUE", 2)
        k, v = item.split("=", 1)
        conf[k.strip()] = v.strip()
    if port and _listening(port):
        fail(f"port {port} is in use by another process: pass --port", 2)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    server = SparkConnectServer(master, log_dir=folder, port=port or None, conf=conf,
                                driver_memory=driver_memory, start_timeout_s=timeout_s)
    try:
        server.start()
    except (RuntimeError, OSError) as e:
        fail(f"spark connect server did not start: {e}", 1)
    listen_s = time.monotonic() - t0
    state = {"pid": server.pid, "port": server.port, "url": server.url, "master": master,
             "log": str(server.log), "started_at": time.time(), "python": sys.executable}
    (folder / "server.json").write_text(json.dumps(state, indent=2) + "\n")
    server.detach()
    click.echo(f"spark connect server {state['url']} (pid {state['pid']}, master {master}, "
               f"log {state['log']}); listening after {listen_s:.1f} s")
    if warm_up > 0:
        from cg_pipelines.spark.session import warm_up_connect

        try:
            took = warm_up_connect(str(state["url"]), rounds=warm_up)
        except Exception as e:  # the server runs; warming is best effort
            click.echo(f"warm-up failed ({type(e).__name__}: {e}); the server is up", err=True)
        else:
            click.echo("warm-up jobs: " + ", ".join(f"{s:.1f} s" for s in took))
    click.echo(f"export CG_SPARK_REMOTE={state['url']}")


@spark_connect.command()
@_STATE_OPT
@click.option("--timeout", "timeout_s", default=10.0, show_default=True,
              help="Seconds after SIGTERM before SIGKILL.")
def stop(state_dir: str | None, timeout_s: float) -> None:
    """Stop the server started by ``start`` (by pid; SIGKILL after the timeout)."""
    from cg_pipelines.local.spark_cluster import stop_pid

    folder = connect_dir(state_dir)
    state = read_state(folder)
    if state is None:
        click.echo(f"no spark connect server recorded under {folder}")
        return
    was = stop_pid(int(state["pid"]), timeout_s)
    (folder / "server.json").unlink(missing_ok=True)
    click.echo(f"spark connect server {state['url']} (pid {state['pid']}) "
               + ("stopped" if was else "was not running"))


@spark_connect.command()
@_STATE_OPT
@click.option("--json", "as_json", is_flag=True, help="Print the state as JSON.")
def status(state_dir: str | None, as_json: bool) -> None:
    """Print whether the server is up (exit 0) or not (exit 3)."""
    folder = connect_dir(state_dir)
    state = read_state(folder)
    up = server_up(state)
    if as_json:
        click.echo(json.dumps({"running": up, "state_dir": str(folder), **(state or {})}))
    elif state is None:
        click.echo(f"no spark connect server recorded under {folder}")
    else:
        age = time.time() - float(state.get("started_at", time.time()))
        click.echo(f"spark connect server {state['url']} (pid {state['pid']}, master "
                   f"{state['master']}): {'running' if up else 'NOT running'}, started "
                   f"{age:.0f} s ago; log {state['log']}")
    if not up:
        sys.exit(NOT_RUNNING)



def default_archive(state_dir: str | None) -> Path:
    """``<state dir>/spark/classes.jsa`` (state dir: ``--state-dir``, default ``.state``)."""
    return Path(state_dir or ".state").resolve() / "spark" / "classes.jsa"


@click.command("spark-archive")
@click.option("--state-dir", default=None,
              help="State directory (default ./.state); the archive goes to "
              "<state dir>/spark/classes.jsa unless --path.")
@click.option("--path", default=None, help="Where to write the archive.")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True,
              help="Seconds allowed.")
def spark_archive(state_dir: str | None, path: str | None, timeout_s: float) -> None:
    """Build the JVM class-data-sharing archive that local Spark JVMs of runs start from
    (SparkResource(class_archive=...)): ~2 s less per JVM start on 2 cores. Rebuild it after
    upgrading Java or pyspark (a stale archive is ignored by the JVM, never an error)."""
    from cg_pipelines.spark.classarchive import build_class_archive

    target = Path(path).resolve() if path else default_archive(state_dir)
    try:
        seconds = build_class_archive(target, timeout_s=timeout_s)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        fail(f"cannot build the Spark class archive at {target}: {e}", 1)
    size = target.stat().st_size / 2**20
    click.echo(f"spark class archive {target} ({size:.0f} MiB) built in {seconds:.1f} s; use "
               f"it with SparkResource(class_archive={str(target)!r})")
