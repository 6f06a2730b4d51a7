"""Config codec and validation (reference JSON, DESIGN §4).

Expected bytes are what Go's ``encoding/json`` writes for the reference structs
(synadia-io/orbit.go pcgroups v0.2.1): ``StaticConsumerGroupConfig`` and
``ElasticConsumerGroupConfig`` (field order and ``omitempty`` tags in
static_stream_consumer_group.go / elastic_stream_consumer_group.go), ``PartitioningFilter`` and
``MemberMapping`` (no ``omitempty``: a nil slice is ``null``), with ``<``, ``>``, ``&`` escaped.
"""

from __future__ import annotations

import pytest

from cg_pipelines.core.config import (
    MAX_MEMBERS,
    ElasticConfig,
    MemberMapping,
    PartitioningFilter,
    StaticConfig,
    equivalent,
    go_json,
    parse_mapping,
    with_mappings,
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
    # No wildcards given: Go's zero value, a nil slice, is null (the Go API's
    # PartitioningFilter{Filter: "a.>"}); DESIGN §4 "Round trip".
    (ElasticConfig(2, (PartitioningFilter("a.>"),), 100, 2048, (),
                   (MM("x", (1,)), MM("y", (0,)))),
     b'{"max_members":2,"partitioning_filters":[{"filter":"a.\\u003e","partitioning_wildcards":'
     b'null}],"max_buffered_msg":100,"max_buffered_bytes":2048,"member_mappings":'
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
    # Issue 16: max_members is bounded (MAX_MEMBERS) and member names are unique.
    (ElasticConfig(MAX_MEMBERS + 1), "max_members", f"must be <= {MAX_MEMBERS}, got 4097"),
    (StaticConfig(10**8, members=("a",)), "max_members", "got 100000000"),
    (ElasticConfig(10**30, members=("a",)), "max_members", "got 100000000000...(31 digits)"),
    (ElasticConfig(4, members=("m1", "m2", "m1")), "members", "'m1' is listed more than once"),
    (StaticConfig(4, members=("a", "a")), "members", "'a' is listed more than once"),
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
    ElasticConfig(3, (PartitioningFilter("foo.*.*.>", (2, 1)),), members=("zz", "m1")),
    ElasticConfig(MAX_MEMBERS, members=("m1",)),
    StaticConfig(MAX_MEMBERS, member_mappings=(MM("a", tuple(range(MAX_MEMBERS))),)),
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
    # Go's encoding/json rejects these (Python's json would read them).
    (b'{"max_members":3,"x":NaN}', "config", "not valid JSON"),
    (b'{"max_members":3,"x":-Infinity}', "config", "not valid JSON"),
    # Bounded while parsing, before anything loops over the partitions.
    (b'{"max_members":1000000000000000000000000000000,"members":["a"]}', "max_members",
     f"must be <= {MAX_MEMBERS}"),
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


def test_bad_max_members_and_duplicates_fail_fast() -> None:
    """A stored max_members of 10**30 or 10**8 is refused when read, at once (it used to make
    every assignment loop for ever / tens of seconds)."""
    import time

    t = time.perf_counter()
    for data in (b'{"max_members":1000000000000000000000000000000}',
                 b'{"max_members":100000000,"member_mappings":[{"member":"a","partitions":[0]}]}'):
        with pytest.raises(ConfigError) as ei:
            ElasticConfig.from_json(data)
        assert ei.value.field == "max_members" and f"<= {MAX_MEMBERS}" in ei.value.rule
        assert "\n" not in str(ei.value)
    cfg = StaticConfig.from_json(b'{"max_members":4,"members":["b","a","b"]}')
    with pytest.raises(ConfigError, match="members: member 'b' is listed more than once"):
        cfg.validate()
    assert time.perf_counter() - t < 5  # a hang guard, not a timing test


# ------------------------------------------------------------------------------ round trip
#
# What is read is written back as read (issue 11): the reference's watcher compares
# PartitioningFilters with reflect.DeepEqual, so null (nil) vs [] (empty) must survive; members
# and mappings keep their order; unknown fields stay in place.

GO_ELASTIC_NULL_WC = (  # written by the Go API with PartitioningFilter{Filter: "S.>"}
    b'{"max_members":4,"partitioning_filters":[{"filter":"S.\\u003e","partitioning_wildcards":'
    b'null}],"members":["m2","m1"]}')
GO_ELASTIC_EMPTY_WC = GO_ELASTIC_NULL_WC.replace(b"null", b"[]")  # []int{}
GO_ELASTIC_NO_FILTERS = b'{"max_members":4,"partitioning_filters":null,"members":["m2","m1"]}'
GO_ELASTIC_EMPTY_FILTERS = b'{"max_members":4,"partitioning_filters":[],"members":["m2","m1"]}'
GO_ELASTIC_MAPPED = (
    b'{"max_members":2,"partitioning_filters":[{"filter":"S.*.a","partitioning_wildcards":[1]},'
    b'{"filter":"S.*.b","partitioning_wildcards":[1]}],"max_buffered_msg":10,'
    b'"member_mappings":[{"member":"y","partitions":[1]},{"member":"x","partitions":[0]}]}')
GO_STATIC_MAPPED = (
    b'{"max_members":2,"filters":["S.a.\\u003e","S.b.\\u003e"],"member_mappings":'
    b'[{"member":"x","partitions":[1,0]},{"member":"y","partitions":null}]}')

ROUND_TRIP = [
    GO_ELASTIC_NULL_WC, GO_ELASTIC_EMPTY_WC, GO_ELASTIC_NO_FILTERS, GO_ELASTIC_EMPTY_FILTERS,
    GO_ELASTIC_MAPPED, GO_STATIC_MAPPED,
    b'{"max_members":2}',  # partitioning_filters absent stays absent
    b'{"max_members":2,"partitioning_filters":null,"max_buffered_msg":0,"members":[]}',
    b'{"max_members":2,"partitioning_filters":null,"members":null,"member_mappings":null}',
    b'{"max_members":2,"filters":[],"members":null}',
    b'{"max_members":2,"partitioning_filters":null,"max_memberz":3,"members":["a"]}',
    b'{ "max_members" : 2,\n  "partitioning_filters": null }',  # not compact: bytes kept
    b'{"max_members":2,"partitioning_filters":[{"filter":"a.*","partitioning_wildcards":[1],'
    b'"hash":"fnv1a"}],"member_mappings":[{"member":"x","partitions":[0,1],"weight":2}]}',
]


@pytest.mark.parametrize("data", ROUND_TRIP)
def test_config_read_and_written_back_unchanged_is_byte_exact(data: bytes) -> None:
    cls = StaticConfig if b'"filters"' in data else ElasticConfig
    cfg = cls.from_json(data)
    assert cfg.to_json() == data
    assert cls.from_json(cfg.to_json()) == cfg


# (stored bytes, change, expected bytes): the expected bytes are what the reference writes
# after the same change (json.Marshal of the struct it unmarshalled, with the new membership;
# AddMembers/DeleteMembers/SetMemberMappings/DeleteMemberMappings in
# elastic_stream_consumer_group.go), except that our members are sorted (the reference's come
# from a map: random order).
ELASTIC_CHANGES = [
    # nil wildcards stay null (a rewrite as [] stops every Go member: reflect.DeepEqual)
    (GO_ELASTIC_NULL_WC, lambda c: with_members(c, [*c.members, "m3"]),
     b'{"max_members":4,"partitioning_filters":[{"filter":"S.\\u003e","partitioning_wildcards":'
     b'null}],"members":["m1","m2","m3"]}'),
    (GO_ELASTIC_EMPTY_WC, lambda c: with_members(c, [*c.members, "m3"]),
     b'{"max_members":4,"partitioning_filters":[{"filter":"S.\\u003e","partitioning_wildcards":'
     b'[]}],"members":["m1","m2","m3"]}'),
    (GO_ELASTIC_NO_FILTERS, lambda c: with_members(c, ["m1"]),
     b'{"max_members":4,"partitioning_filters":null,"members":["m1"]}'),
    (GO_ELASTIC_EMPTY_FILTERS, lambda c: with_members(c, ["m1"]),
     b'{"max_members":4,"partitioning_filters":[],"members":["m1"]}'),
    # DeleteMembers of everyone: nil members, omitted (omitempty)
    (GO_ELASTIC_NULL_WC, lambda c: with_members(c, []),
     b'{"max_members":4,"partitioning_filters":[{"filter":"S.\\u003e","partitioning_wildcards":'
     b'null}]}'),
    # SetMemberMappings: Members = []string{} (omitted), mappings written
    (GO_ELASTIC_NULL_WC, lambda c: with_mappings(c, [MM("b", (2, 3)), MM("a", (0, 1))]),
     b'{"max_members":4,"partitioning_filters":[{"filter":"S.\\u003e","partitioning_wildcards":'
     b'null}],"member_mappings":[{"member":"a","partitions":[0,1]},{"member":"b","partitions":'
     b'[2,3]}]}'),
    # DeleteMemberMappings then AddMembers, with filters and a buffer limit kept as they were
    (GO_ELASTIC_MAPPED, lambda c: with_members(c, ["x"]),
     b'{"max_members":2,"partitioning_filters":[{"filter":"S.*.a","partitioning_wildcards":[1]},'
     b'{"filter":"S.*.b","partitioning_wildcards":[1]}],"max_buffered_msg":10,'
     b'"members":["x"]}'),
    # Unknown fields (a newer reference's, or a typo) keep their place; a field that was
    # absent goes right after the Go field before it.
    (b'{"max_members":4,"partitioning_filters":null,"max_memberz":9,"members":["a"],'
     b'"zz":{"k":[1,null],"s":"<"}}', lambda c: with_members(c, ["a", "b"]),
     b'{"max_members":4,"partitioning_filters":null,"max_memberz":9,"members":["a","b"],'
     b'"zz":{"k":[1,null],"s":"\\u003c"}}'),
    (b'{"max_members":4,"partitioning_filters":null,"future":true}',
     lambda c: with_members(c, ["a"]),
     b'{"max_members":4,"partitioning_filters":null,"members":["a"],"future":true}'),
    (b'{"max_members":2,"partitioning_filters":[{"filter":"a.*","partitioning_wildcards":[1],'
     b'"hash":"fnv1a"}],"member_mappings":[{"member":"x","partitions":[0,1],"weight":2}]}',
     lambda c: with_members(c, ["x"]),
     b'{"max_members":2,"partitioning_filters":[{"filter":"a.*","partitioning_wildcards":[1],'
     b'"hash":"fnv1a"}],"members":["x"]}'),
]


@pytest.mark.parametrize(("stored", "change", "expected"), ELASTIC_CHANGES)
def test_membership_change_keeps_everything_else_as_read(
        stored: bytes, change: object, expected: bytes) -> None:
    new = change(ElasticConfig.from_json(stored)).validate()  # type: ignore[operator]
    assert new.to_json() == expected
    assert ElasticConfig.from_json(expected) == new


def test_null_and_empty_wildcards_are_equal_but_written_as_read() -> None:
    null, empty = ElasticConfig.from_json(GO_ELASTIC_NULL_WC), ElasticConfig.from_json(
        GO_ELASTIC_EMPTY_WC)
    # Same group to us (same transform, same filters): create stays idempotent over either.
    assert null == empty and null.same_shape(empty)
    assert b'"partitioning_wildcards":null' in null.to_json()
    assert b'"partitioning_wildcards":[]' in empty.to_json()


def test_unknown_fields_are_exposed() -> None:
    cfg = ElasticConfig.from_json(
        b'{"max_memberz":5,"max_members":2,"partitioning_filters":[{"filter":"a.*",'
        b'"partitioning_wildcards":[1],"hash":"x"}],"member_mappings":[{"member":"m",'
        b'"partitions":[0,1],"weight":2}]}')
    assert cfg.unknown_fields == {"max_memberz": 5, "partitioning_filters[0].hash": "x",
                                  "member_mappings[0].weight": 2}
    assert ElasticConfig.from_json(GO_ELASTIC_NULL_WC).unknown_fields == {}
    assert ElasticConfig(2).unknown_fields == {}
    # An ADR name that was not used (the code's name is there too) is unknown to the reference.
    s = StaticConfig.from_json(b'{"max_members":2,"filters":["a.>"],"filter":"b.>"}')
    assert s.filters == ("a.>",) and s.unknown_fields == {"filter": "b.>"}
    assert s.to_json() == b'{"max_members":2,"filters":["a.>"],"filter":"b.>"}'


def test_adr_names_are_written_with_the_code_names_in_place() -> None:
    e = ElasticConfig.from_json(b'{"max_members":3,"filter":"foo.*","partitioning-wildcards":[1],'
                                b'"x":1,"member-mappings":[{"member":"m","partitions":[0,1,2]}]}')
    assert e.to_json() == (b'{"max_members":3,"partitioning_filters":[{"filter":"foo.*",'
                           b'"partitioning_wildcards":[1]}],"x":1,"member_mappings":[{"member":'
                           b'"m","partitions":[0,1,2]}]}')
    nested = ElasticConfig.from_json(b'{"max_members":1,"partitioning_filters":[{"filter":"a.*",'
                                     b'"partitioning-wildcards":[1]}]}')
    assert nested.to_json() == (b'{"max_members":1,"partitioning_filters":[{"filter":"a.*",'
                                b'"partitioning_wildcards":[1]}]}')


def test_equivalent_ignores_member_and_mapping_order_only() -> None:
    a = ElasticConfig.from_json(GO_ELASTIC_NULL_WC)
    assert equivalent(a, with_members(a, a.members)) and a != with_members(a, a.members)
    assert not equivalent(a, with_members(a, ["m1"]))
    m1 = ElasticConfig(3, member_mappings=(MM("b", (2, 1)), MM("a", (0,))))
    m2 = ElasticConfig(3, member_mappings=(MM("a", (0,)), MM("b", (1, 2))))
    assert equivalent(m1, m2)
    assert not equivalent(m1, ElasticConfig(3, member_mappings=(MM("a", (1,)), MM("b", (0, 2)))))
    assert not equivalent(StaticConfig(3), ElasticConfig(3))
