"""Autoscaling in the product: the leader's control plane runs the scaler's counts, with real `llmgw agent`s on
fixture GPUs starting `llmgw sim` engines (with a modelled cold start), and a gateway run in the test's process
(so that the test hands it the stand-in scaler of tests/autoscale_standin.py and reads what it was shown).

Every wait is for a state, with a deadline that only fails a hung test.
"""

from __future__ import annotations

import dataclasses
import re

import httpx
import trio

from autoscale_standin import StandInScaler
from llmgw.autoscale.model import AutoscaleSettings
from llmgw.gateway.app import Gateway
from llmgw.plugins_manager import load_checked_config
from llmgw.testing.cluster import AGENTS, alive
from llmgw.testing.gateway import run_in_process
from llmgw.testing.processes import free_port, llmgw_command

STARTUP = 1.0  # the simulated engines' cold start, seconds: long enough for a step to see a replica starting
BATCH = {"x-llmgw-priority": "batch"}  # waits up to 60 s at the gateway (the default "standard" class: 10 s)


def config(*profiles: tuple[str, ...], replicas: str = "1", autoscale: str = "", profile_keys: str = "") -> str:
    """``profiles``: (profile, served model, extra sim args as a YAML list's items[, tp: 1 when not given]), each
    with ``profile_keys`` (YAML lines); each deployed with ``replicas`` and, when given, the ``autoscale`` section
    (a YAML flow mapping)."""
    text = "autoscale:\n  interval: 0.2s\n" + AGENTS + "profiles:\n"
    for name, model, args, *tp in profiles:
        text += f"""  - name: {name}
    engine: sim
    model_path: {model}
    served_model_name: {model}
    tp: {tp[0] if tp else 1}
    args: ["--num-blocks", "256", "--startup-seconds", "{STARTUP}"{args}]
{profile_keys}"""
    section = f"    autoscale: {autoscale}\n" if autoscale else ""
    text += "deployments:\n" + "".join(f"  - profile: {name}\n    replicas: {replicas}\n{section}"
                                       for name, *_ in profiles)
    return text


async def start(nursery, cluster, tmp_path, settings: dict[str, AutoscaleSettings] | None, *profiles,
                nodes=("a",), ports: tuple[int, int] | None = None, **config_options):
    """A gateway in ``nursery`` (on ``ports``, data and control, or ephemeral ones) and the agents of ``nodes``
    joined to it (started once). With ``settings``, it autoscales those deployments with a new stand-in scaler;
    without, with llmgw's own scaler and the config's keys (``config_options``: :func:`config`'s)."""
    scaler = StandInScaler()
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "llmgw.yaml"
    path.write_text(config(*profiles, **config_options))
    options = {} if settings is None else {
        "scaler": lambda config: scaler, "autoscale_settings": lambda deployment: settings.get(deployment.profile)}
    gateway = Gateway(load_checked_config(path, None), **options)
    running = await run_in_process(nursery, gateway, ports or (0, 0))
    cluster.control_url, cluster.data_url = running.control_url, running.url
    async with trio.open_nursery() as joining:
        for node in nodes:
            if node not in cluster.agents:
                joining.start_soon(cluster.start_agent, node, f"tiny-2gpu-{node}")
    return running, scaler


async def ask_at_once(gateway, count: int, max_tokens: int = 4, meanwhile=None) -> list[httpx.Response]:
    """``count`` chat completions at once; ``await meanwhile()`` while they are in flight, if given."""
    answers: list[httpx.Response] = []

    async def ask():
        answers.append(await chat(gateway, max_tokens=max_tokens))

    async with trio.open_nursery() as asking:
        for _ in range(count):
            asking.start_soon(ask)
        if meanwhile is not None:
            await meanwhile()
    return answers


async def autoscale(gateway, key: str) -> dict:
    response = await gateway.admin("/admin/autoscale")
    assert response.status_code == 200, response.text
    return response.json()["deployments"][key]


