"""The local tokenizer source: the model's tokenizer.json and chat template in the router, exactly /tokenize's ids."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.http.client import UpstreamPool
from llmgw.kv.local_tokenizer import LocalTokenizer, LocalTokenizerError
from llmgw.kv.tokenize import CHAT_PATH, COMPLETIONS_PATH, plan
from llmgw.plugins.replica_tokenizer import TokenizeClient
from llmgw.plugins.tokenizers import VERIFY_ANSWERS, LocalFirstTokenizer
from llmgw.router.replica import Replica
from llmgw.sim import tokenizer as sim_tokenizer
from llmgw.sim.app import Simulator
from llmgw.sim.config import SimConfig
from llmgw.sim.tokenizer_files import write_tokenizer_files

BASE = frozenset({"tiny"})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_tokenizer_files(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
async def sim(nursery):
    simulator = Simulator(SimConfig(port=0, served_model_names=["tiny"], time_scale=0))
    addresses = await nursery.start(simulator.run)
    replica = Replica(name="sim", model="tiny", url=addresses.base_url)
    replica.pool = UpstreamPool(replica.host, replica.port)
    return replica


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80) | st.sampled_from(
    ["<|user|>", "a<s>b", "<|end|>\n", " x ", "é漢🙂", "<reserved_9>", ""])


@settings(max_examples=150, deadline=None)
@given(text=texts, special=st.booleans())
def test_completion_prompts_tokenize_like_the_simulator(files, text, special):
    local = LocalTokenizer(files)
    assert local.ids({"prompt": text, "add_special_tokens": special}) == sim_tokenizer.encode(
        text, add_special_tokens=special)


@settings(max_examples=150, deadline=None)
@given(text=texts, special=st.booleans())
def test_the_offset_free_encoding_gives_encodes_ids(files, text, special):
    segments = LocalTokenizer(files).segments
    assert segments.ids != segments._encode_ids  # encode_batch_fast is in use
    assert segments.ids(text, special) == segments.tokenizer.encode(text, add_special_tokens=special).ids


def test_an_offset_free_encoding_that_disagrees_is_not_used(files):
    from tokenizers import Tokenizer

    class Disagreeing:
        def __init__(self):
            self.real = Tokenizer.from_file(str(files / "tokenizer.json"))

        def __getattr__(self, name):
            return getattr(self.real, name)

        def encode_batch_fast(self, texts, add_special_tokens):
            return [self.real.encode(text + "x", add_special_tokens=add_special_tokens) for text in texts]

    from llmgw.kv.local_tokenizer import SegmentMemo

    segments = SegmentMemo(Disagreeing())
    assert segments.ids == segments._encode_ids and segments.split is not None
    assert segments.encode("<|user|>hi", False) == segments.tokenizer.encode("<|user|>hi",
                                                                             add_special_tokens=False).ids


roles = st.sampled_from(["system", "user", "assistant", "tool"])


@settings(max_examples=150, deadline=None)
@given(messages=st.lists(st.fixed_dictionaries({"role": roles, "content": texts}), min_size=1, max_size=4),
       generation=st.booleans())
def test_chats_render_and_tokenize_like_the_simulators_template(files, messages, generation):
    local = LocalTokenizer(files)
    body = {"messages": messages, "add_generation_prompt": generation}
    assert local.ids(body) == sim_tokenizer.encode_chat(messages, add_generation_prompt=generation)


def test_what_cannot_be_reproduced_exactly_is_left_to_the_engine(files):
    local = LocalTokenizer(files)
    chat = [{"role": "user", "content": "hi"}]
    assert local.ids({"messages": chat}) is not None
    for body in ({"messages": chat, "tools": [{"type": "function", "function": {"name": "f"}}]},
                 {"messages": chat, "chat_template": "{{ messages }}"},
                 {"messages": chat, "chat_template_kwargs": {"enable_thinking": False}},
                 {"messages": chat, "continue_final_message": True, "add_generation_prompt": False},
                 {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                 {"messages": [{"role": "user", "content": None}]},
                 {"messages": [{"role": "user", "content": "hi", "name": "bob"}]},
                 {"messages": []}, {"prompt": 5}, {"prompt": "x", "add_special_tokens": "yes"}):
        assert local.ids(body) is None, body


def test_missing_or_broken_files_are_a_clear_error(tmp_path):
    with pytest.raises(LocalTokenizerError, match="tokenizer.json"):
        LocalTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(LocalTokenizerError, match="cannot load"):
        LocalTokenizer(tmp_path)
    write_tokenizer_files(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for x in %}"}))
    with pytest.raises(LocalTokenizerError, match="does not compile"):
        LocalTokenizer(tmp_path)


def bodies():
    """/tokenize bodies as the kv_index tier builds them: chats, completions, a LoRA request."""
    out = []
    for i in range(6):
        chat = {"model": "tiny", "messages": [{"role": "system", "content": f"system {i} " * 40},
                                              {"role": "user", "content": f"question {i} <|user|> é"}]}
        out.append(plan(CHAT_PATH, chat, base_models=BASE).body)
        out.append(plan(COMPLETIONS_PATH, {"model": "tiny", "prompt": f"complete {i} " * 30}, base_models=BASE).body)
    return out


async def test_the_local_source_answers_what_the_engines_tokenize_answers(sim, files):
    counted = []
    source = LocalFirstTokenizer({"tokenizer_path": str(files), "base_models": BASE, "tokenize_timeout": 2.0})
    source.count_source = counted.append
    assert source.local is not None
    reference = TokenizeClient(timeout=2.0)
    for body in bodies():
        assert await source.tokenize(sim, body) == await reference.tokenize(sim, body)
    # the first answers were checked against the engine, the rest came from the router's own tokenizer
    assert source.verify_left == 0 and source.mismatches == 0 and source.local is not None
    assert counted.count("replica") == VERIFY_ANSWERS and counted.count("local") == len(bodies()) - VERIFY_ANSWERS
    assert source.replica.calls == VERIFY_ANSWERS
    assert await source.tokenize(sim, bodies()[-1]) == await reference.tokenize(sim, bodies()[-1])
    assert counted[-1] == "cache"
    # a chat the local tokenizer cannot template exactly goes to the engine
    tools = plan(CHAT_PATH, {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                             "tools": [{"type": "function", "function": {"name": "f"}}]}, base_models=BASE).body
    await source.tokenize(sim, tools)
    assert counted[-1] == "replica" and source.replica.calls == VERIFY_ANSWERS + 1


async def test_a_disagreeing_local_tokenizer_is_turned_off_for_good(sim, files, tmp_path, caplog):
    write_tokenizer_files(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("<|end|>", " <|end|>")  # not the engine's template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    counted = []
    source = LocalFirstTokenizer({"tokenizer_path": str(tmp_path), "base_models": BASE, "tokenize_timeout": 2.0})
    source.count_source = counted.append
    reference = TokenizeClient(timeout=2.0)
    chat = bodies()[0]
    with caplog.at_level(logging.WARNING, logger="llmgw.plugins.tokenizers"):
        assert await source.tokenize(sim, chat) == await reference.tokenize(sim, chat)  # the engine's answer
    assert source.local is None and source.mismatches == 1 and "local_mismatch" in counted
    assert "disagreed with sim's /tokenize" in caplog.text
    for body in bodies()[1:4]:
        assert await source.tokenize(sim, body) == await reference.tokenize(sim, body)
    assert "local" not in counted


async def test_without_tokenizer_files_the_engines_tokenize_answers(sim, tmp_path):
    source = LocalFirstTokenizer({"tokenizer_path": str(tmp_path), "base_models": BASE, "tokenize_timeout": 2.0})
    assert source.local is None
    body = bodies()[0]
    assert await source.tokenize(sim, body) == await TokenizeClient(timeout=2.0).tokenize(sim, body)
    assert source.replica.calls == 1


async def test_a_lora_request_is_tokenized_by_the_engine(files):
    source = LocalFirstTokenizer({"tokenizer_path": str(files), "base_models": BASE})
    lora = plan(COMPLETIONS_PATH, {"model": "my-adapter", "prompt": "x"}, base_models=BASE,
                loras={"my-adapter": "/adapters/a"}).body
    assert source._local_ids(source.local, lora) is None
    base = plan(COMPLETIONS_PATH, {"model": "tiny", "prompt": "x"}, base_models=BASE).body
    assert source._local_ids(source.local, base) == [1, 16 + ord("x")]


def test_the_kv_tier_finds_the_tokenizer_in_the_profiles_model_path(files, tmp_path):
    from llmgw.metrics import Metrics
    from llmgw.plugins_manager import build_registry, make_plugin_manager
    from llmgw.router.model import TierModel
    from llmgw.router.router import Router

    router = Router(build_registry(make_plugin_manager()), Metrics())
    profile = TierModel("tiny", "kv_index", model_path=str(files))
    tier = router.configure_model("tiny", "kv_index", model=profile).tier
    assert tier.tokenizer.local is not None and tier.tokenizer.base_models == BASE
    hub_id = TierModel("tiny", "kv_index", model_path="org/model")
    assert router.configure_model("tiny", "kv_index", model=hub_id).tier.tokenizer.local is None
    explicit = {"tokenizer_path": str(files), "tokenizer": "local"}
    assert router.configure_model("tiny", "kv_index", explicit).tier.tokenizer.local is not None


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["messages", "prompt", "add_special_tokens", "add_generation_prompt",
                                             "tools", "continue_final_message", "model"]), json_values, max_size=5))
def test_any_body_gives_ids_or_none_never_an_error(files, body):
    ids = LocalTokenizer(files).ids(json.dumps(body).encode())
    assert ids is None or all(type(t) is int for t in ids)
