"""Data-plane overhead: llmgw vs the upstream called directly vs the Rust ``vllm-router``.

Measures, with ``wrk`` (one thread) and a Lua POST script, for each target:

* added latency at concurrency 1 (p50/p99 of small non-streaming chat completions,
  minus the upstream called directly),
* maximum requests/s at concurrency 32 for small non-streaming POSTs,
* maximum 50-chunk SSE streams/s at concurrency 32 (and a whole stream's p50 at c=1),
* the proxy's CPU (µs per request on its one core), and how much of that core other
  processes took meanwhile (a busy machine shows up there, not silently in the numbers).

Targets: ``direct`` (one fake upstream), ``llmgw`` (``llmgw serve`` with one model,
two replicas = two fake upstreams, round_robin), ``vllm-router`` 0.1.17
(``--policy round_robin``, the same two upstreams), and with ``--baseline DIR`` the llmgw
of another checkout (``git worktree add /tmp/base <commit>``) as ``llmgw-baseline``.
Opt-in TLS targets (``--targets ...,direct-tls,llmgw-tls,llmgw-https``): ``llmgw-tls`` relays
plaintext clients to two fake upstreams serving HTTPS (``https://`` replicas, verified
against a test CA), ``llmgw-https`` also serves HTTPS itself (``data_tls``; wrk speaks
TLS); their cost over plain ``llmgw`` is reported as ``tls_overhead``. ``direct-tls`` is
one HTTPS upstream called directly (what the upstream side of TLS costs on its own). They need the
``trustme`` package (the test extra) for the certificates.
Opt-in ``llmgw-keyed`` and ``llmgw-limited``: the same llmgw config with one API key, which every request
carries; ``llmgw-keyed``'s key has no limits (its requests are authenticated, their usage recorded and a stream's
usage asked of the engine and stripped; no await is added), ``llmgw-limited``'s has rpm, tpm and concurrency
limits far above what the run sends (every request is admitted before routing and settled after: the limiter's
cost, in this one process). Their added p50 and CPU per request over plain ``llmgw`` (round by round) are
reported as ``ratios_<target>_vs_llmgw``.
Opt-in ``llmgw-redis``: the same llmgw config with ``state: backend: redis`` on a private
``redis-server`` (on the upstreams' CPU): one control process that still publishes its load every
50 ms and runs the log writer. Its CPU per request and added p50 over plain ``llmgw`` (round by
round) are reported as ``ratios_llmgw_redis_vs_llmgw``, with the targets (<= 1.1x, <= 1.05x);
the server's own CPU over the measurement is in ``checks.redis_cpu_s``.
The proxy under test is pinned to CPU 1; wrk and the upstreams to CPU 0 (``taskset``), as
in ``docs/vllm-notes.md`` section 6. All targets run at once (idle ones cost nothing)
and every round measures each scenario on each target in turn, so that whatever else the
machine does falls on all of them alike; medians over the rounds are reported, and ratios
are the median of round-by-round ratios. Everything listens on 127.0.0.1 with ephemeral
ports; every process is started and stopped here (also on Ctrl-C), each run is bounded.
How far to trust the numbers: the spread of each target's CPU per request over the rounds, the
machine's state (load average before and after, CPU 1's frequency governor where readable, the
other processes that ran on the proxy's core: ``machine_state``), and no ratio printed (nor a
target met or missed) where the per-round ratios differ by more than 10% (``agreement``);
docs/development.md, "A quiet measurement", says how to take one worth quoting.

Run: ``llmgw bench proxy [--duration 10] [--repeat 3] [--json bench-results/proxy.json]``.
Needs ``wrk`` and ``taskset`` (Debian: ``apt-get install wrk util-linux``). vllm-router
is looked up with ``--vllm-router``, on PATH, in ``/tmp/vr`` or ``bench-results/vr-venv``,
and installed into ``bench-results/vr-venv`` when missing (``--no-install`` to skip it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import platform
import re
import shlex
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

from llmgw.testing.processes import SERVE_READY, Child, ChildFailed, checkout_env, free_port, start_child
from llmgw.testing.redis import start_private_redis

from . import machine_state
from .agreement import RATIO_SPREAD_BOUND, disagreement, spread
from .cluster_rig import state_section
from .common import cell as fmt

VLLM_ROUTER_VERSION = "0.1.17"
PROXY_CPU = 1
LOAD_CPU = 0
MODEL = "tiny"
SMALL_BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                        separators=(",", ":"))
STREAM_BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
                          "stream": True}, separators=(",", ":"))
PATH = "/v1/chat/completions"
BASELINE = "llmgw-baseline"
TLS_TARGETS = ("llmgw-tls", "llmgw-https")  # llmgw over TLS, compared with plain llmgw
REDIS_TARGET = "llmgw-redis"  # llmgw with its state on Redis, compared with plain llmgw (state: local)
BENCH_KEY = "sk-bench-proxy-key"
# llmgw with an API key every request carries, compared with plain llmgw: the key's limits (none; never reached).
TENANT_TARGETS = {"llmgw-keyed": "", "llmgw-limited": "    limits: {rpm: 100000000, tpm: 100000000000, "
                                                      "concurrency: 100000}\n"}
REDIS_CPU_TARGET, REDIS_P50_TARGET = 1.1, 1.05
QUIET_BUSY = 0.10  # share of the machine's CPUs busy just before the run above which it is not quiet
QUIET_SAMPLE_S = 2.0  # how long the machine's idle targets are watched for that share
QUIET_OTHERS = 0.05  # share of the proxy's core others (and the hypervisor) may take in a run of a quiet measurement
DIRECT_TLS = "direct-tls"

LUA = r"""
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
%(headers)sdone = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%%d,"duration_us":%%d,"bytes":%%d,"connect_errors":%%d,"read_errors":%%d,' ..
    '"write_errors":%%d,"status_errors":%%d,"timeout_errors":%%d,"lat_mean_us":%%.1f,"lat_max_us":%%d,' ..
    '"p50_us":%%d,"p90_us":%%d,"p99_us":%%d,"p999_us":%%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency.max, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9)))
