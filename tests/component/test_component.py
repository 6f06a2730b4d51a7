"""The Dagster Component, as a ``dg`` user meets it: ``create-dagster project``, ``dg scaffold
defs cg_pipelines.dagster.ConsumerGroupAssetComponent``, a group declared in ``defs.yaml``
(merge mode), ``dg check defs``, ``dg launch`` of one partition against a real nats-server, and
the Delta table checked against the published orders. Plus the validation errors, in process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nats
import pytest

from cg_pipelines import ArrowProcessor, JsonDecoder, JsonField
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.dagster import ConsumerGroupAssetComponent
from cg_pipelines.dagster.component import (
    SCAFFOLD_YAML,
    SHARED_MAX,
    build_resources,
    scaffold_text,
    shared_resource_count,
)
from cg_pipelines.dagster.io_manager import IcebergTableIOManager
from cg_pipelines.dagster.warehouse import IcebergWarehouseResource
from cg_pipelines.sinks.delta import DeltaSink

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TYPE = "cg_pipelines.dagster.ConsumerGroupAssetComponent"
GUIDE = REPO / "docs" / "guides" / "component.md"


def guide_block(first_line: str) -> str:
    """The code block of the Component guide that starts with ``first_line``."""
    for m in re.finditer(r"^```\w*\n(.*?)^```", GUIDE.read_text(), re.M | re.S):
        if m.group(1).startswith(first_line):
            return m.group(1)
    raise AssertionError(f"{GUIDE.name} has no block starting with {first_line!r}")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], ok: bool = True
         ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    if ok:
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"
    return proc


async def _publish(url: str, stream: str, orders: list[tuple[str, float]]) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for customer, amount in orders:
            await js.publish(f"{stream}.eu.{customer}",
                             json.dumps({"customer": customer, "amount": amount}).encode())
        # the group's work queue is filled from the stream asynchronously
        deadline = time.monotonic() + 60
        while (await js.stream_info(f"{stream}-totals")).state.messages < len(orders):
            assert time.monotonic() < deadline, "the work queue did not receive the orders"
            await asyncio.sleep(0.05)
    finally:
        await nc.close()


async def test_dg_scaffold_declare_launch(nats_url: str, tmp_path: Path) -> None:
    stream = f"dgorders{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{tmp_path / 'orders_project' / 'src'}",
           "DAGSTER_HOME": str(tmp_path / "home"), "NATS_URL": nats_url,
           "WAREHOUSE": str(tmp_path / "warehouse"), "DAGSTER_DISABLE_TELEMETRY": "1",
           "DAGSTER_DG_UPDATE_CHECK_ENABLED": "0"}  # no PyPI look-up: hermetic, offline-safe
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    _run([str(BIN / "create-dagster"), "project", "--no-uv-sync", "orders_project"],
         tmp_path, env)
    project = tmp_path / "orders_project"
    pkg = project / "src" / "orders_project"
    # the user's processor: the guide's transforms.py, as written
    (pkg / "transforms.py").write_text(guide_block("# src/orders_project/transforms.py"))
    # the documented project-level registration: `dg list components` then lists ours
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(
        'registry_modules = [', 'registry_modules = [\n    "cg_pipelines.dagster",', 1))
    listed = _run([str(BIN / "dg"), "list", "components", "--json"], project, env).stdout
    assert f'"key": "{TYPE}"' in listed, listed[-2000:]

    _run([str(BIN / "dg"), "scaffold", "defs", TYPE, "customer_totals", "--stream", stream,
          "--group", "totals", "--partitions", "2",
          "--processor", "orders_project.transforms:totals"], project, env)
    defs_yaml = pkg / "defs" / "customer_totals" / "defs.yaml"
    text = defs_yaml.read_text()
    assert f"type: {TYPE}" in text and f"stream: {stream}" in text, text
    # the user picks merge mode: one current row per customer
    text = text.replace("write: {mode: append}", "write: {mode: merge, key: customer}")
    assert "mode: merge" in text
    defs_yaml.write_text(text)
    out = _run([str(BIN / "dg"), "check", "defs"], project, env).stdout
    assert "All definitions loaded successfully" in out, out

    cg = [sys.executable, "-m", "cg_pipelines.cli"]
    _run([*cg, "stream", "create", stream, "--subject", f"{stream}.>", "--server", nats_url],
         tmp_path, env)
    _run([*cg, "elastic", "create", stream, "totals", "--max-members", "2", "--filter",
          f"{stream}.*.*:2", "--members", "m1", "--server", nats_url], tmp_path, env)
    orders = [(f"c{i % 7}", float(i)) for i in range(60)]
    await _publish(nats_url, stream, orders)

    _run([str(BIN / "dg"), "launch", "--assets", "customer_totals", "--partition", "totals-0"],
         project, env)
    table = DeltaSink(str(tmp_path / "warehouse" / "customer_totals")).read().to_pylist()
    want = {c: a for c, a in orders if partition_for([c], 2) == 0}  # last amount per customer
    assert want, "no customer maps to partition 0"
    got = {r["customer"]: (r["amount"], r["doubled"], r["_partition"]) for r in table}
    assert got == {c: (a, 2 * a, 0) for c, a in want.items()}

    # a processor path that does not resolve is a clear error from dg, naming the field
    defs_yaml.write_text(text.replace("transforms:totals", "transforms:totalz"))
    bad = _run([str(BIN / "dg"), "check", "defs"], project, env, ok=False)
    assert bad.returncode != 0
    assert "module 'orders_project.transforms' has no attribute 'totalz'" in \
        bad.stdout + bad.stderr, bad.stdout[-2000:] + bad.stderr[-2000:]


BASE = """\
name: t
stream: s
group: g
partitions: 2
processor: cg_pipelines.dagster.component:RESOURCE_CLASSES
resources:
  nats: {servers: {env: NATS_URL}}
  warehouse: {root: /tmp/cg-component-wh}
