"""Hostile agents: `llmgw serve`, real `llmgw agent` processes, and impostors with the join token on raw websockets.

An impostor can neither take over a node (its session, its StartShard secrets)
nor get a replica routed to its endpoint by a forged report; a real agent
reconnects with its node secret, across a control-plane restart and a join
token rotation, without its engine being restarted; and it joins over
``wss://`` trusting only its CA file (through a TLS terminator in front of the
control listener).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import ssl
import stat
from pathlib import Path

import trio
import trio_websocket
import trustme

from llmgw import wire
from llmgw.agent.discovery import discover
from llmgw.testing.cluster import AGENTS, TOKEN, alive, all_up, environ_of
from llmgw.wire.channel import AgentCredentials

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"  # the fake nodes (their GPUs)
API_KEY = "engine-k3y-for-a-only"
ENV_SECRET = "env-s3cret-for-a-only"

SECRET_PROFILE = f"""
profiles:
  - name: tiny-sim
    engine: sim
    model_path: tiny
    served_model_name: tiny
    api_key: {API_KEY}
    env: {{NODE_SECRET_ENV: {ENV_SECRET}}}
deployments:
  - profile: tiny-sim
    replicas: 1
"""



class RawAgent:
    """A hand-made agent on a raw websocket: sends what the test says, heartbeats, and keeps what it receives."""

    def __init__(self) -> None:
        self.reply: wire.Registered | None = None
        self.received: list = []
        self.closed = trio.Event()
        self._ws = None
        self._scope = trio.CancelScope()

    @classmethod
    async def join(cls, nursery: trio.Nursery, control_url: str, register: wire.Register) -> "RawAgent":
        agent = cls()
        await nursery.start(agent._run, control_url.replace("http://", "ws://") + "/agent", register)
        return agent

    async def _run(self, url: str, register: wire.Register, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self._scope:
            try:
                async with trio_websocket.open_websocket_url(
                        url, extra_headers=AgentCredentials.of(register).headers()) as ws:
                    self._ws = ws
                    await ws.send_message(wire.encode(register))
                    with trio.fail_after(10):
                        self.reply = wire.decode(await ws.get_message())
                    task_status.started()
                    if self.reply.accepted:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(self._heartbeats)
                            while True:
                                self.received.append(wire.decode(await ws.get_message()))
                    else:  # the control plane closes a refused connection: anything after the refusal is kept
                        while True:
                            self.received.append(wire.decode(await ws.get_message()))
            except* trio_websocket.ConnectionClosed:
                pass
            finally:
                self.closed.set()

    async def _heartbeats(self) -> None:
        seq = 0
        while True:
            seq += 1
            await self.send(wire.Heartbeat(seq=seq))
            await trio.sleep(0.3)

    async def send(self, message: wire.Message) -> None:
        await self._ws.send_message(wire.encode(message))

    def of_type(self, kind: type) -> list:
        return [m for m in self.received if isinstance(m, kind)]

    def close(self) -> None:
        self._scope.cancel()


def impostor_register(node_id: str, **fields) -> wire.Register:
    """A realistic Register (GPUs from a fixture, so placement would take it), with the join token."""
    register = discover(f"fixture:{FIXTURES / 'tiny-2gpu-b'}.json", node_id=node_id, address="127.0.0.1")
    register.token = TOKEN
    for name, value in fields.items():
        setattr(register, name, value)
    return register


async def start_listener(nursery: trio.Nursery) -> tuple[int, list]:
    """A TCP port that records every connection made to it (an impostor's "engine")."""
    connections: list = []

    async def handler(stream):
        connections.append(stream.socket.getpeername())
        await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1], connections


