"""Subjects: validation, the work-queue partition transform, and the server's partition hash.

Sources:
- The transform destination is built as the reference implementation does
  (synadia-io/orbit.go ``pcgroups``, ``getPartitioningTransformDest``): the k-th ``*`` of the
  filter becomes ``{{Wildcard(k)}}`` and ``{{Partition(N,i,j)}}.`` (or ``{{Partition(N)}}.``)
  is prefixed, so the partition number is always the first token.
- The partition number is what nats-server's subject transform computes: FNV-1a 32-bit over the
  selected tokens concatenated without separator (the whole subject, dots included, when no
  wildcard is selected), modulo N.
"""

from __future__ import annotations

from collections.abc import Sequence

from cg_pipelines.core.errors import DecodeError, UsageError

_FNV32_OFFSET = 0x811C9DC5
_FNV32_PRIME = 0x01000193


def fnv1a_32(data: bytes) -> int:
    """FNV-1a 32-bit hash of ``data`` (an int in [0, 2**32))."""
    h = _FNV32_OFFSET
    for byte in data:
        h ^= byte
        h = (h * _FNV32_PRIME) & 0xFFFFFFFF
    return h


def partition_for(tokens: Sequence[str], n: int) -> int:
    """Partition number in [0, n) for the selected subject tokens, as nats-server computes it.

    ``tokens`` are joined without separator and hashed with FNV-1a 32-bit (UTF-8 bytes).
    Raises ``UsageError`` if ``n < 1``.
    """
    if n < 1:
        raise UsageError(f"number of partitions must be >= 1, got {n}")
    return fnv1a_32("".join(tokens).encode()) % n


def wildcard_positions(filter_subject: str) -> list[int]:
    """Token positions (0-based) of the ``*`` wildcards of a filter, in order."""
    return [i for i, tok in enumerate(filter_subject.split(".")) if tok == "*"]


def partition_of_subject(
    subject: str, filter_subject: str, partitioning_wildcards: Sequence[int], n: int
) -> int:
    """Partition number the work-queue transform gives ``subject`` (which must match the filter).

    ``partitioning_wildcards`` are 1-based indexes into the filter's ``*`` wildcards; empty means
    the whole subject is hashed. Raises ``UsageError`` if the subject has too few tokens.
    """
    if not partitioning_wildcards:
        return partition_for([subject], n)
    positions = wildcard_positions(filter_subject)
    tokens = subject.split(".")
    selected = []
    for k in partitioning_wildcards:
        pos = positions[k - 1]
        if pos >= len(tokens):
            raise UsageError(
                f"subject {subject!r} has too few tokens for filter {filter_subject!r}"
            )
        selected.append(tokens[pos])
    return partition_for(selected, n)


def transform_destination(
    filter_subject: str, partitioning_wildcards: Sequence[int], max_members: int
) -> str:
    """Work-queue subject-transform destination for one partitioning filter.

    ``transform_destination("foo.*", [1], 4) == "{{Partition(4,1)}}.foo.{{Wildcard(1)}}"``.
    """
    tokens = filter_subject.split(".")
    k = 0
    for i, tok in enumerate(tokens):
        if tok == "*":
            k += 1
            tokens[i] = f"{{{{Wildcard({k})}}}}"
    dest = ".".join(tokens)
    if not partitioning_wildcards:
        return f"{{{{Partition({max_members})}}}}.{dest}"
    idx = ",".join(str(w) for w in partitioning_wildcards)
    return f"{{{{Partition({max_members},{idx})}}}}.{dest}"


def strip_partition(subject: str) -> tuple[int, str]:
    """Split a work-queue subject ``"<p>.<rest>"`` into ``(p, rest)``.

    Raises ``DecodeError`` if the first token is not a partition number or nothing follows it.
    """
    head, sep, rest = subject.partition(".")
    if not sep or not rest or not head.isdigit():
        raise DecodeError(f"subject {subject!r} does not start with a partition-number token")
    return int(head), rest


def subject_error(subject: str, *, allow_wildcards: bool = True) -> str | None:
    """Why ``subject`` is not a valid NATS subject (or filter), or ``None`` if it is valid.

    Rules: non-empty tokens separated by ``.``; no whitespace; ``>`` only as the last token;
    ``*`` and ``>`` only as whole tokens and only if ``allow_wildcards``.
    """
    if not subject:
        return "must not be empty"
    if any(c.isspace() for c in subject):
        return "must not contain whitespace"
    tokens = subject.split(".")
    for i, tok in enumerate(tokens):
        if not tok:
            return "must not contain empty tokens"
        if tok in ("*", ">"):
            if not allow_wildcards:
                return "must not contain wildcards"
            if tok == ">" and i != len(tokens) - 1:
                return "'>' must be the last token"
        elif "*" in tok or ">" in tok:
            return "wildcards must be whole tokens"
    return None


def name_error(name: str) -> str | None:
    """Why ``name`` is not usable as a stream, group, member or consumer name, or ``None``.

    JetStream names must be non-empty and must not contain ``.``, ``*``, ``>``, path separators
    or whitespace.
    """
    if not name:
        return "must not be empty"
    bad = [c for c in name if c in ".*>/\\" or c.isspace() or ord(c) < 32]
    if bad:
        return f"must not contain {bad[0]!r}"
    return None
