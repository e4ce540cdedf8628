"""What the key stores read back and what the admin API reads from a body: a valid record round-trips, anything
else is refused with RecordError (or ConfigError for a body), never another exception (property tests)."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.cluster import records
from llmgw.commands.keys import budget_value
from llmgw.config.issues import ConfigError
from llmgw.config.loading import read_json_object
from llmgw.config.schema import KeySpec, TeamConfig
from llmgw.tenancy import codec
from llmgw.tenancy.directory import KeyEntry, TeamEntry, digest_of
from llmgw.tenancy.model import PERIODS, Budget, Limits
from llmgw.tenancy.store_redis import KEY, RedisKeyStore

names = st.from_regex(codec.NAME, fullmatch=True)
counts = st.none() | st.integers(1, 10**15)
budgets = st.lists(st.sampled_from(PERIODS), unique=True).flatmap(lambda periods: st.tuples(*[
    st.builds(Budget, st.just(p), counts, st.none() | st.integers(0, 10**18)) for p in periods]))
limits = st.builds(Limits, counts, counts, counts, budgets)
models = st.none() | st.frozensets(st.text(min_size=1, max_size=40), max_size=5)
priorities = st.none() | st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
keys = st.builds(KeyEntry, st.from_regex(codec.KEY_ID, fullmatch=True), names, st.binary(min_size=32, max_size=32),
                 st.none() | names, models, priorities, limits, st.just("api"),
                 st.floats(0, 1e10, allow_nan=False).map(lambda t: round(t, 3)), st.booleans())
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=20)


@given(keys)
def test_a_key_record_round_trips(entry):
    assert codec.decode_key(codec.encode_key(entry)) == entry


@given(st.builds(TeamEntry, names, limits, models, priorities, st.just("api"), st.just(0.0), st.booleans()))
def test_a_team_record_round_trips(entry):
    assert codec.decode_team(codec.encode_team(entry)) == entry


@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_anything_else_is_refused_with_a_record_error(raw):
    for decode in (codec.decode_key, codec.decode_team):
        try:
            decode(raw)
        except codec.RecordError:
            pass


@given(keys, st.dictionaries(st.sampled_from(["id", "sha256", "team", "name", "models", "priority", "limits",
                                              "created", "priority_header"]), json_values, max_size=3))
def test_a_record_with_fields_replaced_by_anything_decodes_or_is_refused(entry, replaced):
    fields = {**json.loads(codec.encode_key(entry)), **replaced}
    try:
        codec.decode_key(json.dumps(fields).encode())
    except codec.RecordError:
        pass


def test_records_larger_than_any_the_admin_api_writes_are_refused():
    with pytest.raises(codec.RecordError):
        codec.decode_team(b" " * (codec.MAX_RECORD_BYTES + 1))


@settings(max_examples=200)
@given(keys, st.lists(st.binary(max_size=64) | st.integers() | st.none(), max_size=6))
def test_the_redis_store_admits_only_records_signed_for_their_field(entry, junk):
    store = RedisKeyStore(None, "llmgw:t:", records.Signer(b"s" * 32), max_keys=10, max_teams=10)  # type: ignore
    body = codec.encode_key(entry)
    good = store.seal(KEY, entry.key_id, body)
    other_secret = RedisKeyStore(None, "llmgw:t:", records.Signer(b"x" * 32), max_keys=10, max_teams=10)  # type: ignore
    fields = [entry.key_id.encode(), good,
              b"k-ffffffffffffffff", good,  # moved to another id
              entry.key_id.encode(), other_secret.seal(KEY, entry.key_id, body),
              entry.key_id.encode(), body, *junk]
    refused = {"key": 0}
    found = store._decoded(KEY, fields, codec.decode_key, lambda e: e.key_id, refused, "key")
    assert found == [entry]
    assert refused["key"] == 3 + len(junk) // 2


@given(st.dictionaries(st.sampled_from(["name", "team", "models", "priority", "priority_header", "limits", "budgets",
                                        "key", "x"]),
                       json_values, max_size=5))
def test_an_admin_body_is_read_or_refused_with_the_configs_messages(body):
    for cls in (KeySpec, TeamConfig):
        try:
            read_json_object(cls, body, "body")
        except ConfigError as exc:
            assert exc.errors and all(issue.message for issue in exc.errors)


def test_an_admin_body_never_reads_the_environment(monkeypatch):
    monkeypatch.setenv("LLMGW_SECRET_FOR_TEST", "hunter2")
    with pytest.raises(ConfigError) as raised:
        read_json_object(KeySpec, {"name": "a", "models": ["${LLMGW_SECRET_FOR_TEST}"]}, "body")
    assert "hunter2" not in str(raised.value)
    spec = read_json_object(KeySpec, {"name": "a", "limits": {"rpm": 5}, "budgets": [{"period": "day", "usd": 1}]},
                            "body")
    assert (spec.name, spec.limits.rpm, spec.budgets[0].usd) == ("a", 5, 1.0)
    assert spec.limits.was_written("rpm") and not spec.limits.was_written("tpm") and not spec.was_written("team")


@given(st.text(max_size=40))
def test_the_cli_budget_argument_is_read_or_refused(text):
    try:
        budget = budget_value(text)
    except argparse.ArgumentTypeError:
        return
    assert set(budget) <= {"period", "usd", "tokens"}


def test_digests_are_of_the_token():
    assert digest_of("abc").hex() == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_priority_header_is_read_as_false_from_an_earlier_versions_record_and_refused_when_not_a_boolean():
    entry = TeamEntry("search", priority="batch", priority_header=True)
    fields = json.loads(codec.encode_team(entry))
    assert fields["priority_header"] is True
    del fields["priority_header"]  # as a gateway without flow control wrote it
    assert codec.decode_team(json.dumps(fields).encode()).priority_header is False
    with pytest.raises(codec.RecordError, match="priority_header"):
        codec.decode_team(json.dumps({**fields, "priority_header": 1}).encode())
