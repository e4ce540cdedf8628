"""The routers the routing benchmark compares, each started in front of the same fresh simulators.

An :class:`Arm` is llmgw with one routing tier (``round_robin``, ``prefix_tree``, ``kv_index``;
options per arm), the Rust ``vllm-router`` with one policy, or the oracle. :func:`open_arm`
starts the simulators (KV events on the empty topic, ``--debug-routes``) and the router in the
caller's nursery and returns a :class:`Target`: how to send one chat request through each of its
gateways, which gateway takes the next request, and the routers' process ids (for their CPU time).

With ``gateways`` N > 1 an arm is N routers in front of the same simulators, as behind an L4
balancer: request *i* (in the order the clients send them) goes to gateway *i mod N*
(:class:`Spread`), so the turns of one conversation land on different gateways as new connections
through such a balancer would. The routers, by kind:

- llmgw: one cluster sharing its state through a private ``redis-server`` (``state.backend:
  redis``, a cluster of its own per run): one control process (it follows the engines' KV events
  and writes the replica table and the KV index's changes to Redis) and N-1 ``llmgw serve --role
  gateway`` processes following it; every process shares its in-flight load per replica with the
  others. Whatever else the cluster shares (in a later llmgw) it shares here too;
- vllm-router: N independent instances, each with the same worker list (for ``kv_aware`` each
  subscribes to the simulators' KV events itself): its only multi-instance mode;
- the oracle: N independent oracles, each reading the engines exactly but knowing only its own
  decisions in flight.

An llmgw arm with a ``source`` (``NAME@baseline``: ``llmgw bench routing --baseline DIR``) runs the
gateway of that other checkout (its folder as working directory and ``PYTHONPATH``) on the same
simulators, which are always this checkout's; every llmgw gateway is started so that it first prints
the ``llmgw`` package it imported (:attr:`Target.modules`), so a report shows which code ran.

The oracle is no process: for each request it asks every simulator ``POST /debug/prefix_hit``
(the prompt's cached leading tokens and the engine's queues, read from the engine itself) and
sends the request straight to the simulator whose estimated time to first token is the least:
``overhead + (1 + T / step_budget) x step(T / steps prefilled beside the running batch)`` with
``T`` the prefill tokens queued ahead plus this prompt's uncached tokens and ``step`` the
replica's own step model (:mod:`llmgw.sim.timing`, from the profile it runs: on a GPU profile
the step grows with the running batch and the context it reads; on the constant model this is
``T / prefill_rate + steps x step_time``). A prompt's cached tokens on a simulator are the
engine's answer or, when longer, the leading blocks the prompts it sent there and that are still
in flight will have computed (it tokenizes with the simulators' own tokenizer); the prefill queued
is the engine's or, when larger, the uncached tokens of the requests it sent there that have not
had their first token yet. So it knows each cache and queue exactly at decision time, and its own
decisions on their way; estimates within one engine step of each other are a tie, won by the
longer cached prefix, then the shorter queue. Its decision is free (the time to first token is
measured from the send to the chosen simulator).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Awaitable, Callable

import httpx
import trio

from ..sim import tokenizer
from ..sim.profiles import CONSTANT, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_PROFILE, ProfileError, profile
from ..sim.timing import ConstantTiming, GpuTiming, StepWork, Timing, causal_attention_pairs
from ..testing.processes import announced_module, checkout_env, free_port, start_child, start_serve
from ..testing.redis import start_private_redis
from ..testing.shared_state import state_section
from ..testing.sims import KV_SIM_ENV, KV_SIM_EXTRA, MODEL, gateway_config, kv_sources, start_sims
from .chat_workloads import ChatResult, send_chat

VLLM_ROUTER_READY = re.compile(rb"Starting server on (\S+)")


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # "llmgw", "vllm-router" or "oracle"
    policy: str = ""  # the llmgw tier or the vllm-router policy
    options: dict = field(default_factory=dict)  # llmgw routing_options
    source: Path | None = None  # llmgw: the checkout whose gateway runs (None: this one); see BASELINE

    @property
    def label(self) -> str:
        return f"vllm-router {self.policy}" if self.kind == "vllm-router" else self.name


ARMS = {arm.name: arm for arm in (
    Arm("round_robin", "llmgw", "round_robin"),
    Arm("prefix_tree", "llmgw", "prefix_tree"),
    Arm("kv_index", "llmgw", "kv_index"),
    Arm("oracle", "oracle"),
    Arm("vllm-router-round_robin", "vllm-router", "round_robin"),
    Arm("vllm-router-cache_aware", "vllm-router", "cache_aware"),
    Arm("vllm-router-kv_aware", "vllm-router", "kv_aware"),
)}


# ``NAME@baseline``: llmgw arm NAME run by the gateway of another checkout (``llmgw bench routing --baseline DIR``)
BASELINE = "baseline"

# a slower kind of GPU for the slow replicas of ``hetero`` (the first whose memory holds the model)
SLOWER_GPUS = {"h100": ("a100-40gb", "a100-80gb"), "a100-80gb": ("a100-40gb", "l4"), "a100-40gb": ("l4",),
               "mi300x": ("a100-80gb", "a100-40gb"), "l4": ()}
CONSTANT_SLOWDOWN = 2.0  # a slow replica on the constant model: half the prefill rate, twice the step


@dataclass
class SimSpec:
    """The simulators every arm runs on (by default 4 replicas of ``llmgw sim``'s default GPU profile)."""

    replicas: int = 4
    num_blocks: int | None = None  # None: 2861 on the constant model (2,860 usable blocks of 16 tokens: 45,760
    # tokens each), what the GPU's memory holds on a GPU profile
    block_size: int = 16
    prefill_tokens_per_s: float = 8000.0  # the constant model's rates
    decode_ms_per_step: float = 30.0
    max_model_len: int = 16384
    time_scale: float = 1.0
    seed: int = 0
    profile: str = DEFAULT_PROFILE  # every replica's ``--profile``
    slow_replicas: int = 0  # the first N replicas run a slower GPU (on the constant model: slower rates)
    output_tokens: tuple[int, int] | None = None  # the simulators' natural output lengths (None: theirs)

    CONSTANT_NUM_BLOCKS = 2861

    def replica_profile(self, i: int) -> str:
        """Replica ``i``'s ``--profile``: the run's, or for a slow replica the next slower GPU that holds the model."""
        if i >= self.slow_replicas or self.profile == CONSTANT:
            return self.profile
        gpu = profile(self.profile)
        suffix = self.profile[len(gpu.gpu.name):]
        for slower in SLOWER_GPUS.get(gpu.gpu.name, ()):
            try:
                profile(slower + suffix).num_blocks(self.block_size, DEFAULT_GPU_MEMORY_UTILIZATION)
            except ProfileError:
                continue
            return slower + suffix
        raise ProfileError(f"no slower GPU than {gpu.gpu.name} holds {gpu.model.name} for a slow replica")

    def _slowdown(self, i: int) -> float:
        return CONSTANT_SLOWDOWN if i < self.slow_replicas else 1.0

    def timing(self, i: int) -> Timing:
        """Replica ``i``'s step model, as its simulator computes it."""
        name = self.replica_profile(i)
        if name == CONSTANT:
            return ConstantTiming(self.prefill_tokens_per_s / self._slowdown(i),
                                  self.decode_ms_per_step * self._slowdown(i))
        return GpuTiming(profile(name))

    def blocks(self, i: int) -> int:
        """Replica ``i``'s KV cache in blocks, its null block included (as ``--num-blocks`` counts it)."""
        if self.num_blocks is not None:
            return self.num_blocks
        name = self.replica_profile(i)
        if name == CONSTANT:
            return self.CONSTANT_NUM_BLOCKS
        return profile(name).num_blocks(self.block_size, DEFAULT_GPU_MEMORY_UTILIZATION)

    def explicit_blocks(self, i: int) -> int | None:
        """``--num-blocks`` for replica ``i``: a given capacity, or None where its GPU's memory decides."""
        return self.num_blocks if self.num_blocks is not None or self.replica_profile(i) != CONSTANT \
            else self.CONSTANT_NUM_BLOCKS

    def fleet_tokens(self) -> int:
        """The KV cache of all the replicas together, in tokens."""
        return sum((self.blocks(i) - 1) * self.block_size for i in range(self.replicas))

    def extra(self, i: int = 0) -> list[str]:
        """Replica ``i``'s simulator flags beyond :func:`llmgw.testing.sims.sim_command`'s."""
        name = self.replica_profile(i)
        if name == CONSTANT:
            timing = ["--profile", CONSTANT,
                      "--prefill-tokens-per-s", str(self.prefill_tokens_per_s / self._slowdown(i)),
                      "--decode-ms-per-step", str(self.decode_ms_per_step * self._slowdown(i))]
        else:
            timing = ["--profile", name]
        if self.output_tokens is not None:
            timing += ["--output-tokens", f"{self.output_tokens[0]}:{self.output_tokens[1]}"]
        # (KV_SIM_EXTRA's empty topic: vllm-router 0.1.17 takes only that one)
        return [*timing, "--max-model-len", str(self.max_model_len), *KV_SIM_EXTRA, "--debug-routes"]


Send = Callable[[httpx.AsyncClient, list[dict], int], Awaitable[ChatResult]]


class Spread:
    """Which of N gateways takes the next request: request *i* in sending order goes to gateway *i mod N*
    (an L4 balancer's round robin over new connections, whatever conversation the request belongs to)."""

    def __init__(self, gateways: int):
        if gateways < 1:
            raise ValueError("at least one gateway")
        self.gateways = gateways
        self.sent = 0

    def next(self) -> int:
        gateway = self.sent % self.gateways
        self.sent += 1
        return gateway


@dataclass
class Target:
    sends: list[Send]  # one per gateway: a chat request through it
    sim_urls: list[str]
    router_pids: list[int]  # every router process (and the cluster's redis-server); empty: the oracle (in-process)
    decision_urls: list[str] = field(default_factory=list)  # llmgw: each gateway's control URL (/admin/decisions)
    modules: list[str | None] = field(default_factory=list)  # llmgw: the llmgw package file each gateway imported
    spread: Spread = field(init=False)  # which gateway takes the next request

    def __post_init__(self) -> None:
        self.spread = Spread(len(self.sends))


async def open_arm(nursery: trio.Nursery, arm: Arm, spec: SimSpec, vllm_router: str | None,
                   gateways: int = 1, omit: frozenset[str] = frozenset()) -> Target:
    """Fresh simulators and ``arm``'s ``gateways`` routers, in ``nursery`` (cancel it to stop them); ``omit``:
    :data:`OPTIONAL_KEYS` left out of an llmgw arm's config (:func:`baseline_omits`)."""
    sims = await start_sims(nursery, spec.replicas, env=KV_SIM_ENV, block_size=spec.block_size,
                            time_scale=spec.time_scale, seed=spec.seed,
                            per_replica=lambda i: {"num_blocks": spec.explicit_blocks(i), "extra": spec.extra(i)})
    urls = [sim.url for sim in sims]
    sources = [kv_sources(sim) for sim in sims]
    if arm.kind == "oracle":
        timings = [spec.timing(i) for i in range(spec.replicas)]
        return Target([Oracle(urls, spec.block_size, timings).send for _ in range(gateways)], urls, [])
    if arm.kind == "vllm-router":
        if vllm_router is None:
            raise RuntimeError("vllm-router is not installed")
        routers: list[tuple[str, int]] = [("", 0)] * gateways

        async def start(i: int) -> None:
            routers[i] = await start_vllm_router(nursery, vllm_router, arm.policy, urls, sources, spec.block_size)

        async with trio.open_nursery() as starting:
            for i in range(gateways):
                starting.start_soon(start, i)
        return Target([_through(url) for url, _ in routers], urls, [pid for _, pid in routers])
    config = arm_config(arm, urls, sources, spec, omit)
    kv = arm.policy == "kv_index"
    directory = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))  # the config, and the redis-server's folder
    nursery.start_soon(_remove_when_cancelled, directory)
    pids = []
    if gateways > 1:
        redis = await start_private_redis(nursery, directory)
        config += cluster_state(redis.url, "bench")
        pids.append(redis.pid)
    path = directory / "llmgw.yaml"
    path.write_text(config)
    # another checkout's gateway: its own code on the path (this checkout's simulators all the same)
    serve = partial(start_serve, nursery, path, announce_module=True, cwd=arm.source,
                    env=None if arm.source is None else checkout_env(arm.source))
    control = await serve()  # the control process first: the others follow its log
    followers = []
    async with trio.open_nursery() as starting:
        async def follower() -> None:
            followers.append(await serve("--role", "gateway"))

        for _ in range(gateways - 1):
            starting.start_soon(follower)
    processes = [control, *followers]
    async with trio.open_nursery() as waiting:
        for process in processes:
            waiting.start_soon(partial(_gateway_ready, replicas=spec.replicas, kv=kv), process.control_url)
    return Target([_through(p.url) for p in processes], urls, [p.pid for p in processes] + pids,
                  [p.control_url for p in processes], [announced_module(p) for p in processes])