async def wait_for(cluster, what: str, predicate, timeout: float = 60.0):
    return await cluster.wait_for(what, predicate, timeout=timeout, interval=0.1)


def chat(gateway, model: str = "tiny", max_tokens: int = 4):
    """One chat completion in the batch class: it may wait at the gateway up to 60 s for a replica to start."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    return gateway.post("/v1/chat/completions", body, headers=BATCH, timeout=90)


async def test_from_zero_requests_wait_for_the_first_replica_and_to_zero_when_idle(nursery, cluster, tmp_path):
    settings = {"tiny-sim": AutoscaleSettings(min_replicas=0, max_replicas=2, queued_per_replica=4,
                                              scale_down_after=0.5, idle_to_zero=1.0)}
    gateway, scaler = await start(nursery, cluster, tmp_path, settings, ("tiny-sim", "tiny", ""))
    # At zero: declared (listed, ready), nothing placed.
    models = (await gateway.http.get(gateway.url + "/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert (await gateway.http.get(gateway.url + "/ready")).status_code == 200
    assert (await autoscale(gateway, "tiny-sim"))["desired"] == 0
    assert await cluster.replicas() == {}

    # Three requests arrive: they wait in the flow queue (not 503), the queue starts one replica, all are served.
    answers = await ask_at_once(gateway, 3)
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert {a.headers["x-llmgw-replica"] for a in answers} == {"tiny-sim-0"}
    first = [d for d in scaler.decisions if d.key == "tiny-sim"][0]
    assert (first.kind, first.current, first.desired) == ("from_zero", 0, 1)
    # The first of the three may be decided on alone (the scaler runs every 0.2 s; on a loaded machine the three
    # requests can land in two of its rounds), the count it asks for is one replica either way.
    assert re.fullmatch(r"[123] waiting or in flight need 1 replicas, 0 run", first.reason), first.reason
    # While it started, the scaler saw the requests queued and the replica starting (pending-aware input).
    assert any(v.signals.queued == 3 and v.counts.starting == 1 and v.counts.ready == 0 for _, v in scaler.views)

    # Idle for idle_to_zero: drained and stopped; the model stays declared and the gateway ready.
    await wait_for(cluster, "tiny-sim back to zero",
                   lambda: _replicas_are(cluster, set()))
    assert [d.kind for d in scaler.decisions] == ["from_zero", "to_zero"]
    assert (await gateway.http.get(gateway.url + "/ready")).status_code == 200
    status = await autoscale(gateway, "tiny-sim")
    assert (status["desired"], status["ready"], status["starting"]) == (0, 0, 0)
    assert [d["kind"] for d in status["decisions"]] == ["from_zero", "to_zero"]
    assert status["decisions"][1]["reason"]

    # And from zero once more.
    assert (await chat(gateway)).status_code == 200


HELD = 10  # requests held while the first replica starts
# An engine of 2 sequences whose requests last a while (16 tokens of 20 ms steps), starting cold in 8 s: long enough
# to queue the requests one by one in a known order before it is ready.
BURSTY = ("tiny-sim", "tiny", ', "--startup-seconds", "8", "--max-num-seqs", "2", "--profile", "constant", '
          '"--decode-ms-per-step", "20", "--output-tokens", "16:16"')


async def first_token(gateway, times: dict[int, float], index: int) -> None:
    """One streamed chat completion in the batch class; ``times[index]``: when its first token arrived (trio's
    clock). Fails on any answer but 200."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"hello {index}"}], "max_tokens": 16,
            "stream": True}
    async with gateway.http.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=BATCH,
                                   timeout=90) as answer:
        assert answer.status_code == 200, (await answer.aread()).decode()
        async for line in answer.aiter_lines():
            if line.startswith("data: {") and '"content"' in line and index not in times:
                times[index] = trio.current_time()


