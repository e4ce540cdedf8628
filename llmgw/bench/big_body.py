"""Head-of-line cost of a big request body: a small request's latency while 15 MiB bodies are in flight.

Starts two fake upstreams and ``llmgw serve`` routing model ``tiny`` to one and
model ``big`` to the other (so the upstream parsing a big body never delays a
small request). One client sends small chat completions back to back on one
keep-alive connection and records each latency; another client, in a process
of its own (so that building and sending 15 MiB does not delay the measuring
client), sends big bodies of one kind after another. For each kind the report gives the small
requests' p50, p99 and max latency, minus the same numbers with no big body in
flight (``added_*``), and the big requests' status and duration. Then, in this
process, for each kind the event loop's longest gap (a 1 ms ticker task) while
the body is parsed as the data plane did before (``json.loads``) and as it
does now (:func:`~llmgw.http.jsonbody.read_json_body`): the part of the stall
that is the parser's, without the noise of other processes.

Kinds of big body (all about ``--size`` bytes, default 15 MiB, under the 16 MiB
body limit): ``text`` (one long ASCII prompt), ``escaped`` (a prompt of
non-ASCII text, JSON-escaped), ``token_ids`` (a completions prompt of token ids),
``containers`` (a list of small arrays: the most objects per byte) and ``deep``
(nesting 90,000 deep) and ``at_bound`` (just under the default bound on JSON
containers: 100,000 empty arrays, then a long prompt: about the costliest body
accepted).

With ``--routing kv_index`` model ``big`` is a simulator (``llmgw sim``, its KV
events followed by the gateway) routed by the ``kv_index`` tier, so each big
body is also planned, cut, tokenized through the simulator's ``/tokenize`` and
hashed before it is forwarded (kinds ``text``: a chat, ``escaped``: a completion
prompt, ``token_ids``: ids hashed without ``/tokenize``); the simulator answers
400 (the prompt is longer than its context), after the routing work this
measures.

Run: ``python -m llmgw.bench.big_body [--seconds 4] [--loop-gaps 5] [--routing kv_index]
[--json bench-results/big_body.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import trio

from ..http.jsonbody import DEFAULT_MAX_CONTAINERS, BodyError, read_json_body
from ..testing.processes import free_port, llmgw_command, start_child
from ..testing.sims import start_fake_upstream, start_gateway
from .common import bench_parser, finish

MiB = 1024 * 1024
SMALL = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()


def big_bodies(size: int) -> dict[str, bytes]:
    """One body of each kind, each close to ``size`` bytes."""
    head = b'{"model":"big","max_tokens":1,'
    just_below_bound = b",".join([b"[]"] * (DEFAULT_MAX_CONTAINERS - 10))
    return {
        "text": head + b'"messages":[{"role":"user","content":"' + b"x" * (size - 80) + b'"}]}',
        "escaped": head + b'"prompt":"' + b"\\u00e9\\n" * ((size - 60) // 8) + b'"}',
        "token_ids": head + b'"prompt":[' + b",".join([b"1234"] * ((size - 60) // 5)) + b"]}",
        "containers": head + b'"x":[' + b",".join([b"[]"] * ((size - 60) // 3)) + b"]}",
        "deep": head + b'"x":' + b"[" * 90_000 + b"]" * 90_000 + b"}",
        "at_bound": head + b'"x":[' + just_below_bound + b'],"prompt":"' + b"x" * (size - len(just_below_bound) - 80)
                    + b'"}',
    }


def request_bytes(host: str, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def exchange(stream: trio.SocketStream, data: bytes) -> int:
    """Send one request and read its whole (content-length) answer; the status code."""
    return (await answer_of(stream, data))[0]


async def answer_of(stream: trio.SocketStream, data: bytes) -> tuple[int, bytes]:
    """Send one request and read its whole (content-length) answer: the status code and the body."""
    await stream.send_all(data)
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("the gateway closed the connection")
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("the gateway closed the connection mid-answer")
        rest += chunk
    return int(lines[0].split()[1]), rest


async def small_latencies(host: str, port: int, seconds: float) -> list[float]:
    """Small requests back to back for ``seconds``: each one's latency in seconds."""
    latencies = []
    stream = await trio.open_tcp_stream(host, port)
    data = request_bytes(host, "/v1/chat/completions", SMALL)
    async with stream:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            with trio.fail_after(30):
                status = await exchange(stream, data)
            if status != 200:
                raise RuntimeError(f"a small request got HTTP {status}")
            latencies.append(time.perf_counter() - started)
    return latencies


