"""API keys and teams of a real ``llmgw serve``: from the config and from ``/admin/keys``, ``/admin/teams`` and the
``llmgw keys``/``llmgw teams`` CLI; 401 without a valid key, 403 for a model the key may not use, ``/v1/models``
filtered; with ``state.backend: local`` they survive a restart (SQLite), with Redis every gateway follows them,
and a record not signed with the cluster secret is never admitted."""

from __future__ import annotations

import hashlib
import json
import os

import coredis
import httpx
import pytest
import trio

from helpers import assert_openai_error, wait_for
from llmgw.cluster import records
from llmgw.cluster.records import Keys
from llmgw.testing.metrics import scrape_value
from llmgw.testing.processes import llmgw_command
from llmgw.testing.shared_state import state_section

pytestmark = pytest.mark.slow

CONFIG_KEY = "sk-config-key-000001"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def gateway_config(tiny_url: str, other_url: str, extra: str = "") -> str:
    return (f"models:\n  - name: tiny\n    replicas: [{{url: '{tiny_url}'}}]\n"
            f"  - name: other\n    replicas: [{{url: '{other_url}'}}]\n"
            f"api_keys:\n  - {{key: {CONFIG_KEY}, name: ops, team: search, models: [tiny]}}\n"
            "teams:\n  - {name: search, limits: {rpm: 1000}}\n" + extra)


async def chat(http: httpx.AsyncClient, url: str, key: str, model: str = "tiny") -> httpx.Response:
    return await http.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": model, **CHAT})


async def models_of(http: httpx.AsyncClient, url: str, key: str) -> list[str]:
    answer = await http.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return [card["id"] for card in answer.json()["data"]]


