"""Placement: which GPUs of which nodes run each replica. Pure, deterministic and explainable.

``place()`` puts one replica: it filters nodes (allowed node ids, connected,
labels, GPU class, free healthy GPUs), fits ``gpus_per_node`` GPUs on each of
``profile.nodes`` nodes, scores the fits (NVLink island and NUMA locality,
then spread or binpack) and returns a :class:`ReplicaPlacement`, or an
:class:`Unplaced` that says why each node was rejected. A multi-node replica
is a gang: all its ranks are placed on distinct nodes of one fabric with
identical GPUs, or none is; rank 0, the leader, is the first of them by node
id. ``plan_all()`` places every replica the deployments want, keeping
existing placements that are still valid. Same inputs, same output: nodes are
taken in node-id order and GPUs in index order. The rules are described in
``docs/placement.md``.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw import wire
from llmgw.config.schema import Deployment, Profile

DEFAULT_LEADER_PORT = 29500  # torch.distributed's customary rendezvous port
CPU_CLASS = "cpu"  # gpu_class that claims no GPU at all
REPLICA_WIDE = "*"  # key of Unplaced.reasons for a reason that is about no node in particular
TCP_FABRIC = "tcp"  # the fabric of nodes that report no InfiniBand, RoCE or NVLink fabric
# Which shared fabric a gang prefers, best first.
FABRIC_PREFERENCE = ("nvlink", "infiniband", "roce", TCP_FABRIC)
# Locality of the GPUs chosen on one node, best first.
LOCALITY = ("one NVLink island and NUMA node", "one NVLink island", "one NUMA node", "spread over the node")


class GpuDemand(enum.Enum):
    """Whether a replica claims GPUs."""

    REQUIRED = "required"  # whole GPUs (or MIG instances) on every node
    OPTIONAL = "optional"  # GPUs where a node has them; a node without any GPU runs it on CPUs
    NONE = "none"  # no GPUs: CPU engines


def gpu_demand(profile: Profile) -> GpuDemand:
    """The default demand: ``gpu_class: cpu`` claims none, another class requires GPUs, no class takes
    GPUs where there are some and also runs on GPU-less nodes (the simulator, vLLM's CPU build)."""
    if profile.gpu_class is None:
        return GpuDemand.OPTIONAL
    return GpuDemand.NONE if profile.gpu_class.strip().lower() == CPU_CLASS else GpuDemand.REQUIRED


def gpus_per_node(profile: Profile) -> int:
    return profile.gpus_per_node or max(1, profile.gpus // profile.nodes)


# -- inputs and outputs -----------------------------------------------------------------------------------------------


@dataclass
class NodeView:
    """What placement knows of a node."""

    node_id: str
    address: str
    labels: dict[str, str] = field(default_factory=dict)
    gpus: list[wire.GpuInfo] = field(default_factory=list)
    used_gpus: set[int] = field(default_factory=set)  # GPU indices taken by running shards
    schedulable: bool = True  # False: connected no longer, cordoned...; existing replicas stay
    unschedulable_reason: str = "not connected"
    fabrics: list[str] = field(default_factory=list)  # fabric ids ("infiniband:fe80:...") a gang can span
    replica_counts: dict[str, int] = field(default_factory=dict)  # replicas placed here, by profile name
    leader_ports: set[int] = field(default_factory=set)  # rendezvous ports of gang leaders placed here

    @classmethod
    def from_register(cls, reg: wire.Register, used_gpus: Iterable[int] = (), *, schedulable: bool = True,
                      unschedulable_reason: str = "not connected") -> NodeView:
        return cls(node_id=reg.node_id, address=reg.address, labels=dict(reg.labels), gpus=list(reg.gpus),
                   used_gpus=set(used_gpus), schedulable=schedulable, unschedulable_reason=unschedulable_reason,
                   fabrics=fabric_ids(reg))

    def copy(self) -> NodeView:
        return dataclasses.replace(self, used_gpus=set(self.used_gpus), replica_counts=dict(self.replica_counts),
                                   leader_ports=set(self.leader_ports))


def fabric_ids(reg: wire.Register) -> list[str]:
    """The fabrics a node can join a gang over: InfiniBand/RoCE subnets with an active port, and its
    NVLink fabric clique when IMEX channels are present (multi-node NVLink needs them)."""
    ids = set()
    for fabric in reg.fabrics:
        if fabric.kind == "nvlink" and reg.imex.channels:
            ids.add(f"nvlink:{fabric.name}")
        elif fabric.kind != "nvlink" and any(hca.state.upper() == "ACTIVE" for hca in fabric.hcas):
            ids.add(f"{fabric.kind}:{fabric.name}")
    return sorted(ids)


@dataclass
class ShardPlacement:
    node_id: str
    rank: int
    gpu_indices: list[int]
    gpu_uuids: list[str]
    leader_address: str
    leader_port: int  # 0 for a single-node replica: nothing to rendezvous


@dataclass
class ReplicaPlacement:
    replica_id: str
    profile: str
    shards: list[ShardPlacement]  # rank 0 (the leader) first

    @property
    def leader(self) -> ShardPlacement:
        return self.shards[0]

    @property
    def node_ids(self) -> list[str]:
        return [shard.node_id for shard in self.shards]


@dataclass
class Unplaced:
    replica_id: str
    profile: str
    reasons: dict[str, str]  # node id (or "*" for the replica as a whole) -> why it was rejected


@dataclass
class PlanResult:
    placed: list[ReplicaPlacement] = field(default_factory=list)  # in desired order, kept ones included
    unplaced: list[Unplaced] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # replica ids whose existing placement was kept
    dropped: dict[str, str] = field(default_factory=dict)  # existing placements not kept, and why

    @property
    def ok(self) -> bool:
        return not self.unplaced

    def placement(self, replica_id: str) -> ReplicaPlacement | None:
        return next((p for p in self.placed if p.replica_id == replica_id), None)


# -- GPU class -------------------------------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return [word for word in re.split(r"[\s_/-]+", text.lower()) if word]


def class_matches(gpu_class: str | None, gpu: wire.GpuInfo) -> bool:
    """Whether a GPU is of ``gpu_class``: every word of the class appears in the GPU's name, in order,
    as a whole word, ignoring case (``H100`` matches "NVIDIA H100 80GB HBM3"; ``L4`` does not match
    "NVIDIA L40S"). A MIG instance qualifies only when the class names MIG or its profile
    (``1g.10gb``); with no class, every whole GPU qualifies and no MIG instance does."""
    if gpu_class is None:
        return gpu.mig is None
    wanted = _words(gpu_class)
    if gpu.mig is not None and "mig" not in wanted and gpu.mig.profile.lower() not in wanted:
        return False
    name = iter(_words(gpu.name))
    return all(word in name for word in wanted)  # consumes the iterator: an in-order subsequence


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _describe_gpus(gpus: Sequence[wire.GpuInfo]) -> str:
    if not gpus:
        return "no GPUs"
    counts = Counter(gpu.name or "unnamed GPU" for gpu in gpus)
    return ", ".join(f"{count}x {name}" for name, count in sorted(counts.items()))


# -- one node ---------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class NodeFit:
    """A node that can run one shard of the replica, with the GPUs it would use."""

    node: NodeView
    gpus: list[wire.GpuInfo]
    locality: int  # index into LOCALITY
    free_after: int  # free matching GPUs left on the node after this shard

    @property
    def gpu_class(self) -> str:
        return " + ".join(sorted({gpu.name for gpu in self.gpus})) or CPU_CLASS


def _filter(profile: Profile, deployment: Deployment, node: NodeView, *, check_schedulable: bool = True) -> str | None:
    """Why a node may not run this profile at all (None: it may)."""
    allowed = deployment.placement.nodes
    if allowed and node.node_id not in allowed:
        return "not in placement.nodes"
    if check_schedulable and not node.schedulable:
        return node.unschedulable_reason
    wanted = {**profile.labels, **deployment.placement.node_selector}
    for key in sorted(wanted):
        if key not in node.labels:
            return f"label {key}={wanted[key]} required, missing"
        if node.labels[key] != wanted[key]:
            return f"label {key}={wanted[key]} required, has {key}={node.labels[key]}"
    return None


def nvlink_islands(gpus: Sequence[wire.GpuInfo]) -> dict[int, int]:
    """GPU index -> its NVLink island (the lowest index in it). MIG instances are islands of their own."""
    island = {gpu.index: gpu.index for gpu in gpus}
    by_key = {}
    for gpu in gpus:
        if gpu.mig is None:
            by_key[gpu.uuid] = gpu.index
            if gpu.pci_bus_id:
                by_key[gpu.pci_bus_id] = gpu.index

    def find(index: int) -> int:
        while island[index] != index:
            island[index] = island[island[index]]
            index = island[index]
        return index

    for gpu in gpus:
        if gpu.mig is not None:
            continue
        for peer in gpu.nvlink_peers:
            if peer in by_key:
                a, b = find(gpu.index), find(by_key[peer])
                island[max(a, b)] = min(a, b)
    return {index: find(index) for index in island}


def _choose(free: list[wire.GpuInfo], count: int, islands: dict[int, int]) -> tuple[list[wire.GpuInfo], int]:
    """The ``count`` GPUs to use and their locality: the best-fitting group that holds them all, trying
    (island, NUMA node), then island, then NUMA node, then the whole node."""
    levels = (lambda g: (islands[g.index], g.numa_node), lambda g: islands[g.index], lambda g: g.numa_node,
              lambda g: 0)
    for locality, key in enumerate(levels):
        groups: dict[object, list[wire.GpuInfo]] = defaultdict(list)
        for gpu in free:
            groups[key(gpu)].append(gpu)
        fitting = [group for group in groups.values() if len(group) >= count]
        if fitting:
            # Best fit: the smallest group that holds the shard keeps big groups whole for big shards.
            group = min(fitting, key=lambda g: (len(g), g[0].index))
            return _pack(group, count, islands), locality
    raise AssertionError("unreachable: the whole node holds the shard")


def _pack(group: list[wire.GpuInfo], count: int, islands: dict[int, int]) -> list[wire.GpuInfo]:
    """``count`` GPUs of a group, taken from its largest (island, NUMA) subgroups first."""
    size = Counter((islands[g.index], g.numa_node) for g in group)
    ordered = sorted(group, key=lambda g: (-size[(islands[g.index], g.numa_node)], islands[g.index], g.numa_node,
                                           g.index))
    return sorted(ordered[:count], key=lambda g: g.index)


def _gpus_needed(profile: Profile, node: NodeView, demand: GpuDemand) -> int:
    """GPUs one shard claims on ``node``: none for CPU profiles, and for optional ones on GPU-less nodes."""
    if demand is GpuDemand.NONE or (demand is GpuDemand.OPTIONAL and not node.gpus):
        return 0
    return gpus_per_node(profile)


def fit_node(profile: Profile, node: NodeView, demand: GpuDemand) -> NodeFit | str:
    """The GPUs one shard of ``profile`` would use on ``node``, or why it does not fit."""
    count = _gpus_needed(profile, node, demand)
    if count == 0:
        return NodeFit(node, [], locality=0, free_after=0)
    if not node.gpus:
        return f"gpu_class {profile.gpu_class} not present (no GPUs)" if profile.gpu_class else "no GPUs"
    matching = [gpu for gpu in node.gpus if class_matches(profile.gpu_class, gpu)]
    if not matching:
        return f"gpu_class {profile.gpu_class or '(any)'} not present (has {_describe_gpus(node.gpus)})"
    mig_parents = {gpu.mig.parent_uuid for gpu in node.gpus if gpu.mig is not None}
    excluded: Counter[str] = Counter()
    free = []
    for gpu in sorted(matching, key=lambda g: (g.index, g.pci_bus_id)):
        if gpu.index in node.used_gpus:
            excluded["in use"] += 1
        elif gpu.health.problems:
            excluded["unhealthy"] += 1
        elif gpu.uuid in mig_parents:
            excluded["split into MIG instances"] += 1
        elif gpu.mig is not None and count > 1:
            excluded["MIG instances, which cannot be combined"] += 1
        else:
            free.append(gpu)
    if len(free) < count:
        detail = ", ".join(f"{n} {why}" for why, n in sorted(excluded.items()))
        return f"{_count(len(free), 'free GPU')}, needs {count}" + (f" ({detail})" if detail else "")
    chosen, locality = _choose(free, count, nvlink_islands(node.gpus))
    return NodeFit(node, chosen, locality=locality, free_after=len(free) - count)


def _preference(fit: NodeFit, profile: Profile, deployment: Deployment) -> tuple:
    """Sort key of node fits, best first: GPUs before GPU-less nodes, GPU locality, with ``spread`` the
    fewest replicas of this profile, then the fewest free GPUs left (binpack), then node id."""
    without_gpus = 0 if fit.gpus else 1
    same_profile = fit.node.replica_counts.get(profile.name, 0) if deployment.placement.spread else 0
    return (without_gpus, fit.locality, same_profile, fit.free_after, fit.node.node_id)


# -- one replica ------------------------------------------------------------------------------------------------------


def place(profile: Profile, deployment: Deployment, replica_id: str, nodes: Sequence[NodeView], *,
          demand: GpuDemand | None = None,
          leader_port: Callable[[NodeView], int] | None = None) -> ReplicaPlacement | Unplaced:
    """Place one replica of ``profile`` on ``nodes``, or say why each node was rejected.

    ``demand`` overrides :func:`gpu_demand`; ``leader_port(leader_node)`` chooses
    a gang's rendezvous port (default: the lowest from 29500 up that no gang
    leader on that node uses). ``nodes`` are not modified.
    """
    demand = demand or gpu_demand(profile)
    reasons: dict[str, str] = {}
    fits: list[NodeFit] = []
    for node in sorted(nodes, key=lambda n: n.node_id):
        fit = _filter(profile, deployment, node) or fit_node(profile, node, demand)
        if isinstance(fit, str):
            reasons[node.node_id] = fit
        else:
            fits.append(fit)
    if not nodes:
        reasons[REPLICA_WIDE] = "no nodes known"
    if profile.nodes == 1:
        if not fits:
            return Unplaced(replica_id, profile.name, reasons)
        best = min(fits, key=lambda fit: _preference(fit, profile, deployment))
        return _placement(replica_id, profile, [best], leader_port)
    return _place_gang(profile, deployment, replica_id, fits, reasons, leader_port)


def _fabric_rank(fabric: str) -> tuple[int, str]:
    kind = fabric.split(":", 1)[0]
    return (FABRIC_PREFERENCE.index(kind) if kind in FABRIC_PREFERENCE else len(FABRIC_PREFERENCE), fabric)


def _place_gang(profile: Profile, deployment: Deployment, replica_id: str, fits: list[NodeFit],
                reasons: dict[str, str], leader_port) -> ReplicaPlacement | Unplaced:
    """All ``profile.nodes`` ranks on distinct nodes sharing a fabric and a GPU class, or none."""
    needed = profile.nodes
    groups: dict[tuple[str, str], list[NodeFit]] = defaultdict(list)
    for fit in fits:
        for fabric in fit.node.fabrics or [TCP_FABRIC]:
            groups[(fabric, fit.gpu_class)].append(fit)
    for fabric, gpu_class in sorted(groups, key=lambda key: (_fabric_rank(key[0]), key[1])):
        members = groups[(fabric, gpu_class)]
        if len(members) >= needed:
            chosen = sorted(members, key=lambda fit: _preference(fit, profile, deployment))[:needed]
            return _placement(replica_id, profile, sorted(chosen, key=lambda fit: fit.node.node_id), leader_port)
    for fit in fits:
        # Report the most promising group this node belongs to.
        fabric, gpu_class = min((key for key, members in groups.items() if fit in members),
                                key=lambda key: (-len(groups[key]), _fabric_rank(key[0]), key[1]))
        together = len(groups[(fabric, gpu_class)])
        reasons[fit.node.node_id] = (f"gang needs {needed} nodes, {together} {'fits' if together == 1 else 'fit'}"
                                     f" (fabric {fabric}, {gpu_class})")
    if not fits:
        reasons.setdefault(REPLICA_WIDE, f"gang needs {needed} nodes, 0 fit")
    return Unplaced(replica_id, profile.name, dict(sorted(reasons.items())))


def _next_free_port(node: NodeView) -> int:
    port = DEFAULT_LEADER_PORT
    while port in node.leader_ports:
        port += 1
    return port


def _placement(replica_id: str, profile: Profile, fits: list[NodeFit], leader_port) -> ReplicaPlacement:
    leader = fits[0].node
    port = 0 if len(fits) == 1 else (leader_port or _next_free_port)(leader)
    shards = [ShardPlacement(node_id=fit.node.node_id, rank=rank, gpu_indices=[gpu.index for gpu in fit.gpus],
                             gpu_uuids=[gpu.uuid for gpu in fit.gpus], leader_address=leader.address,
                             leader_port=port)
              for rank, fit in enumerate(fits)]
    return ReplicaPlacement(replica_id=replica_id, profile=profile.name, shards=shards)


# -- every replica ----------------------------------------------------------------------------------------------------


def replica_ids(deployments: Sequence[Deployment],
                counts: Mapping[str, int] | None = None) -> list[tuple[Deployment, str]]:
    """Every desired replica as (deployment, replica id ``f"{profile}-{i}"``), in config order.

    Two deployments of one profile number on from each other, so ids stay unique. ``counts``: the replicas of
    the deployments an autoscaler sizes, by profile name, instead of their ``replicas`` (such a profile has one
    deployment: fewer replicas drop the highest indices first).
    """
    next_index: Counter[str] = Counter()
    wanted = []
    for deployment in deployments:
        count = deployment.replicas if counts is None else counts.get(deployment.profile, deployment.replicas)
        for _ in range(count):
            wanted.append((deployment, f"{deployment.profile}-{next_index[deployment.profile]}"))
            next_index[deployment.profile] += 1
    return wanted


def _claim(views: dict[str, NodeView], placement: ReplicaPlacement) -> None:
    for shard in placement.shards:
        node = views[shard.node_id]
        node.used_gpus.update(shard.gpu_indices)
        node.replica_counts[placement.profile] = node.replica_counts.get(placement.profile, 0) + 1
    if len(placement.shards) > 1:
        views[placement.leader.node_id].leader_ports.add(placement.leader.leader_port)


def still_valid(placement: ReplicaPlacement, profile: Profile, deployment: Deployment,
                views: Mapping[str, NodeView], claimed: set[tuple[str, int]],
                demand: GpuDemand | None = None) -> str | None:
    """Why an existing placement can no longer stand (None: keep it).

    A node that is known but not schedulable (disconnected, cordoned) keeps its
    replicas: losing contact is not a reason to move healthy engines.
    """
    if placement.profile != profile.name:
        return f"placed for profile {placement.profile}, now {profile.name}"
    if len(placement.shards) != profile.nodes or sorted(s.rank for s in placement.shards) != list(range(profile.nodes)):
        return f"has {len(placement.shards)} shards, the profile needs {profile.nodes}"
    if len({shard.node_id for shard in placement.shards}) != len(placement.shards):
        return "two ranks on one node"
    leader = min(placement.shards, key=lambda s: s.rank)
    for shard in sorted(placement.shards, key=lambda s: s.rank):
        node = views.get(shard.node_id)
        if node is None:
            return f"node {shard.node_id} is gone"
        if shard.leader_address != views.get(leader.node_id, node).address:
            return f"leader {leader.node_id} changed address"
        why = _filter(profile, deployment, node, check_schedulable=False)
        if why:
            return f"node {shard.node_id}: {why}"
        expected = _gpus_needed(profile, node, demand or gpu_demand(profile))
        if len(shard.gpu_indices) != expected:
            return f"uses {_count(len(shard.gpu_indices), 'GPU')} on {shard.node_id}, the profile needs {expected}"
        gpus = {gpu.index: gpu for gpu in node.gpus}
        for index, uuid in zip(shard.gpu_indices, shard.gpu_uuids, strict=False):
            gpu = gpus.get(index)
            if gpu is None or (uuid and gpu.uuid != uuid):
                return f"GPU {index} of {shard.node_id} is gone"
            if not class_matches(profile.gpu_class, gpu):
                return f"GPU {index} of {shard.node_id} is not of class {profile.gpu_class}"
            if (shard.node_id, index) in claimed:
                return f"GPU {index} of {shard.node_id} is claimed by another replica"
    return None


def plan_all(profiles: Sequence[Profile], deployments: Sequence[Deployment], nodes: Sequence[NodeView],
             existing: Mapping[str, ReplicaPlacement] | None = None, *,
             demand_of: Callable[[Profile], GpuDemand] = gpu_demand,
             wanted: Sequence[tuple[Deployment, str]] | None = None) -> PlanResult:
    """Place every replica the deployments want (``wanted``: those replicas, as :func:`replica_ids` gives them,
    when an autoscaler sets some deployments' counts; by default their ``replicas``).

    Existing placements (by replica id) that are still wanted and valid are
    kept and their GPUs claimed first; the rest are placed largest first
    (GPUs per replica), then in config order. ``nodes`` are not modified.
    """
    existing = dict(existing or {})
    by_name = {profile.name: profile for profile in profiles}
    views = {node.node_id: node.copy() for node in nodes}
    wanted = list(wanted) if wanted is not None else replica_ids(deployments)
    result = PlanResult()
    decided: dict[str, ReplicaPlacement | Unplaced] = {}

    wanted_ids = {replica_id for _, replica_id in wanted}
    for replica_id in sorted(set(existing) - wanted_ids):
        result.dropped[replica_id] = "no longer wanted"
    claimed: set[tuple[str, int]] = set()
    for deployment, replica_id in sorted(wanted, key=lambda item: item[1]):
        if replica_id not in existing or deployment.profile not in by_name:
            continue
        placement = existing[replica_id]
        profile = by_name[deployment.profile]
        why = still_valid(placement, profile, deployment, views, claimed, demand_of(profile))
        if why:
            result.dropped[replica_id] = why
            continue
        claimed.update((shard.node_id, index) for shard in placement.shards for index in shard.gpu_indices)
        _claim(views, placement)
        decided[replica_id] = placement
        result.kept.append(replica_id)

    def size(item: tuple[int, tuple[Deployment, str]]) -> tuple[int, int]:
        position, (deployment, _) = item
        profile = by_name.get(deployment.profile)
        return (-(profile.gpus if profile else 0), position)

    for _, (deployment, replica_id) in sorted(enumerate(wanted), key=size):
        if replica_id in decided:
            continue
        wanted_profile = by_name.get(deployment.profile)
        if wanted_profile is None:
            decided[replica_id] = Unplaced(replica_id, deployment.profile,
                                           {REPLICA_WIDE: f"no profile named {deployment.profile}"})
            continue
        outcome = place(wanted_profile, deployment, replica_id, list(views.values()),
                        demand=demand_of(wanted_profile))
        if isinstance(outcome, ReplicaPlacement):
            _claim(views, outcome)
        decided[replica_id] = outcome

    for _, replica_id in wanted:
        outcome = decided[replica_id]
        if isinstance(outcome, ReplicaPlacement):
            result.placed.append(outcome)
        else:
            result.unplaced.append(outcome)
    return result
