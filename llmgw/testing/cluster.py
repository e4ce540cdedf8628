"""A cluster on loopback: ``llmgw serve`` and ``llmgw agent`` as real processes, simulator engines on fixture GPUs.

:class:`Cluster` starts them in the caller's nursery, kills them and reads
their admin API. Engines outlive agents and the control plane by design, so
an :class:`EngineReaper` kills every engine the test started when it ends,
whether it passed or failed: the pids the admin API showed and those in the
agents' ledgers (``shards.json``) under the test's folder. The ``kv_*``
helpers read the KV index of such a cluster.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import trio

from .metrics import metric_value, scrape
from .processes import Child, free_port, llmgw_command, start_child

TOKEN = "s3cret"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
BLOCK = 16

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


class EngineReaper:
    """Engines to kill when the test ends: pids seen, and every shard in the ledgers under ``root`` (also when a
    ``with`` block of it ends)."""

    def __init__(self, root: Path):
        self.root = root
        self.pids: set[int] = set()

    def __enter__(self) -> "EngineReaper":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.reap()

    def add(self, pid: int) -> None:
        self.pids.add(pid)

    def update(self, pids) -> None:
        self.pids.update(pids)

    def reap(self) -> None:
        """SIGKILL the process group of every engine seen or in a ledger (an engine's pid is its group's id)."""
        for ledger in self.root.rglob("shards.json"):
            try:
                entries = json.loads(ledger.read_text()).get("shards", {}).values()
            except (OSError, ValueError):
                continue
            for entry in entries:
                self.pids.add(entry.get("pgid") or entry.get("pid") or 0)
        for pid in self.pids - {0}:
            kill_group(pid)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Cluster:
    """``llmgw serve`` on fixed loopback ports (from :meth:`write_config`) and agents joining it.

    ``fixtures``: the folder of the agents' discovery fixtures (``NAME.json``, fake GPUs);
    ``cwd``: where the children run (a source checkout, so ``python -m llmgw`` imports it)."""

    def __init__(self, nursery: trio.Nursery, tmp_path: Path, engines: EngineReaper, *, fixtures: Path,
                 cwd: Path | None = None):
        self.nursery = nursery
        self.tmp_path = tmp_path
        self.engines = engines
        self.fixtures = fixtures
        self.cwd = cwd
        self.config_path = tmp_path / "llmgw.yaml"
        self.data_url = f"http://127.0.0.1:{free_port()}"
        self.control_url = f"http://127.0.0.1:{free_port()}"
        self.http = httpx.AsyncClient(timeout=10)
        self.agents: dict[str, Child] = {}
        self.serve: Child | None = None  # the last `llmgw serve` started

    def write_config(self, text: str) -> None:
        listen = f"listen: {self.data_url[7:]}\ncontrol_listen: {self.control_url[7:]}\n"
        self.config_path.write_text(listen + text)

    async def spawn(self, name: str, argv: list[str], ready: str, timeout: float = 20.0) -> Child:
        """Start ``argv`` in the cluster's nursery, ready once it printed a line holding ``ready``; killed (its
        group, at once) when the test ends. An agent's engines are in groups of their own: the reaper's."""
        return await start_child(self.nursery, argv, name=name, ready=ready, startup_timeout=timeout,
                                 stop_grace=0, cwd=self.cwd)

    async def start_serve(self, *extra: str) -> Child:
        """``llmgw serve`` with this cluster's config; ``extra``: more of its arguments (``--role gateway``)."""
        argv = llmgw_command("serve", "--config", str(self.config_path), "--log-level", "debug", *extra)
        self.serve = await self.spawn("llmgw serve", argv, "llmgw listening on ")
        return self.serve

    async def start_agent(self, node_id: str, fixture: str, *, token: str = TOKEN, ready: str = " connected to ",
                          timeout: float = 20.0, state_dir: Path | None = None, join: str | None = None,
                          extra: tuple[str, ...] | list[str] = ()) -> Child:
        state_dir = state_dir or self.tmp_path / f"agent-{node_id}"
        argv = llmgw_command("agent", "--join", join or self.control_url, "--token", token, "--node-id", node_id,
                             "--state-dir", str(state_dir), "--address", "127.0.0.1",
                             "--discovery", f"fixture:{self.fixtures / fixture}.json", "--log-level", "debug",
                             *extra)
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
        return metric_value(await scrape(self.control_url, self.http), name, labels)


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
    """Config YAML of an embedded agent (node ``local``) keeping its state in ``state_dir``."""
    return (f"agents:\n  embedded: true\n  node_id: local\n  state_dir: {state_dir}\n"
            + (f"  token: {TOKEN}\n  heartbeat_interval: 0.5s\n  suspect_after: 1.5s\n  disconnected_after: 3s\n"
               if token else "")
            + "health:\n  interval: 0.2s\n  failures_to_down: 1\n")


def text(seed: int, chars: int) -> str:
    """A prompt of about ``chars`` characters whose words depend on ``seed``."""
    return " ".join(f"w{seed}x{i}" for i in range(chars // 4 + 1))[:chars]


async def kv_state(cluster: Cluster) -> dict[str, dict]:
    return {r["name"]: r for r in (await cluster.admin("/admin/kv"))["replicas"]}


async def kv_where(cluster: Cluster, what: str, check, timeout: float = 20.0) -> dict[str, dict]:
    async def predicate():
        state = await kv_state(cluster)
        return state if check(state) else None

    return await cluster.wait_for(what, predicate, timeout)


async def complete(cluster: Cluster, prompt: str, url: str | None = None) -> tuple[str, dict]:
    """A completion through the gateway (or straight to an engine at ``url``): (replica, usage)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    response = await cluster.http.post((url or cluster.data_url) + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.headers.get("x-llmgw-replica", ""), response.json()["usage"]
