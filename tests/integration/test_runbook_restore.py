"""The runbook's backup and restore of the tenancy store (docs/runbook.md, "Restore state from backups"), as an
operator runs it against a real ``llmgw serve`` with ``state.backend: local``: keys made with ``llmgw keys``, usage of
real requests, a copy of the live SQLite file taken with SQLite's online backup (the store is in WAL mode: a plain
``cp`` of the file alone may miss what the WAL holds), the store lost, the copy put back with the gateway stopped.

What the runbook says comes back is asserted: the keys and the usage of the copy, and the usage recorded since from
the usage journal left beside the store; a key made after the copy is gone (refused), and a key revoked after it is
valid again (the runbook says to revoke it again).
"""

from __future__ import annotations

import os
import shutil
import sys

import httpx
import pytest
import trio

from helpers import wait_for
from llmgw.testing.processes import llmgw_command

pytestmark = pytest.mark.slow

# The runbook's command, with this interpreter for `python3` (the one llmgw runs on: it has the sqlite3 module).
BACKUP = "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))"


async def run(*argv: str) -> str:
    result = await trio.run_process(list(argv), capture_stdout=True, capture_stderr=True, check=False,
                                    env=dict(os.environ))
    assert result.returncode == 0, (argv, result.stdout.decode(), result.stderr.decode())
    return result.stdout.decode()


async def make_key(control_url: str, name: str) -> str:
    return (await run(*llmgw_command("keys", "--control", control_url, "create", name))).strip().splitlines()[-1]


async def chat(http: httpx.AsyncClient, url: str, key: str) -> int:
    answer = await http.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    return answer.status_code


async def requests_of(http: httpx.AsyncClient, control_url: str, key_name: str) -> int:
    """The requests the usage store holds for ``key_name`` (``GET /admin/usage``)."""
    answer = await http.get(control_url + "/admin/usage", params={"group_by": "key"})
    assert answer.status_code == 200, answer.text
    return {item["key_name"]: item["requests"] for item in answer.json()["data"]}.get(key_name, 0)


async def wait_requests(http: httpx.AsyncClient, control_url: str, key_name: str, count: int) -> None:
    """Until the usage store holds ``count`` requests of ``key_name`` (flushed every 50 ms)."""
    async def counted() -> bool:
        return await requests_of(http, control_url, key_name) == count

    await wait_for(counted)


async def test_a_backup_of_the_live_tenancy_store_restores_its_keys_and_usage(start_fake_upstream, start_llmgw,
                                                                             tmp_path):
    upstream = await start_fake_upstream("tiny")
    store = tmp_path / "state" / "tenancy.sqlite3"
    backup = tmp_path / "backups" / "tenancy.sqlite3"
    backup.parent.mkdir()
    config = (f"models:\n  - name: tiny\n    replicas: [{{url: '{upstream.url}'}}]\n"
              f"tenancy: {{store: '{store}', usage_flush_interval: 50ms}}\n")
    gw = await start_llmgw(config)
    async with httpx.AsyncClient(timeout=10) as http:
        kept, revoked = await make_key(gw.control_url, "kept"), await make_key(gw.control_url, "revoked-later")
        assert [await chat(http, gw.url, kept) for _ in range(3)] == [200] * 3
        await wait_requests(http, gw.control_url, "kept", 3)
        # The backup, while the gateway runs and writes.
        await run(sys.executable, "-c", BACKUP, str(store), str(backup))
        assert await chat(http, gw.url, kept) == 200  # usage after the copy: not in it
        made_later = await make_key(gw.control_url, "made-later")
        await run(*llmgw_command("keys", "--control", gw.control_url, "revoke", "revoked-later"))
        await wait_requests(http, gw.control_url, "kept", 4)

    # The store is lost (its WAL and shared-memory files too); the copy goes back with the gateway stopped. The
    # usage journal's folder beside it stays.
    await gw.stop()
    for path in store.parent.glob(store.name + "*"):
        if path.is_file():
            path.unlink()
    assert list((store.parent / (store.name + ".usage-journal")).glob("*.usage"))
    shutil.copy2(backup, store)
    os.chmod(store, 0o600)
    gw = await start_llmgw(config)
    async with httpx.AsyncClient(timeout=10) as http:
        # The copy's 3 requests, and the one after the copy from the usage journal kept beside the store: the
        # restored store's marker for its segment is the copy's, so the start ships the rest of the segment.
        assert await requests_of(http, gw.control_url, "kept") == 4
        assert await chat(http, gw.url, kept) == 200
        assert await chat(http, gw.url, made_later) == 401, "a key made after the copy came back"
        assert await chat(http, gw.url, revoked) == 200, "the copy's keys are as they were in it"
        listed = await run(*llmgw_command("keys", "--control", gw.control_url, "list"))
        assert "kept" in listed and "revoked-later" in listed and "made-later" not in listed, listed
        await wait_requests(http, gw.control_url, "kept", 5)  # and the restored store takes usage again
        # What the runbook says to do next: revoke again what was revoked since the copy.
        await run(*llmgw_command("keys", "--control", gw.control_url, "revoke", "revoked-later"))
        assert await chat(http, gw.url, revoked) == 401
    assert oct(store.stat().st_mode & 0o777) == "0o600"