async def cli(*argv: str) -> tuple[int, str, str]:
    result = await trio.run_process(llmgw_command(*argv), capture_stdout=True, capture_stderr=True, check=False,
                                    env=dict(os.environ))
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_keys_made_by_the_admin_api_and_the_cli_are_used_limited_to_their_models_and_revoked(
        start_fake_upstream, start_llmgw, tmp_path):
    tiny, other = await start_fake_upstream("tiny"), await start_fake_upstream("other", model="other")
    store = tmp_path / "state" / "keys.sqlite3"
    config = gateway_config(tiny.url, other.url, f"tenancy: {{store: '{store}'}}\naccess_log: true\n")
    gw = await start_llmgw(config)
    async with httpx.AsyncClient(timeout=10) as http:
        admin = gw.control_url + "/admin"
        # The config's key: its own model list narrows its team's (every model).
        assert (await chat(http, gw.url, CONFIG_KEY)).status_code == 200
        refused = await chat(http, gw.url, CONFIG_KEY, "other")
        error = assert_openai_error(refused, 403, "model_not_allowed")
        assert error["param"] == "model" and "'ops'" in error["message"]
        assert await models_of(http, gw.url, CONFIG_KEY) == ["tiny"]
        assert_openai_error(await http.get(gw.url + "/v1/models/other",
                                           headers={"Authorization": f"Bearer {CONFIG_KEY}"}), 403,
                            "model_not_allowed")
        assert_openai_error(await chat(http, gw.url, "sk-nobody"), 401, "invalid_api_key")
        await wait_for(lambda: line_with(gw, "llmgw.access", " key=ops team=search model=other ", " status=403 "))

        # A team and a key of it, through the API; the key is answered once, never listed.
        made = await http.post(admin + "/teams", json={"name": "batch", "models": ["other"], "priority": "batch",
                                                       "limits": {"tpm": 50000}})
        assert made.status_code == 201, made.text
        created = await http.post(admin + "/keys", json={"name": "nightly", "team": "batch",
                                                         "limits": {"rpm": 100, "concurrency": 4},
                                                         "budgets": [{"period": "month", "usd": 12.5}]})
        assert created.status_code == 201, created.text
        new = created.json()
        secret = new["key"]
        assert secret.startswith("sk-llmgw-") and len(secret) >= 9 + 43
        assert new["id"].startswith("k-") and new["source"] == "api" and new["team"] == "batch"
        assert new["limits"] == {"rpm": 100, "tpm": None, "concurrency": 4}
        assert new["budgets"] == [{"period": "month", "tokens": None, "usd": 12.5}]
        assert (await chat(http, gw.url, secret, "other")).status_code == 200
        assert_openai_error(await chat(http, gw.url, secret, "tiny"), 403, "model_not_allowed")  # its team's list
        assert await models_of(http, gw.url, secret) == ["other"]
        listed = (await http.get(admin + "/keys")).json()["keys"]
        assert [(k["name"], k["source"]) for k in listed] == [("ops", "config"), ("nightly", "api")]
        assert secret not in json.dumps(listed) and hashlib.sha256(secret.encode()).hexdigest() not in \
            json.dumps(listed)
        assert not store.read_bytes().count(secret.encode())  # the store keeps its SHA-256 only

        # Wrong settings are refused with the config's own messages; the config's keys and teams are not the API's.
        bad = await http.post(admin + "/keys", json={"name": "x", "limits": {"rpm": 0}, "team": "nope"})
        assert "limits.rpm: must be at least 1" in assert_openai_error(bad, 400, "invalid_settings")["message"]
        assert_openai_error(await http.post(admin + "/keys", json={"name": "x", "team": "nope"}), 404,
                            "team_not_found")
        assert_openai_error(await http.post(admin + "/keys", json={"name": "ops"}), 409, "key_name_taken")
        assert_openai_error(await http.post(admin + "/keys", json=["not", "an", "object"]), 400, "invalid_json")
        assert_openai_error(await http.patch(admin + "/keys/cfg-ops", json={"limits": {"rpm": 1}}), 409,
                            "defined_in_config")
        assert_openai_error(await http.delete(admin + "/teams/search"), 409, "defined_in_config")
        assert_openai_error(await http.delete(admin + "/teams/batch"), 409, "team_has_keys")

        # Update: out of the team, onto tiny; a limit cleared with null, the others kept.
        patched = await http.patch(admin + "/keys/nightly", json={"team": None, "models": ["tiny"],
                                                                   "limits": {"rpm": None}})
        assert patched.status_code == 200, patched.text
        assert patched.json()["limits"] == {"rpm": None, "tpm": None, "concurrency": 4}
        assert (await chat(http, gw.url, secret, "tiny")).status_code == 200
        assert_openai_error(await chat(http, gw.url, secret, "other"), 403, "model_not_allowed")

        # The CLI: create, list, revoke.
        code, out, err = await cli("keys", "--control", gw.control_url, "create", "cli-app", "--team", "batch",
                                   "--rpm", "60", "--budget", "day:tokens=1000,usd=2")
        assert code == 0, err
        cli_key = out.strip().splitlines()[-1]
        assert cli_key.startswith("sk-llmgw-")
        assert (await chat(http, gw.url, cli_key, "other")).status_code == 200
        code, out, err = await cli("keys", "--control", gw.control_url, "list")
        assert code == 0 and "cli-app" in out and "rpm=60" in out and "day:$2+1000 tokens" in out, out + err
        assert cli_key not in out
        code, out, err = await cli("teams", "--control", gw.control_url, "list")
        assert code == 0 and "batch" in out and "search" in out, out + err

        assert await scrape_value(gw.control_url, "llmgw_tenant_keys", 'source="api"') == 2
        assert await scrape_value(gw.control_url, "llmgw_tenant_keys", 'source="config"') == 1

    # A restart keeps the keys: the SQLite file in the state dir.
    await gw.stop()
    gw = await start_llmgw(config)
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await chat(http, gw.url, secret, "tiny")).status_code == 200
        assert (await chat(http, gw.url, cli_key, "other")).status_code == 200
        code, out, err = await cli("keys", "--control", gw.control_url, "revoke", "cli-app")
        assert code == 0 and "revoked key k-" in out, out + err
        assert_openai_error(await chat(http, gw.url, cli_key, "other"), 401, "invalid_api_key")
        revoked = await http.delete(gw.control_url + "/admin/keys/nightly")
        assert revoked.status_code == 200 and revoked.json()["revoked"] is True
        assert_openai_error(await chat(http, gw.url, secret, "tiny"), 401, "invalid_api_key")
        assert_openai_error(await http.delete(gw.control_url + "/admin/keys/nightly"), 404, "key_not_found")
        assert (await http.delete(gw.control_url + "/admin/teams/batch")).status_code == 200
        await wait_for(lambda: line_with(gw, "API key revoked: name=nightly id=k-", "team=-"))
        assert not any(secret in line or cli_key in line for line in gw.lines)  # never logged


async def line_with(child, *parts: str) -> bool:
    return any(all(part in line for part in parts) for line in child.lines)