async def test_from_zero_the_held_requests_go_out_oldest_first_and_none_is_dropped(nursery, cluster, tmp_path):
    settings = {"tiny-sim": AutoscaleSettings(min_replicas=0, max_replicas=1, queued_per_replica=100,
                                              idle_to_zero=3600)}
    gateway, _ = await start(nursery, cluster, tmp_path, settings, BURSTY)
    times: dict[int, float] = {}
    async with trio.open_nursery() as asking:
        for index in range(HELD):  # one after another, each queued before the next is sent: a known order
            asking.start_soon(first_token, gateway, times, index)
            await wait_for(cluster, f"request {index} queued", lambda n=index + 1: _queued(gateway, n), timeout=30)
        assert not times  # all held while the engine starts
    assert len(times) == HELD  # every one answered (first_token fails on anything but 200)
    # The replica took the burst oldest first, a few at a time: its engine (2 sequences) gave the first request its
    # first token first, and no request a first token before one held several places ahead of it. Before the ramp
    # the whole burst went out at once, the engine taking it in the order the connections landed.
    assert times[0] <= min(times[j] for j in range(2, HELD)), times
    assert all(times[i] <= times[j] for i in range(HELD) for j in range(i + 4, HELD)), times
    assert await gateway.metric("llmgw_flow_ramps_total", 'model="tiny"') == 1
    assert await gateway.metric("llmgw_flow_ramp_held_requests_total", 'model="tiny"') == HELD


async def _queued(gateway, count: int) -> bool:
    return await gateway.metric("llmgw_flow_queued", 'model="tiny",class="batch"') == count


async def _replicas_are(cluster, names: set[str]) -> bool:
    replicas = await cluster.replicas()
    return set(replicas) == names


async def test_a_backlog_scales_up_one_step_at_a_time_and_down_drains_without_losing_a_request(
        nursery, cluster, tmp_path):
    slow = ', "--profile", "constant", "--decode-ms-per-step", "100", "--output-tokens", "60:60"'
    settings = {"tiny-sim": AutoscaleSettings(min_replicas=1, max_replicas=3, queued_per_replica=2,
                                              scale_down_after=3600)}
    gateway, scaler = await start(nursery, cluster, tmp_path, settings, ("tiny-sim", "tiny", slow))
    await wait_for(cluster, "the min replica up", lambda: _up(cluster, {"tiny-sim-0"}))

    # Four slow requests in flight on one replica need two: one step up.
    results = await ask_at_once(gateway, 4, 60, lambda: wait_for(
        cluster, "a second replica up", lambda: _up(cluster, {"tiny-sim-0", "tiny-sim-1"})))
    assert [r.status_code for r in results] == [200] * 4
    assert [(d.kind, d.current, d.desired) for d in scaler.decisions] == [("up", 1, 2)]

    # Two long requests, one on each replica, need one: after the window the highest index is drained, and the
    # request it holds finishes whole.
    settings["tiny-sim"] = dataclasses.replace(settings["tiny-sim"], scale_down_after=1.0)
    results = await ask_at_once(gateway, 2, 60, lambda: wait_for(
        cluster, "tiny-sim-1 retired", lambda: _replicas_are(cluster, {"tiny-sim-0"})))
    assert [r.status_code for r in results] == [200] * 2
    assert {r.headers["x-llmgw-replica"] for r in results} == {"tiny-sim-0", "tiny-sim-1"}
    assert all(r.json()["usage"]["completion_tokens"] == 60 for r in results)
    assert [(d.kind, d.current, d.desired) for d in scaler.decisions][1:] == [("down", 2, 1)]


async def _up(cluster, names: set[str]) -> bool:
    replicas = await cluster.replicas()
    return set(replicas) == names and all(r["state"] == "up" for r in replicas.values())


