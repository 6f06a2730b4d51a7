"""``run_partitions`` refuses a bad partition list (and a sink it cannot use) before any I/O:
no NATS connection is touched (``nc`` is None here) and nothing is read from the sink."""

from __future__ import annotations

import numpy as np
import pytest

from cg_pipelines.core.errors import ConfigError, UsageError
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.options import EngineConfigError
from cg_pipelines.engine.runner import check_partitions, run_partitions
from cg_pipelines.testing import MemorySink
from tests.support import keyed


@pytest.mark.parametrize(("parts", "match"), [
    ([], "one partition or more, got none"),
    ((), "one partition or more, got none"),
    ([0, 3, 3, 1, 1], r"distinct, repeated: \[1, 3\]"),

    (["1"], "integers"),
    ([True], "integers"),
    ([1.0], "integers"),
], ids=["empty", "empty-tuple", "duplicates", "string", "bool", "float"])
async def test_bad_partitions_refused_before_io(parts, match) -> None:
    with pytest.raises(UsageError, match=match):
        await run_partitions(None, "S", "g", parts, keyed.processor(),  # type: ignore[arg-type]
                             MemorySink())


async def test_a_negative_partition_is_a_config_error_before_io() -> None:
    with pytest.raises(ConfigError, match=r"^partitions: must be >= 0, got \[-2\]$"):
        await run_partitions(None, "S", "g", [0, -2, 5], keyed.processor(),  # type: ignore[arg-type]
                             MemorySink())


def test_good_partitions_kept_in_order() -> None:
    assert check_partitions(range(3)) == [0, 1, 2]
    assert check_partitions([7, 2, 5]) == [7, 2, 5]
    got = check_partitions(np.arange(2, 4))  # numpy integers: plain ints
    assert got == [2, 3] and all(type(p) is int for p in got)


async def test_not_a_sink_refused_before_io() -> None:
    with pytest.raises(EngineConfigError, match="is not a table sink"):
        await run_partitions(None, "S", "g", [0, 1], keyed.processor(),  # type: ignore[arg-type]
                             object())  # type: ignore[arg-type]


class _IcebergMerge(MemorySink):
    table_format = "iceberg"


async def test_iceberg_merge_over_several_partitions_refused() -> None:
    sink = _IcebergMerge(write=Merge(("key",)))
    with pytest.raises(EngineConfigError, match="Merge mode refuses"):
        await run_partitions(None, "S", "g", [0, 1], keyed.processor(),  # type: ignore[arg-type]
                             sink)