def send_big_bodies(host: str, port: int, kind: str, size: int, seconds: float) -> list[tuple[int, float]]:
    """Big requests one after another (a new connection each, as an error may close it) for ``seconds``."""
    body = big_bodies(size)[kind]
    path = "/v1/chat/completions" if b'"messages":' in body[:64] else "/v1/completions"
    data = request_bytes(host, path, body)
    results = []

    async def loop() -> None:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            with trio.fail_after(60):
                stream = await trio.open_tcp_stream(host, port)
                async with stream:
                    status = await exchange(stream, data)
            results.append((status, time.perf_counter() - started))

    trio.run(loop)
    return results


async def longest_gap(parse, body: bytes) -> tuple[float, str]:
    """The longest time a 1 ms ticker task waited while ``parse(body)`` ran in the same loop, and its outcome."""
    gaps = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await trio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.02)
        try:
            result = parse(body)
            if hasattr(result, "__await__"):
                await result
            outcome = "parsed"
        except BodyError as exc:
            outcome = f"{exc.status} {exc.reason}"
        except (ValueError, RecursionError) as exc:
            outcome = type(exc).__name__
        await trio.sleep(0.05)  # what the parse left to the garbage collector lands here
        nursery.cancel_scope.cancel()
    return max(gaps) - 0.001, outcome


async def loop_gaps(size: int, kinds: list[str], repeat: int) -> dict:
    """Per kind: the event loop's longest gap with the body parsed as before (``json.loads`` inline) and as now
    (:func:`read_json_body`), the best of ``repeat`` tries each (the least disturbed by other processes)."""
    bodies = big_bodies(size)
    report = {}
    for kind in kinds:
        row = {}
        for name, parse in (("json_loads", json.loads), ("read_json_body", read_json_body)):
            tries = [await longest_gap(parse, bodies[kind]) for _ in range(repeat)]
            row[name] = {"gap_ms": 1000 * min(gap for gap, _ in tries), "outcome": tries[0][1]}
        report[kind] = row
    return report


def summary(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {"requests": len(ordered), "p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max_ms": 1000 * ordered[-1]}


async def kv_index_model(nursery: trio.Nursery) -> str:
    """A simulator serving ``big`` with KV events, and the config lines of model ``big`` routed by ``kv_index``."""
    events, replay = free_port(), free_port()
    events_config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                                "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"})
    argv = llmgw_command("sim", "--port", "0", "--served-model-name", "big", "--profile", "constant",
                         "--time-scale", "0",
                         "--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", events_config)
    engine = await start_child(nursery, argv, name="sim-big", env={"PYTHONHASHSEED": "0"})
    return (f"  - name: big\n    routing: kv_index\n    routing_options: {{tokenize_timeout: 5s}}\n"
            f"    replicas:\n      - {{url: {engine.url}, name: big-0, kv_events: 'tcp://127.0.0.1:{events}', "
            f"kv_replay: 'tcp://127.0.0.1:{replay}'}}\n")


async def control_get(control_url: str, path: str) -> bytes:
    host, port = control_url.removeprefix("http://").rsplit(":", 1)
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        return (await answer_of(stream, f"GET {path} HTTP/1.1\r\nhost: {host}\r\n\r\n".encode()))[1]


async def routing_outcomes(control_url: str) -> dict[str, float]:
    """``llmgw_routing_decisions_total`` of model ``big`` by outcome (to show the big bodies were routed by the
    tier, not by a fallback)."""
    outcomes = {}
    for line in (await control_get(control_url, "/metrics")).decode().splitlines():
        if line.startswith("llmgw_routing_decisions_total{") and 'model="big"' in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            outcomes[outcome] = float(line.rsplit(" ", 1)[1])
    return outcomes


async def index_healthy(control_url: str) -> None:
    """Wait until the gateway's KV index of ``big-0`` is healthy (its first copy of the engine's cache came)."""
    with trio.fail_after(30):
        while True:
            if b'"healthy"' in await control_get(control_url, "/admin/kv"):
                return
            await trio.sleep(0.1)


