"""Hostile config files are bounded: alias bombs, deep nesting, huge files and huge numbers are errors naming
file, line and key, found fast and in little memory; never a traceback."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from llmgw.config import ConfigError, load_config, parse_config
from llmgw.config.loading import MAX_FILE_BYTES
from llmgw.config.yamlpos import MAX_ALIAS_NODES, MAX_DEPTH

LLMGW = Path(sys.executable).parent / "llmgw"

BILLION_LAUGHS = """\
listen: 127.0.0.1:8000
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def only_issue(exc: pytest.ExceptionInfo[ConfigError]):
    assert len(exc.value.errors) == 1, exc.value.errors
    return exc.value.errors[0]


def test_alias_bomb_is_refused_in_little_memory(tmp_path):
    path = tmp_path / "lol.yaml"
    path.write_text(BILLION_LAUGHS)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as exc:
            load_config(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    issue = only_issue(exc)
    assert issue.file == str(path)
    assert issue.line == 7  # the first list whose expansion passes the budget: "f: [*e, ...]" (9^6 > 100,000)
    assert issue.key.startswith("f[")
    assert f"more than {MAX_ALIAS_NODES} nodes" in issue.message
    assert peak < 50 * 1024 * 1024, f"refusing the bomb took {peak} bytes"


def test_aliases_within_the_budget_still_work():
    text = """\
models:
  - name: a
    replicas: &replicas
      - url: http://127.0.0.1:9001
      - url: http://127.0.0.1:9002
  - name: b
    replicas: *replicas
"""
    config = parse_config(text)
    assert [r.url for r in config.models[1].replicas] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


@pytest.mark.parametrize("opening, closing", [("[", "]"), ("{a: ", "}")])
def test_5000_deep_flow_nesting_is_a_config_error(opening, closing):
    text = "listen: 127.0.0.1:8000\nmodels: " + opening * 5000 + "1" + closing * 5000 + "\n"
    with pytest.raises(ConfigError) as exc:
        parse_config(text, "deep.yaml")
    issue = only_issue(exc)
    assert (issue.file, issue.line) == ("deep.yaml", 2)
    assert issue.key.startswith("models")
    assert f"nested deeper than {MAX_DEPTH} levels" in issue.message


def test_deep_block_nesting_names_the_key():
    lines = ["models:", "  - name: m", "    routing_options:"]
    lines += ["      " + "  " * depth + f"k{depth}:" for depth in range(MAX_DEPTH + 2)]
    with pytest.raises(ConfigError) as exc:
        parse_config("\n".join(lines) + " 1\n", "block.yaml")
    issue = only_issue(exc)
    assert issue.key.startswith("models[0].routing_options.k0.k1.k2")
    # root, models, models[0], then routing_options (line 4, k0) at depth 4: the mapping at depth MAX_DEPTH + 1
    # starts on line MAX_DEPTH + 1, under key k<MAX_DEPTH - 4>
    assert issue.line == MAX_DEPTH + 1
    assert issue.key.endswith(f".k{MAX_DEPTH - 4}")


def test_nesting_at_the_bound_is_read():
    depth = MAX_DEPTH - 4  # root mapping, models list, model mapping, routing_options
    options = "{a: " * depth + "1" + "}" * depth
    config = parse_config(f"models:\n  - name: m\n    routing_options: {options}\n"
                          "    replicas: [{url: 'http://127.0.0.1:9001'}]\n")
    value = config.models[0].routing_options
    for _ in range(depth - 1):
        value = value["a"]
    assert value == {"a": 1}


def test_a_file_above_the_size_bound_is_not_parsed(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    issue = only_issue(exc)
    assert issue.file == str(path)
    assert f"larger than {MAX_FILE_BYTES} bytes" in issue.message


@pytest.mark.parametrize("key, value, message", [
    ("limits.retries", "1" + "0" * 35, "must be at most 10"),
    ("limits.retries", "11", "must be at most 10"),
    ("limits.connect_timeout", "2000000", "must be at most 1 day"),
    ("limits.shutdown_grace", "25h", "must be at most 1 day"),
    ("limits.max_body_bytes", "1TiB", "must be at most 256MiB"),
    ("limits.max_header_bytes", "2MiB", "must be at most 1MiB"),
    ("limits.max_connections", "10000001", "must be at most 1000000"),
    ("limits.max_json_depth", "501", "must be at most 500"),
    ("health.failures_to_down", "1001", "must be at most 1000"),
    ("agents.heartbeat_interval", "48h", "must be at most 1 day"),
])
def test_every_numeric_key_has_an_upper_bound(key, value, message):
    section, name = key.split(".")
    with pytest.raises(ConfigError) as exc:
        parse_config(f"{section}:\n  {name}: {value}\n", "bounds.yaml")
    issue = only_issue(exc)
    assert (issue.file, issue.line, issue.key, issue.message) == ("bounds.yaml", 2, key, message)


def test_bounds_of_list_items_name_the_item():
    text = """\
models:
  - name: m
    max_model_len: 1000000000
    replicas:
      - url: http://127.0.0.1:9001
        weight: 100000
profiles:
  - {name: p, engine: sim, model_path: x, tp: 4096, cpu_threads: 100000}
deployments:
  - {profile: p, replicas: 20000}
"""
    with pytest.raises(ConfigError) as exc:
        parse_config(text, "items.yaml")
    found = {(issue.line, issue.key, issue.message) for issue in exc.value.errors}
    assert {
        (3, "models[0].max_model_len", "must be at most 100000000"),
        (6, "models[0].replicas[0].weight", "must be at most 1000"),
        (8, "profiles[0].tp", "must be at most 1024"),
        (8, "profiles[0].cpu_threads", "must be at most 4096"),
        (10, "deployments[0].replicas", "must be at most 10000"),
    } <= found


def test_a_key_with_a_bound_of_its_own_takes_values_up_to_it():
    # max_model_len's bound (100000000) is above MAX_COUNT: it replaces that bound, it does not add to it.
    config = parse_config("models:\n  - name: m\n    max_model_len: 10000000\n"
                          "    replicas: [{url: 'http://127.0.0.1:9001'}]\n")
    assert config.models[0].max_model_len == 10_000_000


def test_config_check_reports_an_alias_bomb_without_a_traceback(tmp_path):
    path = tmp_path / "lol.yaml"
    path.write_text(BILLION_LAUGHS)
    deep = tmp_path / "deep.yaml"
    deep.write_text("models: " + "[" * 5000 + "]" * 5000 + "\n")
    for bad, line in ((path, 7), (deep, 1)):
        result = subprocess.run([str(LLMGW), "config", "check", str(bad)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode != 0
        assert "Traceback" not in result.stderr + result.stdout
        assert f"{bad}:{line}:" in result.stderr + result.stdout


async def test_serve_and_reload_refuse_an_alias_bomb_and_keep_serving(start_llmgw, tmp_path):
    import httpx

    gw = await start_llmgw("log_level: warning\n")
    path = next(tmp_path.glob("llmgw-*.yaml"))
    path.write_text(BILLION_LAUGHS)
    async with httpx.AsyncClient(base_url=gw.control_url, timeout=30) as client:
        answer = await client.post("/admin/reload")
        assert answer.status_code == 422
        (error,) = answer.json()["errors"]
        assert error.startswith(f"{path}:7: f[")
        assert error.endswith(f": aliases expand to more than {MAX_ALIAS_NODES} nodes: write the values out, "
                              "or use fewer aliases")
        assert (await client.get("/health")).status_code == 200
    assert gw.process.returncode is None
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BILLION_LAUGHS)
    result = subprocess.run([str(LLMGW), "serve", "--config", str(bomb)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"{bomb}:7: f[" in result.stderr + result.stdout


@pytest.mark.parametrize("value, message", [
    ("1" * 5000, "cannot read the value: Exceeds the limit (4300 digits) for integer string conversion"),
    ("1.0e+999", "a duration must be a finite number"),
    (".nan", "a duration must be a finite number"),
])
def test_numbers_python_cannot_take_are_config_errors(value, message):
    key = "limits.retries" if "e" not in value and "nan" not in value else "limits.connect_timeout"
    with pytest.raises(ConfigError) as exc:
        parse_config(f"limits:\n  {key.split('.')[1]}: {value}\n", "n.yaml")
    issue = only_issue(exc)
    assert (issue.file, issue.line, issue.key) == ("n.yaml", 2, key)
    assert issue.message.startswith(message)


_yaml_keys = st.sampled_from(["listen", "models", "limits", "retries", "name", "replicas", "url", "routing_options",
                              "profiles", "deployments", "tp", "<<", "a", "x y", ""])
_yaml_scalars = st.one_of(
    st.sampled_from(["1", "-1", "1e35", "1" * 4400, ".inf", ".nan", "~", "yes", "${HOME}", "${X:-2}", "$${",
                     "'quoted'", "\"q\\u0000\"", "[", "]", "{", "}", "&a 1", "*a", "*b", "!!binary AAAA",
                     "!!python/object:os.system", "16MiB", "1h30m", "http://127.0.0.1:9001", "127.0.0.1:8000"]),
    st.text(max_size=12))


@st.composite
def yaml_documents(draw, depth: int = 0) -> str:
    if depth > 3 or draw(st.integers(0, 3)) == 0:
        return draw(_yaml_scalars)
    if draw(st.booleans()):
        items = draw(st.lists(yaml_documents(depth + 1), max_size=3))
        return "[" + ", ".join(items) + "]"
    pairs = draw(st.lists(st.tuples(_yaml_keys, yaml_documents(depth + 1)), max_size=3))
    return "{" + ", ".join(f"{key}: {value}" for key, value in pairs) + "}"


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(yaml_documents(), st.text(max_size=200),
                 st.lists(st.tuples(_yaml_keys, yaml_documents()), max_size=4).map(
                     lambda pairs: "".join(f"{key}: {value}\n" for key, value in pairs))))
def test_fuzzed_config_text_is_a_config_or_config_errors(text):
    try:
        parse_config(text, "fuzz.yaml", env={"X": "3"})
    except ConfigError as exc:
        assert exc.errors and all(issue.file == "fuzz.yaml" and issue.message for issue in exc.errors)
