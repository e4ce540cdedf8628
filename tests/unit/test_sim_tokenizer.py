"""The simulator's tokenizer and chat template (what /tokenize and generation share)."""

from __future__ import annotations

import pytest

from llmgw.sim import tokenizer as tok
from llmgw.sim.sampler import SamplingParams, output_tokens


def test_bytes_and_special_tokens():
    ids = tok.encode("hi <|end|>é", add_special_tokens=True)
    assert ids == [tok.BOS_ID, 16 + ord("h"), 16 + ord("i"), 16 + ord(" "), tok.END_ID, 16 + 0xC3, 16 + 0xA9]
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hi <|end|>é"
    assert tok.decode(ids, skip_special_tokens=True) == "hi é"
    assert tok.encode("", add_special_tokens=False) == []
    assert tok.token_strs(tok.encode("a b", add_special_tokens=False)) == ["a", "Ġ", "b"]


def test_chat_template_matches_recipe():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tok.render_chat(messages) == "<|system|>s<|end|>\n<|user|>u<|end|>\n<|assistant|>"
    assert tok.render_chat(messages, add_generation_prompt=False) == "<|system|>s<|end|>\n<|user|>u<|end|>\n"
    partial = messages + [{"role": "assistant", "content": "Sure"}]
    assert tok.render_chat(partial, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|assistant|>Sure")
    ids = tok.encode_chat(messages)
    assert ids[0] == tok.SYSTEM_ID and ids[-1] == tok.ASSISTANT_ID and tok.BOS_ID not in ids
    assert tok.encode_chat(messages, add_special_tokens=True)[0] == tok.BOS_ID
    # Roles without a special token are plain text; list content is joined with newlines.
    assert tok.render_chat([{"role": "tool", "content": [{"type": "text", "text": "a"}, "b"]}],
                           add_generation_prompt=False) == "<|tool|>a\nb<|end|>\n"


@pytest.mark.parametrize("messages", [[], "x", [{"content": "no role"}],
                                      [{"role": "user", "content": [{"type": "image_url"}]}]])
def test_bad_messages(messages):
    with pytest.raises(tok.TokenizerError):
        tok.encode_chat(messages)


def test_both_generation_flags_rejected():
    with pytest.raises(tok.TokenizerError):
        tok.render_chat([{"role": "user", "content": "x"}], add_generation_prompt=True, continue_final_message=True)


def test_check_ids():
    assert tok.check_ids([0, tok.VOCAB_SIZE - 1]) == [0, tok.VOCAB_SIZE - 1]
    for bad in ([tok.VOCAB_SIZE], [-1], [1.5], ["1"]):
        with pytest.raises(tok.TokenizerError):
            tok.check_ids(bad)


def test_outputs_are_deterministic_and_valid():
    prompt = tok.encode("hello", add_special_tokens=True)
    params = SamplingParams(max_tokens=200)
    a = output_tokens(prompt, params, engine_seed=1, output_range=(16, 128))
    assert a == output_tokens(prompt, params, engine_seed=1, output_range=(16, 128))
    assert a != output_tokens(prompt, params, engine_seed=2, output_range=(16, 128))
    assert a != output_tokens(prompt, SamplingParams(max_tokens=200, seed=5), engine_seed=1, output_range=(16, 128))
    assert 16 <= len(a) <= 128 and a[-1] == tok.EOS_ID
    assert all(16 <= t < tok.VOCAB_SIZE for t in a[:-1])
    capped = output_tokens(prompt, SamplingParams(max_tokens=5), engine_seed=1, output_range=(16, 128))
    assert len(capped) == 5 and tok.EOS_ID not in capped
    forced = output_tokens(prompt, SamplingParams(max_tokens=300, ignore_eos=True), engine_seed=1,
                           output_range=(16, 128))
    assert len(forced) == 300 and tok.EOS_ID not in forced
    at_least = output_tokens(prompt, SamplingParams(max_tokens=300, min_tokens=200), engine_seed=1,
                             output_range=(16, 128))
    assert len(at_least) == 201 and at_least[-1] == tok.EOS_ID
