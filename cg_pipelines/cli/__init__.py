"""``cg``: the consumer-group command line (mirrors the reference's ``cg`` tool), plus
``cg stream`` for the origin stream and ``cg dev`` / ``cg demo`` for local work.

Connection options (``--server``, ``--user``, ``--password``, ``--token``, ``--creds``,
``--nkey``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--timeout``, ``--json``) are accepted
before the command group and after any command. Exit codes: 0 ok; 2 invalid input or a
missing/conflicting group or stream (one-line error, nothing written); 1 server or connection
failure.
"""

from __future__ import annotations

from typing import Any

import click

from cg_pipelines.cli.admin import elastic, static, stream
from cg_pipelines.cli.context import Ctx, add_command_connection_options, group_connection_options
from cg_pipelines.cli.dev import demo, dev
from cg_pipelines.cli.maintain import maintain
from cg_pipelines.cli.ops import OPS_COMMANDS
from cg_pipelines.cli.spark import spark_archive, spark_connect
from cg_pipelines.jetstream.connect import drop_ssl_eof_notice

__all__ = ["main"]


@click.group()
@group_connection_options
@click.pass_context
def main(ctx: click.Context, **settings: Any) -> None:
    """Partitioned consumer groups on NATS JetStream."""
    drop_ssl_eof_notice()  # asyncio's harmless TLS-close notice is noise on a terminal
    ctx.obj = Ctx(settings)


for _group in (static, elastic, stream, *OPS_COMMANDS, maintain):
    add_command_connection_options(_group)
    main.add_command(_group)
main.add_command(dev)
main.add_command(demo)
main.add_command(spark_connect)
main.add_command(spark_archive)


if __name__ == "__main__":
    main()
