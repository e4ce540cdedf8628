"""Built-in KV plugin: vLLM's block keys, the content-chain keys, and the vLLM event decoder."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.kv.codec import decode_batch
from llmgw.kv.keys import ContentChainKeys, VllmBlockKeys
from llmgw.plugin import EventBatch, hookimpl


@hookimpl
def register_block_key_functions():
    return {"vllm": VllmBlockKeys, "content": ContentChainKeys}


def vllm_event_decoder() -> Callable[[bytes], EventBatch]:
    """The decoder for every vLLM payload layout (0.9.0 - 0.34.0); it keeps no state."""
    return decode_batch


@hookimpl
def register_event_decoders():
    return {"vllm": vllm_event_decoder}