async def test_an_impostor_with_the_join_token_cannot_take_a_node_its_secrets_or_its_replica(cluster, nursery):
    cluster.write_config(AGENTS + SECRET_PROFILE)
    serve = await cluster.start_serve()
    agent_a = await cluster.start_agent("a", "tiny-2gpu-a")
    replicas = await cluster.replicas_where("the replica up on a", all_up(1))
    (shard,) = replicas["tiny-sim-0"]["shards"]
    assert shard["node"] == "a"
    engine_pid = shard["pid"]

    # The node secret is in the agent's state dir (private); the control plane keeps only its hash.
    secret_file = cluster.tmp_path / "agent-a" / "node-secret"
    secret = secret_file.read_text().strip()
    assert len(secret) == 64 and stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    store = cluster.tmp_path / "xdg-state" / "llmgw" / "control" / "nodes.json"
    assert secret not in store.read_text() and "a" in json.loads(store.read_text())["nodes"]
    assert stat.S_IMODE(store.stat().st_mode) == 0o600

    # 1. The node id, with the join token but without (or with a wrong) secret: refused; a's session untouched.
    for attempt in (impostor_register("a"), impostor_register("a", node_secret="0" * 64)):
        impostor = await RawAgent.join(nursery, cluster.control_url, attempt)
        assert not impostor.reply.accepted and impostor.reply.reason.startswith("bad_node_secret")
        with trio.fail_after(5):
            await impostor.closed.wait()
        assert impostor.received == [] and not impostor.reply.node_secret
    assert await cluster.metric("llmgw_agent_refused_total", 'reason="bad_node_secret"') == 2
    assert await cluster.node_is("a", "connected")
    assert not any(" disconnected " in line for line in agent_a.lines)

    # 2. While a's agent is down (its engine keeps serving), the id is still a's: an impostor that would be sent
    #    a's StartShard (api key, env) on registering without shards is refused.
    agent_a.kill()
    await cluster.wait_for("a disconnected", lambda: cluster.node_is("a", "disconnected"), timeout=10)
    impostor = await RawAgent.join(nursery, cluster.control_url, impostor_register("a"))
    assert not impostor.reply.accepted
    assert await cluster.metric("llmgw_agent_refused_total", 'reason="bad_node_secret"') == 3

    # 3. A new node id with the join token is admitted, but speaks only for what is its own: a forged Ready copy
    #    of a's replica (fingerprint from the open /admin/nodes, a newer generation, the impostor's endpoint) is
    #    refused as unproven, told to stop, and never routed to, even while a's engine is down.
    evil_port, evil_connections = await start_listener(nursery)
    fingerprint = (await cluster.nodes())["a"]["shards"][0]["fingerprint"]
    forged = wire.ShardReport(shard_id="tiny-sim-0-g99999999999999-r0", replica_id="tiny-sim-0", rank=0,
                              node_count=1, state=wire.ShardState.READY, pid=4242, http_port=evil_port,
                              endpoint=f"http://127.0.0.1:{evil_port}", fingerprint=fingerprint,
                              generation=99_999_999_999_999, gpu_indices=[0], model="tiny",
                              placement_proof="ab" * 32)
    evil = await RawAgent.join(nursery, cluster.control_url, impostor_register("evil", shards=[forged]))
    assert evil.reply.accepted and evil.reply.node_secret
    agent_a_again = await cluster.start_agent("a", "tiny-2gpu-a")  # a comes back: its secret proves it
    replicas = await cluster.replicas_where("a's engine adopted again", all_up(1))
    assert replicas["tiny-sim-0"]["shards"][0]["pid"] == engine_pid
    await evil.send(wire.ShardStatus(shard=forged))
    await cluster.wait_for("the forged shard refused", lambda: cluster.metric(
        "llmgw_agent_refused_total", 'reason="unproven_shard"'))

    # The real engine crashes; its agent restarts it, and the replica stays a's.
    os.kill(engine_pid, signal.SIGKILL)
    await cluster.replicas_where("the replica out of routing", lambda rs: rs["tiny-sim-0"]["state"] != "up",
                                 timeout=10)
    await evil.send(wire.ShardStatus(shard=forged))  # Ready, right when the real one is not

    async def back_on_a():
        replicas = await cluster.replicas()
        routed = replicas["tiny-sim-0"]
        assert routed["node"] == "a" and f":{evil_port}" not in routed["url"], routed  # at every look
        return all_up(1)(replicas) and routed["shards"][0]["pid"] not in (0, engine_pid)

    await cluster.wait_for("a's engine restarted and routed again", back_on_a)
    for _ in range(3):
        assert await cluster.chat() == "tiny-sim-0"
    assert evil_connections == []  # no probe, no prompt, no bearer key ever reached the forger's endpoint
    assert forged.shard_id not in {s["shard_id"] for r in (await cluster.replicas()).values() for s in r["shards"]}
    stops = [m for m in evil.of_type(wire.StopShard) if m.shard_id == forged.shard_id]
    assert stops and "not proven" in stops[0].reason
    assert [m.about for m in evil.of_type(wire.ErrorMessage) if m.code == "unproven_shard"][:1] == [forged.shard_id]

    # 4. No StartShard ever reached an impostor; the secrets went only to a (its engine has them) and nowhere else.
    assert evil.of_type(wire.StartShard) == []
    pid = (await cluster.replicas())["tiny-sim-0"]["shards"][0]["pid"]
    assert environ_of(pid)["NODE_SECRET_ENV"] == ENV_SECRET
    for path in ("/admin/nodes", "/admin/replicas"):
        text = (await cluster.http.get(cluster.control_url + path)).text
        assert API_KEY not in text and ENV_SECRET not in text and secret not in text
        assert "placement_proof" not in text and "node_secret" not in text
    for proc in (serve, agent_a, agent_a_again):
        output = "\n".join(proc.lines)
        assert secret not in output and API_KEY not in output and ENV_SECRET not in output, proc.name
    evil.close()


