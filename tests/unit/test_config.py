"""Config codec and validation (reference JSON, DESIGN §4)."""

from __future__ import annotations

import pytest

from cg_pipelines.core.config import (
    ElasticConfig,
    MemberMapping,
    PartitioningFilter,
    StaticConfig,
    go_json,
    parse_mapping,
    with_members,
)
from cg_pipelines.core.errors import ConfigError

MM = MemberMapping

# (config, exact bytes Go's json.Marshal writes for the reference struct)
STATIC_JSON = [
    (StaticConfig(3, members=("m1", "m2")), b'{"max_members":3,"members":["m1","m2"]}'),
    (StaticConfig(2, filters=("foo.>",), member_mappings=(MM("a", (0,)), MM("b", (1,)))),
     b'{"max_members":2,"filters":["foo.\\u003e"],"member_mappings":'
     b'[{"member":"a","partitions":[0]},{"member":"b","partitions":[1]}]}'),
    (StaticConfig(1), b'{"max_members":1}'),
]
ELASTIC_JSON = [
    (ElasticConfig(4), b'{"max_members":4,"partitioning_filters":null}'),
    (ElasticConfig(8, (PartitioningFilter("flights.*.*", (2,)),), members=("m1",)),
     b'{"max_members":8,"partitioning_filters":[{"filter":"flights.*.*",'
     b'"partitioning_wildcards":[2]}],"members":["m1"]}'),
    (ElasticConfig(2, (PartitioningFilter("a.>"),), 100, 2048, (),
                   (MM("x", (1,)), MM("y", (0,)))),
     b'{"max_members":2,"partitioning_filters":[{"filter":"a.\\u003e","partitioning_wildcards":'
     b'[]}],"max_buffered_msg":100,"max_buffered_bytes":2048,"member_mappings":'
     b'[{"member":"x","partitions":[1]},{"member":"y","partitions":[0]}]}'),
]


@pytest.mark.parametrize(("cfg", "expected"), STATIC_JSON)
def test_static_json_is_byte_equal_to_reference(cfg: StaticConfig, expected: bytes) -> None:
    assert cfg.to_json() == expected
    assert StaticConfig.from_json(expected) == cfg


@pytest.mark.parametrize(("cfg", "expected"), ELASTIC_JSON)
def test_elastic_json_is_byte_equal_to_reference(cfg: ElasticConfig, expected: bytes) -> None:
    assert cfg.to_json() == expected
    assert ElasticConfig.from_json(expected) == cfg


def test_go_escaping_of_html_characters() -> None:
    assert go_json({"f": "a<b>&c\u2028é"}) == b'{"f":"a\\u003cb\\u003e\\u0026c\\u2028\xc3\xa9"}'


def test_reads_adr_field_names() -> None:
    s = StaticConfig.from_json(
        b'{"max_members":2,"filter":"foo.*","member-mappings":[{"member":"a","partitions":[0,1]}]}'
    )
    assert s == StaticConfig(2, ("foo.*",), (), (MM("a", (0, 1)),))
    e = ElasticConfig.from_json(
        b'{"max_members":3,"filter":"foo.*","partitioning-wildcards":[1],"msg-buffer-size":5,'
        b'"members":["m"]}'
    )
    assert e == ElasticConfig(3, (PartitioningFilter("foo.*", (1,)),), 5, 0, ("m",))
    # Written back with the code's names.
    assert b'"max_buffered_msg":5' in e.to_json() and b"msg-buffer-size" not in e.to_json()


