"""The arms ``llmgw bench overload`` compares, each in front of the same running simulators, and what it reads of
them while the load runs.

- ``llmgw-flow``: llmgw's default config, flow control on; the tenants' keys carry their ``priority`` class. An
  llmgw without the ``flow:`` section (before issue 31's gateway work) has no flow control to measure: the arm
  says so and is not run.
- ``llmgw-flow-priority``: ``llmgw-flow`` with every replica's ``scheduling_policy: priority``: each request
  carries its class's engine priority, and the simulators (started with ``--scheduling-policy priority`` when this
  arm runs) serve the interactive class first among what waits in them. The other arms send no priority: every
  request's is 0, and an engine in priority scheduling then orders as in fcfs (arrival order, the latest arrival
  preempted), so they run on the same engines unchanged.
- ``llmgw-flow-chunk``: ``llmgw-flow`` on simulators of their own, started with ``--long-prefill-token-threshold``
  (the bench's ``--prefill-cap``, vLLM's per-step cap of each request's prefill: a profile's
  ``long_prefill_token_threshold``), so that no interactive prefill shares its step with a whole batch prompt. The
  cap changes every request's steps, so the other arms cannot share these engines: ``llmgw bench overload`` starts
  them for this arm and stops them after it.
- ``llmgw-off``: the same as ``llmgw-flow`` with ``flow: {enabled: false}`` (on an llmgw without the section, its
  default: no admission at all, which is what "off" means).
- ``vllm-router``: one vllm-router 0.1.17 (``cache_aware``) with its concurrency limit and queue:
  ``--max-concurrent-requests`` tuned to the fleet (:func:`router_tuning`), ``--queue-size``,
  ``--queue-timeout-secs``.

The llmgw arms run as N gateways on a private Redis (:class:`~.cluster_rig.ClusterRig`, the first its control
process, the others ``--role gateway``), routing ``kv_index`` on the simulators' KV events. :func:`sample_kv`
reads, every ``interval``, every simulator's ``vllm:kv_cache_usage_perc`` and ``vllm:num_requests_waiting``
and every llmgw gateway's queued requests (the sum of its ``llmgw_flow_queued`` series: :data:`QUEUE_GAUGE`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from ..config.schema import Config
from ..testing.metrics import samples, series_sum
from ..testing.processes import Child
from .cluster_rig import ClusterRig
from .overload_workload import Tenant
from .routing_arms import start_vllm_router

FLOW, FLOW_PRIORITY, FLOW_CHUNK = "llmgw-flow", "llmgw-flow-priority", "llmgw-flow-chunk"
OFF, VLLM_ROUTER = "llmgw-off", "vllm-router"
ARMS = (FLOW, FLOW_PRIORITY, FLOW_CHUNK, OFF, VLLM_ROUTER)
DEFAULT_ARMS = (FLOW, OFF, VLLM_ROUTER)
VLLM_ROUTER_POLICY = "cache_aware"
QUEUE_GAUGE = "llmgw_flow_queued"  # the requests a gateway holds in its queue, by model and class
ENGINE_KV, ENGINE_WAITING = "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"
ENGINE_RUNNING = "vllm:num_requests_running"
ENGINE_PREEMPTIONS = "vllm:num_preemptions_total"  # sequences an engine preempted (its KV cache ran out)
VERDICTS_COUNTER = "llmgw_flow_early_shed_verdicts_total"  # early sheds judged afterwards (wrong: idle_in_time)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
ALLOWANCE_GAUGE = "llmgw_flow_output_allowance_ratio"  # of max_tokens, what a gateway's room reserves


class ArmUnavailable(Exception):
    """The arm cannot run here (no flow control in this llmgw, vllm-router not installed): said, not measured."""


def flow_available() -> bool:
    """Whether this llmgw's config has the ``flow:`` section (issue 31's gateway work)."""
    return "flow" in {f.name for f in dataclasses.fields(Config)}


@dataclass(frozen=True)
class RouterTuning:
    """vllm-router's overload options."""

    max_concurrent_requests: int
    rate_limit_tokens_per_second: int
    queue_size: int
    queue_timeout_secs: int

    def argv(self) -> tuple[str, ...]:
        return ("--max-concurrent-requests", str(self.max_concurrent_requests),
                "--rate-limit-tokens-per-second", str(self.rate_limit_tokens_per_second),
                "--queue-size", str(self.queue_size), "--queue-timeout-secs", str(self.queue_timeout_secs))


