"""Once a cluster settled: does the kv_index tier predict exactly the cached tokens each engine then serves?

For each replica, a fresh prompt is sent straight to its engine; once the
router's index holds exactly the blocks every engine holds (``/admin/kv``
against the engine's ``llmgw_sim_cached_blocks``), the same prompt plus a new
question goes through the gateway. It must be routed to that replica, and the
tier's predicted cached tokens (``llmgw_route_predicted_cached_tokens_total``)
must equal the engine's ``usage.prompt_tokens_details.cached_tokens``.
Used by ``llmgw bench fault`` and the fault-matrix tests; nothing else may be
sending requests meanwhile (the counters are compared before and after).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import trio

from ..testing.metrics import metric_value

MODEL = "tiny"


@dataclass
class KvCheck:
    replica: str
    routed_to: str
    predicted: int  # tokens the tier predicted for that request
    actual: int  # tokens the router counted from the engine's usage
    cached_tokens: int  # the engine's usage, as the client saw it

    @property
    def exact(self) -> bool:
        return self.routed_to == self.replica and self.predicted == self.actual == self.cached_tokens > 0


async def engine_cached_blocks(http: httpx.AsyncClient, engine_url: str) -> int:
    """The engine's own count of blocks holding a hash (``llmgw_sim_cached_blocks`` on its /metrics)."""
    text = (await http.get(engine_url + "/metrics")).text
    if "llmgw_sim_cached_blocks" not in text:
        raise ValueError(f"no llmgw_sim_cached_blocks at {engine_url}/metrics")
    return int(metric_value(text, "llmgw_sim_cached_blocks"))


async def index_matches_engines(http: httpx.AsyncClient, control_url: str, engines: dict[str, str]) -> bool:
    """Every replica's index is healthy and holds as many blocks as its engine (``engines``: name -> URL)."""
    state = {r["name"]: r for r in (await http.get(control_url + "/admin/kv")).json()["replicas"]}
    for name, url in engines.items():
        entry = state.get(name, {})
        if entry.get("state") != "healthy" or entry.get("blocks") != await engine_cached_blocks(http, url):
            return False
    return True


async def wait_settled(http: httpx.AsyncClient, control_url: str, engines: dict[str, str], timeout: float) -> None:
    with trio.fail_after(timeout):
        while True:
            try:
                if await index_matches_engines(http, control_url, engines):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await trio.sleep(0.1)


async def predicted_and_actual(http: httpx.AsyncClient, control_url: str) -> tuple[int, int]:
    text = (await http.get(control_url + "/metrics")).text
    return (int(metric_value(text, "llmgw_route_predicted_cached_tokens_total", f'model="{MODEL}"')),
            int(metric_value(text, "llmgw_route_actual_cached_tokens_total", f'model="{MODEL}"')))


def prompt(tag: str, words: int = 400) -> str:
    return " ".join(f"{tag}k{i}" for i in range(words))


async def check_kv_truth(http: httpx.AsyncClient, data_url: str, control_url: str, engines: dict[str, str], *,
                         tag: str, timeout: float = 60.0) -> list[KvCheck]:
    """One :class:`KvCheck` per replica (``engines``: replica name -> engine URL); ``tag`` makes prompts new."""
    prompts = {name: prompt(f"{tag}{i}") for i, name in enumerate(sorted(engines))}
    for name, text in prompts.items():
        response = await http.post(engines[name] + "/v1/completions",
                                   json={"model": MODEL, "prompt": text, "max_tokens": 1})
        response.raise_for_status()
    await wait_settled(http, control_url, engines, timeout)
    checks = []
    for name, text in prompts.items():
        before = await predicted_and_actual(http, control_url)
        response = await http.post(data_url + "/v1/completions",
                                   json={"model": MODEL, "prompt": text + " and a new question", "max_tokens": 1})
        response.raise_for_status()
        cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        after = await predicted_and_actual(http, control_url)
        checks.append(KvCheck(name, response.headers.get("x-llmgw-replica", ""), after[0] - before[0],
                              after[1] - before[1], cached))
    return checks
