"""The dead-letter stream is bounded by age (``max_age``): created with the default 30 days or
the run's ``EngineOptions.dlq_max_age_s``; an existing stream is brought to the setting."""

from __future__ import annotations

import pytest
from nats.js.api import StreamConfig

from cg_pipelines.engine import EngineOptions
from cg_pipelines.engine.deadletter import DLQ_MAX_AGE_S, ensure_dlq_stream
from cg_pipelines.jetstream.api import JetStreamAPI


async def test_dlq_stream_has_a_max_age_and_follows_the_setting(js, unique_name) -> None:
    await js.add_stream(StreamConfig(name=unique_name, subjects=[f"{unique_name}.>"]))
    api = JetStreamAPI.from_js(js)
    name = await ensure_dlq_stream(api, unique_name, "g")
    cfg = (await api.stream_info(name))["config"]
    assert cfg["max_age"] == int(DLQ_MAX_AGE_S * 1e9) == 30 * 24 * 3600 * 10**9
    await ensure_dlq_stream(api, unique_name, "g", max_age_s=3600)  # shorter than the window
    cfg = (await api.stream_info(name))["config"]
    assert cfg["max_age"] == 3600 * 10**9 and cfg["duplicate_window"] <= cfg["max_age"]
    await ensure_dlq_stream(api, unique_name, "g", max_age_s=None)
    assert (await api.stream_info(name))["config"]["max_age"] == 0
    with pytest.raises(ValueError, match="dlq_max_age_s"):
        EngineOptions(dlq_max_age_s=0)
