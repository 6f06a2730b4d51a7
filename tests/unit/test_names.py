"""One name per thing: the wire names the library shares across layers are each written once
(issue 33), and imported everywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cg_pipelines.core.config import PRIORITY_GROUP, dlq_stream_name, work_queue_stream_name
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.record import SEQ_COLUMN
from cg_pipelines.engine.options import EngineOptions

PACKAGE = Path(__file__).resolve().parents[2] / "cg_pipelines"


def _string_parts(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every string constant of a module, f-string pieces included."""
    tree = ast.parse(path.read_text(), str(path))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _writers(match: str, *, suffix: bool = False) -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _string_parts(path):
            if (text.endswith(match) if suffix else text == match):
                out.append(f"{path.relative_to(PACKAGE)}:{line}")
    return out


def test_the_priority_group_name_is_written_once() -> None:
    assert PRIORITY_GROUP == "PCG"  # the reference's (orbit.go pcgroups) wire name
    writers = _writers("PCG")
    assert len(writers) == 1 and writers[0].startswith("core/config.py:"), writers


def test_the_dead_letter_stream_name_is_built_once() -> None:
    assert dlq_stream_name("orders", "bycust") == "orders-bycust-dlq"
    assert dlq_stream_name("s", "g").startswith(work_queue_stream_name("s", "g"))
    writers = _writers("-dlq", suffix=True)
    assert len(writers) == 1 and writers[0].startswith("core/config.py:"), writers


def test_the_origin_sequence_column_is_named_once() -> None:
    # the output column of each row's origin sequence: defaults of KeyedState, Append/Merge,
    # the Spark processor, the reconcile check and the Component all use the one constant
    assert SEQ_COLUMN == "_seq"
    writers = _writers("_seq")
    assert len(writers) == 1 and writers[0].startswith("core/record.py:"), writers


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"batch_max_msgs": 0}, "batch_max_msgs"),
    ({"read_chunk": 0}, "read_chunk"),
    ({"timeout_s": 0.0}, "timeout_s"),
    ({"nats_retry_max_s": -1.0}, "nats_retry_max_s"),
    ({"nats_retry_backoff_s": 4.0}, "nats_retry_backoff_s"),
    ({"executor_read_min_msgs": 0}, "executor_read_min_msgs"),
    ({"dlq_max_age_s": 0.0}, "dlq_max_age_s"),
    ({"settle_interval_s": -1.0}, "settle_interval_s"),
    ({"dead_letter_policy": "drop"}, "dead_letter_policy"),
])
def test_engine_options_out_of_range_raise_config_error_naming_the_field(
        kwargs: dict[str, object], field: str) -> None:
    # ConfigError, as ConsumerGroupAsset raises (it is also a ValueError)
    with pytest.raises(ConfigError) as e:
        EngineOptions(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")
