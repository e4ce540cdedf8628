"""The KV-index pipeline end to end with real ``llmgw sim`` processes.

engine (PUB connects) -> EngineSubscription (SUB bound here, DEALER for replay)
-> EngineMirror -> KvChanges every 20 ms (flush_loop, as an agent would send them)
-> KvIndex (as the control plane would hand them over) -> the kv_index tier of a Router,
which tokenizes through the engines' /tokenize and routes.

Exactness is checked against the engines themselves: ``usage.prompt_tokens_details.
cached_tokens`` of real requests, and ``llmgw_sim_cached_blocks`` (stored minus removed
physical blocks) against the mirror's reference counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial

import httpx
import pytest
import trio

from llmgw.http.client import UpstreamPool
from llmgw.kv.index import IndexState, KvIndex
from llmgw.kv.keys import VllmBlockKeys
from llmgw.kv.mirror import EngineMirror, flush_loop
from llmgw.kv.subscriber import EngineSubscription
from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.replica import Replica
from llmgw.router.router import Router
from llmgw.router.tier import RouteRequest
from llmgw.testing.metrics import metric_value, scrape
from llmgw.testing.processes import Child, free_port, llmgw_command, start_child
from llmgw.wire import KvChangeKind, KvChanges

pytestmark = pytest.mark.slow

MODEL = "tiny"
BLOCK = 16
KEYS = VllmBlockKeys("sha256_cbor", "0")


@dataclass
class Engine:
    """One simulated replica with its subscription, mirror and relay into the router's index."""

    name: str
    sub: EngineSubscription
    mirror: EngineMirror
    events_endpoint: str
    replay_port: int | None
    sim_args: tuple[str, ...]
    replica: Replica | None = None
    child: Child | None = None
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=10))

    async def complete(self, body: dict) -> dict:
        response = await self.http.post(self.replica.url + "/v1/completions", json={"model": MODEL, **body})
        assert response.status_code == 200, response.text
        return response.json()

    async def chat(self, body: dict) -> dict:
        response = await self.http.post(self.replica.url + "/v1/chat/completions", json={"model": MODEL, **body})
        assert response.status_code == 200, response.text
        return response.json()

    async def tokenize(self, body: dict) -> list[int]:
        response = await self.http.post(self.replica.url + "/tokenize", json=body)
        return response.json()["tokens"]

    async def cache_state(self) -> tuple[int, int]:
        """``llmgw_sim_cached_blocks`` and ``llmgw_sim_kv_event_batches_total``, read in one scrape."""
        text = await scrape(self.replica.url, self.http)
        return (int(metric_value(text, "llmgw_sim_cached_blocks", default=None)),
                int(metric_value(text, "llmgw_sim_kv_event_batches_total", default=None)))


class Cluster:
    def __init__(self, nursery: trio.Nursery):
        self.nursery = nursery
        self.router = Router(build_registry(make_plugin_manager()), Metrics())
        self.route = self.router.configure_model(MODEL, "kv_index", {"tokenize_timeout": "2s", "seed": 3,
                                                                     "tokenizer": "replica", "key_function": "vllm"})
        self.tier = self.route.tier
        self.index: KvIndex = self.tier.index
        self.engines: dict[str, Engine] = {}

    async def add(self, name: str, *sim_args: str, replay: bool = True) -> Engine:
        # engine hashes (the simulators run sha256_cbor with PYTHONHASHSEED=0), their parity checked on real events
        mirror = EngineMirror(key_mode="engine", verify_keys=KEYS, name=name)
        replay_port = free_port() if replay else None
        sub = EngineSubscription("tcp://127.0.0.1:0", topic=b"kv", on_batch=mirror.apply, on_reset=mirror.reset,
                                 replay_endpoint=f"tcp://127.0.0.1:{replay_port}" if replay else None,
                                 source=name, idle_probe=0.2)
        endpoint = await self.nursery.start(sub.run)  # bound and receiving before the engine exists
        engine = Engine(name, sub, mirror, endpoint, replay_port, sim_args)
        self.engines[name] = engine
        await self.nursery.start(partial(flush_loop, mirror, partial(self.index.apply, name), interval=0.02))
        await self.start_process(engine)
        return engine

    async def start_process(self, engine: Engine) -> None:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": engine.events_endpoint,
                  "topic": "kv"}
        if engine.replay_port is not None:
            config["replay_endpoint"] = f"tcp://127.0.0.1:{engine.replay_port}"
        argv = llmgw_command("sim", "--port", "0", "--served-model-name", MODEL, "--profile", "constant",
                             "--time-scale", "0",
                             "--block-size", str(BLOCK), "--prefix-caching-hash-algo", "sha256_cbor",
                             "--output-tokens", "1:4", "--kv-events-config", json.dumps(config), *engine.sim_args)
        engine.child = await start_child(self.nursery, argv, name=f"sim-{engine.name}", env={"PYTHONHASHSEED": "0"})
        if engine.replica is not None:
            self.router.remove_replica(engine.replica)
        replica = Replica(name=engine.name, model=MODEL, url=engine.child.url)
        replica.pool = UpstreamPool(replica.host, replica.port)
        engine.replica = replica
        self.router.add_replica(replica)

    async def stop_process(self, engine: Engine) -> None:
        await engine.child.stop(timeout=10)

    async def settled(self, engine: Engine) -> None:
        """Wait until the engine's cache, the mirror and the index agree (all sent, all applied).

        Equal block counts alone do not show that: with a full cache a step evicts as many blocks as
        it stores, so the count stays put while that step's batch is still on its way. Every batch the
        engine has published must have been applied (the last one's seq is the batch count - 1).
        """
        with trio.fail_after(10):
            while True:
                physical, batches = await engine.cache_state()
                mirrored = sum(engine.mirror.refcount(k) for k in engine.mirror.keys())
                applied = -1 if engine.sub.last_seq is None else engine.sub.last_seq
                if applied == batches - 1 and physical == mirrored and not engine.mirror.pending \
                        and self.index.keys(engine.name) == set(engine.mirror.keys()):
                    return
                await trio.sleep(0.02)

    async def pick(self, path: str, body: dict, candidates=None):
        request = RouteRequest(MODEL, path, {"model": MODEL, **body})
        if candidates is None:
            decision = await self.router.pick(request)
        else:
            decision = await self.tier.pick(request, [self.engines[n].replica for n in candidates])
        return request, decision


