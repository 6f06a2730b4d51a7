"""``cg`` tables (issue 29, point 7: columns were misaligned): every column as wide as its
widest cell, numbers right-aligned, a long cell widens its column instead of being cut."""

from __future__ import annotations

import pytest

from cg_pipelines.cli.context import table


@pytest.mark.parametrize(("rows", "want"), [
    ([[1, "a"], [100, None]], ["  p   name", "──────────", "  1   a", "100   -"]),
    ([[7, "a much longer cell"]], ["p   name", "──────────────────────", "7   a much longer cell"]),
    ([], ["p   name", "────────"]),
])
def test_table(rows: list[list[object]], want: list[str]) -> None:
    assert table(["p", "name"], rows, right=["p"]).split("\n") == want


def test_every_row_lines_up_with_its_header() -> None:
    rows = [[i, 10 ** (i % 6), f"holder {'x' * (i % 13)}"] for i in range(300)]
    header, rule, *lines = table(["partition", "pending", "holder"], rows,
                                 right=["partition", "pending"]).split("\n")
    assert len(rule) == max(len(x) for x in lines) and len(lines) == 300
    for name in ("partition", "pending"):
        end = header.index(name) + len(name)
        assert all(ln[end - 1] != " " and ln[end] == " " for ln in lines)
    start = header.index("holder")
    assert all(ln[start:].startswith("holder") for ln in lines)
