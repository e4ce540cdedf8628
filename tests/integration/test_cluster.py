"""A cluster on loopback: `llmgw serve` and `llmgw agent` as real processes, simulator engines on fixture GPUs.

Engines outlive agents and the control plane by design, so every test reaps
them at the end (the ledgers in its folder and every pid the admin API showed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import trio
import trio_websocket

from llmgw import wire
from llmgw.processes import llmgw_command
from helpers import free_port, next_error

REPO = Path(__file__).resolve().parents[2]
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

TINY_SIM = """
profiles:
  - name: tiny-sim
    engine: sim
    model_path: tiny
    served_model_name: tiny
    tp: 1
    kv_events: true
    routing: kv_index
    args: ["--num-blocks", "256"]
    env: {}
deployments:
  - profile: tiny-sim
    replicas: 2
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
        return await self.spawn("llmgw serve", argv, "llmgw listening on ")

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
        text = (await self.http.get(self.control_url + "/metrics")).text
        for line in text.splitlines():
            if line.startswith(name) and all(part in line for part in labels.split(",") if part):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
async def cluster(engines, nursery, tmp_path):
    c = Cluster(nursery, tmp_path, engines)
    yield c
    await c.http.aclose()


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


async def test_two_agents_run_a_deployment_and_keep_it_through_restarts(cluster):
    # Both nodes join before the deployment asks for replicas, so that placement sees both (and spreads).
    cluster.write_config(AGENTS + TINY_SIM.replace("replicas: 2", "replicas: 0"))
    serve = await cluster.start_serve()
    async with trio.open_nursery() as starting:
        starting.start_soon(cluster.start_agent, "a", "tiny-2gpu-a")
        starting.start_soon(cluster.start_agent, "b", "tiny-2gpu-b")
    cluster.write_config(AGENTS + TINY_SIM)
    assert (await cluster.http.post(cluster.control_url + "/admin/reload")).json() == {"reloaded": True, "errors": []}
    replicas = await cluster.settled(2)

    # Placed one per node, on GPU 0, pinned by UUID in the engine's environment.
    nodes = await cluster.nodes()
    assert {r["node"] for r in replicas.values()} == {"a", "b"}
    for replica in replicas.values():
        (shard,) = replica["shards"]
        node = nodes[replica["node"]]
        assert (shard["rank"], shard["gpu_indices"], shard["state"]) == (0, [0], "ready")
        assert replica["url"] == shard["endpoint"] and replica["model"] == "tiny"
        assert environ_of(shard["pid"])["CUDA_VISIBLE_DEVICES"] == node["gpus"][0]["uuid"]
    for node in nodes.values():
        assert (node["state"], node["used_gpus"], len(node["gpus"])) == ("connected", [0], 2)
        assert "token" not in node

    # Both answer through the OpenAI endpoint (the openai client, as a user would).
    def ask_twice():
        client = openai.OpenAI(base_url=cluster.data_url + "/v1", api_key="unused", max_retries=0)
        return [client.chat.completions.with_raw_response.create(**CHAT).headers["x-llmgw-replica"]
                for _ in range(2)]

    answered = await trio.to_thread.run_sync(ask_twice)
    assert sorted(answered) == sorted(replicas), (replicas, serve.output())

    # An engine killed: out of routing while down (every request goes to the other), restarted by its agent.
    victim, other = sorted(replicas, key=lambda name: replicas[name]["node"])
    old_pid = replicas[victim]["shards"][0]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    await cluster.replicas_where(f"{victim} out of routing", lambda rs: rs[victim]["state"] != "up", timeout=5)
    assert [await cluster.chat() for _ in range(4)] == [other] * 4
    replicas = await cluster.replicas_where(f"{victim} back with a new engine", lambda rs: all_up(2)(rs) and (
        rs[victim]["shards"][0]["pid"] not in (0, old_pid)))
    assert replicas[victim]["shards"][0]["restarts"] >= 1
    pids = shard_pids(replicas)

    # The control plane killed and restarted: the engines are adopted, not restarted.
    serve.kill()
    await serve.wait_exit()
    assert all(alive(pid) for pid in pids.values())
    serve = await cluster.start_serve()
    replicas = await cluster.replicas_where("both replicas adopted", all_up(2))
    assert shard_pids(replicas) == pids
    assert {r["origin"] for r in replicas.values()} == {"adopted"}
    assert sorted({await cluster.chat() for _ in range(4)}) == sorted(replicas)

    # An agent killed: its node is disconnected but its replica keeps serving; a new agent adopts its engine.
    agent_node = replicas[victim]["node"]
    cluster.agents[agent_node].kill()
    await cluster.wait_for(f"node {agent_node} disconnected",
                           lambda: cluster.node_is(agent_node, "disconnected"), timeout=10)
    assert alive(pids[victim])
    assert sorted({await cluster.chat() for _ in range(4)}) == sorted(replicas)  # still routed
    assert (await cluster.replicas())[victim]["state"] == "up"
    await cluster.start_agent(agent_node, f"tiny-2gpu-{agent_node}")
    replicas = await cluster.replicas_where("the engine adopted from the ledger", lambda rs: all_up(2)(rs) and (
        "adopted" in rs[victim]["shards"][0]["reason"]))
    assert shard_pids(replicas) == pids
    assert (await cluster.nodes())[agent_node]["state"] == "connected"


