"""Every ``raise`` in ``cg_pipelines`` raises a :class:`~cg_pipelines.core.errors.CgError`
subclass, re-raises an exception it caught, or is on the documented allow-list below.

The walk parses each module with :mod:`ast`, finds every ``Raise`` node and resolves what it
raises by importing the module and looking names up (module globals, then imports made inside
functions):

- bare ``raise``, and ``raise name`` inside ``except ... as name``: a re-raise, accepted;
- ``raise Cls(...)`` / ``raise Cls`` / ``raise mod.Cls(...)``: the class itself;
- ``raise make_error(...)`` / ``raise self._error(...)``: the return annotation of the function
  or method (``X | None`` counts as ``X``);
- ``raise name``: the annotation of a parameter ``name``, else the value of the one assignment
  to ``name`` in the function (resolved by the same rules);
- ``raise obj.attr``: the annotated type (dataclass field, property) of ``attr`` on ``obj``'s
  annotated class.

Anything else is an offender unless :data:`ALLOWED_CLASSES` or :data:`ALLOWED_EXPRESSIONS`
lists it, with the reason.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cg_pipelines.core.errors import CgError

PACKAGE = Path(__file__).resolve().parents[2] / "cg_pipelines"

#: Foreign exception classes the library raises on purpose, because a protocol outside the
#: library requires exactly that class: ``(module, qualified name)`` -> ``(where, reason)``;
#: ``where`` is the path prefix (inside the package) they may be raised in, "" for anywhere.
ALLOWED_CLASSES: dict[tuple[str, str], tuple[str, str]] = {
    ("builtins", "NotImplementedError"):
        ("", "the body of a method each subclass must override"),
    ("builtins", "AttributeError"):
        ("", "a module-level __getattr__ must raise AttributeError (PEP 562)"),
    ("builtins", "KeyboardInterrupt"):
        ("cli/", "cg members: a second Ctrl-C gives up the clean stop the way Python's own "
                 "Ctrl-C does"),
    ("builtins", "SystemExit"): ("cli/", "a CLI command's exit status"),
    ("asyncio.exceptions", "CancelledError"):
        ("airflow/", "the backlog trigger ends as the triggerer cancels it when a NATS error "
                     "(a request timeout) took the cancellation's place on the way out"),
    ("dagster._core.definitions.events", "Failure"):
        ("dagster/", "Dagster shows a step's Failure (description, metadata) in the UI; only "
                     "Failure does"),
    ("airflow.sdk.exceptions", "AirflowException"):
        ("airflow/", "a failed Airflow task: the task log and the UI show its text (the cause "
                     "first); Airflow retries it as the task's retries say"),
    ("airflow.sdk.exceptions", "AirflowFailException"):
        ("airflow/", "Airflow fails the task without retrying only on this class (a wrong "
                     "partition key, an owner served elsewhere)"),
    ("airflow.sdk.exceptions", "AirflowSkipException"):
        ("airflow/", "Airflow marks a task skipped (no asset event) only on this class"),
    ("pyiceberg.exceptions", "CommitFailedException"):
        ("sinks/", "pyiceberg's own commit-conflict signal, which its callers and the fence "
                   "expect"),
    ("pyiceberg.exceptions", "NoSuchTableError"):
        ("sinks/", "pyiceberg's 'no table' signal, raised where pyiceberg would raise it"),
    ("_internal", "TableNotFoundError"):  # deltalake.exceptions.TableNotFoundError (Rust)
        ("sinks/", "delta-rs' 'no table' signal, raised where delta-rs would raise it; "
                   "callers (and the library's own readers) catch TableNotFoundError"),
    ("nats.errors", "ConnectionClosedError"):
        ("jetstream/rangeparser.py", "the bulk range reader mirrors nats-py: a read on a "
         "closed connection raises nats-py's own error, which callers already handle"),
    ("subprocess", "TimeoutExpired"):
        ("spark/classarchive.py", "build_class_archive mirrors subprocess.run(timeout=...): "
         "the same exception whether the child or its JVM overran"),
}

#: Raises of values the walk cannot type statically: ``(module path, expression)`` -> reason.
ALLOWED_EXPRESSIONS: dict[tuple[str, str], str] = {
    ("engine/rebuild.py", "item"):
        "re-raises, in the reading thread, the exception the writer thread caught",
    ("jetstream/connect.py", "f.error"):
        "the typed NatsConnectError that error_cb wrapped in _Fatal to stop nats-py's connect "
        "loop",
    ("jetstream/connect.py", "_Fatal"):
        "private signal that stops nats-py's connect loop; connect() catches it in the same "
        "module and raises the NatsConnectError it carries",
    ("sinks/storage.py", "clean"):
        "a caught exception re-raised as a copy of itself (same type) with secrets masked",
}


@dataclass
class Raise:
    path: str  # relative to the package
    line: int
    expr: str  # what is raised, without the call's arguments
    verdict: str  # "ok", "allowed" or why it is an offender
    foreign: tuple[tuple[str, str], ...] = ()  # the ALLOWED_CLASSES keys it raises


def _modules() -> list[Path]:
    """The package's modules, except ``__main__`` ones (importing those runs them)."""
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _flatten(hint: Any) -> list[Any]:
    """The classes in a type hint (``X | None`` -> ``[X]``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(hint) for c in _flatten(arg)]
    if hint is type(None):
        return []
    return [hint]


def _return_types(fn: Any) -> list[Any] | None:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        return None
    return _flatten(hints["return"]) if "return" in hints else None


def _attribute_hint(owner: Any, attr: str) -> Any:
    """The annotation of ``owner.attr``: a class-level annotation (dataclass field), else an
    annotated ``self.attr: T = ...`` in ``owner.__init__``; None when there is none."""
    try:
        hints = typing.get_type_hints(owner)
    except Exception:
        hints = {}
    if attr in hints:
        return hints[attr]
    init = inspect.getattr_static(owner, "__init__", None)
    if not inspect.isfunction(init):
        return None
    tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    for node in ast.walk(tree):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute)
                and isinstance(node.target.value, ast.Name) and node.target.value.id == "self"
                and node.target.attr == attr):
            module = importlib.import_module(owner.__module__)
            try:
                return eval(ast.unparse(node.annotation), vars(module))
            except Exception:
                return None
    return None


class _Resolver:
    """Resolves the raised expressions of one module."""

    def __init__(self, path: Path, module: str, rel: str) -> None:
        self.path = path
        self.rel = rel
        self.module = importlib.import_module(module)
        self.tree = ast.parse(path.read_text(), str(path))
        self.parents: dict[ast.AST, ast.AST] = {}
        self.raises: list[ast.Raise] = []
        imports: list[ast.ImportFrom] = []
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.Raise):
                self.raises.append(node)
            elif isinstance(node, ast.ImportFrom):
                imports.append(node)
        # Names imported anywhere in the module (functions import lazily): name -> object.
        self.imported: dict[str, Any] = {}
        for node in imports:
            if node.module and node.level == 0:
                for alias in node.names:
                    try:
                        mod = importlib.import_module(node.module)
                        self.imported[alias.asname or alias.name] = getattr(mod, alias.name)
                    except (ImportError, AttributeError):
                        pass

    def _ancestors(self, node: ast.AST) -> list[ast.AST]:
        out = []
        while node in self.parents:
            node = self.parents[node]
            out.append(node)
        return out

    def _function(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        for a in self._ancestors(node):
            if isinstance(a, ast.FunctionDef | ast.AsyncFunctionDef):
                return a
        return None

    def _class_of(self, node: ast.AST) -> Any:
        """The runtime class whose method holds ``node`` (for ``self``)."""
        names = [a.name for a in reversed(self._ancestors(node)) if isinstance(a, ast.ClassDef)]
        obj: Any = self.module
        for n in names:
            obj = getattr(obj, n, None)
        return obj if inspect.isclass(obj) else None

    def _global(self, name: str) -> Any:
        if hasattr(self.module, name):
            return getattr(self.module, name)
        if name in self.imported:
            return self.imported[name]
        return getattr(builtins, name, None)

    def static(self, expr: ast.expr) -> Any:
        """The object a dotted name names (a class, function or module), or None."""
        if isinstance(expr, ast.Name):
            return self._global(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.static(expr.value)
            return getattr(base, expr.attr, None) if base is not None else None
        return None

    def types(self, expr: ast.expr, at: ast.AST) -> list[Any] | None:
        """The classes the value of ``expr`` (evaluated at ``at``) may have, or None."""
        if isinstance(expr, ast.Call):
            fn = self.static(expr.func)
            if fn is None and isinstance(expr.func, ast.Attribute):
                owners = self.types(expr.func.value, at) or []
                fns = [getattr(o, expr.func.attr, None) for o in owners]
                fn = fns[0] if len(fns) == 1 else None
            if inspect.isclass(fn):
                return [fn]
            return _return_types(fn) if callable(fn) else None
        if isinstance(expr, ast.Name):
            if expr.id == "self":
                cls = self._class_of(at)
                return [cls] if cls is not None else None
            fn = self._function(at)
            if fn is not None:
                for arg in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs:
                    if arg.arg == expr.id and arg.annotation is not None:
                        hint = self._eval_annotation(arg.annotation)
                        return _flatten(hint) if hint is not None else None
                assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)
                           and any(isinstance(t, ast.Name) and t.id == expr.id
                                   for t in n.targets)]
                if len(assigns) == 1:
                    return self.types(assigns[0].value, assigns[0])
                if assigns:
                    return None
            obj = self._global(expr.id)
            return [obj] if inspect.isclass(obj) else None
        if isinstance(expr, ast.Attribute):
            owners = self.types(expr.value, at)
            if owners is None:
                obj = self.static(expr)
                return [obj] if inspect.isclass(obj) else None
            found: list[Any] = []
            for owner in owners:
                attr = inspect.getattr_static(owner, expr.attr, None)
                if isinstance(attr, property) and attr.fget is not None:
                    got = _return_types(attr.fget)
                else:
                    hint = _attribute_hint(owner, expr.attr)
                    got = _flatten(hint) if hint is not None else None
                if got is None:
                    return None
                found += got
            return found
        return None

    def _eval_annotation(self, node: ast.expr) -> Any:
        try:
            return eval(ast.unparse(node), vars(self.module) | self.imported)
        except Exception:
            return None

    def _caught_as(self, node: ast.Raise, name: str) -> bool:
        """``node`` is inside ``except ... as name``."""
        return any(isinstance(a, ast.ExceptHandler) and a.name == name
                   for a in self._ancestors(node))

    def verdict(self, node: ast.Raise) -> Raise:
        exc = node.exc
        if exc is None:
            return Raise(self.rel, node.lineno, "raise", "ok")
        target = exc.func if isinstance(exc, ast.Call) else exc
        text = ast.unparse(target)
        if isinstance(exc, ast.Name) and self._caught_as(node, exc.id):
            return Raise(self.rel, node.lineno, text, "ok")
        if (self.rel, text) in ALLOWED_EXPRESSIONS:
            return Raise(self.rel, node.lineno, text, "allowed")
        classes = self.types(exc, node)
        if not classes:
            return Raise(self.rel, node.lineno, text, "cannot tell what it raises")
        bad = []
        for cls in classes:
            if not (inspect.isclass(cls) and issubclass(cls, BaseException)):
                bad.append(f"{cls!r} is not an exception class")
            elif issubclass(cls, CgError):
                continue
            elif not self.rel.startswith(
                    ALLOWED_CLASSES.get((cls.__module__, cls.__qualname__), ("//", ""))[0]):
                bad.append(f"{cls.__module__}.{cls.__qualname__} is not a CgError")
        if bad:
            return Raise(self.rel, node.lineno, text, "; ".join(bad))
        foreign = tuple((c.__module__, c.__qualname__) for c in classes
                        if not issubclass(c, CgError))
        return Raise(self.rel, node.lineno, text, "allowed" if foreign else "ok", foreign)


@functools.cache
def walk() -> tuple[Raise, ...]:
    """Every raise in the package, with its verdict."""
    out: list[Raise] = []
    for path in _modules():
        r = _Resolver(path, _module_name(path), path.relative_to(PACKAGE).as_posix())
        out += [r.verdict(n) for n in r.raises]
    return tuple(out)


def test_every_raise_is_a_cg_error_a_re_raise_or_allowed() -> None:
    found = walk()
    assert len(found) > 300  # the walk really found the package's raises
    offenders = [f"{r.path}:{r.line}: raise {r.expr}: {r.verdict}" for r in found
                 if r.verdict not in ("ok", "allowed")]
    assert not offenders, f"{len(offenders)} raise(s):\n" + "\n".join(offenders)


def test_main_modules_raise_nothing() -> None:
    """The walk imports each module, so it skips ``__main__`` ones: they must not raise."""
    mains = sorted(PACKAGE.rglob("__main__.py"))
    assert mains  # cg_pipelines/cli/__main__.py
    for path in mains:
        tree = ast.parse(path.read_text(), str(path))
        assert not any(isinstance(n, ast.Raise) for n in ast.walk(tree)), path


def test_every_allow_list_entry_is_still_used() -> None:
    found = walk()
    used = {(r.path, r.expr) for r in found if r.verdict == "allowed"}
    stale = [k for k in ALLOWED_EXPRESSIONS if k not in used]
    used_classes = {k for r in found for k in r.foreign}
    stale += [k for k in ALLOWED_CLASSES if k not in used_classes]
    assert not stale, f"allow-list entries that match no raise: {stale}"


PROBE = """
from cg_pipelines.core.errors import CgError, UsageError
from cg_pipelines.jetstream.errors import JetStreamError, error_from_status