async def test_keys_made_on_one_gateway_are_used_and_revoked_on_another_through_redis(
        start_fake_upstream, start_llmgw, redis_url, cluster_name):
    tiny, other = await start_fake_upstream("tiny"), await start_fake_upstream("other", model="other")
    config = gateway_config(tiny.url, other.url, state_section(redis_url, cluster_name))
    control = await start_llmgw(config)
    follower = await start_llmgw(config, "--role", "gateway")
    async with httpx.AsyncClient(timeout=10) as http:
        await wait_for(lambda: models_listed(http, follower.url, ["other", "tiny"]))
        made = await http.post(follower.control_url + "/admin/keys", json={"name": "shared", "models": ["tiny"]})
        assert made.status_code == 201, made.text
        secret = made.json()["key"]
        # In force on the other gateway within a second (each asks the store's version every 0.25 s).
        started = trio.current_time()
        await wait_for(lambda: answers(http, control.url, secret, 200), timeout=3)
        took = trio.current_time() - started
        assert_openai_error(await chat(http, control.url, secret, "other"), 403, "model_not_allowed")
        listed = (await http.get(control.control_url + "/admin/keys")).json()["keys"]
        assert [k["name"] for k in listed if k["source"] == "api"] == ["shared"]
        # Revoked on the control process: refused on the follower from its next copy on.
        assert (await http.delete(control.control_url + "/admin/keys/shared")).status_code == 200
        assert_openai_error(await chat(http, control.url, secret), 401, "invalid_api_key")  # at once where revoked
        await wait_for(lambda: answers(http, follower.url, secret, 401), timeout=3)
        print(f"a new key was in force on the other gateway after {took:.3f} s")


async def test_two_gateways_given_one_new_key_or_team_name_at_once_make_one(start_fake_upstream, start_llmgw,
                                                                             redis_url, cluster_name):
    tiny, other = await start_fake_upstream("tiny"), await start_fake_upstream("other", model="other")
    config = gateway_config(tiny.url, other.url, state_section(redis_url, cluster_name))
    gateways = [await start_llmgw(config), await start_llmgw(config, "--role", "gateway")]
    async with httpx.AsyncClient(timeout=10) as http:
        rounds = [("/admin/keys", {"name": f"twin-{n}"}, "key_name_taken") for n in range(5)] + \
            [("/admin/teams", {"name": f"twins-{n}"}, "team_exists") for n in range(5)]
        for path, body, refused in rounds:  # a few rounds: each is a race the gateways' checks alone may lose
            answers: list[httpx.Response] = []

            async def create(url: str) -> None:
                answers.append(await http.post(url + path, json=body))

            async with trio.open_nursery() as at_once:
                for i in range(8):
                    at_once.start_soon(create, gateways[i % 2].control_url)
            assert sorted(answer.status_code for answer in answers) == [201] + [409] * 7, [a.text for a in answers]
            for answer in answers:
                if answer.status_code == 409:
                    assert_openai_error(answer, 409, refused)
            listed = (await http.get(gateways[1].control_url + path)).json()
            names = [entry["name"] for entry in listed["keys" if path == "/admin/keys" else "teams"]]
            assert names.count(body["name"]) == 1


async def models_listed(http: httpx.AsyncClient, url: str, names: list[str]) -> bool:
    return sorted(await models_of(http, url, CONFIG_KEY)) == ["tiny"] and \
        (await chat(http, url, CONFIG_KEY)).status_code == 200


async def answers(http: httpx.AsyncClient, url: str, key: str, status: int) -> bool:
    return (await chat(http, url, key)).status_code == status


async def test_a_key_record_not_signed_with_the_cluster_secret_is_refused_and_counted(
        start_fake_upstream, start_llmgw, redis_url, cluster_name):
    tiny, other = await start_fake_upstream("tiny"), await start_fake_upstream("other", model="other")
    gw = await start_llmgw(gateway_config(tiny.url, other.url, state_section(redis_url, cluster_name)))
    prefix = Keys(cluster_name).prefix + "tenancy:"
    forged_key = "sk-llmgw-forged-by-a-redis-writer"
    body = json.dumps({"id": "k-00000000000000aa", "sha256": hashlib.sha256(forged_key.encode()).hexdigest(),
                       "team": None, "name": "intruder", "models": None, "priority": None,
                       "limits": {"rpm": None, "tpm": None, "concurrency": None, "budgets": []},
                       "created": 0}).encode()
    client = coredis.Redis.from_url(redis_url)
    async with client:
        await client.hset(prefix + "keys", {
            "k-00000000000000aa": records.pack([body, b"\x00" * 32]),  # a wrong signature
            "k-00000000000000bb": body,  # no signature at all
            "k-00000000000000cc": b"x" * (300 * 1024),  # larger than any record the admin API writes
            "k-" + "0" * 100: body})  # a field longer than any key id
        await client.set(prefix + "version", "v" * 100_000)  # read as at most 32 bytes
    async with httpx.AsyncClient(timeout=10) as http:
        await wait_for(lambda: refused_at_least(gw.control_url, 4))
        assert_openai_error(await chat(http, gw.url, forged_key), 401, "invalid_api_key")
        assert (await chat(http, gw.url, CONFIG_KEY)).status_code == 200  # the rest is in force
        made = await http.post(gw.control_url + "/admin/keys", json={"name": "real"})
        assert made.status_code == 201
        assert (await chat(http, gw.url, made.json()["key"])).status_code == 200
        assert [k["name"] for k in (await http.get(gw.control_url + "/admin/keys")).json()["keys"]] == \
            ["ops", "real"]
    await wait_for(lambda: line_with(gw, "refused (not signed with the cluster secret"))


