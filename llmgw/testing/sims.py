"""Stand-in engines (simulators, fake upstreams) and a gateway in front of them: child processes on loopback.

:func:`sim_command` is how a simulator replica is started, :func:`gateway_config`
the YAML of a gateway routing one model over replicas with a given tier,
:func:`kv_sim_profile` that of a ``sim`` profile deployed by agents, and
:func:`start_sims` / :func:`start_fake_upstream` / :func:`start_gateway` start them in the caller's nursery
(via :func:`llmgw.testing.processes.run_child`, so cancelling the nursery stops them).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import httpx
import trio

from . import fake_upstream
from .processes import Child, llmgw_command, start_child, start_serve

MODEL = "tiny"
EVENTS = re.compile(r"llmgw-sim kv-events on (tcp://\S+)")
REPLAY = re.compile(r"llmgw-sim kv-replay on (tcp://\S+)")
# A simulator's flags for KV events a gateway can follow: bound PUB and replay sockets on ephemeral ports, announced
# on its output (read them with kv_sources), and vLLM's hashing with PYTHONHASHSEED=0 (KV_SIM_ENV).
KV_SIM_EXTRA = ("--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config",
                json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                            "replay_endpoint": "tcp://*:0", "topic": ""}))
KV_SIM_ENV = {"PYTHONHASHSEED": "0"}
CONSTANT_PROFILE = "constant"  # llmgw.sim.profiles.CONSTANT: the simulator's fixed-rate model


def sim_command(*, model: str = MODEL, num_blocks: int | None, block_size: int = 16, time_scale: float = 1.0,
                seed: int = 0, extra: Sequence[str] = ()) -> list[str]:
    """``num_blocks`` None: the simulator's own (what a GPU profile's memory holds). The constant model
    (``--profile constant``, whose numbers the tests are written with) unless ``extra`` names a ``--profile``:
    ``llmgw sim``'s own default is a GPU profile."""
    blocks = [] if num_blocks is None else ["--num-blocks", str(num_blocks)]
    profile = [] if "--profile" in extra else ["--profile", CONSTANT_PROFILE]
    return llmgw_command("sim", "--port", "0", "--served-model-name", model, *profile, *blocks,
                         "--block-size", str(block_size), "--time-scale", str(time_scale), "--seed", str(seed),
                         "--log-level", "WARNING", *extra)


def gateway_config(urls: Sequence[str], *, routing: str, routing_options: dict | None = None,
                   model: str = MODEL, kv_sources: Sequence[tuple[str, str]] | None = None,
                   prefill_tokens_per_s: Sequence[float] | None = None, scheduling_policy: str | None = None) -> str:
    """``kv_sources``: each replica's (events, replay) ZMQ endpoints, for a gateway that follows their events;
    ``prefill_tokens_per_s``: each replica's configured prefill rate (what its profile says);
    ``scheduling_policy``: what every replica's engine runs with (``priority``: started so)."""
    events = [f"        kv_events: {events}\n        kv_replay: {replay}\n" for events, replay in kv_sources] \
        if kv_sources is not None else [""] * len(urls)
    rates = [f"        prefill_tokens_per_s: {rate:.1f}\n" for rate in prefill_tokens_per_s] \
        if prefill_tokens_per_s is not None else [""] * len(urls)
    policy = f"        scheduling_policy: {scheduling_policy}\n" if scheduling_policy else ""
    replicas = "".join(f"      - url: {url}\n        name: sim-{i}\n{kv}{rate}{policy}" for i, (url, kv, rate) in
                       enumerate(zip(urls, events, rates, strict=True)))
    return (f"models:\n  - name: {model}\n    routing: {routing}\n"
            f"    routing_options: {json.dumps(routing_options or {})}\n    replicas:\n{replicas}"
            "health:\n  interval: 1s\nlog_level: warning\n")


def kv_sim_profile(args: str, routing_options: str = "{tokenize_timeout: 2s}", replicas: int = 2,
                   extra: str = "") -> str:
    """Config YAML: a ``sim`` profile with KV events and the ``kv_index`` tier, deployed ``replicas`` times;
    ``args`` (a YAML flow list's items) go to the engine (on the constant model unless they name a ``--profile``),
    ``extra`` (indented YAML lines) to the profile."""
    if "--profile" not in args:
        args = f'"--profile", "{CONSTANT_PROFILE}"' + (f", {args}" if args.strip() else "")
    return f"""
profiles:
  - name: tiny-sim
    engine: sim
    model_path: tiny
    served_model_name: {MODEL}
    kv_events: true
    routing: kv_index
    routing_options: {routing_options}
{extra}    args: [{args}]
deployments:
  - profile: tiny-sim
    replicas: {replicas}
"""


def kv_sources(sim: Child) -> tuple[str, str]:
    """A simulator's (events, replay) ZMQ endpoints, from its output (started with :data:`KV_SIM_EXTRA`)."""
    return _announced(EVENTS, sim), _announced(REPLAY, sim)


def _announced(pattern: re.Pattern, sim: Child) -> str:
    for line in sim.lines:
        match = pattern.search(line)
        if match:
            return match.group(1)
    raise RuntimeError(f"{sim.name} did not print its {pattern.pattern!r} line")


async def start_sims(nursery: trio.Nursery, count: int, *,
                     per_replica: Callable[[int], dict] | None = None, **sim_options) -> list[Child]:
    """Start ``count`` simulators at once; their Children in index order. ``per_replica(i)``: :func:`sim_command`
    options of replica ``i`` beside the common ``sim_options`` (replicas of different sizes or profiles)."""
    children: list[Child | None] = [None] * count
    env = sim_options.pop("env", None)  # added to the simulators' environment (e.g. PYTHONHASHSEED)

    async def start(i: int) -> None:
        options = {**sim_options, **(per_replica(i) if per_replica is not None else {})}
        children[i] = await start_child(nursery, sim_command(**options), name=f"sim-{i}", env=env)

    async with trio.open_nursery() as starting:
        for i in range(count):
            starting.start_soon(start, i)
    return children  # type: ignore[return-value]


async def start_fake_upstream(nursery: trio.Nursery, name: str, *, port: int = 0, chunks: int = 50,
                              model: str = MODEL, status: int = 200, extra: Sequence[str] = ()) -> Child:
    """A running :mod:`llmgw.testing.fake_upstream` (``extra``: more of its options, ``--tls-cert``...)."""
    argv = fake_upstream.command(name, port=port, chunks=chunks, model=model, status=status, extra=tuple(extra))
    return await start_child(nursery, argv, name=f"fake-{name}")


async def start_gateway(nursery: trio.Nursery, config_text: str) -> Child:
    """``llmgw serve`` on ephemeral ports with ``config_text``; ``child.control_url`` is set."""
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as directory:
        path = Path(directory) / "llmgw.yaml"
        path.write_text(config_text)
        return await start_serve(nursery, path)


async def stream_story(http: httpx.AsyncClient, url: str, seed: int, max_tokens: int = 200) -> int:
    """One streamed chat request for :data:`MODEL` through the gateway at ``url``, read to its end (a request that
    stays in flight as long as its answer streams); its HTTP status."""
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": f"tell me a story {seed}"}]}
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for _ in response.aiter_raw():
            pass
        return response.status_code
