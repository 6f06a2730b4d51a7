"""cg-pipelines as a user gets it: a wheel installed with ``[dagster,spark]`` into a fresh
virtual env outside the repo, and a user project in a temp dir (``project/definitions.py``,
which imports only public ``cg_pipelines`` names) driven through the user's own ``cg`` and
``dagster`` commands:

- ``cg stream create`` / ``cg elastic create`` (connection options after the command);
- ``dagster definitions validate``;
- ``dagster asset materialize --partition`` of one partition;
- ``dagster job backfill --all`` of every partition (one run per partition, each tagged
  ``dagster/partition=<group>-<p>``);
- a run against a standalone Spark master (started from the pyspark package), whose JSON
  endpoint shows the run's application.

Per customer, the running total of ``amount`` and the order count in event order, across small
batches, must equal pandas' over everything published.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import nats
import pandas as pd
import pytest
from dagster import DagsterInstance, DagsterRun, DagsterRunStatus

from cg_pipelines.core.subjects import partition_for
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.local.spark_cluster import SparkStandaloneCluster
from cg_pipelines.sinks.delta import DeltaSink

REPO = Path(__file__).resolve().parents[2]
PROJECT = Path(__file__).resolve().parent / "project"
PARTITIONS = 4
REGIONS = ("eu", "us", "ap")
CUSTOMERS = [f"c{i:02d}" for i in range(24)]
FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
DAGSTER_YAML = """\
run_coordinator:
  module: dagster._core.run_coordinator
  class: DefaultRunCoordinator
telemetry:
  enabled: false
"""


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv outside the repo with the built wheel and its [dagster,spark] extras."""
    root = tmp_path_factory.mktemp("user-venv")
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist),
                    str(REPO)], check=True, timeout=600, cwd=root)
    wheel = next(dist.glob("cg_pipelines-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    # the wheel is the library alone: no example, tests or benchmarks
    assert all(n.startswith(("cg_pipelines/", "cg_pipelines-")) for n in names), [
        n for n in names if not n.startswith("cg_pipelines")][:5]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # no PYTHONPATH: a checkout on it (with the egg-info `pip wheel` leaves there) would make
    # pip take cg-pipelines for installed and install only its dependencies
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                    f"{wheel}[dagster,spark]"], check=True, timeout=1200, cwd=root, env=env)
    assert (venv / "bin" / "cg").is_file(), "the wheel's `cg` command was not installed"
    return venv


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """The user's own NATS (a fresh server, so the stream name ``orders`` is theirs)."""
    with NatsServer(tmp_path_factory.mktemp("user-nats"), port=0) as srv:
        yield srv


