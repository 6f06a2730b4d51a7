"""Definition-time guarantees of the Dagster layer that need no server: every engine option is
settable from :class:`PartitionRunsResource` and reaches the engine, groups whose partition
keys collide anywhere (not only at their first or last key) are refused, and the library's own
partitioned checks load without Dagster's preview warning (a user's still warn)."""

from __future__ import annotations

import dataclasses
import typing
import warnings
from pathlib import Path
from typing import Any

import pytest
from dagster import (
    AssetCheckResult,
    Definitions,
    PreviewWarning,
    StaticPartitionsDefinition,
    asset_check,
)

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.dagster import (
    ConsumerGroupAsset,
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
    build_definitions,
)
from cg_pipelines.engine.options import EngineOptions
from tests.support import keyed

ENGINE_FIELDS = [f.name for f in dataclasses.fields(EngineOptions)]
# the resource's own default where it deliberately differs from the engine's
RESOURCE_DEFAULTS = {"adaptive_max_msgs": 200_000}


def _other_value(name: str, default: Any) -> Any:
    """A valid value for engine field ``name`` other than its default, distinct per field."""
    salt = ENGINE_FIELDS.index(name) + 1
    if name == "dead_letter_policy":
        return "halt" if default == "dlq" else "dlq"
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + salt
    if isinstance(default, float):
        return default * 2 + salt  # keeps nats_retry_backoff_s <= nats_retry_max_backoff_s
    assert default is None, (name, default)
    hint = typing.get_type_hints(EngineOptions)[name]
    return float(salt) if float in typing.get_args(hint) else salt


def test_every_engine_option_is_a_resource_field_with_the_engine_default() -> None:
    fields = PartitionRunsResource.model_fields
    assert set(ENGINE_FIELDS) <= set(fields), set(ENGINE_FIELDS) - set(fields)
    engine = EngineOptions()
    resource = PartitionRunsResource()
    for name in ENGINE_FIELDS:
        want = RESOURCE_DEFAULTS.get(name, getattr(engine, name))
        assert getattr(resource, name) == want, name


def test_every_engine_option_set_on_the_resource_reaches_the_engine() -> None:
    defaults = EngineOptions()
    given = {n: _other_value(n, getattr(defaults, n)) for n in ENGINE_FIELDS}
    got = PartitionRunsResource(**given).engine_options()
    assert {n: getattr(got, n) for n in ENGINE_FIELDS} == given
    assert all(given[n] != getattr(defaults, n) for n in ENGINE_FIELDS)


def test_every_resource_field_is_in_the_configuration_reference() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "reference" /
           "configuration.md").read_text()
    table = doc[doc.index("### `PartitionRunsResource`"):doc.index("## `EngineOptions`")]
    missing = [n for n in PartitionRunsResource.model_fields if f"| `{n}` |" not in table]
    assert not missing, missing


def test_an_engine_option_out_of_range_names_the_field() -> None:
    with pytest.raises(ConfigError, match="^nats_retry_backoff_s: need 0 <"):
        PartitionRunsResource(nats_retry_backoff_s=5.0).engine_options()


def _group(name: str, prefix: str, partitions: int) -> ConsumerGroupAsset:
    return ConsumerGroupAsset(name=name, stream="S", group=name, partitions=partitions,
                              processor=keyed.processor(), partition_key_prefix=prefix)


def _resources(tmp_path: Path) -> dict[str, Any]:
    return {"nats": NatsResource(), "warehouse": DeltaWarehouseResource(root=str(tmp_path))}


def test_partition_keys_colliding_in_the_middle_are_refused(tmp_path: Path) -> None:
    # "a" keys a0..a19; "a1" keys a10..a12: only middle keys of "a" collide
    with pytest.raises(ConfigError, match="'a10'") as e:
        build_definitions([_group("wide", "a", 20), _group("narrow", "a1", 3)],
                          resources=_resources(tmp_path))
    assert e.value.field == "partition_key_prefix"
    assert "narrow" in str(e.value) and "wide" in str(e.value)


def test_distinct_partition_keys_are_accepted(tmp_path: Path) -> None:
    defs = build_definitions([_group("wide", "a-", 20), _group("narrow", "a1-", 3)],
                             resources=_resources(tmp_path))
    assert {j.name for j in defs.jobs or []} >= {"wide_job", "narrow_job"}


def test_no_preview_warning_from_the_library_only(tmp_path: Path) -> None:
    """Loading a group's definitions (its partitioned checks, a Dagster 1.13 preview feature)
    prints no ``PreviewWarning``; a user's own partitioned check, built afterwards outside the
    library, still warns (the library's filter is not global). The group also gets its
    ``<name>_checks`` job (the backlog sensor's check-only runs)."""
    group = dataclasses.replace(_group("wide", "a-", 4), lag_objective_s=60.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        defs = build_definitions([group], resources=_resources(tmp_path))
        Definitions.validate_loadable(defs)
    assert [w for w in caught if issubclass(w.category, PreviewWarning)] == []
    assert {j.name for j in defs.jobs or []} >= {"wide_job", "wide_rebuild", "wide_checks"}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        @asset_check(asset="wide", partitions_def=StaticPartitionsDefinition(["a-0"]))
        def mine() -> AssetCheckResult:
            return AssetCheckResult(passed=True)

    assert any(issubclass(w.category, PreviewWarning) and "partitions_def" in str(w.message)
               for w in caught)


class _StatelessWarehouse(DeltaWarehouseResource):
    """A warehouse of the user's whose sinks serve no per-key state."""

    supports_state: typing.ClassVar[bool] = False


def test_the_warehouse_resource_is_checked_against_the_warehouse_contract(
        tmp_path: Path) -> None:
    keyed_group = ConsumerGroupAsset(name="k", stream="S", group="k", partitions=2,
                                     processor=keyed.processor())
    with pytest.raises(ConfigError, match="is not a warehouse") as e:
        build_definitions([_group("g", "g-", 2)],
                          resources={"nats": NatsResource(), "warehouse": NatsResource()})
    assert e.value.field == "resources"
    with pytest.raises(ConfigError, match="cannot serve it"):
        build_definitions([keyed_group], resources={
            "nats": NatsResource(), "warehouse": _StatelessWarehouse(root=str(tmp_path))})
    defs = build_definitions([keyed_group], resources=_resources(tmp_path))
    assert {j.name for j in defs.jobs or []} >= {"k_job"}
