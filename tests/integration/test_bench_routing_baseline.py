"""``llmgw bench routing --baseline DIR``: arms ``NAME@baseline`` run the gateway of another checkout, beside this
checkout's arms, on the same simulators and requests.

The baseline here is a copy of this very checkout's ``llmgw`` package in another folder: each arm's gateway
announces the ``llmgw`` package it imported, so the report says which code ran, and the copy's must be the
baseline's. A config the baseline does not read is refused by the baseline's own check before any run.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import trio

import llmgw

pytestmark = pytest.mark.slow

SYSTEM = "You answer questions about the shared handbook. " + "the quick brown fox jumps over the lazy dog " * 20


def copy_of_this_checkout(folder: Path) -> Path:
    """This checkout's llmgw package (the one this test imports) copied into ``folder``: a checkout of its own."""
    shutil.copytree(Path(llmgw.__file__).parent, folder / "llmgw", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def write_trace(path: Path) -> int:
    lines = [{"id": f"s{s}-t{t}", "session": f"s{s}", "max_tokens": 8,
              "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"q {s} {t}"}]}
             for s in range(2) for t in range(2)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


async def run_bench(*args: str, timeout: float = 240):
    argv = [sys.executable, "-m", "llmgw", "bench", "routing", *args]
    with trio.fail_after(timeout):
        return await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)


async def test_baseline_arms_run_the_other_checkouts_gateway_on_the_same_requests(tmp_path):
    base = copy_of_this_checkout(tmp_path / "base")
    requests = write_trace(tmp_path / "trace.jsonl")
    workload = f"trace:{tmp_path / 'trace.jsonl'}"
    out = tmp_path / "routing.json"
    done = await run_bench("--workload", workload, "--arms", "round_robin,kv_index", "--baseline", str(base),
                           "--concurrency", "2", "--repeats", "1", "--replicas", "2", "--time-scale", "0.05",
                           "--json", str(out))
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["baseline"] == str(base.resolve())
    assert report["settings"]["config_omitted"] == []  # the same code reads every key this one writes
    arms = report["workloads"][workload]["arms"]
    # without a NAME@baseline in --arms, every llmgw arm is followed by its twin
    assert list(arms) == ["round_robin", "round_robin@baseline", "kv_index", "kv_index@baseline"]
    ours = str(Path(llmgw.__file__).resolve())
    theirs = str((base / "llmgw" / "__init__.py").resolve())
    assert ours != theirs
    digests = set()
    for name, arm in arms.items():
        (run,) = arm["runs"]["2"]
        summary = run["summary"]
        assert summary["errors"] == 0 and summary["requests"] == requests
        # the llmgw package each arm's gateway imported: the baseline's arms the copy's, the others this one's
        assert summary["gateway_modules"] == [theirs if name.endswith("@baseline") else ours]
        assert arm["source"] == (str(base.resolve()) if name.endswith("@baseline") else None)
        digests.add(summary["requests_digest"])
        assert sum(summary["per_replica"]) == requests  # the same simulators' own counts
    assert len(digests) == 1  # the same requests for every arm
    assert "| kv_index@baseline | 2 |" in done.stdout.decode()
    # the copy's router was compiled by a process that imported it: the baseline's gateway, nothing else here
    assert any((base / "llmgw" / "router").rglob("*.pyc")) or sys.dont_write_bytecode


async def test_a_config_the_baseline_does_not_read_is_refused_before_any_run(tmp_path):
    base = copy_of_this_checkout(tmp_path / "base")
    write_trace(tmp_path / "trace.jsonl")
    done = await run_bench("--workload", f"trace:{tmp_path / 'trace.jsonl'}", "--arms", "kv_index,kv_index@baseline",
                           "--arm-options", 'kv_index@baseline={"no_such_option": 1}', "--baseline", str(base),
                           "--concurrency", "2", "--repeats", "1", "--replicas", "2", "--time-scale", "0.05",
                           timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 2, err[-3000:]
    assert f"the baseline {base.resolve()} does not read the config arm kv_index@baseline runs on" in err
    assert "unknown key 'no_such_option'" in err  # the baseline's own check, line and key
    assert "[0/" not in err and not done.stdout  # no run started