class UserProject:
    def __init__(self, root: Path, venv: Path, nats_url: str) -> None:
        self.root, self.venv, self.nats_url = root, venv, nats_url
        self.home = root / "dagster_home"
        self.warehouse = root / "warehouse"
        self.events: list[tuple[str, str, float]] = []

    def env(self, spark_master: str = "local[2]") -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items()
                if k in ("HOME", "LANG", "JAVA_HOME", "TMPDIR", "USER")}
        return {**keep, "PATH": f"{self.venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
                "DAGSTER_HOME": str(self.home), "NATS_URL": self.nats_url,
                "SPARK_MASTER": spark_master, "WAREHOUSE": str(self.warehouse)}

    def run(self, *cmd: str, spark_master: str = "local[2]", timeout: float = 300
            ) -> subprocess.CompletedProcess[str]:
        """A command of the user's venv, in the project dir (the repo is not on its path)."""
        exe = str(self.venv / "bin" / cmd[0])
        proc = subprocess.run([exe, *cmd[1:]], cwd=self.root, env=self.env(spark_master),
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"
        return proc

    async def publish(self, n: int, seed: int) -> None:
        """Publish ``n`` orders and wait until the work queue has received them all."""
        rng = random.Random(seed)
        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            for _ in range(n):
                region, customer = rng.choice(REGIONS), rng.choice(CUSTOMERS)
                amount = rng.randint(1, 400) * 0.25  # exact in binary: sums compare exactly
                await js.publish(f"orders.{region}.{customer}",
                                 json.dumps({"customer": customer, "amount": amount}).encode())
                self.events.append((region, customer, amount))
            deadline = time.monotonic() + 60
            while (await js.stream_info("orders-totals")).state.last_seq < len(self.events):
                assert time.monotonic() < deadline, "work queue did not receive the orders"
                await asyncio.sleep(0.1)
        finally:
            await nc.close()

    def reference(self, partitions: set[int]) -> pd.DataFrame:
        df = pd.DataFrame(self.events, columns=["region", "customer", "amount"])
        df = df[[partition_for([c], PARTITIONS) in partitions for c in df["customer"]]]
        g = df.groupby("customer", sort=False)
        df = df.assign(total=g["amount"].cumsum(), orders=g.cumcount() + 1)
        return df[["customer", "amount", "total", "orders"]].sort_values(
            ["customer", "orders"], kind="stable").reset_index(drop=True)

    def table(self, partitions: set[int]) -> pd.DataFrame:
        t = DeltaSink(str(self.warehouse / "customer_totals")).read().to_pandas()
        t = t[t["_partition"].isin(partitions)].sort_values(["customer", "_seq"], kind="stable")
        return t[["customer", "amount", "total", "orders"]].reset_index(drop=True)

    def assert_equals_reference(self, partitions: set[int]) -> None:
        got, want = self.table(partitions), self.reference(partitions)
        assert len(want) > 0
        pd.testing.assert_frame_equal(got, want, check_dtype=False)


@pytest.fixture(scope="module")
def project(user_venv: Path, server: NatsServer, tmp_path_factory: pytest.TempPathFactory
            ) -> UserProject:
    root = tmp_path_factory.mktemp("user-project")
    shutil.copy(PROJECT / "definitions.py", root / "definitions.py")
    p = UserProject(root, user_venv, server.url)
    p.home.mkdir()
    (p.home / "dagster.yaml").write_text(DAGSTER_YAML)
    # the user's own cg creates the stream and the group (connection options after the command)
    p.run("cg", "stream", "create", "orders", "--subject", "orders.>", "--server", server.url)
    out = p.run("cg", "elastic", "create", "orders", "totals", "--max-members", "4",
                "--filter", "orders.*.*:2", "--members", "m1", "--server", server.url).stdout
    assert "m1: 0,1,2,3" in out, out
    return p


def _wait_runs(home: Path, n: int, timeout_s: float) -> list[DagsterRun]:
    deadline = time.monotonic() + timeout_s
    with DagsterInstance.from_config(str(home)) as instance:
        while True:
            runs = instance.get_runs()
            if len(runs) >= n and all(r.status in FINISHED for r in runs):
                return list(runs)
            if time.monotonic() > deadline:
                raise AssertionError(f"runs not finished after {timeout_s} s: "
                                     f"{[(r.run_id, r.status) for r in runs]}")
            time.sleep(0.5)  # poll interval (deadline above)


def test_project_is_small_and_public() -> None:
    text = (PROJECT / "definitions.py").read_text()
    assert len(text.splitlines()) <= 40
    imports = [ln for ln in text.splitlines() if ln.startswith(("from cg_pipelines", "import "))]
    assert imports and all("._" not in ln for ln in imports), imports


def test_validate_materialize_and_backfill(project: UserProject) -> None:
    p = project
    p.run("dagster", "definitions", "validate", "-f", "definitions.py")

    asyncio.run(p.publish(300, seed=1))
    p.run("dagster", "asset", "materialize", "-f", "definitions.py", "--select",
          "customer_totals", "--partition", "totals-0")
    p.assert_equals_reference({0})
    assert p.table({1, 2, 3}).empty  # only partition 0 ran

    asyncio.run(p.publish(300, seed=2))
    out = p.run("dagster", "job", "backfill", "-f", "definitions.py", "-j",
                "customer_totals_job", "--all", "true", "--noprompt").stdout  # 300 s: the CLI
    # launches the backfill's runs as subprocesses before it returns (over 120 s at load 11)
    assert "Launched backfill job" in out, out
    runs = [r for r in _wait_runs(p.home, 1 + PARTITIONS, 600) if "dagster/backfill" in r.tags]
    assert len(runs) == PARTITIONS
    assert sorted(r.tags["dagster/partition"] for r in runs) == [
        f"totals-{i}" for i in range(PARTITIONS)]
    assert all(r.status == DagsterRunStatus.SUCCESS for r in runs), runs
    p.assert_equals_reference(set(range(PARTITIONS)))


def test_runs_on_a_standalone_spark_master(project: UserProject) -> None:
    p = project
    asyncio.run(p.publish(200, seed=3))
    with SparkStandaloneCluster(workers=1, log_dir=p.root / "spark-logs") as cluster:
        p.run("dagster", "asset", "materialize", "-f", "definitions.py", "--select",
              "customer_totals", "--partition", "totals-1", spark_master=cluster.master_url,
              timeout=400)
        apps = cluster.applications()
    assert [a["name"] for a in apps] == ["customer_totals"], apps
    p.assert_equals_reference({1})