def embedded(state_dir: Path, token: bool = False) -> str:
    return (f"agents:\n  embedded: true\n  node_id: local\n  state_dir: {state_dir}\n"
            + (f"  token: {TOKEN}\n  heartbeat_interval: 0.5s\n  suspect_after: 1.5s\n  disconnected_after: 3s\n"
               if token else "")
            + "health:\n  interval: 0.2s\n  failures_to_down: 1\n")


FAST_AND_SLOW = """
profiles:
  - name: fast
    engine: sim
    model_path: tiny
    served_model_name: tiny
  - name: slow
    engine: sim
    model_path: slow
    served_model_name: slow
    args: ["--decode-ms-per-step", "100"]
deployments:
  - profile: fast
    replicas: 1
"""


async def test_a_removed_deployment_drains_without_cutting_a_stream(cluster, start_fake_upstream):
    base = embedded(cluster.tmp_path / "local")
    external = await start_fake_upstream("ext", model="ext")
    static = f"models:\n  - name: ext\n    replicas:\n      - url: {external.url}\n        name: ext-0\n"
    cluster.write_config(base + static + FAST_AND_SLOW + "  - profile: slow\n    replicas: 1\n")
    serve = await cluster.start_serve()
    replicas = await cluster.replicas_where("ext, fast and slow up", all_up(3))
    fast_pid, slow_pid = replicas["fast-0"]["shards"][0]["pid"], replicas["slow-0"]["shards"][0]["pid"]

    # A config with an error is not applied.
    cluster.config_path.write_text(cluster.config_path.read_text().replace("replicas: 1", "replicas: many", 1))
    refused = await cluster.http.post(cluster.control_url + "/admin/reload")
    assert refused.status_code == 400 and "replicas" in refused.json()["errors"][0]
    assert set(await cluster.replicas()) == {"ext-0", "fast-0", "slow-0"}

    body = {"model": "slow", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 30,
            "ignore_eos": True, "stream": True}
    events: list[str] = []
    async with cluster.http.stream("POST", cluster.data_url + "/v1/chat/completions", json=body) as stream:
        lines = stream.aiter_lines()
        while not events:
            line = await lines.__anext__()
            if line.startswith("data: "):
                events.append(line[6:])
        # Mid-stream: the slow deployment is removed, and the config reloaded with SIGHUP.
        cluster.write_config(base + FAST_AND_SLOW)
        serve.kill(signal.SIGHUP)
        draining = await cluster.replicas_where("slow-0 draining", lambda rs: rs["slow-0"]["state"] == "draining",
                                                timeout=5)
        assert draining["slow-0"]["inflight"] == 1 and draining["slow-0"]["retiring"]
        gone = await cluster.http.post(cluster.data_url + "/v1/chat/completions", json=CHAT | {"model": "slow"})
        assert gone.status_code == 404  # no new request for a removed model
        async for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert sum(1 for c in chunks for choice in c["choices"] if choice["delta"].get("content")) == 30
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the whole answer: nothing was cut

    replicas = await cluster.replicas_where("slow-0 retired", lambda rs: set(rs) == {"fast-0"}, timeout=10)
    models = (await cluster.http.get(cluster.data_url + "/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["tiny"]  # the static model went with the reload too
    await cluster.wait_for("the slow engine to exit", lambda: trio.to_thread.run_sync(lambda: not alive(slow_pid)),
                           timeout=10)
    assert replicas["fast-0"]["shards"][0]["pid"] == fast_pid and replicas["fast-0"]["state"] == "up"
    assert await cluster.chat() == "fast-0"


async def test_a_wrong_token_and_reports_about_foreign_shards_are_refused(cluster):
    cluster.write_config(embedded(cluster.tmp_path / "local", token=True) + TINY_SIM.replace("replicas: 2",
                                                                                              "replicas: 1"))
    await cluster.start_serve()
    replicas = await cluster.replicas_where("the local replica up", all_up(1))
    (shard,) = replicas["tiny-sim-0"]["shards"]
    assert shard["node"] == "local"

    intruder = await cluster.start_agent("intruder", "tiny-2gpu-b", token="guess", ready=" refused by ")
    assert await intruder.wait_exit() == 3
    assert await cluster.metric("llmgw_agent_refused_total", 'reason="bad_token"') == 1
    assert "guess" not in intruder.output().replace("--token guess", "")

    # A node with the right token speaks only for its own shards: it can neither claim nor change local's.
    foreign = wire.ShardReport(shard_id=shard["shard_id"], replica_id="tiny-sim-0", state=wire.ShardState.READY,
                               endpoint="http://127.0.0.1:9", fingerprint="x", pid=1)
    url = cluster.control_url.replace("http://", "ws://") + "/agent"
    async with trio_websocket.open_websocket_url(url) as ws:
        await ws.send_message(wire.encode(wire.Register(node_id="crafty", token=TOKEN, address="127.0.0.1",
                                                        shards=[foreign])))
        assert wire.decode(await ws.get_message()).accepted
        refusals = [await next_error(ws)]
        stopped = wire.ShardReport(shard_id=shard["shard_id"], replica_id="tiny-sim-0",
                                   state=wire.ShardState.STOPPED)
        await ws.send_message(wire.encode(wire.ShardStatus(shard=stopped)))
        refusals.append(await next_error(ws))
    assert [(e.code, e.about) for e in refusals] == [("foreign_shard", shard["shard_id"])] * 2
    assert "placed on node local" in refusals[0].message
    assert await cluster.metric("llmgw_agent_refused_total", 'reason="foreign_shard"') == 2
    replicas = await cluster.replicas()
    assert replicas["tiny-sim-0"]["url"] == shard["endpoint"] and replicas["tiny-sim-0"]["state"] == "up"
    assert replicas["tiny-sim-0"]["shards"][0]["state"] == "ready"
    assert (await cluster.nodes())["crafty"]["shards"] == []
    assert await cluster.chat() == "tiny-sim-0"


GANG = """
profiles:
  - name: tiny-gang
    engine: sim
    model_path: tiny
    served_model_name: tiny
    tp: 2
    nodes: 2
deployments:
  - profile: tiny-gang
    replicas: 1
"""


async def test_a_two_node_profile_is_placed_as_a_gang_or_not_at_all(cluster):
    cluster.write_config(AGENTS + GANG)
    await cluster.start_serve()
    await cluster.start_agent("a", "tiny-2gpu-a")
    replicas = await cluster.replicas_where("the gang unplaced", lambda rs: rs["tiny-gang-0"]["state"] == "unplaced")
    assert "gang needs 2 nodes, 1 fits" in replicas["tiny-gang-0"]["reason"]
    assert replicas["tiny-gang-0"]["shards"] == []
    assert await cluster.metric("llmgw_placement_failures_total") == 1

    await cluster.start_agent("b", "tiny-2gpu-b")
    # The replica routes as soon as rank 0 is Ready; rank 1 (a whole simulator here) may still be loading then.
    replicas = await cluster.replicas_where(
        "the gang up with every rank ready",
        lambda rs: all_up(1)(rs) and all(s["state"] == "ready" for s in rs["tiny-gang-0"]["shards"]))
    gang = replicas["tiny-gang-0"]
    shards = sorted(gang["shards"], key=lambda s: s["rank"])
    assert [(s["rank"], s["node"], s["gpu_indices"], s["state"]) for s in shards] == [
        (0, "a", [0], "ready"), (1, "b", [0], "ready")]
    assert {(s["leader_address"], s["leader_port"]) for s in shards} == {("127.0.0.1", 29500)}
    assert len({s["shard_id"].rsplit("-r", 1)[0] for s in shards}) == 1  # one replica, one generation
    assert gang["url"] == shards[0]["endpoint"] and gang["node"] == "a"  # rank 0 is the endpoint
    assert await cluster.chat() == "tiny-gang-0"
