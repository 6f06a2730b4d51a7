"""A ``dg`` Component (:class:`ConsumerGroupAssetComponent`): a group, or a set (``inputs:``),
declared in ``defs.yaml``, with the definitions of ``build_definitions`` (docs/guides/
component.md; docs/joins.md for a set beside it). Resources with the same settings are one
object (:func:`build_resources`), so a project's definitions merge; errors name the field."""

from __future__ import annotations

import importlib
import json
import textwrap
from collections import OrderedDict
from typing import Any, Literal

from dagster import Definitions, EnvVar
from dagster.components import (
    Component,
    ComponentLoadContext,
    Model,
    Resolvable,
    Scaffolder,
    ScaffoldRequest,
    scaffold_with,
)
from pydantic import BaseModel

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.record import SEQ_COLUMN
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.dagster.definitions import build_definitions
from cg_pipelines.dagster.io_manager import table_io_manager
from cg_pipelines.dagster.resources import (
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
    SparkResource,
)
from cg_pipelines.dagster.spec import ConsumerGroupAsset, JoinInput, StreamAsset
from cg_pipelines.dagster.warehouse import IcebergWarehouseResource

__all__ = ["ConsumerGroupAssetComponent", "DeleteWhenModel", "InputModel", "WriteModel",
           "build_resources"]

RESOURCE_CLASSES: dict[str, type[Any]] = {
    "nats": NatsResource,
    "warehouse": DeltaWarehouseResource,
    "spark": SparkResource,
    "partition_runs": PartitionRunsResource,
}
WAREHOUSE_FORMATS: dict[str, type[Any]] = {
    "delta": DeltaWarehouseResource,
    "iceberg": IcebergWarehouseResource,
}
# One object per (key, settings): Definitions.merge accepts a resource key twice only when it
# is the same object. Past SHARED_MAX (a code server reloading edited files) the oldest go.
SHARED_MAX = 256
_SHARED: OrderedDict[str, Any] = OrderedDict()

SCAFFOLD_YAML = """\
type: {type_name}
attributes:
  # asset name (and Delta table name); the origin stream; the elastic group on it (create
  # it first: cg elastic create); its partition count (max_members)
  name: {name}
  stream: {stream}
  group: {group}
  partitions: {partitions}
  # import path module:attribute of an ArrowProcessor / SparkProcessor object
  processor: {processor}
  # or {{mode: merge, key: customer, delete_when: {{column: op, value: delete}}}}
  write: {{mode: append}}
  # {{env: NAME}} is dagster.EnvVar(NAME): read at run time, never stored
  resources:
    nats: {{servers: {{env: NATS_URL}}}}
    warehouse: {{root: {{env: WAREHOUSE}}}}
    # or Iceberg: {{format: iceberg, warehouse: {{env: WAREHOUSE}}, catalog_uri: ...}}
    # spark: {{master: "local[2]"}}   (a SparkProcessor needs it)
    # partition_runs: {{dead_letter_policy: halt, batch_max_msgs: 20000}}
"""


class DeleteWhenModel(Model):
    """A merge delete marker: a row whose ``column`` equals ``value`` deletes its key."""

    column: str
    value: str | int | float | bool


class WriteModel(Model):
    """The write mode: ``append`` (the table is the history) or ``merge`` (one current row per
    ``key``; see :class:`~cg_pipelines.Merge`)."""

    mode: Literal["append", "merge"] = "append"
    key: str | list[str] | None = None
    delete_when: DeleteWhenModel | None = None
    order_by: str | None = SEQ_COLUMN

    def build(self) -> Append | Merge:
        """The :class:`~cg_pipelines.Append` or :class:`~cg_pipelines.Merge` declared.

        Raises:
            ConfigError: ``mode: merge`` without ``key``, or ``key``/``delete_when`` given
                with ``mode: append``, or a merge setting :class:`Merge` refuses.
        """
        if self.mode == "append":
            if self.key is not None or self.delete_when is not None:
                raise ConfigError("write", "key and delete_when apply to mode: merge only")
            return Append()
        if self.key is None:
            raise ConfigError("write", "mode: merge needs key (a column name or a list)")
        key = self.key if isinstance(self.key, str) else tuple(self.key)
        dw = None if self.delete_when is None else (self.delete_when.column,
                                                    self.delete_when.value)
        try:
            return Merge(key=key, delete_when=dw, order_by=self.order_by)
        except ValueError as e:
            raise ConfigError("write", str(e)) from e


