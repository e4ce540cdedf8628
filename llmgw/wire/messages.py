"""The agent <-> control-plane protocol: versioned msgpack messages, one per websocket frame.

Every message is a dataclass below. On the wire it is a msgpack map
``{"v": PROTOCOL_VERSION, "t": "<TypeName>", ...fields}``; nested records are
maps too. Decoding is forgiving where that is safe and strict where it is not:

- unknown fields are ignored and missing optional fields take their defaults,
  so a newer peer can add fields without breaking an older one;
- an unknown enum value decodes to the safe side (an unknown shard state is
  ``FAILED``, never ``READY``);
- an unknown message type decodes to :class:`UnknownMessage`, which receivers
  count and skip;
- a different major protocol version, a frame that is not a map, or a field of
  the wrong type raises :class:`WireError`.

The embedded agent exchanges the very same objects over an in-process channel
(no encoding), so the two paths cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

from ..kv.changes import KvChangeKind

__all__ = [
    "PROTOCOL_VERSION", "WireError", "ShardState", "KvChangeKind", "HostInfo", "GpuFabric", "GpuHealth",
    "MigInfo", "NicPath", "GpuInfo", "ImexInfo", "Hca", "FabricInfo", "StorageInfo", "LocalWeights",
    "LoraModule", "ShardProfile", "ShardReport", "Message", "Register", "Registered", "Heartbeat",
    "StartShard", "StopShard", "DrainShard", "SleepShard", "WakeShard", "ShardStatus", "KvChanges", "KvResync",
    "ErrorMessage",
    "UnknownMessage", "encode", "decode", "to_plain", "from_plain",
]

PROTOCOL_VERSION = 1


class WireError(ValueError):
    """A frame that cannot be decoded into a message."""


class ShardState(str, enum.Enum):
    PENDING = "pending"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    SLEEPING = "sleeping"  # out of routing, the process alive, its GPU memory given up (vLLM's sleep mode)
    WAKING = "waking"  # a wake-up asked for: back to READY when the engine is awake and ready
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"

    @classmethod
    def _missing_(cls, value: object) -> ShardState:
        return cls.FAILED  # an unknown state read off the wire is never taken as Ready

    @property
    def alive(self) -> bool:
        return self in (ShardState.PENDING, ShardState.STARTING, ShardState.LOADING, ShardState.READY,
                        ShardState.SLEEPING, ShardState.WAKING, ShardState.DRAINING)


# -- records nested in messages ---------------------------------------------------------------------------------------


@dataclass
class HostInfo:
    os: str = ""
    kernel: str = ""
    arch: str = ""
    cpu_model: str = ""
    cpu_flags: list[str] = field(default_factory=list)
    driver_version: str = ""
    cuda_version: str = ""
    python_version: str = ""


@dataclass
class GpuFabric:
    state: str = ""  # e.g. "completed", "not_supported"
    status: str = ""
    cluster_uuid: str = ""
    clique_id: int = 0
    bandwidth_gbps: float = 0.0


@dataclass
class GpuHealth:
    ecc_errors: int = 0
    temperature_c: float = 0.0
    problems: list[str] = field(default_factory=list)


@dataclass
class MigInfo:
    parent_uuid: str = ""
    profile: str = ""  # e.g. "1g.10gb"
    gpu_instance_id: int = 0
    compute_instance_id: int = 0


@dataclass
class NicPath:
    nic: str = ""  # e.g. "mlx5_0"
    link: str = ""  # topology class as nvidia-smi topo prints it: PIX, PXB, PHB, NODE, SYS


@dataclass
class GpuInfo:
    index: int = 0
    uuid: str = ""
    name: str = ""
    memory_total: int = 0
    memory_used: int = 0
    compute_capability: str = ""
    numa_node: int = -1
    pci_bus_id: str = ""
    driver_version: str = ""
    cuda_version: str = ""
    utilization: float = 0.0  # percent
    nvlink_peers: list[str] = field(default_factory=list)  # UUIDs (or PCI bus ids) of NVLink peers
    nic_paths: list[NicPath] = field(default_factory=list)
    fabric: GpuFabric | None = None
    health: GpuHealth = field(default_factory=GpuHealth)
    mig: MigInfo | None = None


@dataclass
class ImexInfo:
    state: str = ""  # "", "ready", "not_configured", ...
    channels: list[int] = field(default_factory=list)


@dataclass
class Hca:
    name: str = ""
    port: int = 1
    state: str = ""  # ACTIVE, DOWN...
    rate_gbps: float = 0.0
    link_layer: str = ""  # InfiniBand, Ethernet
    subnet_prefix: str = ""
    pci_bus_id: str = ""
    numa_node: int = -1


@dataclass
class FabricInfo:
    kind: str = ""  # infiniband, roce, nvlink
    name: str = ""
    hcas: list[Hca] = field(default_factory=list)


@dataclass
class StorageInfo:
    path: str = ""
    total_bytes: int = 0
    free_bytes: int = 0


@dataclass
class LocalWeights:
    path: str = ""
    name: str = ""
    size_bytes: int = 0


@dataclass
class LoraModule:
    name: str = ""
    path: str = ""


@dataclass
class ShardProfile:
    """What an engine plugin needs to build a shard's command line."""

    name: str = ""
    engine: str = ""
    engine_bin: str | None = None
    model_path: str = ""
    served_model_name: str = ""
    tp: int = 1
    pp: int = 1
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    lora_adapters: list[LoraModule] = field(default_factory=list)
    kv_events: bool = False
    kv_key_mode: str = "content"  # how the agent's mirror keys the engine's blocks: "content" or "engine" (hashes)
    startup_timeout: float = 600.0
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy (passed only when it is not vLLM's default fcfs)
    long_prefill_token_threshold: int = 0  # vLLM's --long-prefill-token-threshold (passed only when > 0)
    sleep_mode: bool = False  # started with the engine's sleep mode: SleepShard and WakeShard work on it


@dataclass
class ShardReport:
    """A shard as an agent sees it: sent in Register (for adoption) and as ShardStatus."""

    shard_id: str = ""
    replica_id: str = ""
    rank: int = 0
    node_count: int = 1
    state: ShardState = ShardState.PENDING
    reason: str = ""
    pid: int = 0
    http_port: int = 0
    endpoint: str = ""  # http://host:port of the engine, as the router should dial it
    fingerprint: str = ""
    generation: int = 0
    gpu_indices: list[int] = field(default_factory=list)
    restarts: int = 0
    model: str = ""  # served model name
    started_at: float = 0.0
    log_tail: list[str] = field(default_factory=list)
    placement_proof: str = field(default="", repr=False)  # from the StartShard: see llmgw.control.identity


# -- messages ---------------------------------------------------------------------------------------------------------


@dataclass
class Message:
    TYPES: ClassVar[dict[str, type["Message"]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Message.TYPES[cls.__name__] = cls


@dataclass
class Register(Message):
    """Agent -> control plane, first message of every connection."""

    node_id: str = ""
    token: str = field(default="", repr=False)
    hostname: str = ""
    address: str = ""  # management address: where engines on this node can be dialled
    labels: dict[str, str] = field(default_factory=dict)
    agent_version: str = ""
    features: list[str] = field(default_factory=list)
    engine_versions: dict[str, str] = field(default_factory=dict)
    host: HostInfo = field(default_factory=HostInfo)
    cpu_count: int = 0
    memory_bytes: int = 0
    gpus: list[GpuInfo] = field(default_factory=list)
    imex: ImexInfo = field(default_factory=ImexInfo)
    fabrics: list[FabricInfo] = field(default_factory=list)
    storage: list[StorageInfo] = field(default_factory=list)
    local_weights: list[LocalWeights] = field(default_factory=list)
    shards: list[ShardReport] = field(default_factory=list)
    node_secret: str = field(default="", repr=False)  # issued at the first join; proves the node id after it


@dataclass
class Registered(Message):
    """Control plane -> agent: the answer to Register."""

    accepted: bool = True
    reason: str = ""
    node_id: str = ""
    heartbeat_interval: float = 5.0
    control_plane_id: str = ""
    node_secret: str = field(default="", repr=False)  # set on a node's first join: the agent keeps it


@dataclass
class Heartbeat(Message):
    """Both ways: liveness, with the agent's live GPU figures."""

    seq: int = 0
    sent_at: float = 0.0
    gpu_utilization: dict[str, float] = field(default_factory=dict)  # uuid -> percent
    gpu_memory_used: dict[str, int] = field(default_factory=dict)  # uuid -> bytes


@dataclass
class StartShard(Message):
    """Control plane -> agent: run one shard (one rank of one replica)."""

    shard_id: str = ""
    replica_id: str = ""
    rank: int = 0
    node_count: int = 1
    leader_address: str = ""
    leader_port: int = 0
    gpu_indices: list[int] = field(default_factory=list)
    gpu_uuids: list[str] = field(default_factory=list)
    hcas: list[str] = field(default_factory=list)
    http_port: int = 0  # 0: the agent allocates one
    profile: ShardProfile = field(default_factory=ShardProfile)
    pool: str = ""
    fabric: str = ""
    fingerprint: str = ""
    generation: int = 0
    engine_api_key: str = field(default="", repr=False)
    cpu_threads: int = 0
    placement_proof: str = field(default="", repr=False)  # reported back with the shard, for adoption


@dataclass
class StopShard(Message):
    shard_id: str = ""
    reason: str = ""
    grace: float = 30.0


@dataclass
class DrainShard(Message):
    """Stop routing to the shard, wait for in-flight requests up to ``timeout``, then stop it."""

    shard_id: str = ""
    reason: str = ""
    timeout: float = 600.0
    grace: float = 30.0


@dataclass
class SleepShard(Message):
    """Put a Ready shard's engine to sleep (out of routing first; vLLM ``POST /sleep?level=N``), each HTTP call
    within ``timeout``. The shard reports SLEEPING, or stays READY with why not."""

    shard_id: str = ""
    reason: str = ""
    level: int = 1
    timeout: float = 30.0


@dataclass
class WakeShard(Message):
    """Wake a sleeping shard's engine (vLLM ``POST /wake_up``) and probe it ready within ``timeout``: WAKING,
    then READY; an engine that does not wake is stopped (STOPPED, with why), so that it can be started cold."""

    shard_id: str = ""
    reason: str = ""
    timeout: float = 600.0


@dataclass
class ShardStatus(Message):
    """Agent -> control plane: a shard changed state (every transition, with its reason)."""

    shard: ShardReport = field(default_factory=ShardReport)


@dataclass
class KvChanges(Message):
    """Agent -> control plane: KV-cache block changes of one engine (see the KV-index tier)."""

    shard_id: str = ""
    replica_id: str = ""
    data_parallel_rank: int = 0
    kind: KvChangeKind = KvChangeKind.DELTA
    block_size: int = 0
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reason: str = ""


@dataclass
class KvResync(Message):
    """Control plane -> agent: the router's KV index of this shard's replica contradicts what its engine reports
    (``llmgw.kv.drift``). ``mode`` ``full``: send a FULL copy of the mirror; ``reset``: drop the mirror and relearn
    from the engine's next events (an unknown mode is taken as ``full``, which loses nothing)."""

    shard_id: str = ""
    replica_id: str = ""
    data_parallel_rank: int = 0
    mode: str = "full"
    reason: str = ""


@dataclass
class ErrorMessage(Message):
    """Either way: a request that was refused, with why."""

    code: str = ""
    message: str = ""
    about: str = ""  # e.g. the shard id concerned


@dataclass
class UnknownMessage:
    """A message type this version does not know; receivers count it and carry on."""

    type_name: str
    fields: dict[str, Any]


# -- encoding ---------------------------------------------------------------------------------------------------------


def to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def encode(message: Message) -> bytes:
    body = to_plain(message)
    frame: bytes = msgpack.packb({"v": PROTOCOL_VERSION, "t": type(message).__name__, **body}, use_bin_type=True)
    return frame


# Bounds of a decode (see :func:`decode`): a map is a message, a record or a small table (labels, env, the GPU
# figures of a heartbeat), never more entries than this; maps and arrays together number at most
# ``CONTAINERS_BASE + len(frame) // BYTES_PER_CONTAINER`` (a real message spends 25 bytes or more on each of
# its containers past a handful: a 16-GPU Register ~50, a KvChanges three in all).
MAX_MAP_ENTRIES = 4096
CONTAINERS_BASE = 64
BYTES_PER_CONTAINER = 32


class _Spent(Exception):
    """A frame's container budget ran out while msgpack built it."""


class _ContainerBudget:
    """Counts the maps and arrays msgpack builds for one frame, and stops the decode past the budget."""

    __slots__ = ("left",)

    def __init__(self, frame_bytes: int):
        self.left = CONTAINERS_BASE + frame_bytes // BYTES_PER_CONTAINER

    def spend(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _Spent
        return container


def decode(frame: bytes) -> Message | UnknownMessage:
    """The message in ``frame``, at a cost bounded by its size; :class:`WireError` for anything else.

    msgpack (in C) is told the longest string, array and map the frame may hold and refuses extension types;
    every map and array it builds is counted, and the decode stops once they exceed the frame's budget. So a
    frame of N bytes builds at most ``CONTAINERS_BASE + N / BYTES_PER_CONTAINER`` containers and records (an
    empty map in a list of records used to become a whole default record: ~560 bytes of memory per byte of
    frame), and a few dozen bytes of objects per byte otherwise (``tests/unit/test_wire_bounds.py``)."""
    size = len(frame)
    budget = _ContainerBudget(size)
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False, max_str_len=size, max_bin_len=size,
                              max_array_len=size, max_map_len=min(size, MAX_MAP_ENTRIES), max_ext_len=0,
                              list_hook=budget.spend, object_hook=budget.spend)
    except _Spent:
        raise WireError(f"a frame of {size} bytes holds more than {size // BYTES_PER_CONTAINER + CONTAINERS_BASE} "
                        "maps and arrays") from None
    except Exception as exc:  # msgpack raises several types for garbage
        raise WireError(f"not a msgpack frame: {exc}") from None
    if not isinstance(raw, dict):
        raise WireError("a frame must be a map")
    version = raw.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    type_name = raw.pop("t", None)
    cls = Message.TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        return UnknownMessage(str(type_name), raw)
    return from_plain(cls, raw, type_name)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


_T = TypeVar("_T")


class _Misfit(Exception):
    """A value of the wrong type, with the path to it from the record being decoded (built on the way out, so
    that a good value costs no path)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
        self.path = ""

    def at(self, piece: str) -> "_Misfit":
        self.path = piece + self.path
        return self


def from_plain(cls: type[_T], raw: Any, where: str) -> _T:
    """``cls`` from its plain form (maps, lists, scalars); :class:`WireError` naming the field that is wrong."""
    try:
        return _record(cls, raw)
    except _Misfit as exc:
        raise WireError(f"{where}{exc.path}: {exc.message}") from None


def _record(cls: type[_T], raw: Any) -> _T:
    if not isinstance(raw, dict):
        raise _Misfit(f"expected a map, got {type(raw).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # every class decoded here is a dataclass
        if f.name in raw and raw[f.name] is not None:
            try:
                kwargs[f.name] = _convert(hints[f.name], raw[f.name])
            except _Misfit as exc:
                raise exc.at(f".{f.name}") from None
    return cls(**kwargs)


def _convert(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(options[0], value)
    if origin is list:
        if not isinstance(value, list):
            raise _Misfit(f"expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)
        if item in (int, str) and all(type(v) is item for v in value):  # the common case, at C speed
            return value
        converted = []
        for i, v in enumerate(value):
            try:
                converted.append(_convert(item, v))
            except _Misfit as exc:
                raise exc.at(f"[{i}]") from None
        return converted
    if origin is dict:
        if not isinstance(value, dict):
            raise _Misfit(f"expected a map, got {type(value).__name__}")
        key_type, value_type = typing.get_args(hint)
        converted_map = {}
        for k, v in value.items():
            key = _convert(key_type, k)
            try:
                converted_map[key] = _convert(value_type, v)
            except _Misfit as exc:
                raise exc.at(f"[{k!r}]") from None
        return converted_map
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _record(hint, value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Misfit(f"expected a number, got {type(value).__name__}")
        return float(value)
    if hint is Any:
        return value
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise _Misfit(f"expected {hint.__name__}, got {type(value).__name__}")
    return value
