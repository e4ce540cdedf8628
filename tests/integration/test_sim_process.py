"""``llmgw sim`` as a real process, observed from outside as a router would see it.

The ZMQ subscriber, the replay DEALER and the hash recomputation use plain
pyzmq, msgpack, cbor2 and hashlib only, never llmgw code, so they check the
simulator against vLLM's wire format independently.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import cbor2
import httpx
import msgpack
import openai
import pytest
import trio
import zmq

from llmgw.engines.probe import parse_block_size
from llmgw.sim.profiles import GIB, profile
from llmgw.testing.metrics import metric_value
from llmgw.testing.processes import start_child

pytestmark = pytest.mark.slow

READY = re.compile(r"^llmgw-sim listening on (\S+)")


@dataclass
class SimProcess:
    base_url: str
    kv_events: str | None
    kv_replay: str | None
    process: trio.Process


@asynccontextmanager
async def sim_process(*args: str, env: dict[str, str] | None = None, startup_timeout: float = 30.0):
    """Run ``llmgw sim --port 0 ARGS`` (on the constant model unless ARGS name a ``--profile``: the numbers below are
    its); yields a :class:`SimProcess`; SIGTERM on exit (must exit 0 within 10 s)."""
    pinned = () if "--profile" in args else ("--profile", "constant")
    command = [sys.executable, "-m", "llmgw.cli", "sim", "--host", "127.0.0.1", "--port", "0", *pinned, *args]
    async with trio.open_nursery() as nursery:
        child = await start_child(nursery, command, name="llmgw sim", ready=READY, startup_timeout=startup_timeout,
                                  env={"PYTHONHASHSEED": "0", **(env or {})}, stop_grace=10)
        said = {prefix: line.rsplit(" ", 1)[1] for line in child.lines
                for prefix in ("llmgw-sim kv-events on ", "llmgw-sim kv-replay on ") if line.startswith(prefix)}
        yield SimProcess(child.url, said.get("llmgw-sim kv-events on "), said.get("llmgw-sim kv-replay on "),
                         child.process)
        code = await child.stop()  # SIGTERM, SIGKILL 10 s later
    assert code == 0, f"llmgw sim exited with {code} (-9: not within 10 s of SIGTERM)"


async def zmq_recv(sock: zmq.Socket) -> list[bytes]:
    """Receive one multipart message from a plain pyzmq socket without blocking Trio."""
    fd = sock.getsockopt(zmq.FD)
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            await trio.lowlevel.wait_readable(fd)


def zmq_close(sock: zmq.Socket) -> None:
    trio.lowlevel.notify_closing(sock.getsockopt(zmq.FD))
    sock.close(linger=0)


@dataclass
class Subscriber:
    """A SUB socket's messages, collected by a background task: ``seq -> (topic, payload)``."""

    sock: zmq.Socket
    messages: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    _arrived: trio.Event = field(default_factory=trio.Event)

    async def run(self) -> None:
        while True:
            frames = await zmq_recv(self.sock)
            assert len(frames) == 3, frames
            topic, seq, payload = frames
            assert len(seq) == 8
            n = int.from_bytes(seq, "big")
            self.messages[n] = (topic, payload)
            self.order.append(n)
            self._arrived.set()

    async def wait(self, predicate) -> None:
        while not predicate(self):
            self._arrived = trio.Event()
            await self._arrived.wait()


async def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """Ask the replay socket for every batch from ``start`` with a DEALER: ``[(topic, seq, payload)]``."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await zmq_recv(dealer)
            assert len(frames) == 4 and frames[0] == b"", frames  # [b"", topic, seq, payload]
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                assert frames[1] == b"" and frames[3] == b""
                return out
            out.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))
    finally:
        zmq_close(dealer)


def decode(payload: bytes):
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


# ---------------------------------------------------------------------------- hash recomputation

BLOCK = 16
LORA_PATH = "/adapters/sql-lora"
BOS, ASSISTANT, SYSTEM, END = 1, 4, 5, 6


def none_hash(seed: str) -> bytes:
    return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()


def hash_extra(event: dict, block_index: int):
    """The hashed extra item (vLLM 0.31+ tagged form) behind an event's untagged ``extra_keys`` entry."""
    published = event["extra_keys"][block_index]
    if published is None:
        return None
    pieces = []
    for item in published:
        if event.get("lora_name") is not None and item == event["lora_name"]:
            pieces.append(("lora", item, LORA_PATH))
        else:
            pieces.append(("cache_salt", item))
    return tuple(pieces)


