"""The documented examples run as written: every Python block and every ``cg``/``dagster``/
``python`` command of ``docs/getting-started.md`` and of the README's example, in page order,
in a fresh directory, against a real nats-server started for the page.

Rules of the pages (checked here): a Python block whose first line is ``# <name>.py`` (or
``# <name>.py: what it is``) is saved
under that name and must be used by a command of the page (``python <name>.py`` or
``dagster ... -f <name>.py``); any other Python block runs where it stands. In ``bash`` blocks,
``pip install`` lines are the reader's (the test runs in this repo's venv), ``cg dev &`` is the
server the test starts, ``export NATS_URL=...`` is set to it, and the README's repository
commands (``bash scripts/setup.sh ...``) are CI's own.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deltalake import DeltaTable

from cg_pipelines.local.nats_server import NatsServer

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
RUNNABLE = ("cg", "dagster", "python")


def blocks(page: Path) -> list[tuple[str, str]]:
    """The fenced code blocks of a markdown page: ``(language, text)`` in page order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def commands(bash: str) -> Iterator[list[str]]:
    """The commands of a bash block this test runs (see the module docstring)."""
    for line in bash.splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0] not in RUNNABLE:
            assert not words or words[0] in ("pip", "export") or \
                words[:2] == ["bash", "scripts/setup.sh"], f"unexpected command: {line}"
            continue
        if words[:2] == ["cg", "dev"]:
            continue
        yield words


class Page:
    """Runs one page's examples in ``cwd`` against the server at ``url``."""

    def __init__(self, cwd: Path, url: str) -> None:
        self.cwd, self.saved, self.used = cwd, set[str](), set[str]()
        home = cwd / ".dagster"
        home.mkdir()
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        self.env = {**os.environ, "NATS_URL": url, "DAGSTER_HOME": str(home),
                    "PYTHONPATH": str(REPO), "PATH": f"{BIN}:{os.environ['PATH']}"}

    def run(self, words: list[str]) -> str:
        exe = sys.executable if words[0] == "python" else str(BIN / words[0])
        self.used.update(w for w in words[1:] if w in self.saved)
        t0 = time.monotonic()
        proc = subprocess.run([exe, *words[1:]], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=300)
        print(f"{time.monotonic() - t0:6.1f} s  {shlex.join(words)}")
        assert proc.returncode == 0, f"{shlex.join(words)} failed:\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"
        return proc.stdout

    def play(self, page: Path) -> list[str]:
        """Every block of the page in order; the outputs of the commands run."""
        outputs = []
        for i, (lang, text) in enumerate(blocks(page)):
            if lang == "python":
                named = re.match(r"# ([\w.]+\.py)(:|$)", text.splitlines()[0])
                name = named.group(1) if named else None
                (self.cwd / (name or f"block{i}.py")).write_text(text)
                if name:
                    self.saved.add(name)
                else:
                    outputs.append(self.run(["python", f"block{i}.py"]))
            elif lang == "bash":
                outputs.extend(self.run(words) for words in commands(text))
        unused = self.saved - self.used
        assert not unused, f"{page.name}: Python blocks no command runs: {sorted(unused)}"
        return outputs


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh server per page: the pages create stream ``orders`` as a new user would."""
    with NatsServer(tmp_path / "nats", port=0) as srv:
        yield srv


def test_getting_started_runs_as_written(server: NatsServer, tmp_path: Path) -> None:
    page = REPO / "docs" / "getting-started.md"
    langs = [lang for lang, _ in blocks(page)]
    assert langs.count("python") >= 5 and "bash" in langs
    cwd = tmp_path / "user"
    cwd.mkdir()
    out = "".join(Page(cwd, server.url).play(page))
    assert "partition 0:" in out and "the same on Arrow and on Spark" in out, out[-2000:]
    # the pandas transform's running totals, checked against the published orders
    rows = DeltaTable(str(cwd / "warehouse" / "customer_totals")).to_pandas()
    assert set(rows["_partition"]) == {0}
    orders = [(f"c{i % 12:02d}", (i % 7) * 2.5) for i in range(200)]
    for customer, got in rows.groupby("customer"):
        want = [a for c, a in orders if c == customer]
        assert list(got.sort_values("_seq")["total"]) == [sum(want[:k + 1])
                                                          for k in range(len(want))]


def test_readme_example_runs_as_written(server: NatsServer, tmp_path: Path) -> None:
    page = REPO / "README.md"
    cwd = tmp_path / "user"
    cwd.mkdir()
    out = "".join(Page(cwd, server.url).play(page))
    assert "latest_order" in out or "customer" in out, out[-2000:]
    rows = DeltaTable(str(cwd / "warehouse" / "latest_order")).to_pandas()
    assert sorted(rows["customer"]) == [f"c{i}" for i in range(10)]  # one row per customer
    assert sorted(rows["amount"]) == [i * 1.5 for i in range(90, 100)]  # each one's last


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
