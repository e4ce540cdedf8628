"""The third-party tier of docs/plugins.md, taken from the page verbatim: it installs, passes its own test, and
routes real requests through ``llmgw serve`` to simulator replicas, seeing their non-streamed load.

The package is installed with ``pip install --target`` (no build isolation, no dependencies: about two
seconds), not registered with pluggy by hand: the entry point its ``pyproject.toml`` declares is part of what
the page teaches, and only an installed distribution exercises it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from llmgw.testing.metrics import scrape_value
from llmgw.testing.processes import llmgw_command
from llmgw.testing.sims import MODEL, gateway_config, start_sims

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
MARKED_BLOCK = re.compile(r"<!-- walkthrough-file: (\S+) -->\n```\w*\n(.*?)\n```\n", re.S)
REQUESTS = 8


def write_walkthrough(directory: Path) -> dict[str, Path]:
    """Every marked code block of the walkthrough, written under ``directory`` at the path its marker names."""
    written = {}
    for name, code in MARKED_BLOCK.findall(DOC.read_text()):
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code + "\n")
        written[name] = path
    return written


def with_path(*entries: Path) -> dict[str, str]:
    """An environment whose PYTHONPATH puts ``entries`` before the one this test runs with (llmgw's tree)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([*map(str, entries), *inherited])}


def install(source: Path, target: Path) -> None:
    pip = os.path.join(os.path.dirname(sys.executable), "pip")
    result = subprocess.run([pip, "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target),
                             str(source)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


async def test_the_walkthrough_tier_installs_passes_its_test_and_sees_non_streamed_load(nursery, start_llmgw,
                                                                                       tmp_path):
    files = write_walkthrough(tmp_path)
    assert sorted(files) == ["llmgw-least-tokens/llmgw_least_tokens.py", "llmgw-least-tokens/pyproject.toml",
                             "llmgw-least-tokens/tests/test_least_tokens.py"]
    package = tmp_path / "llmgw-least-tokens"
    site = tmp_path / "site"
    install(package, site)
    env = {**os.environ, **with_path(site)}

    # Its own test, as its author runs it (the installed entry point and the module under test are one plugin).
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=package,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout

    # The installed tier is known to config checks, its options included.
    config = tmp_path / "bad.yaml"
    config.write_text(gateway_config(["http://127.0.0.1:9"], routing="least_tokens",
                                     routing_options={"avoid_faild": True}))
    result = subprocess.run(llmgw_command("config", "check", str(config)), env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"{config}:4: models[0].routing_options: unknown key 'avoid_faild' for routing: least_tokens"]

    # Concurrent non-streamed requests of distinct lengths (no two sums of them equal), each answered after
    # 100 decode steps of 20 ms: every pick after the first sees the requests before it in flight.
    sims = await start_sims(nursery, 2, num_blocks=1024, time_scale=1, seed=0, extra=("--output-tokens", "100:100"))
    gateway = await start_llmgw(gateway_config([s.url for s in sims], routing="least_tokens"), env=with_path(site))
    served: list[str] = []

    async def ask(client: httpx.AsyncClient, i: int) -> None:
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "word " * (10 << i),
                                                              "max_tokens": 100, "stream": False})
        assert response.status_code == 200, response.text
        served.append(response.headers["x-llmgw-replica"])

    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        async with trio.open_nursery() as burst:
            for i in range(REQUESTS):
                burst.start_soon(ask, client, i)
    ties = await scrape_value(gateway.control_url, "llmgw_routing_decisions_total", 'tier="least_tokens",outcome="tie"')
    least = await scrape_value(gateway.control_url, "llmgw_routing_decisions_total",
                               'tier="least_tokens",outcome="least"')
    assert (ties, least) == (1, REQUESTS - 1), (ties, least)
    assert sorted(set(served)) == ["sim-0", "sim-1"]
