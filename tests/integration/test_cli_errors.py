"""The errors an operator meets with ``cg`` (issue 29, point 7), each asserted word for word:
a mistyped group names stream and group and what to check; a new group's ``dlq ls`` says
there are none; a partition out of range names the valid range; with ``--json`` errors are
JSON on stdout; ``cg --version``. (``halt skip`` keeping the original error, and aligned
tables: tests/integration/test_cli_ops.py.)

In process through click's runner (a real server; the runner is not an event loop, so the
tests are plain functions and set the group up with their own connection)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import nats
import pytest
from click.testing import CliRunner, Result
from nats.js.api import StreamConfig

from cg_pipelines.cli import main
from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.jetstream import admin
from cg_pipelines.version import __version__


async def _group(url: str, stream: str) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
        await admin.create_elastic(js, stream, "g", ElasticConfig(
            4, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    finally:
        await nc.close()


@pytest.fixture
def group(nats_url: str, unique_name: str) -> str:
    """A new elastic group ``g`` of 4 partitions on stream ``unique_name`` (nothing
    published, nothing dead-lettered)."""
    asyncio.run(_group(nats_url, unique_name))
    return unique_name


def cg(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--server", url, *args])


def not_found(stream: str, group: str) -> str:
    return (f"cg: error: elastic consumer group '{group}' on stream '{stream}': not found: "
            f"check the stream and group names (`cg elastic ls {stream}` lists the stream's "
            "groups)\n")


@pytest.mark.parametrize("args", [
    ("dlq", "ls"), ("dlq", "show", "1"), ("dlq", "purge", "--force"),
    ("halt", "show", "0"), ("halt", "skip", "0", "--reason", "r"), ("backlog",),
], ids=lambda a: "-".join(a[:2]))
def test_mistyped_group_is_named(nats_url: str, group: str, args: tuple[str, ...]) -> None:
    r = cg(nats_url, args[0], *args[1:2] if args[0] in ("dlq", "halt") else (), group,
           "gg", *args[2:] if args[0] in ("dlq", "halt") else args[1:])
    assert r.exit_code == 2, r.output
    assert r.stderr == not_found(group, "gg")
    assert r.stdout == ""


def test_new_group_has_no_dead_letters(nats_url: str, group: str) -> None:
    r = cg(nats_url, "dlq", "ls", group, "g")
    assert (r.exit_code, r.stdout, r.stderr) == (0, f"no dead letters in {group}-g-dlq\n", "")
    r = cg(nats_url, "--json", "dlq", "ls", group, "g")
    assert (r.exit_code, json.loads(r.stdout)) == (0, [])
    r = cg(nats_url, "dlq", "show", group, "g", "1")
    assert r.exit_code == 2
    assert r.stderr == (f"cg: error: no dead letters: {group}-g-dlq does not exist (group g "
                        f"on stream {group} never dead-lettered a message)\n")


@pytest.mark.parametrize("cmd", [
    ["halt", "show", "{s}", "g", "9"], ["halt", "skip", "{s}", "g", "9", "--reason", "r"],
    ["dlq", "ls", "{s}", "g", "-p", "9"], ["dlq", "purge", "{s}", "g", "-p", "9", "--force"],
    ["backlog", "{s}", "g", "-p", "9"],
], ids=lambda c: "-".join(c[:2]))
def test_partition_out_of_range_names_the_range(nats_url: str, group: str,
                                                cmd: list[str]) -> None:
    r = cg(nats_url, *(a.format(s=group) for a in cmd))
    assert r.exit_code == 2, r.output
    assert r.stderr == f"cg: error: partition 9 out of range: {group}.g has partitions 0..3\n"


def test_json_errors_are_json_on_stdout(nats_url: str, group: str) -> None:
    r = cg(nats_url, "--json", "halt", "show", group, "g", "9")
    assert r.exit_code == 2 and r.stderr == ""
    assert json.loads(r.stdout) == {
        "error": f"partition 9 out of range: {group}.g has partitions 0..3", "exit_code": 2}
    r = cg(nats_url, "dlq", "ls", group, "gg", "--json")  # --json after the command too
    assert r.exit_code == 2 and r.stderr == ""
    assert json.loads(r.stdout)["error"] == not_found(group, "gg")[len("cg: error: "):-1]
    # no server: exit 1, still JSON
    r = cg("nats://127.0.0.1:1", "--json", "--timeout", "0.5", "dlq", "ls", group, "g")
    assert r.exit_code == 1 and r.stderr == ""
    err = json.loads(r.stdout)
    assert err["exit_code"] == 1 and "nats://127.0.0.1:1" in err["error"], err


def test_json_usage_error_and_version() -> None:
    """The installed entry point (a real process): usage errors as JSON, ``--version``."""
    cg_ = [sys.executable, "-m", "cg_pipelines.cli"]
    r = subprocess.run([*cg_, "--json", "halt", "show", "S"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr == ""
    assert json.loads(r.stdout) == {"error": "Missing argument 'GROUP'.", "exit_code": 2}
    r = subprocess.run([*cg_, "--version"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, f"cg (cg-pipelines) {__version__}\n")