class InputModel(Model):
    """One input of a co-partitioned set: the processor's ``name`` for it, its ``stream`` and
    elastic ``group``."""

    name: str
    stream: str
    group: str


class ScaffoldParams(BaseModel):
    """``dg scaffold defs ... --stream orders --group totals --partitions 4 --processor m:a``."""

    name: str | None = None
    stream: str | None = None
    group: str | None = None
    partitions: int | None = None
    processor: str | None = None


class ConsumerGroupAssetScaffolder(Scaffolder[ScaffoldParams]):
    """Writes ``defs.yaml`` for one group, with the scaffold parameters or placeholders."""

    @classmethod
    def get_scaffold_params(cls) -> type[ScaffoldParams]:
        """The parameters ``dg scaffold defs`` accepts (all optional)."""
        return ScaffoldParams

    def scaffold(self, request: ScaffoldRequest[ScaffoldParams]) -> None:
        """Create ``<target>/defs.yaml``."""
        p = request.params or ScaffoldParams()
        target = request.target_path
        target.mkdir(parents=True, exist_ok=True)
        name = p.name or target.name
        text = SCAFFOLD_YAML.format(
            type_name=request.type_name, name=name, stream=p.stream or "orders",
            group=p.group or "totals", partitions=p.partitions or 4,
            processor=p.processor or f"my_project.transforms:{name}")
        (target / "defs.yaml").write_text(text)