class ChainChecker:
    """Recomputes every BlockStored hash from its parent with cbor2 + hashlib (sha256_cbor)."""

    def __init__(self, seed: str = "0"):
        self.root = none_hash(seed)
        self.digests: dict[int, bytes] = {}  # event int -> full digest
        self.checked = 0

    def check(self, event: dict) -> None:
        parent_int = event["parent_block_hash"]
        parent = self.root if parent_int is None else self.digests[parent_int]
        tokens = event["token_ids"]
        size = event["block_size"]
        assert len(tokens) == size * len(event["block_hashes"])
        for i, expected in enumerate(event["block_hashes"]):
            block = tuple(tokens[i * size:(i + 1) * size])
            parent = hashlib.sha256(cbor2.dumps((parent, block, hash_extra(event, i)), canonical=True)).digest()
            assert int.from_bytes(parent[-8:], "big") == expected
            self.digests[expected] = parent
            self.checked += 1


def text(n: int, tag: str) -> str:
    """A prompt of exactly ``n`` characters (= n byte tokens, +1 BOS), distinct per ``tag``."""
    base = f"[{tag}] "
    filler = "the quick brown fox jumps over the lazy dog "
    return (base + filler * (n // len(filler) + 1))[:n]


async def after_first_token(response: httpx.Response):
    """A streamed answer's lines, read up to its first ``data:`` line (its first token); the rest to iterate."""
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            break
    return lines


# ---------------------------------------------------------------------------- tests


EVENTS_CONFIG = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                            "replay_endpoint": "tcp://*:0", "topic": "kv"})

MAP_KEYS_0_32 = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]


