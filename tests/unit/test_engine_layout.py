"""The package's shape: no module of ``cg_pipelines`` is over 600 lines, and none imports a
``_private`` name from another module of ``cg_pipelines`` (a module's private helpers stay in
it; what another module needs is public, with a docstring).

Both rules are checked for every module of ``cg_pipelines``. A subpackage named in
:data:`NOT_YET_CHECKED` (none now) would be left out, the same scan only printing what it finds
there: ``pytest tests/unit/test_engine_layout.py -k elsewhere -s``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cg_pipelines"
ENGINE = PACKAGE / "engine"
MAX_LINES = 600
#: Subpackages of ``cg_pipelines`` not (yet) held to the rules; the scan lists their findings.
NOT_YET_CHECKED: tuple[str, ...] = ()


def _unchecked(path: Path) -> bool:
    return any(path.is_relative_to(PACKAGE / name) for name in NOT_YET_CHECKED)


def _engine_modules() -> list[Path]:
    return sorted(ENGINE.rglob("*.py"))


def _checked_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not _unchecked(p))


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


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


def test_engine_jetstream_and_sinks_are_checked() -> None:
    checked = {_rel(p).split("/")[0] for p in _checked_modules()}
    assert {"core", "engine", "jetstream", "sinks"} <= checked
    assert len([p for p in _checked_modules() if p.parent.name == "jetstream"]) >= 15


@pytest.mark.parametrize("path", _checked_modules(), ids=_rel)
def test_module_is_at_most_600_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{_rel(path)} has {lines} lines (> {MAX_LINES})"


@pytest.mark.parametrize("path", _checked_modules(), ids=_rel)
def test_module_imports_no_private_name(path: Path) -> None:
    assert _private_imports(path) == [], (
        f"{_rel(path)} imports private names {_private_imports(path)}")


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
    # Information only (see the module docstring): the packages in NOT_YET_CHECKED.
    for path in sorted(PACKAGE.rglob("*.py")):
        if not _unchecked(path):
            continue
        names = _private_imports(path)
        if names:
            print(f"private import (not yet checked): {_rel(path)}: {', '.join(names)}")
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            print(f"long module (not yet checked): {_rel(path)}: {lines} lines")
