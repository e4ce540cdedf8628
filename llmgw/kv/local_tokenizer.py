"""Prompt token ids computed in the router from the model's own tokenizer files, as vLLM's ``/tokenize`` would.

:class:`LocalTokenizer` loads ``tokenizer.json`` with the Hugging Face
``tokenizers`` library (optional: ``pip install 'llmgw[tokenizer]'``) and the
chat template of ``tokenizer_config.json``, and answers :meth:`LocalTokenizer.ids`
for the ``/tokenize`` bodies :func:`llmgw.kv.tokenize.plan` builds:

- a completion's string prompt: encoded with its ``add_special_tokens``
  (default true), exactly as vLLM does;
- a chat: the chat template rendered as Hugging Face's ``apply_chat_template``
  renders it (a sandboxed Jinja environment with ``trim_blocks`` and
  ``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``; the
  special tokens of ``tokenizer_config.json`` as variables), then encoded
  without special tokens (vLLM's chat default) unless the body asks.

Anything it cannot reproduce with certainty returns None, and the caller asks
a replica's ``/tokenize``: chats with ``tools``, a ``chat_template`` or
``chat_template_kwargs`` of their own, ``continue_final_message``, content
that is not a plain string, a body naming a model that is not the base model
(a LoRA adapter may bring its own tokenizer), or a model without a chat
template. :class:`LocalFirstTokenizer` (tokenizer source ``auto``, the
default) also checks the first answers against ``/tokenize`` and turns itself
off for good on a mismatch.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn

if TYPE_CHECKING:
    from jinja2 import Template
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_CHARS = 1 << 20
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class LocalTokenizerError(Exception):
    """The tokenizer files are missing, unreadable, or the ``tokenizers`` library is not installed."""


def has_tokenizer_files(directory: str | Path | None) -> bool:
    return directory is not None and str(directory) != "" and (Path(directory) / TOKENIZER_FILE).is_file()


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, Mapping) else None
    return content if isinstance(content, str) else None


def _chat_template(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        template = next((t.get("template") for t in template
                         if isinstance(t, Mapping) and t.get("name") == "default"), None)
    return template if isinstance(template, str) and len(template) <= MAX_TEMPLATE_CHARS else None


class LocalTokenizer:
    """The tokenizer of the model in ``directory`` (``tokenizer.json``, and ``tokenizer_config.json`` if any)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise LocalTokenizerError("the 'tokenizers' library is not installed "
                                      "(pip install 'llmgw[tokenizer]')") from exc
        try:
            self.tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        except Exception as exc:  # the library raises plain Exceptions for missing or malformed files
            raise LocalTokenizerError(f"cannot load {directory / TOKENIZER_FILE}: {exc}") from exc
        config: dict[str, Any] = {}
        config_path = directory / CONFIG_FILE
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise LocalTokenizerError(f"cannot read {config_path}: {exc}") from exc
            if not isinstance(config, dict):
                raise LocalTokenizerError(f"{config_path} is not a JSON object")
        self.directory = directory
        self.special_tokens = {key: text for key in SPECIAL_TOKEN_KEYS
                               if (text := _token_text(config.get(key))) is not None}
        source = _chat_template(config)
        self.template = _compile(source) if source else None
        self.segments = SegmentMemo(self.tokenizer)

    def ids(self, body: bytes | Mapping[str, Any]) -> list[int] | None:
        """The prompt ids of a ``/tokenize`` body, or None when only the engine can say them exactly."""
        request = json.loads(body) if isinstance(body, (bytes, str)) else body
        if not isinstance(request, Mapping):
            return None
        if "prompt" in request:
            prompt, special = request.get("prompt"), request.get("add_special_tokens", True)
            if not isinstance(prompt, str) or not isinstance(special, bool):
                return None
            return self.segments.encode(prompt, special)
        text = self.render_chat(request)
        if text is None:
            return None
        special = request.get("add_special_tokens", False)
        if not isinstance(special, bool):
            return None
        return self.segments.encode(text, special)

    def render_chat(self, request: Mapping[str, Any]) -> str | None:
        """The chat template applied to a chat ``/tokenize`` body, or None when it cannot be done exactly here."""
        if self.template is None or any(request.get(key) for key in ("tools", "chat_template",
                                                                      "chat_template_kwargs")):
            return None
        if request.get("continue_final_message", False) is not False:
            return None
        generation = request.get("add_generation_prompt", True)
        messages = request.get("messages")
        if not isinstance(generation, bool) or not isinstance(messages, list) or not messages:
            return None
        for message in messages:
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str) or set(message) - {"role", "content"}:
                return None
        try:
            text: str = self.template.render(messages=messages, add_generation_prompt=generation, tools=None,
                                        documents=None, **self.special_tokens)
        except Exception as exc:  # a template's raise_exception, or any error in it: the engine would answer 400
            log.debug("the local chat template failed (%s); asking a replica", exc)
            return None
        return text