async def test_events_hashes_gaps_replay_and_usage():
    args = ["--kv-events-config", EVENTS_CONFIG, "--prefix-caching-hash-algo", "sha256_cbor",
            "--block-size", str(BLOCK), "--num-blocks", "48", "--time-scale", "0", "--drop-event-seqs", "every:4",
            "--lora-modules", f"sql={LORA_PATH}", "--served-model-name", "tiny"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        async with sim_process(*args) as sim, httpx.AsyncClient(base_url=sim.base_url, timeout=10) as http, \
                trio.open_nursery() as nursery:
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            sub.connect(sim.kv_events)
            subscriber = Subscriber(sub)
            nursery.start_soon(subscriber.run)

            async def complete(prompt: str, **extra) -> dict:
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                             **extra})
                assert r.status_code == 200, r.text
                return r.json()

            with trio.fail_after(20):
                # Slow joiner: warm up until a first batch arrives (what was missed comes from replay).
                for i in range(100):
                    await complete(text(40, f"warm-up {i}"))
                    with trio.move_on_after(0.2):
                        await subscriber.wait(lambda s: s.messages)
                    if subscriber.messages:
                        break
                shared = text(200, "shared")
                first = await complete(shared)
                again = await complete(shared)
                assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (201 - 1) // BLOCK * BLOCK
                await complete(shared + " and a different ending that goes on")
                await complete(text(60, "lora"), model="sql")
                await complete(text(60, "salted"), cache_salt="pepper")
                for i in range(6):  # 6 x 301 tokens >> 47 usable blocks: evictions
                    await complete(text(300, f"distinct {i}"))
                r = await http.post("/reset_prefix_cache")
                assert r.json() == {"success": True}
                sentinel = text(48, "sentinel")
                await complete(sentinel)
                sentinel_tokens = [BOS] + [16 + b for b in sentinel.encode()]

                # Everything published so far, from the replay socket (dropped live seqs included).
                def has_sentinel(batches) -> bool:
                    for _, _, payload in batches:
                        for ev in decode(payload)[1]:
                            if ev["type"] == "BlockStored" and ev["token_ids"] == sentinel_tokens[:48]:
                                return True
                    return False

                replayed = await replay(ctx, sim.kv_replay, 0)
                while not has_sentinel(replayed):
                    replayed = await replay(ctx, sim.kv_replay, 0)
                last = replayed[-1][1]
                await subscriber.wait(lambda s: max(s.messages) >= last - 1)
                metrics = (await http.get("/metrics")).text

            # Sequence numbers: contiguous from 0 in the replay buffer; the live stream has the dropped gaps.
            assert [seq for _, seq, _ in replayed] == list(range(len(replayed)))
            assert all(topic == b"kv" for topic, _, _ in replayed)
            live = subscriber.messages
            first_live = min(live)
            missing = [seq for seq in range(first_live, last + 1) if seq not in live]
            assert missing and all(seq % 4 == 0 for seq in missing)
            assert not [seq for seq in live if seq % 4 == 0 and seq > 0]
            for seq, (topic, payload) in live.items():
                assert topic == b"kv" and payload == replayed[seq][2]  # replay gives the same bytes

            # Frame shapes as the real vLLM 0.32 capture: [ts, [events], 0], map events tagged by "type".
            checker = ChainChecker("0")
            stored = removed = 0
            kinds = set()
            single_store_seen = False
            for _, _seq, payload in replayed:
                assert payload[0] == 0x93 and payload[1] == 0xCB
                ts, events, rank = decode(payload)
                assert rank == 0 and abs(ts - time.time()) < 120
                if len(events) == 1 and events[0]["type"] == "BlockStored":
                    assert payload[10:12] == b"\x91\x8b"
                    assert payload[12:].startswith(b"\xa4type\xabBlockStored\xacblock_hashes\x91"
                                                   if len(events[0]["block_hashes"]) == 1 else b"\xa4type")
                    single_store_seen = True
                for ev in events:
                    kinds.add(ev["type"])
                    if ev["type"] == "BlockStored":
                        assert list(ev) == MAP_KEYS_0_32
                        assert (ev["medium"], ev["group_idx"], ev["kv_cache_spec_kind"]) == \
                            ("GPU", 0, "full_attention")
                        assert len(ev["extra_keys"]) == len(ev["block_hashes"])
                        checker.check(ev)
                        stored += len(ev["block_hashes"])
                    elif ev["type"] == "BlockRemoved":
                        assert ev == {"type": "BlockRemoved", "block_hashes": ev["block_hashes"], "medium": "GPU",
                                      "group_idx": 0}
                        assert len(ev["block_hashes"]) == 1
                        removed += 1
                    else:
                        assert ev == {"type": "AllBlocksCleared"}
                        stored = removed = 0
            assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
            assert single_store_seen
            assert checker.checked > 50

            # The cache gauges agree with the event stream (since the last AllBlocksCleared).
            samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and line[0] != "#")
            labels = '{engine="0",model_name="tiny"}'
            assert float(samples[f"llmgw_sim_cached_blocks{labels}"]) == stored - removed
            assert float(samples[f"vllm:kv_cache_usage_perc{labels}"]) == 0.0  # nothing running
            assert float(samples[f"vllm:prefix_cache_hits_total{labels}"]) >= 192
            nursery.cancel_scope.cancel()
    finally:
        zmq_close(sub)
        ctx.term()


