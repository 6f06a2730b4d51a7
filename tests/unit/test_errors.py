"""Every exception the library defines derives from :class:`cg_pipelines.core.errors.CgError`
(one ``except`` catches them all) and keeps a standard base where it had one."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import cg_pipelines
from cg_pipelines.core.errors import CgError, ConfigError
from cg_pipelines.jetstream.errors import StreamNotFoundError


def _library_exceptions() -> list[type[BaseException]]:
    found = []
    for mod in pkgutil.walk_packages(cg_pipelines.__path__, "cg_pipelines."):
        if mod.name.endswith("__main__"):
            continue
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__ and not name.startswith("_")):
                found.append(obj)
    return found


def test_every_library_exception_is_a_cg_error() -> None:
    found = _library_exceptions()
    assert len(found) >= 25, [c.__name__ for c in found]  # the walk really found them
    assert [c.__qualname__ for c in found if not issubclass(c, CgError)] == []


def test_standard_bases_are_kept() -> None:
    assert issubclass(ConfigError, ValueError)  # bad input is still a ValueError
    err = StreamNotFoundError(404, 10059, "stream not found")
    assert isinstance(err, CgError)
