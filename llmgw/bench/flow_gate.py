"""Micro-benchmark of what overload control adds to a request routed at once: µs per ``FlowGate.enter`` and
``Pass.release`` with room (the data plane's side: class from key, team and header, deadline, the queue's fast path).

Run: ``python -m llmgw.bench.flow_gate [--rounds 15] [--calls 2000] [--json PATH]``. In-process, no socket: the
gate over a :class:`~llmgw.flow.queue.FlowQueue` and a room of fixed size (``llmgw.bench.flow_queue``'s).

Printed, per case, the median µs per call of ``--rounds`` rounds of ``--calls`` calls, with the fastest and
slowest round (the machine is shared: the spread says how much to trust the median):

- ``a keyed request``: a key of a team with its own class, no header (what most requests pay; target of issue 31:
  under 200 µs p50 at 0.5x load, with the queue's own share in ``llmgw.bench.flow_queue``);
- ``with the priority header and a deadline``: the same request lowering its class with ``x-llmgw-priority`` and
  giving ``x-request-deadline`` and ``x-stainless-timeout`` (every header the gate reads).
"""

from __future__ import annotations

import time
from typing import Any

import trio

from llmgw.bench.common import bench_parser, finish, print_spread, rounds_us, spread_us
from llmgw.bench.flow_queue import FixedRoom
from llmgw.flow.model import FlowSettings
from llmgw.flow.queue import FlowQueue
from llmgw.gateway.flow_gate import FlowGate, Pass
from llmgw.http.messages import Request
from llmgw.tenancy.model import Team, Tenant

HEADERS = [(b"host", b"gw"), (b"content-type", b"application/json"), (b"authorization", b"Bearer sk-x"),
           (b"user-agent", b"OpenAI/Python 1.50.0"), (b"accept", b"application/json")]


def enter_release(gate: FlowGate, request: Request, tenant: Tenant) -> None:
    coroutine = gate.enter(request, tenant, "m", 1500, "req-1", output=500)
    try:
        coroutine.send(None)  # with room, enter never awaits: it ends in this one send
    except StopIteration as done:
        passed = done.value
        assert isinstance(passed, Pass), passed
        passed.release()
        return
    raise RuntimeError("the fast path awaited")


def run(rounds: int, calls: int) -> dict[str, Any]:
    async def measure() -> dict[str, list[float]]:
        settings = FlowSettings()
        gate = FlowGate(settings, FlowQueue(settings, FixedRoom(100, 0)), None)
        tenant = Tenant("cfg-a", "a", team=Team("search", priority="interactive"))
        plain = Request("POST", "/v1/chat/completions", HEADERS)
        headed = Request("POST", "/v1/chat/completions", HEADERS + [
            (b"x-llmgw-priority", b"batch"), (b"x-request-deadline", str(time.time() + 30).encode()),
            (b"x-stainless-timeout", b"600")])
        return rounds_us({
            "a keyed request": lambda: enter_release(gate, plain, tenant),
            "with the priority header and a deadline": lambda: enter_release(gate, headed, tenant),
        }, calls, rounds)

    times = trio.run(measure)
    return {"rounds": rounds, "calls": calls, "us": spread_us(times)}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    args = parser.parse_args(argv)
    report = run(args.rounds, args.calls)
    print_spread(f"flow gate: µs per request routed at once, median of {args.rounds} rounds of {args.calls} "
                 "[fastest - slowest round]", report["us"])
    return finish(args, report)


if __name__ == "__main__":
    raise SystemExit(main())
