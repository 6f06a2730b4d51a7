"""Strict JSON event decoding: every rejected payload gets a one-line reason.

Pure logic used by processing steps: a payload that is empty, not UTF-8, not JSON, not an
object, missing a required field or carrying a field of the wrong type raises
:class:`BadMessage` with the reason; so does a subject without the tokens a processing step
needs (:func:`subject_tokens`). The engine dead-letters (or halts on) it — never drops it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa

FieldType = Literal["string", "int", "float", "bool"]

_ARROW: dict[str, pa.DataType] = {
    "string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
}


class BadMessage(ValueError):
    """A payload the decoder rejects; ``str(err)`` is the one-line reason."""


@dataclass(frozen=True, slots=True)
class Field:
    """An expected JSON field: ``required`` fields must be present; ``nullable`` ones may be
    ``null``. ``int`` accepts integers only (not booleans); ``float`` accepts integers too."""

    name: str
    type: FieldType
    required: bool = True
    nullable: bool = True


def _type_ok(value: Any, ftype: FieldType) -> bool:
    if ftype == "string":
        return isinstance(value, str)
    if ftype == "bool":
        return isinstance(value, bool)
    if ftype == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, int | float) and not isinstance(value, bool)


class JsonDecoder:
    """Decodes JSON object payloads to dicts holding exactly the declared fields.

    Unknown fields are ignored; absent optional fields become ``None``; ``float`` fields are
    returned as ``float``.
    """

    def __init__(self, fields: Sequence[Field]) -> None:
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in {names}")
        self.fields = tuple(fields)

    @property
    def arrow_schema(self) -> pa.Schema:
        """Arrow schema of decoded rows (field order as declared)."""
        return pa.schema([pa.field(f.name, _ARROW[f.type], nullable=f.nullable or not f.required)
                          for f in self.fields])

    def decode(self, data: bytes) -> dict[str, Any]:
        """Decode one payload. Raises :class:`BadMessage` naming the problem."""
        if not data:
            raise BadMessage("empty payload")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadMessage(f"payload is not valid UTF-8 (byte {e.start})") from None
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise BadMessage(f"malformed JSON: {e}") from None
        if not isinstance(obj, dict):
            raise BadMessage(f"payload must be a JSON object, got {type(obj).__name__}")
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.name not in obj:
                if f.required:
                    raise BadMessage(f"missing field {f.name!r}")
                out[f.name] = None
                continue
            v = obj[f.name]
            if v is None:
                if not f.nullable:
                    raise BadMessage(f"field {f.name!r} must not be null")
            elif not _type_ok(v, f.type):
                raise BadMessage(f"field {f.name!r} must be {f.type}, got {type(v).__name__}")
            elif f.type == "float":
                v = float(v)
            out[f.name] = v
        return out


def subject_tokens(subject: str, pattern: str) -> list[str]:
    """The tokens of ``subject``, which must have exactly as many as ``pattern``.

    ``pattern`` names the tokens for the reason, e.g. ``"flights.<carrier>.<tailnum>"`` (3).

    Returns:
        ``subject.split(".")``.

    Raises:
        BadMessage: e.g. ``subject 'flights.AA' has too few tokens (2, expected 3:
            flights.<carrier>.<tailnum>)``.
    """
    tokens = subject.split(".")
    want = pattern.count(".") + 1
    if len(tokens) != want:
        much = "few" if len(tokens) < want else "many"
        raise BadMessage(f"subject {subject!r} has too {much} tokens ({len(tokens)}, expected "
                         f"{want}: {pattern})")
    return tokens