async def test_cache_hit_is_faster_by_the_prefill_time():
    rate, decode_ms = 5000.0, 5.0
    async with sim_process("--prefill-tokens-per-s", str(rate), "--decode-ms-per-step", str(decode_ms),
                           "--time-scale", "1") as sim, httpx.AsyncClient(base_url=sim.base_url, timeout=30) as http:
        prompt = text(2047, "long")  # 2048 tokens with BOS

        async def timed() -> tuple[float, dict]:
            started = time.monotonic()
            r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200
            return time.monotonic() - started, r.json()

        with trio.fail_after(20):
            miss_time, miss = await timed()
            hit_time, hit = await timed()
        assert miss["usage"]["prompt_tokens"] == 2048
        assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = hit["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 2047 // 16 * 16 == 2032
        saved = (cached) / rate  # modelled prefill time of the cached tokens: 0.406 s
        assert miss_time >= 2048 / rate
        assert miss_time - hit_time == pytest.approx(saved, abs=0.1)


async def test_a_long_prompt_beside_a_running_request_is_prefilled_in_capped_chunks():
    """``--long-prefill-token-threshold 256``: a 2,048-token prompt arriving while another request decodes is
    prefilled 256 tokens a step, so no step lasts longer than a 256-token chunk (the steps' modelled lengths and the
    capped chunks as its /metrics export them)."""
    rate, decode_ms = 5000.0, 5.0
    async with sim_process("--prefill-tokens-per-s", str(rate), "--decode-ms-per-step", str(decode_ms),
                           "--time-scale", "1", "--long-prefill-token-threshold", "256") as sim, \
            httpx.AsyncClient(base_url=sim.base_url, timeout=30) as http:
        decoding = {"prompt": text(31, "decoding"), "max_tokens": 400, "ignore_eos": True, "stream": True}
        with trio.fail_after(30):
            async with http.stream("POST", "/v1/completions", json=decoding) as r:
                lines = await after_first_token(r)  # it decodes now: two requests held once the long one arrives
                long = await http.post("/v1/completions", json={"prompt": text(2047, "long"), "max_tokens": 1})
                assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 2048
                async for _line in lines:
                    pass
        metrics = (await http.get("/metrics")).text
    labels = 'engine="0",model_name="sim"'
    assert metric_value(metrics, "llmgw_sim_prefill_chunks_capped_total", labels) == 7  # 8 chunks, the last whole
    steps = metric_value(metrics, "llmgw_sim_engine_steps_total", labels)
    assert metric_value(metrics, "llmgw_sim_step_seconds_count", labels) == steps == 400  # the chunks ride decodes
    # the longest step: a 256-token chunk beside the decoding request's token, 56 ms (without the cap: 415 ms)
    assert (256 / rate + decode_ms / 1000) < 0.075
    assert metric_value(metrics, "llmgw_sim_step_seconds_bucket", labels + ',le="0.075"') == steps
    assert metric_value(metrics, "llmgw_sim_step_seconds_sum", labels) == pytest.approx(
        (32 + 2048) / rate + steps * decode_ms / 1000, rel=0.01)
    assert metric_value(metrics, "llmgw_sim_step_overrun_seconds_count", labels) == steps


async def test_usage_counts_blocks_of_running_requests():
    """vLLM's kv_cache_usage_perc counts blocks held by running requests: full (stored) plus partial."""
    async with sim_process("--num-blocks", "101", "--decode-ms-per-step", "20", "--time-scale", "1") as sim, \
            httpx.AsyncClient(base_url=sim.base_url, timeout=30) as http:
        body = {"prompt": text(63, "in flight"), "max_tokens": 40, "ignore_eos": True, "stream": True}
        with trio.fail_after(20):
            async with http.stream("POST", "/v1/completions", json=body) as r:
                lines = await after_first_token(r)  # 64 prompt tokens = 4 full blocks, decoding
                metrics = (await http.get("/metrics")).text
                samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and line[0] != "#")
                labels = '{engine="0",model_name="sim"}'
                used = round(float(samples[f"vllm:kv_cache_usage_perc{labels}"]) * 100)
                assert used in (4, 5)  # 4 full blocks (+ the block decode is filling)
                assert float(samples[f"vllm:num_requests_running{labels}"]) == 1.0
                assert float(samples[f"llmgw_sim_cached_blocks{labels}"]) == 4.0
                async for _line in lines:
                    pass
        metrics = (await http.get("/metrics")).text
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="sim"} 0.0' in metrics
        assert parse_block_size(metrics) == 16  # vllm:cache_config_info's block_size label, as vLLM exports it


