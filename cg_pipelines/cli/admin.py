"""``cg static ...`` / ``cg elastic ...`` group administration and ``cg stream ...`` (the
origin stream a group needs). Mirrors the reference's ``cg`` tool (orbit.go ``pcgroups/cg``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from cg_pipelines.cli.context import Ctx, fail
from cg_pipelines.cli.members import add_member_commands
from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.config import (
    ElasticConfig,
    MemberMapping,
    PartitioningFilter,
    StaticConfig,
    parse_mapping,
)
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.jetstream import admin

__all__ = ["elastic", "static", "stream"]


def _show_config(c: Ctx, kind: str, stream: str, group: str, v: Any) -> None:
    """Print a group's config (``v``: a ``Versioned`` config) as text or JSON, and one warning
    line on stderr for fields the reference does not know (kept as they are on rewrite)."""
    unknown = v.config.unknown_fields
    if unknown:
        click.echo(f"cg: warning: {kind} consumer group {group} on stream {stream} (revision "
                   f"{v.revision}) has fields unknown to pcgroups v0.2.1, kept as they are on "
                   f"rewrite: {', '.join(unknown)}", err=True)
    d = _config_dict(v.config, v.revision)
    if unknown:
        d["unknown_fields"] = list(unknown)
    c.out(d, _config_text(kind, stream, group, v.config, v.revision))


def _config_dict(cfg: StaticConfig | ElasticConfig, rev: int) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(cfg.to_json())
    d["revision"] = rev
    d["assignment"] = {m: ps for m, ps in assignment(cfg).items()}
    return d


def _config_text(kind: str, stream: str, group: str, cfg: Any, rev: int) -> str:
    lines = [f"{kind} consumer group {group} on stream {stream} (revision {rev})",
             f"  max members: {cfg.max_members}"]
    if kind == "static":
        lines.append(f"  filters: {', '.join(cfg.filters) or '(none)'}")
    else:
        pfs = [f"{p.filter} [{','.join(map(str, p.partitioning_wildcards))}]"
               for p in cfg.partitioning_filters]
        lines.append(f"  partitioning filters: {'; '.join(pfs) or '> (whole subject)'}")
        lines.append(f"  max buffered: {cfg.max_buffered_msgs or 'unlimited'} msgs, "
                     f"{cfg.max_buffered_bytes or 'unlimited'} bytes")
    lines.append(f"  {'mappings' if cfg.member_mappings else 'members'}:")
    for m, ps in assignment(cfg).items():
        lines.append(f"    {m}: {','.join(map(str, ps))}")
    return "\n".join(lines)


def _members_option(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--members", "-m", multiple=True,
                     help="Member name(s); repeat or comma separate.")(f)
    return click.option("--mapping", multiple=True,
                        help="Member mapping 'member:0,1,2' (ranges 'member:0-3'); repeat.")(f)


def _split(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _mappings(values: tuple[str, ...]) -> tuple[MemberMapping, ...]:
    try:
        return tuple(parse_mapping(v) for v in values)
    except ConfigError as e:
        fail(str(e), 2)
        raise


def _common_commands(kind: str, grp: click.Group) -> None:
    get = admin.get_static if kind == "static" else admin.get_elastic
    lst = admin.list_static if kind == "static" else admin.list_elastic
    step = admin.static_step_down if kind == "static" else admin.elastic_step_down

    @grp.command("ls")
    @click.argument("stream")
    @click.pass_obj
    def ls_(c: Ctx, stream: str) -> None:
        """List the groups on STREAM."""
        names = c.run(lambda js: lst(js, stream, timeout=c.timeout))
        c.out(names, "\n".join(names) if names else f"no {kind} consumer groups on {stream}")

    @grp.command("info")
    @click.argument("stream")
    @click.argument("group")
    @click.pass_obj
    def info_(c: Ctx, stream: str, group: str) -> None:
        """Show GROUP's config and partition assignment."""
        v = c.run(lambda js: get(js, stream, group, timeout=c.timeout))
        _show_config(c, kind, stream, group, v)

    @grp.command("member-info")
    @click.argument("stream")
    @click.argument("group")
    @click.argument("members", nargs=-1)
    @click.pass_obj
    def member_info_(c: Ctx, stream: str, group: str, members: tuple[str, ...]) -> None:
        """Membership and activity per member (all members when none are named)."""
        st = c.run(lambda js: admin.member_status(
            js, kind, stream, group, members=list(members) or None, timeout=c.timeout))
        rows = [{"member": s.member, "in_membership": s.in_membership,
                 "consumer": s.consumer_exists, "active": s.active, "pinned_id": s.pinned_id,
                 "partitions": list(s.partitions)} for s in st]
        text = "\n".join(
            f"{s.member}: {'member' if s.in_membership else 'NOT a member'}, "
            f"{'active' if s.active else 'inactive'}"
            f"{' (pinned ' + s.pinned_id + ')' if s.pinned_id else ''}, "
            f"partitions {','.join(map(str, s.partitions)) or '-'}" for s in st)
        c.out(rows, text or "no members")

    @grp.command("step-down")
    @click.argument("stream")
    @click.argument("group")
    @click.argument("member")
    @click.pass_obj
    def step_down_(c: Ctx, stream: str, group: str, member: str) -> None:
        """Make MEMBER's active (pinned) instance step down."""
        c.run(lambda js: step(js, stream, group, member, timeout=c.timeout))
        c.out({"stepped_down": member}, f"{member}: pinned instance unpinned")

    add_member_commands(kind, grp)


