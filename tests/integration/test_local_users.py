"""What another local user can do to a deployed engine: nothing to its KV events, nothing with its API key.

A local user reads every engine's command line (``/proc/PID/cmdline``, ``ps``). It must not find the engine's
API key there, and the KV-event endpoints it finds there must not let it learn the engine's sequence number
(the replay socket) nor publish a forged ``BlockStored`` into the agent's subscription (which would make the
``kv_index`` tier send prompts to a replica that does not hold them).
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import stat
import time
from pathlib import Path

import pytest
import trio
import zmq

from llmgw.kv.codec import encode_batch
from llmgw.kv.events import BlockStored, EventBatch
from llmgw.kv.keys import VllmBlockKeys
from llmgw.testing.cluster import BLOCK, all_up, complete, embedded, kv_state, kv_where, text
from llmgw.testing.sims import kv_sim_profile

pytestmark = pytest.mark.slow

ENGINE_KEY = "engine-k3y-never-on-argv"

def attack(events: str, replay: str, payload: bytes) -> dict:
    """What another local user tries (in a forked child, after dropping to that user): ask the replay socket for
    the engine's sequence, connect to the unix sockets, then publish a forged batch (the next seq) at the events
    endpoint for two seconds, as a bound SUB (tcp) or a socket file (ipc) would take it."""
    out: dict = {"replay_answered": False, "unix_connect": {}, "pub": []}
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    next_seq = 0
    try:
        dealer.connect(replay)
        dealer.send_multipart([b"", bytes(8)], zmq.NOBLOCK)
        while dealer.poll(1500):
            frames = dealer.recv_multipart()
            out["replay_answered"] = True
            if frames[2] == b"\xff" * 8:
                break
            next_seq = int.from_bytes(frames[2], "big") + 1
    except zmq.ZMQError as exc:
        out["replay_error"] = str(exc)
    for endpoint in (events, replay):
        if endpoint.startswith("ipc://"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(endpoint[len("ipc://"):])
                    out["unix_connect"][endpoint] = "connected"
                except OSError as exc:
                    out["unix_connect"][endpoint] = type(exc).__name__
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    for how in ("connect", "bind") if events.startswith("ipc://") else ("connect",):
        try:
            getattr(pub, how)(events)
            out["pub"].append(f"{how}: ok")
        except zmq.ZMQError as exc:
            out["pub"].append(f"{how}: {exc}")
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        pub.send_multipart([b"kv", next_seq.to_bytes(8, "big"), payload])
        time.sleep(0.05)
    out["forged_seq"] = next_seq
    pub.close(0)
    dealer.close(0)
    ctx.term()
    return out


def kv_config_of(pid: int) -> dict:
    """The ``--kv-events-config`` a local user reads on the engine's command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return json.loads(argv[argv.index("--kv-events-config") + 1])


def forged_payload() -> bytes:
    """A batch storing 8 blocks of tokens nobody sent, hashed the way the router keys them (it passes parity)."""
    tokens = list(range(1000, 1000 + 8 * BLOCK))
    hashes = VllmBlockKeys("sha256_cbor", "0").keys(tokens, BLOCK)
    stored = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BLOCK)
    return encode_batch(EventBatch(time.time(), [stored], 0))


