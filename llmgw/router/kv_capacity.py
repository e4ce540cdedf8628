"""A replica's free KV cache for the capacity charge, from vLLM's usage gauge or, without it, from the KV index.

The capacity charge (:mod:`llmgw.router.decode_cost`) needs the KV tokens no
running request holds there. vLLM's ``vllm:kv_cache_usage_perc`` says it
(``(1 - usage) x capacity``). An engine that does not export that gauge (an
older vLLM, another engine with vLLM's events and cache config) still tells
its capacity (``num_gpu_blocks`` of ``vllm:cache_config_info``), and the
``kv_index`` tier knows the blocks its events say are stored there. Then (the
rule, also in ``docs/routing.md``)::

    held = min(stored blocks x block size,           all the blocks with a hash, cached-only ones included
               prompt tokens of the requests in flight there)   shared prefixes counted once per request
    free = capacity x block size - held

Each is an over-estimate of what running requests hold: the index counts the
blocks a finished request left cached (free for vLLM: evicted on demand),
the requests in flight count a shared prefix once per request; the smaller
is the closer. The tokens the running requests will still generate are the
charge's demand, not this.
"""

from __future__ import annotations

from typing import Callable

from ..engines.probe import EngineLoad

GAUGE, INDEX = "gauge", "index"

StoredBlocks = Callable[[str], int]  # replica name -> blocks the KV index holds for it


def free_tokens(engine: EngineLoad, stored_blocks: StoredBlocks | None, name: str,
                inflight_tokens: int) -> tuple[float | None, str | None]:
    """Replica ``name``'s free KV tokens and where they come from (:data:`GAUGE`, :data:`INDEX`); ``(None, None)``
    when neither the gauge nor the index and the engine's capacity tell."""
    free = engine.kv_free_tokens
    if free is not None:
        return free, GAUGE
    if stored_blocks is None or engine.num_blocks is None or engine.block_size is None:
        return None, None
    held = min(stored_blocks(name) * engine.block_size, max(inflight_tokens, 0))
    return max(0.0, float(engine.num_blocks * engine.block_size - held)), INDEX
