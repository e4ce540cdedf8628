"""Shard supervision with real engine processes on 127.0.0.1: ``llmgw sim`` through the ``sim`` engine plugin.

Engines outlive their supervisors by design, so every test records the
processes it saw and the fixture kills their process groups at the end.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import trio

from llmgw import wire
from llmgw.agent.ledger import Ledger, LedgerEntry
from llmgw.agent.shards import ShardManager
from llmgw.agent.supervisor import ShardSupervisor, SupervisorSettings
from llmgw.logsetup import TEXT_FORMAT, JsonFormatter
from llmgw.plugins_manager import default_registry
from llmgw.procgroup import process_start_time

pytestmark = pytest.mark.slow

State = wire.ShardState
FAST = SupervisorSettings(restart_backoff=(0.1, 2.0, 0.5), crash_loop_after=2, crash_loop_retry=30.0,
                          probe_interval=(0.1, 0.3), probe_timeout=1.0, unhealthy_after=2, restart_grace=2.0,
                          drain_poll_interval=0.1)


class Recorder:
    """The ``on_status`` callback: keeps every report, lets a test wait for one, remembers every engine pid."""

    def __init__(self):
        self.reports: list[tuple[float, wire.ShardReport]] = []
        self.processes: dict[int, int | None] = {}  # pid -> start time, for the cleanup
        self._changed = trio.Event()

    def __call__(self, report: wire.ShardReport) -> None:
        self.reports.append((time.monotonic(), report))
        if report.pid and report.pid not in self.processes:
            self.processes[report.pid] = process_start_time(report.pid)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, shard_id: str, state: State, *, after: int = 0, timeout: float = 20.0,
                       **fields) -> wire.ShardReport:
        """The first report of ``shard_id`` in ``state`` (with these field values) from report number ``after``."""
        seen = after
        with trio.fail_after(timeout):
            while True:
                for _, report in self.reports[seen:]:
                    if report.shard_id == shard_id and report.state is state and all(
                            getattr(report, k) == v for k, v in fields.items()):
                        return report
                seen = len(self.reports)
                await self._changed.wait()

    def states(self, shard_id: str) -> list[State]:
        return [r.state for _, r in self.reports if r.shard_id == shard_id]

    def kill_all(self) -> None:
        for pid, start_time in self.processes.items():
            if start_time is not None and process_start_time(pid) == start_time:
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def recorder():
    recorder = Recorder()
    try:
        yield recorder
    finally:
        recorder.kill_all()


@pytest.fixture
def manager(tmp_path, recorder):
    return ShardManager(default_registry(), state_dir=tmp_path, node_address="127.0.0.1", on_status=recorder,
                        settings=FAST)


def sim_shard(shard_id: str = "r1-0", *, generation: int = 1, args=(), engine_bin: str | None = None,
              startup_timeout: float = 30.0, http_port: int = 0) -> wire.StartShard:
    pinned = [] if "--profile" in args else ["--profile", "constant"]  # the constant model's numbers, below
    profile = wire.ShardProfile(name="tiny-sim", engine="sim", engine_bin=engine_bin, model_path="tiny",
                                served_model_name="tiny", args=[*pinned, *args], startup_timeout=startup_timeout)
    return wire.StartShard(shard_id=shard_id, replica_id=shard_id.split("-")[0], generation=generation,
                           fingerprint="fp", http_port=http_port, profile=profile)


def running(pid: int) -> bool:
    return process_start_time(pid) is not None


async def models(endpoint: str) -> list[str]:
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"{endpoint}/v1/models")
    return [card["id"] for card in response.json()["data"]]


async def test_a_shard_starts_loads_and_becomes_ready(manager, recorder, tmp_path, nursery):
    await nursery.start(manager.run)
    manager.start(sim_shard())
    ready = await recorder.wait_for("r1-0", State.READY)

    assert recorder.states("r1-0") == [State.PENDING, State.STARTING, State.LOADING, State.READY]
    assert ready.pid > 0 and running(ready.pid)
    assert os.getpgid(ready.pid) == ready.pid  # its own process group
    assert ready.endpoint == f"http://127.0.0.1:{ready.http_port}" and manager.ports.reserved(ready.http_port)
    assert await models(ready.endpoint) == ["tiny"]
    assert (ready.generation, ready.model, ready.restarts, ready.fingerprint) == (1, "tiny", 0, "fp")
    entry = Ledger(tmp_path / "shards.json").get("r1-0")
    assert (entry.pid, entry.http_port, entry.pid_start_time) == (ready.pid, ready.http_port,
                                                                   process_start_time(ready.pid))
    assert [r.state for r in manager.reports()] == [State.READY]
    assert "llmgw-sim listening on" in (tmp_path / "logs" / "r1-0.log").read_text()  # the engine wrote its log

    stopped = await manager.stop("r1-0", grace=5)
    assert stopped.state is State.STOPPED and "after SIGTERM" in stopped.reason
    assert not running(ready.pid)
    assert Ledger(tmp_path / "shards.json").entries() == []
    assert not manager.ports.reserved(ready.http_port)
    assert manager.reports() == [] and manager.get("r1-0") is None


async def test_engine_logs_are_private_and_an_older_agents_are_tightened_at_start(manager, recorder, tmp_path,
                                                                                      nursery):
    folder = tmp_path / "logs"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    for name in ("old-0.log", "old-0.log.1"):  # what an agent before this change left: 0644 in a 0755 folder
        (folder / name).write_text("prompt text\n")
        (folder / name).chmod(0o644)
    await nursery.start(manager.run)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE((folder / name).stat().st_mode) for name in ("old-0.log", "old-0.log.1")} == {0o600}
    manager.start(sim_shard())
    await recorder.wait_for("r1-0", State.READY)
    log = folder / "r1-0.log"
    assert "llmgw-sim listening on" in log.read_text()  # the engine wrote it through the descriptor it was given
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


async def test_a_shard_start_logs_its_shard_pid_and_port_as_json_keys(manager, recorder, nursery, caplog):
    caplog.set_level(logging.INFO, "llmgw.agent.supervisor")
    await nursery.start(manager.run)
    manager.start(sim_shard())
    ready = await recorder.wait_for("r1-0", State.READY)
    (starting,) = [r for r in caplog.records if "(generation 1) is starting: spawned pid" in r.getMessage()]
    line = json.loads(JsonFormatter().format(starting))
    assert (line["shard"], line["replica"], line["generation"]) == ("r1-0", "r1", 1), line
    assert (line["pid"], line["port"], line["state"]) == (ready.pid, ready.http_port, "starting"), line
    assert line["message"] == (f"shard r1-0 (generation 1) is starting: spawned pid {ready.pid} on port "
                               f"{ready.http_port}")
    # The text format is what it was: the message, which names them already.
    text = logging.Formatter(TEXT_FORMAT).format(starting)
    assert text.endswith("llmgw.agent.supervisor: " + line["message"]) and '"pid"' not in text
    (became_ready,) = [r for r in caplog.records if "(generation 1) is ready" in r.getMessage()]
    assert json.loads(JsonFormatter().format(became_ready))["state"] == "ready"
    await manager.stop("r1-0", grace=5)


async def test_a_fixed_http_port_is_used(manager, recorder, nursery):
    await nursery.start(manager.run)
    port = manager.ports.allocate()
    manager.ports.release(port)
    manager.start(sim_shard(http_port=port))
    ready = await recorder.wait_for("r1-0", State.READY)
    assert ready.http_port == port and await models(ready.endpoint) == ["tiny"]
    await manager.stop("r1-0", grace=5)


async def test_a_killed_engine_is_restarted(manager, recorder, tmp_path, nursery):
    await nursery.start(manager.run)
    manager.start(sim_shard())
    first = await recorder.wait_for("r1-0", State.READY)
    mark = len(recorder.reports)
    os.killpg(first.pid, signal.SIGKILL)

    pending = await recorder.wait_for("r1-0", State.PENDING, after=mark)
    assert "killed by SIGKILL" in pending.reason and "restart 1" in pending.reason
    assert any("llmgw-sim listening on" in line for line in pending.log_tail)
    second = await recorder.wait_for("r1-0", State.READY, after=mark)
    assert second.pid != first.pid and running(second.pid)
    assert second.restarts == 1 and second.http_port == first.http_port  # the same endpoint for the router
    assert recorder.states("r1-0")[-4:] == [State.PENDING, State.STARTING, State.LOADING, State.READY]
    assert Ledger(tmp_path / "shards.json").get("r1-0").pid == second.pid
    await manager.stop("r1-0", grace=5)


async def test_an_engine_that_exits_at_once_is_a_crash_loop(manager, recorder, nursery):
    await nursery.start(manager.run)
    manager.start(sim_shard(args=["--block-size", "not-a-number"]))
    failed = await recorder.wait_for("r1-0", State.FAILED)
    assert failed.reason.startswith("crash loop: 2 restarts in the last 600s, then pid ")
    assert "exited with code 2" in failed.reason and "retrying in 30s" in failed.reason
    assert any("invalid int value: 'not-a-number'" in line for line in failed.log_tail)
    states = recorder.states("r1-0")
    assert states.count(State.STARTING) == 3 and State.READY not in states and states[-1] is State.FAILED
    stopped = await manager.stop("r1-0", grace=1)  # ends the slow retries
    assert stopped.state is State.STOPPED


async def test_giving_up_after_a_crash_loop_when_asked(recorder, tmp_path, nursery):
    manager = ShardManager(default_registry(), state_dir=tmp_path, node_address="127.0.0.1", on_status=recorder,
                           settings=SupervisorSettings(**{**FAST.__dict__, "crash_loop_retry": None}))
    await nursery.start(manager.run)
    manager.start(sim_shard(args=["--block-size", "not-a-number"]))
    failed = await recorder.wait_for("r1-0", State.FAILED)
    assert failed.reason.startswith("crash loop:") and "retrying" not in failed.reason
    with trio.fail_after(5):
        while not manager.get("r1-0").finished:
            await trio.sleep(0.05)
    assert [r.state for r in manager.reports()] == [State.FAILED]


async def test_a_missing_engine_bin_fails_at_once_with_the_reason(manager, recorder, tmp_path, nursery):
    await nursery.start(manager.run)
    manager.start(sim_shard(engine_bin=str(tmp_path / "no-such-llmgw")))
    failed = await recorder.wait_for("r1-0", State.FAILED)
    assert failed.reason == f"engine sim: engine_bin '{tmp_path / 'no-such-llmgw'}' is not an executable file"
    assert recorder.states("r1-0") == [State.PENDING, State.FAILED]
    assert manager.get("r1-0").finished


async def test_an_unknown_engine_is_reported_failed(manager, recorder, nursery):
    await nursery.start(manager.run)
    spec = sim_shard()
    spec.profile.engine = "tgi"
    manager.start(spec)
    failed = await recorder.wait_for("r1-0", State.FAILED)
    assert "no engine named 'tgi'" in failed.reason
    assert [r.state for r in manager.reports()] == [State.FAILED]
    assert (await manager.stop("r1-0")).state is State.STOPPED
    assert manager.reports() == []


async def test_startup_timeout_fails_the_shard(manager, recorder, tmp_path, nursery):
    await nursery.start(manager.run)
    manager.start(sim_shard(engine_bin=stubborn_engine(tmp_path), startup_timeout=0.5))
    failed = await recorder.wait_for("r1-0", State.FAILED)
    assert failed.reason.startswith("startup timeout: not ready 0.5s after the start")
    assert any("stubborn engine up" in line for line in failed.log_tail)
    assert not running(recorder.reports[1][1].pid)  # the engine that never got ready was killed
    await manager.stop("r1-0", grace=1)


async def test_drain_waits_for_in_flight_requests_then_stops(manager, recorder, nursery):
    await nursery.start(manager.run)
    manager.start(sim_shard(args=["--decode-ms-per-step", "50"]))
    ready = await recorder.wait_for("r1-0", State.READY)
    tokens = 40  # about 2 s of decoding
    events: list[str] = []
    stream_started = trio.Event()

    async def stream_request():
        body = {"model": "tiny", "prompt": "hello " * 20, "max_tokens": tokens, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{ready.endpoint}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        stream_started.set()
        events.append(f"closed at {time.monotonic()}")

    async with trio.open_nursery() as requests:
        requests.start_soon(stream_request)
        await stream_started.wait()
        drained = await manager.drain("r1-0", timeout=30, grace=5)

    assert events[-2] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["text"]) == tokens  # every token arrived
    draining = await recorder.wait_for("r1-0", State.DRAINING)
    draining_at = next(t for t, r in recorder.reports if r is draining)
    stopped_at = next(t for t, r in recorder.reports if r.state is State.STOPPED)
    closed_at = float(events[-1].split()[-1])
    assert draining_at < closed_at <= stopped_at  # out of routing first, stopped only after the last byte
    assert drained.state is State.STOPPED and "no requests in flight" in drained.reason
    assert not running(ready.pid)


async def test_stop_kills_an_engine_that_ignores_sigterm(manager, recorder, tmp_path, nursery):
    await nursery.start(manager.run)
    manager.start(sim_shard(engine_bin=stubborn_engine(tmp_path)))
    loading = await recorder.wait_for("r1-0", State.LOADING)
    await stubborn_engine_up(tmp_path)
    started = time.monotonic()
    stopped = await manager.stop("r1-0", grace=1.0)
    assert time.monotonic() - started >= 1.0
    assert stopped.state is State.STOPPED
    assert stopped.reason == "stop requested; killed with SIGKILL after a 1s grace"
    assert recorder.states("r1-0")[-2:] == [State.DRAINING, State.STOPPED]
    assert not running(loading.pid)
    assert "got SIGTERM, ignoring it" in (tmp_path / "logs" / "r1-0.log").read_text()


async def test_engines_outlive_the_agent_and_a_new_agent_adopts_them(recorder, tmp_path):
    def new_manager(on_status):
        return ShardManager(default_registry(), state_dir=tmp_path, node_address="127.0.0.1", on_status=on_status,
                            settings=FAST)

    async with trio.open_nursery() as agent:
        first_agent = new_manager(recorder)
        await agent.start(first_agent.run)
        first_agent.start(sim_shard())
        ready = await recorder.wait_for("r1-0", State.READY)
        agent.cancel_scope.cancel()  # the agent dies (or loses the control plane): supervision ends, not the engine

    await trio.sleep(1.0)
    assert running(ready.pid) and await models(ready.endpoint) == ["tiny"]

    second = Recorder()
    async with trio.open_nursery() as agent:
        second_agent = new_manager(second)
        await agent.start(second_agent.run)  # adoption is done when run() has started
        (adopted,) = second_agent.reports()
        assert (adopted.state, adopted.pid, adopted.restarts, adopted.endpoint) == (
            State.READY, ready.pid, 0, ready.endpoint)
        assert "adopted running engine pid" in adopted.reason
        assert second.states("r1-0") == [State.READY]  # no restart, no Starting

        # It is supervised as before: it dies, it is restarted from the spec in the ledger.
        os.killpg(ready.pid, signal.SIGKILL)
        restarted = await second.wait_for("r1-0", State.READY, after=1)
        assert restarted.pid != ready.pid and restarted.restarts == 1
        second.processes.update(recorder.processes)
        try:
            stopped = await second_agent.stop("r1-0", grace=5)
            assert stopped.state is State.STOPPED and not running(restarted.pid)
        finally:
            second.kill_all()
            agent.cancel_scope.cancel()


async def test_an_adopted_engine_that_ignores_sigterm_is_still_stopped(recorder, tmp_path, nursery):
    async with trio.open_nursery() as agent:
        first_agent = ShardManager(default_registry(), state_dir=tmp_path, node_address="127.0.0.1",
                                   on_status=recorder, settings=FAST)
        await agent.start(first_agent.run)
        first_agent.start(sim_shard(engine_bin=stubborn_engine(tmp_path)))
        loading = await recorder.wait_for("r1-0", State.LOADING)
        await stubborn_engine_up(tmp_path)  # its SIGTERM handler installed: a loaded machine starts it slowly
        agent.cancel_scope.cancel()

    second_agent = ShardManager(default_registry(), state_dir=tmp_path, node_address="127.0.0.1",
                                on_status=recorder, settings=FAST)
    await nursery.start(second_agent.run)
    assert second_agent.get("r1-0").pid == loading.pid
    stopped = await second_agent.stop("r1-0", grace=0.5)
    assert stopped.reason.endswith("killed with SIGKILL after a 0.5s grace")
    assert not running(loading.pid)


async def test_stale_ledger_entries_are_reported_failed_and_dropped(recorder, tmp_path, nursery):
    ledger = Ledger(tmp_path / "shards.json")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: its pid names nothing (or, later, someone else)
    ledger.put(LedgerEntry.for_process(sim_shard("dead-0"), pid=gone.pid, pid_start_time=12345, pgid=gone.pid,
                                       http_port=1, endpoint="", model="tiny"))
    ledger.put(LedgerEntry.for_process(sim_shard("reused-0"), pid=os.getpid(),  # alive, but another process now
                                       pid_start_time=process_start_time(os.getpid()) - 1, pgid=os.getpid(),
                                       http_port=1, endpoint="", model="tiny"))

    manager = ShardManager(default_registry(), state_dir=tmp_path, node_address="127.0.0.1", on_status=recorder,
                           settings=FAST)
    await nursery.start(manager.run)
    reports = {r.shard_id: r for r in manager.reports()}
    assert set(reports) == {"dead-0", "reused-0"}
    for report in reports.values():
        assert report.state is State.FAILED and report.reason.startswith("exited while the agent was away")
    assert recorder.states("dead-0") == [State.FAILED] and recorder.states("reused-0") == [State.FAILED]
    assert Ledger(tmp_path / "shards.json").entries() == []
    manager.start(sim_shard("dead-0", generation=2))  # the control plane starts it again: the tombstone goes
    await recorder.wait_for("dead-0", State.READY)
    assert {r.shard_id: r.state for r in manager.reports()} == {"dead-0": State.READY, "reused-0": State.FAILED}
    await manager.stop("dead-0", grace=5)


async def test_start_is_idempotent_and_a_new_generation_replaces_the_old(manager, recorder, nursery):
    await nursery.start(manager.run)
    manager.start(sim_shard(generation=1))
    manager.start(sim_shard(generation=1))
    first = await recorder.wait_for("r1-0", State.READY, generation=1)
    manager.start(sim_shard(generation=1))
    assert recorder.states("r1-0").count(State.STARTING) == 1

    manager.start(sim_shard(generation=2))
    stopped = await recorder.wait_for("r1-0", State.STOPPED, generation=1)
    assert "replaced by generation 2" in stopped.reason
    second = await recorder.wait_for("r1-0", State.READY, generation=2)
    assert second.pid != first.pid and not running(first.pid)
    generation_of = [(r.generation, r.state) for _, r in recorder.reports if r.shard_id == "r1-0"]
    assert generation_of.index((1, State.STOPPED)) < generation_of.index((2, State.STARTING))

    before = len(recorder.reports)
    manager.start(sim_shard(generation=1))  # an old generation (a late message) is refused
    await trio.sleep(0.3)
    assert len(recorder.reports) == before and manager.get("r1-0").spec.generation == 2
    await manager.stop("r1-0", grace=5)


async def test_a_new_placement_proof_for_the_running_generation_is_kept_and_the_engine_runs_on(
        manager, recorder, tmp_path, nursery):
    """The cluster secret was rotated: the control plane sends the running shard's StartShard again with a proof
    made with the new key; the agent keeps it (ledger, reports) without touching the engine."""
    await nursery.start(manager.run)
    manager.start(dataclasses.replace(sim_shard(), placement_proof="old proof"))
    ready = await recorder.wait_for("r1-0", State.READY)
    manager.start(dataclasses.replace(sim_shard(), placement_proof="new proof"))
    assert manager.get("r1-0").report().placement_proof == "new proof"
    assert recorder.reports[-1][1].placement_proof == "new proof"  # told at once
    entry = Ledger(tmp_path / "shards.json").get("r1-0")
    assert (entry.pid, entry.spec.placement_proof) == (ready.pid, "new proof")  # what the next agent adopts with
    await trio.sleep(0.3)
    assert running(ready.pid) and recorder.states("r1-0").count(State.STARTING) == 1
    await manager.stop("r1-0", grace=5)


async def test_a_frozen_engine_leaves_ready_and_comes_back_without_a_restart(manager, recorder, nursery):
    await nursery.start(manager.run)
    manager.start(sim_shard())
    ready = await recorder.wait_for("r1-0", State.READY)
    mark = len(recorder.reports)
    os.kill(ready.pid, signal.SIGSTOP)  # busy or stuck: probes time out
    try:
        unhealthy = await recorder.wait_for("r1-0", State.LOADING, after=mark)
        assert unhealthy.reason.startswith("unhealthy: 2 health probes failed in a row")
    finally:
        os.kill(ready.pid, signal.SIGCONT)
    healthy = await recorder.wait_for("r1-0", State.READY, after=mark)
    assert healthy.pid == ready.pid and healthy.restarts == 0  # timeouts alone never restart an engine
    assert healthy.reason.startswith("healthy again")
    await manager.stop("r1-0", grace=5)


async def test_a_supervisor_can_be_used_on_its_own(recorder, tmp_path, nursery):
    ledger = Ledger(tmp_path / "shards.json")
    manager = ShardManager(default_registry(), state_dir=tmp_path, node_address="127.0.0.1", on_status=recorder)
    supervisor = ShardSupervisor(sim_shard(), manager.engines.get("sim"), ctx_factory=manager.launch_context,
                                 ledger=ledger, on_status=recorder, probe_interval=(0.1, 0.5))
    nursery.start_soon(supervisor.run)
    ready = await recorder.wait_for("r1-0", State.READY)
    assert supervisor.report().pid == ready.pid and supervisor.settings.probe_interval == (0.1, 0.5)
    await supervisor.drain(timeout=5, grace=5)
    assert supervisor.state is State.STOPPED and supervisor.finished


async def stubborn_engine_up(folder: Path) -> None:
    """Until the engine of :func:`stubborn_engine` (shard ``r1-0``) says in its log that it ignores SIGTERM."""
    with trio.fail_after(5):
        while "stubborn engine up" not in (folder / "logs" / "r1-0.log").read_text():
            await trio.sleep(0.05)


def stubborn_engine(folder: Path) -> str:
    """An ``llmgw``-like executable that never serves HTTP and ignores SIGTERM."""
    path = folder / "stubborn-llmgw"
    path.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import signal, sys, time
        def ignore(signum, frame):
            print("got SIGTERM, ignoring it", flush=True)
        signal.signal(signal.SIGTERM, ignore)
        print("stubborn engine up", sys.argv[1:], flush=True)
        while True:
            time.sleep(1)
        """))
    path.chmod(0o755)
    return str(path)