async def test_tokenize_and_api_shapes():
    async with sim_process("--served-model-name", "tiny-llama", "--max-model-len", "512",
                           "--time-scale", "0") as sim, httpx.AsyncClient(base_url=sim.base_url, timeout=10) as http:
        with trio.fail_after(20):
            r = await http.post("/tokenize", json={"model": "tiny-llama", "prompt": "def f(x):"})
            body = r.json()
            assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]
            assert body["token_strs"] is None and body["max_model_len"] == 512
            assert body["tokens"][0] == BOS and body["count"] == len(body["tokens"]) == 10

            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
            chat = (await http.post("/tokenize", json={"model": "tiny-llama", "messages": messages})).json()
            tokens = chat["tokens"]
            assert tokens[0] == SYSTEM and tokens[-1] == ASSISTANT and BOS not in tokens  # like the capture
            assert tokens[-3:-1] == [END, 16 + ord("\n")]
            parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
            joined = (await http.post("/tokenize", json={"messages": parts})).json()["tokens"]
            assert joined == (await http.post("/tokenize", json={
                "messages": [{"role": "user", "content": "a\nb"}]})).json()["tokens"]
            r = await http.post("/tokenize", json={"messages": messages, "continue_final_message": True})
            assert r.status_code == 400
            r = await http.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})
            assert r.json()["token_strs"] == ["<s>", "h", "i"]
            r = await http.post("/detokenize", json={"tokens": tokens})
            assert r.json() == {"prompt": "<|system|>be brief<|end|>\n<|user|>hi<|end|>\n<|assistant|>"}

            # The chat request's prompt is exactly what /tokenize predicted.
            r = await http.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": messages,
                                                              "max_tokens": 3})
            assert r.json()["usage"]["prompt_tokens"] == chat["count"]

            models = (await http.get("/v1/models")).json()
            assert models["object"] == "list"
            card = models["data"][0]
            assert {k: card[k] for k in ("id", "object", "owned_by", "root", "max_model_len")} == \
                {"id": "tiny-llama", "object": "model", "owned_by": "vllm", "root": "sim", "max_model_len": 512}
            r = await http.get("/health")
            assert r.status_code == 200 and r.content == b""
            assert "version" in (await http.get("/version")).json()
            assert (await http.get("/kv_event_sources")).json() == {}

            async def error(path: str, status: int, **kw) -> dict:
                r = await http.post(path, **kw)
                assert r.status_code == status, r.text
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                return err

            await error("/v1/completions", 404, json={"model": "nope", "prompt": "x"})
            await error("/v1/completions", 400, content=b"{not json")
            deep = await error("/v1/completions", 400, content=b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}")
            assert "deeper than 100 levels" in deep["message"]
            await error("/v1/completions", 400, json={"prompt": "x" * 600})
            await error("/v1/completions", 400, json={"prompt": "x" * 500, "max_tokens": 100})
            await error("/v1/completions", 400, json={"prompt": "x", "n": 2})
            await error("/v1/chat/completions", 400, json={"messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})


async def test_openai_client_and_determinism():
    async with sim_process("--time-scale", "0", "--seed", "7") as sim:
        client = openai.AsyncOpenAI(base_url=sim.base_url + "/v1", api_key="unused")
        with trio.fail_after(20):
            pieces, usage, finish = [], None, None
            stream = await client.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "tell me a story"}], max_tokens=12,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage
            assert finish == "length" and usage.completion_tokens == 12
            assert usage.prompt_tokens_details.cached_tokens == 0
            whole = await client.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "tell me a story"}], max_tokens=12,
                extra_body={"ignore_eos": True})
            assert whole.choices[0].message.content == "".join(pieces)  # same prompt and seed: same text
            completion = await client.completions.create(model="sim", prompt="once upon a time", max_tokens=5,
                                                         stream=True)
            texts = [c.choices[0].text async for c in completion]
            assert len("".join(texts)) <= 5 and texts
            await client.close()


