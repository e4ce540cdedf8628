"""Micro-benchmark of the gateway queue's fast path: µs of the event loop per ``enter`` + ``release`` with room.

Run: ``python -m llmgw.bench.flow_queue [--rounds 15] [--calls 2000] [--waiting 1000] [--json PATH]`` (seconds).
In-process, no socket: a :class:`~llmgw.flow.queue.FlowQueue` with its metrics, over a room of fixed size.

Printed, per case, the median µs per call of ``--rounds`` rounds of ``--calls`` calls, with the fastest and
slowest round (the machine is shared: the spread says how much to trust the median):

- ``fast path``: an interactive request enters a model with room and nothing waiting, and is released (what
  every request pays at 0.5x load, the target being under 200 µs p50);
- ``fast path, lower classes waiting``: the same while ``--waiting`` batch requests wait for that model (no room
  for their class): the interactive request passes them;
- ``fair band push + pop``: one request through :class:`~llmgw.flow.fair.FairBand` with 100 flows backlogged
  (what the slow path adds per waiter, besides its task's wake-ups).
"""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from llmgw.bench.common import bench_parser, finish, print_spread, rounds_us, spread_us
from llmgw.flow.fair import FairBand
from llmgw.flow.interfaces import Room
from llmgw.flow.model import DEFAULT_CLASSES, Admitted, FlowRequest, FlowSettings, PriorityClass
from llmgw.flow.queue import FlowQueue

MODEL = "m"
INTERACTIVE, _, BATCH, _ = DEFAULT_CLASSES


class FixedRoom(Room):
    """``capacity`` places of which ``used`` are taken; a class may fill its ``max_fill`` of them."""

    def __init__(self, capacity: int, used: int):
        self.capacity, self.used = capacity, used

    def free(self, model: str, priority: PriorityClass) -> int:
        return int(self.capacity * priority.max_fill) - self.used

    def fits(self, model: str, priority: PriorityClass, tokens: int, output: int = 0) -> bool:
        return True  # counted in requests only, as before the token room: the fast path's cost is the queue's

    async def changed(self, model: str) -> None:
        await trio.sleep(0.05)

    def wake(self, model: str) -> None:
        pass

    def saturation(self, model: str) -> float:
        return self.used / self.capacity


def enter_release(queue: FlowQueue, request: FlowRequest) -> None:
    coroutine = queue.enter(request)
    try:
        coroutine.send(None)  # the fast path never awaits: enter ends in this one send
    except StopIteration as done:
        outcome = done.value
        assert isinstance(outcome, Admitted)
        queue.release(outcome)
        return
    raise RuntimeError("the fast path awaited")


class _Item:
    __slots__ = ("flow", "cost", "weight")

    def __init__(self, flow: str, cost: int):
        self.flow, self.cost, self.weight = flow, cost, 1.0


def run(rounds: int, calls: int, waiting: int) -> dict[str, Any]:
    async def measure() -> dict[str, list[float]]:
        idle = FlowQueue(FlowSettings(), FixedRoom(100, 0))
        busy = FlowQueue(FlowSettings(max_queued=waiting + 10), FixedRoom(100, 90))  # batch may fill 85: none
        far = 1e9  # the waiters' deadline
        async with trio.open_nursery() as nursery:
            await nursery.start(busy.run)
            for i in range(waiting):
                nursery.start_soon(busy.enter, FlowRequest(MODEL, f"t{i % 10}", BATCH, 1000, far))
            await trio.testing.wait_all_tasks_blocked()
            assert sum(q.requests for q in busy.queued(MODEL).values()) == waiting
            band: FairBand[_Item] = FairBand()
            for i in range(1000):
                band.push(_Item(f"f{i % 100}", 100 + i % 7))
            request = FlowRequest(MODEL, "a", INTERACTIVE, 500, far)

            def band_push_pop() -> None:
                band.push(_Item("f1", 100))
                band.pop()

            times = rounds_us({
                "fast path": lambda: enter_release(idle, request),
                "fast path, lower classes waiting": lambda: enter_release(busy, request),
                "fair band push + pop": band_push_pop,
            }, calls, rounds)
            nursery.cancel_scope.cancel()
        return times

    times = trio.run(measure)
    return {"rounds": rounds, "calls": calls, "waiting": waiting, "us": spread_us(times)}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--waiting", type=int, default=1000, help="batch requests waiting in the second case")
    args = parser.parse_args(argv)
    report = run(args.rounds, args.calls, args.waiting)
    print_spread(f"flow queue: µs per call, median of {args.rounds} rounds of {args.calls} [fastest - slowest round]",
                 report["us"])
    return finish(args, report)


if __name__ == "__main__":
    raise SystemExit(main())
