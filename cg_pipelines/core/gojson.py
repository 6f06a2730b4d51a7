"""The JSON codec of the consumer-group configs: JSON written as Go's ``encoding/json`` writes
it, and the round trip that keeps what was read.

Go's ``json.Marshal`` writes compact JSON with ``<``, ``>``, ``&`` (and U+2028, U+2029)
escaped (``\\u003c``, ``\\u003e``, ``\\u0026``): :func:`go_json`.

Round trip. A config read from JSON remembers what it was read from (a :class:`RawJson`).
Writing it back (:func:`encode_fields`) keeps, for every field whose value did not change, the
exact JSON that was read (``null`` stays ``null``, ``[]`` stays ``[]``, an absent field stays
absent, members stay in their order), keeps unknown fields (a newer reference version's, or a
typo) in their place, and writes only the changed fields anew, in Go struct order; a config
written back unchanged gives the bytes that were read. This matters because the reference's
watcher compares configs with ``reflect.DeepEqual``, where a nil slice differs from an empty
one: rewriting ``"partitioning_wildcards":null`` as ``[]`` stops every running Go member.

The config types themselves (which fields, their Go order and ``omitempty`` tags, the rules)
are in :mod:`cg_pipelines.core.config`, which describes each struct as a list of
:data:`GoField`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

from cg_pipelines.core.errors import ConfigError, DecodeError

JsonObject = dict[str, Any]
"""A JSON object as ``json.loads`` returns it (key order kept); its values are whatever the
JSON held, checked by the code that reads each field."""

GoField = tuple[str, object, bool, object]
"""One Go struct field of a config as it is now: (JSON name, typed value, written when built
from scratch (``omitempty``), its JSON value when built from scratch)."""


def go_json(obj: object) -> bytes:
    """Compact JSON exactly as Go's ``json.Marshal`` writes it (HTML characters escaped)."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text.encode()


def is_int(v: object) -> TypeGuard[int]:
    """True for a JSON integer (``bool`` is an ``int`` in Python, not in JSON)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _no_constant(name: str) -> Any:
    # Python's json reads NaN/Infinity; Go's encoding/json (the reference) rejects them.
    raise DecodeError(f"{name} is not JSON")


def load_object(data: bytes | str) -> tuple[JsonObject, bytes]:
    """The JSON object in ``data`` and the bytes it was read from. Raises ``ConfigError``
    (field ``config``) if ``data`` is not JSON as Go reads it, or not an object."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError("config", f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError("config", "must be a JSON object")
    return obj, raw


# ------------------------------------------------------------------------ what was read (raw)


@dataclass(frozen=True, slots=True, eq=False)
class RawJson:
    """A JSON object as read, kept by the config parsed from it so writing it back keeps what
    did not change.

    ``obj``: the object (key order kept). ``parsed``: each code field's typed value as read.
    ``present``: the code fields whose value was read under the code's name (their JSON is
    written back as it was while the value is unchanged). ``adr``: ADR keys that were read,
    with the code field they fed. ``data``: the bytes read (top level only).
    """

    obj: JsonObject
    parsed: Mapping[str, object]
    present: frozenset[str]
    adr: dict[str, str]
    data: bytes | None = None

    def unknown(self) -> JsonObject:
        """Keys that are neither the code's fields nor ADR names that were used."""
        return {k: v for k, v in self.obj.items()
                if k not in self.parsed and k not in self.adr}


class HasUnknownFields(Protocol):
    """A part of a config (a mapping, a partitioning filter) that lists the unknown fields of
    the JSON it was read from."""

    @property
    def unknown_fields(self) -> JsonObject: ...


class GoObject:
    """Base of a config part read from and written back to reference JSON (a mapping, a
    partitioning filter): the subclass lists its Go fields in ``_go()`` and keeps what was
    read in ``_raw``; this gives the JSON object to write and the unknown fields read."""

    __slots__ = ()
    _raw: RawJson | None

    def _go(self) -> list[GoField]:
        raise NotImplementedError

    def to_dict(self) -> JsonObject:
        """The JSON object (what was read kept for unchanged fields, see :func:`merge_fields`)."""
        return merge_fields(self._go(), self._raw)

    @property
    def unknown_fields(self) -> JsonObject:
        """Fields of the JSON read that the reference v0.2.1 does not have."""
        return self._raw.unknown() if self._raw else {}


def _unchanged(go: Sequence[GoField], raw: RawJson) -> bool:
    return all(name in raw.parsed and raw.parsed[name] == value for name, value, _, _ in go)


def merge_fields(go: Sequence[GoField], raw: RawJson | None) -> JsonObject:
    """The JSON object to write: the Go fields (``go``, in struct order) merged into what was
    read (``raw``).

    A field whose value is unchanged keeps its JSON as read (or stays absent if it was absent);
    a changed field, or one read through an ADR name, is written as Go would. Unknown keys keep
    their place; a field not in ``raw`` goes right after the nearest preceding Go field.
    """
    if raw is None:
        return {name: js for name, _, emit, js in go if emit}
    chosen: dict[str, tuple[bool, object]] = {}
    for name, value, emit, js in go:
        if name in raw.parsed and raw.parsed[name] == value:
            if name in raw.present:
                chosen[name] = (True, raw.obj[name])
            elif name in raw.adr.values():
                chosen[name] = (emit, js)
            else:
                chosen[name] = (False, None)  # absent as read
        else:
            chosen[name] = (emit, js)
    order: list[tuple[bool, str]] = []  # (is a Go field, key)
    placed: set[str] = set()
    for key in raw.obj:
        fed = key if key in chosen else raw.adr.get(key)
        if fed is None:
            order.append((False, key))
        elif fed not in placed:
            order.append((True, fed))
            placed.add(fed)
    names = [name for name, _, _, _ in go]
    for i, name in enumerate(names):
        if name in placed:
            continue
        pos = 0
        for prev in reversed(names[:i]):
            if prev in placed:
                pos = order.index((True, prev)) + 1
                break
        order.insert(pos, (True, name))
        placed.add(name)
    out: JsonObject = {}
    for is_field, key in order:
        if not is_field:
            out[key] = raw.obj[key]
        elif chosen[key][0]:
            out[key] = chosen[key][1]
    return out


def encode_fields(go: Sequence[GoField], raw: RawJson | None) -> bytes:
    """The JSON bytes of a config: the bytes read when nothing changed (and no ADR name was
    read), else :func:`go_json` of :func:`merge_fields`."""
    if raw is not None and raw.data is not None and not raw.adr and _unchanged(go, raw):
        return raw.data
    return go_json(merge_fields(go, raw))


def nested_unknown(prefix: str, items: Sequence[HasUnknownFields]) -> JsonObject:
    """The unknown fields of each of ``items`` (a config's list field ``prefix``), named like
    ``"member_mappings[0].weight"``."""
    out: JsonObject = {}
    for i, item in enumerate(items):
        for k, v in item.unknown_fields.items():
            out[f"{prefix}[{i}].{k}"] = v
    return out
