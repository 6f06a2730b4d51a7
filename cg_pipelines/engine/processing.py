"""A processing step over Arrow: decode each record, then transform the batch as a table.

Decoding is per record (a payload the decoder rejects becomes a dead letter with its reason);
the transform sees the good rows, in stream order, as one Arrow table with the decoded fields
plus ``_seq`` (int64 stream sequence), ``_subject`` (string, partition token stripped) and
``_time`` (timestamp ns UTC). The Spark step (:mod:`cg_pipelines.spark.job`) reuses the
decoding and runs the transform on a Spark DataFrame instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa

from cg_pipelines.core.decode import BadMessage, JsonDecoder
from cg_pipelines.engine.model import BatchContext, DeadLetter, Processed, Record

META_FIELDS = [
    pa.field("_seq", pa.int64(), nullable=False),
    pa.field("_subject", pa.string(), nullable=False),
    pa.field("_time", pa.timestamp("ns", tz="UTC"), nullable=False),
]

ArrowTransform = Callable[[pa.Table, BatchContext], pa.Table]


def decode_batch(
    records: Sequence[Record],
    decoder: JsonDecoder,
    validate: Callable[[Record, dict], None] | None = None,
) -> tuple[pa.Table, list[DeadLetter]]:
    """Decode records into an Arrow table (decoded fields + meta columns) and dead letters.

    ``validate(record, row)`` may raise :class:`BadMessage` for record-level checks (e.g. the
    subject has too few tokens).
    """
    cols: dict[str, list] = {f.name: [] for f in decoder.fields}
    seqs, subjects, times = [], [], []
    dead: list[DeadLetter] = []
    for r in records:
        try:
            row = decoder.decode(r.data)
            if validate is not None:
                validate(r, row)
        except BadMessage as e:
            dead.append(DeadLetter(r.seq, str(e)))
            continue
        for k, v in row.items():
            cols[k].append(v)
        seqs.append(r.seq)
        subjects.append(r.subject)
        times.append(r.time_ns)
    schema = pa.schema([*decoder.arrow_schema, *META_FIELDS])
    arrays = [pa.array(cols[f.name], f.type) for f in decoder.arrow_schema]
    arrays += [pa.array(seqs, pa.int64()), pa.array(subjects, pa.string()),
               pa.array(times, pa.int64()).cast(pa.timestamp("ns", tz="UTC"))]
    return pa.Table.from_arrays(arrays, schema=schema), dead


class ArrowProcessor:
    """Processing step: :func:`decode_batch`, then ``transform(table, ctx)`` on the good rows.

    The transform must be deterministic for the same rows and committed state.
    """

    def __init__(
        self,
        decoder: JsonDecoder,
        transform: ArrowTransform,
        validate: Callable[[Record, dict], None] | None = None,
    ) -> None:
        self.decoder, self.transform, self.validate = decoder, transform, validate

    def process(self, records: Sequence[Record], ctx: BatchContext) -> Processed:
        table, dead = decode_batch(records, self.decoder, self.validate)
        out = self.transform(table, ctx) if table.num_rows else None
        return Processed(out, dead)
