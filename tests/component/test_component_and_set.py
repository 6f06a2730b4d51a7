"""A co-partitioned set beside a Component in one ``dg`` project (issue 50), as docs/joins.md
("In a ``dg`` project, beside a Component") shows it: a project made by ``create-dagster``
holds the Component guide's group in ``defs.yaml`` and the impressions/clicks set, declared in
``defs.yaml`` or in a Python module of the ``defs`` folder with ``build_resources``;
``dg check defs`` loads each (and names the resource clash of a module with resources of its
own), and ``dg launch`` runs one partition of the set into its Delta table."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import sys
import time
import uuid
from pathlib import Path

import nats

from cg_pipelines.core.subjects import partition_for
from cg_pipelines.sinks.delta import DeltaSink
from tests.component.test_component import BIN, REPO, _run, guide_block

JOINS = REPO / "docs" / "joins.md"


def joins_block(first_line: str) -> str:
    """The code block of docs/joins.md that starts with ``first_line``."""
    for m in re.finditer(r"^```\w*\n(.*?)^```", JOINS.read_text(), re.M | re.S):
        if m.group(1).startswith(first_line):
            return m.group(1)
    raise AssertionError(f"docs/joins.md has no block starting with {first_line!r}")


async def _publish(url: str, imp: str, clk: str, n: int) -> dict[str, int]:
    """``n`` auctions, auction ``a<i>`` with one impression and ``i % 3`` clicks; returns
    the clicks per auction."""
    nc = await nats.connect(url)
    clicks = {f"a{i}": i % 3 for i in range(n)}
    try:
        js = nc.jetstream()
        for a, k in clicks.items():
            await js.publish(f"{imp}.{a}", json.dumps({"auction": a, "ad": "x"}).encode())
            for _ in range(k):
                await js.publish(f"{clk}.{a}", json.dumps({"auction": a}).encode())
        for stream, want in ((imp, n), (clk, sum(clicks.values()))):
            deadline = time.monotonic() + 60
            while (await js.stream_info(f"{stream}-join")).state.messages < want:
                assert time.monotonic() < deadline, f"{stream}-join was not filled"
                await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return clicks


async def test_a_set_beside_a_component(nats_url: str, tmp_path: Path) -> None:
    u = uuid.uuid4().hex[:8]
    imp, clk = f"imp{u}", f"clk{u}"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{tmp_path / 'orders_project' / 'src'}",
           "DAGSTER_HOME": str(tmp_path / "home"), "NATS_URL": nats_url,
           "WAREHOUSE": str(tmp_path / "warehouse"), "DAGSTER_DISABLE_TELEMETRY": "1",
           "DAGSTER_DG_UPDATE_CHECK_ENABLED": "0"}
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    _run([str(BIN / "create-dagster"), "project", "--no-uv-sync", "orders_project"],
         tmp_path, env)
    project = tmp_path / "orders_project"
    pkg = project / "src" / "orders_project"
    dg = str(BIN / "dg")

    def streams(text: str) -> str:  # streams of this test's own on the shared nats-server
        return re.sub(r"\b(stream: |JoinInput\(\"\w+\", \")impressions", rf"\g<1>{imp}",
                      re.sub(r"\b(stream: |JoinInput\(\"\w+\", \")clicks", rf"\g<1>{clk}", text))

    # the Component guide's group, in defs.yaml
    (pkg / "transforms.py").write_text(guide_block("# src/orders_project/transforms.py"))
    group = guide_block("type: cg_pipelines.dagster.ConsumerGroupAssetComponent")
    (pkg / "defs" / "customer_totals").mkdir(parents=True)
    (pkg / "defs" / "customer_totals" / "defs.yaml").write_text(group)
    # the set's processor: joins_example.py copied into the project, and auctions.py
    (pkg / "joins_example.py").write_text(joins_block("# joins_example.py"))
    (pkg / "auctions.py").write_text(joins_block("# src/orders_project/auctions.py"))

    # 1. the set in defs.yaml
    yaml_set = pkg / "defs" / "auctions"
    yaml_set.mkdir()
    (yaml_set / "defs.yaml").write_text(streams(joins_block(
        "# src/orders_project/defs/auctions/defs.yaml")))
    out = _run([dg, "check", "defs"], project, env).stdout
    assert "All definitions loaded successfully" in out, out
    listed = _run([dg, "list", "defs", "--json"], project, env).stdout
    for name in ("customer_totals", "auctions", "auctions_backlog", "auctions_membership",
                 "auctions_drain", "customer_totals_backlog", "lag_within_objective__impressions"):
        assert name in listed, (name, listed[-3000:])

    # 2. the set in Python beside the Components: the documented module loads ...
    shutil.rmtree(yaml_set)
    module = pkg / "defs" / "auctions.py"
    text = streams(joins_block("# src/orders_project/defs/auctions.py"))
    assert imp in text and clk in text
    module.write_text(text)
    out = _run([dg, "check", "defs"], project, env).stdout
    assert "All definitions loaded successfully" in out, out
    # ... and resources of its own do not: the clash the page names
    own = text.replace("from cg_pipelines.dagster.component import build_resources",
                       "from cg_pipelines.dagster import DeltaWarehouseResource, NatsResource")
    own = own[:own.index("resources=build_resources(")] + (
        'resources={"nats": NatsResource(), "warehouse": DeltaWarehouseResource(root="w")})\n')
    module.write_text(own)
    bad = _run([dg, "check", "defs"], project, env, ok=False)
    assert bad.returncode != 0 and "same key 'nats'" in bad.stdout + bad.stderr, \
        (bad.stdout + bad.stderr)[-3000:]
    module.write_text(text)

    # 3. one partition of the set launched, as the page says, into its table
    cg = [sys.executable, "-m", "cg_pipelines.cli"]
    for line in joins_block("cg stream create impressions").splitlines():
        words = shlex.split(line.replace("impressions", imp).replace("clicks", clk))
        _run([*cg, *words[1:], "--server", nats_url], tmp_path, env)
    clicks = await _publish(nats_url, imp, clk, 40)
    _run([dg, "launch", "--assets", "auctions", "--partition", "join-0"], project, env)
    rows = DeltaSink(str(tmp_path / "warehouse" / "auctions")).read().to_pylist()
    want = {a: k for a, k in clicks.items() if partition_for([a], 4) == 0}
    assert want, "no auction maps to partition 0"
    assert {r["auction"]: (r["clicks"], r["events"], r["_partition"]) for r in rows} == \
        {a: (k, k + 1, 0) for a, k in want.items()}
