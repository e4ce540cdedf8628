"""API key names (defaults, rules, errors that never echo a key), the bearer check naming the key's holder, what a
reload leaves for a restart, and the ``/ready`` query parser (property-based)."""

from __future__ import annotations

from urllib.parse import urlencode

import pytest
from hypothesis import given, strategies as st

from llmgw.config import ConfigError, parse_config
from llmgw.gateway.bearer import BearerTokens
from llmgw.gateway.readiness import MAX_QUERY_MODELS, QueryError, query_models
from llmgw.gateway.reload_guard import RESTART_KEYS, restart_required

SECRET = "sk-very-secret-0123456789"


def test_api_keys_without_a_name_are_named_by_their_place():
    config = parse_config(f"api_keys:\n  - key: a-{SECRET}\n  - key: b-{SECRET}\n    name: web\n"
                          f"  - key: c-{SECRET}\n")
    assert [key.name for key in config.api_keys] == ["key-1", "web", "key-3"]
    assert SECRET not in repr(config.api_keys)


@pytest.mark.parametrize("entries, key, message", [
    ("  - key: {s}\n    name: none\n", "api_keys[0].name", "'none' stands for requests without a valid key"),
    ("  - key: {s}\n    name: 'web front'\n", "api_keys[0].name", "a name of up to 64 letters"),
    ("  - key: {s}\n    name: " + "n" * 65 + "\n", "api_keys[0].name", "a name of up to 64 letters"),
    ("  - key: {s}\n  - key: x{s}\n    name: key-1\n", "api_keys[1].name", "duplicate API key name: same as "
                                                                         "api_keys[0].name on line 2"),
    ("  - key: {s}\n    name: web\n  - key: {s}\n    name: app\n", "api_keys[1].key", "duplicate API key"),
])
def test_a_key_names_error_names_the_key_by_its_place_never_by_its_value(entries, key, message):
    with pytest.raises(ConfigError) as caught:
        parse_config("api_keys:\n" + entries.format(s=SECRET))
    [issue] = caught.value.errors
    assert issue.key == key and message in issue.message, str(issue)
    assert SECRET not in str(caught.value) and SECRET not in repr(caught.value.errors)


def test_the_bearer_check_names_the_holder_of_the_key():
    tokens = BearerTokens([("web", "sk-one"), ("batch", "sk-two")])
    assert tokens.holder("Bearer sk-two") == "batch" and tokens.holder("bearer  sk-one ") == "web"
    assert tokens.holder("Bearer sk-three") is None and tokens.holder(None) is None
    assert tokens.holder("Basic sk-one") is None and not tokens.accepts("Bearer ")
    assert not BearerTokens([])


def test_restart_required_compares_with_the_started_config():
    started = parse_config("listen: 127.0.0.1:8000\napi_keys:\n  - key: a\n")
    rotated = parse_config("listen: 127.0.0.1:8000\napi_keys:\n  - key: b\naccess_log: true\n"
                           "limits:\n  retries: 1\n  max_connections: 50\n")
    assert restart_required(started, rotated) == ("limits.max_connections",)
    moved = parse_config("listen: 127.0.0.1:9000\nhealth:\n  interval: 1s\nlog_level: debug\n")
    assert restart_required(started, moved) == ("listen", "health", "log_level")
    assert restart_required(started, started) == ()
    assert len(set(RESTART_KEYS)) == len(RESTART_KEYS)


names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)


@given(st.lists(names, max_size=MAX_QUERY_MODELS))
def test_a_ready_query_gives_back_the_models_it_names(models):
    query = urlencode([("model", name) for name in models])
    assert query_models(query) == list(dict.fromkeys(models))


@given(st.text(max_size=300))
def test_any_ready_query_is_read_or_refused_with_a_query_error(query):
    try:
        models = query_models(query)
    except QueryError as exc:
        assert str(exc)
    else:
        assert len(models) <= MAX_QUERY_MODELS and all(models)


def test_a_ready_query_is_bounded_and_takes_only_model():
    assert query_models("") == []
    with pytest.raises(QueryError, match="at most 64 models"):
        query_models("&".join(f"model=m{i}" for i in range(MAX_QUERY_MODELS + 1)))
    for bad in ("model=", "other=x", "model=a&&model=b", "modela"):
        with pytest.raises(QueryError):
            query_models(bad)