async def test_a_revoked_key_put_back_by_a_redis_writer_stays_revoked(start_fake_upstream, start_llmgw, redis_url,
                                                                       cluster_name):
    tiny, other = await start_fake_upstream("tiny"), await start_fake_upstream("other", model="other")
    config = gateway_config(tiny.url, other.url, state_section(redis_url, cluster_name))
    gw = await start_llmgw(config)
    prefix = Keys(cluster_name).prefix + "tenancy:"
    client = coredis.Redis.from_url(redis_url)
    async with client, httpx.AsyncClient(timeout=10) as http:
        made = (await http.post(gw.control_url + "/admin/keys", json={"name": "leaver"})).json()
        assert (await chat(http, gw.url, made["key"])).status_code == 200
        signed = await client.hget(prefix + "keys", made["id"])
        assert (await http.delete(gw.control_url + "/admin/keys/leaver")).status_code == 200
        await client.hset(prefix + "keys", {made["id"]: signed})  # the old signed record, put back
        await client.incr(prefix + "version")
        await wait_for(lambda: refused_at_least(gw.control_url, 1, "replayed_key"))
        assert_openai_error(await chat(http, gw.url, made["key"]), 401, "invalid_api_key")
        late = await start_llmgw(config, "--role", "gateway")  # started after: refuses it from the tombstone
        await wait_for(lambda: refused_at_least(late.control_url, 1, "replayed_key"))
        assert_openai_error(await chat(http, late.url, made["key"]), 401, "invalid_api_key")
    await wait_for(lambda: line_with(gw, "replayed: older than the revocation"))


async def refused_at_least(control_url: str, count: int, kind: str = "key") -> bool:
    return (await scrape_value(control_url, "llmgw_tenant_refused_records_total", f'kind="{kind}"') or 0) >= count


async def test_a_key_made_on_the_control_port_of_llmgw_serve_workers_reaches_every_worker(
        start_fake_upstream, start_llmgw, tmp_path):
    tiny, other = await start_fake_upstream("tiny"), await start_fake_upstream("other", model="other")
    config = gateway_config(tiny.url, other.url, f"tenancy: {{store: '{tmp_path / 'keys.sqlite3'}'}}\n")
    supervisor = await start_llmgw(config, "--workers", "2", "--state-dir", str(tmp_path / "w"))
    workers = [line.split(": control ")[-1].strip() for line in supervisor.lines
               if line.startswith("llmgw worker ") and ": control " in line]
    assert len(workers) == 2, supervisor.output()
    # New connections for every request: SO_REUSEPORT spreads connections over the workers.
    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        made = await http.post(supervisor.control_url + "/admin/keys", json={"name": "everywhere"})
        assert made.status_code == 201, made.text
        secret = made.json()["key"]
        for control_url in workers:  # each worker's own directory has it within a second
            await wait_for(lambda: listed(http, control_url, "everywhere"), timeout=3)
        for _ in range(20):
            assert (await chat(http, supervisor.url, secret)).status_code == 200
        # Keys the admin API makes share one label ("api"): their number is the store's, not the config file's.
        served = [await scrape_value(url, "llmgw_requests_by_key_total", 'key="api",code="200"', default=0)
                  for url in workers]
        assert sum(served) == 20 and min(served) >= 1, served
        assert (await http.delete(supervisor.control_url + "/admin/keys/everywhere")).status_code == 200
        for control_url in workers:
            await wait_for(lambda: listed(http, control_url, "everywhere", present=False), timeout=3)
        for _ in range(10):
            assert_openai_error(await chat(http, supervisor.url, secret), 401, "invalid_api_key")


async def listed(http: httpx.AsyncClient, control_url: str, name: str, present: bool = True) -> bool:
    names = [k["name"] for k in (await http.get(control_url + "/admin/keys")).json()["keys"]]
    return (name in names) == present
