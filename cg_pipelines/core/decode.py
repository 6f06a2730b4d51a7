"""Strict JSON event decoding: every rejected payload gets a one-line reason.

Pure logic used by processing steps: a payload that is empty, over the size limit, not UTF-8,
not JSON, not an object, nested deeper than the limit, missing a required field or carrying a
field of the wrong type (an integer outside 64 bits, a string that is not valid Unicode such as
a lone surrogate ``"\\ud800"``) raises :class:`BadMessage` with the reason; so does a subject
without the tokens a processing step needs (:func:`subject_tokens`). The engine dead-letters
(or halts on) it — never drops it.

:meth:`JsonDecoder.decode_column` decodes a whole batch in one call: ``pyarrow.json`` parses the
payloads that can take the fast path, with the declared schema; any payload it cannot vouch
for, and every payload of a batch it fails on, is decoded one by one by :meth:`JsonDecoder.
decode` — the same accepted rows and values either way (``tests/unit/test_decode.py`` holds the
two to each other on a table of edge cases), and every rejected payload named with its reason.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from cg_pipelines.core.errors import CgError, DecodeError, UsageError

FieldType = Literal["string", "int", "float", "bool"]

_ARROW: dict[str, pa.DataType] = {
    "string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

MAX_DEPTH = 64
"""Most nesting of objects and arrays a payload may have (the payload object is depth 1).
Deeper payloads are dead letters: Python's parser recurses once per level (100,000 levels
overflow it) and no event schema needs more."""

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
"""Default payload size limit: 1 MiB, nats-server's default ``max_payload``."""


class BadMessage(CgError, ValueError):
    """A payload the decoder rejects; ``str(err)`` is the one-line reason."""


@dataclass(frozen=True, slots=True)
class JsonField:
    """An expected JSON field: ``required`` fields must be present; ``nullable`` ones may be
    ``null``. ``int`` accepts integers only (not booleans), within 64 bits; ``float`` accepts
    integers too; ``string`` values must be valid Unicode."""

    name: str
    type: FieldType
    required: bool = True
    nullable: bool = True


def _type_error(v: Any, f: JsonField) -> str | None:
    """Why ``v`` is not a valid value of ``f`` (None when it is)."""
    t = f.type
    if t == "string":
        if not isinstance(v, str):
            return f"must be string, got {type(v).__name__}"
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"is not valid Unicode (lone surrogate at character {e.start})"
        return None
    if t == "bool":
        return None if isinstance(v, bool) else f"must be bool, got {type(v).__name__}"
    if t == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be int, got {type(v).__name__}"
        if not INT64_MIN <= v <= INT64_MAX:
            digits = len(str(abs(v)))
            return f"must be a 64-bit int, got a {digits}-digit integer"
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        return f"must be float, got {type(v).__name__}"
    return None