# --------------------------------------------------------------------------------------- static


@click.group()
def static() -> None:
    """Static consumer groups (partition number already the first subject token)."""


_common_commands("static", static)


@static.command("create")
@click.argument("stream")
@click.argument("group")
@click.option("--max-members", type=int, required=True, help="Number of partitions.")
@click.option("--filter", "filters", multiple=True, help="Subject filter after the partition "
              "token; repeat.")
@_members_option
@click.pass_obj
def static_create(c: Ctx, stream: str, group: str, max_members: int, filters: tuple[str, ...],
                  members: tuple[str, ...], mapping: tuple[str, ...]) -> None:
    """Create a static group on STREAM."""
    cfg = StaticConfig(max_members, tuple(filters), tuple(sorted(set(_split(members)))),
                       _mappings(mapping))
    v = c.run(lambda js: admin.create_static(js, stream, group, cfg, timeout=c.timeout))
    _show_config(c, "static", stream, group, v)


@static.command("delete")
@click.argument("stream")
@click.argument("group")
@click.pass_obj
def static_delete(c: Ctx, stream: str, group: str) -> None:
    """Delete a static group and exactly its members' consumers."""
    deleted = c.run(lambda js: admin.delete_static(js, stream, group, timeout=c.timeout))
    c.out({"deleted": group, "consumers": deleted},
          f"deleted static group {group} (consumers: {', '.join(deleted) or 'none'})")


# -------------------------------------------------------------------------------------- elastic


@click.group()
def elastic() -> None:
    """Elastic consumer groups (partitioned by a work-queue stream's subject transform)."""


_common_commands("elastic", elastic)


def _partitioning_filter(text: str) -> PartitioningFilter:
    flt, sep, idx = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        wcs = tuple(int(i) for i in idx.split(",") if i.strip()) if sep else ()
    except ValueError:
        fail(f"partitioning_filters: {text!r} must look like 'subject.*.*:2' or 'subject.>'", 2)
        raise
    return PartitioningFilter(flt, wcs)


@elastic.command("create")
@click.argument("stream")
@click.argument("group")
@click.option("--max-members", type=int, required=True, help="Number of partitions.")
@click.option("--filter", "filters", multiple=True,
              help="Partitioning filter 'FILTER[:i,j]': i,j are the 1-based '*' wildcards "
                   "hashed into the key, e.g. 'flights.*.*:2'. Repeat. None: whole subject.")