end
"""


class BenchError(RuntimeError):
    pass


# -- processes ---------------------------------------------------------------------------------------------------------
# Children run under llmgw.testing's runner with their output in a file of the work dir (nothing of theirs passes
# through this process while wrk measures); each is in its own process group, stopped when the nursery ends.

def process_cpu_seconds(pid: int) -> float:
    """User+system CPU of process ``pid``, its threads and descendants (and their reaped children), from /proc."""
    stats = (machine_state.process_stat(one) for one in [pid] + _descendants(pid))
    return sum(stat[1] for stat in stats if stat is not None)


def _descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``: the children of each of its threads (trio starts processes from a worker
    thread, under whose ``children`` they are listed while that thread lives), and theirs."""
    out: list[int] = []
    children: list[str] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                children += (task / "children").read_text().split()
            except OSError:
                continue  # a thread that just exited
    except OSError:
        return out
    for child in dict.fromkeys(children):
        out.append(int(child))
        out.extend(_descendants(int(child)))
    return out


async def start(nursery: trio.Nursery, workdir: Path, name: str, argv: list[str], cpu: int | None,
                ready: re.Pattern | None, timeout: float, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> Child:
    """``argv`` pinned to ``cpu`` (``taskset``), its output in ``workdir/NAME.log``, once it printed ``ready``."""
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu)] + argv
    try:
        return await start_child(nursery, argv, name=name, ready=ready, startup_timeout=timeout, cwd=cwd,
                                 output_file=workdir / f"{name}.log", env=env)
    except ChildFailed as exc:
        raise BenchError(str(exc)) from None


UPSTREAM_READY = re.compile(r"listening on (https?://\S+)")
GATEWAY_READY = re.compile(r"llmgw listening on (https?://\S+)")


