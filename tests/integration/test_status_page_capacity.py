"""The status page's chart of replicas against demand over time (``GET /admin/capacity``), in a real headless
Chromium against a real ``llmgw serve`` whose deployment is autoscaled (``replicas: {min: 1, max: 2}``; and a
``sleep_mode`` one, ``{min: 0, max: 1}`` with ``keep_warm``, whose replica goes to sleep).

The gateway samples its own view every 2 s into a bounded ring: the deployment's replicas ready, starting, asleep
and draining, the requests in flight and queued, the arrivals, and the autoscaler's decisions. The JSON shows the
replica that is up and the requests held open on it, or the replica asleep after a scale to zero; the page draws
the chart from it with a mark per decision and the last one's reason (no console error, no Content-Security-Policy
violation)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
import trio

from llmgw.testing.chromium import open_page, start_chromium
from llmgw.testing.cluster import AGENTS, embedded

pytestmark = pytest.mark.slow

MODEL = "tiny"
POINTS = "document.querySelector('#capacity svg .{0}').getAttribute('points')"
TITLE = "document.querySelector('#capacity .chart div').textContent"
LAST_DECISION = "document.querySelector('#capacity .last-decision').textContent"


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


async def chart_title(tab, holding: str) -> str:
    """The first chart's line of words, once it holds ``holding``."""
    return await tab.wait_for(f"the chart with {holding!r}", f"(() => {{ const t = document.querySelector("
                                                            f"'#capacity .chart div'); return t && t.textContent"
                                                            f".includes({holding!r}) && t.textContent; }})()")


async def every_layer_drawn(tab) -> None:
    for part in ("ready", "starting", "sleeping", "draining", "inflight", "queued", "arrivals"):
        points = await tab.evaluate(POINTS.format(part))
        assert points and "NaN" not in points, (part, points)


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
            title = await chart_title(tab, "ready")
            assert title.startswith(f"{MODEL}: 1 ready, 0 starting, 0 asleep, 0 draining; "), title
            assert await tab.evaluate("document.querySelectorAll('#capacity svg').length") == 1
            await every_layer_drawn(tab)
            await tab.wait_for("the requests in flight", "document.querySelector('#capacity .chart div')"
                                                         ".textContent.includes('3 in flight')")
            assert tab.errors == []


SLEEPY = f"""autoscale:
  interval: 0.2s
{AGENTS}profiles:
  - name: tiny-sim
    engine: sim
    model_path: tiny
    served_model_name: {MODEL}
    sleep_mode: true
    args: ["--startup-seconds", "0.5", "--hot-startup-seconds", "0.2"]
deployments:
  - profile: tiny-sim
    replicas: {{min: 0, max: 1}}
    autoscale: {{idle_to_zero: 1s, keep_warm: 1h}}
"""


@dataclass
class Urls:
    url: str
    control_url: str


async def latest(gw) -> dict | None:
    return next((d for d in (await capacity(gw))["deployments"] if d["model"] == MODEL and d["at"]), None)


async def call(gw) -> None:
    """One request in the batch class: it waits at the gateway (up to 60 s) for a replica to start or wake."""
    async with httpx.AsyncClient(timeout=90) as client:
        answer = await client.post(gw.url + "/v1/completions", headers={"x-llmgw-priority": "batch"},
                                   json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert answer.status_code == 200, answer.text


async def until_sampled(gw, what: str, predicate) -> dict:
    """The deployment's samples once ``predicate`` holds of them; a failure naming ``what`` after 60 s."""
    found = None
    with trio.move_on_after(60):
        while True:
            found = await latest(gw)
            if found is not None and predicate(found):
                return found
            await trio.sleep(0.5)
    raise AssertionError(f"/admin/capacity did not show {what} within 60 s; last: {found}")


async def test_the_page_charts_a_replica_asleep_and_the_decisions_that_put_it_there_and_woke_it(
        nursery, cluster, tmp_path):
    # a remote agent on fixture GPUs: the autoscaler places a replica only where GPUs are free
    cluster.write_config(SLEEPY)
    await cluster.start_serve()
    await cluster.start_agent("a", "tiny-2gpu-a")
    gw = Urls(cluster.data_url, cluster.control_url)
    await until_sampled(gw, "at zero", lambda d: d["ready"][-1] == 0)
    await call(gw)  # from zero, a cold start; idle 1 s later, back to zero: the replica sleeps
    shown = await until_sampled(gw, "the replica asleep", lambda d: d["sleeping"][-1] == 1 and d["ready"][-1] == 0)
    assert [d["kind"] for d in shown["decisions"]][-2:] == ["from_zero", "to_zero"], shown["decisions"]
    assert shown["decisions"][-2]["reason"].endswith("; a cold start"), shown["decisions"]
    read = [a for a in shown["arrivals"] if a is not None]  # null before the leader's autoscaler read any
    assert read and max(read) > 0 and read[-1] == shown["arrivals"][-1], shown["arrivals"]
    assert shown["decisions"][-1]["at"] >= shown["at"][0]  # on the chart, which began with the gateway

    browser = await start_chromium(nursery, tmp_path / "chromium")
    async with open_page(browser) as tab:
        await tab.navigate(f"{gw.control_url}/ui")
        title = await chart_title(tab, "1 asleep")
        assert title.startswith(f"{MODEL}: 0 ready, 0 starting, 1 asleep, 0 draining; "), title
        assert "arriving/s" in title, title
        await every_layer_drawn(tab)
        # the violet layer stands above the axis at the end: its last point's height is the whole scale
        top = await tab.evaluate(POINTS.format("sleeping") + ".trim().split(' ').slice(-2)[0].split(',')[1]")
        axis = await tab.evaluate("document.querySelector('#capacity svg line').getAttribute('y1')")
        assert float(top) < float(axis), (top, axis)
        marks = await tab.evaluate("[...document.querySelectorAll('#capacity svg .decision title')]"
                                   ".map((t) => t.textContent)")
        assert any(m.startswith("from_zero 0 → 1: ") for m in marks) and \
            any(m.startswith("to_zero 1 → 0: ") for m in marks), marks
        assert "to_zero 1 → 0: " in await tab.evaluate(LAST_DECISION)

        await call(gw)  # called again: the step up wakes the sleeping replica (a hot start); marked on the chart
        # (idle 1 s later it goes back to sleep, so the newest decision may already be the next to_zero)
        woke = await tab.wait_for("the woken replica's mark", "[...document.querySelectorAll('#capacity svg "
                                  ".decision title')].map((t) => t.textContent).find((m) => m.includes('woke'))")
        assert woke.startswith("from_zero 0 → 1: ") and woke.endswith("; woke 1 sleeping replica (a hot start)"), woke
        assert tab.errors == []
