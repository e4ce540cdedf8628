"""The canonical text routing compares, and the router's token estimate from it."""

from __future__ import annotations

from llmgw.router.canonical import canonical_text, estimated_prompt_tokens, render_body
from llmgw.router.tier import RouteRequest


def test_chat_messages_render_with_their_roles_so_a_longer_conversation_extends_a_shorter_one():
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    one, two = render_body({"messages": turn1}), render_body({"messages": turn2})
    assert one == "system\x1fbe brief\x1euser\x1fhi\x1e"
    assert two.startswith(one)
    # The same words under another role are another prompt.
    assert render_body({"messages": [{"role": "user", "content": "be brief"}]}) != \
        render_body({"messages": [{"role": "system", "content": "be brief"}]})


def test_content_parts_tools_and_cache_salt_are_part_of_the_text():
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                       {"type": "image_url", "image_url": {"url": "u1"}}]}]}
    other_image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                             {"type": "image_url", "image_url": {"url": "u2"}}]}]}
    assert render_body(parts) != render_body(other_image)
    assert render_body(parts).startswith("user\x1flook\n")
    tools = {"tools": [{"type": "function", "function": {"name": "f"}}], **parts}
    assert render_body(tools).startswith("tools\x1f") and render_body(tools).endswith(render_body(parts))
    salted = {"cache_salt": "tenant-1", **parts}
    assert render_body(salted).startswith("salt\x1ftenant-1\x1e")


def test_completion_prompts_token_ids_batches_and_embedding_inputs():
    assert render_body({"prompt": "once upon a time"}) == "once upon a time"
    assert render_body({"prompt": [1, 2, 3]}) == "1,2,3"
    assert render_body({"prompt": ["first", "second"]}) == "first"
    assert render_body({"prompt": [[5, 6], [7]]}) == "5,6"
    assert render_body({"input": "embed me"}) == "embed me"
    assert render_body({}) == ""


def test_the_text_is_rendered_once_per_request_and_estimates_tokens():
    request = RouteRequest("m", "/v1/completions", {"prompt": "x" * 400})
    assert estimated_prompt_tokens(request) == 101
    request.body["prompt"] = "changed"  # cached: the router and the tier see the same text
    assert canonical_text(request) == "x" * 400