def http_post(url: str, body: str, timeout: float = 5.0, tls: ssl.SSLContext | None = None,
              authorization: str | None = None) -> tuple[int, bytes, dict]:
    host, port = url.split("//", 1)[1].split(":")
    conn: http.client.HTTPConnection
    if url.startswith("https://"):
        conn = http.client.HTTPSConnection(host, int(port), timeout=timeout, context=tls)
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if authorization:
            headers["Authorization"] = authorization
        conn.request("POST", PATH, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def wait_ready(url: str, timeout: float, proc: Child | None = None, tls: ssl.SSLContext | None = None,
               authorization: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.returncode is not None:
            raise BenchError(f"{proc.name} exited with code {proc.returncode}:\n{proc.output(30)}")
        try:
            status, body, _ = http_post(url, SMALL_BODY, timeout=2, tls=tls, authorization=authorization)
            if status == 200:
                return
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise BenchError(f"{url} was not ready within {timeout:g}s (last: {last})"
                     + (f"\n{proc.output(30)}" if proc else ""))


def check_target(name: str, url: str, tls: ssl.SSLContext | None = None, authorization: str | None = None) -> dict:
    """One request of each kind, checked by hand: what wrk will count must be real answers."""
    status, body, headers = http_post(url, SMALL_BODY, tls=tls, authorization=authorization)
    if status != 200 or b'"choices"' not in body:
        raise BenchError(f"{name}: a non-streaming request got HTTP {status}: {body[:300]!r}")
    status, body, _ = http_post(url, STREAM_BODY, tls=tls, authorization=authorization)
    events = body.count(b"data: ")
    if status != 200 or not body.rstrip().endswith(b"data: [DONE]"):
        raise BenchError(f"{name}: a streaming request got HTTP {status} and {events} events: {body[-300:]!r}")
    return {"stream_events": events, "served_by": headers.get("x-served-by"),
            "replica_header": headers.get("x-llmgw-replica"),
            "ratelimit_headers": sorted(name for name in headers if name.startswith("x-ratelimit-"))}


def check_shared_state(control_url: str, timeout: float = 15.0) -> dict:
    """``/admin/cluster`` of a gateway on Redis, once its shared state is live (not degraded)."""
    host, port = control_url.split("//", 1)[1].split(":")
    deadline = time.monotonic() + timeout
    while True:
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            conn.request("GET", "/admin/cluster")
            state = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        if state.get("backend") == "redis" and not state.get("degraded"):
            return {k: state.get(k) for k in ("backend", "role", "degraded", "log", "redis")}
        if time.monotonic() > deadline:
            raise BenchError(f"{control_url}/admin/cluster: the shared state is not live: {state}")
        time.sleep(0.1)


# -- wrk ---------------------------------------------------------------------------------------------------------------

def lua_script(workdir: Path, name: str, body: str, authorization: str | None = None) -> Path:
    path = workdir / f"{name}.lua"
    headers = f'wrk.headers["Authorization"] = "{authorization}"\n' if authorization else ""
    path.write_text(LUA % {"body": "[==[" + body + "]==]", "headers": headers})
    return path


@dataclass
class RunResult:
    target: str
    scenario: str
    connections: int
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    errors: dict
    proxy_cpu_share: float | None  # of one core, 0..1+
    proxy_cpu_us_per_request: float | None
    proxy_core_busy: float | None = None  # share of the proxy's core busy with anything (ours or not)
    proxy_core_steal: float | None = None  # share of the proxy's core taken by the hypervisor
    others_on_core: list[dict] = field(default_factory=list)  # machine_state.busy_on_core: who else ran there
    command: list[str] = field(default_factory=list)

    @property
    def foreign_cpu_share(self) -> float | None:
        """How much of the proxy's core other processes used during the run (other people's work)."""
        if self.proxy_core_busy is None or self.proxy_cpu_share is None:
            return None
        return max(0.0, self.proxy_core_busy - self.proxy_cpu_share)

    @property
    def ok(self) -> bool:
        return not any(self.errors.values()) and self.requests > 0


def core_times(cpu: int) -> tuple[float, float, float]:
    """(busy, steal, total) seconds of one CPU since boot, from /proc/stat (zeros where not readable)."""
    return machine_state.cpu_times(f"cpu{cpu}") or (0.0, 0.0, 0.0)


def run_wrk(url: str, script: Path, connections: int, duration: float, proxy: Child | None,
            target: str, scenario: str) -> RunResult:
    duration = max(1, round(duration))  # wrk takes whole seconds
    argv = ["taskset", "-c", str(LOAD_CPU), "wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "5s",
            "-s", str(script), url + PATH]
    cpu_before = process_cpu_seconds(proxy.pid) if proxy else None
    core_before = core_times(PROXY_CPU)
    processes_before = machine_state.processes()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 30)
    except subprocess.TimeoutExpired:
        raise BenchError(f"wrk did not finish within {duration + 30:g}s: {shlex.join(argv)}") from None
    cpu_after = process_cpu_seconds(proxy.pid) if proxy else None
    core_after = core_times(PROXY_CPU)
    ours = {proxy.pid, *_descendants(proxy.pid)} if proxy else set()
    others = machine_state.busy_on_core(processes_before, machine_state.processes(), PROXY_CPU, ours)
    core_span = core_after[2] - core_before[2]
    line = next((out for out in done.stdout.splitlines() if out.startswith("WRKJSON ")), None)
    if done.returncode != 0 or line is None:
        raise BenchError(f"wrk failed (code {done.returncode}): {shlex.join(argv)}\n{done.stdout}\n{done.stderr}")
    data = json.loads(line[len("WRKJSON "):])
    seconds = data["duration_us"] / 1e6
    requests = data["requests"]
    cpu = (cpu_after - cpu_before) if cpu_after is not None and cpu_before is not None else None
    errors = {k: data[k] for k in ("connect_errors", "read_errors", "write_errors", "status_errors",
                                   "timeout_errors")}
    return RunResult(
        target=target, scenario=scenario, connections=connections, requests=requests, seconds=seconds,
        rps=requests / seconds if seconds else 0.0,
        p50_ms=data["p50_us"] / 1000, p90_ms=data["p90_us"] / 1000, p99_ms=data["p99_us"] / 1000,
        p999_ms=data["p999_us"] / 1000, max_ms=data["lat_max_us"] / 1000, errors=errors,
        proxy_cpu_share=(cpu / seconds) if cpu is not None and seconds else None,
        proxy_cpu_us_per_request=(cpu / requests * 1e6) if cpu is not None and requests else None,
        proxy_core_busy=(core_after[0] - core_before[0]) / core_span if core_span > 0 else None,
        proxy_core_steal=(core_after[1] - core_before[1]) / core_span if core_span > 0 else None,
        others_on_core=others, command=argv,
    )


SCENARIOS = [
    # name, body, connections, what it measures
    ("c1", SMALL_BODY, 1, "non-streaming, c=1: latency"),
    ("c32", SMALL_BODY, 32, "non-streaming, c=32: max requests/s"),
    ("stream_c1", STREAM_BODY, 1, "50-chunk stream, c=1: latency of a whole stream"),
    ("stream_c32", STREAM_BODY, 32, "50-chunk streams, c=32: max streams/s"),
]


@dataclass
class Target:
    name: str
    url: str
    proc: Child | None  # None for the upstream called directly
    authorization: str | None = None  # the Authorization header every request carries


def run_interleaved(targets: list[Target], workdir: Path, duration: float, warmup: float,
                    repeat: int) -> list[RunResult]:
    """Every scenario on every target, target after target, ``repeat`` rounds.

    Interleaving puts whatever else the machine is doing on all targets alike, instead of
    on whichever one happened to run while it did.
    """
    results = []
    scripts = {(scenario, target.authorization): lua_script(
        workdir, f"{scenario}-{target.name}" if target.authorization else scenario, body, target.authorization)
        for scenario, body, _, _ in SCENARIOS for target in targets}
    for round_ in range(repeat):
        for scenario, _, connections, _ in SCENARIOS:
            for target in targets:
                script = scripts[scenario, target.authorization]
                if warmup and round_ == 0:
                    run_wrk(target.url, script, connections, warmup, None, target.name, scenario + "-warmup")
                result = run_wrk(target.url, script, connections, duration, target.proc, target.name, scenario)
                flag = "" if result.ok else f"  ERRORS {result.errors}"
                cpu = ""
                if result.proxy_cpu_share is not None:
                    cpu = f"  proxy CPU {result.proxy_cpu_share * 100:3.0f}%"
                    if result.foreign_cpu_share is not None:
                        cpu += f" (others on its core {result.foreign_cpu_share * 100:.0f}%)"
                print(f"  [{round_ + 1}/{repeat}] {target.name:12s} {scenario:10s} {result.rps:9.0f} req/s  "
                      f"p50 {result.p50_ms:7.3f} ms  p99 {result.p99_ms:7.3f} ms{cpu}{flag}", flush=True)
                results.append(result)
    return results


# -- targets -----------------------------------------------------------------------------------------------------------

def find_vllm_router(explicit: str | None, install: bool, repo: Path) -> tuple[str | None, str]:
    """The vllm-router executable and how it was found (installing it when allowed)."""
    candidates: list[str | None] = [explicit] if explicit else []
    candidates += [shutil.which("vllm-router"), str(Path(sys.executable).with_name("vllm-router")),
                   "/tmp/vr/bin/vllm-router",
                   str(repo / "bench-results/vr-venv/bin/vllm-router")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate, "found"
    if explicit:
        raise BenchError(f"--vllm-router {explicit} is not an executable")
    if not install:
        return None, "missing (--no-install)"
    venv = repo / "bench-results" / "vr-venv"
    python = shutil.which("python3.11") or sys.executable
    print(f"vllm-router not found: installing vllm-router=={VLLM_ROUTER_VERSION} into {venv} ...", flush=True)
    try:
        subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(venv / "bin/pip"), "install", "-q", f"vllm-router=={VLLM_ROUTER_VERSION}"], check=True,
                       timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return None, f"install failed: {exc}"
    return str(venv / "bin/vllm-router"), "installed"


def vllm_router_version(executable: str) -> str | None:
    python = Path(executable).with_name("python")
    if python.exists():
        done = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            return done.stdout.strip()
    return None


def llmgw_config(upstreams: list[str], tls: "BenchPki | None" = None, https_listener: bool = False) -> str:
    replicas = "\n".join(f"      - url: {url}\n        name: up-{i}" for i, url in enumerate(upstreams))
    text = (f"# generated by llmgw.bench.proxy\nlog_level: warning\nmodels:\n  - name: {MODEL}\n"
            f"    routing: round_robin\n    replicas:\n{replicas}\n")
    if tls is not None:
        text += f"upstream_tls:\n  ca_file: {tls.ca}\n"
        if https_listener:
            text += f"data_tls:\n  cert_file: {tls.server}\n"
    return text


@dataclass
class BenchPki:
    """A test CA and a certificate for 127.0.0.1 (both PEM files), for the TLS targets."""

    ca: Path
    server: Path

    @classmethod
    def create(cls, workdir: Path) -> "BenchPki":
        try:
            import trustme
        except ImportError:
            raise BenchError("the TLS targets need the trustme package: pip install -e '.[test]'") from None
        authority = trustme.CA()
        pki = cls(workdir / "bench-ca.pem", workdir / "bench-server.pem")
        authority.cert_pem.write_to_path(str(pki.ca))
        authority.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pki.server))
        return pki

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