async def test_when_gpus_run_out_an_idle_model_gives_a_replica_to_one_with_a_backlog(nursery, cluster, tmp_path):
    # "other" starts at its min, 2: both GPUs of the node.
    settings = {"tiny-sim": AutoscaleSettings(min_replicas=0, max_replicas=2, queued_per_replica=4),
                "other-sim": AutoscaleSettings(min_replicas=2, max_replicas=3, scale_down_after=3600,
                                               idle_to_zero=3600)}
    gateway, scaler = await start(nursery, cluster, tmp_path, settings, ("tiny-sim", "tiny", ""),
                                  ("other-sim", "other", ""))
    await wait_for(cluster, "other at 2", lambda: _up(cluster, {"other-sim-0", "other-sim-1"}))
    # Its min lowered to 0 (a reload would do the same), it may give: "tiny" is called, no GPU is free, and idle
    # "other" gives its highest replica, drained; tiny's first starts on its GPU, and the request waits for it.
    settings["other-sim"] = dataclasses.replace(settings["other-sim"], min_replicas=0)
    answer = await chat(gateway)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-llmgw-replica"] == "tiny-sim-0"
    moves = [(d.kind, d.key, d.current, d.desired, d.taken_from) for d in scaler.decisions]
    assert moves == [("take", "tiny-sim", 0, 1, "other-sim"), ("give", "other-sim", 2, 1, None)]
    await wait_for(cluster, "other-sim-1 gone", lambda: _up(cluster, {"other-sim-0", "tiny-sim-0"}))
    status = (await gateway.admin("/admin/autoscale")).json()["deployments"]
    assert status["other-sim"]["decisions"][-1]["kind"] == "give"
    assert status["tiny-sim"]["decisions"][-1]["taken_from"] == "other-sim"


async def test_a_restarted_control_plane_starts_from_the_replicas_running_not_from_min(nursery, cluster, tmp_path):
    settings = {"tiny-sim": AutoscaleSettings(min_replicas=2, max_replicas=3, scale_down_after=3600,
                                              idle_to_zero=3600)}
    profile = ("tiny-sim", "tiny", "")
    ports = (free_port(), free_port())
    async with trio.open_nursery() as first_term:
        await start(first_term, cluster, tmp_path / "first", settings, profile, ports=ports)
        await wait_for(cluster, "2 replicas", lambda: _up(cluster, {"tiny-sim-0", "tiny-sim-1"}))
        pids = {r["shards"][0]["pid"] for r in (await cluster.replicas()).values()}
        first_term.cancel_scope.cancel()  # the control plane goes; the engines stay with their agent

    # A new control plane, its scaler fresh and its min 0, adopts both and keeps them: it starts from what runs.
    settings["tiny-sim"] = dataclasses.replace(settings["tiny-sim"], min_replicas=0)
    gateway, scaler = await start(nursery, cluster, tmp_path / "second", settings, profile, ports=ports)
    status = await wait_for(cluster, "the counts started", lambda: _started(gateway))
    assert (status["started_from"], status["desired"]) == (2, 2)
    await wait_for(cluster, "both adopted", lambda: _up(cluster, {"tiny-sim-0", "tiny-sim-1"}))
    assert {r["shards"][0]["pid"] for r in (await cluster.replicas()).values()} == pids
    assert {r["origin"] for r in (await cluster.replicas()).values()} == {"adopted"}
    assert scaler.decisions == []


async def _started(gateway) -> dict | None:
    status = await autoscale(gateway, "tiny-sim")
    return status if status["started_from"] is not None else None