async def test_api_key_and_array_layout_with_bytes_hashes():
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})
    async with sim_process("--api-key", "sekret", "--event-layout", "array", "--kv-events-config", config,
                           "--prefix-caching-hash-algo", "sha256_cbor", "--time-scale", "0",
                           env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}) as sim, \
            httpx.AsyncClient(base_url=sim.base_url, timeout=10) as http:
        ctx = zmq.Context()
        try:
            with trio.fail_after(20):
                body = {"prompt": text(40, "array"), "max_tokens": 2}
                assert (await http.post("/v1/completions", json=body)).status_code == 401
                assert (await http.get("/health")).status_code == 200
                auth = {"authorization": "Bearer sekret"}
                assert (await http.post("/v1/completions", json=body, headers=auth)).status_code == 200
                batches = await replay(ctx, sim.kv_replay, 0)
                while not batches:
                    batches = await replay(ctx, sim.kv_replay, 0)
            [(topic, seq, payload)] = batches
            assert (topic, seq) == (b"", 0)
            ts, [event], rank = decode(payload)
            assert event[0] == "BlockStored" and len(event) == 12  # tag + the 11 fields of 0.22-0.23
            hashes, parent, tokens = event[1], event[2], event[3]
            assert parent is None and len(hashes) == 2 and all(len(h) == 32 for h in hashes)
            digest = none_hash("0")
            for i, h in enumerate(hashes):
                digest = hashlib.sha256(cbor2.dumps((digest, tuple(tokens[16 * i:16 * i + 16]), None),
                                                    canonical=True)).digest()
                assert h == digest
            assert event[4:] == [16, None, "GPU", None, [None, None], 0, "full_attention", None]
        finally:
            ctx.term()


def parse_metrics(text_: str) -> dict[str, float]:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text_.splitlines() if line and line[0] != "#")}