@click.option("--max-buffered-msgs", type=int, default=0, help="Work-queue limit (0 = none).")
@click.option("--max-buffered-bytes", type=int, default=0, help="Work-queue limit (0 = none).")
@_members_option
@click.pass_obj
def elastic_create(c: Ctx, stream: str, group: str, max_members: int, filters: tuple[str, ...],
                   max_buffered_msgs: int, max_buffered_bytes: int, members: tuple[str, ...],
                   mapping: tuple[str, ...]) -> None:
    """Create an elastic group on STREAM (and its work-queue stream STREAM-GROUP)."""
    cfg = ElasticConfig(max_members, tuple(_partitioning_filter(f) for f in filters),
                        max_buffered_msgs, max_buffered_bytes,
                        tuple(sorted(set(_split(members)))), _mappings(mapping))
    v = c.run(lambda js: admin.create_elastic(js, stream, group, cfg, timeout=c.timeout))
    _show_config(c, "elastic", stream, group, v)


@elastic.command("delete")
@click.argument("stream")
@click.argument("group")
@click.pass_obj
def elastic_delete(c: Ctx, stream: str, group: str) -> None:
    """Delete an elastic group and its work-queue stream."""
    found = c.run(lambda js: admin.delete_elastic(js, stream, group, timeout=c.timeout))
    if not found:
        fail(f"elastic consumer group {group!r} on stream {stream!r}: not found", 2)
    c.out({"deleted": group}, f"deleted elastic group {group}")


def _membership_command(name: str, fn: Callable[..., Any], verb: str) -> None:
    @elastic.command(name)
    @click.argument("stream")
    @click.argument("group")
    @click.argument("members", nargs=-1, required=True)
    @click.option("--sticky", is_flag=True, help="Keep partitions with surviving owners "
                  "(written as member mappings).")
    @click.pass_obj
    def cmd(c: Ctx, stream: str, group: str, members: tuple[str, ...], sticky: bool) -> None:
        v = c.run(lambda js: fn(js, stream, group, _split(members), sticky=sticky,
                                timeout=c.timeout))
        _show_config(c, "elastic", stream, group, v)

    cmd.__doc__ = f"{verb} MEMBERS (compare-and-set)."


_membership_command("add", admin.add_members, "Add")
_membership_command("drop", admin.drop_members, "Drop")


@elastic.command("create-mapping")
@click.argument("stream")
@click.argument("group")
@click.argument("mappings", nargs=-1, required=True)
@click.pass_obj
def elastic_create_mapping(c: Ctx, stream: str, group: str, mappings: tuple[str, ...]) -> None:
    """Set member mappings, e.g. 'm1:0-3' 'm2:4,5,6,7' (replaces the membership)."""
    mm = _mappings(mappings)
    v = c.run(lambda js: admin.set_member_mappings(js, stream, group, mm, timeout=c.timeout))
    _show_config(c, "elastic", stream, group, v)


@elastic.command("delete-mapping")
@click.argument("stream")
@click.argument("group")
@click.pass_obj
def elastic_delete_mapping(c: Ctx, stream: str, group: str) -> None:
    """Remove the member mappings."""
    v = c.run(lambda js: admin.delete_member_mappings(js, stream, group, timeout=c.timeout))
    _show_config(c, "elastic", stream, group, v)


def _set_group(text: str) -> tuple[str, str]:
    stream, sep, group = text.partition("/")
    if not (sep and stream and group):
        fail(f"groups: {text!r} must look like 'STREAM/GROUP'", 2)
    return stream, group


def _set_text(r: admin.SetMembership, names: list[str]) -> str:
    lines = [f"co-partitioned set {', '.join(names)}: the member mappings of every group"]
    lines += [f"  {m}: {','.join(map(str, ps))}" for m, ps in r.assignment.items()]
    moved = [f"{p} {old or '-'} -> {new or '-'}" for p, (old, new) in r.moved.items()]
    lines.append(f"moved: {'; '.join(moved) or 'none'}")
    return "\n".join(lines)


@elastic.command("set-members")
@click.argument("groups", nargs=-1, required=True)
@click.option("--members", "-m", multiple=True, required=True,
              help="Member name(s); repeat or comma separate.")
