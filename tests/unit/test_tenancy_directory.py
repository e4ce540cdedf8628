"""The key directory: config keys and teams as tenants, found by the SHA-256 of the presented token."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from hypothesis import given, strategies as st

from llmgw.config import parse_config
from llmgw.tenancy.directory import API, KeyEntry, TeamEntry, build_directory, build_prices, digest_of
from llmgw.tenancy.model import Budget, Limits, Price

CONFIG = """
api_keys:
  - key: sk-search
    name: search-prod
    team: search
    models: [llama-8b]
    priority: interactive
    limits: {rpm: 600, tpm: 200000, concurrency: 16}
    budgets: [{period: month, usd: 250}, {period: day, tokens: 5000000}]
  - key_sha256: %s
    name: hashed
  - key: sk-plain
teams:
  - name: search
    limits: {rpm: 1000}
    budgets: [{period: total, usd: 0.5}]
    models: [llama-8b, llama-70b]
    priority: standard
prices:
  - {model: llama-8b, input: 0.10, cached_input: 0.05, output: 0.40}
  - {model: llama-70b, input: 1.5, output: 2}
tenancy: {default_max_tokens: 1024, cached_input_weight: 0.5}
""" % hashlib.sha256(b"sk-hashed").hexdigest().upper()


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_config_keys_become_tenants_with_their_team_limits_and_budgets():
    directory = build_directory(parse_config(CONFIG))
    assert directory.required
    tenant = directory.lookup(bearer("sk-search"))
    assert tenant is not None
    assert (tenant.key_id, tenant.name, tenant.source, tenant.priority) == \
        ("cfg-search-prod", "search-prod", "config", "interactive")
    assert tenant.limits == Limits(rpm=600, tpm=200000, concurrency=16,
                                   budgets=(Budget("month", None, 250_000_000_000), Budget("day", 5_000_000, None)))
    assert tenant.team is not None and tenant.team.name == "search"
    assert tenant.team.limits == Limits(rpm=1000, budgets=(Budget("total", None, 500_000_000),))
    assert tenant.may_use("llama-8b") and not tenant.may_use("llama-70b")  # its own list narrows its team's
    assert tenant.limited and tenant.class_name == "interactive"


def test_a_key_given_as_its_hash_and_a_key_without_anything_else():
    directory = build_directory(parse_config(CONFIG))
    hashed = directory.lookup(bearer("sk-hashed"))
    assert hashed is not None and hashed.key_id == "cfg-hashed"
    plain = directory.lookup(bearer("sk-plain"))
    assert plain is not None and (plain.name, plain.team, plain.models) == ("key-3", None, None)
    assert not plain.limited and plain.may_use("anything")


def test_wrong_tokens_and_headers_find_nobody():
    directory = build_directory(parse_config(CONFIG))
    for header in (None, "", "Bearer", "Bearer ", "Basic sk-search", "Bearer sk-searc", "Bearer sk-search2",
                   "sk-search", "Bearer " + hashlib.sha256(b"sk-hashed").hexdigest()):
        assert directory.lookup(header) is None, header
    assert directory.lookup("bearer  sk-search ") is not None  # the scheme's case and spaces, as BearerTokens


def test_a_non_ascii_key_sent_as_utf8_is_found():
    directory = build_directory(parse_config("api_keys:\n  - key: ключ-ü\n"))
    assert directory.lookup("Bearer " + "ключ-ü".encode().decode("latin-1")) is not None  # as a header arrives


@given(st.text(max_size=80))
def test_any_header_value_finds_a_tenant_or_nobody(header):
    directory = build_directory(parse_config(CONFIG))
    assert directory.lookup(header) is None or header.split()[-1] in ("sk-search", "sk-hashed", "sk-plain")


def test_without_keys_the_directory_is_open_until_a_key_exists_then_closed_for_good():
    directory = build_directory(parse_config("models: []\n"))
    assert not directory.required and directory.lookup(bearer("x")) is None
    directory.set_stored([KeyEntry("k-1", "made", digest_of("sk-made"))], [])
    assert directory.required
    directory.set_stored([], [])  # the last key revoked: /v1 does not open again
    assert directory.required and directory.lookup(bearer("sk-made")) is None
    assert build_directory(parse_config("tenancy: {require_keys: true}\n")).required


def test_stored_keys_join_the_config_and_a_key_of_a_missing_team_is_refused():
    directory = build_directory(parse_config(CONFIG))
    team = TeamEntry("ops", Limits(rpm=5), frozenset({"m"}), None, API)
    alone = KeyEntry("k-1", "made", digest_of("sk-made"), None, source=API)
    member = KeyEntry("k-2", "member", digest_of("sk-member"), "ops", source=API)
    of_config_team = KeyEntry("k-3", "joins", digest_of("sk-joins"), "search", source=API)
    orphan = KeyEntry("k-4", "orphan", digest_of("sk-orphan"), "gone", source=API)
    directory.set_stored([alone, member, of_config_team, orphan], [team])
    made = directory.lookup(bearer("sk-made"))
    assert made is not None and (made.key_id, made.source) == ("k-1", "api")
    member_tenant = directory.lookup(bearer("sk-member"))
    assert member_tenant is not None and member_tenant.team == team.team() and not member_tenant.may_use("x")
    joined = directory.lookup(bearer("sk-joins"))
    assert joined is not None and joined.team is not None and joined.team.limits.rpm == 1000
    assert directory.lookup(bearer("sk-orphan")) is None
    assert directory.lookup(bearer("sk-search")) is not None  # the config's keys stay
    assert directory.counts() == {"config": 3, "api": 4}
    directory.set_stored([], [])
    assert directory.lookup(bearer("sk-made")) is None  # revoked: gone with the next copy


def test_a_reload_swaps_the_config_keys():
    directory = build_directory(parse_config(CONFIG))
    new = build_directory(parse_config("api_keys:\n  - key: sk-new\n"))
    directory.set_config(new.keys(), new.teams())
    assert directory.lookup(bearer("sk-search")) is None and directory.lookup(bearer("sk-new")) is not None


def test_prices_are_nano_dollars_per_token():
    prices = build_prices(parse_config(CONFIG))
    assert prices.of("llama-8b") == Price(input=100, cached_input=50, output=400)
    assert prices.of("llama-70b") == Price(input=1500, cached_input=1500, output=2000)  # cached: the input price
    assert prices.of("other") == Price()
    assert parse_config(CONFIG).tenancy.settings().default_max_tokens == 1024


def test_the_examples_of_docs_tenants_load():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "tenants.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", docs, re.S)
    assert blocks
    for block in blocks:
        config = parse_config(block, "tenants.md", env={"SEARCH_PROD_KEY": "sk-x"})
        build_directory(config)
        build_prices(config)
