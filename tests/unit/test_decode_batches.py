"""``decode_batches``, ``prepare_batches`` and ``ArrowProcessor.process_partitions``
(``engine/processing.py``):
several partitions' batches decoded in ONE call give exactly what one ``decode_batch`` (one
``process``) per batch gives: the same rows, the same dead letters on the same batch, with
malformed payloads, a validation rule and empty batches among them."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.core.state import KeyedState
from cg_pipelines.engine.processing import (
    ArrowProcessor,
    decode_batch,
    decode_batches,
    prepare_batches,
)
from cg_pipelines.engine.processor import BatchContext

DECODER = JsonDecoder([JsonField("key", "string", nullable=False),
                       JsonField("v", "int", nullable=False)])


def _negative(table: pa.Table) -> list[tuple[int, str]]:
    return [(i, "v < 0") for i, v in enumerate(table["v"].to_pylist()) if v < 0]


def _batch(rnd: random.Random, first_seq: int, n: int, p: int) -> pa.Table:
    data: list[bytes] = []
    for _ in range(n):
        roll = rnd.random()
        if roll < 0.1:
            data.append(b"{not json")
        elif roll < 0.15:
            data.append(json.dumps({"key": "k"}).encode())  # a required field missing
        else:
            data.append(json.dumps({"key": f"k{rnd.randrange(9)}",
                                    "v": rnd.randrange(-3, 50)}).encode())
    seqs = [first_seq + 3 * i for i in range(n)]
    return pa.table({
        "seq": pa.array(seqs, pa.int64()),
        "subject": [f"s.k{i}" for i in range(n)],
        "time": pa.array([10**18 + s for s in seqs], pa.int64()).cast(
            pa.timestamp("ns", tz="UTC")),
        "headers": pa.array([None] * n, pa.string()),
        "data": data,
        "origin_seq": pa.array([1000 * p + s for s in seqs], pa.int64()),
    }).cast(RECORD_SCHEMA)


@pytest.mark.parametrize("seed", range(6))
def test_one_decode_of_all_batches_equals_one_per_batch(seed: int) -> None:
    rnd = random.Random(seed)
    sizes = [rnd.choice([0, 1, 7, 40, 200]) for _ in range(rnd.randrange(2, 7))]
    batches = [_batch(rnd, 1 + i, n, i) for i, n in enumerate(sizes)]
    got = decode_batches(batches, DECODER, _negative)
    want = [decode_batch(b, DECODER, _negative) for b in batches]
    assert len(got) == len(want)
    for (table, dead), (w_table, w_dead) in zip(got, want, strict=True):
        assert table.equals(w_table)
        assert dead == w_dead
    # every message of every batch is a row or a dead letter of its own batch
    for b, (table, dead) in zip(batches, got, strict=True):
        assert table.num_rows + len(dead) == b.num_rows
        assert {d.seq for d in dead} <= set(b["seq"].to_pylist())


def test_process_partitions_gives_each_partition_what_process_gives() -> None:
    calls: list[int] = []

    def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
        calls.append(ctx.partition)
        return table.select(["key", "v", "_seq"]).append_column(
            "p", pa.array([ctx.partition] * table.num_rows, pa.int64()))

    proc = ArrowProcessor(DECODER, transform, validate=_negative)
    rnd = random.Random(7)
    items = [(_batch(rnd, 1 + p, 30, p),
              BatchContext("s", "g", p, f"app{p}", 1, 100, None))  # type: ignore[arg-type]
             for p in range(4)]
    got = proc.process_partitions(items)
    want = [proc.process(b, c) for b, c in items]
    assert calls == [0, 1, 2, 3, 0, 1, 2, 3]  # the transform still sees one partition a call
    for g, w in zip(got, want, strict=True):
        assert g.dead == w.dead
        assert g.table is not None and w.table is not None and g.table.equals(w.table)


class _PartitionState:
    """A partition's state reader: ``v`` of every key is ``10 * partition``; records asks."""

    def __init__(self, partition: int, asked: list[int]) -> None:
        self.partition, self.asked = partition, asked

    def lookup(self, keys: object) -> pa.Table:
        self.asked.append(self.partition)
        ks = sorted(keys)  # type: ignore[call-overload]
        return pa.table({"key": ks, "_seq": [0] * len(ks), "v": [10 * self.partition] * len(ks)})


def test_prepare_batches_attaches_each_partition_s_own_state() -> None:
    asked: list[int] = []
    rnd = random.Random(3)
    bad = _batch(rnd, 1, 5, 1).set_column(4, RECORD_SCHEMA.field("data"), pa.array([b"{"] * 5))
    batches = [_batch(rnd, 1, 20, 0), bad, _batch(rnd, 2, 20, 2)]
    items = [(b, BatchContext("s", "g", p, f"app{p}", 1, 100, None,  # type: ignore[arg-type]
                              state=_PartitionState(p, asked)))
             for p, b in enumerate(batches)]
    got = prepare_batches(items, DECODER, None, KeyedState("key", ("v",)))
    assert asked == [0, 2]  # the batch where nothing decodes asks for no state
    assert got[1] == (None, decode_batch(bad, DECODER)[1]) and len(got[1][1]) == 5
    for p in (0, 2):
        table, dead = got[p]
        want, want_dead = decode_batch(batches[p], DECODER)
        assert table is not None and dead == want_dead
        assert table.drop_columns(["last_v"]).equals(want)
        assert set(table["last_v"].to_pylist()) == {10 * p}
