"""The pyiceberg row filters the Iceberg sink builds, typed in one place.

pyiceberg 0.12's predicates (``EqualTo``, ``In``) are pydantic models with their own
``__init__(term, literal)`` / ``__init__(term, literals)``, taken positionally at run time; type
checkers read the models' fields instead (``term=``, ``value=`` / ``values=``) and refuse the
positional form the pyiceberg docs show (mypy with pydantic's plugin: ``call-arg``; a warm
mypy cache may add a note on the models' ``__init__``, not an error). The constructors here call
the documented form and say what they return.
"""

from __future__ import annotations

from collections.abc import Iterable

from pyiceberg.expressions import BooleanExpression, EqualTo, In

__all__ = ["equal_to", "is_in"]


def equal_to(column: str, value: object) -> BooleanExpression:
    """``column == value`` (an unbound ``EqualTo``)."""
    return EqualTo(column, value)  # type: ignore[call-arg]  # see the module docstring


def is_in(column: str, values: Iterable[object]) -> BooleanExpression:
    """``column IN values`` (an unbound ``In``; pyiceberg rewrites one value as ``EqualTo``
    and none as ``AlwaysFalse``)."""
    return In(column, list(values))  # type: ignore[call-arg]  # see the module docstring
