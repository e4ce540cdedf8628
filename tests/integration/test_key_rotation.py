"""Rotating client API keys on a running ``llmgw serve``: a reload (``POST /admin/reload``, SIGHUP) applies the new
``api_keys`` at once, with no restart, and names in ``restart_required`` what it cannot apply, on that reload and
every later one until a restart."""

from __future__ import annotations

import signal

import httpx

from helpers import wait_for
from llmgw.testing.metrics import scrape_value

OLD, NEW = "sk-old-key-0001", "sk-new-key-0002"


async def line_with(child, *parts: str) -> bool:
    """Whether a line of ``child``'s output holds every one of ``parts``."""
    return any(all(part in line for part in parts) for line in child.lines)


async def test_a_reload_rotates_the_api_keys_live_and_names_what_waits_for_a_restart(start_fake_upstream,
                                                                                     start_llmgw, tmp_path):
    upstream = await start_fake_upstream("a")
    path = tmp_path / "rotate.yaml"
    models = f"models:\n  - name: tiny\n    replicas:\n      - url: {upstream.url}\n"
    path.write_text(models + f"api_keys:\n  - key: {OLD}\n    name: web\n")
    gw = await start_llmgw(None, "--config", str(path))
    async with httpx.AsyncClient(timeout=10) as http:

        async def status_with(key: str) -> int:
            answer = await http.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                     json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            return answer.status_code

        async def reload() -> dict:
            answer = await http.post(gw.control_url + "/admin/reload")
            assert answer.status_code == 200, answer.text
            return answer.json()

        assert (await status_with(OLD), await status_with(NEW)) == (200, 401)
        pid = gw.pid

        # The new key replaces the old one; limits.max_connections is read when the listener starts.
        path.write_text(models + f"api_keys:\n  - key: {NEW}\n    name: web\nlimits:\n  max_connections: 500\n")
        answer = await reload()
        assert answer["reloaded"] is True and answer["restart_required"] == ["limits.max_connections"]
        assert (await status_with(OLD), await status_with(NEW)) == (401, 200)
        assert gw.pid == pid and gw.returncode is None  # no restart

        # A later reload (SIGHUP) that changes something else still says it: the listener has the old limit.
        path.write_text(models + f"api_keys:\n  - key: {NEW}\n    name: web\nlimits:\n  max_connections: 500\n"
                        "access_log: true\n")
        gw.kill(signal.SIGHUP)
        await wait_for(lambda: line_with(gw, "limits.max_connections changed since this process started",
                                         "takes a restart"))
        assert (await reload())["restart_required"] == ["limits.max_connections"]
        assert await scrape_value(gw.control_url, "llmgw_config_restart_required") == 1
        assert await status_with(NEW) == 200  # access_log applied live: this request has its line
        await wait_for(lambda: line_with(gw, "llmgw.access", " key=web "))

        # Back to the started value: nothing waits for a restart any more.
        path.write_text(models + f"api_keys:\n  - key: {NEW}\n    name: web\n")
        assert (await reload())["restart_required"] == []
        assert (await status_with(OLD), await status_with(NEW)) == (401, 200)
        assert await scrape_value(gw.control_url, "llmgw_config_restart_required") == 0
