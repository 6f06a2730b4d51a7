"""partition_for equals the server's own subject-transform partitioning (FNV-1a, mod N)."""

from __future__ import annotations

import asyncio
import random
import string

from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_of_subject, strip_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI

N_SUBJECTS = 10_000
ALPHABET = string.ascii_letters + string.digits + "-_"


def _token(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 12)))


async def _wait_count(api: JetStreamAPI, stream: str, n: int) -> None:
    for _ in range(300):
        info = await api.stream_info(stream)
        if info["state"]["messages"] >= n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{stream} has {info['state']['messages']} of {n} messages")


async def test_partition_for_matches_server_transform(js, unique_name, report) -> None:
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    n = 7
    await admin.create_elastic(js, stream, "wc", ElasticConfig(
        n, (PartitioningFilter(f"{stream}.*.*", (2, 1)),)))
    await admin.create_elastic(js, stream, "whole", ElasticConfig(n))
    rng = random.Random(20261121)
    subjects = {f"{stream}.{_token(rng)}.{_token(rng)}" for _ in range(N_SUBJECTS)}
    assert len(subjects) >= N_SUBJECTS * 0.99
    acks = [await js.publish_async(s, b"") for s in subjects]
    await asyncio.gather(*acks)
    api = JetStreamAPI.from_js(js)
    mismatches = 0
    for group, flt, wcs in (("wc", f"{stream}.*.*", (2, 1)), ("whole", ">", ())):
        wq = f"{stream}-{group}"
        await _wait_count(api, wq, len(subjects))
        per_subject = await api.stream_info(wq, subjects_filter=">")
        seen = per_subject["state"]["subjects"]
        assert len(seen) == len(subjects)
        for wq_subject in seen:
            p, original = strip_partition(wq_subject)
            if partition_of_subject(original, flt, wcs, n) != p:
                mismatches += 1
    assert mismatches == 0
    report.append(f"partition hash: {2 * len(subjects)} server-transformed subjects, "
                  f"{mismatches} mismatches with partition_for")
