"""The simulator's tokenizer as Hugging Face files: ``tokenizer.json`` and ``tokenizer_config.json``.

What a real model directory holds next to its weights, so that a router's
local tokenizer (:mod:`llmgw.kv.local_tokenizer`) can be tested end to end
against simulators: the ``tokenizers`` library loading ``tokenizer.json``
yields exactly :func:`llmgw.sim.tokenizer.encode`'s ids (byte-level, special
tokens as single ids, BOS prepended with ``add_special_tokens``), and the
``chat_template`` of ``tokenizer_config.json`` renders what
:func:`llmgw.sim.tokenizer.render_chat` renders for string contents.
"""

from __future__ import annotations

import json
from pathlib import Path

from .tokenizer import _TOKEN_STRS, BOS_ID, EOS_ID, SPECIAL_TOKENS

CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizer_json() -> dict:
    """``tokenizer.json``: a byte-level BPE without merges, the special tokens added, BOS by the post-processor."""
    vocab = {token: i for i, token in enumerate(_TOKEN_STRS)}
    added = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, token in enumerate(SPECIAL_TOKENS)]
    bos = SPECIAL_TOKENS[BOS_ID]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def tokenizer_config_json() -> dict:
    return {"bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID], "add_bos_token": True,
            "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}


def write_tokenizer_files(directory: str | Path) -> Path:
    """Write both files into ``directory`` (created if missing); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_json(), ensure_ascii=False))
    return directory
