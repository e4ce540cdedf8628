"""Which requests can be indexed (and why not), the /tokenize bodies, the cache, and the client's deadline."""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio

from llmgw.http.client import UpstreamPool
from llmgw.kv.keys import VllmBlockKeys, request_extra_keys
from llmgw.kv.tokenize import CACHE_ENTRY_OVERHEAD, CHAT_PATH, COMPLETIONS_PATH, TokenizeCache, TokenizeError, plan
from llmgw.plugins.replica_tokenizer import TokenizeClient
from llmgw.router.replica import Replica
from llmgw.sim.app import Simulator
from llmgw.sim.config import SimConfig

BASE = frozenset({"tiny"})


def body_of(p) -> dict:
    return json.loads(p.body)


def test_chat_bodies_carry_exactly_the_fields_that_change_the_prompt():
    request = {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}],
        "add_generation_prompt": False, "continue_final_message": True, "chat_template": "{{ x }}",
        "chat_template_kwargs": {"enable_thinking": False}, "add_special_tokens": True,
        "temperature": 0.3, "max_tokens": 5, "stream": True, "cache_salt": "tenant-1",
    }
    p = plan(CHAT_PATH, request, base_models=BASE)
    assert p.indexable and p.token_ids is None
    assert body_of(p) == {k: request[k] for k in ("model", "messages", "tools", "add_generation_prompt",
                                                  "continue_final_message", "chat_template",
                                                  "chat_template_kwargs", "add_special_tokens")}
    assert p.cache_salt == "tenant-1"
    # vLLM's chat defaults apply on both sides: fields the request leaves out stay out
    minimal = plan(CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]})
    assert body_of(minimal) == {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    # canonical bytes: the same request in another key order is the same cache key
    shuffled = dict(reversed(list(request.items())))
    assert plan(CHAT_PATH, shuffled, base_models=BASE).body == p.body


def test_completion_bodies():
    p = plan(COMPLETIONS_PATH, {"model": "tiny", "prompt": "hello", "max_tokens": 3}, base_models=BASE)
    assert body_of(p) == {"model": "tiny", "prompt": "hello", "add_special_tokens": True}
    p = plan(COMPLETIONS_PATH, {"prompt": ["hello"], "add_special_tokens": False})
    assert body_of(p) == {"prompt": "hello", "add_special_tokens": False}


def test_token_id_prompts_need_no_tokenize_call():
    p = plan(COMPLETIONS_PATH, {"prompt": [1, 2, 3]})
    assert p.indexable and p.body is None and p.token_ids == [1, 2, 3]
    p = plan(COMPLETIONS_PATH, {"prompt": [[5, 6]]})
    assert p.token_ids == [5, 6]


@pytest.mark.parametrize("path, body, reason", [
    ("/v1/embeddings", {"input": "x"}, "path"),
    ("/v1/responses", {"input": "x"}, "path"),
    (CHAT_PATH, {"messages": []}, "bad_body"),
    (CHAT_PATH, {"messages": "hi"}, "bad_body"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:..."}}]}]},
     "non_text_content"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "non_text_content"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                 "continue_final_message": True}, "both_prompt_flags"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "both_prompt_flags"),
    (COMPLETIONS_PATH, {"prompt": ["a", "b"]}, "batched_prompt"),
    (COMPLETIONS_PATH, {"prompt": [[1, 2], [3]]}, "batched_prompt"),
    (COMPLETIONS_PATH, {"prompt": ""}, "empty_prompt"),
    (COMPLETIONS_PATH, {"prompt": []}, "empty_prompt"),
    (COMPLETIONS_PATH, {"prompt": "x", "prompt_embeds": "base64..."}, "prompt_embeds"),
    (COMPLETIONS_PATH, {"prompt": [1, "2"]}, "bad_body"),
    (COMPLETIONS_PATH, {"prompt": [1, True]}, "bad_body"),
    (COMPLETIONS_PATH, {"prompt": 5}, "bad_body"),
    (COMPLETIONS_PATH, {"prompt": "x", "add_special_tokens": "yes"}, "bad_body"),
    (COMPLETIONS_PATH, {"model": "some-adapter", "prompt": "x"}, "unknown_lora"),
    (COMPLETIONS_PATH, {"prompt": "x", "cache_salt": ""}, "bad_cache_salt"),
    (COMPLETIONS_PATH, {"prompt": "x", "cache_salt": 7}, "bad_cache_salt"),
])
def test_unindexable_requests_say_why(path, body, reason):
    p = plan(path, body, base_models=BASE)
    assert not p.indexable and p.reason == reason and p.body is None and p.token_ids is None