@pytest.fixture
async def cluster(nursery):
    cluster = Cluster(nursery)
    yield cluster
    for engine in cluster.engines.values():
        await engine.http.aclose()


def text(seed: int, chars: int) -> str:
    words = [f"w{seed}x{i}" for i in range(chars // 4 + 1)]
    return " ".join(words)[:chars]


def blocks_of(tokens: list[int]) -> list[int]:
    return KEYS.keys(tokens, BLOCK)


async def test_a_shared_prefix_goes_to_its_holder_and_the_prediction_matches_the_engine(cluster):
    a = await cluster.add("a")
    b = await cluster.add("b")
    long_prompt = text(1, 3000)
    first = await a.complete({"prompt": long_prompt, "max_tokens": 1})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    await cluster.settled(a)
    tokens = await a.tokenize({"prompt": long_prompt})
    keys = blocks_of(tokens)
    assert cluster.index.match(keys, ["a", "b"]) == {"a": len(keys), "b": 0}
    assert a.mirror.parity is True  # the router's vllm keys reproduce the engine's hashes

    body = {"prompt": long_prompt + " and now a different question", "max_tokens": 2}
    request, decision = await cluster.pick("/v1/completions", body)
    assert decision.replica is a.replica and decision.outcome == "hit" and decision.tier == "kv_index"
    cluster.router.routed(request, decision)
    answer = await a.complete(body)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == decision.detail["predicted_cached_tokens"] == len(tokens) // BLOCK * BLOCK
    cluster.router.finished(request, decision, answer["usage"])
    assert cluster.tier.predicted_cached_total == cluster.tier.actual_cached_total == cached

    # a chat: the system prompt is the shared prefix; /tokenize renders the same template as generation
    system = {"role": "system", "content": text(2, 2000)}
    warm = await b.chat({"messages": [system, {"role": "user", "content": "first"}], "max_tokens": 1})
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    await cluster.settled(b)
    body = {"messages": [system, {"role": "user", "content": "second question"}], "max_tokens": 1}
    request, decision = await cluster.pick("/v1/chat/completions", body)
    assert decision.replica is b.replica and decision.outcome == "hit"
    answer = await b.chat(body)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == decision.detail["predicted_cached_tokens"] > 0
    cluster.router.finished(request, decision, answer["usage"])
    assert cluster.tier.predicted_cached_total == cluster.tier.actual_cached_total


async def test_dropped_events_are_replayed_and_the_index_stays_exact(cluster):
    # 64 blocks: the workload overflows the cache, so evictions (BlockRemoved) are replayed too
    a = await cluster.add("a", "--num-blocks", "64", "--drop-event-seqs", "1,4,5,9,14")
    await cluster.add("b")
    prompts = [text(100 + i, 300 + 37 * i) for i in range(12)]
    with trio.fail_after(30):  # until every dropped batch is behind us (a dropped last batch shows only later)
        i = 0
        while a.sub.last_seq is None or a.sub.last_seq < 16:
            await a.complete({"prompt": prompts[i % len(prompts)] + f" #{i}", "max_tokens": 3})
            i += 1
    await cluster.settled(a)  # engine == mirror (reference counts) == index, after 4 replayed holes
    sub = a.sub
    # 4 holes (4 and 5 make one), fewer when one replay also brought a later dropped batch (it returns
    # everything buffered from the hole on) before the live stream reached it
    assert 1 <= sub.gaps <= 4 and sub.replays == {"filled": sub.gaps} and not sub.resets
    assert a.mirror.ignored["unknown_block"] == 0
    for i, prompt in enumerate(prompts):  # what the index predicts is what the engine serves from cache
        tokens = await a.tokenize({"prompt": prompt})
        predicted = cluster.index.match(blocks_of(tokens), ["a"], predicted=False)["a"]
        answer = await a.complete({"prompt": prompt, "max_tokens": 3})
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            min(predicted, (len(tokens) - 1) // BLOCK) * BLOCK, f"prompt {i}"
        await cluster.settled(a)
    assert cluster.index.state("a") is IndexState.HEALTHY and cluster.index.describe("a")["resets"] == 0


async def test_without_replay_a_gap_resets_that_replica_and_it_relearns(cluster):
    a = await cluster.add("a", "--drop-event-seqs", "1", replay=False)
    b = await cluster.add("b")
    b_prompt = text(7, 500)
    await b.complete({"prompt": b_prompt, "max_tokens": 1})
    await cluster.settled(b)
    b_keys = cluster.index.keys("b")
    before = text(8, 500)
    await a.complete({"prompt": before, "max_tokens": 1})  # seq 0
    await a.complete({"prompt": text(9, 500), "max_tokens": 1})  # seq 1: never arrives
    after = text(10, 500)
    await a.complete({"prompt": after, "max_tokens": 1})  # seq 2: the gap shows, the mirror resets
    with trio.fail_after(10):
        await a.sub.wait_for(lambda s: s.last_seq is not None and s.last_seq >= 2)
        while a.mirror.pending or cluster.index.keys("a") != set(a.mirror.keys()):
            await trio.sleep(0.02)
    assert a.sub.resets == {"gap": 1} and a.sub.replays == {"disabled": 1}
    described = cluster.index.describe("a")
    assert described["resets"] == 1 and described["last_reset_reason"] == "gap"
    after_keys = blocks_of(await a.tokenize({"prompt": after}))
    before_keys = blocks_of(await a.tokenize({"prompt": before}))
    index = cluster.index
    assert index.match(after_keys, ["a"]) == {"a": len(after_keys)}  # re-learnt from the next batch on
    assert index.match(before_keys, ["a"], predicted=False) == {"a": 0}  # forgotten with the reset
    assert index.healthy("a") and index.keys("b") == b_keys  # the other replica never noticed


async def test_an_engine_restart_clears_that_replica_only(cluster):
    a = await cluster.add("a")
    b = await cluster.add("b")
    old = text(20, 800)
    await a.complete({"prompt": old, "max_tokens": 1})
    await b.complete({"prompt": text(21, 800), "max_tokens": 1})
    await cluster.settled(a)
    await cluster.settled(b)
    old_keys = blocks_of(await a.tokenize({"prompt": old}))
    b_keys = cluster.index.keys("b")
    assert cluster.index.match(old_keys, ["a"]) == {"a": len(old_keys)}

    await cluster.stop_process(a)
    await cluster.start_process(a)  # same event endpoint and replay port; its sequence starts at 0 again
    new = text(22, 800)
    await a.complete({"prompt": new, "max_tokens": 1})
    with trio.fail_after(10):  # seen live (seq back to 0) or, when that batch was lost, by the idle probe
        await a.sub.wait_for(lambda s: s.resets["engine_restart"] == 1)
    await cluster.settled(a)
    assert a.sub.resets == {"engine_restart": 1}
    new_keys = blocks_of(await a.tokenize({"prompt": new}))
    assert cluster.index.match(new_keys, ["a"]) == {"a": len(new_keys)}
    assert cluster.index.match(old_keys, ["a"], predicted=False) == {"a": 0}
    assert cluster.index.keys("b") == b_keys and not b.sub.resets


async def test_a_prefix_cache_reset_clears_that_replica_only(cluster):
    a = await cluster.add("a")
    b = await cluster.add("b")
    await a.complete({"prompt": text(30, 600), "max_tokens": 1})
    await b.complete({"prompt": text(31, 600), "max_tokens": 1})
    await cluster.settled(a)
    await cluster.settled(b)
    b_keys = cluster.index.keys("b")
    assert cluster.index.blocks("a") > 0
    response = await a.http.post(a.replica.url + "/reset_prefix_cache")
    assert response.json() == {"success": True}
    with trio.fail_after(10):
        await a.sub.wait_for(lambda s: s.resets["cleared"] == 1)
    await cluster.settled(a)
    assert cluster.index.blocks("a") == 0 and cluster.index.state("a") is IndexState.RESETTING
    assert cluster.index.describe("a")["last_reset_reason"] == "cleared"
    assert cluster.index.keys("b") == b_keys
    # the tree decides for "a" meanwhile; fresh stores end the reset window
    await a.complete({"prompt": text(32, 600), "max_tokens": 1})
    await cluster.settled(a)
    assert cluster.index.healthy("a")


async def test_a_slow_tokenize_and_an_unindexable_request_get_tree_decisions(cluster, nursery):
    a = await cluster.add("a")

    async def slow_tokenize(stream):
        await stream.receive_some(65536)
        await trio.sleep(30)

    listeners = await nursery.start(partial(trio.serve_tcp, slow_tokenize, 0, host="127.0.0.1"))
    slow = Replica(name="slow", model=MODEL, url=f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    cluster.router.add_replica(slow)
    cluster.index.apply("slow", KvChanges(kind=KvChangeKind.FULL, block_size=BLOCK))  # healthy, holds nothing
    cluster.tier.tokenizer.timeout = 0.1
    a.replica.local_inflight = 1  # the idle "slow" replica is asked to tokenize
    started = trio.current_time()
    request, decision = await cluster.pick("/v1/completions", {"prompt": text(40, 400)})
    assert trio.current_time() - started < 1.0  # the request waited for the deadline, not for the replica
    assert decision.outcome == "tokenize_timeout" and decision.tier == "kv_index"
    a.replica.local_inflight = 0

    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                       {"type": "image_url", "image_url": {"url": "x"}}]}]}
    request, decision = await cluster.pick("/v1/chat/completions", image)
    assert decision.outcome == "unindexable" and decision.detail["reason"] == "non_text_content"

    counter = cluster.router.metrics.decisions
    assert counter.labels(MODEL, "kv_index", "tokenize_timeout")._value.get() == 1
    assert counter.labels(MODEL, "kv_index", "unindexable")._value.get() == 1
    assert cluster.tier.fallbacks == {"tokenize_timeout": 1, "unindexable": 1}


