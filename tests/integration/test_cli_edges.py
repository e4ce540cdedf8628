"""A user's first hour with the CLI, as real processes: addresses that cannot be listened on, log options."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import trio

from llmgw.testing.processes import llmgw_command

CONFIG = "log_level: info\n"  # nothing to probe: stderr holds only what the command says


@pytest.fixture
def busy_port():
    """A port some other program is listening on for the whole test."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        yield squatter.getsockname()[1]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(llmgw_command(*args), capture_output=True, text=True, timeout=timeout)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_serve_on_a_busy_data_port_says_so_in_one_line(tmp_path, busy_port):
    (tmp_path / "llmgw.yaml").write_text(CONFIG)
    result = run("serve", "--config", str(tmp_path / "llmgw.yaml"), "--listen", f"127.0.0.1:{busy_port}",
                 "--control-listen", "127.0.0.1:0", "--log-level", "warning")
    assert result.returncode == 2
    assert one_line(result.stderr) == f"llmgw serve: cannot listen on 127.0.0.1:{busy_port}: address already in use"


def test_serve_on_a_busy_control_port_says_so_in_one_line(tmp_path, busy_port):
    (tmp_path / "llmgw.yaml").write_text(CONFIG)
    result = run("serve", "--config", str(tmp_path / "llmgw.yaml"), "--listen", "127.0.0.1:0",
                 "--control-listen", f"127.0.0.1:{busy_port}", "--log-level", "warning")
    assert result.returncode == 2
    assert one_line(result.stderr) == f"llmgw serve: cannot listen on 127.0.0.1:{busy_port}: address already in use"


def test_serve_on_an_address_of_no_interface_here(tmp_path):
    (tmp_path / "llmgw.yaml").write_text(CONFIG)
    result = run("serve", "--config", str(tmp_path / "llmgw.yaml"), "--listen", "192.0.2.7:0",
                 "--control-listen", "127.0.0.1:0", "--log-level", "warning")
    assert result.returncode == 2
    assert one_line(result.stderr) == "llmgw serve: cannot listen on 192.0.2.7:0: cannot assign requested address"


def test_sim_on_a_busy_port_and_a_busy_event_port(busy_port):
    result = run("sim", "--port", str(busy_port))
    assert result.returncode == 2
    assert one_line(result.stderr) == f"llmgw sim: cannot listen on 127.0.0.1:{busy_port}: address already in use"
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{busy_port}"})
    result = run("sim", "--port", "0", "--kv-events-config", events)
    assert result.returncode == 2
    assert one_line(result.stderr) == f"llmgw sim: cannot listen on tcp://*:{busy_port}: address already in use"


def test_agent_with_an_address_of_no_interface_here(tmp_path):
    result = run("agent", "--join", "http://127.0.0.1:9", "--token", "t", "--state-dir", str(tmp_path),
                 "--address", "192.0.2.7")
    assert result.returncode == 2
    assert one_line(result.stderr) == "llmgw agent: cannot listen on 192.0.2.7: cannot assign requested address"


@pytest.mark.parametrize("command", [["serve"], ["agent", "--join", "http://127.0.0.1:9", "--token", "t"], ["sim"]])
def test_an_unknown_log_level_is_a_usage_error(command):
    result = run(*command, "--log-level", "bogus")
    assert result.returncode == 2
    assert "argument --log-level: invalid choice: 'bogus'" in result.stderr


def test_json_log_format_writes_one_object_per_line(busy_port):
    result = run("sim", "--port", str(busy_port), "--log-format", "json", "--log-level", "debug",
                 "--max-num-seqs", "1", "--enforce-eager")  # an ignored vLLM flag is logged at info
    records = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert records, result.stderr
    assert {"ts", "level", "logger", "message"} <= set(records[0])
    assert records[0]["logger"] == "llmgw.sim" and "--enforce-eager" in records[0]["message"]


def test_dev_keeps_the_callers_working_directory_for_file_arguments(tmp_path):
    (tmp_path / "llmgw.yaml").write_text(CONFIG)
    dev = Path(__file__).resolve().parents[2] / "dev"
    result = subprocess.run([str(dev), "config", "check", "llmgw.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("llmgw.yaml: ok")


async def test_config_log_format_json_makes_serve_log_json(start_llmgw):
    gw = await start_llmgw("log_format: json\nhealth:\n  interval: 0.2s\n  failures_to_down: 1\n"
                           "models:\n  - name: tiny\n    replicas:\n      - url: http://127.0.0.1:9\n")
    with trio.fail_after(20):
        while not any("is now down" in line for line in gw.lines):
            await trio.sleep(0.05)
    line = next(line for line in gw.lines if "is now down" in line)
    record = json.loads(line)
    assert record["level"] == "warning" and record["logger"] == "llmgw.router.health"


def test_a_redis_password_variable_that_is_not_set_stops_the_start_naming_it(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMGW_TEST_REDIS_PW", raising=False)
    (tmp_path / "llmgw.yaml").write_text(CONFIG + "state:\n  backend: redis\n  url: redis://127.0.0.1:1\n"
                                         "  password_env: LLMGW_TEST_REDIS_PW\n"
                                         "  secret_env: LLMGW_TEST_CLUSTER_SECRET\n")
    result = run("serve", "--config", str(tmp_path / "llmgw.yaml"), "--listen", "127.0.0.1:0",
                 "--control-listen", "127.0.0.1:0")
    assert result.returncode == 2
    assert one_line(result.stderr).endswith(
        "llmgw.yaml:5: state.password_env: state.password_env names LLMGW_TEST_REDIS_PW, which is not set")


def test_a_redis_backend_without_a_cluster_secret_stops_the_start_naming_the_file_line_and_key(tmp_path):
    """Without a secret anyone who can write to Redis steers routing (issue 29): refused at start, not run."""
    (tmp_path / "llmgw.yaml").write_text(CONFIG + "state:\n  backend: redis\n  url: redis://127.0.0.1:1\n")
    result = run("serve", "--config", str(tmp_path / "llmgw.yaml"), "--listen", "127.0.0.1:0",
                 "--control-listen", "127.0.0.1:0")
    assert result.returncode == 2
    assert f"{tmp_path / 'llmgw.yaml'}:2: state.secret_env: backend redis needs a cluster secret" in one_line(
        result.stderr), result.stderr


def test_role_gateway_without_a_shared_state_backend_is_refused(tmp_path):
    (tmp_path / "llmgw.yaml").write_text(CONFIG)
    result = run("serve", "--config", str(tmp_path / "llmgw.yaml"), "--role", "gateway", "--listen", "127.0.0.1:0",
                 "--control-listen", "127.0.0.1:0")
    assert result.returncode == 2
    assert "--role gateway follows a cluster's shared state: it needs backend: redis" in one_line(result.stderr)