def _reject_constant(name: str) -> Any:
    raise DecodeError(f"{name} is not valid JSON")


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, counting no further than ``limit + 1``."""
    depth, level = 0, [obj]
    while level and depth <= limit:
        depth += 1
        nxt: list[Any] = []
        for o in level:
            if isinstance(o, dict):
                nxt.extend(v for v in o.values() if isinstance(v, dict | list))
            elif isinstance(o, list):
                nxt.extend(v for v in o if isinstance(v, dict | list))
        level = nxt
    return depth


@dataclass(frozen=True, slots=True)
class DecodedColumn:
    """What :meth:`JsonDecoder.decode_column` made of a batch of payloads.

    ``rows``: positions (in the input) of the accepted payloads, ascending; ``table``: their
    decoded fields in that order (:attr:`JsonDecoder.arrow_schema`); ``dead``: ``(position,
    reason)`` of the rejected ones; ``fast``: how many were decoded on the bulk path.
    """

    rows: list[int]
    table: pa.Table
    dead: list[tuple[int, str]]
    fast: int


class JsonDecoder:
    """Decodes JSON object payloads to the declared fields.

    Unknown fields are ignored; absent optional fields become ``None``; ``float`` fields are
    returned as ``float``. Limits: ``max_payload_bytes`` (default 1 MiB) and
    :data:`MAX_DEPTH` levels of nesting; ``NaN`` and ``Infinity`` are not JSON.

    Raises:
        UsageError: duplicate field names, or a non-positive ``max_payload_bytes``.
    """

    def __init__(self, fields: Sequence[JsonField], *,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise UsageError(f"duplicate field names in {names}")
        if max_payload_bytes < 1:
            raise UsageError("max_payload_bytes must be >= 1")
        self.fields = tuple(fields)
        self.max_payload_bytes = max_payload_bytes
        self._parse_options = pajson.ParseOptions(
            explicit_schema=pa.schema([pa.field(f.name, _ARROW[f.type]) for f in fields]),
            unexpected_field_behavior="ignore", newlines_in_values=False)
        self._required = [f.name for f in self.fields if f.required]

    @property
    def arrow_schema(self) -> pa.Schema:
        """Arrow schema of decoded rows (field order as declared)."""
        return pa.schema([pa.field(f.name, _ARROW[f.type], nullable=f.nullable or not f.required)
                          for f in self.fields])

    def decode(self, data: bytes) -> dict[str, Any]:
        """Decode one payload. Raises :class:`BadMessage` naming the problem."""
        if not data:
            raise BadMessage("empty payload")
        if len(data) > self.max_payload_bytes:
            raise BadMessage(f"payload is {len(data)} bytes, over the "
                             f"{self.max_payload_bytes}-byte limit")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadMessage(f"payload is not valid UTF-8 (byte {e.start})") from None
        try:
            obj = json.loads(text, parse_constant=_reject_constant)
        except RecursionError:
            raise BadMessage(f"JSON nested deeper than {MAX_DEPTH} levels") from None
        except ValueError as e:
            raise BadMessage(f"malformed JSON: {e}") from None
        if not isinstance(obj, dict):
            raise BadMessage(f"payload must be a JSON object, got {type(obj).__name__}")
        if _depth(obj, MAX_DEPTH) > MAX_DEPTH:
            raise BadMessage(f"JSON nested deeper than {MAX_DEPTH} levels")
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
            elif (why := _type_error(v, f)) is not None:
                raise BadMessage(f"field {f.name!r} {why}")
            elif f.type == "float":
                v = float(v)
                if not math.isfinite(v):
                    raise BadMessage(f"field {f.name!r} must be a finite float")
            out[f.name] = v
        return out

    # -------------------------------------------------------------------------- bulk decoding

    def decode_column(self, data: pa.Array | pa.ChunkedArray) -> DecodedColumn:
        """Decode a batch of payloads (a binary Arrow array) in one call.

        The bulk path (``pyarrow.json`` with the declared schema) takes the payloads that are
        non-empty, within the size limit, one line, start with ``{``, hold no ``NaN``/
        ``Infinity`` token and at most :data:`MAX_DEPTH` brackets; the strict per-payload
        :meth:`decode` takes the others, those whose required fields came back null (missing
        and ``null`` look alike in Arrow), and all of them when the bulk parse fails or does
        not give one row per payload.
        """
        if isinstance(data, pa.ChunkedArray):
            data = data.combine_chunks()
        n = len(data)
        fast_mask = self._fast_candidates(data)
        fast_rows = [i for i, ok in enumerate(fast_mask.to_pylist()) if ok] if n else []
        table: pa.Table | None = None
        if fast_rows:
            table = self._bulk(data.take(pa.array(fast_rows, pa.int64())), len(fast_rows))
        if table is None:
            fast_rows, table = [], None
        strict_rows = sorted(set(range(n)) - set(fast_rows))
        if table is not None and self._required:
            nulls = pc.is_null(table[self._required[0]])
            for name in self._required[1:]:
                nulls = pc.or_(nulls, pc.is_null(table[name]))
            recheck = [i for i, bad in enumerate(nulls.to_pylist()) if bad]
            if recheck:  # missing and null look alike in Arrow: the strict decoder decides
                keep = sorted(set(range(len(fast_rows))) - set(recheck))
                strict_rows = sorted(strict_rows + [fast_rows[i] for i in recheck])
                table = table.take(pa.array(keep, pa.int64()))
                fast_rows = [fast_rows[i] for i in keep]
        strict_ok, strict_table, dead = self._strict(data, strict_rows)
        tables = [t for t in (table, strict_table) if t is not None and t.num_rows]
        rows = fast_rows + strict_ok
        if not tables:
            return DecodedColumn([], self.arrow_schema.empty_table(), dead, 0)
        merged = pa.concat_tables([t.cast(self.arrow_schema) for t in tables])
        order = sorted(range(len(rows)), key=rows.__getitem__)
        merged = merged.take(pa.array(order, pa.int64()))
        return DecodedColumn(sorted(rows), merged, sorted(dead), len(fast_rows))

    def _fast_candidates(self, data: pa.Array) -> pa.Array:
        if not len(data):
            return pa.array([], pa.bool_())
        size = pc.binary_length(data)
        ok = pc.and_(pc.greater(size, 0), pc.less_equal(size, self.max_payload_bytes))
        ok = pc.and_(ok, pc.match_substring_regex(data, r"^[ \t\r]*\{"))
        ok = pc.and_(ok, pc.invert(pc.match_substring(data, "\n")))
        ok = pc.and_(ok, pc.invert(pc.match_substring_regex(data, "NaN|Infinity")))
        brackets = pc.add(pc.count_substring(data, "{"), pc.count_substring(data, "["))
        ok = pc.and_(ok, pc.less_equal(brackets, MAX_DEPTH))
        return pc.fill_null(ok, False)

    def _bulk(self, data: pa.Array, n: int) -> pa.Table | None:
        """``pyarrow.json`` over the payloads joined by newlines; None when it fails or does
        not give exactly ``n`` rows (the strict path then decides every payload)."""
        buf = b"\n".join(data.to_pylist())
        try:
            table = pajson.read_json(
                io.BytesIO(buf), parse_options=self._parse_options,
                read_options=pajson.ReadOptions(use_threads=False,
                                                block_size=max(len(buf) + 1, 1 << 20)))
        except (pa.ArrowException, UnicodeDecodeError, ValueError):
            return None
        if table.num_rows != n:
            return None
        floats = [f.name for f in self.fields if f.type == "float"]
        for name in floats:  # NaN/Infinity never reach here; a huge number may overflow
            col = table[name]
            if pc.any(pc.is_inf(col)).as_py():
                return None
        return table.select([f.name for f in self.fields])

    def _strict(self, data: pa.Array, rows: list[int]
                ) -> tuple[list[int], pa.Table | None, list[tuple[int, str]]]:
        """Per-payload decoding of ``rows``, then conversion to Arrow; a row whose values Arrow
        cannot take is a dead letter too (never a failed batch)."""
        ok: list[int] = []
        values: list[dict[str, Any]] = []
        dead: list[tuple[int, str]] = []
        for i in rows:
            try:
                values.append(self.decode(data[i].as_py()))
                ok.append(i)
            except BadMessage as e:
                dead.append((i, str(e)))
        if not ok:
            return [], None, dead
        schema = self.arrow_schema
        try:
            table = pa.Table.from_pylist(values, schema=schema)
        except (pa.ArrowException, OverflowError, UnicodeError, ValueError, TypeError):
            keep_rows, keep_vals = [], []
            for i, row in zip(ok, values, strict=True):
                try:
                    pa.Table.from_pylist([row], schema=schema)
                except (pa.ArrowException, OverflowError, UnicodeError, ValueError,
                        TypeError) as e:
                    dead.append((i, f"cannot convert to Arrow: {type(e).__name__}: {e}"[:300]))
                    continue
                keep_rows.append(i)
                keep_vals.append(row)
            ok, table = keep_rows, pa.Table.from_pylist(keep_vals, schema=schema)
        return ok, table, dead


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
