"""The ``state`` section: where several gateways share their state (docs/configuration.md#state)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from llmgw.cluster.link import client_options, describe_backend, sentinel_options
from llmgw.config import ConfigError, parse_config
from llmgw.config.addresses import parse_redis_url


def signed(text: str) -> str:
    """``text`` with a cluster secret (a Redis backend needs one), on a line after the others."""
    return text + "  secret_env: LLMGW_CLUSTER_SECRET\n" if "backend: redis" in text and "secret_env" not in text \
        else text


def state(text: str):
    return parse_config("state:\n" + signed(text), filename="llmgw.yaml").state


def errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config("state:\n" + signed(text), filename="llmgw.yaml")
    return [str(issue) for issue in caught.value.errors]


def test_redis_needs_a_cluster_secret_naming_the_file_line_and_key():
    with pytest.raises(ConfigError) as caught:
        parse_config("log_level: info\nstate:\n  backend: redis\n  url: redis://127.0.0.1\n", filename="llmgw.yaml")
    [error] = [str(issue) for issue in caught.value.errors]
    assert error.startswith("llmgw.yaml:2: state.secret_env: backend redis needs a cluster secret: name the "
                            "environment variable that holds it")
    assert state("  backend: redis\n  url: redis://127.0.0.1\n  secret_env: S\n").secret_env == "S"
    assert state("  secret_env: S\n").backend == "local"  # alone, a secret is allowed and unused


def test_the_default_is_this_process_alone():
    settings = parse_config("{}", filename="llmgw.yaml").state
    assert settings.backend == "local" and not settings.shared


@pytest.mark.parametrize("url, normal", [
    ("redis://127.0.0.1", "redis://127.0.0.1:6379/0"),
    ("redis://Redis.example:7000/3", "redis://redis.example:7000/3"),
    ("rediss://[::1]:6380", "rediss://[::1]:6380/0"),
    ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
])
def test_redis_urls_are_normalised(url, normal):
    assert state(f"  backend: redis\n  url: {url}\n").url == normal


@pytest.mark.parametrize("url, message", [
    ("redis://:secret@h:1", "put the password in the environment (state.password_env), not in the URL"),
    ("redis://user@h:1", "put the user name in state.username, not in the URL"),
    ("http://h:1", "the URL must start with redis://, rediss:// or unix://"),
    ("redis://h:0", "the URL's port must be a number from 1 to 65535"),
    ("redis://h:1/db", "the URL's path is the database number, e.g. redis://127.0.0.1:6379/0"),
    ("unix://relative.sock", "write a Unix socket as unix:///absolute/path/to/redis.sock"),
])
def test_bad_redis_urls_name_the_key_and_never_echo_the_url(url, message):
    [error] = errors(f"  backend: redis\n  url: {url}\n")
    assert error == f"llmgw.yaml:3: state.url: {message}"
    assert "secret" not in error


def test_redis_needs_a_url_and_load_reports_must_outlive_their_interval():
    assert errors("  backend: redis\n") == [
        "llmgw.yaml:1: state.url: backend redis needs the server's URL, e.g. redis://127.0.0.1:6379/0 "
        "(or state.sentinel)"]
    assert errors("  load_interval: 1s\n  load_ttl: 2s\n") == [
        "llmgw.yaml:3: state.load_ttl: must be at least 4 x load_interval: a live gateway's load must not expire"]


@given(st.text(max_size=80))
def test_any_text_is_a_redis_url_or_a_value_error(text):
    try:
        url = parse_redis_url(text)
    except ValueError:
        return
    assert url.startswith(("redis://", "rediss://", "unix:///"))


def test_client_options_take_the_password_from_the_environment_and_the_socket_from_the_url():
    settings = state("  backend: redis\n  url: unix:///tmp/r.sock?db=3\n  password_env: PW\n  username: gw\n")
    options = client_options(settings, {"PW": "s3cret"})
    assert options["unix_socket_path"] == "/tmp/r.sock" and options["db"] == 3
    assert options["password"] == "s3cret" and options["username"] == "gw"
    with pytest.raises(ValueError, match="state.password_env names PW, which is not set"):
        client_options(settings, {})
    tcp = client_options(state("  backend: redis\n  url: redis://h:7000/2\n"), {})
    assert (tcp["host"], tcp["port"], tcp["db"]) == ("h", 7000, 2) and "password" not in tcp


SENTINEL = "  backend: redis\n  sentinel:\n    service: main\n    addresses: [\"10.0.0.1:26379\", \"[::1]:26380\"]\n"


def test_a_sentinel_section_replaces_the_url():
    settings = state(SENTINEL + "    database: 4\n    password_env: SPW\n  password_env: PW\n")
    assert settings.sentinel.service == "main" and [str(a) for a in settings.sentinel.addresses] == [
        "10.0.0.1:26379", "[::1]:26380"]
    primary = client_options(settings, {"PW": "p", "SPW": "s"})
    assert primary["db"] == 4 and primary["password"] == "p" and "host" not in primary
    assert sentinel_options(settings, {"PW": "p", "SPW": "s"})["password"] == "s"
    with pytest.raises(ValueError, match="state.sentinel.password_env names SPW, which is not set"):
        sentinel_options(settings, {"PW": "p"})
    assert describe_backend(settings) == "sentinel service main via 10.0.0.1:26379,[::1]:26380"


def test_sentinel_errors_name_the_key():
    assert errors(SENTINEL + "  url: redis://h:1\n") == [
        "llmgw.yaml:3: state.sentinel: give either url or sentinel: with sentinel, the sentinels say where the "
        "primary is"]
    assert errors("  backend: redis\n  sentinel:\n    service: main\n    addresses: [\"h:0\"]\n") == [
        "llmgw.yaml:5: state.sentinel.addresses: a sentinel's port is not 0"]
    many = ", ".join(f'"h:{port}"' for port in range(1, 18))
    assert errors(f"  backend: redis\n  sentinel:\n    service: main\n    addresses: [{many}]\n") == [
        "llmgw.yaml:5: state.sentinel.addresses: must have at most 16 entries"]
    assert errors("  backend: redis\n  sentinel:\n    service: main\n    addresses: []\n") == [
        "llmgw.yaml:5: state.sentinel.addresses: name at least one sentinel, e.g. 10.0.0.1:26379"]
