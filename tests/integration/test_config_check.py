"""``llmgw config check`` as a real process: every error of a file in one pass, plugins included."""

from __future__ import annotations

import subprocess
import textwrap

from llmgw.testing.processes import llmgw_command

ALL_WRONG = textwrap.dedent("""\
    listen: 127.0.0.1:99999
    models:
      - name: a
        routing: nosuchtier
        replicas:
          - url: http://127.0.0.1:9001
      - name: b
        routing: prefix_tree
        routing_options: {bogus_option: 1}
        replicas:
          - url: ftp://x
    profiles:
      - name: p
        engine: tensorrt
        model_path: /m
        routing: kv_indx
    agents:
      embedded: true
    deployments:
      - profile: p
        replicas: 1
    """)


def check(tmp_path, text: str) -> subprocess.CompletedProcess:
    (tmp_path / "llmgw.yaml").write_text(text)
    return subprocess.run(llmgw_command("config", "check", "llmgw.yaml"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)


def test_structural_and_plugin_errors_are_reported_together(tmp_path):
    result = check(tmp_path, ALL_WRONG)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "llmgw.yaml:1: listen: the port must be a number from 0 to 65535",
        "llmgw.yaml:4: models[0].routing: no routing tier named 'nosuchtier' (known: kv_index, prefix_tree, "
        "round_robin)",
        "llmgw.yaml:9: models[1].routing_options: unknown key 'bogus_option' for routing: prefix_tree "
        "(see docs/routing.md)",
        "llmgw.yaml:11: models[1].replicas[0].url: the URL must start with http:// or https://",
        "llmgw.yaml:14: profiles[0].engine: no engine named 'tensorrt' (known: sim, vllm)",
        "llmgw.yaml:16: profiles[0].routing: no routing tier named 'kv_indx' (known: kv_index, prefix_tree, "
        "round_robin)",
    ]


def test_an_unknown_engine_alone_fails_the_check(tmp_path):
    result = check(tmp_path, "profiles:\n  - name: p\n    engine: vlm\n    model_path: /m\n")
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["llmgw.yaml:3: profiles[0].engine: no engine named 'vlm' (known: sim, vllm)"]


def test_an_unknown_profile_tier_alone_fails_the_check(tmp_path):
    result = check(tmp_path, "profiles:\n  - name: p\n    engine: sim\n    model_path: /m\n    routing: fancy\n")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "llmgw.yaml:5: profiles[0].routing: no routing tier named 'fancy' (known: kv_index, prefix_tree, round_robin)"]


def test_serve_refuses_an_unknown_engine_with_the_same_line(tmp_path):
    (tmp_path / "llmgw.yaml").write_text("profiles:\n  - name: p\n    engine: vlm\n    model_path: /m\n")
    result = subprocess.run(llmgw_command("serve", "--config", "llmgw.yaml"), cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "llmgw serve: llmgw.yaml:3: profiles[0].engine: no engine named 'vlm' (known: sim, vllm)"]
