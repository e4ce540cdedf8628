"""``llmgw status``: the cluster as tables, from a running control plane's admin API.

Nodes (state, GPUs used/total, shards, last heard from), replicas (model,
state, node, endpoint), shards (node, rank, GPUs, state, pid, restarts,
reason), the router's KV index per replica (state, blocks, block size, and
for an ``unusable_keys`` index why and the fix) and the autoscaled deployments (bounds, counts, demand, the last
decision), read from ``GET /admin/nodes``, ``GET /admin/replicas``, ``GET /admin/kv`` and ``GET
/admin/autoscale``. In a cluster
sharing state through Redis, a first line says who leads (from ``GET
/admin/cluster``), and a candidate that does not lead is read through the
leader it names.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterable, Sequence

from .control_api import DEFAULT_CONTROL, ControlApiError, add_arguments, get_json


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw status", description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", default=DEFAULT_CONTROL,
                        help=f"the control listener of llmgw serve (default {DEFAULT_CONTROL})")
    parser.add_argument("--json", action="store_true", help="print the admin API's JSON instead of tables")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    add_arguments(parser)
    return parser


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """Left-aligned columns as wide as their widest cell; '-' for empty cells."""
    cells = [[str(h) for h in headers]] + [[("-" if v in (None, "") else str(v)) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]


def node_rows(nodes: list[dict]) -> list[list]:
    rows = []
    for node in nodes:
        gpus = node.get("gpus") or []
        used = len(node.get("used_gpus") or [])
        names = sorted({gpu.get("name", "?") for gpu in gpus})
        rows.append([node.get("node_id"), node.get("state"), node.get("address"),
                     f"{used}/{len(gpus)}" + (f" {','.join(names)}" if names else ""),
                     len(node.get("shards") or []), f"{node.get('last_seen_s', 0):.1f}s ago",
                     node.get("state_reason") if node.get("state") != "connected" else ""])
    return rows


def replica_rows(replicas: list[dict]) -> list[list]:
    return [[r.get("name"), r.get("model"), r.get("state"), r.get("node") or "(static)", r.get("url"),
             r.get("inflight", 0), r.get("reason")] for r in replicas]


def shard_rows(replicas: list[dict]) -> list[list]:
    rows = []
    for replica in replicas:
        for shard in replica.get("shards") or []:
            rows.append([shard.get("shard_id"), shard.get("node"), shard.get("rank"),
                         ",".join(map(str, shard.get("gpu_indices") or [])) or "none", shard.get("state"),
                         shard.get("pid") or "", shard.get("restarts", 0), shard.get("reason")])
    return rows


def kv_rows(kv: dict) -> list[list]:
    """The KV index's replicas (``/admin/kv``): state, blocks, block size, and the problem of unusable keys."""
    return [[r.get("name"), r.get("state"), r.get("blocks", 0), r.get("block_size"),
             r.get("problem") or r.get("drift", {}).get("suspect_reason")] for r in kv.get("replicas") or []]


def render(nodes: list[dict], replicas: list[dict], kv: dict | None = None) -> str:
    lines = [f"NODES ({len(nodes)})"]
    lines += table(["NODE", "STATE", "ADDRESS", "GPUS USED", "SHARDS", "LAST HEARD", "WHY"], node_rows(nodes))
    lines += ["", f"REPLICAS ({len(replicas)})"]
    lines += table(["REPLICA", "MODEL", "STATE", "NODE", "ENDPOINT", "INFLIGHT", "REASON"], replica_rows(replicas))
    shards = shard_rows(replicas)
    lines += ["", f"SHARDS ({len(shards)})"]
    lines += table(["SHARD", "NODE", "RANK", "GPUS", "STATE", "PID", "RESTARTS", "REASON"], shards)
    rows = kv_rows(kv or {})
    if rows:
        lines += ["", f"KV INDEX ({len(rows)})"]
        lines += table(["REPLICA", "STATE", "BLOCKS", "BLOCK SIZE", "WHY"], rows)
    return "\n".join(lines)


def autoscale_rows(autoscale: dict) -> list[list]:
    """The autoscaled deployments (``/admin/autoscale``): bounds, counts, demand and the last decision's reason."""
    rows = []
    for key, d in sorted((autoscale.get("deployments") or {}).items()):
        signals = d.get("signals") or {}
        last = (d.get("decisions") or [{}])[-1]
        rows.append([key, d.get("model"), f"{d.get('min')}..{d.get('max')}", d.get("desired"), d.get("ready"),
                     d.get("starting"), d.get("draining"), d.get("sleeping"), signals.get("queued"),
                     signals.get("inflight"),
                     f"{last['kind']} {last['from']}->{last['to']}: {last['reason']}" if last else ""])
    return rows


def render_autoscale(autoscale: dict) -> list[str]:
    rows = autoscale_rows(autoscale)
    if not rows:
        return []
    return ["", f"AUTOSCALE ({len(rows)})"] + table(
        ["DEPLOYMENT", "MODEL", "MIN..MAX", "DESIRED", "READY", "STARTING", "DRAINING", "SLEEPING", "QUEUED",
         "INFLIGHT", "LAST DECISION"], rows)


def leader_line(cluster: dict) -> str | None:
    """Who leads a cluster, as its process at ``/admin/cluster`` says; None without a shared state."""
    if cluster.get("backend") != "redis":
        return None
    name = cluster.get("cluster")
    election = cluster.get("leader")
    if election is None:
        return f"CLUSTER {name}: this process follows (--role gateway)"
    holder = election.get("holder") or {}
    if election.get("candidate") is False:
        return (f"CLUSTER {name}: this process follows (--role gateway); " + (
            f"the leader is {holder.get('origin')} at {holder.get('control_url')} (term {holder.get('generation')})"
            if holder else "no leader (Redis unreachable, or an election under way)"))
    if election.get("leading"):
        return f"CLUSTER {name}: this process leads (term {election.get('term')})"
    if not holder:
        return f"CLUSTER {name}: no leader (Redis unreachable, or an election under way)"
    return (f"CLUSTER {name}: this process follows; the leader is {holder.get('origin')} at "
            f"{holder.get('control_url')} (term {holder.get('generation')})")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    base = args.control.rstrip("/")
    try:
        cluster = get_json(f"{base}/admin/cluster", args, args.timeout)
        election = cluster.get("leader") or {}
        holder = election.get("holder") or {}
        if holder.get("control_url") and not election.get("leading"):
            base = str(holder["control_url"]).rstrip("/")  # the control plane is there
        nodes = get_json(f"{base}/admin/nodes", args, args.timeout)
        replicas = get_json(f"{base}/admin/replicas", args, args.timeout)
        kv = get_json(f"{base}/admin/kv", args, args.timeout)
        autoscale = get_json(f"{base}/admin/autoscale", args, args.timeout)
    except ControlApiError as exc:
        print(f"llmgw status: cannot read {base}/admin: {exc}", file=sys.stderr)
        return 1
    if args.json:
        shared = {"cluster": cluster} if cluster.get("backend") == "redis" else {}
        print(json.dumps({**shared, "nodes": nodes, "replicas": replicas, "kv": kv, "autoscale": autoscale},
                         indent=2))
    else:
        line = leader_line(cluster)
        print((line + "\n\n" if line else "") + "\n".join([render(nodes, replicas, kv), *render_autoscale(autoscale)]))
    return 0