async def test_llmgws_own_scaler_from_the_config_starts_a_replica_from_zero_and_returns_to_zero(
        nursery, cluster, tmp_path):
    gateway, _ = await start(nursery, cluster, tmp_path, None, ("tiny-sim", "tiny", ""),
                             replicas="{min: 0, max: 2}", autoscale="{idle_to_zero: 2s, ttft_slo: 60s}")
    assert (await autoscale(gateway, "tiny-sim"))["desired"] == 0
    answers = await ask_at_once(gateway, 2, max_tokens=1)  # one token: a non-streamed answer's TTFT is known
    assert [a.status_code for a in answers] == [200] * 2, [a.text for a in answers]

    # The signals the scaler reads (at its next step): the requests that entered the queue, their first tokens.
    async def measured():
        signals = (await autoscale(gateway, "tiny-sim"))["signals"]
        return signals if signals["arrivals_per_s"] > 0 and signals["ttft_attainment"] is not None else None

    signals = await wait_for(cluster, "arrivals and TTFT attainment measured", measured)
    assert signals["ttft_attainment"] == 1.0, signals  # both first tokens within the 60 s SLO
    await wait_for(cluster, "back to zero", lambda: _replicas_are(cluster, set()))
    status = await autoscale(gateway, "tiny-sim")
    kinds = [d["kind"] for d in status["decisions"] if d["kind"] != "hold"]
    assert kinds == ["from_zero", "to_zero"], status["decisions"]
    assert await gateway.metric("llmgw_autoscale_decisions_total", 'deployment="tiny-sim",kind="from_zero"') == 1
    assert await gateway.metric("llmgw_autoscale_desired_replicas", 'deployment="tiny-sim"') == 0
    # llmgw status shows it: the bounds, the counts and the last decision's reason.
    done = await trio.run_process(llmgw_command("status", "--control", gateway.control_url), capture_stdout=True)
    lines = done.stdout.decode().splitlines()
    row = lines[lines.index("AUTOSCALE (1)") + 2].split()
    assert row[:9] == ["tiny-sim", "tiny", "0..2", "0", "0", "0", "0", "0", "0"], lines
    assert " ".join(row[10:]).startswith("to_zero 1->0: no request for tiny"), lines


async def test_busy_seats_over_the_utilisation_target_step_up_before_the_queue_target(nursery, cluster, tmp_path):
    """Two clients in a closed loop on one replica whose profile declares two seats: nothing waits at the gateway
    (no queue, no backlog to measure arrivals by), yet the busy load is over the 70% utilisation target: llmgw's
    scaler steps up on the busy seats, and says so."""
    gateway, _ = await start(nursery, cluster, tmp_path, None, ("tiny-sim", "tiny", ', "--max-num-seqs", "2"'),
                             replicas="{min: 1, max: 2}",
                             autoscale="{lookahead: 2s, scale_up_after: 0.5s, queued_per_replica: 100}")
    await wait_for(cluster, "the first replica up", lambda: _up(cluster, {"tiny-sim-0"}))
    done = trio.Event()

    async def client():  # interactive: a class that may fill every seat (batch keeps 15% of them free)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 128}
        while not done.is_set():
            answer = await gateway.post("/v1/chat/completions", body, headers={"x-llmgw-priority": "interactive"},
                                        timeout=90)
            assert answer.status_code == 200, answer.text

    async def stepped_up():
        status = await autoscale(gateway, "tiny-sim")
        ups = [d for d in status["decisions"] if d["kind"] == "up"]
        return (status, ups[0]) if ups else None

    async with trio.open_nursery() as clients:
        for _ in range(2):
            clients.start_soon(client)
        status, up = await wait_for(cluster, "a step up on the busy seats", stepped_up)
        done.set()
    assert (up["from"], up["to"]) == (1, 2), up
    assert "busy" in up["reason"] and "over 70% of 1 provisioned replica" in up["reason"], up
    assert "queued over" not in up["reason"] and "arriving" not in up["reason"], up
    assert status["signals"]["busy"] is not None and status["scaler"]["busy"] is not None, status
    await wait_for(cluster, "the second replica", lambda: _up(cluster, {"tiny-sim-0", "tiny-sim-1"}))


