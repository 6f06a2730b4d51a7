"""The dead-letter stream is bounded by age (``max_age``): created with the default 30 days or
the run's ``EngineOptions.dlq_max_age_s``; an existing stream is brought to the setting."""

from __future__ import annotations

import pytest
from nats.js.api import StreamConfig

from cg_pipelines.engine import EngineOptions
from cg_pipelines.engine.deadletter import DLQ_MAX_AGE_S, ensure_dlq_stream, group_replicas
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import JetStreamError, StreamNotFoundError


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


async def test_dlq_replicas_are_never_guessed_when_the_group_cannot_be_read(
        js, nc, unique_name) -> None:
    """Neither stream exists (both 404): 1. Neither answers (here no responders on a wrong
    API prefix; on a cluster a timeout while a leader is elected): the error is raised, so the
    engine's retry asks again instead of creating an R1 dead-letter stream on an R3 group (the
    loaded cluster CI run that found it: ``{'EngR3-g-dlq': 1} != {'EngR3-g-dlq': 3}``)."""
    api = JetStreamAPI.from_js(js)
    assert await group_replicas(api, unique_name, "g") == 1
    await js.add_stream(StreamConfig(name=unique_name, subjects=[f"{unique_name}.>"]))
    assert await group_replicas(api, unique_name, "g") == 1  # R1 origin on one server
    async with JetStreamAPI(nc, prefix="$JS.nowhere.API", timeout=1) as lost:
        with pytest.raises(JetStreamError) as e:
            await group_replicas(lost, unique_name, "g")
        assert e.value.status != 404
        with pytest.raises(JetStreamError):
            await ensure_dlq_stream(lost, unique_name, "g")
    with pytest.raises(StreamNotFoundError):
        await api.stream_info(f"{unique_name}-g-dlq")  # nothing was created on a guess
