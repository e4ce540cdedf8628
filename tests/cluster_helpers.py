"""A cluster on loopback for the integration tests: ``llmgw serve`` and ``llmgw agent`` as real processes.

:class:`Cluster` starts them, kills them and reads their admin API; the
``cluster`` fixture gives one per test, with ``engines``, which reaps the
engines at the end (they outlive agents and the control plane by design;
``integration/conftest.py`` offers both fixtures). The ``kv_*`` helpers read the
KV index of such a cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.bench.common import metric_value
from llmgw.bench.sim_cluster import kv_sim_profile as kv_sim  # noqa: F401 (the tests' import of it)
from llmgw.processes import free_port, llmgw_command

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "nodes"
TOKEN = "s3cret"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

AGENTS = f"""
agents:
  token: {TOKEN}
  heartbeat_interval: 0.5s
  suspect_after: 1.5s
  disconnected_after: 3s
health:
  interval: 0.2s
  failures_to_down: 1
"""


@dataclass
class Proc:
    """A child process whose output is collected line by line (stdout and stderr together)."""

    name: str
    process: trio.Process
    lines: list[str] = field(default_factory=list)
    exited: trio.Event = field(default_factory=trio.Event)

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pid, sig)

    async def wait_exit(self, timeout: float = 10.0) -> int:
        with trio.fail_after(timeout):
            await self.exited.wait()
        return self.process.returncode

    def output(self) -> str:
        return "\n".join(self.lines[-60:])


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Cluster:
    def __init__(self, nursery: trio.Nursery, tmp_path: Path, engines: set[int]):
        self.nursery = nursery
        self.tmp_path = tmp_path
        self.engines = engines
        self.config_path = tmp_path / "llmgw.yaml"
        self.data_url = f"http://127.0.0.1:{free_port()}"
        self.control_url = f"http://127.0.0.1:{free_port()}"
        self.http = httpx.AsyncClient(timeout=10)
        self.agents: dict[str, Proc] = {}
        self.serve: Proc | None = None  # the last `llmgw serve` started

    def write_config(self, text: str) -> None:
        listen = f"listen: {self.data_url[7:]}\ncontrol_listen: {self.control_url[7:]}\n"
        self.config_path.write_text(listen + text)

    async def spawn(self, name: str, argv: list[str], ready: str, timeout: float = 20.0) -> Proc:
        process = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                   start_new_session=True, cwd=REPO,
                                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
        proc = Proc(name, process)
        seen = trio.Event()
        self.nursery.start_soon(self._pump, proc, ready, seen)
        with trio.fail_after(timeout):
            await seen.wait()
        if not any(ready in line for line in proc.lines):
            raise AssertionError(f"{name} exited with {process.returncode} before printing {ready!r}:\n"
                                 f"{proc.output()}")
        return proc

    async def _pump(self, proc: Proc, ready: str, seen: trio.Event) -> None:
        buffer = b""
        try:
            async for chunk in proc.process.stdout:
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    line = raw.decode(errors="replace")
                    proc.lines.append(line)
                    if ready in line:
                        seen.set()
            await proc.process.wait()
        finally:
            seen.set()
            proc.exited.set()
            with trio.CancelScope(shield=True):
                if proc.process.returncode is None:
                    kill_group(proc.pid)  # an agent's engines are in groups of their own: reaped by `engines`
                    await proc.process.wait()

    async def start_serve(self) -> Proc:
        argv = llmgw_command("serve", "--config", str(self.config_path), "--log-level", "debug")
        self.serve = await self.spawn("llmgw serve", argv, "llmgw listening on ")
        return self.serve

    async def start_agent(self, node_id: str, fixture: str, *, token: str = TOKEN, ready: str = " connected to ",
                          timeout: float = 20.0, state_dir: Path | None = None, join: str | None = None,
                          extra: tuple[str, ...] | list[str] = ()) -> Proc:
        state_dir = state_dir or self.tmp_path / f"agent-{node_id}"
        argv = llmgw_command("agent", "--join", join or self.control_url, "--token", token, "--node-id", node_id,
                             "--state-dir", str(state_dir), "--address", "127.0.0.1",
                             "--discovery", f"fixture:{FIXTURES / fixture}.json", "--log-level", "debug", *extra)
        proc = self.agents[node_id] = await self.spawn(f"agent {node_id}", argv, ready, timeout)
        return proc

    async def admin(self, path: str):
        response = await self.http.get(self.control_url + path)
        response.raise_for_status()
        body = response.json()
        if path == "/admin/replicas":
            self.engines.update(s["pid"] for r in body for s in r.get("shards", []) if s.get("pid"))
        return body

    async def replicas(self) -> dict[str, dict]:
        return {r["name"]: r for r in await self.admin("/admin/replicas")}

    async def nodes(self) -> dict[str, dict]:
        return {n["node_id"]: n for n in await self.admin("/admin/nodes")}

    async def node_is(self, node_id: str, state: str) -> bool:
        return (await self.nodes())[node_id]["state"] == state

    async def wait_for(self, what: str, predicate, timeout: float = 20.0, interval: float = 0.1):
        """Poll ``await predicate()`` until it returns something true; fail with ``what`` and the last value."""
        last = None
        try:
            with trio.fail_after(timeout):
                while True:
                    try:
                        last = await predicate()
                    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                        last = exc
                    else:
                        if last:
                            return last
                    await trio.sleep(interval)
        except trio.TooSlowError:
            raise AssertionError(f"timed out waiting for {what}; last: {last!r}") from None

    async def replicas_where(self, what: str, check, timeout: float = 20.0) -> dict[str, dict]:
        async def predicate():
            replicas = await self.replicas()
            return replicas if check(replicas) else None

        return await self.wait_for(what, predicate, timeout)

    async def settled(self, count: int) -> dict[str, dict]:
        """``count`` replicas up, and still up on the same engines a moment later (two agents on one host can
        race for a port: the loser's engine exits and is restarted elsewhere)."""
        async def stable():
            before = shard_pids(await self.replicas_where(f"{count} replicas up", all_up(count)))
            await trio.sleep(0.6)
            after = await self.replicas()
            return after if all_up(count)(after) and shard_pids(after) == before else None

        return await self.wait_for(f"{count} replicas up on stable engines", stable)

    async def chat(self, body: dict = CHAT) -> str:
        """One chat completion through the OpenAI endpoint; the replica that answered."""
        response = await self.http.post(self.data_url + "/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.headers["x-llmgw-replica"]

    async def metric(self, name: str, labels: str = "") -> float:
        return metric_value((await self.http.get(self.control_url + "/metrics")).text, name, labels)


def all_up(count: int):
    return lambda replicas: len(replicas) == count and all(r["state"] == "up" for r in replicas.values())


def shard_pids(replicas: dict[str, dict]) -> dict[str, int]:
    return {name: r["shards"][0]["pid"] for name, r in replicas.items()}


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def embedded(state_dir: Path, token: bool = False) -> str:
    return (f"agents:\n  embedded: true\n  node_id: local\n  state_dir: {state_dir}\n"
            + (f"  token: {TOKEN}\n  heartbeat_interval: 0.5s\n  suspect_after: 1.5s\n  disconnected_after: 3s\n"
               if token else "")
            + "health:\n  interval: 0.2s\n  failures_to_down: 1\n")



BLOCK = 16


def text(seed: int, chars: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(chars // 4 + 1))[:chars]


async def kv_state(cluster) -> dict[str, dict]:
    return {r["name"]: r for r in (await cluster.admin("/admin/kv"))["replicas"]}


async def kv_where(cluster, what: str, check, timeout: float = 20.0) -> dict[str, dict]:
    async def predicate():
        state = await kv_state(cluster)
        return state if check(state) else None

    return await cluster.wait_for(what, predicate, timeout)


async def complete(cluster, prompt: str, url: str | None = None) -> tuple[str, dict]:
    """A completion through the gateway (or straight to an engine at ``url``): (replica, usage)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    response = await cluster.http.post((url or cluster.data_url) + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.headers.get("x-llmgw-replica", ""), response.json()["usage"]


@pytest.fixture
def engines(tmp_path):
    """Pids of engines to reap after the test (after every async fixture, the cluster's processes included)."""
    pids: set[int] = set()
    yield pids
    for ledger in tmp_path.rglob("shards.json"):
        for entry in json.loads(ledger.read_text()).get("shards", {}).values():
            pids.add(entry.get("pgid") or entry.get("pid") or 0)
    for pid in pids - {0}:
        kill_group(pid)


@pytest.fixture
async def cluster(engines, nursery, tmp_path):
    c = Cluster(nursery, tmp_path, engines)
    yield c
    await c.http.aclose()