@click.pass_obj
def elastic_set_members(c: Ctx, groups: tuple[str, ...], members: tuple[str, ...]) -> None:
    """Give a co-partitioned set GROUPS (two or more STREAM/GROUP) the same --members: partition
    p of every group goes to one member, as few partitions as possible move (sticky), written
    as each group's member mappings. Refused, nothing written, unless the groups have the same
    max members and every partitioning filter selects the same number of key wildcards."""
    pairs = [_set_group(g) for g in groups]
    r = c.run(lambda js: admin.set_set_mappings(js, pairs, _split(members), timeout=c.timeout))
    names = [f"{s}/{g}" for s, g in pairs]
    c.out({"groups": names, "assignment": r.assignment, "previous": r.previous,
           "moved": {str(p): {"from": old, "to": new} for p, (old, new) in r.moved.items()},
           "revisions": {f"{s}/{g}": v.revision for (s, g), v in r.configs.items()}},
          _set_text(r, names))


# --------------------------------------------------------------------------------------- stream


@click.group()
def stream() -> None:
    """The origin stream a group consumes (create it here, or with any NATS tool)."""


def _stream_summary(info: Any) -> dict[str, Any]:
    cfg, st = info.config, info.state
    return {"name": cfg.name, "subjects": list(cfg.subjects or []),
            "retention": str(getattr(cfg.retention, "value", cfg.retention)),
            "storage": str(getattr(cfg.storage, "value", cfg.storage)),
            "replicas": cfg.num_replicas, "max_age_s": cfg.max_age or 0,
            "max_msgs": cfg.max_msgs, "max_bytes": cfg.max_bytes,
            "messages": st.messages, "bytes": st.bytes, "first_seq": st.first_seq,
            "last_seq": st.last_seq}


def _stream_text(d: dict[str, Any]) -> str:
    return (f"stream {d['name']}: subjects {', '.join(d['subjects'])}; {d['retention']} "
            f"retention, {d['storage']} storage, {d['replicas']} replica(s); "
            f"{d['messages']} messages (sequences {d['first_seq']}..{d['last_seq']})")


@stream.command("create")
@click.argument("name")
@click.option("--subject", "subjects", multiple=True, required=True,
              help="Subject (wildcards allowed) the stream stores; repeat.")
@click.option("--storage", type=click.Choice(["file", "memory"]), default="file",
              show_default=True)
@click.option("--replicas", type=click.IntRange(1, 5), default=1, show_default=True)
@click.option("--max-age", type=click.FloatRange(min=0), default=0.0,
              help="Seconds a message is kept (0 = unlimited). A group's backfill rebuilds "
                   "from this history.")
@click.option("--max-msgs", type=int, default=-1, help="Most messages kept (-1 = unlimited).")
@click.option("--max-bytes", type=int, default=-1, help="Most bytes kept (-1 = unlimited).")
@click.pass_obj
def stream_create(c: Ctx, name: str, subjects: tuple[str, ...], storage: str, replicas: int,
                  max_age: float, max_msgs: int, max_bytes: int) -> None:
    """Create stream NAME (limits retention, so the history stays for rebuilds). Idempotent
    with the same settings; exit 2 when it exists with others."""
    from nats.js.api import StorageType, StreamConfig
    from nats.js.errors import BadRequestError

    cfg = StreamConfig(name=name, subjects=list(subjects), num_replicas=replicas,
                       storage=StorageType(storage), max_age=max_age or None,
                       max_msgs=max_msgs, max_bytes=max_bytes, allow_direct=True)

    async def create(js: Any) -> Any:
        try:
            return await js.add_stream(cfg)
        except BadRequestError as e:
            fail(f"stream {name!r}: {e.description or e}", 2)

    info = c.run(create)
    d = _stream_summary(info)
    c.out(d, "created " + _stream_text(d))


@stream.command("info")
@click.argument("name")
@click.pass_obj
def stream_info(c: Ctx, name: str) -> None:
    """Show stream NAME: subjects, limits, messages."""
    from nats.js.errors import NotFoundError

    async def info(js: Any) -> Any:
        try:
            return await js.stream_info(name)
        except NotFoundError:
            fail(f"stream {name!r}: not found", 2)

    d = _stream_summary(c.run(info))
    c.out(d, _stream_text(d))
