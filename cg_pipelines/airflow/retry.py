"""Core's retry rule as an Airflow task ``retry_policy`` (:class:`CoreRetryPolicy`): the
``k``-th retry of a failed drain waits exactly
:meth:`cg_pipelines.core.triggers.RetryPolicy.backoff` ``(k)`` seconds (Airflow's own
exponential delay adds a hash jitter), and the reason Airflow stores is the cause's first
line. A task killed with SIGKILL raises nothing, so Airflow's static retry settings (the same
base delay, doubled, capped) apply to it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import RetryDecision, RetryPolicy

from cg_pipelines.core.errors import one_line
from cg_pipelines.core.triggers import RetryPolicy as CorePolicy

__all__ = ["CoreRetryPolicy"]


class CoreRetryPolicy(RetryPolicy):
    """``evaluate`` retries after ``policy.backoff(try_number)`` seconds (``try_number``: the
    try that failed, 1-based), with the exception's first line as the reason. Airflow still
    stops at the task's ``retries`` (``max_failures - 1``); ``AirflowFailException`` never
    reaches a policy."""

    def __init__(self, policy: CorePolicy) -> None:
        self.policy = policy

    def evaluate(self, exception: BaseException, try_number: int, max_tries: int,
                 context: Any = None) -> RetryDecision:
        """The decision for a failed try (see the class docstring)."""
        text = str(exception).splitlines()[0] if str(exception).strip() else \
            type(exception).__name__
        return RetryDecision.retry(
            delay=timedelta(seconds=self.policy.backoff(max(1, try_number))),
            reason=one_line(text, 500))

    def serialize(self) -> dict[str, Any]:
        """The core policy's three numbers."""
        p = self.policy
        return {"max_failures": p.max_failures, "backoff_s": p.backoff_s,
                "max_backoff_s": p.max_backoff_s}

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> CoreRetryPolicy:
        """From :meth:`serialize`'s dict."""
        return cls(CorePolicy(int(data["max_failures"]), float(data["backoff_s"]),
                              float(data["max_backoff_s"])))