async def attack_as(user: str, events: str, replay: str) -> dict:
    """:func:`attack` run by ``user`` in a child forked from this process (``user`` could not even start this
    interpreter, which lives under ``/root``; everything the attack uses is imported already)."""
    account = pwd.getpwnam(user)
    payload = forged_payload()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, attack, report, never return into pytest
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
            os.write(write_end, json.dumps(attack(events, replay, payload)).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    _, status = await trio.to_thread.run_sync(os.waitpid, pid, 0)
    with os.fdopen(read_end, "rb") as report:
        text_ = report.read()
    assert os.waitstatus_to_exitcode(status) == 0, text_
    return json.loads(text_)


async def test_another_local_user_cannot_reach_or_forge_a_deployed_engines_kv_events(cluster):
    cluster.write_config(embedded(cluster.tmp_path / "local")
                         + kv_sim_profile('"--num-blocks", "512", "--time-scale", "0"', replicas=1))
    await cluster.start_serve()
    (name,) = await cluster.replicas_where("the replica up", all_up(1))
    await kv_where(cluster, "its index healthy", lambda s: s.get(name, {}).get("state") == "healthy")
    # The engine published something (so it has a sequence to leak).
    await complete(cluster, text(5, 600))
    before = (await kv_where(cluster, "its first blocks", lambda s: s[name]["blocks"] > 0))[name]["blocks"]
    pid = (await cluster.replicas())[name]["shards"][0]["pid"]
    config = kv_config_of(pid)
    events, replay = config["endpoint"], config["replay_endpoint"]

    if os.geteuid() == 0:  # another user can be tried for real
        result = await attack_as("nobody", events, replay)
        await trio.sleep(1)  # anything forged would be in the index by now (the agent flushes every 25 ms)
        state = await kv_state(cluster)
        assert state[name]["blocks"] == before and state[name]["state"] == "healthy", (state[name], result)
        assert result["replay_answered"] is False, result  # the sequence number is not told
        assert set(result["unix_connect"].values()) == {"PermissionError"}, result
        assert not any(line.endswith(": ok") for line in result["pub"] if line.startswith("bind")), result
    # The endpoints are unix sockets the engine bound, in a folder only the agent's user can open.
    assert events.startswith("ipc://") and replay.startswith("ipc://"), config
    folder = Path(events[len("ipc://"):]).parent
    info = os.stat(folder)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    assert Path(replay[len("ipc://"):]).parent == folder

    # The engine's own events still reach the index end to end.
    _, usage = await complete(cluster, text(6, 3000))
    await kv_where(cluster, "a second prompt indexed",
                   lambda s: s[name]["blocks"] >= before + usage["prompt_tokens"] // BLOCK - 1)

    # The sockets are the engine's until it stops; then the agent removes them. A changed profile replaces the
    # engine (a new generation, with sockets of its own).
    sockets = [Path(endpoint[len("ipc://"):]) for endpoint in (events, replay)]
    assert all(stat.S_ISSOCK(path.stat().st_mode) for path in sockets)
    cluster.write_config(embedded(cluster.tmp_path / "local")
                         + kv_sim_profile('"--num-blocks", "256", "--time-scale", "0"', replicas=1))
    reloaded = await cluster.http.post(cluster.control_url + "/admin/reload")
    assert reloaded.status_code == 200, reloaded.text

    async def replaced():
        replicas = await cluster.replicas()
        shards = [r["shards"][0] for r in replicas.values() if r["state"] == "up" and r["shards"]]
        return shards and shards[0]["pid"] not in (0, pid) and not any(path.exists() for path in sockets)

    await cluster.wait_for("a new engine, the old one's sockets removed", replaced, timeout=60)
    (new,) = (await cluster.replicas()).values()
    assert kv_config_of(new["shards"][0]["pid"])["endpoint"] not in (events, replay)


async def test_the_engine_api_key_is_in_its_environment_not_on_its_command_line(cluster):
    profile = kv_sim_profile('"--time-scale", "0"', replicas=1, extra=f"    api_key: {ENGINE_KEY}\n")
    cluster.write_config(embedded(cluster.tmp_path / "local") + profile)
    serve = await cluster.start_serve()
    replicas = await cluster.replicas_where("the replica up", all_up(1))
    (name,) = replicas
    pid = replicas[name]["shards"][0]["pid"]
    assert ENGINE_KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    environ = Path(f"/proc/{pid}/environ")
    assert stat.S_IMODE(environ.stat().st_mode) == 0o400  # the engine's user's only
    assert f"VLLM_API_KEY={ENGINE_KEY}".encode() in environ.read_bytes().split(b"\0")

    # The engine requires the key, and the gateway (which has it) is let in.
    engine = replicas[name]["url"]
    refused = await cluster.http.post(engine + "/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                                         "max_tokens": 1})
    assert refused.status_code == 401
    chosen, _ = await complete(cluster, "hello there")
    assert chosen == name
    # Nor is it in any log: the agent's shard log (the engine's command line is written there) or the gateway's.
    logs = "".join(path.read_text() for path in (cluster.tmp_path / "local" / "logs").glob("*.log"))
    assert "starting shard" in logs and ENGINE_KEY not in logs
    assert ENGINE_KEY not in serve.output()
