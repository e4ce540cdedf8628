"""The leader's lease: its settings and the value read back from Redis to name the leader (docs/scaling.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from llmgw.cluster.election import MAX_HOLDER_BYTES, lease_value, next_generation, parse_holder
from llmgw.cluster.records import Signer
from llmgw.config import ConfigError, parse_config


def test_the_lease_defaults_renew_four_times_within_its_life():
    settings = parse_config("state:\n  backend: redis\n  url: redis://127.0.0.1\n  secret_env: S\n",
                            filename="llmgw.yaml").state
    assert (settings.lease_ttl, settings.lease_renew) == (2.0, 0.5)


def test_a_renewal_slower_than_a_third_of_the_lease_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as caught:
        parse_config("state:\n  backend: redis\n  url: redis://127.0.0.1\n  secret_env: S\n  lease_ttl: 1s\n"
                     "  lease_renew: 500ms\n",
                     filename="llmgw.yaml")
    (issue,) = caught.value.errors
    assert "lease_renew" in str(issue) and "third of lease_ttl" in str(issue)


def test_a_lease_value_names_its_term_holder_and_control_url():
    raw = lease_value(7, "0123456789ab", "https://10.0.0.5:8001")
    assert parse_holder(raw) == {"generation": 7, "origin": "0123456789ab", "control_url": "https://10.0.0.5:8001"}


@pytest.mark.parametrize("raw", [None, 5, b"", b"x y z", b"1 two", b"-1 a b", b"1 a b c", "\u00b2 a b".encode(),
                                 b"1 a " + b"u" * MAX_HOLDER_BYTES])
def test_what_is_not_a_lease_value_names_no_leader(raw):
    assert parse_holder(raw) is None


@given(st.binary(max_size=700))
def test_any_bytes_are_a_holder_or_none_never_an_error(raw):
    holder = parse_holder(raw)
    assert holder is None or (holder["generation"] >= 0 and " " not in holder["origin"])


SIGNER = Signer(b"a cluster secret of at least 16 bytes")


def test_a_signed_lease_names_its_holder_and_nothing_else_does():
    raw = lease_value(7, "0123456789ab", "https://10.0.0.5:8001", SIGNER)
    assert parse_holder(raw, SIGNER) == {"generation": 7, "origin": "0123456789ab",
                                         "control_url": "https://10.0.0.5:8001"}
    body, signature = raw.rsplit(b" ", 1)
    assert parse_holder(body, SIGNER) is None  # unsigned: no candidate wrote it
    assert parse_holder(b"8" + body[1:] + b" " + signature, SIGNER) is None  # another generation
    assert parse_holder(raw, Signer(b"another cluster's secret, 16+ bytes")) is None
    assert parse_holder(body + b" " + b"zz" * 32, SIGNER) is None


@given(st.binary(max_size=800))
def test_any_bytes_are_a_signed_holder_or_none_never_an_error(raw):
    assert parse_holder(raw, SIGNER) is None


@pytest.mark.parametrize(("counter", "seen", "expected"), [
    (b"41", 0, 42), (b"41", 50, 51), (b"", 3, 4), (b"evil", 0, 1), (b"9" * 40, 7, 8), (b"-5", 0, 1)])
def test_the_next_generation_follows_the_counter_and_what_was_seen(counter, seen, expected):
    assert next_generation(counter, seen) == expected
