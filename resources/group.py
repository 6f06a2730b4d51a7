"""Partition-run settings of this Dagster deployment: the members it serves and engine options.

A group's partitions are owned by members (the group's KV config); this deployment runs only
the partitions owned by ``members`` (empty: every member of the config).
"""

from __future__ import annotations

from typing import Literal

from dagster import ConfigurableResource
from pydantic import Field

from cg_pipelines.engine.runner import EngineOptions


class PartitionRunsResource(ConfigurableResource):
    """Which members this deployment serves, and how partition runs behave."""

    members: list[str] = Field(default_factory=list, description="Member names served here; "
                               "empty = every member in the group's config.")
    batch_max_msgs: int = Field(20_000, description="Messages per batch (one commit each).")
    batch_max_bytes: int = Field(64 * 1024 * 1024, description="Payload bytes per batch.")
    ack_wait_s: float = Field(30.0, description="Lease ack wait, seconds.")
    priority_timeout_s: float = Field(30.0, description="Pin timeout, seconds.")
    hold_wait_s: float = Field(5.0, description="Seconds to wait when another instance holds "
                               "the partition.")
    max_messages: int | None = Field(None, description="Stop a run after this many messages.")
    dead_letter_policy: Literal["dlq", "halt"] = Field("dlq")
    run_timeout_s: float = Field(3600.0, description="Upper bound of one partition run.")
    min_pending: int = Field(1, description="Backlog sensor: run a partition at this many "
                             "pending messages ...")
    max_age_s: float | None = Field(None, description="... or when its oldest pending message "
                                    "is this old (seconds).")

    def served(self) -> list[str] | None:
        """Served member names, or ``None`` for every member."""
        return list(self.members) or None

    def engine_options(self) -> EngineOptions:
        return EngineOptions(
            batch_max_msgs=self.batch_max_msgs, batch_max_bytes=self.batch_max_bytes,
            ack_wait_s=self.ack_wait_s, priority_timeout_s=self.priority_timeout_s,
            hold_wait_s=self.hold_wait_s, max_messages=self.max_messages,
            dead_letter_policy=self.dead_letter_policy)