async def test_a_replica_kept_warm_is_adopted_by_the_next_step_up_and_stopped_when_its_time_is_up(
        nursery, cluster, tmp_path):
    profile = ("tiny-sim", "tiny", "")
    gateway, _ = await start(nursery, cluster, tmp_path, None, profile, replicas="{min: 0, max: 2}",
                             autoscale="{idle_to_zero: 1s, keep_warm: 1h}")
    assert (await chat(gateway)).status_code == 200  # from zero: a cold start
    pid = (await cluster.replicas())["tiny-sim-0"]["shards"][0]["pid"]
    await wait_for(cluster, "back to zero", lambda: _replicas_are(cluster, set()))
    assert alive(pid)  # out of routing, its engine kept warm

    # Called again: the step up adopts the warm engine (no start), and serves from it.
    answer = await chat(gateway)
    assert answer.status_code == 200, answer.text
    replica = (await cluster.replicas())["tiny-sim-0"]
    assert (replica["shards"][0]["pid"], replica["origin"], replica["shards"][0]["restarts"]) == (pid, "adopted", 0)

    # With keep_warm lowered (a reload), the next scale-down keeps it only that long, then stops it.
    (tmp_path / "llmgw.yaml").write_text(config(profile, replicas="{min: 0, max: 2}",
                                                autoscale="{idle_to_zero: 1s, keep_warm: 0.5s}"))
    outcome = await gateway.gateway.reload()
    assert outcome.refusal is None
    await wait_for(cluster, "back to zero", lambda: _replicas_are(cluster, set()))
    await wait_for(cluster, "the warm engine stopped", lambda: _stopped(pid))


async def _stopped(pid: int) -> bool:
    return not alive(pid)


SLEEPY = ("tiny-sim", "tiny", ', "--hot-startup-seconds", "0.3"')  # wakes in 0.3 s, starts cold in 1 s
SLEEP_MODE = "    sleep_mode: true\n"


async def _shard_of(cluster, replica_id: str) -> dict:
    return (await cluster.replicas())[replica_id]["shards"][0]


async def _is_sleeping(gateway, endpoint: str) -> bool:
    answer = await gateway.http.get(endpoint + "/is_sleeping")
    assert answer.status_code == 200, answer.text
    return answer.json()["is_sleeping"]


async def _shard_reason_has(cluster, shard_id: str, *parts: str) -> bool:
    for node in (await cluster.nodes()).values():
        for shard in node["shards"]:
            if shard["shard_id"] == shard_id:
                return shard["state"] == "sleeping" and all(part in shard["reason"] for part in parts)
    return False


async def _node_shard_state(cluster, shard_id: str) -> str | None:
    for node in (await cluster.nodes()).values():
        for shard in node["shards"]:
            if shard["shard_id"] == shard_id:
                return shard["state"]
    return None


async def test_a_sleep_mode_replica_sleeps_when_scaled_down_and_the_next_step_up_wakes_it(
        nursery, cluster, tmp_path):
    gateway, _ = await start(nursery, cluster, tmp_path, None, SLEEPY, replicas="{min: 0, max: 2}",
                             autoscale="{idle_to_zero: 1s, keep_warm: 1h}", profile_keys=SLEEP_MODE)
    assert (await chat(gateway)).status_code == 200  # from zero: a cold start
    shard = await _shard_of(cluster, "tiny-sim-0")
    pid, endpoint, shard_id = shard["pid"], shard["endpoint"], shard["shard_id"]
    status = await autoscale(gateway, "tiny-sim")
    assert status["decisions"][0]["kind"] == "from_zero" and status["decisions"][0]["start"] == "a cold start"

    # Scaled to zero: out of routing, then put to sleep by its agent; the same engine process runs on.
    await wait_for(cluster, "back to zero", lambda: _replicas_are(cluster, set()))
    await wait_for(cluster, "the shard reported sleeping",
                   lambda: _equal(_node_shard_state(cluster, shard_id), "sleeping"))
    assert alive(pid) and await _is_sleeping(gateway, endpoint)
    assert (await autoscale(gateway, "tiny-sim"))["sleeping"] == 1
    await wait_for(cluster, "the sleeping gauge", lambda: _equal(
        gateway.metric("llmgw_autoscale_sleeping_replicas", 'deployment="tiny-sim"'), 1))

    # Its agent killed and started again: the new agent adopts the engine from its ledger and finds it asleep.
    cluster.agents["a"].kill()
    await cluster.agents["a"].wait_exit()
    await cluster.start_agent("a", "tiny-2gpu-a")
    await wait_for(cluster, "the adopted engine reported sleeping", lambda: _shard_reason_has(
        cluster, shard_id, "adopted running engine", "it sleeps (GET /is_sleeping)"))
    assert alive(pid) and await _is_sleeping(gateway, endpoint)
    assert await cluster.replicas() == {}  # not routed: a sleeping engine still answers /health

    # Called again: the step up adopts the sleeping engine, wakes it (a hot start) and routes it once awake.
    answer = await chat(gateway)
    assert answer.status_code == 200, answer.text
    replica = (await cluster.replicas())["tiny-sim-0"]
    assert (replica["shards"][0]["pid"], replica["origin"], replica["shards"][0]["restarts"]) == (pid, "adopted", 0)
    assert replica["shards"][0]["state"] == "ready" and not await _is_sleeping(gateway, endpoint)
    status = await autoscale(gateway, "tiny-sim")
    woke = [d for d in status["decisions"] if d["kind"] == "from_zero"][-1]
    assert woke["start"] == "woke 1 sleeping replica (a hot start)", status["decisions"]
    assert woke["reason"].endswith("; woke 1 sleeping replica (a hot start)"), woke
    assert status["sleeping"] == 0


