"""The simulator's HTTP handlers: vLLM's OpenAI server surface, served by ``llmgw.http.server``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and
not), ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``,
``GET /health``, ``GET /ping``, ``GET /version``, ``GET /load``, ``GET /metrics``,
``POST /reset_prefix_cache``, ``GET /kv_event_sources``, with ``--enable-sleep-mode`` ``POST /sleep``,
``POST /wake_up`` and ``GET /is_sleeping`` (:mod:`~llmgw.sim.startup`), and with the test switch
``--debug-routes`` ``POST /debug/prefix_hit`` and ``GET /debug/first_tokens``. With ``--api-key`` (or
``VLLM_API_KEY`` in the environment), paths under ``/v1`` need ``Authorization: Bearer KEY`` (vLLM protects exactly
those). A request whose client goes away is aborted in the engine (its blocks
are freed; cached blocks stay cached).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, AsyncIterator

from llmgw.http.messages import Request, Response, error_response

from . import metrics, protocol, tokenizer
from .protocol import ApiError, ChunkWriter, bad_request
from .sampler import output_tokens
from .scheduler import Sequence

if TYPE_CHECKING:
    from .app import Simulator

log = logging.getLogger(__name__)

EMPTY_OK = Response(200, [], b"")


def _error(exc: ApiError) -> Response:
    return error_response(exc.status, exc.message, param=exc.param, code=exc.status, type_=exc.type_)


class SimApi:
    """Request handlers bound to one :class:`~llmgw.sim.app.Simulator`."""

    def __init__(self, sim: "Simulator"):
        self.sim = sim
        self.config = sim.config
        self.core = sim.core
        self.in_flight = 0
        self._id_prefix = os.urandom(6).hex()
        self._next_id = 0
        self._bearer = f"Bearer {sim.config.api_key}" if sim.config.api_key else None
        self._routes = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.models,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/health"): self.health,
            ("GET", "/ping"): self.health,
            ("POST", "/ping"): self.health,
            ("GET", "/version"): self.version,
            ("GET", "/load"): self.load,
            ("GET", "/metrics"): self.metrics,
            ("POST", "/reset_prefix_cache"): self.reset_prefix_cache,
            ("GET", "/kv_event_sources"): self.kv_event_sources,
        }
        if sim.config.enable_sleep_mode:
            self._routes |= {("POST", "/sleep"): self.sleep, ("POST", "/wake_up"): self.wake_up,
                             ("GET", "/is_sleeping"): self.is_sleeping}
        if sim.config.debug_routes:
            self._routes[("POST", "/debug/prefix_hit")] = self.debug_prefix_hit
            self._routes[("GET", "/debug/first_tokens")] = self.debug_first_tokens
            log.info("test switch --debug-routes: POST /debug/prefix_hit and GET /debug/first_tokens show the "
                     "cache, queues and scheduling order to anyone")
        self._paths = {path for _, path in self._routes}

    async def handle(self, request: Request) -> Response:
        path = request.path
        route = self._routes.get((request.method, path))
        if route is None:
            if request.method == "HEAD" and (("GET", path) in self._routes):
                route = self._routes[("GET", path)]
            elif path in self._paths:
                return error_response(405, f"method {request.method} is not allowed on {path}",
                                      type_="MethodNotAllowed", code=405)
            else:
                return error_response(404, f"no route for {path}", type_="NotFoundError", code=404)
        if self._bearer is not None and path.startswith("/v1") and request.header("authorization") != self._bearer:
            return error_response(401, "Unauthorized", type_="AuthenticationError", code=401)
        if self.sim.startup.sleeping and path.startswith("/v1/") and request.method == "POST":
            return error_response(503, "the engine is sleeping: POST /wake_up first", type_="ServiceUnavailable",
                                  code=503)
        try:
            return await route(request)
        except ApiError as exc:
            return _error(exc)

    # ------------------------------------------------------------------ helpers

    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self._id_prefix}{self._next_id:010x}"

    @staticmethod
    def _body(request: Request) -> dict:
        return protocol.parse_body(request.body)

    def _model(self, body: dict):
        """``(name to echo, LoRA module or None)``; an unknown model is a 404 like vLLM's."""
        name = body.get("model")
        if name is None:
            return self.config.model_name, None
        if name in self.config.served_model_names:
            return name, None
        lora = self.sim.loras.get(name)
        if lora is not None:
            return name, lora
        raise ApiError(404, f"The model `{name}` does not exist.", param="model", type_="NotFoundError")

    # ------------------------------------------------------------------ generation

    async def completions(self, request: Request) -> Response:
        body = self._body(request)
        model, lora = self._model(body)
        protocol.check_n(body)
        prompt_ids = protocol.completion_prompt_ids(body)
        return await self._generate(body, model, lora, prompt_ids, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = self._body(request)
        model, lora = self._model(body)
        protocol.check_n(body)
        prompt_ids = protocol.chat_prompt_ids(body)
        return await self._generate(body, model, lora, prompt_ids, chat=True)

    def _sequence(self, body: dict, lora, prompt_ids: list[int], *, chat: bool) -> Sequence:
        config = self.config
        assert config.max_model_len is not None  # SimConfig.resolve() filled it
        params = protocol.sampling_params(body, len(prompt_ids), config.max_model_len, chat=chat)
        salt = protocol.cache_salt(body)
        priority = protocol.priority(body, config.scheduling_policy)
        planned = output_tokens(prompt_ids, params, engine_seed=config.seed, output_range=config.output_tokens)
        hashing = self.sim.hashing
        hashes = None
        if hashing is not None:
            hashes = hashing.for_request((lora.name, lora.path) if lora else None, salt)
        return Sequence(self._new_id(), prompt_ids, planned, hashes=hashes,
                        lora_id=lora.lora_id if lora else None, lora_name=lora.name if lora else None,
                        priority=priority)

    async def _generate(self, body: dict, model: str, lora, prompt_ids: list[int], *, chat: bool) -> Response:
        options = protocol.stream_options(body)
        seq = self._sequence(body, lora, prompt_ids, chat=chat)
        request_id = ("chatcmpl-" if chat else "cmpl-") + seq.request_id
        created = int(time.time())
        if options.stream:
            return Response(200, [(b"content-type", b"text/event-stream; charset=utf-8")],
                            self._stream(seq, request_id, created, model, options, chat=chat))
        engine = self.core
        self.in_flight += 1
        try:
            await engine.arrive(seq)
            await seq.wait_finished()
        finally:
            self.in_flight -= 1
            engine.abort(seq)
        if seq.error is not None:
            return _error(protocol.engine_error(seq.error))
        output = seq.output_ids
        text = tokenizer.decode(output, skip_special_tokens=True)
        usage = protocol.usage(seq.prompt_len, len(output), seq.num_cached_tokens)
        build = protocol.chat_body if chat else protocol.completion_body
        return Response.json(build(request_id, created, model, text, seq.finish_reason, usage))

    async def _stream(self, seq: Sequence, request_id: str, created: int, model: str,
                      options: protocol.StreamOptions, *, chat: bool) -> AsyncIterator[bytes]:
        """SSE chunks as the engine produces tokens; the request is submitted when streaming starts."""
        engine = self.core
        writer = ChunkWriter(request_id, created, model, chat=chat, continuous_usage=options.continuous_usage)
        self.in_flight += 1
        try:
            await engine.arrive(seq)
            if self.sim.config.stream_head_first:
                yield b""  # the server sends the head now; the first token follows when it is computed
            sent = 0
            while True:
                await seq.wait_for_tokens(sent)
                tokens = seq.token_ids[seq.prompt_len + sent:]
                if chat and sent == 0 and tokens:
                    yield writer.role()
                sent += len(tokens)
                done = seq.finished
                if seq.finish_reason == "abort":
                    return
                if seq.error is not None:  # vLLM's mid-stream error: an error event, then [DONE]
                    yield ChunkWriter.error(protocol.engine_error(seq.error))
                    break
                usage = None
                if options.continuous_usage:
                    usage = protocol.usage(seq.prompt_len, sent, max(seq.num_cached_tokens, 0))
                yield writer.delta(tokenizer.decode(tokens, skip_special_tokens=True),
                                   seq.finish_reason if done else None, usage)
                if done:
                    break
            if options.include_usage and seq.error is None:
                yield writer.usage(protocol.usage(seq.prompt_len, sent, seq.num_cached_tokens))
            yield ChunkWriter.DONE
        finally:
            self.in_flight -= 1
            engine.abort(seq)

    # ------------------------------------------------------------------ tokenizer endpoints

    async def tokenize(self, request: Request) -> Response:
        body = self._body(request)
        self._model(body)
        if "messages" in body:
            ids = protocol.chat_prompt_ids(body)
        elif isinstance(body.get("prompt"), str):
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise bad_request("'add_special_tokens' must be a boolean", "add_special_tokens")
            ids = tokenizer.encode(body["prompt"], add_special_tokens=add_special)
        else:
            raise bad_request("the body needs 'prompt' (a string) or 'messages'")
        strs = tokenizer.token_strs(ids) if body.get("return_token_strs") else None
        return Response.json({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                              "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        body = self._body(request)
        self._model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise bad_request("'tokens' must be a list of token ids", "tokens")
        try:
            ids = tokenizer.check_ids(tokens)
        except tokenizer.TokenizerError as exc:
            raise bad_request(str(exc), "tokens") from None
        return Response.json({"prompt": tokenizer.decode(ids, skip_special_tokens=False)})

    async def debug_prefix_hit(self, request: Request) -> Response:
        """What the engine would serve from its cache for this request now, and its queues (test switch).

        The body is a chat (``messages``) or completion (``prompt``) request; nothing is submitted and
        the cache's LRU order is not touched. ``pending_prefill_tokens`` are the prompt tokens the
        queued and running requests still have to compute (their own cache hits deducted);
        ``running_context_tokens`` the tokens the running requests hold (what each decode step reads).
        """
        body = self._body(request)
        _, lora = self._model(body)
        prompt_ids = protocol.chat_prompt_ids(body) if "messages" in body else protocol.completion_prompt_ids(body)
        cache, scheduler = self.core.cache, self.core.scheduler
        hashing = self.sim.hashing
        cached = 0
        if hashing is not None:
            hashes = hashing.for_request((lora.name, lora.path) if lora else None, protocol.cache_salt(body))
            hashes.extend(prompt_ids)
            cached = len(cache.computed_blocks(_Probe(prompt_ids, hashes))) * cache.block_size
        pending = sum(max(0, seq.prompt_len - seq.num_computed_tokens) for seq in scheduler.running)
        pending += sum(len(seq.token_ids) - len(cache.computed_blocks(seq)) * cache.block_size
                       for seq in scheduler.waiting)
        return Response.json({"prompt_tokens": len(prompt_ids), "cached_tokens": cached,
                              "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                              "running_context_tokens": sum(len(seq.token_ids) for seq in scheduler.running),
                              "pending_prefill_tokens": pending, "block_size": cache.block_size,
                              "prefill_tokens_per_s": self.core.timing.prefill_tokens_per_s,
                              "decode_ms_per_step": self.core.timing.decode_ms_per_step,
                              "max_num_batched_tokens": scheduler.max_num_batched_tokens})

    async def debug_first_tokens(self, request: Request) -> Response:
        """The latest first tokens in the order the engine produced them (test switch): each request's id (a
        response's ``id`` less its ``cmpl-``/``chatcmpl-`` prefix), priority, arrival rank, when its first step
        began and when its first token came (seconds, the engine loop's clock) and how often it was preempted."""
        return Response.json({"scheduling_policy": self.config.scheduling_policy, "first_tokens": [
            {"request_id": ft.request_id, "priority": ft.priority, "arrival": ft.arrival,
             "scheduled_at": round(ft.scheduled_at, 6), "first_token_at": round(ft.first_token_at, 6),
             "preemptions": ft.preemptions} for ft in self.core.first_tokens]})

    # ------------------------------------------------------------------ server endpoints

    async def health(self, request: Request) -> Response:
        return EMPTY_OK

    async def version(self, request: Request) -> Response:
        return Response.json({"version": self.sim.vllm_version})

    async def load(self, request: Request) -> Response:
        return Response.json({"server_load": self.in_flight})

    async def metrics(self, request: Request) -> Response:
        return Response(200, [(b"content-type", metrics.CONTENT_TYPE)],
                        metrics.render(self.core, self.config.model_name))

    async def models(self, request: Request) -> Response:
        created = self.sim.created
        cards = [self._model_card(name, self.config.model, None, self.config.max_model_len, created)
                 for name in self.config.served_model_names]
        cards += [self._model_card(lora.name, lora.path, self.config.model_name, None, created)
                  for lora in self.config.lora_modules]
        return Response.json({"object": "list", "data": cards})

    def _model_card(self, name: str, root: str, parent: str | None, max_model_len: int | None,
                    created: int) -> dict:
        return {
            "id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root,
            "parent": parent, "max_model_len": max_model_len,
            "permission": [{
                "id": f"modelperm-{os.urandom(16).hex()}",
                "object": "model_permission", "created": created, "allow_create_engine": False,
                "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
                "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False,
            }],
        }

    async def reset_prefix_cache(self, request: Request) -> Response:
        reset_running = "reset_running_requests=true" in request.query.lower()
        ok = self.sim.reset_prefix_cache(reset_running_requests=reset_running)
        return Response.json({"success": ok})

    async def sleep(self, request: Request) -> Response:
        level = 2 if "level=2" in request.query else 1
        self.sim.startup.sleep(level)
        return EMPTY_OK

    async def wake_up(self, request: Request) -> Response:
        await self.sim.startup.wake_up()
        return EMPTY_OK

    async def is_sleeping(self, request: Request) -> Response:
        return Response.json({"is_sleeping": bool(self.sim.startup.sleeping)})

    async def kv_event_sources(self, request: Request) -> Response:
        return Response.json(self.sim.kv_event_sources())


class _Probe:
    """A prompt as the cache manager sees a request (token ids and block hashes), for a lookup only."""

    __slots__ = ("token_ids", "hashes")

    def __init__(self, token_ids: list[int], hashes):
        self.token_ids = token_ids
        self.hashes = hashes
