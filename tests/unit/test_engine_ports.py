"""The agent's engine port range: ``--engine-ports LOW-HIGH`` read, checked, and used by the allocator."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, strategies as st

from llmgw.agent import ports as ports_module
from llmgw.agent.agent import Agent
from llmgw.agent.ports import DEFAULT_ENGINE_PORTS, ephemeral_overlap
from llmgw.commands import agent as agent_command
from llmgw.config.addresses import parse_port_range

ports = st.integers(1, 65535)


@given(ports, ports)
def test_a_written_range_reads_back_as_its_two_ports(a, b):
    low, high = sorted((a, b))
    assert parse_port_range(f"{low}-{high}") == (low, high)
    assert parse_port_range(f" {low}-{high}\n") == (low, high)


@given(st.text(max_size=20))
def test_any_text_is_a_range_or_a_value_error_saying_why(text):
    try:
        low, high = parse_port_range(text)
    except ValueError as exc:
        assert str(exc)
    else:
        assert 1 <= low <= high <= 65535


@pytest.mark.parametrize(("text", "says"), [
    ("21000", "not a port range LOW-HIGH"),
    ("21000:21999", "not a port range"),
    ("-5-10", "not a port range"),
    ("0-100", "ports are 1 to 65535"),
    ("60000-70000", "ports are 1 to 65535"),
    ("22000-21000", "the low port is above the high one"),
])
def test_a_bad_range_says_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=says):
        parse_port_range(text)


def test_the_ephemeral_range_is_reported_when_it_overlaps(tmp_path):
    proc = tmp_path / "ip_local_port_range"
    proc.write_text("32768\t60999\n")
    assert ephemeral_overlap(*DEFAULT_ENGINE_PORTS, range_file=proc) is None
    assert ephemeral_overlap(30000, 32768, range_file=proc) == (32768, 60999)
    assert ephemeral_overlap(60999, 61000, range_file=proc) == (32768, 60999)
    assert ephemeral_overlap(30000, 40000, range_file=tmp_path / "missing") is None


def test_the_agent_takes_engine_ports_from_its_range(tmp_path):
    agent = Agent("ws://127.0.0.1:9/agent", node_id="n", state_dir=tmp_path, address="127.0.0.1",
                  engine_ports=(41000, 41009))
    allocator = agent.shards.ports
    assert (allocator.start, allocator.end) == (41000, 41009)
    assert 41000 <= allocator.allocate() <= 41009
    default = Agent("ws://127.0.0.1:9/agent", node_id="m", state_dir=tmp_path / "m", address="127.0.0.1")
    assert (default.shards.ports.start, default.shards.ports.end) == DEFAULT_ENGINE_PORTS


def test_a_bad_engine_ports_flag_exits_2_naming_it(capsys, tmp_path):
    code = agent_command.main(["--join", "http://127.0.0.1:9", "--token", "t", "--state-dir", str(tmp_path),
                               "--engine-ports", "9000-8000"])
    assert code == 2
    assert "llmgw agent: --engine-ports '9000-8000': the low port is above the high one" in capsys.readouterr().err


def test_an_overlap_with_the_ephemeral_range_is_logged_once_with_the_fix(tmp_path, monkeypatch, caplog):
    proc = tmp_path / "ip_local_port_range"
    proc.write_text("32768 60999\n")
    monkeypatch.setattr(ports_module, "EPHEMERAL_RANGE_FILE", proc)
    with caplog.at_level(logging.WARNING, logger="llmgw.agent"):
        agent_command.warn_if_ephemeral(None)
        agent_command.warn_if_ephemeral((21000, 21999))
        assert caplog.messages == []
        agent_command.warn_if_ephemeral((30000, 40000))
    (message,) = caplog.messages
    assert "--engine-ports 30000-40000 overlaps the kernel's ephemeral ports 32768-60999" in message
    assert "choose a range outside it" in message


def test_the_embedded_agents_range_is_a_config_key_whose_errors_name_file_line_and_key():
    from llmgw.config import ConfigError, parse_config

    assert parse_config("agents:\n  engine_ports: 21000-21099\n", filename="llmgw.yaml").agents.engine_ports == (
        21000, 21099)
    assert parse_config("{}", filename="llmgw.yaml").agents.engine_ports is None
    with pytest.raises(ConfigError) as caught:
        parse_config("agents:\n  engine_ports: 9000-8000\n", filename="llmgw.yaml")
    assert [str(issue) for issue in caught.value.errors] == [
        "llmgw.yaml:2: agents.engine_ports: the low port is above the high one"]