async def test_identities_survive_a_restart_and_a_token_rotation_keeps_sessions_and_engines(cluster, nursery):
    cluster.write_config(AGENTS + SECRET_PROFILE)
    serve = await cluster.start_serve()
    agent_a = await cluster.start_agent("a", "tiny-2gpu-a")
    replicas = await cluster.replicas_where("the replica up on a", all_up(1))
    engine_pid = replicas["tiny-sim-0"]["shards"][0]["pid"]

    # Rotation, step 1: the new token beside the old one; step 2: the new one only. Reloaded, not restarted.
    rotating = AGENTS.replace(f"  token: {TOKEN}\n", f"  token: {TOKEN}\n  tokens: [n3w-token]\n")
    rotated = AGENTS.replace(f"  token: {TOKEN}\n", "  token: n3w-token\n")
    for text, join_tokens in ((rotating, {"before": 1, "after": 2}), (rotated, {"before": 2, "after": 1})):
        cluster.write_config(text + SECRET_PROFILE)
        reload = (await cluster.http.post(cluster.control_url + "/admin/reload")).json()
        assert (reload["reloaded"], reload["errors"], reload["summary"]["join_tokens"]) == (True, [], join_tokens)
    old = await cluster.start_agent("old-token", "tiny-2gpu-b", ready=" refused by ")
    assert await old.wait_exit() == 3 and "bad_token" in old.output()
    await cluster.start_agent("b", "tiny-2gpu-b", token="n3w-token")
    await trio.sleep(1.0)  # past a heartbeat: a's session would have ended by now if the reload cut it
    assert await cluster.node_is("a", "connected")
    assert not any(" disconnected " in line for line in agent_a.lines)
    assert (await cluster.replicas())["tiny-sim-0"]["shards"][0]["pid"] == engine_pid

    # The control plane killed and restarted: a (still holding the old token) reconnects with its secret, its
    # engine is adopted by its placement proof; the id is still a's.
    serve.kill()
    await serve.wait_exit()
    serve = await cluster.start_serve()
    replicas = await cluster.replicas_where("the engine adopted after the restart", lambda rs: all_up(1)(rs) and (
        rs["tiny-sim-0"]["origin"] == "adopted"))
    assert replicas["tiny-sim-0"]["shards"][0]["pid"] == engine_pid and alive(engine_pid)
    assert await cluster.metric("llmgw_agent_refused_total", 'reason="unproven_shard"') == 0
    impostor = await RawAgent.join(nursery, cluster.control_url, impostor_register("a", token="n3w-token"))
    assert not impostor.reply.accepted and impostor.reply.reason.startswith("bad_node_secret")

    # b's machine is rebuilt (its state dir is gone): refused until an operator forgets b's identity; then it joins.
    cluster.agents["b"].kill()
    rebuilt = cluster.tmp_path / "rebuilt-b"
    refused = await cluster.start_agent("b", "tiny-2gpu-b", token="n3w-token", state_dir=rebuilt,
                                        ready=" refused by ")
    assert await refused.wait_exit() == 3 and "forget" in refused.output()
    forget = await cluster.http.post(cluster.control_url + "/admin/nodes/b/forget")
    assert forget.status_code == 200 and forget.json() == {"forgotten": "b"}
    await cluster.start_agent("b", "tiny-2gpu-b", token="n3w-token", state_dir=rebuilt)
    assert await cluster.node_is("b", "connected")
    assert (await cluster.http.post(cluster.control_url + "/admin/nodes/nobody/forget")).status_code == 404


