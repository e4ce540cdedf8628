"""The optional mypyc build of the data plane (``LLMGW_MYPYC=1``, llmgw/compiled.py) behaves as the pure-Python one.

A wheel built from a copy of the checkout with ``LLMGW_MYPYC=1`` carries every module of ``MYPYC_MODULES`` as
a C extension; an ``llmgw serve`` run from it and one run from the source answer the same requests (relayed,
streamed, broken off, refused, malformed, too large, unknown) with the same statuses, bodies and headers (but
the request ids and timings, which differ from run to run), and count them in the same metric series.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

import compiled_build
from llmgw.compiled import MYPYC_MODULES, module_name
from llmgw.testing.processes import SERVE_READY, Child, start_child, start_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the compiled build takes 1-8 minutes here

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
log_level: info
models:
  - name: tiny
    routing: round_robin
    replicas:
      - url: {a}
        name: up-a
      - url: {b}
        name: up-b
limits:
  max_body_bytes: 4096
"""
VARYING_HEADERS = {"x-request-id", "date", "x-served-by", "content-length"}  # x-served-by: a or b, by turn


@pytest.fixture(scope="module")
def compiled_tree(tmp_path_factory) -> Path:
    """The llmgw of a wheel built with ``LLMGW_MYPYC=1`` from the checkout's sources (the build leaves nothing in
    the checkout), unpacked; reused when ``./dev test`` already built it for these sources (tests/compiled_build.py)."""
    cache = compiled_build.cache_root(REPO) or tmp_path_factory.mktemp("compiled")
    tree, _ = compiled_build.compiled_tree(REPO, cache)
    return tree


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_compiled_wheel_carries_every_hot_module_as_an_extension(compiled_tree):
    probe = subprocess.run([sys.executable, "-c", "import json, llmgw.compiled as c; "
                            "print(json.dumps(c.compiled_modules()))"], cwd=compiled_tree, capture_output=True,
                           text=True, timeout=60, env={**_environ(), "PYTHONPATH": str(compiled_tree)})
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == [module_name(path) for path in MYPYC_MODULES]


def test_the_images_check_passes_for_the_compiled_build_only(compiled_tree, tmp_path):
    """``python -m llmgw.compiled --require`` (the Containerfile's build runs it on the wheel it installed) says
    which build runs and fails on a pure install, so an image cannot ship the pure data plane unnoticed."""
    n = len(MYPYC_MODULES)
    for path, code, line in ((compiled_tree, 0, f"data plane: {n} of {n} hot modules compiled with mypyc"),
                             (REPO, 1, f"data plane: pure Python (0 of {n} hot modules compiled")):
        check = subprocess.run([sys.executable, "-m", "llmgw.compiled", "--require"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=60,
                               env={**_environ(), "PYTHONPATH": str(path), "PYTHONSAFEPATH": "1"})
        assert (check.returncode, check.stdout.startswith(line)) == (code, True), (path, check.stdout, check.stderr)


async def test_dev_serve_runs_the_compiled_build_when_dev_test_built_it_and_says_which(
        compiled_tree, start_fake_upstream, nursery, tmp_path):
    """``./dev serve`` takes the tree ``./dev test`` built for these sources (the cache it finds through
    ``LLMGW_COMPILED_CACHE``, where the fixture's build is), and the pure source when there is none."""
    a, b = await start_fake_upstream("a"), await start_fake_upstream("b")
    config = tmp_path / "llmgw.yaml"
    config.write_text(CONFIG.format(a=a.url, b=b.url))
    n = len(MYPYC_MODULES)
    for cache, said, logged in (
            (compiled_tree.parent.parent, f"./dev serve: the compiled data plane ({compiled_tree}, built by ./dev test",
             f"data plane: {n} of {n} hot modules compiled with mypyc"),
            (tmp_path / "no-build", "./dev serve: the pure-Python data plane (no compiled build for these sources",
             f"data plane: pure Python (0 of {n} hot modules compiled")):
        gateway = await start_child(nursery, [str(REPO / "dev"), "serve", "--config", str(config), "--listen",
                                              "127.0.0.1:0", "--control-listen", "127.0.0.1:0"],
                                    name="dev-serve", ready=SERVE_READY, cwd=tmp_path, startup_timeout=90,
                                    env={"LLMGW_COMPILED_CACHE": str(cache)})
        assert any(line.startswith(said) for line in gateway.lines), gateway.output(20)
        assert any(logged in line for line in gateway.lines), gateway.output(20)
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(gateway.url + "/v1/models")).status_code == 200
        await gateway.stop()


