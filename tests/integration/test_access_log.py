"""The access log has a line for every answer of the data plane, not only for relayed ones: 401, 404, 400, 413
(answered by the HTTP server itself) and 503 too, each with the name of the API key it carried (``none``:
no valid key), as ``key=value`` text or as keys of a JSON object; the same names label
``llmgw_requests_by_key_total``. A key itself is never written."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers import wait_for
from llmgw.testing.metrics import metric_value, scrape
from llmgw.testing.processes import free_port

KEYS = ("sk-access-web-0001", "sk-access-batch-0002")


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_every_answer_has_an_access_line_with_its_key_name(start_fake_upstream, start_llmgw, log_format):
    upstream = await start_fake_upstream("a")
    gw = await start_llmgw(f"""
access_log: true
models:
  - name: tiny
    replicas:
      - url: {upstream.url}
        name: a
  - name: gone
    replicas:
      - url: http://127.0.0.1:{free_port()}
api_keys:
  - key: {KEYS[0]}
    name: web
  - key: {KEYS[1]}
limits:
  max_body_bytes: 1KiB
health:
  interval: 0.1s
  failures_to_down: 1
""", "--log-format", log_format)
    web, batch = ({"Authorization": f"Bearer {key}"} for key in KEYS)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    expected = {}  # request id -> (status, key name, model)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        for status, key, model, answer in [
            (401, "none", None, client.post("/v1/chat/completions", json={"model": "tiny", **chat},
                                            headers={"Authorization": "Bearer sk-wrong"})),
            (404, "web", "nope", client.post("/v1/chat/completions", json={"model": "nope", **chat}, headers=web)),
            (404, "key-2", None, client.get("/v1/nothing-here", headers=batch)),
            (400, "web", None, client.post("/v1/chat/completions", content=b"{", headers=web)),
            (413, "none", None, client.post("/v1/chat/completions", json={"model": "tiny", "p": "x" * 4096},
                                            headers=web)),
            (200, "key-2", "tiny", client.post("/v1/chat/completions", json={"model": "tiny", **chat},
                                               headers=batch)),
        ]:
            response = await answer
            assert response.status_code == status, response.text
            expected[response.headers["x-request-id"]] = (status, key, model)

        async def gone_is_down() -> bool:
            response = await client.post("/v1/chat/completions", json={"model": "gone", **chat}, headers=web)
            if response.status_code == 503:
                expected[response.headers["x-request-id"]] = (503, "web", "gone")
            return response.status_code == 503

        await wait_for(gone_is_down)

    def access_lines() -> dict[str, dict]:
        found = {}
        for line in gw.lines:
            if "llmgw.access" not in line:
                continue
            if log_format == "json":
                entry = json.loads(line)
            else:
                message = line.split("llmgw.access: ", 1)[1]
                entry = dict(part.split("=", 1) for part in message.split(" "))
            found[entry["request_id"]] = entry
        return found

    async def all_logged() -> bool:
        return set(expected) <= set(access_lines())

    await wait_for(all_logged)
    lines = access_lines()
    for request_id, (status, key, model) in expected.items():
        entry = lines[request_id]
        if log_format == "json":
            assert (entry["status"], entry["key"], entry["model"]) == (status, key, model), entry
        else:
            assert (entry["status"], entry["key"], entry["model"]) == (str(status), key, model or "-"), entry
    assert lines[next(i for i, e in expected.items() if e[0] == 200)]["replica"] == "a"
    everything = "\n".join(gw.lines)
    assert not any(key in everything for key in KEYS)

    text = await scrape(gw.control_url)
    assert metric_value(text, "llmgw_requests_by_key_total", 'key="none",code="401"') == 1
    assert metric_value(text, "llmgw_requests_by_key_total", 'key="key-2",code="200"') == 1
    assert metric_value(text, "llmgw_requests_by_key_total", 'key="web",code="404"') == 1
    assert metric_value(text, "llmgw_requests_by_key_total", 'key="none",code="413"') == 1
