"""How a group's runs are laid out, kept in NATS so a deployment picks a change up at its next
sensor tick without a code change or a restart: the run parallelism D, partitions one run
drains (``notes/RANGE_RUNS.md`` §7; ``cg runs set``).

It lives in cg's own KV bucket :data:`RUNS_BUCKET`, never in the reference implementation's
buckets (a Go member reads those and must not see keys it does not know), key
``<stream>.<group>`` (the reference's key form), value ``{"partitions_per_run": D}`` (JSON).
A missing bucket or key means "not set": the deployment's own setting applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import nats.js.errors as jserr
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType

from cg_pipelines.core.config import config_key
from cg_pipelines.core.errors import ConfigError

__all__ = ["RUNS_BUCKET", "RunLayout", "delete_run_layout", "get_run_layout", "set_run_layout"]

RUNS_BUCKET = "cg-runs"
"""cg's KV bucket of run layouts (one key per group)."""


@dataclass(frozen=True, slots=True)
class RunLayout:
    """A group's run layout: ``partitions_per_run`` (D, ``>= 1``; 1 = one run per
    partition).

    Raises:
        ConfigError: D below 1 or not an integer.
    """

    partitions_per_run: int

    def __post_init__(self) -> None:
        d = self.partitions_per_run
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ConfigError("partitions_per_run", f"must be an integer >= 1, got {d!r}")

    def encode(self) -> bytes:
        """The stored JSON."""
        return json.dumps({"partitions_per_run": self.partitions_per_run}).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> RunLayout:
        """Parse a stored value (``where`` names the key in errors).

        Raises:
            ConfigError: not JSON, not an object, or D invalid (the stored text quoted).
        """
        try:
            return cls(json.loads(data)["partitions_per_run"])
        except (ValueError, TypeError, KeyError) as e:  # ConfigError is a ValueError
            raise ConfigError("partitions_per_run", f"{where} holds {data[:200]!r}, not a run "
                              f"layout ({type(e).__name__}: {e})") from None


async def get_run_layout(js: JetStreamContext, stream: str, group: str) -> RunLayout | None:
    """The group's layout, or ``None`` when none is set (no bucket, no key, or deleted).

    Raises:
        ConfigError: the stored value is not a valid layout.
        nats errors, TimeoutError: as the KV read fails.
    """
    try:
        kv = await js.key_value(RUNS_BUCKET)
        entry = await kv.get(config_key(stream, group))
    except (jserr.BucketNotFoundError, jserr.KeyNotFoundError, jserr.KeyDeletedError):
        return None
    if entry.value is None:
        return None
    return RunLayout.decode(entry.value, f"{RUNS_BUCKET}/{config_key(stream, group)}")


async def set_run_layout(js: JetStreamContext, stream: str, group: str, layout: RunLayout,
                         replicas: int = 1) -> int:
    """Store the group's layout (the bucket is made on first use, file storage, ``replicas``;
    keeps one revision per key); returns the KV revision.

    Raises:
        nats errors, TimeoutError: as the KV write fails.
    """
    try:
        kv = await js.key_value(RUNS_BUCKET)
    except jserr.BucketNotFoundError:
        kv = await js.create_key_value(KeyValueConfig(
            bucket=RUNS_BUCKET, history=1, storage=StorageType.FILE, replicas=replicas,
            description="cg-pipelines: run layouts of consumer groups (cg runs set)"))
    return int(await kv.put(config_key(stream, group), layout.encode()))


async def delete_run_layout(js: JetStreamContext, stream: str, group: str) -> bool:
    """Remove the group's layout (back to each deployment's own setting); ``False`` when none
    was set.

    Raises:
        nats errors, TimeoutError: as the KV write fails.
    """
    if await get_run_layout(js, stream, group) is None:
        return False
    kv = await js.key_value(RUNS_BUCKET)
    await kv.delete(config_key(stream, group))
    return True