def test_salt_and_lora_become_vllm_extra_keys():
    p = plan(COMPLETIONS_PATH, {"model": "sql", "prompt": "x", "cache_salt": "t"}, base_models=BASE,
             loras={"sql": "/adapters/sql"})
    assert p.lora == ("sql", "/adapters/sql") and p.cache_salt == "t"
    assert p.extra_keys(40, 16) == request_extra_keys(40, 16, lora=("sql", "/adapters/sql"), cache_salt="t")
    assert p.extra_keys(40, 16, style="event") == [("sql", "t"), ("sql",)]
    assert plan(COMPLETIONS_PATH, {"prompt": "x"}).extra_keys(40, 16) is None


def test_cache_is_an_lru_bounded_by_tokens():
    entry = CACHE_ENTRY_OVERHEAD  # what each entry is charged beside its ids
    cache = TokenizeCache(max_tokens=3 * entry + 10)
    cache.put(b"a", [1, 2, 3, 4])
    cache.put(b"b", [5, 6, 7, 8])
    assert cache.get(b"a") == [1, 2, 3, 4]  # a is now the most recent
    cache.put(b"c", [9, 10, 11])
    assert cache.get(b"b") is None and cache.get(b"a") == [1, 2, 3, 4] and cache.get(b"c") == [9, 10, 11]
    assert cache.tokens == 2 * entry + 7
    cache.put(b"huge", list(range(2 * entry + 11)))  # larger than the whole cache: not kept
    assert cache.get(b"huge") is None and len(cache) == 2
    assert cache.hits == 3 and cache.misses == 2


def test_cache_bounds_entries_and_body_bytes_whatever_the_answers():
    """An empty answer, or a short one to a large body, is charged too: neither the entries nor the bodies held
    grow past the bound however many such answers come (the soak of issue 29 looked for what grows per request)."""
    cache = TokenizeCache(max_tokens=1000)
    for i in range(5000):
        cache.put(b'{"messages":[%d],"chat_template":""}' % i, [])
    assert len(cache) <= 1000 // CACHE_ENTRY_OVERHEAD and cache.tokens <= 1000
    for i in range(200):
        cache.put(b"x" * 3000 + b"%d" % i, [7])
    held = sum(len(body) for body in cache._entries)
    assert held <= 4 * 1000 and len(cache) >= 1 and cache.tokens <= 1000
    cache.put(b"y" * 5000, [1])  # a body worth more than the whole cache: not kept
    assert cache.get(b"y" * 5000) is None


@pytest.fixture
async def sim(nursery):
    simulator = Simulator(SimConfig(port=0, served_model_names=["tiny"], time_scale=0, api_key="sk-engine",
                                    prefix_caching_hash_algo="sha256_cbor"), environ={"PYTHONHASHSEED": "0"})
    addresses = await nursery.start(simulator.run)
    replica = Replica(name="sim", model="tiny", url=addresses.base_url, api_key="sk-engine")
    replica.pool = UpstreamPool(replica.host, replica.port)
    return replica


async def test_client_gets_the_engines_prompt_ids_and_caches_them(sim):
    observed = []
    client = TokenizeClient(timeout=2.0, observe=observed.append)
    request = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hello there"}]}
    p = plan(CHAT_PATH, request, base_models=BASE)
    ids = await client.tokenize(sim, p.body)
    # the simulator's chat template and byte tokenizer: <|system|>=5, <|end|>=6, byte b is 16+b, no BOS
    assert ids[0] == 5 and ids[-1] == 4 and 6 in ids
    assert await client.tokenize(sim, p.body) == ids
    assert client.calls == 1 and client.cache.hits == 1 and len(observed) == 1
    completion = plan(COMPLETIONS_PATH, {"prompt": "hello"})
    assert await client.tokenize(sim, completion.body) == [1] + [16 + b for b in b"hello"]  # BOS added
    keys = VllmBlockKeys().keys(ids, 16)  # the client's ids hash like the engine's
    assert len(keys) == len(ids) // 16


