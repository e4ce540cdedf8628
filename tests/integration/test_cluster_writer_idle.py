"""The control process's log writer at rest: once its last snapshot is older than ``snapshot_interval`` and
nothing changed, it waits for a change instead of looping (it used to spin a core at 100%)."""

from __future__ import annotations

import collections
from pathlib import Path

import trio

from llmgw.cluster.writer import LogWriter

WRITER_TASK = f"{LogWriter.run.__module__}.{LogWriter.run.__qualname__}"


class TaskSteps(trio.abc.Instrument):
    """How many times each task ran (a task that waits runs once per wake-up)."""

    def __init__(self) -> None:
        self.steps: collections.Counter[str] = collections.Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name] += 1


async def test_an_idle_writer_waits_for_a_change_instead_of_spinning(gateway_in_process, redis_url, cluster_name,
                                                                    start_fake_upstream):
    upstreams = [await start_fake_upstream(name) for name in ("a", "b")]

    def config(replicas: int) -> str:
        listed = "".join(f"      - url: {upstream.url}\n" for upstream in upstreams[:replicas])
        return (f"models:\n  - name: tiny\n    replicas:\n{listed}state:\n  backend: redis\n  url: {redis_url}\n"
                f"  cluster: {cluster_name}\n  snapshot_interval: 100ms\n")

    gateway = await gateway_in_process(config(1))
    with trio.fail_after(15):
        while gateway.gateway.shared.term is None:  # elected
            await trio.sleep(0.05)
        writer = gateway.gateway.shared.term.writer
        while not writer.published or writer.dirty:  # the first snapshot is out, and nothing changed since
            await trio.sleep(0.05)
    await trio.sleep(0.3)  # the last snapshot is now older than snapshot_interval
    counter = TaskSteps()
    trio.lowlevel.add_instrument(counter)
    try:
        await trio.sleep(0.5)
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert counter.steps[WRITER_TASK] <= 2, counter.steps.most_common(3)  # spinning, it ran thousands of times
    # A change wakes it: a reload adds a replica, which goes to the log at once.
    seq = writer.seq
    Path(gateway.gateway.config.source).write_text(config(2))
    assert (await gateway.gateway.reload()).applied
    with trio.fail_after(5):
        while writer.seq == seq:
            await trio.sleep(0.02)