def machine_info() -> dict:
    info: dict = {"hostname": platform.node(), "kernel": platform.release(), "machine": platform.machine(),
                  "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.+)", cpuinfo)
        info["cpu_model"] = model.group(1).strip() if model else None
        mem = re.search(r"MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text())
        info["memory_gib"] = round(int(mem.group(1)) / 2**20, 1) if mem else None
    except OSError:
        pass
    try:
        info["virtualization"] = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True,
                                                timeout=5).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def versions(repo: Path) -> dict:
    from importlib import metadata

    out: dict = {}
    for dist in ("trio", "httptools", "prometheus-client", "hypercorn", "quart-trio"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "llmgw"], cwd=repo, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        out["llmgw_git"] = head + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        out["llmgw_git"] = None
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True, timeout=10)
    out["wrk"] = (wrk.stdout + wrk.stderr).strip().splitlines()[0] if (wrk.stdout + wrk.stderr).strip() else None
    return out


# -- report ------------------------------------------------------------------------------------------------------------

def _median(values: list[float]) -> float:
    return statistics.median(values)


def _median_known(values: list[float | None]) -> float | None:
    """The median of the values that are known; None when none is."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _runs(results: list[RunResult], target: str, scenario: str) -> list[RunResult]:
    return [r for r in results if r.target == target and r.scenario == scenario]


def summarize(results: list[RunResult], targets: list[str]) -> dict:
    """Medians over the rounds (and bests), added latency over the direct upstream, and llmgw/vllm-router ratios.

    Ratios are taken round by round (the two proxies ran one after the other, so they shared
    the machine's conditions) and the median of those is reported.
    """
    summary: dict = {}
    for target in targets:
        row: dict = {}
        for scenario, *_ in SCENARIOS:
            runs = _runs(results, target, scenario)
            if not runs:
                continue
            cell: dict = {
                "rps": round(_median([r.rps for r in runs]), 1),
                "rps_best": round(max(r.rps for r in runs), 1),
                "p50_ms": round(_median([r.p50_ms for r in runs]), 3),
                "p50_ms_best": round(min(r.p50_ms for r in runs), 3),
                "p99_ms": round(_median([r.p99_ms for r in runs]), 3),
                "ok": all(r.ok for r in runs),
                "rounds": len(runs),
                "rps_spread": spread([r.rps for r in runs]),
            }
            cpu = _median_known([r.proxy_cpu_share for r in runs])
            per_request = _median_known([r.proxy_cpu_us_per_request for r in runs])
            if cpu is not None and per_request is not None:
                cell["proxy_cpu_share"] = round(cpu, 3)
                cell["proxy_cpu_us_per_request"] = round(per_request, 1)
                cell["others_on_proxy_core_max"] = round(max(r.foreign_cpu_share or 0.0 for r in runs), 3)
                cell["proxy_core_steal_max"] = round(max(r.proxy_core_steal or 0.0 for r in runs), 3)
                per_round = [r.proxy_cpu_us_per_request for r in runs if r.proxy_cpu_us_per_request is not None]
                cell["proxy_cpu_us_per_request_rounds"] = [round(us, 1) for us in per_round]
                cell["proxy_cpu_us_per_request_spread"] = spread(per_round)
                cell["others_on_proxy_core"] = machine_state.busiest_by_name([r.others_on_core for r in runs])
            direct = _runs(results, "direct", scenario)
            if target != "direct" and direct:
                cell["added_p50_ms"] = round(cell["p50_ms"] - _median([r.p50_ms for r in direct]), 3)
                cell["added_p99_ms"] = round(cell["p99_ms"] - _median([r.p99_ms for r in direct]), 3)
            row[scenario] = cell
        summary[target] = row
    if "llmgw" in summary and "vllm-router" in summary:
        ratios = _pair_ratios(results, "llmgw", "vllm-router")
        summary["ratios_llmgw_vs_vllm_router"] = ratios
        summary["targets_met"] = {
            "rps_at_least_0.9x": _met(ratios, "c32_rps_ratio", at_least=0.9),
            "stream_rps_at_least_0.9x": _met(ratios, "stream_c32_rps_ratio", at_least=0.9),
            "added_p50_at_most_1.2x": _met(ratios, "c1_added_p50_ratio", at_most=1.2),
        }
    if "llmgw" in summary and BASELINE in summary:
        summary["ratios_llmgw_vs_baseline"] = _pair_ratios(results, "llmgw", BASELINE)
    for target in TENANT_TARGETS:
        if "llmgw" in summary and target in summary:
            summary[f"ratios_{target}_vs_llmgw"] = _pair_ratios(results, target, "llmgw") | _cpu_ratios(
                results, target, "llmgw")
    if "llmgw" in summary and REDIS_TARGET in summary:
        ratios = _pair_ratios(results, REDIS_TARGET, "llmgw") | _cpu_ratios(results, REDIS_TARGET, "llmgw")
        summary["ratios_llmgw_redis_vs_llmgw"] = ratios
        summary["redis_targets_met"] = {
            f"cpu_per_request_at_most_{REDIS_CPU_TARGET}x": _met(ratios, "c32_cpu_ratio", at_most=REDIS_CPU_TARGET),
            f"added_p50_at_most_{REDIS_P50_TARGET}x": _met(ratios, "c1_added_p50_ratio", at_most=REDIS_P50_TARGET),
        }
    overhead = {target: tls_overhead(summary, results, target) for target in TLS_TARGETS
                if target in summary and "llmgw" in summary}
    if overhead:
        summary["tls_overhead"] = overhead
    return summary


def tls_overhead(summary: dict, results: list[RunResult], target: str) -> dict:
    """What TLS costs over plain llmgw: added p50 and CPU per request, and requests/s as a ratio."""
    tls_row, plain_row = summary[target], summary["llmgw"]
    out: dict = {}
    for scenario in ("c1", "stream_c1"):
        if scenario in tls_row and scenario in plain_row:
            out[f"{scenario}_added_p50_ms"] = round(tls_row[scenario]["p50_ms"] - plain_row[scenario]["p50_ms"], 3)
    for scenario in ("c32", "stream_c32"):
        if scenario in tls_row and scenario in plain_row:
            tls_cpu = tls_row[scenario].get("proxy_cpu_us_per_request")
            plain_cpu = plain_row[scenario].get("proxy_cpu_us_per_request")
            if tls_cpu is not None and plain_cpu is not None:
                out[f"{scenario}_added_cpu_us_per_request"] = round(tls_cpu - plain_cpu, 1)
    for key, value in _pair_ratios(results, target, "llmgw").items():
        if key.endswith("rps_ratio") or key.endswith("rps_ratio_rounds"):
            out[key] = value
    return out


def _put_ratio(ratios: dict, name: str, per_round: list[float]) -> None:
    """``ratios[name]``: the median of the per-round ratios (none: nothing put), with ``NAME_rounds`` and, when
    the rounds disagree beyond :data:`RATIO_SPREAD_BOUND`, ``NAME_refused`` saying so (the table then prints no
    median; the JSON keeps it, flagged)."""
    if not per_round:
        return
    ratios[name] = round(_median(per_round), 3)
    ratios[f"{name}_rounds"] = [round(r, 3) for r in per_round]
    observed = spread(per_round)
    if observed is not None:
        ratios[f"{name}_spread"] = round(observed, 3)
    refused = disagreement(per_round)
    if refused:
        ratios[f"{name}_refused"] = refused


def ratio_text(ratios: dict, name: str, digits: int = 2) -> str:
    """``ratios[name]`` for the table: the median and its rounds, or why it is not printed."""
    if name not in ratios:
        return "n/a"
    rounds = ", ".join(f"{x:.{digits}f}" for x in ratios[f"{name}_rounds"])
    if f"{name}_refused" in ratios:
        return f"{ratios[name + '_refused']}  (rounds: {rounds})"
    return f"{ratios[name]:.{digits}f}x  (rounds: {rounds})"


def _met(ratios: dict, name: str, at_least: float | None = None, at_most: float | None = None) -> bool | None:
    """Whether ``ratios[name]`` is at least ``at_least`` or at most ``at_most``; None when it was not measured or
    its rounds disagree (no target is met or missed on noise)."""
    if name not in ratios or f"{name}_refused" in ratios:
        return None
    return ratios[name] >= at_least if at_least is not None else ratios[name] <= (at_most or 0.0)


def _pair_ratios(results: list[RunResult], a: str, b: str) -> dict:
    """``a`` over ``b``, round by round (requests/s, and added p50 latency over the direct upstream)."""
    ratios: dict = {}
    for scenario in ("c32", "stream_c32"):
        pairs = zip(_runs(results, a, scenario), _runs(results, b, scenario))
        per_round = [x.rps / y.rps for x, y in pairs if y.rps]
        _put_ratio(ratios, f"{scenario}_rps_ratio", per_round)
    for scenario in ("c1", "stream_c1"):
        triples = zip(_runs(results, a, scenario), _runs(results, b, scenario), _runs(results, "direct", scenario))
        per_round = [(x.p50_ms - d.p50_ms) / (y.p50_ms - d.p50_ms) for x, y, d in triples if y.p50_ms - d.p50_ms > 0]
        _put_ratio(ratios, f"{scenario}_added_p50_ratio", per_round)
    return ratios


def _cpu_ratios(results: list[RunResult], a: str, b: str) -> dict:
    """``a``'s proxy CPU per request over ``b``'s, round by round, per scenario."""
    ratios: dict = {}
    for scenario, *_ in SCENARIOS:
        pairs = zip(_runs(results, a, scenario), _runs(results, b, scenario))
        per_round = [x.proxy_cpu_us_per_request / y.proxy_cpu_us_per_request for x, y in pairs
                     if x.proxy_cpu_us_per_request is not None and y.proxy_cpu_us_per_request]
        _put_ratio(ratios, f"{scenario}_cpu_ratio", per_round)
    return ratios


def _with_spread(cell: dict, key: str) -> str:
    """``cell[key]`` and the spread of its rounds ((max - min) / median), for the table."""
    observed = cell.get(f"{key}_spread")
    return fmt(cell.get(key), ".0f") + ("" if observed is None else f" ({observed * 100:.0f}%)")


def print_machine_state(state: dict, summary: dict, targets: list[str]) -> None:
    """The machine around the measurement: load, the proxy core's governor, who else ran on that core; and, when
    it was not quiet, that the numbers are not a quiet measurement."""
    before, after = state.get("before", {}), state.get("after", {})
    load = " / ".join(" ".join(f"{x:.2f}" for x in s["loadavg"]) if s.get("loadavg") else "unknown"
                      for s in (before, after))
    print()
    busy = before.get("busy")
    print(f"machine: load average (1, 5, 15 min) {load} before / after, {before.get('cpus')} CPUs"
          + ("" if busy is None else f", {busy * 100:.0f}% busy in the {QUIET_SAMPLE_S:g} s before the run") + "; "
          f"CPU {PROXY_CPU}'s frequency governor: {before.get('governor') or 'not readable (no cpufreq here)'}")
    others: dict[str, float] = {}
    for target in targets:
        for cell in summary.get(target, {}).values():
            for process in cell.get("others_on_proxy_core", []):
                others[process["name"]] = others.get(process["name"], 0.0) + process["cpu_s"]
    if others:
        busiest = sorted(others.items(), key=lambda item: -item[1])[:machine_state.TOP]
        print(f"other processes on CPU {PROXY_CPU} while the proxies were measured (CPU seconds): "
              + ", ".join(f"{name} {seconds:.1f}" for name, seconds in busiest))
    reasons = not_quiet_reasons(before, summary, targets)
    if reasons:
        print(f"NOT A QUIET MEASUREMENT ({'; '.join(reasons)}): read these numbers as this machine's today; "
              f"docs/development.md, \"A quiet measurement\", says how to take one")


def not_quiet_reasons(before: dict, summary: dict, targets: list[str]) -> list[str]:
    """Why a run was not a quiet measurement: the machine busy just before it started, its targets idle (not the
    load average: after a run it is the run's own, and before one it still holds the last run's minute), or others
    or the hypervisor taking more than :data:`QUIET_OTHERS` of the proxy's core in some scenario. Empty when it
    was quiet."""
    reasons = []
    busy = before.get("busy")
    if busy is not None and busy > QUIET_BUSY:
        reasons.append(f"the CPUs {busy * 100:.0f}% busy before the run, above {QUIET_BUSY * 100:.0f}%")
    cells = [cell for target in targets for cell in summary.get(target, {}).values()]
    others = max((cell.get("others_on_proxy_core_max") or 0.0 for cell in cells), default=0.0)
    if others > QUIET_OTHERS:
        reasons.append(f"others took up to {others * 100:.0f}% of the proxy's core")
    steal = max((cell.get("proxy_core_steal_max") or 0.0 for cell in cells), default=0.0)
    if steal > QUIET_OTHERS:
        reasons.append(f"the hypervisor took up to {steal * 100:.0f}% of the proxy's core (steal)")
    return reasons


def print_table(summary: dict, targets: list[str]) -> None:
    cols = ["target", "c=1 p50 ms", "added p50", "c=1 p99 ms", "added p99", "c=32 req/s", "CPU µs/req (spread)",
            "c=32 streams/s", "stream CPU µs", "stream c=1 p50 ms", "others on core"]
    print()
    print("medians over the rounds (best c=32 req/s in brackets); proxy CPU is per request on its one core")
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("-" * (len(c) + 2) for c in cols) + "|")
    for target in targets:
        row = summary.get(target, {})
        c1, c32, s1, s32 = (row.get(k, {}) for k in ("c1", "c32", "stream_c1", "stream_c32"))
        bad = "" if all(x.get("ok", True) for x in (c1, c32, s1, s32)) else " (errors!)"
        others = max((x.get("others_on_proxy_core_max") or 0.0) for x in (c1, c32, s1, s32))
        cells = [
            target + bad, fmt(c1.get("p50_ms"), ".3f"), fmt(c1.get("added_p50_ms"), "+.3f"),
            fmt(c1.get("p99_ms"), ".3f"), fmt(c1.get("added_p99_ms"), "+.3f"),
            f"{fmt(c32.get('rps'), '.0f')} ({fmt(c32.get('rps_best'), '.0f')})",
            _with_spread(c32, "proxy_cpu_us_per_request"), fmt(s32.get("rps"), ".0f"),
            fmt(s32.get("proxy_cpu_us_per_request"), ".0f"), fmt(s1.get("p50_ms"), ".3f"),
            "-" if target in ("direct", DIRECT_TLS) else f"up to {others * 100:.0f}%",
        ]
        print("| " + " | ".join(cells) + " |")
    for key, title, with_targets in (("ratios_llmgw_vs_vllm_router", "llmgw / vllm-router", True),
                                     ("ratios_llmgw_vs_baseline", f"llmgw / {BASELINE}", False)):
        ratios = summary.get(key)
        if not ratios:
            continue

        def r(name):
            return ratio_text(ratios, name)

        print()
        print(f"{title} (median of per-round ratios; none printed where they differ by more than "
              f"{RATIO_SPREAD_BOUND * 100:.0f}% of it):")
        at_least, at_most = ("  target >= 0.9x", "  target <= 1.2x") if with_targets else ("", "")
        print(f"  requests/s at c=32 (non-streaming): {r('c32_rps_ratio')}{at_least}")
        print(f"  streams/s at c=32 (50 chunks):      {r('stream_c32_rps_ratio')}{at_least}")
        print(f"  added p50 latency at c=1:           {r('c1_added_p50_ratio')}{at_most}")
        print(f"  added p50 of a whole stream at c=1: {r('stream_c1_added_p50_ratio')}")
    redis_ratios: dict = summary.get("ratios_llmgw_redis_vs_llmgw") or {}
    if redis_ratios:
        def rr(name):
            return ratio_text(redis_ratios, name, 3)

        print()
        print(f"{REDIS_TARGET} / llmgw (state on Redis over state: local; median of per-round ratios):")
        print(f"  proxy CPU per request, c=32:        {rr('c32_cpu_ratio')}  target <= {REDIS_CPU_TARGET}x")
        print(f"  proxy CPU per request, c=1:         {rr('c1_cpu_ratio')}")
        print(f"  proxy CPU per stream, c=32:         {rr('stream_c32_cpu_ratio')}")
        print(f"  added p50 latency at c=1:           {rr('c1_added_p50_ratio')}  target <= {REDIS_P50_TARGET}x")
        print(f"  added p50 of a whole stream at c=1: {rr('stream_c1_added_p50_ratio')}")
        print(f"  requests/s at c=32:                 {rr('c32_rps_ratio')}")
    for target in TENANT_TARGETS:
        tenant_ratios: dict = summary.get(f"ratios_{target}_vs_llmgw") or {}
        if tenant_ratios:
            print()
            limited = " with limits" if TENANT_TARGETS[target] else ""
            print(f"{target} / llmgw (every request carries an API key{limited}; median of per-round ratios):")
            for name, what in (("c1_added_p50_ratio", "added p50 latency at c=1"),
                               ("stream_c1_added_p50_ratio", "added p50 of a whole stream at c=1"),
                               ("c32_cpu_ratio", "proxy CPU per request, c=32"),
                               ("stream_c32_cpu_ratio", "proxy CPU per stream, c=32"),
                               ("c32_rps_ratio", "requests/s at c=32")):
                print(f"  {what + ':':36s}{ratio_text(tenant_ratios, name, 3)}")
    for target, overhead in summary.get("tls_overhead", {}).items():
        print()
        print(f"{target} over plain llmgw (what TLS costs):")
        print(f"  added p50 at c=1: {overhead.get('c1_added_p50_ms', 'n/a')} ms, of a whole stream: "
              f"{overhead.get('stream_c1_added_p50_ms', 'n/a')} ms")
        print(f"  requests/s at c=32: {overhead.get('c32_rps_ratio', 'n/a')}x, streams/s at c=32: "
              f"{overhead.get('stream_c32_rps_ratio', 'n/a')}x")
        print(f"  proxy CPU per request at c=32: +{overhead.get('c32_added_cpu_us_per_request', 'n/a')} µs, "
              f"per stream: +{overhead.get('stream_c32_added_cpu_us_per_request', 'n/a')} µs")


# -- main --------------------------------------------------------------------------------------------------------------

def check_tools() -> None:
    missing = [tool for tool in ("wrk", "taskset") if shutil.which(tool) is None]
    if missing:
        raise BenchError(f"missing tools: {', '.join(missing)}. On Debian/Ubuntu: "
                         f"sudo apt-get install {' '.join('wrk' if t == 'wrk' else 'util-linux' for t in missing)}")
    if (os.cpu_count() or 1) < 2:
        raise BenchError("needs at least 2 CPUs (the proxy on CPU 1, wrk and the upstreams on CPU 0)")


async def start_and_measure(args: argparse.Namespace, targets: list[str], workdir: Path, repo: Path,
                            results: list[RunResult], commands: dict[str, list[str]], extra: dict) -> None:
    """Start every target in one nursery (stopped, each process group, when it ends: at the end, on an error,
    on Ctrl-C or SIGTERM), check each answers, then measure them.

    The checks and the measurement block the event loop on purpose: nothing else runs in this process
    meanwhile (the children write their output to files), and Ctrl-C raises KeyboardInterrupt right in them,
    which kills a wrk under way, as SIGTERM does too (it gets the handler trio gave SIGINT)."""
    on_interrupt = signal.getsignal(signal.SIGINT)

    def interrupt(signum: int, frame: object) -> None:
        if not callable(on_interrupt):  # SIG_DFL or SIG_IGN: no trio handler to pass it to
            raise KeyboardInterrupt
        on_interrupt(signal.SIGINT, frame)  # type: ignore[arg-type]  # (typeshed: frame is FrameType | None)

    signal.signal(signal.SIGTERM, interrupt)
    async with trio.open_nursery() as nursery:
        pki = BenchPki.create(workdir) if {DIRECT_TLS, *TLS_TARGETS} & set(targets) else None

        async def start_upstreams(suffix: str = "", tls: tuple[str, ...] = ()) -> list[str]:
            urls = []
            for name in ("a", "b"):
                proc = await start(nursery, workdir, f"upstream-{name}{suffix}", [
                    sys.executable, "-m", "llmgw.testing.fake_upstream", "--port", "0", "--name", name,
                    "--model", MODEL, "--chunks", "50", *tls], LOAD_CPU, UPSTREAM_READY, 30)
                commands[proc.name] = proc.argv
                urls.append(proc.url)
            return urls

        urls = await start_upstreams()
        tls_urls = await start_upstreams("-tls", ("--tls-cert", str(pki.server))) if pki else []
        running: list[Target] = []

        if "direct" in targets:
            extra["direct"] = check_target("direct", urls[0])
            running.append(Target("direct", urls[0], None))
            print(f"direct: {urls[0]}", flush=True)
        if DIRECT_TLS in targets:
            assert pki is not None  # made for the TLS targets
            extra[DIRECT_TLS] = check_target(DIRECT_TLS, tls_urls[0], pki.client_context())
            running.append(Target(DIRECT_TLS, tls_urls[0], None))
            print(f"{DIRECT_TLS}: {tls_urls[0]}", flush=True)

        config = workdir / "llmgw.yaml"
        config.write_text(llmgw_config(urls))
        gateways = [("llmgw", None, config)] if "llmgw" in targets else []
        if args.baseline is not None:
            gateways.append((BASELINE, args.baseline.resolve(), config))
            targets.insert(targets.index("llmgw") + 1 if "llmgw" in targets else len(targets), BASELINE)
        for name in TLS_TARGETS:
            if name in targets:
                tls_config = workdir / f"{name}.yaml"
                tls_config.write_text(llmgw_config(tls_urls, pki, https_listener=name == "llmgw-https"))
                extra[f"{name}_config"] = tls_config.read_text()
                gateways.append((name, None, tls_config))
        for name, limits in TENANT_TARGETS.items():
            if name in targets:
                keyed_config = workdir / f"{name}.yaml"
                keyed_config.write_text(llmgw_config(urls) + f"api_keys:\n  - key: {BENCH_KEY}\n    name: bench\n"
                                        + limits)
                extra[f"{name}_config"] = keyed_config.read_text()
                gateways.append((name, None, keyed_config))
        for name, source, config_path in gateways:
            # From another checkout: its folder first on the path, whatever this process's PYTHONPATH (a compiled
            # tree, say) and PYTHONSAFEPATH, which would otherwise make the baseline import this process's llmgw.
            proc = await start(nursery, workdir, name, [
                sys.executable, "-m", "llmgw", "serve", "--config", str(config_path), "--listen", "127.0.0.1:0",
                "--control-listen", "127.0.0.1:0"], PROXY_CPU, GATEWAY_READY, 60, cwd=source,
                env=None if source is None else checkout_env(source))
            commands[name] = proc.argv + ([f"(in {source})"] if source else [])
            client_tls = pki.client_context() if pki and proc.url.startswith("https://") else None
            authorization = f"Bearer {BENCH_KEY}" if name in TENANT_TARGETS else None
            wait_ready(proc.url, 30, proc, client_tls, authorization)
            extra[name] = check_target(name, proc.url, client_tls, authorization)
            running.append(Target(name, proc.url, proc, authorization))
            print(f"{name}: {proc.url} (pid {proc.pid}{f', from {source}' if source else ''})", flush=True)
        extra["llmgw_config"] = config.read_text()
        redis = None
        if REDIS_TARGET in targets:
            # on the load CPU: this process's affinity (main) is the redis-server's too
            redis = await start_private_redis(nursery, workdir / "redis")
            redis_config = workdir / f"{REDIS_TARGET}.yaml"
            redis_config.write_text(llmgw_config(urls) + state_section(redis.url, cluster="bench-proxy"))
            extra[f"{REDIS_TARGET}_config"] = redis_config.read_text()
            proc = await start(nursery, workdir, REDIS_TARGET, [
                sys.executable, "-m", "llmgw", "serve", "--config", str(redis_config), "--listen", "127.0.0.1:0",
                "--control-listen", "127.0.0.1:0"], PROXY_CPU, SERVE_READY, 60)
            commands[REDIS_TARGET] = proc.argv
            wait_ready(proc.url, 30, proc)
            extra[REDIS_TARGET] = check_target(REDIS_TARGET, proc.url) | {
                "cluster": check_shared_state(proc.control_url)}
            running.insert(next((i + 1 for i, t in enumerate(running) if t.name == "llmgw"), len(running)),
                           Target(REDIS_TARGET, proc.url, proc))
            print(f"{REDIS_TARGET}: {proc.url} (pid {proc.pid}, redis-server pid {redis.pid} at {redis.url})",
                  flush=True)

        if "vllm-router" in targets:
            executable, how = find_vllm_router(args.vllm_router, not args.no_install, repo)
            extra["vllm_router_lookup"] = how
            if executable is None:
                print(f"vllm-router: skipped ({how})", flush=True)
                targets.remove("vllm-router")
            else:
                port = free_port()
                argv_vr = [executable, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                           "--policy", "round_robin", "--prometheus-port", str(free_port()),
                           "--worker-startup-check-interval", "1", "--log-level", "warning"]
                proc = await start(nursery, workdir, "vllm-router", argv_vr, PROXY_CPU, None, 60)
                proc.announced_url = f"http://127.0.0.1:{port}"
                commands["vllm-router"] = proc.argv
                extra["vllm_router_version"] = vllm_router_version(executable)
                wait_ready(proc.url, 60, proc)
                extra["vllm-router"] = check_target("vllm-router", proc.url)
                running.append(Target("vllm-router", proc.url, proc))
                print(f"vllm-router {extra['vllm_router_version']}: {proc.url} (pid {proc.pid})", flush=True)

        extra["machine_state"] = {"before": machine_state.describe(PROXY_CPU, QUIET_SAMPLE_S)}
        print(f"measuring: {len(SCENARIOS)} scenarios x {len(running)} targets x {args.repeat} rounds of "
              f"{args.duration:g} s (+{args.warmup:g} s warm-up in round 1)", flush=True)
        redis_cpu = process_cpu_seconds(redis.pid) if redis is not None else 0.0
        results.extend(run_interleaved(running, workdir, args.duration, args.warmup, args.repeat))
        extra["machine_state"]["after"] = machine_state.describe(PROXY_CPU)
        if redis is not None:
            extra["redis_cpu_s"] = round(process_cpu_seconds(redis.pid) - redis_cpu, 3)
            extra[REDIS_TARGET]["cluster_after"] = check_shared_state(
                next(t.proc for t in running if t.name == REDIS_TARGET).control_url)  # type: ignore[union-attr]
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per measured wrk run (default 10)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="seconds of unmeasured load before each scenario in the first round (default 2)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds over all targets and scenarios (interleaved); medians and bests are reported")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the results here (e.g. bench-results/proxy.json)")
    parser.add_argument("--targets", default="direct,llmgw,vllm-router",
                        help="comma-separated subset of direct, llmgw, vllm-router, direct-tls, llmgw-tls, "
                             f"llmgw-https, {REDIS_TARGET}, {', '.join(TENANT_TARGETS)} "
                             f"(e.g. direct,llmgw,{REDIS_TARGET})")
    parser.add_argument("--vllm-router", default=None, help="path of the vllm-router executable")
    parser.add_argument("--no-install", action="store_true", help="do not install vllm-router when it is missing")
    parser.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                        help=f"also measure the llmgw of another checkout (e.g. a git worktree of an older commit), "
                             f"as target {BASELINE!r}, interleaved with the others")
    args = parser.parse_args(argv)
    if not 0 < args.duration <= 300 or not 0 <= args.warmup <= 60 or not 1 <= args.repeat <= 10:
        parser.error("bounds: 0 < --duration <= 300, 0 <= --warmup <= 60, 1 <= --repeat <= 10")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(targets) - {"direct", "llmgw", "vllm-router", DIRECT_TLS, *TLS_TARGETS, REDIS_TARGET,
                              *TENANT_TARGETS}
    if unknown:
        parser.error(f"unknown targets: {', '.join(sorted(unknown))}")
    repo = Path(__file__).resolve().parents[2]

    try:
        os.sched_setaffinity(0, {LOAD_CPU})  # this orchestrator stays off the proxy's core
    except (AttributeError, OSError):
        pass

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    results: list[RunResult] = []
    commands: dict[str, list[str]] = {}
    extra: dict = {}
    code = 0
    try:
        check_tools()
        trio.run(partial(start_and_measure, args, targets, workdir, repo, results, commands, extra))
    except* BenchError as group:
        print(f"llmgw.bench.proxy: {group.exceptions[0]}", file=sys.stderr)
        code = 2
    except* KeyboardInterrupt:  # Ctrl-C, or SIGTERM (start_and_measure): every process is stopped by now
        print("\ninterrupted: every process stopped", file=sys.stderr)
        code = 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if code:
        return code

    summary = summarize(results, targets)
    print_table(summary, targets)
    print_machine_state(extra.get("machine_state", {}), summary, targets)
    if args.json:
        report = {
            "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": ["llmgw", "bench", "proxy"] + (argv if argv is not None else sys.argv[1:]),
            "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "repeat": args.repeat,
                         "proxy_cpu": PROXY_CPU, "load_and_upstream_cpu": LOAD_CPU, "wrk_threads": 1,
                         "small_body": SMALL_BODY, "stream_body": STREAM_BODY, "path": PATH,
                         "scenarios": {s: what for s, _, _, what in SCENARIOS}},
            "machine": machine_info(),
            "versions": dict(versions(repo), vllm_router=extra.get("vllm_router_version")),
            "commands": {k: shlex.join(v) for k, v in commands.items()},
            "checks": extra,
            "summary": summary,
            "runs": [vars(r) | {"ok": r.ok, "command": shlex.join(r.command)} for r in results],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