def router_tuning(knee_concurrency: int, capacity_rps: float, queue_size: int, queue_timeout: int) -> RouterTuning:
    """vllm-router's limit is a token bucket: ``--max-concurrent-requests`` tokens, refilled at
    ``--rate-limit-tokens-per-second`` (its default: the same number per second, which at this fleet's size would
    let every arrival through). Tuned to the fleet: the bucket holds the closed-loop concurrency at which the fleet
    still met the interactive TTFT SLO at its highest throughput (the capacity ramp's knee), and refills at the
    capacity in requests/s, so the router lets in what the fleet serves well and queues the rest."""
    return RouterTuning(max(1, knee_concurrency), max(1, round(capacity_rps)), queue_size, queue_timeout)


def keys_config(tenants: Sequence[Tenant]) -> str:
    """The ``api_keys`` of the tenants, each with its class."""
    return "api_keys:\n" + "".join(
        f'  - {{key: "{t.key}", name: "{t.name}", priority: "{t.priority}"}}\n' for t in tenants)


@dataclass
class Fleet:
    """One arm as the load sees it."""

    arm: str
    gateways: int
    urls: list[str]  # where clients send (each gateway's data URL)
    control_urls: list[str]  # llmgw: each gateway's control URL (/metrics)
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.arm} x{self.gateways}"


@contextlib.asynccontextmanager
async def open_fleet(arm: str, gateways: int, engines: list[Child], tenants: Sequence[Tenant], workdir: Path,
                     vllm_router: str | None, tuning: RouterTuning,
                     output_quantile: str | None = None) -> AsyncIterator[Fleet]:
    """``arm`` with ``gateways`` routers in front of ``engines`` (running, kept after the block); the flow arms'
    ``flow.output_quantile`` (``off``: ``flow.learn_output: false``; None: the default)."""
    if arm == VLLM_ROUTER:
        if vllm_router is None:
            raise ArmUnavailable("vllm-router is not installed (llmgw bench overload --install-vllm-router)")
        async with trio.open_nursery() as nursery:
            urls = [s.url for s in engines]
            url, _pid = await start_vllm_router(nursery, vllm_router, VLLM_ROUTER_POLICY, urls, [], 16,
                                                tuning.argv())
            try:
                yield Fleet(arm, 1, [url], [], [" ".join(tuning.argv())])
            finally:
                nursery.cancel_scope.cancel()
        return
    config = keys_config(tenants)
    if arm in (FLOW, FLOW_PRIORITY, FLOW_CHUNK) and not flow_available():
        raise ArmUnavailable("not available: this llmgw has no flow control (the `flow:` config section)")
    if arm == OFF and flow_available():
        config += "flow:\n  enabled: false\n"
    elif arm in (FLOW, FLOW_CHUNK) and output_quantile is not None:
        config += "flow:\n  " + ("learn_output: false" if output_quantile == "off" else
                                   f"output_quantile: {float(output_quantile)}") + "\n"
    workdir.mkdir(parents=True, exist_ok=True)
    async with ClusterRig.open(workdir, followers=gateways - 1, engines=engines, extra_config=config,
                               scheduling_policy="priority" if arm == FLOW_PRIORITY else None) as rig:
        yield Fleet(arm, gateways, [g.url for g in rig.gateways], [g.control_url for g in rig.gateways])


