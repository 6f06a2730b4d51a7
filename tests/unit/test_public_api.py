"""The public surface: the top-level names come from one table (each resolves to the object its
defining module holds; ``__all__`` and ``dir()`` are that table), and the contract modules
document every method on the method itself (when the engine calls it) with the sinks
importing nothing of the engine."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import cg_pipelines
from cg_pipelines.engine import processor as processor_contract
from cg_pipelines.sinks import base as sink_contract

PACKAGE = Path(cg_pipelines.__file__).resolve().parent


@pytest.mark.parametrize("name", sorted(cg_pipelines.EXPORTS))
def test_every_exported_name_resolves_to_its_defining_module(name: str) -> None:
    module = cg_pipelines.EXPORTS[name]
    value = getattr(cg_pipelines, name)
    assert value is getattr(importlib.import_module(module), name)
    assert value.__module__ == module, f"{name} is defined in {value.__module__}, not {module}"


def test_all_and_dir_are_the_table() -> None:
    assert cg_pipelines.__all__ == ["__version__", *cg_pipelines.EXPORTS]
    assert set(cg_pipelines.EXPORTS) <= set(dir(cg_pipelines))


@pytest.mark.parametrize("name", ["Field", "engine_options", "nope"])
def test_names_outside_the_table_are_not_attributes(name: str) -> None:
    with pytest.raises(AttributeError, match=name):
        getattr(cg_pipelines, name)


def _protocol_methods() -> list[tuple[str, object]]:
    out = []
    for mod, names in ((sink_contract, ["TableSink", "MaintainedSink"]),
                       (processor_contract, ["Processor"])):
        for cls_name in names:
            cls = getattr(mod, cls_name)
            for attr, member in vars(cls).items():
                if callable(member) and not attr.startswith("_"):
                    out.append((f"{cls_name}.{attr}", member))
    return out


@pytest.mark.parametrize(("name", "method"), _protocol_methods(), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_each_contract_method_documents_when_it_is_called(name: str, method: object) -> None:
    doc = inspect.getdoc(method) or ""
    assert "Called" in doc, f"{name}: {doc[:80]!r}"


def test_the_contract_methods_are_found() -> None:
    names = {n for n, _ in _protocol_methods()}
    assert {"TableSink.watermark", "TableSink.commit", "MaintainedSink.maintain",
            "TableSink.last_rows", "TableSink.replace_partition", "Processor.process",
            "Processor.bind"} <= names


def test_the_sinks_import_nothing_of_the_engine() -> None:
    for path in sorted((PACKAGE / "sinks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("cg_pipelines.engine"), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("cg_pipelines.engine") for a in node.names)
