"""Batch size adapted to the processor's fixed cost."""

from __future__ import annotations

import pytest

from cg_pipelines.core.batching import CostModel, next_batch_size


def model(*obs: tuple[int, float]) -> CostModel:
    m = CostModel()
    for n, t in obs:
        m.observe(n, t)
    return m


@pytest.mark.parametrize(("obs", "base", "limit", "want"), [
    ((), 20_000, 200_000, 20_000),                       # nothing seen: the configured size
    (((20_000, 1.0),), 20_000, 200_000, 40_000),         # one size seen: probe twice that
    (((20_000, 1.0),), 20_000, 30_000, 30_000),          # ... not past the limit
    (((150_000, 3.0),), 20_000, 200_000, 200_000),
    # Spark-like: 1 s fixed + 10 µs/msg -> fixed <= 20 % at 400k, capped at the limit
    (((20_000, 1.2), (40_000, 1.4)), 20_000, 200_000, 200_000),
    (((20_000, 1.2), (40_000, 1.4)), 20_000, 1_000_000, 400_000),
    # Arrow-like: 5 ms fixed + 5 µs/msg -> 4,000 wanted, the configured size is the floor
    (((20_000, 0.105), (40_000, 0.205)), 20_000, 200_000, 20_000),
    (((20_000, 0.105), (40_000, 0.205)), 1_000, 200_000, 4_000),
    # noise that fits a negative fixed cost: no reason to grow
    (((20_000, 1.0), (40_000, 2.5)), 20_000, 200_000, 20_000),
    ((), 20_000, 10_000, 20_000),                        # limit below base: base
])
def test_next_batch_size(obs: tuple, base: int, limit: int, want: int) -> None:
    assert next_batch_size(model(*obs), base, limit) == want


def test_fit_and_memory() -> None:
    m = model((10, 1.0), (20, 1.5), (30, 2.0))
    fixed, per = m.fit()  # type: ignore[misc]
    assert fixed == pytest.approx(0.5) and per == pytest.approx(0.05)
    assert model((10, 1.0), (10, 2.0)).fit() is None
    m = CostModel(keep=2)
    for i in range(1, 6):
        m.observe(i, float(i))
    m.observe(0, 1.0)  # ignored
    assert list(m.observations) == [(4, 4.0), (5, 5.0)]
