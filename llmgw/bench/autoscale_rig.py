"""The fleet ``llmgw bench autoscale`` runs its traces on: one ``llmgw serve`` (the control plane, the leader) and
remote ``llmgw agent``s on recorded nodes of H100s (fixture discovery), deploying simulator engines.

:meth:`AutoscaleRig.open` writes the config (:func:`fleet_config`: a profile per model, ``llmgw sim --profile
h100-llama-3.1-8b`` with its startup times, and the arm's deployments), starts the control process, then one
agent per node (``node-a``, ``node-b``... each a fixture of ``gpus`` H100s), and returns once every model has
``ready`` replicas routable. Leaving the block stops every process, and the engines (which outlive agents by design)
are killed from the agents' ledgers. :meth:`AutoscaleRig.sample` is what the bench records every sample: per model,
the replicas ready (routable) and starting (placed, or wanted and waiting to be placed:
:func:`~llmgw.gateway.capacity_history.count_replicas`), the requests in
flight (``/admin/replicas``) and the requests queued at the gateway (``llmgw_flow_queued`` on ``/metrics``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from ..gateway.capacity_history import count_replicas
from ..sim.cli import build_parser
from ..testing.cluster import AGENTS, TOKEN, EngineReaper
from ..testing.metrics import samples
from ..testing.processes import Child, llmgw_command, start_child
from .chaos_rig import AGENT_READY, H100, node_fixture
from .cluster_rig import CONTROL, GatewayProcess
from .overload_arms import QUEUE_GAUGE

STARTUP_FLAGS = ("--startup-seconds", "--hot-startup-seconds")  # the simulator's (issue 32)
SLEEP_FLAG = "--enable-sleep-mode"  # a replica can be put to sleep and woken (a hot start) instead of stopped
MODEL_LABEL = re.compile(r'model="([^"]*)"')


def sim_models_startup() -> bool:
    """Whether this llmgw's simulator takes the startup flags (cold and hot time to ready)."""
    return all(flag in build_parser().format_help() for flag in STARTUP_FLAGS)


def profile_name(model: str) -> str:
    return f"h100-{model}"


@dataclass(frozen=True)
class EngineShape:
    """What every replica is: a simulated GPU profile, how many sequences it runs, its startup times (wall s)."""

    profile: str
    max_num_seqs: int
    cold_start: float
    hot_start: float

    def args(self) -> list[str]:
        # JSON logs: the timeline reads when the engine is ready from its own (llmgw/bench/autoscale_timeline.py)
        args = ["--profile", self.profile, "--max-num-seqs", str(self.max_num_seqs), "--log-format", "json"]
        if sim_models_startup():
            args += [STARTUP_FLAGS[0], f"{self.cold_start:g}", STARTUP_FLAGS[1], f"{self.hot_start:g}"]
        if SLEEP_FLAG in build_parser().format_help():
            args.append(SLEEP_FLAG)
        return args


def fleet_config(workdir: Path, engine: EngineShape, deployments: Mapping[str, str], extra: str = "",
                 profile_extra: str = "") -> str:
    """The control process's config: a profile per model of ``deployments`` (model -> its deployment's YAML
    lines after ``profile:``, e.g. ``replicas: 2``), each with ``profile_extra`` (YAML lines, e.g.
    ``sleep_mode: true``), the agents' settings and ``extra`` (top-level YAML)."""
    profiles = "".join(f"""  - name: {profile_name(model)}
    engine: sim
    model_path: tiny
    served_model_name: {model}
    args: {json.dumps(engine.args())}
{profile_extra}""" for model in deployments)
    placed = "".join(f"  - profile: {profile_name(model)}\n    {lines}\n" for model, lines in deployments.items())
    logs = "log_level: info\nlog_format: json\naccess_log: true\n"  # the timeline's (llmgw/bench/autoscale_timeline.py)
    return (logs + AGENTS.replace("agents:\n", f"agents:\n  control_state_dir: {workdir / 'ids'}\n")
            + f"profiles:\n{profiles}deployments:\n{placed}" + extra)


