"""Storage option keys checked against the keys the table's store reads
(cg_pipelines.core.storage_keys): a table test, and the sink refusing a misspelt key."""

from __future__ import annotations

import pytest

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.storage_keys import PROVIDER_KEYS, check_storage_options, known_keys
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.storage import s3_options

# (uri, options, None if accepted else a fragment of the error)
CASES = [
    ("s3://b/t", {"AWS_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://x",
                  "AWS_ALLOW_HTTP": "true"}, None),
    ("s3://b/t", {"region": "eu-west-1", "aws_access_key_id": "a"}, None),
    ("s3a://b/t", {"AWS_S3_LOCKING_PROVIDER": "dynamodb", "DELTA_DYNAMO_TABLE_NAME": "l"}, None),
    ("s3://b/t", {"aws_timeout": "30s", "timeout": "30s", "max_retries": "3"}, None),
    ("s3://b/t", {"AWS_REGOIN": "eu-west-1"}, "AWS_REGOIN (did you mean AWS_REGION?)"),
    ("s3://b/t", {"AWS_ENDPOINT_URL_": "http://x"}, "did you mean AWS_ENDPOINT_URL?"),
    ("s3://b/t", {"AZURE_STORAGE_ACCOUNT_NAME": "acc"}, "AZURE_STORAGE_ACCOUNT_NAME"),
    ("s3://b/t", {"whatever": "1", "AWS_REGOIN": "x"}, "whatever, AWS_REGOIN"),
    ("abfss://c@acc.dfs.core.windows.net/t", {"AZURE_STORAGE_ACCOUNT_NAME": "acc",
                                              "azure_storage_account_key": "k"}, None),
    ("az://c/t", {"AWS_REGION": "x"}, "unknown to the az store"),
    ("gs://b/t", {"GOOGLE_SERVICE_ACCOUNT": "/k.json", "google_timeout": "5s"}, None),
    ("gs://b/t", {"GOOGLE_SERVICE_ACOUNT": "/k.json"}, "did you mean GOOGLE_SERVICE_ACCOUNT?"),
    ("/tmp/t", {"AWS_REGION": "x", "max_retries": "3"}, None),
    ("file:///tmp/t", {"AWS_REGOIN": "x"}, "unknown to the file store"),
    ("/tmp/t", {}, None),
    ("memory:///t", {"anything": "goes"}, None),  # a scheme not known is not checked
]


@pytest.mark.parametrize(("uri", "options", "error"), CASES)
def test_check_storage_options(uri: str, options: dict[str, str], error: str | None) -> None:
    if error is None:
        check_storage_options(uri, options)
        return
    with pytest.raises(ConfigError, match="storage_options") as got:
        check_storage_options(uri, options)
    assert error in str(got.value)


def test_a_value_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ConfigError, match="must be strings"):
        check_storage_options("s3://b/t", {"AWS_ALLOW_HTTP": True})  # type: ignore[dict-item]


def test_every_option_the_library_builds_is_known() -> None:
    opts = s3_options("http://127.0.0.1:9000", "a", "b", region="us-east-1", allow_http=True)
    assert {k.lower() for k in opts} <= PROVIDER_KEYS["s3"]
    assert known_keys("s3://b/t") == PROVIDER_KEYS["s3"]
    assert known_keys("hdfs://n/t") is None


def test_the_sink_refuses_a_misspelt_key_before_touching_the_table(tmp_path) -> None:
    uri = str(tmp_path / "t")
    with pytest.raises(ConfigError, match="AWS_REGOIN"):
        DeltaSink("s3://bucket/t", storage_options={"AWS_REGOIN": "eu-west-1"})
    DeltaSink(uri, storage_options={"AWS_REGION": "eu-west-1"})  # known: accepted
    assert not (tmp_path / "t").exists()