# keys the bench writes that an older checkout's config may not know: hints, left out for every arm of a run whose
# baseline does not read them (the prefill rate each replica's profile gives: the cost model's prior without it)
OPTIONAL_KEYS = ("prefill_tokens_per_s",)


def arm_config(arm: Arm, urls: list[str], sources: list[tuple[str, str]], spec: SimSpec,
               omit: frozenset[str] = frozenset()) -> str:
    """The config an llmgw arm's gateways read: the simulators as one model's replicas (each with its profile's
    prefill rate, unless omitted), the arm's tier and options (and with ``kv_index`` each replica's KV event
    endpoints). The same for a baseline arm: only keys both checkouts read (:func:`baseline_omits`)."""
    rates = None if "prefill_tokens_per_s" in omit else [spec.timing(i).prefill_tokens_per_s
                                                         for i in range(len(urls))]
    return gateway_config(urls, routing=arm.policy, routing_options=arm.options,
                          kv_sources=sources if arm.policy == "kv_index" else None, prefill_tokens_per_s=rates)


def baseline_config_problems(arm: Arm, spec: SimSpec, omit: frozenset[str] = frozenset()) -> str | None:
    """What the baseline checkout's own ``llmgw config check`` finds wrong with the config ``arm`` will run on
    (with placeholder addresses), or None when it reads it: a key it lacks, a tier or option it does not know."""
    assert arm.source is not None, "a baseline arm"
    urls = [f"http://127.0.0.1:{9 + i}" for i in range(spec.replicas)]
    sources = [(f"tcp://127.0.0.1:{19 + i}", f"tcp://127.0.0.1:{29 + i}") for i in range(spec.replicas)]
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as directory:
        path = Path(directory) / "llmgw.yaml"
        path.write_text(arm_config(arm, urls, sources, spec, omit))
        try:
            done = subprocess.run([sys.executable, "-m", "llmgw", "config", "check", str(path)], cwd=arm.source,
                                  env=dict(os.environ, **checkout_env(arm.source)), capture_output=True, text=True,
                                  timeout=60)
        except subprocess.TimeoutExpired:
            return f"`llmgw config check` of {arm.source} did not answer within 60 s"
    if done.returncode == 0:
        return None
    return (done.stdout + done.stderr).strip().replace(str(path), "the bench's config") or \
        f"`llmgw config check` of {arm.source} exited with code {done.returncode}"


