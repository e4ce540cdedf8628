"""LoRA adapters are models: listed with their base as parent, routed among the base's replicas, and the
``kv_index`` tier predicts their cached tokens exactly, with the adapter in the block keys (vLLM's LoRA
extra keys), through ``llmgw serve``, its embedded agent and simulator engines started with
``--enable-lora --lora-modules``."""

from __future__ import annotations

import pytest

from llmgw.testing.cluster import BLOCK, all_up, embedded, kv_where, text
from llmgw.testing.sims import kv_sim_profile as kv_sim

pytestmark = pytest.mark.slow

LORA_SIM = kv_sim('"--num-blocks", "512", "--time-scale", "0"',
                  extra="    lora_adapters:\n      - {name: sql-lora, path: /adapters/sql}\n")


async def complete(cluster, model: str, prompt: str) -> tuple[str, dict]:
    response = await cluster.http.post(cluster.data_url + "/v1/completions",
                                       json={"model": model, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.headers["x-llmgw-replica"], response.json()["usage"]


async def predicted_and_actual(cluster) -> tuple[float, float]:
    return (await cluster.metric("llmgw_route_predicted_cached_tokens_total", 'model="tiny"'),
            await cluster.metric("llmgw_route_actual_cached_tokens_total", 'model="tiny"'))


async def test_adapters_are_listed_routed_and_predicted_exactly(cluster):
    cluster.write_config(embedded(cluster.tmp_path / "local") + LORA_SIM)
    await cluster.start_serve()
    replicas = await cluster.replicas_where("two replicas up", all_up(2))
    await kv_where(cluster, "both indexes healthy",
                   lambda s: all(s.get(name, {}).get("state") == "healthy" for name in replicas))

    models = (await cluster.http.get(cluster.data_url + "/v1/models")).json()["data"]
    assert {m["id"]: m.get("parent") for m in models} == {"tiny": None, "sql-lora": "tiny"}
    card = (await cluster.http.get(cluster.data_url + "/v1/models/sql-lora")).json()
    assert card["id"] == "sql-lora" and card["parent"] == "tiny"
    missing = await cluster.http.post(cluster.data_url + "/v1/completions",
                                      json={"model": "other-lora", "prompt": "x", "max_tokens": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    # The adapter's prompt once: cached nowhere yet; its blocks (with the adapter's extra keys) get indexed.
    prompt = text(7, 3000)
    holder, usage = await complete(cluster, "sql-lora", prompt)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    await kv_where(cluster, "the adapter's blocks indexed",
                   lambda s: s[holder]["blocks"] >= usage["prompt_tokens"] // BLOCK)

    # The same adapter and prefix again: routed to the holder, predicted exactly what the engine served.
    chosen, usage = await complete(cluster, "sql-lora", prompt + " and a follow-up")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert chosen == holder and cached >= (usage["prompt_tokens"] // BLOCK - 2) * BLOCK > 0
    assert await predicted_and_actual(cluster) == (cached, cached)
    explained = await cluster.http.post(cluster.control_url + "/admin/explain",
                                        json={"model": "sql-lora", "prompt": prompt})
    assert explained.status_code == 200 and explained.json()["pick"] == holder

    # The base model with the same prompt: the adapter's blocks are not its blocks (the adapter is in the keys),
    # so nothing is predicted and the engine, wherever it went, served nothing from cache.
    _, usage = await complete(cluster, "tiny", prompt)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert await predicted_and_actual(cluster) == (cached, cached)
    assert await cluster.metric("llmgw_requests_total", 'model="sql-lora",code="200"') == 2
