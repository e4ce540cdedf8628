"""OpenAI/vLLM request parsing and response shapes for the simulator's HTTP surface.

Turns request bodies into prompt ids and sampling parameters (raising
:class:`ApiError` with the status vLLM would answer), and builds response and
SSE chunk bodies in vLLM's field layout. Streaming chunks are built from
pre-rendered JSON around the text, so each token costs one small ``json.dumps``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llmgw.http.jsonbody import BodyError, parse_json_body
from llmgw.http.messages import error_body

from . import tokenizer
from .sampler import SamplingParams
from .scheduler import PRIORITY

_dumps = json.JSONEncoder(separators=(",", ":")).encode


class ApiError(Exception):
    """An error answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type_ = type_


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, type_="BadRequestError")


# A lone surrogate can only come from a \uD800-\uDFFF escape (raw surrogate bytes are not UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> dict:
    """A request body as vLLM's FastAPI layer would accept it, else the 400 vLLM answers.

    Invalid JSON and JSON nested too deep for the parser are 400s (FastAPI: "There
    was an error parsing the body"). A string holding a lone surrogate (legal JSON,
    ``"\\ud800"``) is a 400 too: vLLM passes it on until its tokenizer or its engine
    request encoder raises ``UnicodeEncodeError`` (a ``ValueError``, which vLLM's
    serving layer answers with 400); the simulator refuses it before anything else
    touches it, so no later step can fail on it.
    """
    try:
        body = parse_json_body(raw)  # bounded depth and size: deep JSON is a 400, not a 500
    except BodyError as exc:
        raise bad_request(str(exc)) from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then pay for a full check
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise bad_request(str(exc)) from None
        except RecursionError:
            raise bad_request("There was an error parsing the body: JSON nested too deep") from None
    return body


def engine_error(reason: str) -> ApiError:
    """The 500 a request gets when a step failed on it (the engine keeps running)."""
    return ApiError(500, f"the engine failed on this request: {reason}", type_="InternalServerError")


def _int_field(body: dict, name: str, default: int | None, *, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if type(value) is not int or value < minimum:
        raise bad_request(f"'{name}' must be an integer >= {minimum}", name)
    return value


def _bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


def check_n(body: dict) -> None:
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise bad_request("the simulator supports n=1 only", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("the simulator supports best_of=1 only", "best_of")


def completion_prompt_ids(body: dict) -> list[int]:
    """Prompt ids of a ``/v1/completions`` body (a string or token ids; one prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        add_special = _bool_field(body, "add_special_tokens", True)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        try:
            ids = tokenizer.check_ids(prompt)
        except tokenizer.TokenizerError as exc:
            raise bad_request(str(exc), "prompt") from None
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("the simulator supports one prompt per request", "prompt")
    else:
        raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    return ids


def chat_prompt_ids(body: dict) -> list[int]:
    """Prompt ids of a chat body (``/v1/chat/completions`` or ``/tokenize``), with vLLM's defaults."""
    try:
        return tokenizer.encode_chat(
            body.get("messages"),
            add_generation_prompt=_bool_field(body, "add_generation_prompt", True),
            continue_final_message=_bool_field(body, "continue_final_message", False),
            add_special_tokens=_bool_field(body, "add_special_tokens", False),
        )
    except tokenizer.TokenizerError as exc:
        raise bad_request(str(exc), "messages") from None


PRIORITY_BOUND = 1 << 63  # vLLM's engine requests carry it as a 64-bit integer


def priority(body: dict, policy: str) -> int:
    """A request's ``priority`` (vLLM's extra field, default 0): an integer, lower served first. Any other value
    than 0 needs the engine in priority scheduling: vLLM refuses it otherwise (a ValueError its server answers
    400), with this message."""
    value = body.get("priority", 0)
    if value is None:
        return 0
    if type(value) is not int or not -PRIORITY_BOUND <= value < PRIORITY_BOUND:
        raise bad_request("'priority' must be an integer (a signed 64-bit one)", "priority")
    if value != 0 and policy != PRIORITY:
        raise bad_request(f"Got priority {value} but Priority scheduling is not enabled.", "priority")
    return value


def cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("'cache_salt' must be a non-empty string", "cache_salt")
    return salt


def sampling_params(body: dict, prompt_len: int, max_model_len: int, *, chat: bool) -> SamplingParams:
    """Generation limits, checked against the context length as vLLM does."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.", "messages" if chat
            else "prompt")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int_field(body, "max_completion_tokens", None, minimum=1)
    else:
        max_tokens = _int_field(body, "max_tokens", None if chat else 16, minimum=1)
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_len}).", "max_tokens")
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise bad_request("'seed' must be an integer", "seed")
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(_int_field(body, "min_tokens", 0, minimum=0) or 0, max_tokens),
        ignore_eos=_bool_field(body, "ignore_eos", False),
        seed=seed,
    )


@dataclass(slots=True)
class StreamOptions:
    stream: bool
    include_usage: bool
    continuous_usage: bool


def stream_options(body: dict) -> StreamOptions:
    stream = _bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return StreamOptions(stream, False, False)
    if not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return StreamOptions(stream, bool(options.get("include_usage")), bool(options.get("continuous_usage_stats")))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                    usage_: dict) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                     "stop_reason": None, "prompt_logprobs": None}],
        "service_tier": None, "system_fingerprint": None, "usage": usage_, "kv_transfer_params": None,
    }


def chat_body(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
              usage_: dict) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                 "audio": None, "function_call": None, "tool_calls": [],
                                 "reasoning_content": None},
                     "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
        "service_tier": None, "system_fingerprint": None, "usage": usage_, "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


class ChunkWriter:
    """SSE chunks of one streamed response (completion or chat)."""

    __slots__ = ("_head", "_chat", "_continuous")

    def __init__(self, request_id: str, created: int, model: str, *, chat: bool, continuous_usage: bool = False):
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{_dumps(request_id)},"object":"{obj}","created":{created},'
                      f'"model":{_dumps(model)},"choices":')
        self._chat = chat
        self._continuous = continuous_usage

    def role(self) -> bytes:
        """The chat stream's opening chunk (assistant role, empty content)."""
        return (self._head + '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                '"finish_reason":null}]}\n\n').encode()

    def delta(self, text: str, finish_reason: str | None, usage_: dict | None = None) -> bytes:
        reason = "null" if finish_reason is None else f'"{finish_reason}"'
        stop = ',"stop_reason":null' if finish_reason is not None or not self._chat else ""
        if self._chat:
            choice = (f'[{{"index":0,"delta":{{"content":{_dumps(text)}}},"logprobs":null,'
                      f'"finish_reason":{reason}{stop}}}]')
        else:
            choice = f'[{{"index":0,"text":{_dumps(text)},"logprobs":null,"finish_reason":{reason}{stop}}}]'
        tail = f',"usage":{_dumps(usage_)}}}\n\n' if self._continuous and usage_ is not None else "}\n\n"
        return (self._head + choice + tail).encode()

    def usage(self, usage_: dict) -> bytes:
        return (self._head + f'[],"usage":{_dumps(usage_)}}}\n\n').encode()

    @staticmethod
    def error(exc: ApiError) -> bytes:
        """An error event in a stream whose head was sent (vLLM's streaming error shape)."""
        return b"data: " + error_body(exc.status, exc.message, param=exc.param, code=exc.status,
                                      type_=exc.type_) + b"\n\n"

    DONE = b"data: [DONE]\n\n"
