"""PartitionRunError (issue 29, point 3): the cause first, the partition facts after, found
on the original exception or anything raised from it."""

from __future__ import annotations

import pytest

from cg_pipelines.core.errors import (
    CAUSE_CHARS,
    CgError,
    PartitionRunError,
    cause_text,
    exception_chain,
    one_line,
)


def _err(cause: BaseException, **kw: object) -> PartitionRunError:
    args: dict = dict(stream="orders", group="bycust", read_stream="orders-bycust",
                      partition=3, inflight=(6201, 6320), committed_through=6200,
                      acknowledged_through=6200, commits=2)
    args.update(kw)
    return PartitionRunError(cause, **args)


@pytest.mark.parametrize(("text", "limit", "want"), [
    ("a  b\n\tc", 100, "a b c"),
    ("abcdef", 6, "abcdef"),
    ("abcdefg", 6, "abcde…"),
    ("", 5, ""),
])
def test_one_line(text: str, limit: int, want: str) -> None:
    assert one_line(text, limit) == want


@pytest.mark.parametrize(("error", "want"), [
    (ValueError("amount feed\nunder investigation"), "ValueError: amount feed under investigation"),
    (KeyError(), "KeyError"),
    (RuntimeError("   "), "RuntimeError"),
])
def test_cause_text(error: BaseException, want: str) -> None:
    assert cause_text(error) == want


def test_cause_text_is_bounded() -> None:
    got = cause_text(ValueError("x" * 5000))
    assert len(got) == CAUSE_CHARS and got.startswith("ValueError: xxx") and got.endswith("…")


@pytest.mark.parametrize(("kw", "facts"), [
    ({}, "partition 3 of orders-bycust: run failed with sequences 6201..6320 in flight; "
         "committed through sequence 6200, acknowledged through 6200 (2 commit(s) by this "
         "run); nothing later"),
    ({"inflight": None, "committed_through": None, "acknowledged_through": 0, "commits": 0},
     "partition 3 of orders-bycust: run failed with no batch in flight; nothing read from the "
     "sink yet, acknowledged through none (0 commit(s) by this run); nothing later"),
])
def test_description_is_cause_then_facts(kw: dict, facts: str) -> None:
    cause = ValueError("amount feed under investigation")
    err = _err(cause, **kw)
    first, second = str(err).split("\n")
    assert first == "ValueError: amount feed under investigation"
    assert second.startswith(facts), second
    assert err.__cause__ is cause and err.cause is cause
    assert isinstance(err, CgError)


def test_attached_and_found_through_the_chain() -> None:
    cause = ValueError("bad")
    inner = _err(cause)
    inner.attach()
    _err(cause, partition=9).attach()  # the innermost run's facts win
    assert PartitionRunError.of(cause) is inner
    try:
        try:
            raise cause
        except ValueError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as wrapped:
        assert PartitionRunError.of(wrapped) is inner
    assert PartitionRunError.of(ValueError("no run")) is None
    assert PartitionRunError.of(inner) is inner


def _chain(*messages: str, cycle: bool = False) -> BaseException:
    """An exception raised from the next one, from the next...; the first message is outermost."""
    errors = [RuntimeError(m) for m in messages]
    for outer, inner in zip(errors, errors[1:], strict=False):
        outer.__cause__ = inner
    if cycle:
        errors[-1].__context__ = errors[0]
    return errors[0]


@pytest.mark.parametrize(("error", "depth", "expected"), [
    (RuntimeError("a"), 10, ["a"]),
    (_chain("a", "b", "c"), 10, ["a", "b", "c"]),
    (_chain("a", "b", "c"), 2, ["a", "b"]),
    (_chain("a", "b", cycle=True), 5, ["a", "b", "a", "b", "a"]),  # bounded, not endless
])
def test_exception_chain_walks_cause_then_context_up_to_depth(
        error: BaseException, depth: int, expected: list[str]) -> None:
    assert [str(e) for e in exception_chain(error, depth)] == expected


def test_exception_chain_prefers_the_cause_over_the_context() -> None:
    outer = RuntimeError("outer")
    outer.__cause__, outer.__context__ = ValueError("cause"), KeyError("context")
    assert [type(e) for e in exception_chain(outer)] == [RuntimeError, ValueError]
