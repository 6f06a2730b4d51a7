"""The docs site builds with ``--strict`` (as ``.ci/run`` does) and renders what it promises:
the API reference from the docstrings (Sphinx roles shown as code), the ``cg`` reference from
the click commands, and every page of the nav."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _hook() -> ModuleType:
    """The MkDocs hook module, loaded from its file as MkDocs does."""
    spec = importlib.util.spec_from_file_location("sphinx_roles",
                                                  REPO / "docs" / "hooks" / "sphinx_roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_strict_and_renders_the_references(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict",
                           "--site-dir", str(site)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("dagster.component.ConsumerGroupAssetComponent",
                 "dagster.resources.PartitionRunsResource", "core.state.KeyedState",
                 "engine.runner.run_partition", "spark.processor.SparkProcessor"):
        assert f'id="cg_pipelines.{name}"' in api, name
    assert ":class:" not in api and "~cg_pipelines" not in api
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("cg elastic create", "cg backlog", "cg halt skip", "cg dev"):
        assert command in cli, command
    nav_pages = re.findall(r":\s*([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    assert len(nav_pages) >= 30
    for page in nav_pages:  # index.md -> index.html, a/b.md -> a/b/index.html
        assert (site / page.removesuffix(".md").removesuffix("index") / "index.html").exists(), \
            page


@pytest.mark.parametrize(("html", "want"), [
    ("see :class:<code>~cg_pipelines.spark.SparkProcessor</code>.",
     "see <code>SparkProcessor</code>."),
    (":func:<code>cg_pipelines.engine.run_partition</code>",
     "<code>cg_pipelines.engine.run_partition</code>"),
    ("<p>class:<code>~a.b.RunResult</code> with", "<p><code>RunResult</code> with"),
    ("a class: <code>x</code> stays", "a class: <code>x</code> stays"),
])
def test_sphinx_roles_become_code(html: str, want: str) -> None:
    assert _hook().on_page_content(html) == want
