"""Batch size adapted to a processor's fixed cost (pure; table-tested).

Each batch costs a processor a fixed part (a Spark job: planning, scheduling, collecting —
about a second on 2 cores) plus a part per message. With small batches the fixed part
dominates; with huge ones memory and latency grow. :class:`CostModel` keeps the recent
``(messages, seconds)`` of a processor's batches; :func:`next_batch_size` fits ``seconds =
fixed + per_message * messages`` by least squares and picks the smallest batch whose fixed part
is at most ``overhead`` of its time, between the configured batch size and a limit. With one
batch size seen so far it probes twice that size (that is how the fit learns).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["CostModel", "next_batch_size"]


@dataclass
class CostModel:
    """Recent batches of one processor: ``(messages, seconds)``, newest last (at most
    ``keep``). Shared by every run of the processor in a process, so later runs start from
    what earlier ones learned."""

    keep: int = 16
    observations: deque[tuple[int, float]] = field(default_factory=deque)

    def observe(self, messages: int, seconds: float) -> None:
        """Record one batch (ignored unless both are positive)."""
        if messages > 0 and seconds > 0:
            self.observations.append((messages, seconds))
            while len(self.observations) > self.keep:
                self.observations.popleft()

    def fit(self) -> tuple[float, float] | None:
        """``(fixed seconds, seconds per message)`` by least squares, or None with fewer than
        two distinct batch sizes."""
        obs = list(self.observations)
        xs = [n for n, _ in obs]
        if len(set(xs)) < 2:
            return None
        k = len(obs)
        mx = sum(xs) / k
        my = sum(t for _, t in obs) / k
        sxx = sum((n - mx) ** 2 for n in xs)
        sxy = sum((n - mx) * (t - my) for n, t in obs)
        slope = sxy / sxx
        return my - slope * mx, slope


def next_batch_size(model: CostModel, base: int, limit: int, overhead: float = 0.2) -> int:
    """Messages for the next batch, in ``[base, limit]`` (``base`` when ``limit <= base``).

    Args:
        model: the processor's recent batches.
        base: the configured batch size (the smallest this returns).
        limit: the largest batch size allowed.
        overhead: the share of a batch's time its fixed cost may take (0 < overhead < 1).
    """
    if limit <= base or not model.observations:
        return base
    fit = model.fit()
    if fit is None:
        return max(base, min(limit, 2 * model.observations[-1][0]))
    fixed, per_message = fit
    if fixed <= 0:
        return base
    if per_message <= 0:
        return limit
    want = fixed * (1 - overhead) / (overhead * per_message)
    return max(base, min(limit, int(want)))
