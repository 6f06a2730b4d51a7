"""Errors raised by the pure core (no I/O)."""

from __future__ import annotations


class CgError(Exception):
    """The base of every exception this library raises on purpose: ``except CgError`` catches
    them all (each also keeps its standard base, e.g. ``ValueError`` for bad input)."""


class ConfigError(CgError, ValueError):
    """An invalid consumer-group configuration.

    Attributes:
        field: the configuration field at fault (e.g. ``"member_mappings"``), using the
            reference JSON field names.
        rule: the rule broken, in words.

    ``str(err)`` is ``"<field>: <rule>"``, a one-line message fit for a CLI error.
    """

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class GroupNotFoundError(CgError, LookupError):
    """No config for ``<stream>.<group>`` in the kind's KV bucket (or no bucket at all)."""

    def __init__(self, kind: str, stream: str, group: str, why: str = "not found") -> None:
        super().__init__(f"{kind} consumer group {group!r} on stream {stream!r}: {why}")
        self.kind, self.stream, self.group = kind, stream, group


class GroupExistsError(CgError, ValueError):
    """A create found an existing group whose config differs from the requested one."""


class MembershipError(CgError, ValueError):
    """A membership change that the group's config does not allow (e.g. adding members to a
    group that uses member mappings)."""


class ConcurrentUpdateError(CgError, RuntimeError):
    """A compare-and-set config update kept losing to concurrent writers and gave up."""