"""


@pytest.mark.parametrize(("yaml", "message"), [
    (BASE, "processor: 'cg_pipelines.dagster.component:RESOURCE_CLASSES' is a dict, not a "
           "processor"),
    (BASE.replace("dagster.component:RESOURCE_CLASSES", "nowhere:x"),
     "cannot import module 'cg_pipelines.nowhere'"),
    (BASE.replace("cg_pipelines.dagster.component:RESOURCE_CLASSES", "noseparator"),
     "must look like 'package.module:attribute'"),
    (BASE.replace("  nats:", "  natz:"), "unknown resource 'natz'"),
    (BASE + "write: {mode: merge}\n", "write: mode: merge needs key"),
    (BASE + "write: {mode: append, key: c}\n", "key and delete_when apply to mode: merge"),
])
def test_validation_errors_name_the_problem(yaml: str, message: str) -> None:
    component = ConsumerGroupAssetComponent.resolve_from_yaml(yaml)
    with pytest.raises(ConfigError) as e:
        component.build_defs(None)  # type: ignore[arg-type]  # the context is not read
    assert message in str(e.value)


def test_schema_refuses_unknown_fields_and_bad_types() -> None:
    with pytest.raises(Exception, match="partitons"):
        ConsumerGroupAssetComponent.resolve_from_yaml(BASE + "partitons: 3\n")
    with pytest.raises(Exception, match="partitions"):
        ConsumerGroupAssetComponent.resolve_from_yaml(BASE.replace("partitions: 2",
                                                                   "partitions: many"))


def test_same_resource_settings_share_one_object() -> None:
    declared = {"nats": {"servers": {"env": "NATS_URL"}}, "warehouse": {"root": "/tmp/w"}}
    a, b = build_resources(declared), build_resources(json.loads(json.dumps(declared)))
    assert all(a[k] is b[k] for k in a)  # so two components' definitions merge
    assert set(a) == {"nats", "warehouse", "partition_runs", "cg_io_manager"}
    assert build_resources({"warehouse": {"root": "/tmp/other"}})["warehouse"] is not \
        a["warehouse"]


def test_the_guide_shows_what_the_scaffold_writes() -> None:
    """The guide's defs.yaml is the scaffold's output for the guide's dg scaffold command."""
    command = guide_block("pip install 'cg-pipelines[dg,ui,testing]'")
    assert "--stream orders --group totals --partitions 4 --processor " \
           "orders_project.transforms:totals" in command
    assert guide_block(f"type: {TYPE}") == SCAFFOLD_YAML.format(
        type_name=TYPE, name="customer_totals", stream="orders", group="totals", partitions=4,
        processor="orders_project.transforms:totals")


def test_scaffold_text_is_the_documented_yaml() -> None:
    component = ConsumerGroupAssetComponent.resolve_from_yaml(
        scaffold_text().split("attributes:\n", 1)[1].replace("\n  ", "\n").lstrip())
    assert (component.stream, component.group, component.partitions) == ("orders", "totals", 4)


def test_shared_resources_are_bounded() -> None:
    first = build_resources({"warehouse": {"root": "/tmp/bound-0"}})["warehouse"]
    for i in range(1, SHARED_MAX + 50):
        build_resources({"warehouse": {"root": f"/tmp/bound-{i}"}})
    assert shared_resource_count() <= SHARED_MAX
    # the oldest settings were dropped: the same settings now make a new object
    assert build_resources({"warehouse": {"root": "/tmp/bound-0"}})["warehouse"] is not first


def doubled(table: object, ctx: object) -> object:
    return table


PROCESSOR = ArrowProcessor(JsonDecoder([JsonField("customer", "string")]), doubled)


def test_an_iceberg_warehouse_by_format(tmp_path: Path) -> None:
    """``warehouse: {format: iceberg, ...}`` gives the Iceberg warehouse, its IO manager and
    an asset of kind iceberg; an unknown format is refused with the choices."""
    yaml = BASE.replace("cg_pipelines.dagster.component:RESOURCE_CLASSES",
                        "tests.component.test_component:PROCESSOR").replace(
        "warehouse: {root: /tmp/cg-component-wh}",
        f"warehouse: {{format: iceberg, warehouse: {tmp_path / 'lake'}, namespace: shop}}")
    defs = ConsumerGroupAssetComponent.resolve_from_yaml(yaml).build_defs(
        None)  # type: ignore[arg-type]  # the context is not read
    warehouse = defs.resources["warehouse"]
    assert isinstance(warehouse, IcebergWarehouseResource) and warehouse.namespace == "shop"
    assert isinstance(defs.resources["cg_io_manager"], IcebergTableIOManager)
    (spec,) = [a for a in defs.resolve_all_asset_specs() if a.key.to_user_string() == "t"]
    assert spec.kinds == {"nats", "iceberg"}
    bad = ConsumerGroupAssetComponent.resolve_from_yaml(yaml.replace("iceberg", "hudi"))
    with pytest.raises(ConfigError, match="resources.warehouse.format: must be one of delta, "
                                          "iceberg, got 'hudi'"):
        bad.build_defs(None)  # type: ignore[arg-type]

