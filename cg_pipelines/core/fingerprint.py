"""A code version for a processing step, stable across processes (no I/O).

The backlog sensor stops retrying a partition that keeps failing, and resumes by itself once
different code is loaded: it compares the code version its failed runs were made with to the
one loaded now. :func:`code_version` derives that version from the objects themselves — the
bytecode, constants and names of every function reached from them (closures, defaults,
attributes of objects, items of containers), and the plain values they hold — so editing a
transform, a decoder's fields or a state declaration changes it, while restarting a process
does not (memory addresses, set order under hash randomization and ``id()`` never enter).
"""

from __future__ import annotations

import hashlib
import re
import types
from typing import Any

__all__ = ["code_version"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_MAX_DEPTH = 12


def code_version(*objects: object, length: int = 12) -> str:
    """A hex digest (``length`` characters) of ``objects`` and all code reachable from them.

    Two processes that load the same definitions get the same text; a change of any reached
    function's code or of a held plain value gives another one (up to hash collisions).
    Objects are walked at most 12 levels deep; modules and classes count by name only.
    """
    h = hashlib.sha256()
    seen: set[int] = set()
    for obj in objects:
        _feed(h, obj, 0, seen)
    return h.hexdigest()[:length]


def _feed(h: Any, obj: object, depth: int, seen: set[int]) -> None:
    if depth > _MAX_DEPTH:
        h.update(b"<deep>")
        return
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
        return
    if isinstance(obj, (types.ModuleType, type)):
        h.update(f"<{type(obj).__name__} {getattr(obj, '__qualname__', obj.__name__)}>".encode())
        return
    if id(obj) in seen:
        h.update(b"<cycle>")
        return
    seen.add(id(obj))
    d = depth + 1
    if isinstance(obj, types.CodeType):
        h.update(obj.co_code)
        h.update(repr(obj.co_names).encode())
        for c in obj.co_consts:
            _feed(h, c, d, seen)
        return
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
        h.update(f"<fn {fn.__qualname__}>".encode())
        _feed(h, fn.__code__, d, seen)
        for value in (fn.__defaults__ or ()):
            _feed(h, value, d, seen)
        for cell in fn.__closure__ or ():
            try:
                _feed(h, cell.cell_contents, d, seen)
            except ValueError:  # an empty cell
                h.update(b"<empty>")
        if isinstance(obj, types.MethodType):
            _feed(h, obj.__self__, d, seen)
        return
    if isinstance(obj, (list, tuple)):
        h.update(f"<{type(obj).__name__} {len(obj)}>".encode())
        for item in obj:
            _feed(h, item, d, seen)
        return
    if isinstance(obj, (set, frozenset)):
        # Order-free: each item's own digest, sorted.
        h.update(b"".join(sorted(code_version(i, length=64).encode() for i in obj)))
        return
    if isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            _feed(h, k, d, seen)
            _feed(h, obj[k], d, seen)
        return
    if isinstance(obj, types.BuiltinFunctionType) or callable(obj) and not hasattr(
            obj, "__dict__") and not hasattr(obj, "__slots__"):
        h.update(_ADDRESS.sub("", repr(obj)).encode())
        return
    h.update(f"<obj {type(obj).__module__}.{type(obj).__qualname__}>".encode())
    state = getattr(obj, "__dict__", None)
    if state is None:
        slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
        state = {s: getattr(obj, s) for s in slots if hasattr(obj, s)}
    if not state:
        h.update(_ADDRESS.sub("", repr(obj)).encode())
        return
    for k in sorted(state):
        h.update(f"{k}=".encode())
        _feed(h, state[k], d, seen)
