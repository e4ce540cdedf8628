"""The status page's chart of replicas against demand over time (``GET /admin/capacity``), in a real headless
Chromium against a real ``llmgw serve`` whose deployment is autoscaled (``replicas: {min: 1, max: 2}``).

The gateway samples its own view every 2 s into a bounded ring: the deployment's replicas ready and starting, the
requests in flight and queued. The JSON shows the replica that is up and the requests held open on it; the page
draws the chart from it (no console error, no Content-Security-Policy violation)."""

from __future__ import annotations

import httpx
import pytest
import trio

from llmgw.testing.chromium import open_page, start_chromium
from llmgw.testing.cluster import embedded

pytestmark = pytest.mark.slow

MODEL = "tiny"


def config(tmp_path) -> str:
    return embedded(tmp_path / "state") + f"""
profiles:
  - name: tiny-sim
    engine: sim
    model_path: tiny
    served_model_name: {MODEL}
    args: ["--profile", "constant", "--decode-ms-per-step", "50"]
deployments:
  - profile: tiny-sim
    replicas: {{min: 1, max: 2}}
    autoscale: {{scale_up_after: 1h}}
"""


async def capacity(gw) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.get(gw.control_url + "/admin/capacity")
    assert answer.status_code == 200, answer.text
    return answer.json()


async def slow_request(gw) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(gw.url + "/v1/completions",
                                   json={"model": MODEL, "prompt": "hello", "max_tokens": 200, "ignore_eos": True})
    assert answer.status_code == 200, answer.text


async def test_the_page_charts_an_autoscaled_deployments_replicas_against_its_requests(
        nursery, start_llmgw, engines, tmp_path):
    gw = await start_llmgw(config(tmp_path), "--stop-engines")
    with trio.fail_after(90):
        while True:
            shown = await capacity(gw)
            deployment = next((d for d in shown["deployments"] if d["model"] == MODEL), None)
            if deployment is not None and deployment["ready"][-1] == 1:
                break
            await trio.sleep(0.5)
    assert shown["interval_s"] == 2.0 and shown["size"] == 300
    assert len(deployment["at"]) == len(deployment["ready"]) == len(deployment["starting"]) \
        == len(deployment["queued"]) == len(deployment["inflight"])
    assert deployment["at"] == sorted(deployment["at"])

    async with trio.open_nursery() as load:  # three requests of 10 s each: in flight over several samples
        for _ in range(3):
            load.start_soon(slow_request, gw)
        with trio.fail_after(30):
            while max((await capacity(gw))["deployments"][0]["inflight"][-1:], default=0) < 3:
                await trio.sleep(0.5)

        browser = await start_chromium(nursery, tmp_path / "chromium")
        async with open_page(browser) as tab:
            await tab.navigate(f"{gw.control_url}/ui")
            title = await tab.wait_for("the chart", "(() => { const t = document.querySelector('#capacity .chart "
                                                    "div'); return t && t.textContent; })()")
            assert title.startswith(f"{MODEL}: 1 ready, 0 starting; "), title
            assert await tab.evaluate("document.querySelectorAll('#capacity svg').length") == 1
            for part in ("ready", "starting", "inflight", "queued"):
                points = await tab.evaluate(f"document.querySelector('#capacity svg .{part}').getAttribute('points')")
                assert points and "NaN" not in points, (part, points)
            await tab.wait_for("the requests in flight", "document.querySelector('#capacity .chart div')"
                                                         ".textContent.includes('3 in flight')")
            assert tab.errors == []
