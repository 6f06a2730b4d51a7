"""The engine's shape: no module of ``cg_pipelines.engine`` is over 600 lines, and none imports
a ``_private`` name from another module of ``cg_pipelines`` (a module's private helpers stay
in it; what another module needs is public, with a docstring).

The private-import rule is checked for the engine package only for now. Elsewhere in the
package the same scan finds (information, not a failure; the jetstream package is restructured
separately): ``jetstream/publish.py`` imports ``_conn`` from ``jetstream/rangeread.py``. Print
the current list with ``pytest tests/unit/test_engine_layout.py -k elsewhere -s``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cg_pipelines"
ENGINE = PACKAGE / "engine"
MAX_LINES = 600


def _engine_modules() -> list[Path]:
    return sorted(ENGINE.rglob("*.py"))


def _private_imports(path: Path, package: Path = PACKAGE) -> list[str]:
    """``module:name`` for each ``_private`` name ``path`` (a file under ``package``) imports
    from another module of ``cg_pipelines`` (absolute or relative imports; dunder names are
    not private), and each ``_private`` module it imports from."""
    tree = ast.parse(path.read_text(), str(path))
    here = ".".join(path.relative_to(package.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = here.split(".")[: -node.level]
            module = ".".join([*base, node.module] if node.module else base)
        else:
            module = node.module or ""
        if module != "cg_pipelines" and not module.startswith("cg_pipelines."):
            continue
        for alias in node.names:
            name = alias.name
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                out.append(f"{module}:{name}")
        if any(part.startswith("_") and not part.startswith("__")
               for part in module.split(".")):
            out.append(module)
    return out


def test_there_are_engine_modules_to_check() -> None:
    assert len(_engine_modules()) >= 10


@pytest.mark.parametrize("path", _engine_modules(), ids=lambda p: p.name)
def test_engine_module_is_at_most_600_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines (> {MAX_LINES})"


@pytest.mark.parametrize("path", _engine_modules(), ids=lambda p: p.name)
def test_engine_module_imports_no_private_name(path: Path) -> None:
    assert _private_imports(path) == [], (
        f"{path.relative_to(PACKAGE)} imports private names {_private_imports(path)}")


def test_the_scan_finds_a_private_import(tmp_path: Path) -> None:
    # the checker itself: a private name, from an absolute and from a relative import
    probe = tmp_path / "cg_pipelines" / "engine" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from cg_pipelines.engine.runner import _Hidden\n"
                     "from .model import _also_hidden, __all__\n"
                     "from collections import _private_elsewhere\n")
    assert _private_imports(probe, tmp_path / "cg_pipelines") == [
        "cg_pipelines.engine.runner:_Hidden", "cg_pipelines.engine.model:_also_hidden"]


def test_private_imports_elsewhere_in_the_package_are_listed() -> None:
    # Information only (see the module docstring): not a failure while jetstream/ is redone.
    found = {str(p.relative_to(PACKAGE)): _private_imports(p)
             for p in sorted(PACKAGE.rglob("*.py")) if not p.is_relative_to(ENGINE)}
    for path, names in found.items():
        if names:
            print(f"private import (not yet checked): {path}: {', '.join(names)}")
