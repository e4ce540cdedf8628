"""Every path vLLM's OpenAI server answers with a model in its body is relayed, multipart uploads included;
other paths stay 404 and reach no replica."""

from __future__ import annotations

import httpx
import pytest

from llmgw.gateway.dataplane import PROXIED_POST_PATHS

pytestmark = pytest.mark.slow


async def upstream_paths(upstream) -> dict[str, int]:
    async with httpx.AsyncClient() as client:
        return (await client.get(upstream.url + "/stats")).json()["by_path"]


async def test_vllm_paths_are_relayed_by_model(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a")
    gw = await start_llmgw(f"models:\n  - name: tiny\n    replicas:\n      - url: {upstream.url}\n")
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        json_paths = sorted(PROXIED_POST_PATHS - {"/v1/audio/transcriptions", "/v1/audio/translations"})
        for path in json_paths:
            response = await client.post(path, json={"model": "tiny", "prompt": "hi", "input": "hi"})
            assert response.status_code == 200, (path, response.text)
            assert response.headers["x-request-id"]
        # vLLM's tokenizer endpoints may omit the model: the gateway's only model serves them.
        assert (await client.post("/tokenize", json={"prompt": "hi"})).status_code == 200
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            response = await client.post(path, data={"model": "tiny"},
                                         files={"file": ("a.wav", b"RIFF....", "audio/wav")})
            assert response.status_code == 200 and response.json()["text"] == "hello from a", response.text
        no_model = await client.post("/v1/audio/transcriptions", data={"language": "en"},
                                     files={"file": ("a.wav", b"RIFF", "audio/wav")})
        assert no_model.status_code == 400 and no_model.json()["error"]["code"] == "missing_model"
        broken = await client.post("/v1/audio/transcriptions", content=b"not a form",
                                   headers={"content-type": "multipart/form-data; boundary=xyz"})
        assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_form"
        unknown = await client.post("/v1/unknown", json={"model": "tiny"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
        assert (await client.post("/admin/whatever", json={"model": "tiny"})).status_code == 404
        assert (await client.get("/tokenize")).status_code == 405
    seen = await upstream_paths(upstream)
    assert {path: seen.get(path) for path in PROXIED_POST_PATHS} == {
        path: 2 if path == "/tokenize" else 1 for path in PROXIED_POST_PATHS}
    assert "/v1/unknown" not in seen and "/admin/whatever" not in seen
