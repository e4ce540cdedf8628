"""Engines left running on exit, with real processes: ``serve`` and ``agent`` say how many keep running and how to
stop them; ``llmgw down`` stops them (and refuses while an agent holds their state dir); ``--stop-engines`` stops
them at exit; a demo start and stop logs each state change once."""

from __future__ import annotations

import json
import re
import signal
from collections import Counter

import pytest
import trio

from llmgw.agent.leftover import running_engines
from llmgw.procgroup import process_start_time
from llmgw.testing.cluster import AGENTS, TOKEN, embedded, shard_pids
from llmgw.testing.processes import llmgw_command

pytestmark = pytest.mark.slow
STATE_LINE = re.compile(r"shard (\S+) (?:\(generation \d+\)|on \S+) is (\w+):")

SIM = """
profiles:
  - name: tiny-sim
    engine: sim
    model_path: tiny
    served_model_name: tiny
deployments:
  - profile: tiny-sim
    replicas: 2
"""


def gone(pid: int) -> bool:
    return process_start_time(pid) is None  # exited (a zombie waiting for init counts as gone)


async def down(*args: str) -> trio.Process:
    return await trio.run_process(llmgw_command("down", *args), capture_stdout=True, capture_stderr=True,
                                  check=False)


async def stop(proc, sig: int = signal.SIGINT) -> int:
    proc.kill(sig)
    return await proc.wait_exit(30)


async def test_serve_says_how_many_engines_keep_running_and_down_stops_them(cluster):
    state = cluster.tmp_path / "local"
    cluster.write_config(embedded(state) + SIM)
    serve = await cluster.start_serve()
    pids = list(shard_pids(await cluster.settled(2)).values())
    assert await stop(serve) == 0
    path = cluster.config_path
    assert (f"llmgw serve stopped; 2 engines keep running for the next 'llmgw serve --config {path}' to adopt; "
            f"stop them with: llmgw down --config {path}") in serve.lines
    assert not any(gone(pid) for pid in pids)

    result = await down("--config", str(path), "--grace", "10")
    out = result.stdout.decode().splitlines()
    assert result.returncode == 0, result.stderr
    assert sorted(line.split(": ")[1] for line in out[:-1]) == ["terminated", "terminated"]
    assert out[-1] == f"llmgw down: 2 engines stopped in {state}"
    assert all(gone(pid) for pid in pids)
    assert json.loads((state / "shards.json").read_text())["shards"] == {}

    again = await down("--config", str(path))
    assert again.returncode == 0 and again.stdout.decode().splitlines() == [f"llmgw down: 0 engines stopped in {state}"]


async def test_serve_with_stop_engines_leaves_nothing_running(cluster):
    cluster.write_config(embedded(cluster.tmp_path / "local") + SIM)
    serve = await cluster.spawn("llmgw serve", llmgw_command("serve", "--config", str(cluster.config_path),
                                                             "--stop-engines"), "llmgw listening on ")
    pids = list(shard_pids(await cluster.settled(2)).values())
    assert await stop(serve, signal.SIGTERM) == 0
    assert all(gone(pid) for pid in pids)
    assert running_engines(cluster.tmp_path / "local") == []
    assert not any("keep running" in line for line in serve.lines)


async def test_an_agent_says_what_keeps_running_and_down_waits_for_it_to_stop(cluster):
    cluster.write_config(AGENTS + SIM.replace("replicas: 2", "replicas: 1"))
    await cluster.start_serve()
    agent = await cluster.start_agent("a", "cpu-only")
    pid, = shard_pids(await cluster.settled(1)).values()
    state = cluster.tmp_path / "agent-a"

    refused = await down("--state-dir", str(state))
    assert refused.returncode == 2
    assert refused.stderr.decode().strip() == (
        f"llmgw down: state dir {state} is in use by pid {agent.pid} (llmgw agent); stop that process first, or give "
        "this one another state dir")
    assert not gone(pid)

    assert await stop(agent) == 0
    assert (f"llmgw-agent a stopped; 1 engine keeps running for the next 'llmgw agent --state-dir {state}' to "
            f"adopt; stop it with: llmgw down --state-dir {state}") in agent.lines
    result = await down("--state-dir", str(state), "--grace", "10")
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().splitlines()[-1] == f"llmgw down: 1 engine stopped in {state}"
    assert gone(pid)


async def test_an_agent_with_stop_engines_stops_them_when_it_exits(cluster):
    cluster.write_config(AGENTS + SIM.replace("replicas: 2", "replicas: 1"))
    await cluster.start_serve()
    argv = llmgw_command("agent", "--join", cluster.control_url, "--token", TOKEN, "--node-id", "a",
                         "--state-dir", str(cluster.tmp_path / "agent-a"), "--discovery", "cpu", "--stop-engines")
    agent = await cluster.spawn("agent a", argv, " connected to ")
    pid, = shard_pids(await cluster.settled(1)).values()
    assert await stop(agent, signal.SIGTERM) == 0
    assert "llmgw-agent a stopped" in agent.lines
    assert gone(pid)


async def test_a_demo_start_and_stop_logs_each_state_change_once(cluster):
    demo = await cluster.spawn("demo", llmgw_command("serve", "--listen", "127.0.0.1:0", "--control-listen",
                                                     "127.0.0.1:0", "--demo-replicas", "2"), "llmgw listening on ")
    assert await stop(demo) == 0
    logged = [line for line in demo.lines if " INFO " in line or " WARNING " in line or " ERROR " in line]
    assert all(" INFO " in line for line in logged), "\n".join(logged)  # a clean start and stop: nothing to warn of
    states = Counter()  # (shard, state) -> lines, from the agent's supervisor or the control side's inventory
    for line in logged:
        if match := STATE_LINE.search(line):
            states[match.groups()] += 1
    assert sorted(Counter(state for _, state in states).items()) == [("ready", 2), ("starting", 2), ("stopped", 2)]
    assert set(states.values()) == {1}, states
    assert len(logged) <= 16, "\n".join(logged)  # one line of the demo, a few per engine: not a wall of text