async def measure(seconds: float, size: int, kinds: list[str], routing: str = "proxy") -> dict:
    report: dict = {"size_bytes": size, "seconds_per_kind": seconds, "routing": routing, "kinds": {}}
    async with trio.open_nursery() as nursery:
        upstreams = []
        for name in ("small", "big"):
            upstreams.append(await start_fake_upstream(nursery, name))
        big = (await kv_index_model(nursery) if routing == "kv_index"
               else f"  - name: big\n    replicas: [{{url: {upstreams[1].url}}}]\n")
        config = f"models:\n  - name: tiny\n    replicas: [{{url: {upstreams[0].url}}}]\n{big}log_level: warning\n"
        gateway = await start_gateway(nursery, config)
        if routing == "kv_index":
            await index_healthy(gateway.control_url)
        host, port_text = gateway.url.removeprefix("http://").rsplit(":", 1)
        port = int(port_text)
        await small_latencies(host, port, 0.5)  # warm up
        baseline = summary(await small_latencies(host, port, seconds))
        report["baseline"] = baseline
        for kind in kinds:
            sender = [sys.executable, "-m", "llmgw.bench.big_body", "--send", kind, "--size", str(size),
                      "--seconds", str(seconds + 1.0), "--target", f"{host}:{port}"]
            async with trio.open_nursery() as load:
                sent: list = []

                async def run_sender() -> None:
                    sent.append(await trio.run_process(sender, capture_stdout=True))

                load.start_soon(run_sender)
                await trio.sleep(0.5)  # the sender builds its body and starts
                latencies = await small_latencies(host, port, seconds)
            results = json.loads(sent[0].stdout)
            row = summary(latencies)
            row.update({f"added_{k}": row[k] - baseline[k] for k in ("p50_ms", "p99_ms", "max_ms")})
            row["big_statuses"] = sorted({status for status, _ in results})
            row["big_requests"] = len(results)
            row["big_median_s"] = statistics.median(d for _, d in results) if results else None
            report["kinds"][kind] = row
        if routing == "kv_index":
            report["big_routing_outcomes"] = await routing_outcomes(gateway.control_url)
        nursery.cancel_scope.cancel()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=4.0, help="small-request measuring time per kind")
    parser.add_argument("--size", type=int, default=15 * MiB, help="bytes of each big body")
    parser.add_argument("--kinds", help="default: text,escaped,token_ids,containers,deep,at_bound "
                                         "(with --routing kv_index: text,escaped,token_ids)")
    parser.add_argument("--routing", choices=("proxy", "kv_index"), default="proxy",
                        help="model big: a fake upstream (proxy) or a simulator routed by kv_index")
    parser.add_argument("--loop-gaps", type=int, default=3, metavar="N",
                        help="also time the event loop's longest gap while parsing each body in process, as before "
                             "and as now, best of N (0: skip)")
    parser.add_argument("--send", metavar="KIND", help=argparse.SUPPRESS)  # the big-body sender's process
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.send:
        host, port = args.target.rsplit(":", 1)
        print(json.dumps(send_big_bodies(host, int(port), args.send, args.size, args.seconds)))
        return 0
    kinds = (args.kinds or ("text,escaped,token_ids" if args.routing == "kv_index"
                            else "text,escaped,token_ids,containers,deep,at_bound")).split(",")
    report = trio.run(measure, args.seconds, args.size, kinds, args.routing)
    base = report["baseline"]
    print(f"no big body: small request p50 {base['p50_ms']:.1f} ms, p99 {base['p99_ms']:.1f} ms, "
          f"max {base['max_ms']:.1f} ms ({base['requests']} requests)")
    print(f"{'big body':<11} {'status':<10} {'big s':>6} {'small p50':>10} {'+p99 ms':>8} {'+max ms':>8}")
    for kind, row in report["kinds"].items():
        big = f"{row['big_median_s']:.2f}" if row["big_median_s"] is not None else "-"
        print(f"{kind:<11} {','.join(map(str, row['big_statuses'])):<10} {big:>6} {row['p50_ms']:>10.1f} "
              f"{row['added_p99_ms']:>8.1f} {row['added_max_ms']:>8.1f}")
    if "big_routing_outcomes" in report:
        print(f"model big, routing decisions by outcome: {report['big_routing_outcomes']}")
    if args.loop_gaps:
        report["loop_gaps"] = trio.run(loop_gaps, args.size, kinds, args.loop_gaps)
        print(f"\nlongest event-loop gap while parsing in process (best of {args.loop_gaps}):")
        print(f"{'big body':<11} {'json.loads':>18} {'read_json_body':>28}")
        for kind, row in report["loop_gaps"].items():
            before, after = row["json_loads"], row["read_json_body"]
            print(f"{kind:<11} {before['gap_ms']:>8.1f} ms {before['outcome']:<9} {after['gap_ms']:>8.1f} ms "
                  f"{after['outcome']}")
    return finish(args, report)


if __name__ == "__main__":
    raise SystemExit(main())