async def start_tls_proxy(nursery: trio.Nursery, server_context, target_port: int) -> int:
    """A TLS terminator on 127.0.0.1 in front of the plain control listener (as a TLS load balancer would be)."""

    async def pump(source, sink):
        try:
            while data := await source.receive_some(65536):
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await sink.aclose()

    async def handler(client):
        try:
            async with client, await trio.open_tcp_stream("127.0.0.1", target_port) as upstream:
                async with trio.open_nursery() as pumps:
                    pumps.start_soon(pump, client, upstream)
                    pumps.start_soon(pump, upstream, client)
        except (trio.BrokenResourceError, OSError):
            pass  # a client that failed its handshake

    listeners = await nursery.start(functools.partial(trio.serve_ssl_over_tcp, handler, 0, server_context,
                                                      host="127.0.0.1"))
    return listeners[0].transport_listener.socket.getsockname()[1]


async def test_a_real_agent_joins_over_wss_trusting_only_its_ca_file(cluster, nursery):
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    ca_file = cluster.tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cluster.write_config(AGENTS)
    await cluster.start_serve()
    port = await start_tls_proxy(nursery, server_context, int(cluster.control_url.rsplit(":", 1)[1]))
    wss = f"wss://127.0.0.1:{port}"

    joined = await cluster.start_agent("a", "tiny-2gpu-a", join=wss, extra=["--ca-file", str(ca_file)])
    assert any(f"connected to {wss}/agent" in line for line in joined.lines)
    assert await cluster.node_is("a", "connected")
    assert (cluster.tmp_path / "agent-a" / "node-secret").exists()

    # Without the CA file the system store does not vouch for the certificate: it never registers, and says why.
    untrusting = await cluster.start_agent("b", "tiny-2gpu-b", join=wss, ready="certificate verification failed")
    assert "b" not in await cluster.nodes()
    untrusting.kill()

    insecure = await cluster.start_agent("c", "tiny-2gpu-b", join=wss, extra=["--insecure-skip-verify"])
    assert any("--insecure-skip-verify" in line and "NOT verified" in line for line in insecure.lines)

    bad = await cluster.start_agent("d", "tiny-2gpu-b", join="ws://127.0.0.1:1", extra=["--ca-file", str(ca_file)],
                                    ready="llmgw agent: ")
    assert await bad.wait_exit() == 2 and "need a wss://" in bad.output()


HOSTILE_PROFILE = SECRET_PROFILE.replace("replicas: 1", "replicas: 3")  # a: two of them, the impostor: one