async def test_client_reports_errors_by_kind(sim):
    client = TokenizeClient(timeout=2.0)
    with pytest.raises(TokenizeError) as info:
        await client.tokenize(sim, json.dumps({"model": "nope", "prompt": "x"}).encode())
    assert info.value.kind == "status" and client.errors == 1
    dead = Replica(name="dead", model="tiny", url="http://127.0.0.1:9")  # no pool: the client makes one
    with pytest.raises(TokenizeError) as info:
        await client.tokenize(dead, b'{"prompt": "x"}')
    assert info.value.kind == "connect"


@pytest.fixture
async def slow(nursery) -> Replica:
    """A replica that reads the request and never answers."""
    async def slow_server(stream):
        await stream.receive_some(65536)
        await trio.sleep(10)

    listeners = await nursery.start(partial(trio.serve_tcp, slow_server, 0, host="127.0.0.1"))
    return Replica(name="slow", model="tiny", url=f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")


async def test_a_slow_tokenize_times_out_at_the_deadline(slow):
    replica = slow
    observed = []
    client = TokenizeClient(timeout=0.05, observe=observed.append)
    started = trio.current_time()
    with pytest.raises(TokenizeError) as info:
        await client.tokenize(replica, b'{"prompt": "x"}')
    elapsed = trio.current_time() - started
    assert info.value.kind == "timeout" and client.timeouts == 1
    assert 0.04 <= elapsed < 0.5 and observed[0] >= 0.04


async def test_the_deadline_adapts_to_the_observed_latency(sim, caplog):
    import itertools

    from llmgw.plugins import replica_tokenizer as tokenize_module

    ticks = itertools.count(step=0.08)  # on this clock every call takes 80 ms (the sim answers at once)
    client = TokenizeClient(timeout=0.05, timeout_per_kb=0.0, clock=lambda: next(ticks))
    small = b'{"prompt":"x"}'
    assert client.deadline(small) == 0.05  # nothing observed: the configured deadline
    with caplog.at_level("INFO", logger="llmgw.plugins.replica_tokenizer"):
        for i in range(tokenize_module.ADAPTIVE_MIN_CALLS):
            await client.tokenize(sim, json.dumps({"model": "tiny", "prompt": f"call {i}"}).encode())
    assert client.deadline(small) == pytest.approx(2 * 0.08)  # twice the p99 of what was observed
    assert "twice the observed p99" in caplog.text  # said once, when it took over
    large = json.dumps({"prompt": "y" * 64 * 1024}).encode()
    assert client.deadline(large) == tokenize_module.ADAPTIVE_CEILING  # 64 KiB x 160 ms: capped
    fast = TokenizeClient(timeout=0.05, timeout_per_kb=0.0, clock=lambda: 0.0)
    for i in range(tokenize_module.ADAPTIVE_MIN_CALLS):
        await fast.tokenize(sim, json.dumps({"model": "tiny", "prompt": f"call {i}"}).encode())
    assert fast.deadline(small) == 0.05  # never shorter than the configured one


async def test_timeouts_lengthen_the_next_deadlines(slow, monkeypatch):
    from llmgw.plugins import replica_tokenizer as tokenize_module

    monkeypatch.setattr(tokenize_module, "ADAPTIVE_MIN_CALLS", 2)
    replica = slow
    client = TokenizeClient(timeout=0.02, timeout_per_kb=0.0)
    for i in range(2):
        with pytest.raises(TokenizeError):
            await client.tokenize(replica, b'{"prompt": "%d"}' % i)
    assert client.deadline(b'{"prompt": "x"}') == pytest.approx(0.04)  # a timeout counts as its deadline
