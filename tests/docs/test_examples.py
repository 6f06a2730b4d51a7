"""The documented paths run as written from a fresh install: the README's example, Getting
started (Arrow, then Spark), the Dagster Component guide and the Airflow guide (against
``airflow standalone``), each in page order, in a new directory and a new virtual environment
where the page's own ``pip install`` lines install the wheel built from this checkout, against
a real nats-server started for the page. The rules of the pages and the few commands the
runner stands in for are in :mod:`tests.docs.pages`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from deltalake import DeltaTable

from cg_pipelines.core.subjects import partition_for
from cg_pipelines.local.nats_server import NatsServer
from tests.docs.pages import REPO, Page, blocks, build_wheel, fences, make_venv

# The Component guide's `dg dev` binds its default port (3000): this module's tests run one
# after another (one xdist worker takes a whole file: `--dist loadfile`).


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once per session."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh server per page: the pages create stream ``orders`` as a new user would."""
    with NatsServer(tmp_path / "nats", port=0) as srv:
        yield srv


@pytest.fixture
def page(server: NatsServer, wheel: Path, tmp_path: Path) -> Page:
    """A page runner in a new directory with a new, empty venv (the page installs into it)."""
    cwd = tmp_path / "user"
    cwd.mkdir()
    return Page(cwd, server.url, wheel, make_venv(tmp_path / "venv"))


def test_getting_started_runs_as_written(page: Page) -> None:
    path = REPO / "docs" / "getting-started.md"
    langs = [lang for lang, _ in blocks(path)]
    assert langs.count("python") >= 5 and "bash" in langs
    cwd = page.cwd
    out = page.play(path)
    assert "partition 0:" in out and "the same on Arrow and on Spark" in out, out[-2000:]
    # the pandas transform's running totals, checked against the published orders
    rows = DeltaTable(str(cwd / "warehouse" / "customer_totals")).to_pandas()
    assert set(rows["_partition"]) == {0}
    orders = [(f"c{i % 12:02d}", (i % 7) * 2.5) for i in range(200)]
    for customer, got in rows.groupby("customer"):
        want = [a for c, a in orders if c == customer]
        assert list(got.sort_values("_seq")["total"]) == [sum(want[:k + 1])
                                                          for k in range(len(want))]


def test_readme_example_runs_as_written(page: Page) -> None:
    cwd = page.cwd
    out = page.play(REPO / "README.md")
    assert "latest_order" in out or "customer" in out, out[-2000:]
    rows = DeltaTable(str(cwd / "warehouse" / "latest_order")).to_pandas()
    assert sorted(rows["customer"]) == [f"c{i}" for i in range(10)]  # one row per customer
    assert sorted(rows["amount"]) == [i * 1.5 for i in range(90, 100)]  # each one's last


def test_component_guide_runs_as_written(page: Page) -> None:
    """create-dagster project, installing it, scaffolding the component, NATS, stream, group,
    publishing, the environment (NATS_URL, WAREHOUSE, DAGSTER_HOME), dg check/list/launch and
    dg dev answering: the guide's commands only."""
    start = page.cwd
    out = page.play(REPO / "docs" / "guides" / "component.md")
    assert "All definitions loaded successfully" in out, out[-2000:]
    assert "customer_totals" in out  # dg list defs lists the asset
    assert page.cwd == start / "orders_project"
    rows = DeltaTable(str(page.cwd / "warehouse" / "customer_totals")).to_pyarrow_table()
    customers = set(rows.column("customer").to_pylist())
    assert set(rows.column("_partition").to_pylist()) == {0}  # the one partition launched
    assert customers and all(partition_for([c], 4) == 0 for c in customers), customers
    # the launched run is in the instance the page set up (what `dg dev` shows)
    runs = list((page.cwd / ".dagster_home" / "storage").iterdir())
    assert runs, "the launched run was not recorded in DAGSTER_HOME"


def test_airflow_guide_runs_as_written(page: Page) -> None:
    """pip install with the airflow extra, NATS, stream, group, publishing, the Dag file in a
    Dags folder, the environment, ``airflow standalone`` and the watch script: the guide's
    commands only (its titled fragments are not run). Airflow drains exactly the partitions
    that got orders, one run each, and the table holds every order's running total."""
    path = REPO / "docs" / "guides" / "airflow.md"
    assert sum(f.fragment for f in fences(path)) >= 4  # connection, Spark, rebuild, db clean
    cwd = page.cwd
    out = page.play(path)
    assert (cwd / "dags" / "customer_totals.py").is_file()
    orders = [(f"c{i % 3}", i * 1.5) for i in range(90)]
    rows = DeltaTable(str(cwd / "warehouse" / "customer_totals")).to_pandas()
    assert len(rows) == len(orders)
    for customer, got in rows.groupby("customer"):
        want = [a for c, a in orders if c == customer]
        assert list(got.sort_values("_seq")["total"]) == [sum(want[:k + 1])
                                                          for k in range(len(want))]
        assert list(got.sort_values("_seq")["orders"]) == list(range(1, len(want) + 1))
    assert sorted(rows["customer"].unique()) == sorted({c for c, _ in orders})
    # one successful run per partition with backlog (watch.py prints the Dag's runs)
    with_orders = sorted({partition_for([c], 4) for c, _ in orders})
    runs = re.findall(r"^\S+ (totals-\d+) (\w+)$", out, re.M)
    assert sorted(runs) == [(f"totals-{p}", "success") for p in with_orders], out[-3000:]
    assert sorted(rows["_partition"].unique()) == with_orders == [0, 1, 2]  # as the page says
    assert not page.background  # the runner stopped airflow standalone's process group


def test_readme_is_a_quickstart() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    first = [ln for ln in text.splitlines() if ln.startswith("bash scripts/setup.sh")][:2]
    assert first[0].startswith("bash scripts/setup.sh && .venv/bin/python -m mainjob")
    assert first[1].startswith("bash scripts/setup.sh --tests && .venv/bin/python -m pytest -q")
    assert "```python" in text and "from cg_pipelines" in text
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 20 and all((REPO / link).is_file() for link in links), [
        link for link in links if not (REPO / link).is_file()]