@dataclass(eq=False)
class AutoscaleRig:
    nursery: trio.Nursery
    workdir: Path
    control: GatewayProcess
    agents: list[Child]
    models: tuple[str, ...]
    http: httpx.AsyncClient
    reaper: EngineReaper

    @property
    def url(self) -> str:
        return self.control.url

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, workdir: Path, engine: EngineShape, deployments: Mapping[str, str], ready: Mapping[str, int],
                   *, nodes: int = 2, gpus: int = 4, timeout: float = 180.0,
                   extra_config: str = "", profile_extra: str = "") -> AsyncIterator["AutoscaleRig"]:
        """The fleet of ``deployments`` (see the module's docstring), once each model has ``ready[model]``
        replicas up."""
        workdir.mkdir(parents=True, exist_ok=True)
        with EngineReaper(workdir) as reaper:
            async with httpx.AsyncClient(timeout=2.0) as http, trio.open_nursery() as nursery:
                config = workdir / "llmgw.yaml"
                config.write_text(fleet_config(workdir, engine, deployments, extra_config, profile_extra))
                control = GatewayProcess("llmgw control", CONTROL, config)
                await control.start(nursery)
                rig = cls(nursery, workdir, control, [], tuple(deployments), http, reaper)
                for i in range(nodes):
                    rig.agents.append(await rig.start_agent(f"node-{'abcdefgh'[i]}", i, gpus))
                await rig.wait_ready(ready, timeout)
                try:
                    yield rig
                finally:
                    nursery.cancel_scope.cancel()

    async def start_agent(self, node_id: str, index: int, gpus: int) -> Child:
        fixture = self.workdir / f"{node_id}.json"
        fixture.write_text(json.dumps(node_fixture(gpus, H100, node_id, index)))
        argv = llmgw_command("agent", "--join", self.control.control_url, "--token", TOKEN, "--node-id", node_id,
                             "--state-dir", str(self.workdir / f"agent-{node_id}"), "--address", "127.0.0.1",
                             "--discovery", f"fixture:{fixture}", "--log-level", "info", "--log-format", "json")
        return await start_child(self.nursery, argv, name=f"llmgw agent {node_id}", ready=AGENT_READY,
                                 startup_timeout=60, stop_grace=2)

    def log_lines(self) -> tuple[list[str], list[str]]:
        """The control process's output so far, and every agent's together (JSON log lines: the timeline's)."""
        control = self.control.child.lines if self.control.child is not None else []
        return list(control), [line for agent in self.agents for line in agent.lines]

    async def replicas(self) -> list[dict]:
        listed = (await self.http.get(self.control.control_url + "/admin/replicas")).json()
        self.reaper.update(s["pid"] for r in listed for s in r.get("shards") or () if s.get("pid"))
        return listed

    async def sample(self) -> dict[str, dict[str, int]]:
        """Per model: ready, starting, inflight, queued (see the module's docstring)."""
        counts = count_replicas(await self.replicas(), self.models)
        for found in counts.values():
            found["queued"] = 0
        text = (await self.http.get(self.control.control_url + "/metrics")).text
        for key, value in samples(text).items():
            if key.partition("{")[0] == QUEUE_GAUGE and (label := MODEL_LABEL.search(key)) is not None:
                if label.group(1) in counts:
                    counts[label.group(1)]["queued"] += int(value)
        return counts

    async def wait_ready(self, ready: Mapping[str, int], timeout: float) -> None:
        """Until each model has at least ``ready[model]`` replicas up."""
        last: dict | Exception = {}
        try:
            with trio.fail_after(timeout):
                while True:
                    try:
                        last = await self.sample()
                        if all(last[m]["ready"] >= n for m, n in ready.items()):
                            return
                    except (httpx.HTTPError, ValueError, KeyError) as exc:
                        last = exc
                    await trio.sleep(0.2)
        except trio.TooSlowError:
            raise RuntimeError(f"the fleet did not get {dict(ready)} replicas ready in {timeout:g} s; "
                               f"last: {last!r}") from None


def ready_counts(models: Sequence[str], count: int) -> dict[str, int]:
    return dict.fromkeys(models, count)
