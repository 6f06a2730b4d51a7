"""Errors raised by the pure core (no I/O)."""

from __future__ import annotations


class ConfigError(ValueError):
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