async def test_fresh_engines_co_locate_a_burst_from_the_first_request_tokenized_in_the_router(cluster, tmp_path):
    from llmgw.sim.tokenizer_files import write_tokenizer_files

    # The router tokenizes with the engines' own tokenizer files (as a profile's model_path provides them).
    cluster.route = cluster.router.configure_model(MODEL, "kv_index", {
        "tokenize_timeout": "2s", "seed": 3, "tokenizer_path": str(write_tokenizer_files(tmp_path))})
    cluster.tier = cluster.route.tier
    a = await cluster.add("a")
    b = await cluster.add("b")
    with trio.fail_after(10):  # the fresh engines' first copies: healthy, nothing held, no block size yet
        while not (cluster.index.healthy("a") and cluster.index.healthy("b")):
            await trio.sleep(0.02)
    assert cluster.index.block_size("a") is None and cluster.index.block_size("b") is None
    system = {"role": "system", "content": text(7, 2000)}
    bodies = [{"messages": [system, {"role": "user", "content": f"question {i}"}], "max_tokens": 2}
              for i in range(6)]
    decisions = [(await cluster.pick("/v1/chat/completions", body))[1] for body in bodies]  # a burst: none sent yet
    owner = decisions[0].replica
    assert decisions[0].outcome == "miss" and decisions[0].detail["block_size"] == BLOCK  # assumed: vLLM's default
    assert all(d.replica is owner and d.outcome == "hit" for d in decisions[1:]), [d.outcome for d in decisions]
    explained = await cluster.tier.explain(RouteRequest(MODEL, "/v1/chat/completions", {"model": MODEL, **bodies[0]}),
                                           [a.replica, b.replica])
    entries = {e["name"]: e for e in explained["replicas"]}
    assert entries[owner.name]["block_size_from"] == "default" and explained["pick"] == owner.name
    held = entries[owner.name]["cost"]  # the burst's blocks, predicted: what the owner would not compute again
    assert held["cached_tokens"] > 1900 and held["new_tokens"] < 100
    assert held["estimated_ttft_s"] == min(e["cost"]["estimated_ttft_s"] for e in entries.values())
    engine = cluster.engines[owner.name]
    await engine.chat(bodies[0])
    await cluster.settled(engine)
    for body, decision in zip(bodies[1:], decisions[1:]):
        answer = await engine.chat(body)  # the engine's cached tokens are what the burst's decisions predicted
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == decision.detail["predicted_cached_tokens"]
    source = cluster.tier.tokenizer
    assert source.local is not None and source.mismatches == 0 and source.verify_left == 0
    assert source.replica.calls == 3  # only the first answers were checked against /tokenize