REJECTED = [
    # (config, field, words in the rule)
    (ElasticConfig(0), "max_members", ">= 1"),
    (StaticConfig(0, members=("a",)), "max_members", ">= 1"),
    (ElasticConfig(2, members=("a",), member_mappings=(MM("a", (0, 1)),)), "members", "not both"),
    (ElasticConfig(2, member_mappings=(MM("a", (0,)),)), "member_mappings", "missing [1]"),
    (ElasticConfig(2, member_mappings=(MM("a", (0, 0)), MM("b", (1,)))), "member_mappings",
     "more than once"),
    (ElasticConfig(2, member_mappings=(MM("a", (0,)), MM("a", (1,)))), "member_mappings",
     "mapped twice"),
    (ElasticConfig(2, member_mappings=(MM("a", (0, 2)), MM("b", (1,)))), "member_mappings",
     "outside [0, 2)"),
    (ElasticConfig(1, member_mappings=(MM("a", (0,)), MM("b", ()))), "member_mappings",
     "number of mappings"),
    (ElasticConfig(2, (PartitioningFilter(""),)), "partitioning_filters", "not be empty"),
    (ElasticConfig(2, (PartitioningFilter("foo.bar"),)), "partitioning_filters",
     "at least one '*'"),
    (ElasticConfig(2, (PartitioningFilter("foo.*", (1, 2)),)), "partitioning_filters",
     "1 '*' wildcards but 2"),
    (ElasticConfig(2, (PartitioningFilter("foo.*.*", (1, 1)),)), "partitioning_filters",
     "unique"),
    (ElasticConfig(2, (PartitioningFilter("foo.*.*", (3,)),)), "partitioning_filters",
     "between 1 and 2"),
    (ElasticConfig(2, (PartitioningFilter("foo.*", (0,)),)), "partitioning_filters",
     "between 1 and 1"),
    (ElasticConfig(2, (PartitioningFilter("foo.>.*", (1,)),)), "partitioning_filters",
     "last token"),
    (ElasticConfig(2, members=("a.b",)), "members", "must not contain '.'"),
    (ElasticConfig(2, max_buffered_msgs=-1), "max_buffered_msg", ">= 0"),
    (StaticConfig(2, filters=("foo..bar",)), "filters", "empty tokens"),
]


@pytest.mark.parametrize(("cfg", "field", "words"), REJECTED)
def test_validation_names_field_and_rule(cfg: object, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as ei:
        cfg.validate()  # type: ignore[attr-defined]
    assert ei.value.field == field
    assert words in str(ei.value)


ACCEPTED = [
    ElasticConfig(1),
    ElasticConfig(3, (PartitioningFilter("foo.>"),)),
    ElasticConfig(3, (PartitioningFilter("foo.*.*.>", (2, 1)),), members=("m1", "m1", "zz")),
    ElasticConfig(2, member_mappings=(MM("a", (1,)), MM("b", (0,)))),
    StaticConfig(4, ("x.*",), ("a", "b", "c", "d", "e")),
]


@pytest.mark.parametrize("cfg", ACCEPTED)
def test_valid_configs_pass(cfg: object) -> None:
    assert cfg.validate() is cfg  # type: ignore[attr-defined]


BAD_JSON = [
    (b"not json", "config", "not valid JSON"),
    (b"[1]", "config", "JSON object"),
    (b'{"max_members":"3"}', "max_members", "integer"),
    (b'{"max_members":3,"members":"m1"}', "members", "list of strings"),
    (b'{"max_members":3,"member_mappings":[{"member":"a","partitions":["0"]}]}',
     "member_mappings", "integers"),
    (b'{"max_members":3,"partitioning_filters":{}}', "partitioning_filters", "list"),
]


@pytest.mark.parametrize(("data", "field", "words"), BAD_JSON)
def test_bad_json_shapes_raise_config_error(data: bytes, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as ei:
        ElasticConfig.from_json(data)
    assert ei.value.field == field and words in str(ei.value)


def test_with_members_sorts_and_dedupes() -> None:
    cfg = with_members(ElasticConfig(4, member_mappings=(MM("a", (0, 1, 2, 3)),)), ["b", "a", "b"])
    assert cfg.members == ("a", "b") and cfg.member_mappings == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("m1:0,1,2", MM("m1", (0, 1, 2))), ("m2:3-5,7", MM("m2", (3, 4, 5, 7)))],
)
def test_parse_mapping(text: str, expected: MemberMapping) -> None:
    assert parse_mapping(text) == expected


@pytest.mark.parametrize(("text", "words"), [
    ("m1", "must look like 'member:0,1,2'"), ("m1:", "must look like"), (":1", "must look like"),
    ("m1=0", "must look like"), ("m1:a", "'a' is not a partition number"),
    ("m1:1-x", "'1-x' is not a partition number"), ("m1:0,1;m2", "'1;m2' is not a partition"),
    ("m1:0,,1", "'' is not a partition number"), ("m1:-1", "'-1' is not a partition number"),
    ("m1:3-1", "range '3-1' is reversed"),
])
def test_parse_mapping_rejects(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match="member_mappings") as ei:
        parse_mapping(text)
    assert ei.value.field == "member_mappings" and words in ei.value.rule, ei.value.rule
