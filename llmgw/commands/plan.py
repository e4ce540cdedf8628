"""``llmgw plan``: print the placement the control plane would make for a config, and why, touching nothing;
with ``--load``, what its autoscaler would decide for that load (:mod:`llmgw.commands.plan_autoscale`).

Nodes come from recorded fixtures (``--nodes FILE.json...``, run through the
fixture discovery; node id = the fixture's ``node_id`` or the file's stem) or
from a running control plane (``--control URL``: ``GET /admin/nodes``, plus
the replicas it has already placed from ``GET /admin/replicas``). Exit status:
0 when every replica is placed, 3 when one is not, 2 for a usage or config error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable
from typing import Any

from llmgw import wire
from llmgw.agent.discovery import DiscoveryError, FixtureProvider, load_fixture
from llmgw.autoscale.gpus import free_gpus_of
from llmgw.commands import plan_autoscale
from llmgw.commands.control_api import ControlApiError, add_arguments, get_json
from llmgw.config import Config, ConfigError
from llmgw.control.placement import (
    NodeView,
    PlanResult,
    ReplicaPlacement,
    ShardPlacement,
    Unplaced,
    plan_all,
    replica_ids,
)
from llmgw.plugins_manager import load_checked_config

EXIT_PLACED = 0
EXIT_USAGE = 2
EXIT_UNPLACED = 3
UNLIMITED_GPUS: dict[str | None, int] = {None: plan_autoscale.UNLIMITED}


class UsageError(Exception):
    """Bad arguments, an unreadable fixture, an unreachable control plane."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw plan", description="Print where each replica of a config would be placed, or why it cannot be.")
    parser.add_argument("--config", required=True, metavar="FILE", help="the llmgw config file")
    parser.add_argument("--nodes", nargs="+", action="extend", default=[], metavar="FIXTURE.json",
                        help="recorded node fixtures to place on (repeatable)")
    parser.add_argument("--control", metavar="URL", help="a running control listener, e.g. http://127.0.0.1:8001")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for --control (default 10)")
    autoscale = parser.add_argument_group("autoscaling preview (docs/autoscaling.md)")
    autoscale.add_argument("--load", action="append", default=[],
                           metavar="MODEL=QUEUED[,kv=F,ttft=F,inflight=N,idle=S,busy=R]",
                           help="a model's (or profile's) load, held constant: requests queued at the gateways, "
                                "KV usage, TTFT attainment, requests in flight, seconds idle (repeatable)")
    autoscale.add_argument("--replicas", action="append", default=[], metavar="PROFILE=N",
                           help="the replicas a deployment runs when the preview starts (default: the config's)")
    autoscale.add_argument("--free-gpus", action="append", default=[], metavar="[CLASS=]N",
                           help="free GPUs, in all or of a class (default: what --nodes or --control leave free, "
                                "else unlimited)")
    autoscale.add_argument("--for", dest="duration", type=float, metavar="SECONDS",
                           help="how long the load holds (default: until every window has passed)")
    autoscale.add_argument("--ready-after", type=float, default=60.0, metavar="SECONDS",
                           help="a new replica's start time (default 60)")
    add_arguments(parser)
    return parser


# -- nodes ------------------------------------------------------------------------------------------------------------


def nodes_from_fixtures(paths: Iterable[str]) -> list[NodeView]:
    """One node per fixture file; two fixtures with one node id are an error."""
    nodes: dict[str, NodeView] = {}
    for path in paths:
        try:
            fixture = load_fixture(path)
            register = FixtureProvider(fixture).discover(node_id=fixture.node_id, address=fixture.address)
        except DiscoveryError as exc:
            raise UsageError(str(exc)) from None
        if fixture.node_id in nodes:
            raise UsageError(f"{path}: node id {fixture.node_id!r} is already used by another fixture")
        nodes[fixture.node_id] = NodeView.from_register(register)
    return list(nodes.values())


