"""DeltaSink on S3 (moto server mode on 127.0.0.1): put-if-absent commits, fencing, races."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from botocore.exceptions import ClientError
from deltalake import DeltaTable

from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.testing.s3 import MotoS3Server
from tests.support.race import race

SCHEMA = pa.schema([("key", pa.string()), ("seq", pa.int64()), ("tag", pa.string())])


def rows(first: int, n: int, tag: str = "t", key: str = "k") -> pa.Table:
    return pa.table(
        {"key": [key] * n, "seq": list(range(first, first + n)), "tag": [tag] * n}, schema=SCHEMA
    )


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoS3Server]:
    with MotoS3Server() as server:
        yield server


@pytest.fixture
def uri(moto: MotoS3Server) -> str:
    bucket = f"cg-{uuid.uuid4().hex[:12]}"
    return moto.create_bucket(bucket) + "/tables/t"


@pytest.fixture
def make(moto: MotoS3Server, uri: str) -> Callable[[], DeltaSink]:
    return lambda: DeltaSink(uri, storage_options=moto.storage_options())


def delta_version(moto: MotoS3Server, uri: str) -> int:
    return DeltaTable(uri, storage_options=moto.storage_options()).version()


def test_moto_honours_if_none_match(moto: MotoS3Server) -> None:
    client = moto.client()
    bucket = f"cg-{uuid.uuid4().hex[:12]}"
    moto.create_bucket(bucket)
    client.put_object(Bucket=bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as ei:
        client.put_object(Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"first"


def test_server_stops(moto: MotoS3Server) -> None:
    with MotoS3Server() as other:
        url = other.endpoint_url
        assert url.startswith("http://127.0.0.1:") and url != moto.endpoint_url
        other.create_bucket("cg-stop-check")
    with pytest.raises(RuntimeError):
        _ = other.endpoint_url
    import urllib.error
    import urllib.request

    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(url, timeout=2)


def test_watermark_commit_read(make: Callable[[], DeltaSink]) -> None:
    sink = make()
    assert sink.watermark("s/g/0") == 0
    assert not sink.exists()
    assert sink.read().num_rows == 0
    sink.commit(rows(1, 3), {"s/g/0": (0, 3)})
    sink.commit(rows(4, 2, "b"), {"s/g/0": (3, 5)})
    assert sink.exists()
    assert sink.watermark("s/g/0") == 5
    assert make().watermark("s/g/0") == 5
    got = make().read(columns=["seq"], filter=pc.field("tag") == "b")
    assert sorted(got.column("seq").to_pylist()) == [4, 5]
    assert make().read().sort_by("seq").to_pylist() == rows(1, 3).to_pylist() + rows(
        4, 2, "b").to_pylist()


def test_stale_expected_is_refused_and_writes_nothing(
    make: Callable[[], DeltaSink], moto: MotoS3Server, uri: str
) -> None:
    sink = make()
    sink.commit(rows(1, 5), {"a": (0, 5)})
    version = delta_version(moto, uri)
    with pytest.raises(FenceConflictError) as ei:
        sink.commit(rows(6, 5), {"a": (2, 10)})
    assert (ei.value.expected, ei.value.found) == (2, 5)
    assert delta_version(moto, uri) == version
    assert make().read().num_rows == 5 and make().watermark("a") == 5


def test_zombie_is_fenced(make: Callable[[], DeltaSink], moto: MotoS3Server, uri: str) -> None:
    make().ensure_table(SCHEMA)
    zombie, owner = make(), make()
    zombie.watermark("a")
    owner.watermark("a")
    owner.commit(rows(1, 2, "owner"), {"a": (0, 2)})
    version = delta_version(moto, uri)
    with pytest.raises(FenceConflictError) as ei:
        zombie.commit(rows(1, 2, "zombie"), {"a": (0, 2)})
    assert ei.value.found == 2
    assert delta_version(moto, uri) == version
    assert make().read().column("tag").to_pylist() == ["owner", "owner"]


@pytest.mark.parametrize("fresh", [True, False])
def test_race_same_app_exactly_one_wins(make: Callable[[], DeltaSink], fresh: bool) -> None:
    if not fresh:
        make().commit(rows(1, 1, "seed"), {"other": (0, 1)})
    n = 4
    sinks = [make() for _ in range(n)]
    assert all(s.watermark("a") == 0 for s in sinks)
    out = race(n, lambda i: sinks[i].commit(rows(1, 3, f"w{i}"), {"a": (0, 10 + i)}))
    winners = [i for i, e in out.items() if e is None]
    assert len(winners) == 1, out
    assert all(isinstance(e, FenceConflictError) for e in out.values() if e is not None), out
    assert make().watermark("a") == 10 + winners[0]
    tags = make().read(filter=pc.field("tag") != "seed").column("tag").to_pylist()
    assert tags == [f"w{winners[0]}"] * 3


@pytest.mark.parametrize("fresh", [True, False])
def test_partitions_commit_concurrently(make: Callable[[], DeltaSink], fresh: bool) -> None:
    if not fresh:
        make().ensure_table(SCHEMA)
    n, batches = 4, 3
    sinks = [make() for _ in range(n)]

    def partition(i: int) -> None:
        app = f"s/g/{i}"
        wm = sinks[i].watermark(app)
        for _ in range(batches):
            sinks[i].commit(rows(wm + 1, 2, key=str(i)), {app: (wm, wm + 2)})
            wm += 2

    assert race(n, partition) == {i: None for i in range(n)}
    check = make()
    assert [check.watermark(f"s/g/{i}") for i in range(n)] == [2 * batches] * n
    assert check.read().num_rows == n * 2 * batches


def test_empty_commit_advances_watermark(
    make: Callable[[], DeltaSink], moto: MotoS3Server, uri: str
) -> None:
    sink = make()
    sink.commit(rows(1, 1), {"a": (0, 1)})
    version = delta_version(moto, uri)
    sink.commit(None, {"a": (1, 4)})
    sink.commit(rows(1, 0), {"a": (4, 7)})
    assert make().watermark("a") == 7
    assert delta_version(moto, uri) == version + 2
    assert make().read().num_rows == 1


def test_repr_hides_secrets(moto: MotoS3Server, uri: str) -> None:
    opts = DeltaSink.s3_options(moto.endpoint_url, "AKIDMOTOEXAMPLE", "moto-secret-XYZ",
                                allow_http=True)
    sink = DeltaSink(uri, storage_options=opts)
    sink.commit(rows(1, 1), {"a": (0, 1)})  # the credentials are really used (moto takes any)
    assert sink.watermark("a") == 1
    text = repr(sink)
    assert "AKIDMOTOEXAMPLE" not in text and "moto-secret-XYZ" not in text
    assert "***" in text and moto.endpoint_url in text