async def _metrics(http: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    with trio.move_on_after(2.0):
        try:
            return samples((await http.get(url + "/metrics")).text)
        except httpx.HTTPError:
            return None
    return None


def queued(parsed: dict[str, float]) -> float | None:
    """A gateway's queued requests (every series of :data:`QUEUE_GAUGE`), None when it has no such gauge."""
    values = [v for k, v in parsed.items() if k.partition("{")[0] == QUEUE_GAUGE]
    return sum(values) if values else None


def allowance(parsed: dict[str, float]) -> float | None:
    """A gateway's output allowance ratio (the mean of its models'), None when it has no such gauge."""
    values = [v for k, v in parsed.items() if k.partition("{")[0] == ALLOWANCE_GAUGE]
    return sum(values) / len(values) if values else None


async def sample_kv(http: httpx.AsyncClient, engines: Sequence[str], gateways: Sequence[str], into: list[dict],
                    interval: float = 0.25, seats: int = 0) -> None:
    """Until cancelled, a sample every ``interval``: ``kv`` (the engines' mean KV usage, 0..1), ``waiting`` (their
    waiting requests), ``preemptions`` (their preemption counters' sum; None: an engine did not answer), ``queued``
    (the gateways' queued requests; None: no gateway has a queue gauge), ``allowance`` (the gateways' mean output
    allowance ratio; None: no gateway has the gauge), ``busy`` (the engines' mean of the larger of their KV usage and
    their running sequences over ``seats``, their ``--max-num-seqs``: an engine full of sequences is as busy as one
    full of blocks; None without ``seats``)."""
    while True:
        read: list[dict[str, float] | None] = [None] * (len(engines) + len(gateways))

        async def one(i: int, url: str) -> None:
            read[i] = await _metrics(http, url)

        async with trio.open_nursery() as nursery:
            for i, url in enumerate([*engines, *gateways]):
                nursery.start_soon(one, i, url)
        engine_read = [r for r in read[:len(engines)] if r is not None]
        if engine_read:
            gateway_queues = [q for r in read[len(engines):] if r is not None and (q := queued(r)) is not None]
            allowances = [a for r in read[len(engines):] if r is not None and (a := allowance(r)) is not None]
            into.append({"kv": sum(series_sum(r, ENGINE_KV) for r in engine_read) / len(engine_read),
                         "waiting": sum(series_sum(r, ENGINE_WAITING) for r in engine_read),
                         "preemptions": sum(series_sum(r, ENGINE_PREEMPTIONS) for r in engine_read)
                         if len(engine_read) == len(engines) else None,
                         "queued": sum(gateway_queues) if gateway_queues else None,
                         "allowance": sum(allowances) / len(allowances) if allowances else None,
                         "busy": sum(max(series_sum(r, ENGINE_KV), series_sum(r, ENGINE_RUNNING) / seats)
                                     for r in engine_read) / len(engine_read) if seats else None})
        await trio.sleep(interval)


async def gateway_series(http: httpx.AsyncClient, gateways: Sequence[str], stem: str) -> dict[str, float] | None:
    """Each series of ``stem`` (by its labels, ``{...}``), summed over the gateways; None when one did not answer."""
    total: dict[str, float] = {}
    for url in gateways:
        parsed = await _metrics(http, url)
        if parsed is None:
            return None
        for key, value in parsed.items():
            name, _, labels = key.partition("{")
            if name == stem:
                total[labels] = total.get(labels, 0.0) + value
    return total


async def engine_priority_requests(http: httpx.AsyncClient, gateways: Sequence[str]) -> float | None:
    """The requests the gateways sent with an engine priority (``llmgw_engine_priority_requests_total``, summed);
    None when a gateway did not answer."""
    found = await gateway_series(http, gateways, "llmgw_engine_priority_requests_total")
    return None if found is None else sum(found.values())


async def early_shed_verdicts(http: httpx.AsyncClient, gateways: Sequence[str]) -> dict[str, float] | None:
    """The gateways' early sheds judged so far (``llmgw_flow_early_shed_verdicts_total``), by ``class/verdict``;
    None when a gateway did not answer."""
    found = await gateway_series(http, gateways, VERDICTS_COUNTER)
    if found is None:
        return None
    out: dict[str, float] = {}
    for labels, value in found.items():
        fields = dict(_LABEL.findall(labels))
        key = f"{fields.get('class', '')}/{fields.get('verdict', '')}"
        out[key] = out.get(key, 0.0) + value
    return out


async def wait_idle(http: httpx.AsyncClient, engines: Sequence[str], timeout: float) -> bool:
    """Until no engine runs or holds a request (what an arm left behind drained); False when ``timeout`` passed."""
    with trio.move_on_after(timeout):
        while True:
            busy = 0.0
            for url in engines:
                parsed = await _metrics(http, url)
                busy += 1 if parsed is None else \
                    series_sum(parsed, "vllm:num_requests_running") + series_sum(parsed, ENGINE_WAITING)
            if busy == 0:
                return True
            await trio.sleep(0.25)
    return False
