"""``llmgw plan --load``: the autoscaler's decisions for a given load, run as the CLI; its argument parsers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from llmgw.commands.plan_autoscale import LoadError, parse_counts, parse_load

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nodes"
LLMGW = [sys.executable, "-m", "llmgw"]

CONFIG = """\
agents: {token: s3cret}
profiles:
  - {name: chat, engine: sim, model_path: tiny, served_model_name: chat-model}
  - {name: batch, engine: sim, model_path: tiny}
  - {name: fixed, engine: sim, model_path: tiny}
deployments:
  - profile: chat
    replicas: {min: 1, max: 6}
    autoscale: {priority: 5}
  - profile: batch
    replicas: {min: 0, max: 4}
  - profile: fixed
    replicas: 1
"""


def run_plan(tmp_path: Path, *args: str, config: str = CONFIG) -> subprocess.CompletedProcess:
    path = tmp_path / "llmgw.yaml"
    path.write_text(config)
    return subprocess.run([*LLMGW, "plan", "--config", str(path), *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def test_a_busy_load_over_the_utilisation_target_previews_the_step_ahead_of_a_queue(tmp_path):
    done = run_plan(tmp_path, "--load", "chat-model=0,inflight=3,busy=1.5", "--replicas", "chat=2", "--for", "120")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "chat (model chat-model): 2 -> 3 replicas (min 1, max 6); load: 0 queued, 3 in flight, busy 1.5 replicas" \
        in lines, lines
    up = next(line for line in lines if " up 2 -> 3: " in line)
    assert "busy 1.50 replicas: over 70% of 2 provisioned replicas for 5.0 s: 2 -> 3 replicas" in up, lines
    assert not any(" up 3 -> " in line for line in lines)  # 1.5 busy over 3 is under the target: one step


def test_a_load_previews_each_decision_with_its_reason_and_time(tmp_path):
    done = run_plan(tmp_path, "--load", "chat-model=20,kv=0.5", "--load", "batch=0,idle=100", "--replicas",
                    "batch=2", "--free-gpus", "3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("autoscale preview: 661 s of a constant load, a decision every 1 s, replicas ready 60 s "
                        "after their step; free GPUs: any 3")
    assert "chat (model chat-model): 1 -> 5 replicas (min 1, max 6); load: 20 queued, kv 0.5" in lines
    assert ("  +    5.0 s  up 1 -> 4: 20 requests queued over 1 provisioned replica (target 4 per replica) for "
            "5.0 s: 1 -> 4 replicas (5 needed; only 3 more fit the free GPUs)") in lines
    assert ("  +   11.0 s  take 4 -> 5: 20 requests queued over 4 provisioned replicas (target 4 per replica) for "
            "5.0 s, but 0 free GPUs and a replica needs 1 GPU: taking one from batch (idle): 4 -> 5") in lines
    assert "batch (model batch): 2 -> 0 replicas (min 0, max 4); load: 0 queued" in lines
    assert any(line.startswith("  +   11.0 s  give 2 -> 1: gives a replica to chat (idle;") for line in lines)
    assert ("  +  611.0 s  to_zero 1 -> 0: no request for batch for 600 s (idle_to_zero 600 s): back to min 0"
            in lines)
    assert not any("fixed" in line for line in lines)  # not autoscaled: not previewed


def test_free_gpus_come_from_the_nodes_after_the_current_replicas(tmp_path):
    done = run_plan(tmp_path, "--nodes", str(FIXTURES / "tiny-2gpu-a.json"), "--load", "chat=40", "--for", "10",
                    "--replicas", "batch=0")
    assert done.returncode == 0, done.stderr
    # 2 GPUs: chat-0 and fixed-0 hold them both; batch runs none and is idle, so chat cannot grow
    assert "free GPUs: any 0" in done.stdout.splitlines()[0]
    assert "no idle or lower-priority deployment of its GPU class is above its min to give one" in done.stdout


def test_json_lists_the_decisions(tmp_path):
    done = run_plan(tmp_path, "--json", "--load", "batch=3", "--replicas", "batch=0", "--for", "2")
    assert done.returncode == 0, done.stderr
    preview = json.loads(done.stdout)
    batch = next(d for d in preview["deployments"] if d["deployment"] == "batch")
    assert (batch["start"], batch["end"]) == (0, 1)
    assert [(d["at"], d["kind"], d["current"], d["desired"]) for d in batch["decisions"]] == [
        (0.0, "from_zero", 0, 1)]
    assert batch["decisions"][0]["reason"] == "3 requests waiting for batch, which has no replica: starting one at once"


@pytest.mark.parametrize("args, message", [
    (["--load", "chat"], "expected MODEL=QUEUED"),
    (["--load", "chat=many"], "--load chat queued: expected a whole number, got 'many'"),
    (["--load", "chat=1,kv=2"], "--load chat kv: must be between 0 and 1, got '2'"),
    (["--load", "chat=1,speed=2"], "unknown option 'speed=2' (options: kv, ttft, inflight, idle, busy)"),
    (["--load", "nobody=1"], "--load: no deployment of nobody in"),
    (["--load", "chat=1", "--replicas", "chat"], "--replicas 'chat': expected NAME=N"),
    (["--load", "chat=1", "--free-gpus", "h100=-1"], "--free-gpus h100=-1: must be at least 0"),
])
def test_bad_arguments_exit_2_naming_them(tmp_path, args, message):
    done = run_plan(tmp_path, *args)
    assert done.returncode == 2 and message in done.stderr, (done.stdout, done.stderr)


def test_a_config_without_an_autoscaled_deployment_exits_2(tmp_path):
    done = run_plan(tmp_path, "--load", "fixed=3", config=CONFIG.split("  - profile: chat")[0]
                    + "  - {profile: fixed, replicas: 1}\n")
    assert done.returncode == 2 and "has no autoscaled deployment (replicas: {min, max})" in done.stderr


def test_the_parsers_read_what_they_document():
    assert parse_load("m=3,kv=0.9,ttft=0.5,inflight=7,idle=60,busy=1.5").__dict__ == {
        "model": "m", "queued": 3, "inflight": 7, "kv_usage": 0.9, "ttft_attainment": 0.5, "idle": 60.0,
        "busy": 1.5}
    assert parse_counts(["4", "h100=2"], "--free-gpus", classes=True) == {None: 4, "h100": 2}


@given(st.text(max_size=60))
def test_parse_load_reads_anything_or_says_why(text):
    try:
        load = parse_load(text)
    except LoadError as exc:
        assert str(exc)
    else:
        assert load.queued >= 0 and load.model


@given(st.lists(st.text(max_size=20), max_size=4), st.booleans())
def test_parse_counts_reads_anything_or_says_why(items, classes):
    try:
        counts = parse_counts(items, "--free-gpus", classes=classes)
    except LoadError as exc:
        assert str(exc)
    else:
        assert all(count >= 0 for count in counts.values())


def test_the_documented_example_loads_and_previews_as_shown(tmp_path):
    docs = (REPO / "docs" / "autoscaling.md").read_text()
    config = docs.split("```yaml\n", 1)[1].split("```", 1)[0]
    console = docs.split("```console\n", 1)[1].split("```", 1)[0].splitlines()
    command = " ".join(line.rstrip("\\").strip() for line in console[:2]).removeprefix("$ llmgw plan ").split()
    assert command[:2] == ["--config", "fleet.yaml"]
    path = tmp_path / "fleet.yaml"
    path.write_text(config)
    done = subprocess.run([*LLMGW, "plan", "--config", str(path), *command[2:]], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={"LLMGW_AGENT_TOKEN": "t", "PATH": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == console[2:]


def test_free_gpus_by_class_are_the_ones_no_replica_holds_on_schedulable_nodes():
    from llmgw.autoscale.gpus import free_gpus_of
    from llmgw.commands.plan import nodes_from_fixtures
    from llmgw.config import parse_config

    config = parse_config("""
agents: {token: t}
profiles: [{name: l4, engine: sim, model_path: tiny, gpu_class: L4}, {name: h, engine: sim, model_path: tiny,
           gpu_class: H100}]
deployments: [{profile: l4, replicas: {min: 0, max: 2}}, {profile: h, replicas: {min: 0, max: 2}}]
""")
    l4, dgx = nodes_from_fixtures([str(FIXTURES / "l4-2gpu.json"), str(FIXTURES / "dgx-h100-8gpu.json")])
    assert free_gpus_of([l4, dgx], config) == {None: 10, "L4": 2, "H100": 8}
    l4.used_gpus.add(l4.gpus[0].index)
    dgx.schedulable = False
    assert free_gpus_of([l4, dgx], config) == {None: 1, "L4": 1, "H100": 0}
