"""``Unsettled`` (``engine/unsettled.py``): committed batches owed a settle merge into one
purge's worth: each side's span from its first batch's first sequence to its last batch's
last, messages summed; the committed count summed; split-read windows joined only when back to
back (else None: the sides purge their own partitions)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.engine.commit import Prepared, Span
from cg_pipelines.engine.reads import Window
from cg_pipelines.engine.unsettled import Unsettled


def _prep(spans: dict[str, Span], rows: dict[str, int]) -> Prepared:
    records = {n: RECORD_SCHEMA.empty_table() if not k else pa.table(
        {f.name: pa.nulls(k, f.type) for f in RECORD_SCHEMA}) for n, k in rows.items()}
    return Prepared(records, None, {}, {}, 0.0, spans)


def _win(start: int | None, end: int | None, rows: int) -> Window:
    return Window({}, {}, end=end, start=start, read_rows=rows)


def test_of_counts_the_committed_records_of_every_side() -> None:
    u = Unsettled.of(_prep({"a": Span(3, 9, 103, 4), "b": Span(5, 8, None, 2)},
                           {"a": 4, "b": 2}), _win(3, 10, 7))
    assert u.committed == 6 and u.spans["a"] == Span(3, 9, 103, 4)
    assert u.window is not None and (u.window.start, u.window.end) == (3, 10)


def test_then_merges_each_side_s_spans_and_counts() -> None:
    first = Unsettled({"a": Span(3, 9, 103, 4), "b": Span(5, 8, 105, 2)}, 6, None)
    later = Unsettled({"a": Span(12, 20, None, 5), "c": Span(11, 11, 111, 1)}, 6, None)
    got = first.then(later)
    assert got.spans == {
        "a": Span(3, 20, 103, 9),   # later has no origin: the earlier one stays
        "b": Span(5, 8, 105, 2),    # only in the first
        "c": Span(11, 11, 111, 1),  # only in the later
    }
    assert got.committed == 12


@pytest.mark.parametrize(("a", "b", "joined"), [
    ((1, 10, 8), (11, 20, 9), (1, 20, 17)),   # back to back: one purge below 21
    ((1, 10, 8), (12, 20, 9), None),          # a gap (a read ahead dropped): no split purge
    ((1, 10, 8), (None, None, 0), None),      # the later batch read side by side
    ((None, None, 0), (11, 20, 9), None),
])
def test_split_windows_join_only_back_to_back(
        a: tuple[int | None, int | None, int], b: tuple[int | None, int | None, int],
        joined: tuple[int, int, int] | None) -> None:
    got = Unsettled({}, 0, _win(*a)).then(Unsettled({}, 0, _win(*b))).window
    if joined is None:
        assert got is None
    else:
        assert got is not None and (got.start, got.end, got.read_rows) == joined


def test_a_missing_window_stays_missing() -> None:
    assert Unsettled({}, 0, None).then(Unsettled({}, 0, _win(1, 5, 5))).window is None
