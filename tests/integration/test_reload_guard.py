"""A reload of a real ``llmgw serve`` with simulator engines is all or nothing and never weakens auth: an empty,
unparsable or everything-removing file, or one without ``admin_tokens``, changes nothing (the engines keep their
pids, ``/v1/models`` every model, ``/admin`` its token) until confirmed, and confirming never opens ``/admin``."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import trio

from llmgw.testing.cluster import all_up, embedded, shard_pids
from llmgw.testing.processes import llmgw_command

ADMIN = "adm-reload-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
TOKENS = f"admin_tokens:\n  - token: {ADMIN}\n    name: ops\n"
MODELS = ("tiny", "other")
SIM = ("profiles:\n" + "".join(f"  - name: {m}-sim\n    engine: sim\n    model_path: {m}\n    served_model_name: {m}\n"
                               for m in MODELS)
       + "deployments:\n" + "".join(f"  - profile: {m}-sim\n    replicas: 1\n" for m in MODELS))
CHAT_OTHER = {"model": "other", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def refused(cluster, status: int, code: str, query: str = "") -> dict:
    """``POST /admin/reload`` answered with an OpenAI error ``status``/``code`` and ``reloaded: false``."""
    answer = await cluster.http.post(cluster.control_url + "/admin/reload" + query)
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error"
    assert body["reloaded"] is False and body["errors"] and body["error"]["message"] == "; ".join(body["errors"])
    return body


async def assert_unchanged(cluster, before: dict[str, dict]) -> None:
    """The same replicas on the same engines and generations, every model served, /admin still behind the token."""
    after = await cluster.replicas()
    assert all_up(2)(after) and shard_pids(after) == shard_pids(before)
    assert {n: r["generation"] for n, r in after.items()} == {n: r["generation"] for n, r in before.items()}
    models = (await cluster.http.get(cluster.data_url + "/v1/models")).json()["data"]
    assert sorted(m["id"] for m in models) == sorted(MODELS)
    async with httpx.AsyncClient(timeout=10) as anonymous:
        assert (await anonymous.get(cluster.control_url + "/admin/nodes")).status_code == 401
    assert {await cluster.chat(), await cluster.chat(CHAT_OTHER)} == {"tiny-sim-0", "other-sim-0"}


async def test_a_reload_that_would_empty_the_cluster_or_open_admin_changes_nothing(cluster):
    cluster.http.headers.update(AUTH)
    base = TOKENS + embedded(cluster.tmp_path / "local")
    cluster.write_config(base + SIM)
    serve = await cluster.start_serve()
    before = await cluster.settled(2)
    path = cluster.config_path

    # The reload: the file truncated to nothing.
    path.write_text("")
    body = await refused(cluster, 409, "empty_file")
    assert str(path) in body["error"]["message"] and "allow_empty=true" in body["error"]["message"]
    await assert_unchanged(cluster, before)

    # SIGHUP reads the same empty file: refused, logged, nothing else.
    serve.kill(signal.SIGHUP)
    await cluster.wait_for("the SIGHUP reload's refusal in the log", lambda: trio.to_thread.run_sync(
        lambda: any("refused; keeping the running config" in line and "no YAML document" in line
                    for line in serve.lines)))
    await assert_unchanged(cluster, before)

    # Unparsable (cut in the middle of a key): 422, each error at its file and line.
    path.write_text(f"listen: {cluster.data_url[7:]}\ncontrol_listen: {cluster.control_url[7:]}\n{TOKENS}models:\n"
                    "  - name: ext\n    repl")
    body = await refused(cluster, 422, "invalid")
    assert body["errors"][0].startswith(f"{path}:8:") and body["summary"] is None
    await assert_unchanged(cluster, before)

    # A file without admin_tokens: refused, confirmed or not; the old token still works, and is still needed.
    cluster.write_config(embedded(cluster.tmp_path / "local") + SIM)
    for query in ("", "?allow_empty=true"):
        body = await refused(cluster, 409, "removes_admin_tokens", query)
        assert body["summary"]["admin_tokens"] == {"before": 1, "after": 0}
    await assert_unchanged(cluster, before)

    # A file cut before its profiles: every deployment would go. Refused, with what it would change...
    cluster.write_config(base)
    body = await refused(cluster, 409, "removes_everything")
    assert body["summary"]["deployments"] == {"added": [], "removed": ["tiny-sim", "other-sim"], "changed": []}
    await assert_unchanged(cluster, before)
    reloads = 'outcome="%s"'
    for outcome, count in (("empty_file", 2), ("invalid", 1), ("removes_admin_tokens", 2),
                           ("removes_everything", 1), ("applied", 0)):
        assert await cluster.metric("llmgw_config_reloads_total", reloads % outcome) == count, outcome

    # ...until confirmed (here with the CLI): then applied, and /admin still needs the token.
    result = await trio.run_process(
        llmgw_command("reload", "--control", cluster.control_url, "--allow-empty"), capture_stdout=True,
        capture_stderr=True, check=False, env={**os.environ, "LLMGW_ADMIN_TOKEN": ADMIN})
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().startswith("reloaded: models: added -; removed -; changed -; deployments: added -; "
                                             "removed tiny-sim, other-sim; changed -")
    assert (await cluster.http.get(cluster.data_url + "/v1/models")).json()["data"] == []
    async with httpx.AsyncClient(timeout=10) as anonymous:
        assert (await anonymous.get(cluster.control_url + "/admin/nodes")).status_code == 401
    assert await cluster.metric("llmgw_config_reloads_total", reloads % "applied") == 1


async def test_the_cli_reports_a_refused_reload(cluster):
    cluster.http.headers.update(AUTH)
    cluster.write_config(TOKENS + "models: []\n")
    await cluster.start_serve()
    cluster.config_path.write_text("# being written\n")
    result = await trio.run_process(
        llmgw_command("reload", "--control", cluster.control_url), capture_stdout=True, capture_stderr=True,
        check=False, env={**os.environ, "LLMGW_ADMIN_TOKEN": ADMIN})
    assert result.returncode == 1
    assert "llmgw reload: not applied (the running config is kept): POST " in result.stderr.decode()
    assert "409 " in result.stderr.decode() and "no YAML document" in result.stderr.decode()
    async with httpx.AsyncClient(timeout=10) as anonymous:
        assert (await anonymous.get(cluster.control_url + "/admin/nodes")).status_code == 401


async def test_a_reload_never_opens_v1_and_its_summary_counts_api_keys(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a")
    keys = ("sk-reload-one-0123456789", "sk-reload-two-0123456789", "sk-reload-three-0123456789")

    def text(*held: str) -> str:
        listed = "".join(f"  - key: {key}\n" for key in held)
        return (f"models:\n  - name: tiny\n    replicas: [{{url: {upstream.url}}}]\nlog_level: warning\n"
                + (f"api_keys:\n{listed}" if held else ""))

    gw = await start_llmgw(text(keys[0], keys[1]))
    path = Path(gw.argv[gw.argv.index("--config") + 1])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=30) as http:
        async def status_with(key: str | None) -> int:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return (await http.post(gw.url + "/v1/chat/completions", json=chat, headers=headers)).status_code

        path.write_text(text())  # api_keys gone: refused, confirmed or not
        for query in ("", "?allow_empty=true"):
            answer = await http.post(gw.control_url + "/admin/reload" + query)
            assert answer.status_code == 409, answer.text
            body = answer.json()
            assert body["error"]["code"] == "removes_api_keys" and body["reloaded"] is False
            assert "api_keys is empty while the running config has 2" in body["error"]["message"]
            assert body["summary"]["api_keys"] == {"added": 0, "removed": 2, "kept": 0}
            assert not any(key in answer.text for key in keys)
        assert (await status_with(None), await status_with(keys[0])) == (401, 200)

        path.write_text(text(keys[1], keys[2]))  # one key replaced by another: applied, and counted
        answer = await http.post(gw.control_url + "/admin/reload")
        assert answer.status_code == 200, answer.text
        summary = answer.json()["summary"]
        assert summary["api_keys"] == {"added": 1, "removed": 1, "kept": 1}
        assert summary["description"].endswith("API keys: added 1, removed 1, kept 1")
        assert not any(key in answer.text for key in keys)
        assert (await status_with(keys[0]), await status_with(keys[2]), await status_with(None)) == (401, 200, 401)
