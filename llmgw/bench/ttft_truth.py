"""Time to first token as llmgw reports it, against the client's own measurement and the time to first byte.

Run: ``python -m llmgw.bench.ttft_truth [--requests 30] [--json FILE]`` (at most about 40 requests: the
gateway's last 50 output lines are kept).

One simulator sends its stream heads at once and each first token after the
modelled prefill (``--stream-head-first``, as vLLM does), behind ``llmgw serve``
with ``access_log: true``. Streamed chat requests go one after another; per
request the client notes its time to first byte (the response head) and to
first token (the first chunk with content), and the gateway's access log line
gives its own ``ttft_ms``. Printed: p50 of each, and p50/max of the
per-request difference client - gateway (what the gateway cannot see: the
relay to the client and the client's own parsing).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

from ..testing.processes import llmgw_command, start_child, start_serve
from ..testing.sims import MODEL
from .common import print_and_save

TTFT_LINE = re.compile(r"request_id=(\S+) .* ttft_ms=([\d.]+)")


async def measure(requests: int) -> dict:
    async with trio.open_nursery() as nursery:
        sim = await start_child(nursery, llmgw_command(
            "sim", "--port", "0", "--served-model-name", MODEL, "--stream-head-first", "--profile", "constant",
            "--prefill-tokens-per-s",
            "4000", "--decode-ms-per-step", "10", "--output-tokens", "16:16", "--no-enable-prefix-caching",
            "--log-level", "WARNING"), name="sim", keep_lines=10)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "llmgw.yaml"
            path.write_text(f"access_log: true\nmodels:\n  - name: {MODEL}\n    replicas:\n      - url: {sim.url}\n")
            gateway = await start_serve(nursery, path)
        rows = []
        async with httpx.AsyncClient(timeout=60) as client:
            for i in range(requests):
                body = {"model": MODEL, "max_tokens": 16, "stream": True,
                        "messages": [{"role": "user", "content": f"request {i}: " + "words to prefill " * 200}]}
                sent = time.perf_counter()
                async with client.stream("POST", gateway.url + "/v1/chat/completions", json=body) as response:
                    head = time.perf_counter() - sent
                    first = None
                    async for line in response.aiter_lines():
                        if first is None and '"content":"' in line and '"content":""' not in line:
                            first = time.perf_counter() - sent
                rows.append((response.headers["x-request-id"], head, first))  # gateway.lines: its access log
        await trio.sleep(0.2)  # the last access line
        logged = {m.group(1): float(m.group(2)) / 1000 for line in gateway.lines
                  if (m := TTFT_LINE.search(line))}
        nursery.cancel_scope.cancel()
    pairs = [(head, first, logged[rid]) for rid, head, first in rows if rid in logged and first is not None]
    diffs = [first - gw for _, first, gw in pairs]
    return {
        "requests": requests, "matched": len(pairs),
        "client_ttfb_p50_ms": 1000 * statistics.median(p[0] for p in pairs),
        "client_ttft_p50_ms": 1000 * statistics.median(p[1] for p in pairs),
        "llmgw_ttft_p50_ms": 1000 * statistics.median(p[2] for p in pairs),
        "difference_p50_ms": 1000 * statistics.median(diffs), "difference_max_ms": 1000 * max(diffs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.bench.ttft_truth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = trio.run(measure, args.requests)
    rows = "\n".join(f"| {key} | {value:.1f} |" if isinstance(value, float) else f"| {key} | {value} |"
                     for key, value in report.items())
    return print_and_save(report, "| measure | value |\n|---|---|\n" + rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