async def exchange_all(url: str) -> list[tuple]:
    """The requests both gateways answer, and what each answer was (what does not vary between runs)."""
    answers: list[tuple] = []
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        async def post(body: bytes | dict, **headers: str) -> None:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await client.post("/v1/chat/completions", content=content,
                                         headers={"content-type": "application/json", **headers})
            answers.append(_answer(response.status_code, response.headers, response.content))

        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        for _ in range(4):  # both replicas, twice
            await post(chat)
        await post(chat, **{"x-request-id": "client-given-id-1"})
        await post({**chat, "stream": True})
        await post({**chat, "stream": True, "x_chunks": 3})
        await post({**chat, "stream": True, "x_break_after": 2})  # broken off: an error event ends it
        await post({**chat, "x_status": 500})  # the request's own failure: relayed as it is
        await post({**chat, "x_status": 503})  # an unwell replica: tried on the other, which fails the same way
        await post({**chat, "model": "nope"})
        await post({"messages": []})
        await post(b"{not json")
        await post(b"[1, 2]")
        await post(b"x" * 8192)  # over limits.max_body_bytes
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("GET", "/v1/other"),
                             ("PUT", "/v1/chat/completions"), ("GET", "/health")):
            response = await client.request(method, path)
            answers.append(_answer(response.status_code, response.headers, response.content))
    return answers


def _answer(status: int, headers: httpx.Headers, body: bytes) -> tuple:
    kept = sorted((k, v) for k, v in headers.items() if k not in VARYING_HEADERS)
    text = body.decode("utf-8", "replace")
    text = re.sub(r'"created":\s*\d+', '"created":0', text)
    text = re.sub(r"(request|id)[ -]\w{8,}", r"\1 ID", text)  # request ids inside error messages
    return status, kept, text


def counted(metrics_text: str) -> dict[str, float]:
    """The request-counting series of a /metrics page (not durations, which differ from run to run)."""
    series = {}
    for line in metrics_text.splitlines():
        if line.startswith(("llmgw_requests_total", "llmgw_requests_by_key_total", "llmgw_upstream_errors_total",
                            "llmgw_request_caused_failures_total", "llmgw_retries_total",
                            "llmgw_rejected_bodies_total", "llmgw_routing_decisions_total")):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series


async def start_both(compiled_tree: Path, start_fake_upstream, nursery, tmp_path: Path) -> tuple[Child, Child]:
    """A pure and a compiled ``llmgw serve`` over the same two fake upstreams."""
    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    config = tmp_path / "llmgw.yaml"
    config.write_text(CONFIG.format(a=a.url, b=b.url))
    pure = await start_serve(nursery, config)
    # run where the checkout's llmgw is not on the path: ``python -m`` puts the working directory first
    compiled = await start_serve(nursery, config, env={"PYTHONPATH": str(compiled_tree)}, cwd=compiled_tree)
    return pure, compiled


async def test_compiled_and_pure_gateways_answer_alike(compiled_tree, start_fake_upstream, nursery, tmp_path):
    pure, compiled = await start_both(compiled_tree, start_fake_upstream, nursery, tmp_path)
    n = len(MYPYC_MODULES)  # what each says at start, before its banner: the build an operator runs
    assert [line for line in compiled.lines if "data plane:" in line][0].endswith(
        f"data plane: {n} of {n} hot modules compiled with mypyc"), compiled.output(20)
    assert [line for line in pure.lines if "data plane:" in line][0].endswith(
        f"data plane: pure Python (0 of {n} hot modules compiled: this install was built without LLMGW_MYPYC=1; "
        "the compiled build costs less CPU per request, docs/deploy.md says how to get it)"), pure.output(20)
    pure_answers = await exchange_all(pure.url)
    compiled_answers = await exchange_all(compiled.url)
    assert [answer[0] for answer in pure_answers] == [200, 200, 200, 200, 200, 200, 200, 200, 500, 503, 404, 400,
                                                      400, 400, 413, 200, 200, 404, 405, 200]
    assert compiled_answers == pure_answers
    async with httpx.AsyncClient(timeout=10) as client:
        pure_metrics = counted((await client.get(pure.control_url + "/metrics")).text)
        compiled_metrics = counted((await client.get(compiled.control_url + "/metrics")).text)
    assert pure_metrics and compiled_metrics == pure_metrics


async def slow_request_then_close(url: str) -> bytes:
    """One request on a raw keep-alive connection that keeps the handler busy long enough for the server to start
    watching the client (``DISCONNECT_WATCH_AFTER``), its whole answer read, then the connection closed by the
    client while the server's watcher still waits on it."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x_delay_ms": 80}).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    answer = b""
    with trio.fail_after(10):
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(body), body))
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _content_length(answer):
            answer += await stream.receive_some(65536)
    await stream.aclose()
    return answer


def _content_length(answer: bytes) -> int:
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    return int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])


async def test_a_client_closing_after_a_slow_request_is_no_error_in_either_build(compiled_tree, start_fake_upstream,
                                                                                 nursery, tmp_path):
    """The connection's watcher reads the client's end after a handler that ran longer than the watch delay.
    (mypyc 2.4 trusted ``while self.final is None`` over a call that set ``final``: a TypeError ended the
    connection's task with an error logged, and a protocol error found there would have gone unanswered.)"""
    pure, compiled = await start_both(compiled_tree, start_fake_upstream, nursery, tmp_path)
    for gateway in (pure, compiled):
        for _ in range(3):
            assert (await slow_request_then_close(gateway.url)).startswith(b"HTTP/1.1 200 ")
    await trio.sleep(0.5)  # the watchers see the ends
    for name, gateway in (("pure", pure), ("compiled", compiled)):
        failures = [line for line in gateway.lines if "connection failed" in line or "Traceback" in line]
        assert not failures, (name, gateway.lines[-40:])