class SegmentMemo:
    """Encoding with a memo of the text between added tokens: a shared system prompt is tokenized once.

    The ``tokenizers`` library splits its input on added tokens (``<|end|>``,
    ``<|im_start|>``...) before normalizing and pre-tokenizing each piece on its
    own, so the ids of a text are its pieces' ids one after the other, and the
    pieces of a chat (a system prompt, earlier turns) recur from request to
    request. Used only when that holds for this tokenizer: every added token
    matched verbatim (no ``lstrip``/``rstrip``/``single_word``, not
    normalized), and probe texts encode the same both ways (a pre-tokenizer
    that treats the start of the input apart, such as Metaspace's
    ``prepend_scheme: first``, fails that check); with ``add_special_tokens``
    (a post-processor adds BOS) the text is encoded whole. Bounded by
    ``max_tokens`` ids held, least recently used first out; safe to use from the
    event loop and one worker thread at once.

    Text is encoded with ``encode_batch_fast`` (``tokenizers`` 0.21+), which
    skips the character offsets ``encode`` computes and nobody here reads:
    about half the cost of a 2,000-token piece. Used only when it gives
    ``encode``'s ids on the probe texts (else ``encode``).
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int = 2_000_000):
        import re
        from collections import OrderedDict

        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.tokens = 0
        self._memo: "OrderedDict[str, list[int]]" = OrderedDict()
        self._lock = threading.Lock()  # large bodies are tokenized in a worker thread, small ones inline
        self.ids: Callable[[str, bool], list[int]] = self._encode_ids
        fast = getattr(tokenizer, "encode_batch_fast", None)
        if fast is not None and self._fast_agrees(fast):
            self.ids = lambda text, special: fast([text], add_special_tokens=special)[0].ids
        added = tokenizer.get_added_tokens_decoder()
        self.ids_of = {token.content: i for i, token in added.items()}
        verbatim = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        self.split: Callable[[str], list[str]] | None = None
        if added and verbatim:
            contents = sorted(self.ids_of, key=len, reverse=True)  # leftmost-longest, as the library matches
            self.split = re.compile("(" + "|".join(map(re.escape, contents)) + ")").split
            if not self._agrees(contents):
                self.split = None

    def _encode_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _fast_agrees(self, fast: Callable[..., Any]) -> bool:
        added = [token.content for token in self.tokenizer.get_added_tokens_decoder().values()][:4]
        probes = ["Hello world\n  more text é ", " leading", "x", *(f"{c} a{c}\nb " for c in added)]
        return all(fast([p], add_special_tokens=special)[0].ids == self._encode_ids(p, special)
                   for p in probes for special in (False, True))

    def _agrees(self, contents: list[str]) -> bool:
        probes = [f"{c}Hello world{d}\n  more text é{c} end " for c in contents[:4] for d in contents[:2]]
        probes += [f" leading{contents[0]}\nnext", f"x{contents[-1]}{contents[0]} y"]
        return all(self._pieces(p) == self._encode_ids(p, False) for p in probes)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if add_special_tokens or self.split is None:
            return self.ids(text, add_special_tokens)
        return self._pieces(text)

    def _pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        memo, lock, split = self._memo, self._lock, self.split
        assert split is not None  # only with a split: see encode and _agrees
        for i, piece in enumerate(split(text)):
            if i % 2:
                ids.append(self.ids_of[piece])
            elif piece:
                with lock:
                    known = memo.get(piece)
                    if known is not None:
                        memo.move_to_end(piece)
                if known is None:
                    known = self.ids(piece, False)
                    with lock:
                        if piece not in memo:
                            memo[piece] = known
                            self.tokens += len(known)
                        while self.tokens > self.max_tokens and memo:
                            self.tokens -= len(memo.popitem(last=False)[1])
                ids.extend(known)
        return ids


def _compile(source: str) -> Template:
    """The template compiled like Hugging Face's ``apply_chat_template`` compiles it."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> NoReturn:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise LocalTokenizerError(f"the chat template does not compile: {exc}") from exc