async def test_client_disconnect_aborts_the_request():
    async with sim_process("--decode-ms-per-step", "20", "--time-scale", "1") as sim, \
            httpx.AsyncClient(base_url=sim.base_url, timeout=10) as http:
        labels = '{engine="0",model_name="sim"}'
        body = {"prompt": text(100, "abandoned"), "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with trio.fail_after(20):
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            # Leaving the block closed the connection mid-stream: the engine must drop the request.
            while True:
                samples = parse_metrics((await http.get("/metrics")).text)
                if samples[f"vllm:num_requests_running{labels}"] == 0:
                    break
                await trio.sleep(0.05)
        assert samples[f"vllm:kv_cache_usage_perc{labels}"] == 0.0
        assert samples['vllm:request_success_total{engine="0",model_name="sim",finished_reason="abort"}'] == 1
        assert samples[f"vllm:generation_tokens_total{labels}"] < 100


async def test_debug_prefix_hit_reports_the_cached_prefix_and_queues_only_with_the_test_switch():
    """``--debug-routes``: what the next request would find cached (as its usage then reports), and the queues."""
    chat = {"model": "sim", "messages": [{"role": "system", "content": text(700, "shared")},
                                         {"role": "user", "content": "first"}], "max_tokens": 4}
    other = dict(chat, messages=[chat["messages"][0], {"role": "user", "content": "second question"}])
    async with sim_process("--time-scale", "0") as sim, httpx.AsyncClient(base_url=sim.base_url, timeout=30) as http:
        assert (await http.post("/debug/prefix_hit", json=chat)).status_code == 404  # off by default
    async with sim_process("--time-scale", "0", "--debug-routes") as sim, \
            httpx.AsyncClient(base_url=sim.base_url, timeout=30) as http:
        with trio.fail_after(20):
            cold = (await http.post("/debug/prefix_hit", json=chat)).json()
            prompt = (await http.post("/tokenize", json=chat)).json()["count"]
            assert cold["prompt_tokens"] == prompt and cold["cached_tokens"] == 0
            assert cold["running"] == cold["waiting"] == cold["pending_prefill_tokens"] == 0
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            probe = (await http.post("/debug/prefix_hit", json=other)).json()
            served = (await http.post("/v1/chat/completions", json=other)).json()["usage"]
        assert probe["cached_tokens"] == served["prompt_tokens_details"]["cached_tokens"] > 700
        assert probe["prompt_tokens"] == served["prompt_tokens"]
        assert probe["block_size"] == 16 and probe["cached_tokens"] % 16 == 0
        bad = await http.post("/debug/prefix_hit", json={"model": "sim"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"


async def test_debug_prefix_hit_reports_the_context_the_running_requests_hold():
    """``running_context_tokens``: what a decode step reads (the oracle's batch cost on a GPU profile)."""
    # 4,000 steps of 20 ms: the request still runs when the probe comes even if this process is starved for
    # seconds (with 400 it once finished first, at a load where a gateway on this machine stalled for 5 s).
    answer = 4000
    body = {"model": "sim", "prompt": text(300, "long"), "max_tokens": answer, "ignore_eos": True, "stream": True}
    async with sim_process("--decode-ms-per-step", "20", "--debug-routes") as sim, \
            httpx.AsyncClient(base_url=sim.base_url, timeout=30) as http:
        with trio.fail_after(20):
            prompt = (await http.post("/tokenize", json={"model": "sim", "prompt": body["prompt"]})).json()["count"]
            async with http.stream("POST", "/v1/completions", json=body) as response:
                first = None
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):  # decoding: the request runs, holding its prompt and output
                        first = line
                        break
                probe = (await http.post("/debug/prefix_hit", json={"model": "sim", "prompt": "x"})).json()
        assert probe["running"] == 1, (first, probe)
        assert prompt < probe["running_context_tokens"] < prompt + answer


async def test_gpu_profile_derives_its_cache_from_memory_and_preempts_when_it_runs_out():
    """A GPU profile's KV cache is what its memory holds; requests that outgrow it are preempted (recomputed, as
    vLLM V1 does), counted in vllm:num_preemptions_total, and still complete."""
    l4_8b = profile("l4-llama-3.1-8b")
    block_bytes = l4_8b.model.kv_bytes_per_token * 16
    reserved = l4_8b.model.weights_bytes + l4_8b.model.activation_gib * GIB
    utilization = (reserved + 80.5 * block_bytes) / (l4_8b.gpu.memory_gib * GIB)  # memory for 80 blocks
    async with sim_process("--profile", "l4-llama-3.1-8b", "--gpu-memory-utilization", f"{utilization:.9f}",
                           "--time-scale", "0") as sim, \
            httpx.AsyncClient(base_url=sim.base_url, timeout=30) as http:
        metrics = (await http.get("/metrics")).text
        assert metric_value(metrics, "llmgw_sim_num_blocks") == 79  # 80 blocks, one of them vLLM's null block
        results: list[dict] = []

        async def complete(i: int) -> None:  # 300 prompt + 400 output tokens = 44 blocks each; 4 need 176
            body = {"prompt": text(299, f"request {i}"), "max_tokens": 400, "ignore_eos": True}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            results.append(response.json())

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(complete, i)
        assert [r["usage"]["completion_tokens"] for r in results] == [400] * 4
        assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
        metrics = (await http.get("/metrics")).text
        assert metric_value(metrics, "vllm:num_preemptions_total") >= 1
        assert metric_value(metrics, "vllm:kv_cache_usage_perc") == 0.0


async def test_a_cold_start_delays_listening_and_sleep_mode_wakes_hot():
    async with sim_process("--startup-seconds", "0.3", "--hot-startup-seconds", "0.2", "--enable-sleep-mode",
                           "--log-level", "INFO") as sim, \
            httpx.AsyncClient(base_url=sim.base_url, timeout=10) as http:
        with trio.fail_after(20):
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
            assert (await http.post("/sleep", params={"level": "1"})).status_code == 200
            assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
            asleep = await http.post("/v1/chat/completions", json=chat)
            assert asleep.status_code == 503 and "wake_up" in asleep.json()["error"]["message"]
            assert (await http.get("/health")).status_code == 200  # alive: an agent keeps it
            async with trio.open_nursery() as waking:  # two wake-ups at once: one hot start, both wait for it
                for _ in range(2):
                    waking.start_soon(http.post, "/wake_up")
            assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200


async def test_sleep_mode_routes_exist_only_with_the_flag():
    async with sim_process("--time-scale", "0") as sim, httpx.AsyncClient(base_url=sim.base_url, timeout=10) as http:
        with trio.fail_after(20):
            assert (await http.post("/sleep")).status_code == 404
            assert (await http.post("/wake_up")).status_code == 404
