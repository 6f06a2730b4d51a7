"""``cg``: the consumer-group command line (mirrors the reference's ``cg`` tool), plus
``cg stream`` for the origin stream and ``cg dev`` / ``cg demo`` for local work.

Connection options (``--server``, ``--user``, ``--password``, ``--token``, ``--creds``,
``--nkey``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--timeout``, ``--json``) are accepted
before the command group and after any command. Exit codes: 0 ok; 2 invalid input or a
missing/conflicting group or stream (one-line error, nothing written); 1 server or connection
failure. With ``--json``, every error (a usage error too) is one JSON object
``{"error": ..., "exit_code": ...}`` on stdout. ``cg --version`` prints the library's version.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import click

from cg_pipelines.cli.admin import elastic, static, stream
from cg_pipelines.cli.context import Ctx, add_command_connection_options, group_connection_options
from cg_pipelines.cli.dev import demo, dev
from cg_pipelines.cli.maintain import maintain
from cg_pipelines.cli.migrate import migrate_command
from cg_pipelines.cli.ops import OPS_COMMANDS
from cg_pipelines.cli.runs import runs
from cg_pipelines.cli.spark import spark_archive, spark_connect
from cg_pipelines.jetstream.connect import drop_ssl_eof_notice
from cg_pipelines.version import __version__

__all__ = ["main"]


class CgGroup(click.Group):
    """The ``cg`` group: click's usage errors as JSON when ``--json`` is given."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode or "--json" not in argv:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            return super().main(argv, prog_name, complete_var, False, **extra)
        except click.ClickException as e:
            click.echo(json.dumps({"error": e.format_message(), "exit_code": e.exit_code}))
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo(json.dumps({"error": "aborted", "exit_code": 1}))
            sys.exit(1)


@click.group(cls=CgGroup)
@click.version_option(__version__, "--version", prog_name="cg",
                      message="%(prog)s (cg-pipelines) %(version)s")
@group_connection_options
@click.pass_context
def main(ctx: click.Context, /, **settings: Any) -> None:
    """Partitioned consumer groups on NATS JetStream."""
    drop_ssl_eof_notice()  # asyncio's harmless TLS-close notice is noise on a terminal
    ctx.obj = Ctx(settings)


elastic.add_command(migrate_command)
for _group in (static, elastic, stream, *OPS_COMMANDS, runs, maintain):
    add_command_connection_options(_group)
    main.add_command(_group)
main.add_command(dev)
main.add_command(demo)
main.add_command(spark_connect)
main.add_command(spark_archive)


if __name__ == "__main__":
    main()