class Holder:
    error: JetStreamError | None = None


def make() -> UsageError:
    return UsageError("x")


def plain(x: int) -> None:
    raise ValueError("a bare ValueError")                      # line 15: offender


def helpers(h: Holder, e: BaseException) -> None:
    raise make()                                                # line 19: ok (annotation)
    raise error_from_status(423)                                # line 20: ok (annotation)
    raise h.error                                               # line 21: ok (field type)
    raise e                                                     # line 22: typed BaseException


def reraise() -> None:
    try:
        pass
    except OSError as caught:
        raise caught                                            # line 29: ok (re-raise)
    except KeyError:
        raise                                                   # line 31: ok (bare)
    err = KeyError("k")
    raise err                                                   # line 33: offender (assigned)


def unknown(x: object) -> None:
    raise x.whatever                                            # line 37: cannot tell
"""


def test_the_resolver_accepts_cg_errors_and_re_raises_and_flags_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resolution rules on a module with one raise of each kind (a resolver that accepts
    everything, or nothing, fails here)."""
    path = tmp_path / "raise_walk_probe.py"
    path.write_text(PROBE.lstrip("\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    r = _Resolver(path, "raise_walk_probe", "probe.py")
    got = {n.lineno: r.verdict(n).verdict for n in r.raises}
    assert got == {
        14: "builtins.ValueError is not a CgError",
        18: "ok", 19: "ok", 20: "ok",
        21: "builtins.BaseException is not a CgError",
        28: "ok", 30: "ok",
        32: "builtins.KeyError is not a CgError",
        36: "cannot tell what it raises",
    }