def _load_processor(path: str) -> Any:
    """The object at ``module:attribute`` (or ``module.attribute``); a processor has
    ``process`` (a join processor ``process_inputs``)."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError("processor", f"{path!r} must look like 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError("processor", f"{path!r}: cannot import module {module_name!r} "
                          f"({e})") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError("processor", f"{path!r}: module {module_name!r} has no "
                              f"attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(getattr(obj, "process", getattr(obj, "process_inputs", None))):
        raise ConfigError("processor", f"{path!r} is a {type(obj).__name__}, not a processor "
                          "(an ArrowProcessor, a SparkProcessor, or an object with "
                          "process(batch, ctx))")
    return obj


def _value(v: Any) -> Any:
    """``{env: NAME}`` -> ``EnvVar(NAME)`` (resolved at run time, never stored in the code
    location's snapshot); other values as they are."""
    if isinstance(v, dict) and set(v) == {"env"} and isinstance(v["env"], str):
        return EnvVar(v["env"])
    return v


def _shared(key: str, settings: Any, make: Any) -> Any:
    ident = f"{key}:{json.dumps(settings, sort_keys=True, default=repr)}"
    if ident in _SHARED:
        _SHARED.move_to_end(ident)
    else:
        _SHARED[ident] = make()
        while len(_SHARED) > SHARED_MAX:
            _SHARED.popitem(last=False)
    return _SHARED[ident]


def shared_resource_count() -> int:
    """How many shared resource objects are kept (at most :data:`SHARED_MAX`)."""
    return len(_SHARED)


def build_resources(declared: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The resource objects of a ``resources:`` mapping, plus ``partition_runs`` and
    ``cg_io_manager``: for the same settings the same objects, so the definitions of a ``dg``
    project (Components, and Python modules that take these) merge (docs/joins.md).

    Raises:
        ConfigError: an unknown resource key, settings that are not a mapping, or settings
            the resource class refuses (its message included).
    """
    out: dict[str, Any] = {}
    for key, settings in declared.items():
        cls = RESOURCE_CLASSES.get(key)
        if cls is None:
            raise ConfigError("resources", f"unknown resource {key!r}; known: "
                              f"{', '.join(sorted(RESOURCE_CLASSES))}")
        if not isinstance(settings, dict):
            raise ConfigError(f"resources.{key}", f"must be a mapping of {cls.__name__} "
                              f"fields, got {settings!r}")
        fields = settings
        if key == "warehouse":
            fmt = settings.get("format", "delta")
            if fmt not in WAREHOUSE_FORMATS:
                raise ConfigError("resources.warehouse.format", f"must be one of "
                                  f"{', '.join(WAREHOUSE_FORMATS)}, got {fmt!r}")
            cls = WAREHOUSE_FORMATS[fmt]
            fields = {k: v for k, v in settings.items() if k != "format"}

        def make(cls: type[Any] = cls, key: str = key, fields: dict[str, Any] = fields) -> Any:
            try:
                return cls(**{k: _value(v) for k, v in fields.items()})
            except Exception as e:  # pydantic's ValidationError names the fields
                raise ConfigError(f"resources.{key}", f"{cls.__name__}: {e}") from e

        out[key] = _shared(key, settings, make)
    out.setdefault("partition_runs", _shared("partition_runs", {}, PartitionRunsResource))
    if "warehouse" in out:
        spark = out.get("spark")
        out["cg_io_manager"] = _shared(
            "cg_io_manager", [declared.get("warehouse"), declared.get("spark")],
            lambda: table_io_manager(out["warehouse"], spark))
    return out


@scaffold_with(ConsumerGroupAssetScaffolder)
class ConsumerGroupAssetComponent(Component, Resolvable, Model):
    """A consumer group, or a co-partitioned set of groups, as a partitioned Dagster asset,
    declared in ``defs.yaml``.

    Attributes:
        name, partitions: as :class:`~cg_pipelines.dagster.StreamAsset`'s.
        stream, group: the one group (create it first: ``cg elastic create``); or
        inputs: a co-partitioned set, ``[{name, stream, group}, ...]`` (:class:`InputModel`).
        processor: import path ``package.module:attribute`` of the processor (a
            ``JoinProcessor`` for a set).
        write: the write mode (:class:`WriteModel`; default append).
        resources: settings by key (``nats``, ``warehouse``, ``spark``, ``partition_runs``);
            a value ``{env: NAME}`` is ``dagster.EnvVar(NAME)``.
        description, group_name, partition_key_prefix, sensor_interval_s, lag_objective_s,
        schedule_cron: as :class:`~cg_pipelines.dagster.StreamAsset`'s (``null``: none);
            the other settings keep their defaults (declare the asset in Python for them).

    Raises:
        ConfigError: when the definitions load: a processor path that does not import or is
            not a processor, bad resources or write mode, or what ``StreamAsset`` and
            ``build_definitions`` refuse.
    """

    name: str
    partitions: int
    processor: str
    stream: str | None = None
    group: str | None = None
    inputs: list[InputModel] | None = None
    write: WriteModel = WriteModel()
    resources: dict[str, dict[str, Any]] = {}
    description: str = ""
    group_name: str | None = None
    partition_key_prefix: str | None = None
    sensor_interval_s: int = 30
    lag_objective_s: float | None = 300.0
    schedule_cron: str | None = "*/15 * * * *"

    def spec(self) -> StreamAsset:
        """The spec this declaration stands for (imports the processor).

        Raises:
            ConfigError: neither or both of ``stream``/``group`` and ``inputs``.
        """
        options: dict[str, Any] = dict(
            write=self.write.build(), description=self.description,
            group_name=self.group_name, partition_key_prefix=self.partition_key_prefix,
            sensor_interval_s=self.sensor_interval_s, lag_objective_s=self.lag_objective_s,
            schedule_cron=self.schedule_cron)
        processor = _load_processor(self.processor)
        if self.inputs is not None and self.stream is None and self.group is None:
            return StreamAsset(self.name, [JoinInput(i.name, i.stream, i.group)
                                           for i in self.inputs],
                               self.partitions, processor, **options)
        if self.inputs is not None or self.stream is None or self.group is None:
            raise ConfigError("inputs", "declare either stream and group (one group) or "
                              "inputs (a co-partitioned set)")
        return ConsumerGroupAsset(name=self.name, stream=self.stream, group=self.group,
                                  partitions=self.partitions, processor=processor, **options)

    def build_defs(self, context: ComponentLoadContext) -> Definitions:
        """The asset's definitions (:func:`~cg_pipelines.dagster.build_definitions`)."""
        resources = build_resources(self.resources)
        return build_definitions([self.spec()], resources=resources)


def scaffold_text(type_name: str = "cg_pipelines.dagster.ConsumerGroupAssetComponent") -> str:
    """The ``defs.yaml`` the scaffolder writes with no parameters (for docs and tests)."""
    return textwrap.dedent(SCAFFOLD_YAML.format(
        type_name=type_name, name="customer_totals", stream="orders", group="totals",
        partitions=4, processor="my_project.transforms:customer_totals"))
