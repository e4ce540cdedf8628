"""The status page (``GET /ui``) in a real headless Chromium against a real ``llmgw serve``.

The gateway runs an embedded agent with two simulators publishing KV events and the ``kv_index`` tier, behind an
admin token. With the token (given once in the URL's fragment) the page shows the replicas, their KV index, the
nodes and shards, and the routing decisions as they happen, with no console error and no Content-Security-Policy
violation; a value a client chose is shown as text, never run. Without the token it shows only the login prompt.
The JSON endpoints the page reads (``/admin/stats``, ``/admin/decisions``) agree with ``/metrics``. The demo (no
admin tokens) shows its status with no login at all.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from llmgw.testing.chromium import open_page, start_chromium
from llmgw.testing.cluster import embedded, text
from llmgw.testing.metrics import metric_value
from llmgw.testing.shared_state import cluster_config, wait_replicas
from llmgw.testing.sims import kv_sim_profile, start_sims

pytestmark = pytest.mark.slow

ADMIN = "adm-ui-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
HOSTILE_ID = "<img/src=x/onerror=window.pwned=1>"  # a client's x-request-id, shown in the decisions table
ROW_TEXTS = "[...document.querySelectorAll('#{0} tr')].map((row) => row.textContent)"


def config(tmp_path) -> str:
    return (embedded(tmp_path / "state") + f"admin_tokens:\n  - token: {ADMIN}\n    name: ops\n"
            + kv_sim_profile('"--num-blocks", "512", "--time-scale", "0"', replicas=2))


async def start_cluster(start_llmgw, engines, tmp_path) -> tuple[object, list[str]]:
    """The gateway with both replicas up and their KV index healthy; (child, replica names)."""
    gw = await start_llmgw(config(tmp_path), "--stop-engines")
    async with httpx.AsyncClient(timeout=10, headers=AUTH) as client:
        with trio.fail_after(90):
            while True:
                replicas = (await client.get(gw.control_url + "/admin/replicas")).json()
                engines.update(shard["pid"] for r in replicas for shard in r.get("shards", []))
                kv_index = (await client.get(gw.control_url + "/admin/kv")).json()["replicas"]
                kv = {r["name"]: r["state"] for r in kv_index}
                names = [r["name"] for r in replicas if r["state"] == "up" and kv.get(r["name"]) == "healthy"]
                if len(names) == 2:
                    return gw, sorted(names)
                await trio.sleep(0.3)


async def complete(gw, prompt: str, request_id: str | None = None) -> httpx.Response:
    """One completion of one token (so that its body's arrival is its first token's: it has a TTFT)."""
    headers = {"x-request-id": request_id} if request_id else {}
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(gw.url + "/v1/completions", headers=headers,
                                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return answer


async def test_the_status_page_shows_the_cluster_live_and_nothing_without_the_token(
        nursery, start_llmgw, engines, tmp_path):
    gw, names = await start_cluster(start_llmgw, engines, tmp_path)
    for seed in range(4):
        await complete(gw, text(seed, 400))
    await complete(gw, text(0, 400), request_id=HOSTILE_ID)  # a repeat: a KV hit, with a hostile request id

    async with httpx.AsyncClient(timeout=10) as client:
        page = await client.get(gw.control_url + "/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "connect-src 'self'" in policy and "default-src 'none'" in policy and "unsafe" not in policy
    assert "'sha256-" in policy.split("script-src")[1].split(";")[0]
    assert page.headers["cache-control"] == "no-store"

    browser = await start_chromium(nursery, tmp_path / "chromium")
    async with open_page(browser) as tab:
        await tab.navigate(f"{gw.control_url}/ui#token={ADMIN}")
        shown = await tab.wait_for("both replicas", f"(() => {{ const rows = {ROW_TEXTS.format('replicas')}; "
                                   f"return {names!r}.every((n) => rows.some((r) => r.startsWith(n))) && rows; }})()")
        assert all("healthy" in row for row in shown), shown  # each replica's KV index health
        await tab.wait_for("the node and its shards", f"{ROW_TEXTS.format('nodes')}.some((r) => r.startsWith('local'))"
                           f" && {ROW_TEXTS.format('shards')}.length === 2")
        node = await tab.evaluate(f"{ROW_TEXTS.format('nodes')}.find((r) => r.startsWith('local'))")
        assert node.startswith("localconnected since "), node  # its session, and since when
        cluster = await tab.evaluate(ROW_TEXTS.format("cluster"))
        assert cluster[0] == "healthok" and cluster[1].startswith("shared statenone"), cluster
        # The client's id is shown as text: no element made of it, nothing of it run.
        await tab.wait_for("the hostile request id as text",
                           f"{ROW_TEXTS.format('decisions')}.some((r) => r.includes({HOSTILE_ID!r}))")
        assert await tab.evaluate("document.querySelector('#data img') === null && window.pwned === undefined")
        # The token left the address bar; it is kept in this tab only.
        assert await tab.evaluate("location.href") == f"{gw.control_url}/ui"
        assert await tab.evaluate("sessionStorage.getItem('llmgw-admin-token')") == ADMIN
        # Live: a request made now appears without a reload.
        await complete(gw, text(9, 400), request_id="after-the-page-loaded")
        await tab.wait_for("the new decision", f"{ROW_TEXTS.format('decisions')}.some((r) => "
                           "r.includes('after-the-page-loaded'))")
        hit = await tab.evaluate(f"{ROW_TEXTS.format('decisions')}.find((r) => r.includes({HOSTILE_ID!r}))")
        # the tier's explanation of its pick, in words
        assert "hit" in hit and "blocks matched" in hit and "predicted cached" in hit, hit
        assert tab.errors == []
        # The policy is enforced: an injected inline script does not run, and the violation is reported.
        await tab.evaluate("(() => { const s = document.createElement('script'); s.textContent = 'window.ran = 1'; "
                           "document.body.append(s); })()")
        with trio.fail_after(10):
            while not any("script-src" in error for error in tab.errors):
                await trio.sleep(0.1)
        assert await tab.evaluate("window.ran === undefined")

    async with open_page(browser) as tab:  # a new tab: no token in its sessionStorage
        await tab.navigate(f"{gw.control_url}/ui")
        await tab.wait_for("the login prompt", "!document.getElementById('login').hidden")
        await trio.sleep(2)  # a poll or more later: still nothing
        assert await tab.evaluate("document.getElementById('data').hidden")
        body = await tab.evaluate("document.body.innerText")
        assert not any(name in body for name in names) and "local" not in body, body
        assert await tab.evaluate("document.querySelectorAll('tbody tr').length") == 0
        # A wrong token is refused and forgotten; the right one shows the data.
        for token in ("wrong-token", ADMIN):
            await tab.evaluate(f"document.getElementById('token').value = {token!r}; "
                               "document.getElementById('login').requestSubmit()")
            if token != ADMIN:
                await tab.wait_for("the refusal", "document.getElementById('login-error').textContent")
                assert await tab.evaluate("sessionStorage.getItem('llmgw-admin-token')") is None
        await tab.wait_for("the replicas after login", f"{ROW_TEXTS.format('replicas')}.length === 2")


async def test_the_pages_endpoints_need_the_token_and_agree_with_the_metrics(nursery, start_llmgw, engines,
                                                                            tmp_path):
    gw, names = await start_cluster(start_llmgw, engines, tmp_path)
    served = {}
    for seed in (1, 2, 1, 3, 2):  # repeats hit the KV cache
        answer = await complete(gw, text(seed, 600), request_id=f"req-{seed}-{len(served)}")
        served[answer.headers["x-request-id"]] = answer.headers["x-llmgw-replica"]
    async with httpx.AsyncClient(timeout=10) as client:
        for path in ("/admin/stats", "/admin/decisions", "/admin/capacity"):
            assert (await client.get(gw.control_url + path)).status_code == 401
        stats = (await client.get(gw.control_url + "/admin/stats", headers=AUTH)).json()["replicas"]
        decisions = (await client.get(gw.control_url + "/admin/decisions", headers=AUTH)).json()
        metrics = (await client.get(gw.control_url + "/metrics")).text
    assert decisions["capacity"] == 100
    assert [(d["request_id"], d["replica"]) for d in decisions["decisions"]] == list(reversed(served.items()))
    assert all(d["tier"] == "kv_index" and d["status"] == 200 and d["latency_ms"] >= d["ttft_ms"] > 0
               and "block_keys" not in d["detail"] and "prompt_tokens" in d["detail"] for d in decisions["decisions"])
    assert sum(d["outcome"] == "hit" for d in decisions["decisions"]) >= 2
    assert sorted(s["replica"] for s in stats) == sorted(set(served.values()))
    for entry in stats:
        labels = f'model="tiny",replica="{entry["replica"]}"'
        prompt = metric_value(metrics, "llmgw_prompt_tokens_total", labels)
        cached = metric_value(metrics, "llmgw_cached_tokens_total", labels)
        assert (entry["prompt_tokens"], entry["cached_tokens"]) == (prompt, cached)
        assert entry["hit_rate"] == round(cached / prompt, 4)
        assert entry["requests"] == list(served.values()).count(entry["replica"])
        assert entry["ttft"]["count"] == metric_value(metrics, "llmgw_time_to_first_token_seconds_count", labels)
        assert 0 < entry["ttft"]["p50_ms"] <= entry["ttft"]["p90_ms"]
    assert sum(entry["cached_tokens"] for entry in stats) > 0


async def test_the_demo_without_admin_tokens_shows_its_status_with_no_login(nursery, start_llmgw, tmp_path):
    gw = await start_llmgw(None)  # the demo: an embedded agent, two simulators, kv_index, no admin tokens
    browser = await start_chromium(nursery, tmp_path / "chromium")
    async with open_page(browser) as tab:
        await tab.navigate(f"{gw.control_url}/ui")
        await tab.wait_for("both demo replicas up", f"{ROW_TEXTS.format('replicas')}"
                           ".filter((r) => r.includes('up')).length === 2", timeout=90)
        await complete(gw, text(1, 400))
        await tab.wait_for("the decision", f"{ROW_TEXTS.format('decisions')}.some((r) => r.includes('kv_index'))")
        # Overload control's queues: one row per model and class (nothing waiting), a row per replica's room.
        queues = await tab.wait_for("the queues", f"(() => {{ const r = {ROW_TEXTS.format('queues')}; "
                                    "return r.length === 4 && r; })()")
        assert [row.split("0 (0)")[0] for row in queues] == ["tinyinteractive", "tinystandard", "tinybatch",
                                                              "tinybest-effort"], queues
        await tab.wait_for("each replica's room", f"{ROW_TEXTS.format('saturation')}.length === 2")
        # Its deployment has a fixed count: no chart of replicas over time
        await tab.wait_for("no capacity chart", "document.getElementById('capacity').textContent === "
                                                "'no autoscaled deployment'")
        assert await tab.evaluate("document.querySelector('#capacity svg') === null")
        assert await tab.evaluate("document.getElementById('login').hidden")
        assert tab.errors == []


async def test_the_status_page_shows_the_leader_the_term_and_redis_and_why_it_is_degraded(
        nursery, start_llmgw, private_redis, cluster_name, tmp_path):
    """A candidate of a cluster (no admin tokens: loopback only), whose Redis goes away and comes back."""
    (sim,) = await start_sims(nursery, 1, num_blocks=256, block_size=16)
    gw = await start_llmgw(cluster_config([sim], private_redis.url, cluster_name, routing="round_robin"))
    await wait_replicas(gw.control_url, 1)
    browser = await start_chromium(nursery, tmp_path / "chromium")
    rows = ROW_TEXTS.format("cluster")
    async with open_page(browser) as tab:
        await tab.navigate(f"{gw.control_url}/ui")
        shown = await tab.wait_for("the leader, its term and Redis up", f"(() => {{ const r = {rows}; return "
                                   "r.some((t) => t.startsWith('leader') && t.endsWith('(this process)')) && "
                                   "r.some((t) => /^term[0-9]+$/.test(t)) && r.includes('healthok') && r; })()")
        redis = f"Redisredis://127.0.0.1:{private_redis.port}/0"
        assert f"{redis}: up" in shown and "rolecontrol, leading" in shown, shown
        await private_redis.kill()
        shown = await tab.wait_for("degraded, with the reason", f"(() => {{ const r = {rows}; return "
                                   "r.includes('healthdegraded') && r.some((t) => t.includes('is unreachable')) && "
                                   "r.some((t) => t.startsWith('leadernone known')) && r; })()", timeout=30)
        assert any(row.startswith(f"{redis}: unreachable (") for row in shown), shown
        assert any("Redis at" in row and "(since " in row for row in shown), shown
        await private_redis.restart()
        await tab.wait_for("ok again", f"{rows}.includes('healthok')", timeout=30)
        # While it leads no term (Redis away), /admin/nodes answers 404, which the page shows as no control plane
        # (the browser logs the 404); and the usage store, in that Redis, 503 when the page's tenants poll (every
        # 10 s) falls in that time, which the page shows as "usage unavailable". Nothing else went wrong.
        expected = (("404", "/admin/nodes"), ("503", "/admin/usage"))
        assert [error for error in tab.errors if not any(status in error and path in error
                                                         for status, path in expected)] == [], tab.errors


async def test_the_status_page_shows_tenants_usage_budgets_and_refusals(nursery, start_llmgw, start_fake_upstream,
                                                                       tmp_path):
    """Keys of a team with a daily budget and a key of no team with an rpm of 2: the teams, the top keys, the
    budget's spend and the 429s as the page shows them (no admin tokens: loopback only)."""
    upstream = await start_fake_upstream("a")
    keys = {"alice": "sk-alice-ui-000000001", "bob": "sk-bob-ui-00000000002", "eve": "sk-eve-ui-000000003"}
    gw = await start_llmgw(
        f"models:\n  - name: tiny\n    replicas:\n      - url: {upstream.url}\n"
        "teams:\n  - name: search\n    budgets:\n      - period: day\n        tokens: 1000\n        usd: 1\n"
        f"api_keys:\n  - key: {keys['alice']}\n    name: alice\n    team: search\n"
        f"  - key: {keys['bob']}\n    name: bob\n    limits:\n      rpm: 2\n"
        f"  - key: {keys['eve']}\n    name: eve.html\n    team: search\n"
        "prices:\n  - model: tiny\n    input: 1000\n    output: 2000\n")
    async with httpx.AsyncClient(timeout=10) as client:
        for name, count in (("alice", 3), ("bob", 3), ("eve", 1)):
            for _ in range(count):
                await client.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {keys[name]}"},
                                  json={"model": "tiny", "max_tokens": 5,
                                        "messages": [{"role": "user", "content": "hi"}]})
    browser = await start_chromium(nursery, tmp_path / "chromium")
    async with open_page(browser) as tab:
        await tab.navigate(f"{gw.control_url}/ui")
        teams = await tab.wait_for("the teams", f"(() => {{ const r = {ROW_TEXTS.format('tenant-teams')}; "
                                   "return r.some((t) => t.startsWith('searchstandard4')) && r; })()",
                                   timeout=30)
        # search: 4 answers of 5 + 3 tokens (20 in, 12 out) at $1000 and $2000 per million: $0.044; bob's third
        # request was a 429 of his rpm, refused before the queue gave it a class. One line per team and class: the
        # answers are in the default class, standard.
        assert "searchstandard42012$0.0440000" in teams and "(no team)standard2106$0.0220000" in teams, teams
        assert "(no team)(no class)000$0.0000100" in teams, teams
        keys_shown = await tab.evaluate(ROW_TEXTS.format("tenant-keys"))
        assert keys_shown[0].startswith("alicesearch3159$0.0330"), keys_shown  # the largest spender first
        assert any(row.startswith("eve.htmlsearch1") for row in keys_shown), keys_shown
        budgets = await tab.evaluate(ROW_TEXTS.format("tenant-budgets"))
        assert budgets == ["team searchday32 / 1000 (3.2 %)$0.0440 / $1.0000 (4.4 %)"], budgets
        assert tab.errors == []
