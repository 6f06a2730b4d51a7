"""Each kind of deliberate error raises its ``CgError`` subclass and keeps the standard base it
had before the family existed (``except ValueError`` callers keep working)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable

import pyarrow as pa
import pytest

import cg_pipelines
from cg_pipelines.core import errors
from cg_pipelines.core.contract import OutputContractError, check_output
from cg_pipelines.core.coverage import decode_seqs
from cg_pipelines.core.errors import (
    CgError,
    ColumnNotFoundError,
    ConfigError,
    ContractError,
    DecodeError,
    StateError,
    UsageError,
)
from cg_pipelines.core.state import KeyedState, last_per_key
from cg_pipelines.core.subjects import partition_for, strip_partition
from cg_pipelines.core.triggers import MembershipCursor, RetryPolicy, decode_cursor
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.jetstream.api_wire import parse_rfc3339_ns, seconds_to_ns
from cg_pipelines.jetstream.members import MemberConfig
from cg_pipelines.sinks.maintenance import Maintenance
from cg_pipelines.testing.s3 import MotoS3Server

CASES: list[tuple[str, Callable[[], object], type[CgError], type[Exception], str]] = [
    # (what, call, class, standard base, start of the message)
    ("EngineOptions", lambda: EngineOptions(dlq_max_age_s=0), ConfigError, ValueError,
     "dlq_max_age_s: must be > 0"),
    ("EngineOptions policy", lambda: EngineOptions(dead_letter_policy="skip"),  # type: ignore[arg-type]
     ConfigError, ValueError, "dead_letter_policy: must be 'dlq' or 'halt'"),
    ("MemberConfig", lambda: MemberConfig(max_ack_pending=0), ConfigError, ValueError,
     "max_ack_pending: must be >= 1"),
    ("Maintenance", lambda: Maintenance(compact_min_files=1), ConfigError, ValueError,
     "compact_min_files: must be >= 2"),
    ("RetryPolicy", lambda: RetryPolicy(max_failures=0), ConfigError, ValueError,
     "max_failures: must be >= 1"),
    ("partition_for", lambda: partition_for(["a"], 0), UsageError, ValueError,
     "number of partitions must be >= 1"),
    ("Merge", lambda: Merge(key=""), UsageError, ValueError, "Merge: key must be"),
    ("KeyedState", lambda: KeyedState(key="k", order_by="_seq", columns=("k",)), UsageError,
     ValueError, "KeyedState: the key 'k'"),
    ("seconds_to_ns", lambda: seconds_to_ns(-1.0), UsageError, ValueError,
     "duration must be >= 0"),
    ("decode_seqs", lambda: decode_seqs("zz"), DecodeError, ValueError,
     "coverage text must start with"),
    ("membership cursor", lambda: decode_cursor("{", MembershipCursor), DecodeError, ValueError,
     "corrupt membership cursor"),
    ("strip_partition", lambda: strip_partition("x.y"), DecodeError, ValueError,
     "subject 'x.y' does not start"),
    ("parse_rfc3339_ns", lambda: parse_rfc3339_ns("yesterday"), DecodeError, ValueError,
     "not an RFC 3339 time stamp"),
    ("last_per_key", lambda: last_per_key(pa.table({"k": [1]}), "k", "_seq"),
     ColumnNotFoundError, KeyError, "\"column '_seq' not in"),
    ("Merge.check", lambda: Merge(key="k").check(pa.table({"k": [None, 1], "_seq": [1, 2]})),
     ContractError, ValueError, "merge key column 'k' holds 1 null value(s)"),
    ("check_output", lambda: check_output(pa.schema([("_seq", pa.string())])),
     OutputContractError, ValueError, ""),
    ("MotoS3Server", lambda: MotoS3Server().endpoint_url, StateError, RuntimeError,
     "MotoS3Server not started"),
]


@pytest.mark.parametrize(("what", "call", "cls", "base", "message"), CASES,
                         ids=[c[0] for c in CASES])
def test_each_kind_of_error_has_its_class_and_keeps_its_base(
        what: str, call: Callable[[], object], cls: type[CgError], base: type[Exception],
        message: str) -> None:
    with pytest.raises(cls) as raised:
        call()
    assert isinstance(raised.value, base), f"{what}: {type(raised.value).__mro__}"
    assert str(raised.value).startswith(message), str(raised.value)


def test_output_contract_errors_are_contract_errors() -> None:
    assert issubclass(OutputContractError, ContractError)
    assert issubclass(OutputContractError, ValueError)


def test_the_family_list_names_every_error_class_of_the_package() -> None:
    """``cg_pipelines.core.errors``' docstring is the one table of the family: a new error
    class must be added to it."""
    doc = errors.__doc__ or ""
    defined = set()
    for mod in pkgutil.walk_packages(cg_pipelines.__path__, "cg_pipelines."):
        if mod.name.endswith("__main__"):
            continue
        module = importlib.import_module(mod.name)
        defined |= {name for name, obj in vars(module).items()
                    if inspect.isclass(obj) and issubclass(obj, CgError)
                    and obj.__module__ == module.__name__ and not name.startswith("_")}
    assert len(defined) > 30, defined  # the walk found them
    missing = sorted(n for n in defined - {"CgError"} if not re.search(rf"\b{n}`", doc))
    assert not missing, f"not in the family list of cg_pipelines.core.errors: {missing}"