def ready_report(start: wire.StartShard, endpoint: str) -> wire.ShardReport:
    """What an agent says when its engine for ``start`` is Ready at ``endpoint`` (the placement proof and all)."""
    return wire.ShardReport(shard_id=start.shard_id, replica_id=start.replica_id, rank=start.rank,
                            node_count=start.node_count, state=wire.ShardState.READY, pid=4242, http_port=8000,
                            endpoint=endpoint, fingerprint=start.fingerprint, generation=start.generation,
                            gpu_indices=list(start.gpu_indices), model="tiny", started_at=1.0,
                            placement_proof=start.placement_proof)


async def test_a_node_reporting_a_bad_endpoint_is_refused_and_the_gateway_keeps_serving(cluster, nursery):
    cluster.write_config(AGENTS + HOSTILE_PROFILE)
    serve = await cluster.start_serve()
    await cluster.start_agent("a", "tiny-2gpu-a")  # two GPUs: two of the three replicas
    await cluster.replicas_where("a's two replicas up", lambda rs: sum(r["state"] == "up" for r in rs.values()) == 2)
    healthy = {name for name, r in (await cluster.replicas()).items() if r["state"] == "up"}

    evil = await RawAgent.join(nursery, cluster.control_url, impostor_register("evil"))
    assert evil.reply.accepted

    async def placed_on_evil():
        return evil.of_type(wire.StartShard)

    (start,) = await cluster.wait_for("the third replica placed on evil", placed_on_evil)
    data_port = int(cluster.data_url.rsplit(":", 1)[1])
    control_port = int(cluster.control_url.rsplit(":", 1)[1])
    bad_endpoints = ["http://127.0.0.1:99999", "http://[::1", "http://h:abc", "http://10.9.9.9:8000",
                     f"http://127.0.0.1:{data_port}", f"http://127.0.0.1:{control_port}", "http://127.0.0.1:0"]
    for count, endpoint in enumerate(bad_endpoints, 1):
        await evil.send(wire.ShardStatus(shard=ready_report(start, endpoint)))

        async def refused():
            errors = [m for m in evil.of_type(wire.ErrorMessage) if m.code == "invalid_report"]
            return len(errors) >= count and errors[-1]

        error = await cluster.wait_for(f"{endpoint} refused", refused)
        assert error.about == start.shard_id and "endpoint" in error.message, error
        if endpoint.endswith(f":{data_port}") or endpoint.endswith(f":{control_port}"):
            assert "this gateway's own listeners" in error.message, error
        assert serve.process.returncode is None, endpoint  # the gateway is still up...
        assert (await cluster.http.get(cluster.data_url + "/health")).status_code == 200
        replicas = await cluster.replicas()
        assert replicas[start.replica_id]["state"] != "up" and replicas[start.replica_id]["url"] == ""
        for _ in range(4):  # ...and the healthy replicas keep serving
            assert await cluster.chat() in healthy
    assert await cluster.metric("llmgw_agent_refused_total", 'reason="invalid_report"') == len(bad_endpoints)

    # After a restart of its agent, the node registers again with the shard in its Register: refused the same.
    evil.close()
    again = await RawAgent.join(nursery, cluster.control_url, impostor_register(
        "evil", node_secret=evil.reply.node_secret, shards=[ready_report(start, "http://127.0.0.1:99999")]))
    assert again.reply.accepted

    async def refused_again():
        return await cluster.metric("llmgw_agent_refused_total", 'reason="invalid_report"') > len(bad_endpoints)

    await cluster.wait_for("the Register's shard refused", refused_again)
    await trio.sleep(0.5)  # a reconcile pass or two
    assert serve.process.returncode is None
    assert await cluster.chat() in healthy
    assert [m.about for m in again.of_type(wire.ErrorMessage) if m.code == "invalid_report"] == [start.shard_id]

    # A Register whose address is not a host is refused before it opens a session.
    bad_address = await RawAgent.join(nursery, cluster.control_url, impostor_register("bad-address",
                                                                                      address="h:abc/x"))
    assert not bad_address.reply.accepted and bad_address.reply.reason.startswith("invalid_report")
    again.close()