def _get_json(url: str, args: argparse.Namespace) -> Any:
    try:
        return get_json(url, args, args.timeout)
    except ControlApiError as exc:
        raise UsageError(str(exc)) from None


def node_from_admin(item: dict[str, Any]) -> NodeView:
    """A ``GET /admin/nodes`` entry: a Register as plain values, plus ``state`` and ``used_gpus``."""
    try:
        register = wire.from_plain(wire.Register, item, "node")
    except wire.WireError as exc:
        raise UsageError(f"/admin/nodes: {exc}") from None
    state = str(item.get("state") or "connected")
    why = f"{state}: {item['state_reason']}" if item.get("state_reason") else f"not connected (state {state})"
    return NodeView.from_register(register, used_gpus=item.get("used_gpus") or (), schedulable=state == "connected",
                                  unschedulable_reason=why)


def placement_from_admin(item: dict[str, Any], nodes: dict[str, NodeView]) -> ReplicaPlacement | None:
    """A ``GET /admin/replicas`` entry as a placement, when it has a replica id and shards with a node and
    GPU indices; ``None`` for anything else (external replicas, unplaced ones, ones being retired)."""
    replica_id = item.get("replica_id") or item.get("id") or item.get("name")
    shards = item.get("shards")
    if not isinstance(replica_id, str) or not isinstance(shards, list) or not shards or item.get("retiring"):
        return None
    placed = []
    for position, shard in enumerate(shards):
        if not isinstance(shard, dict):
            return None
        node_id = shard.get("node_id") or shard.get("node") or item.get("node")
        if node_id not in nodes or not isinstance(shard.get("gpu_indices", []), list):
            return None
        placed.append(ShardPlacement(node_id=node_id, rank=int(shard.get("rank", position)),
                                     gpu_indices=list(shard.get("gpu_indices", [])),
                                     gpu_uuids=list(shard.get("gpu_uuids", [])),
                                     leader_address=shard.get("leader_address") or "",
                                     leader_port=int(shard.get("leader_port") or 0)))
    placed.sort(key=lambda shard: shard.rank)
    for shard in placed:
        shard.leader_address = shard.leader_address or nodes[placed[0].node_id].address
    profile = item.get("profile") or replica_id.rsplit("-", 1)[0]
    return ReplicaPlacement(replica_id=replica_id, profile=profile, shards=placed)


def state_from_control(url: str, args: argparse.Namespace) -> tuple[list[NodeView], dict[str, ReplicaPlacement]]:
    base = url.rstrip("/")
    items = _get_json(f"{base}/admin/nodes", args)
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise UsageError(f"GET {base}/admin/nodes: expected a JSON list of nodes")
    nodes = [node_from_admin(item) for item in items]
    by_id = {node.node_id: node for node in nodes}
    replicas = _get_json(f"{base}/admin/replicas", args)
    existing = {}
    for item in replicas if isinstance(replicas, list) else []:
        placement = placement_from_admin(item, by_id) if isinstance(item, dict) else None
        if placement is not None:
            existing[placement.replica_id] = placement
    return nodes, existing


# -- output -----------------------------------------------------------------------------------------------------------


def _headline(placement: ReplicaPlacement, kept: bool) -> str:
    leader = placement.leader
    if len(placement.shards) == 1:
        where = f"on {leader.node_id} ({leader.leader_address})"
    else:
        where = (f"on {len(placement.shards)} nodes, leader {leader.node_id} "
                 f"{leader.leader_address}:{leader.leader_port}")
    return f"{placement.replica_id}: placed {where}, profile {placement.profile}{', kept' if kept else ''}"