async def test_an_engine_that_does_not_wake_is_stopped_and_started_cold(nursery, cluster, tmp_path):
    # A wake-up (60 s) longer than the profile's startup_timeout (8 s): the agent gives up on it.
    sleepy = ("tiny-sim", "tiny", ', "--hot-startup-seconds", "60"')
    gateway, _ = await start(nursery, cluster, tmp_path, None, sleepy, replicas="{min: 0, max: 2}",
                             autoscale="{idle_to_zero: 1s, keep_warm: 1h}",
                             profile_keys=SLEEP_MODE + "    startup_timeout: 8s\n")
    assert (await chat(gateway)).status_code == 200
    shard = await _shard_of(cluster, "tiny-sim-0")
    pid, shard_id = shard["pid"], shard["shard_id"]
    await wait_for(cluster, "back to zero", lambda: _replicas_are(cluster, set()))
    await wait_for(cluster, "the shard reported sleeping",
                   lambda: _equal(_node_shard_state(cluster, shard_id), "sleeping"))

    # Called again: the wake-up does not finish in time, the engine is stopped and the same shard started cold.
    answer = await chat(gateway)
    assert answer.status_code == 200, answer.text
    assert not alive(pid)
    shard = await _shard_of(cluster, "tiny-sim-0")
    assert shard["shard_id"] == shard_id and shard["pid"] != pid and shard["state"] == "ready", shard


async def test_a_sleeping_engine_is_stopped_when_another_model_needs_its_gpus(nursery, cluster, tmp_path):
    # Node a has 2 GPUs: tiny-sim sleeps on one, big-sim needs both (tp 2).
    big = ("big-sim", "big", "", "2")
    gateway, _ = await start(nursery, cluster, tmp_path, None, SLEEPY, big, replicas="{min: 0, max: 1}",
                             autoscale="{idle_to_zero: 1s, keep_warm: 1h}", profile_keys=SLEEP_MODE)
    assert (await chat(gateway)).status_code == 200
    shard = await _shard_of(cluster, "tiny-sim-0")
    await wait_for(cluster, "back to zero", lambda: _replicas_are(cluster, set()))
    await wait_for(cluster, "the shard reported sleeping",
                   lambda: _equal(_node_shard_state(cluster, shard["shard_id"]), "sleeping"))

    # big is called: it cannot be placed beside the sleeping engine, which is stopped first; then big serves.
    answer = await chat(gateway, model="big")
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-llmgw-replica"] == "big-sim-0" and not alive(shard["pid"])
    assert (await autoscale(gateway, "tiny-sim"))["sleeping"] == 0


async def _equal(value, expected) -> bool:
    return await value == expected