def baseline_omits(arm: Arm, spec: SimSpec) -> tuple[frozenset[str], str | None]:
    """The :data:`OPTIONAL_KEYS` to leave out of every llmgw arm's config so that the baseline reads it, and what
    the baseline's check still finds wrong without them (None: it reads it)."""
    problems = baseline_config_problems(arm, spec)
    if problems is None:
        return frozenset(), None
    omit = frozenset(key for key in OPTIONAL_KEYS if f".{key}: unknown key" in problems)
    return omit, baseline_config_problems(arm, spec, omit) if omit else problems


async def _remove_when_cancelled(directory: Path) -> None:
    try:
        await trio.sleep_forever()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def cluster_state(redis_url: str, cluster: str) -> str:
    """The config lines of a gateway sharing its state with the others of ``cluster`` through Redis."""
    return state_section(redis_url, cluster)


def _through(url: str) -> Send:
    async def send(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> ChatResult:
        return await send_chat(client, url, MODEL, messages, max_tokens)
    return send


async def _gateway_ready(control_url: str, replicas: int, *, kv: bool, timeout: float = 60.0) -> None:
    """Every replica routable (and with ``kv``, every replica's index fed by its events)."""
    async with httpx.AsyncClient(timeout=5) as http:
        with trio.fail_after(timeout):
            while True:
                models = (await http.get(control_url + "/admin/models")).json()
                ready = models and models[0]["routable"] == replicas
                if ready and kv:
                    states = [r["state"] for r in (await http.get(control_url + "/admin/kv")).json()["replicas"]]
                    ready = states.count("healthy") == replicas
                if ready:
                    return
                await trio.sleep(0.1)


async def start_vllm_router(nursery: trio.Nursery, executable: str, policy: str, urls: list[str],
                            sources: list[tuple[str, str]], block_size: int,
                            extra: tuple[str, ...] = ()) -> tuple[str, int]:
    """A ``vllm-router`` with ``policy`` over ``urls`` (``extra``: more of its options); its URL and pid."""
    port = free_port()
    argv = [executable, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1", "--log-level", "info",
            *extra]
    if policy == "kv_aware":
        for url, (events, replay) in zip(urls, sources):
            argv += ["--kv-event-source", f"{url}={events}", "--kv-event-replay-source", f"{url}={replay}"]
        argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", MODEL]
    child = await start_child(nursery, argv, name=f"vllm-router {policy}", startup_timeout=60,
                              ready=VLLM_ROUTER_READY)
    return f"http://127.0.0.1:{port}", child.pid


def block_keys(ids: list[int], block_size: int) -> list[int]:
    """Chained keys of the full blocks of ``ids``: equal keys, equal prefixes up to that block."""
    keys, parent = [], 0
    for b in range(len(ids) // block_size):
        parent = hash((parent, tuple(ids[b * block_size:(b + 1) * block_size])))
        keys.append(parent)
    return keys


def leading(keys: list[int], held) -> int:
    """How many of ``keys`` from the first are in ``held``."""
    count = 0
    for key in keys:
        if key not in held:
            break
        count += 1
    return count


class Oracle:
    """Sends each request to the simulator with the least estimated time to first token, read from the engines."""

    def __init__(self, urls: list[str], block_size: int, timings: list[Timing]):
        self.urls = urls
        self.block_size = block_size
        self.timings = timings  # each replica's step model (the simulators' own, from their profiles)
        self.turn = 0  # rotates ties
        self.in_flight: list[Counter] = [Counter() for _ in urls]  # block keys of prompts sent, not yet answered
        self.prefilling = [0] * len(urls)  # uncached prompt tokens of requests sent, before their first token
        self.deciding = trio.Lock()

    async def pick(self, client: httpx.AsyncClient, body: dict, keys: list[int]) -> tuple[int, int]:
        """The simulator to send ``body`` to, and the prompt tokens it will compute."""
        states: list[dict] = [{}] * len(self.urls)

        async def ask(i: int) -> None:
            response = await client.post(self.urls[i] + "/debug/prefix_hit", json=body)
            response.raise_for_status()
            states[i] = response.json()

        async with trio.open_nursery() as nursery:
            for i in range(len(self.urls)):
                nursery.start_soon(ask, i)
        self.turn += 1
        for i, state in enumerate(states):
            usable = keys[:(state["prompt_tokens"] - 1) // state["block_size"]]  # the last token is computed
            coming = leading(usable, self.in_flight[i]) * state["block_size"]
            state["cached_tokens"] = max(state["cached_tokens"], coming)
            state["pending_prefill_tokens"] = max(state["pending_prefill_tokens"], self.prefilling[i])
        # estimates within one engine step of each other are a tie: the longer cached prefix wins it, then
        # the shorter queue (the cache it builds serves the requests that follow)
        estimates = [self.estimate(s, timing) for s, timing in zip(states, self.timings)]
        near = min(estimates) + states[0]["decode_ms_per_step"] / 1000.0
        best = min((-s["cached_tokens"], s["running"] + s["waiting"], (i - self.turn) % len(states), i)
                   for i, s in enumerate(states) if estimates[i] <= near)[-1]
        return best, states[best]["prompt_tokens"] - states[best]["cached_tokens"]

    @staticmethod
    def estimate(state: dict, timing: Timing) -> float:
        """Seconds to this request's first token on a replica with step model ``timing``: the prefill ahead of
        it and its own, in steps that each also decode the running batch (on a GPU profile a step grows with
        that batch and the context it reads), plus the frontend's overhead."""
        tokens = state["pending_prefill_tokens"] + state["prompt_tokens"] - state["cached_tokens"]
        steps = 1 + tokens / state["max_num_batched_tokens"]  # not rounded: a ceil would split near-equal costs
        chunk = round(tokens / steps)
        running = state["running"]
        step = timing.step_seconds(StepWork(
            prefill_tokens=chunk, decode_tokens=running,
            context_tokens=state.get("running_context_tokens", 0) + state["cached_tokens"] + chunk,
            attention_pairs=causal_attention_pairs(state["cached_tokens"], chunk), sequences=running + 1))
        return timing.request_overhead_s + steps * step

    async def send(self, client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> ChatResult:
        keys = block_keys(tokenizer.encode_chat(messages), self.block_size)
        async with self.deciding:  # one decision at a time, each seeing the ones before it
            chosen, uncached = await self.pick(client, {"model": MODEL, "messages": messages}, keys)
            self.in_flight[chosen].update(keys)
            self.prefilling[chosen] += uncached
        prefilled = False

        def first_token() -> None:  # the response head leaves the simulator with the first token
            nonlocal prefilled
            if not prefilled:
                prefilled = True
                self.prefilling[chosen] -= uncached

        try:
            result = await send_chat(client, self.urls[chosen], MODEL, messages, max_tokens, on_head=first_token)
        finally:
            first_token()
            self.in_flight[chosen].subtract(keys)
            self.in_flight[chosen] += Counter()  # drops the keys no request in flight holds any more
        result.replica = f"sim-{chosen}"
        return result
