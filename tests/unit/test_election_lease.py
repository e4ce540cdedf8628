"""The leader's lease: its settings and the value read back from Redis to name the leader (docs/scaling.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from llmgw.cluster.election import MAX_HOLDER_BYTES, lease_value, parse_holder
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