def render_text(result: PlanResult, nodes: list[NodeView], order: list[str]) -> list[str]:
    """Per replica, in ``order`` (replica ids): its shards, or each node's reason for refusing it."""
    total = len(result.placed) + len(result.unplaced)
    names = ", ".join(sorted(node.node_id for node in nodes)) or "none"
    lines = [f"{total} replica{'' if total == 1 else 's'}: {len(result.placed)} placed, "
             f"{len(result.unplaced)} not placed (nodes: {names})"]
    position = {replica_id: i for i, replica_id in enumerate(order)}
    outcomes: list[ReplicaPlacement | Unplaced] = [*result.placed, *result.unplaced]
    outcomes.sort(key=lambda o: (position.get(o.replica_id, total), o.replica_id))
    for outcome in outcomes:
        lines.append("")
        if isinstance(outcome, ReplicaPlacement):
            lines.append(_headline(outcome, outcome.replica_id in result.kept))
            for shard in outcome.shards:
                gpus = ",".join(map(str, shard.gpu_indices)) or "none (runs on CPUs)"
                lines.append(f"  rank {shard.rank}  {shard.node_id}  GPUs {gpus}")
                if shard.gpu_uuids:
                    lines.append(f"          {' '.join(shard.gpu_uuids)}")
        else:
            lines.append(f"{outcome.replica_id}: NOT PLACED, profile {outcome.profile}")
            for node_id, why in outcome.reasons.items():
                lines.append(f"  {node_id}: {why}")
    for replica_id, why in sorted(result.dropped.items()):
        lines += ["", f"{replica_id}: existing placement dropped: {why}"]
    return lines


def render_json(result: PlanResult, nodes: list[NodeView]) -> str:
    return json.dumps({
        "ok": result.ok,
        "nodes": sorted(node.node_id for node in nodes),
        "placed": [dataclasses.asdict(placement) for placement in result.placed],
        "unplaced": [dataclasses.asdict(unplaced) for unplaced in result.unplaced],
        "kept": result.kept,
        "dropped": result.dropped,
    }, indent=2)


# -- main -------------------------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        config = load_checked_config(args.config)
    except ConfigError as exc:
        for issue in exc.errors:
            print(issue, file=sys.stderr)
        return EXIT_USAGE
    try:
        if not args.nodes and not args.control and not args.load:
            raise UsageError("give the nodes to plan on: --nodes FIXTURE.json... or --control URL")
        nodes = nodes_from_fixtures(args.nodes)
        existing: dict[str, ReplicaPlacement] = {}
        if args.control:
            remote, existing = state_from_control(args.control, args)
            clash = {node.node_id for node in nodes} & {node.node_id for node in remote}
            if clash:
                raise UsageError(f"node ids both in fixtures and at {args.control}: {', '.join(sorted(clash))}")
            nodes += remote
    except UsageError as exc:
        print(f"llmgw plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result = plan_all(config.profiles, config.deployments, nodes, existing)
    if args.load:
        return autoscale_preview(args, config, nodes, result)
    order = [replica_id for _, replica_id in replica_ids(config.deployments)]
    print(render_json(result, nodes) if args.json else "\n".join(render_text(result, nodes, order)))
    return EXIT_PLACED if result.ok else EXIT_UNPLACED


def autoscale_preview(args: argparse.Namespace, config: Config, nodes: list[NodeView], placed: PlanResult) -> int:
    """``--load``: the autoscaler's decisions for that load, on the GPUs ``placed`` leaves free."""
    try:
        loads = [plan_autoscale.parse_load(text) for text in args.load]
        replicas = plan_autoscale.parse_counts(args.replicas, "--replicas")
        free = plan_autoscale.parse_counts(args.free_gpus, "--free-gpus", classes=True)
        if not free and nodes:
            for placement in placed.placed:
                for shard in placement.shards:
                    next(n for n in nodes if n.node_id == shard.node_id).used_gpus.update(shard.gpu_indices)
            free = free_gpus_of(nodes, config)
        outcome = plan_autoscale.preview(config, loads, replicas=replicas, free_gpus=free or dict(UNLIMITED_GPUS),
                                         duration=args.duration, ready_after=max(0.0, args.ready_after))
    except plan_autoscale.LoadError as exc:
        print(f"llmgw plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(plan_autoscale.render_json(outcome) if args.json else "\n".join(plan_autoscale.render_text(outcome)))
    return EXIT_PLACED
