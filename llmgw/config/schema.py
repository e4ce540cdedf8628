"""The configuration model: one frozen dataclass per section of the YAML file.

Each field is a YAML key; its type (with ``Annotated`` parse and check
metadata) says how it is read, its ``setting`` its default. Rules that span
several keys of one object live in its ``_finish`` hook; rules across the
whole file are in :mod:`llmgw.config.crosschecks`. Documented key by key in
``docs/configuration.md``.
"""

from __future__ import annotations

import hashlib
from decimal import Decimal
from typing import Annotated, Any

from ..autoscale.model import AutoscaleSettings
from ..flow.model import DEFAULT_CLASS, DEFAULT_CLASSES, FlowSettings, PriorityClass
from ..http.jsonbody import DEFAULT_MAX_CONTAINERS, DEFAULT_MAX_DEPTH, DEFAULT_MAX_VALUES
from ..tenancy.model import NANO_PER_USD, PERIODS, TenancySettings
from ..units import parse_duration, parse_size
from . import crosschecks
from .addresses import HostPort, parse_http_url, parse_port_range, parse_redis_url, parse_zmq_endpoint, url_host_port
from .fields import (
    INVALID,
    Check,
    Located,
    OrMapping,
    Parse,
    at_least,
    at_most,
    at_most_items,
    config_class,
    known,
    matches,
    non_empty,
    one_of,
    positive,
    setting,
)
from .names import name_problem
from .reader import Draft
from .tls import ListenerTls, TlsFile, UpstreamTls, check_replica_tls

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
DAY = 24 * 3600.0
MAX_LIMIT = 10**15  # the bound of a rate limit or a token budget: exact in a Redis counter and in a float
MAX_COUNT = 1_000_000  # the bound of a count with no tighter one of its own (docs/configuration.md)

# Value types shared by several keys.
Duration = Annotated[float, Parse(parse_duration), at_most(DAY, "1 day")]  # seconds; "500ms", "5s", "2m" or a number
PositiveDuration = Annotated[float, Parse(parse_duration), positive(), at_most(DAY, "1 day")]
Size = Annotated[int, Parse(parse_size), positive(), at_most(GiB, "1GiB")]  # bytes; "64KiB", "16MiB", "1GB"
Address = Annotated[HostPort, Parse(HostPort.parse)]
HttpUrl = Annotated[str, Parse(parse_http_url)]
ZmqEndpoint = Annotated[str, Parse(parse_zmq_endpoint)]
Count = Annotated[int, at_least(1), at_most(MAX_COUNT)]
NonNegative = Annotated[int, at_least(0), at_most(MAX_COUNT)]
Text = Annotated[str, Check(lambda value: None if value.strip() else "must not be empty")]
IDENTIFIER_PATTERN = r"[A-Za-z_][A-Za-z0-9_.-]*"
Identifier = Annotated[str, matches(IDENTIFIER_PATTERN, "a name of letters, digits, '_', '.' and '-'")]
EngineName = Annotated[str, Check(name_problem)]  # on an engine's command line: llmgw.config.names
ProfileName = Annotated[str, matches(r"[A-Za-z0-9][A-Za-z0-9_.-]*",
                                     "a name of letters, digits, '_', '.' and '-' (not starting with a symbol)")]
EnvName = Annotated[str, matches(r"[A-Za-z_][A-Za-z0-9_]*", "a valid environment variable name")]
# An API key's name: a log field and a metric label ("none" stands for requests without a valid key).
KEY_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.@:/+-]{0,63}"  # also a team's name
KeyName = Annotated[str, matches(KEY_NAME_PATTERN,
                                 "a name of up to 64 letters, digits and '_.@:/+-' (not starting with a symbol)"),
                    Check(lambda value: "'none' stands for requests without a valid key: choose another name"
                          if value == "none" else None)]
Sha256Hex = Annotated[str, matches(r"[0-9A-Fa-f]{64}", "a SHA-256 as 64 hex digits")]
LimitCount = Annotated[int, at_least(1), at_most(MAX_LIMIT)]  # a rate limit or a token budget
Usd = Annotated[float, Check(lambda value: whole_units(value, NANO_PER_USD, "USD", 9)), at_most(1e9, "1000000000")]
UsdPerMillion = Annotated[float, Check(lambda value: whole_units(value, NANO_PER_USD // 1_000_000, "USD per million "
                                                                 "tokens", 3)), at_most(1e6, "1000000")]
ModelNames = Annotated[list[Text], at_most_items(10_000)]
LogLevel = Annotated[str, one_of("debug", "info", "warning", "error", "critical")]
LogFormat = Annotated[str, one_of("text", "json")]
# vLLM's --scheduling-policy of an engine: priority orders its waiting requests by the gateway's engine priority
SchedulingPolicy = Annotated[str, one_of("fcfs", "priority")]


def whole_units(value: float, units_per_one: int, what: str, decimals: int) -> str | None:
    """None when ``value`` (>= 0) is a whole number of ``1/units_per_one``; else why not."""
    if value < 0:
        return "must be at least 0"
    exact = Decimal(str(value)) * units_per_one
    return None if exact == exact.to_integral_value() else f"must be {what} with at most {decimals} decimals"


def check_budget_periods(draft: Draft) -> None:
    """A key or a team has at most one budget per period (two would only mean the smaller)."""
    if draft.known("budgets"):
        crosschecks.report_duplicates(draft, draft["budgets"], "period", "budget period")

# Numbers with an upper bound of their own in place of MAX_COUNT or 1GiB (docs/configuration.md, "Upper bounds").
SmallCount = Annotated[int, at_least(1), at_most(1000)]  # a replica's weight, the health thresholds
# prompt tokens per second: a replica's prefill rate as known before it answers (the cost model's prior of it)
PrefillRate = Annotated[float, at_least(50), at_most(1e8, "100000000")]
GpuCount = Annotated[int, at_least(1), at_most(1024)]  # tp, pp, nodes, GPUs per node
# An agent's frames: never below the largest Register (llmgw.wire.channel.MAX_REGISTER_BYTES, 256KiB).
AgentFrameSize = Annotated[int, Parse(parse_size), Check(lambda value: None if value >= 256 * KiB else
                                                         "must be at least 256KiB (the largest Register)"),
                           at_most(GiB, "1GiB")]


@config_class
class ExternalReplica(Located):
    """An OpenAI-compatible server that llmgw did not start (an existing vLLM, a simulator)."""

    url: HttpUrl = setting()
    api_key: Text | None = setting(None, secret=True)  # sent upstream as "Authorization: Bearer ..."
    name: Text | None = setting(None)  # default: "host:port" of the URL
    kv_events: ZmqEndpoint | None = setting(None)  # the engine's KV-event PUB socket
    kv_replay: ZmqEndpoint | None = setting(None)  # its replay socket
    weight: SmallCount = setting(1)
    prefill_tokens_per_s: PrefillRate | None = setting(None)  # its prefill rate before it answers (docs/routing.md)
    scheduling_policy: SchedulingPolicy = setting("fcfs")  # what the engine runs with: priority gets `priority` set
    tls_ca_file: TlsFile | None = setting(None)  # https:// only; default: upstream_tls.ca_file
    tls_cert_file: TlsFile | None = setting(None)  # client certificate for mutual TLS
    tls_key_file: TlsFile | None = setting(None)
    tls_verify: bool | None = setting(None)  # default: upstream_tls.verify

    @property
    def address(self) -> HostPort:
        """Host and port of the URL (the scheme's default port when none is written)."""
        return url_host_port(self.url)

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft["name"] is None and draft.known("url"):
            draft.set("name", str(url_host_port(draft["url"])))
        if draft.known("kv_replay", "kv_events") and draft["kv_replay"] and not draft["kv_events"]:
            draft.problem("kv_replay", "needs kv_events: replay fills gaps in an event stream")
        check_replica_tls(draft)


@config_class
class LoraAdapter(Located):
    """A LoRA adapter the engine loads next to the base model."""

    name: EngineName = setting()
    path: Text = setting()


@config_class
class ModelConfig(Located):
    """A model served by static external replicas."""

    name: EngineName = setting()
    routing: Identifier = setting("round_robin")  # a routing tier plugin's name
    routing_options: dict[str, Any] = setting(factory=dict)  # the tier's own settings
    replicas: Annotated[list[ExternalReplica], non_empty("a model needs at least one replica")] = setting()
    max_model_len: Annotated[int, at_least(1), at_most(100_000_000)] | None = setting(None)
    lora_adapters: list[LoraAdapter] = setting(factory=list)  # adapters every replica serves (--lora-modules)

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("replicas"):
            crosschecks.report_duplicates(draft, draft["replicas"], "url", "replica URL")
            crosschecks.report_duplicates(draft, draft["replicas"], "name", "replica name")
        if draft.known("lora_adapters"):
            crosschecks.report_duplicates(draft, draft["lora_adapters"], "name", "LoRA adapter name")


@config_class
class TenantLimits(Located):
    """The rate limits of a key or a team (docs/tenants.md); left out: unlimited in that dimension."""

    rpm: LimitCount | None = setting(None)  # requests per minute
    tpm: LimitCount | None = setting(None)  # tokens per minute (input, cached input as weighted, output)
    concurrency: LimitCount | None = setting(None)  # requests in flight at once


@config_class
class BudgetConfig(Located):
    """A cap on what a key or a team uses in a period: tokens, money, or both."""

    period: Annotated[str, one_of(*PERIODS)] = setting()  # the UTC day, the UTC month, or for ever
    tokens: LimitCount | None = setting(None)
    usd: Usd | None = setting(None)

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("period", "tokens", "usd") and draft["tokens"] is None and draft["usd"] is None:
            draft.problem("period", "a budget needs tokens, usd or both")


Budgets = Annotated[list[BudgetConfig], at_most_items(len(PERIODS))]


@config_class
class TeamSpec(Located):
    """What a team says of its keys: limits and budgets they share, the models they may use (``PATCH
    /admin/teams/NAME`` reads one)."""

    limits: TenantLimits = setting(factory=TenantLimits)
    budgets: Budgets = setting(factory=list)
    models: ModelNames | None = setting(None)  # the models its keys may use; left out: every model
    priority: Identifier | None = setting(None)  # its keys' priority class, unless a key names its own
    priority_header: bool = setting(False)  # its keys' requests may raise their class with flow.priority_header

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        check_budget_periods(draft)


@config_class
class TeamConfig(TeamSpec):
    """A team under ``teams`` (or in ``POST /admin/teams``)."""

    name: KeyName = setting()


@config_class
class KeySpec(Located):
    """What an API key carries besides the key: who holds it, its team, models, priority, limits and budgets
    (``POST /admin/keys`` and ``PATCH /admin/keys/ID`` read one)."""

    name: KeyName | None = setting(None)  # who holds it; safe to log
    team: KeyName | None = setting(None)  # a team: its limits and models apply too
    models: ModelNames | None = setting(None)  # the models it may use; left out: every model (its team's apply)
    priority: Identifier | None = setting(None)  # its requests' priority class; default: its team's
    priority_header: bool = setting(False)  # its requests may raise their class with flow.priority_header
    limits: TenantLimits = setting(factory=TenantLimits)
    budgets: Budgets = setting(factory=list)

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        check_budget_periods(draft)


@config_class
class ApiKey(KeySpec):
    """A client API key accepted on /v1 (as "Authorization: Bearer KEY"), given as the key or as its SHA-256.
    ``name`` says who holds it, in the access log and the ``key`` label of the metrics; left out, it is ``key-N``
    (N: the key's place in the list, from 1), filled in by :func:`llmgw.config.crosschecks.name_api_keys`."""

    key: Text | None = setting(None, secret=True)
    key_sha256: Sha256Hex | None = setting(None)  # instead of key: its SHA-256, as 64 hex digits

    @property
    def sha256(self) -> str:
        """The SHA-256 of the key as 64 lowercase hex digits: how the key directory finds it."""
        if self.key_sha256 is not None:
            return self.key_sha256.lower()
        assert self.key is not None  # _finish: exactly one of key and key_sha256
        return hashlib.sha256(self.key.encode("utf-8", "surrogatepass")).hexdigest()

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("key", "key_sha256") and (draft["key"] is None) == (draft["key_sha256"] is None):
            draft.problem("key" if draft.was_written("key") or not draft.was_written("key_sha256") else "key_sha256",
                          "give exactly one of key and key_sha256")
        KeySpec._finish(draft)


@config_class
class PriceConfig(Located):
    """One model's price in USD per million tokens (as providers list them)."""

    model: Text = setting()  # the name clients ask for
    input: UsdPerMillion = setting(0.0)
    cached_input: UsdPerMillion | None = setting(None)  # default: the input price
    output: UsdPerMillion = setting(0.0)


@config_class
class TenancyConfig(Located):
    """How limits count and where keys made by the admin API are kept (docs/tenants.md)."""

    default_max_tokens: Annotated[int, at_least(1), at_most(10_000_000)] = setting(4096)
    max_prompt_estimate: Annotated[int, at_least(1), at_most(100_000_000)] = setting(1_000_000)
    cached_input_weight: Annotated[float, Check(lambda value: None if 0 <= value <= 1 else
                                                "must be between 0 and 1")] = setting(1.0)
    budgets_fail_closed: bool = setting(True)  # Redis away: budgets admit only what a lease in hand holds
    lease_seconds: Annotated[float, Parse(parse_duration), at_least(0.01), at_most(60.0)] = setting(0.5)
    lease_idle_seconds: Annotated[float, Parse(parse_duration), at_least(0.1), at_most(3600.0)] = setting(2.0)
    usage_flush_interval: Annotated[float, Parse(parse_duration), at_least(0.01), at_most(60.0)] = setting(0.1)
    store: Text | None = setting(None)  # the SQLite file of keys and teams (state.backend local)
    require_keys: bool = setting(False)  # /v1 needs a key even while none is configured or made
    max_keys: Annotated[int, at_least(1), at_most(1_000_000)] = setting(100_000)  # keys the admin API may hold
    max_teams: Annotated[int, at_least(1), at_most(100_000)] = setting(10_000)  # teams the admin API may hold

    def settings(self) -> TenancySettings:
        """The knobs the limiter and the usage sink read."""
        return TenancySettings(
            default_max_tokens=self.default_max_tokens, max_prompt_estimate=self.max_prompt_estimate,
            cached_input_weight=self.cached_input_weight, budgets_fail_closed=self.budgets_fail_closed,
            lease_seconds=self.lease_seconds, lease_idle_seconds=self.lease_idle_seconds,
            usage_flush_interval=self.usage_flush_interval)


@config_class
class AdminToken(Located):
    """A token accepted on the control port's ``/admin/*`` (as "Authorization: Bearer TOKEN")."""

    token: Text = setting(secret=True)
    name: Text | None = setting(None)  # who holds it; safe to log


@config_class
class Limits(Located):
    """Request limits and timeouts of the data plane."""

    max_body_bytes: Annotated[int, Parse(parse_size), positive(), at_most(256 * MiB, "256MiB")] = setting(16 * MiB)
    max_header_bytes: Annotated[int, Parse(parse_size), positive(), at_most(1 * MiB, "1MiB")] = setting(64 * KiB)
    client_header_timeout: PositiveDuration = setting(10.0)
    client_body_timeout: PositiveDuration = setting(30.0)
    keepalive_timeout: PositiveDuration = setting(75.0)
    connect_timeout: PositiveDuration = setting(3.0)
    first_byte_timeout: PositiveDuration = setting(600.0)
    idle_timeout: PositiveDuration = setting(300.0)
    retries: Annotated[int, at_least(0), at_most(10)] = setting(2)
    shutdown_grace: Duration = setting(30.0)
    max_connections: Count = setting(10000)
    control_max_connections: Count = setting(1000)
    max_json_depth: Annotated[int, at_least(1), at_most(500)] = setting(DEFAULT_MAX_DEPTH)  # nesting of a request body
    max_json_values: Count = setting(DEFAULT_MAX_VALUES)  # commas, brackets and escapes of a request body
    max_json_containers: Count = setting(DEFAULT_MAX_CONTAINERS)  # brackets of a request body


@config_class
class HealthConfig(Located):
    """Active probing and passive failure counting of replicas."""

    interval: PositiveDuration = setting(2.0)
    timeout: PositiveDuration = setting(2.0)
    failures_to_down: SmallCount = setting(2)
    successes_to_up: SmallCount = setting(1)
    passive_failures_to_down: SmallCount = setting(3)
    path: Annotated[str, matches(r"/\S*", "a path starting with '/'")] = setting("/health")


@config_class
class AgentsConfig(Located):
    """How agents join the control plane, and the embedded agent of ``llmgw serve``."""

    token: Text | None = setting(None, secret=True)
    embedded: bool = setting(False)
    heartbeat_interval: PositiveDuration = setting(5.0)
    suspect_after: PositiveDuration = setting(15.0)
    disconnected_after: PositiveDuration = setting(60.0)
    node_id: Text | None = setting(None)
    state_dir: Text | None = setting(None)
    tokens: list[Text] = setting(factory=list, secret=True)  # more join tokens accepted (rotation)
    control_state_dir: Text | None = setting(None)  # node identities; default $XDG_STATE_HOME/llmgw/control
    max_sessions: Count = setting(1024)  # remote agent websockets open at once (503 past it)
    register_timeout: PositiveDuration = setting(5.0)  # from the upgrade to the Register; then closed
    max_message_bytes: AgentFrameSize = setting(16 * MiB)  # a registered agent's largest frame (Hypercorn's too)
    engine_ports: Annotated[tuple[int, int], Parse(parse_port_range)] | None = setting(None)  # embedded agent

    @property
    def embedded_node_id(self) -> str:
        """The embedded agent's node id: ``node_id``, or this machine's hostname."""
        import socket

        return self.node_id or socket.gethostname()

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("heartbeat_interval", "suspect_after") and draft["suspect_after"] <= draft["heartbeat_interval"]:
            draft.problem("suspect_after", "must be longer than heartbeat_interval")
        if draft.known("suspect_after", "disconnected_after") and draft["disconnected_after"] <= draft["suspect_after"]:
            draft.problem("disconnected_after", "must be longer than suspect_after")


@config_class
class Profile(Located):
    """How to run one engine replica: engine, model, parallelism, arguments."""

    name: ProfileName = setting()
    engine: Identifier = setting()  # an engine plugin's name: vllm, sim
    model_path: Text = setting()
    served_model_name: EngineName = setting(None)  # default: name
    gpu_class: Text | None = setting(None)
    tp: GpuCount = setting(1)
    pp: GpuCount = setting(1)
    nodes: GpuCount = setting(1)
    gpus_per_node: GpuCount | None = setting(None)  # default: tp * pp / nodes
    args: list[str] = setting(factory=list)
    env: dict[EnvName, str] = setting(factory=dict, secret=True)  # often holds tokens
    lora_adapters: list[LoraAdapter] = setting(factory=list)
    kv_events: bool = setting(False)
    routing: Identifier = setting("round_robin")
    routing_options: dict[str, Any] = setting(factory=dict)
    engine_bin: Text | None = setting(None)
    startup_timeout: PositiveDuration = setting(600.0)
    sleep_mode: bool = setting(False)  # the engine's sleep mode: a replica kept warm sleeps (docs/autoscaling.md)
    labels: dict[str, str] = setting(factory=dict)
    prefill_tokens_per_s: PrefillRate | None = setting(None)  # its replicas' prefill rate before they answer
    cpu_threads: Annotated[int, at_least(1), at_most(4096)] | None = setting(None)
    api_key: Text | None = setting(None, secret=True)
    scheduling_policy: SchedulingPolicy = setting("fcfs")  # priority: the engine orders requests by their class
    # vLLM's --long-prefill-token-threshold: a request computes at most this many tokens per engine step
    long_prefill_token_threshold: Annotated[int, at_least(1), at_most(100_000_000)] | None = setting(None)

    @property
    def gpus(self) -> int:
        """GPUs one replica uses in all: tp * pp."""
        return self.tp * self.pp

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft["served_model_name"] is None and draft.known("name"):
            draft.set("served_model_name", draft["name"])
        if draft.known("tp", "pp", "nodes", "gpus_per_node"):
            gpus, nodes, per_node = draft["tp"] * draft["pp"], draft["nodes"], draft["gpus_per_node"]
            if per_node is None and gpus % nodes:
                draft.problem("nodes", f"tp x pp = {gpus} GPUs cannot be split evenly over {nodes} nodes")
            elif per_node is None:
                draft.set("gpus_per_node", gpus // nodes)
            elif per_node * nodes != gpus:
                draft.problem("gpus_per_node", f"gpus_per_node x nodes = {per_node * nodes}, but tp x pp = {gpus}")
        if draft.known("lora_adapters"):
            crosschecks.report_duplicates(draft, draft["lora_adapters"], "name", "LoRA adapter name")


@config_class
class Placement(Located):
    """Where a deployment's replicas may run."""

    node_selector: dict[str, str] = setting(factory=dict)  # node labels that must match
    nodes: list[Text] = setting(factory=list)  # allowed node ids; empty: any
    spread: bool = setting(True)  # prefer different nodes for different replicas


MAX_REPLICAS = 10_000
ReplicaCount = Annotated[int, at_least(0), at_most(MAX_REPLICAS)]
_AUTOSCALE = AutoscaleSettings()  # the defaults of the autoscale keys are the settings' own


@config_class
class ReplicaRange(Located):
    """``replicas: {min, max}``: the bounds of an autoscaled deployment (docs/autoscaling.md)."""

    min: ReplicaCount = setting(1)  # 0: no replica while idle (the first request starts one)
    max: Annotated[int, at_least(1), at_most(MAX_REPLICAS)] = setting()

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("min", "max") and draft["min"] > draft["max"]:
            draft.problem("min", f"must be at most max ({draft['max']})")


@config_class
class DeploymentAutoscale(Located):
    """A deployment's ``autoscale:`` section: its targets, windows and priority (docs/autoscaling.md)."""

    queued_per_replica: Annotated[float, positive(), at_most(MAX_COUNT)] = setting(_AUTOSCALE.queued_per_replica)
    kv_usage: Fraction = setting(_AUTOSCALE.kv_usage)  # the mean KV-cache usage of the ready replicas
    ttft_slo: PositiveDuration | None = setting(None)  # when set, first-token attainment is a target too
    attainment: Fraction = setting(_AUTOSCALE.attainment)  # the share of first tokens within ttft_slo
    utilisation: Fraction = setting(_AUTOSCALE.utilisation)  # the busy seats' share forecast `lookahead` ahead
    lookahead: PositiveDuration = setting(_AUTOSCALE.lookahead)  # about the engine's cold start
    scale_up_after: Duration = setting(_AUTOSCALE.scale_up_after)
    scale_down_after: Duration = setting(_AUTOSCALE.scale_down_after)
    idle_to_zero: PositiveDuration = setting(_AUTOSCALE.idle_to_zero)  # no request this long: back to min
    keep_warm: Duration = setting(_AUTOSCALE.keep_warm)  # a scaled-down replica's engine kept adoptable this long
    priority: Annotated[int, at_least(-1000), at_most(1000)] = setting(_AUTOSCALE.priority)

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("ttft_slo") and draft["ttft_slo"] is None and draft.was_written("attainment"):
            draft.problem("attainment", "needs ttft_slo: the attainment is the share of first tokens within it")


@config_class
class Deployment(Located):
    """A number of replicas of one profile, kept running by the control plane: fixed (``replicas: 2``) or
    autoscaled between bounds (``replicas: {min: 0, max: 4}``, with an optional ``autoscale`` section)."""

    profile: ProfileName = setting()
    replicas: Annotated[ReplicaCount, OrMapping(ReplicaRange)] = setting(1)  # after loading: the count to start at
    pool: Text | None = setting(None)
    placement: Placement = setting(factory=Placement)
    autoscale: DeploymentAutoscale | None = setting(None)
    bounds: tuple[int, int] | None = setting(None, internal=True)  # replicas: {min, max}; None: replicas: N

    @property
    def min_replicas(self) -> int:
        return self.bounds[0] if self.bounds else self.replicas

    @property
    def max_replicas(self) -> int:
        return self.bounds[1] if self.bounds else self.replicas

    @property
    def autoscaled(self) -> bool:
        return self.bounds is not None and self.bounds[1] > self.bounds[0]

    def autoscale_settings(self) -> AutoscaleSettings:
        """The scaler's view of this deployment's keys (the defaults where no ``autoscale`` section is written)."""
        section = self.autoscale
        if section is None:  # the section's defaults are the settings' own
            return AutoscaleSettings(min_replicas=self.min_replicas, max_replicas=self.max_replicas)
        return AutoscaleSettings(
            min_replicas=self.min_replicas, max_replicas=self.max_replicas,
            queued_per_replica=section.queued_per_replica, kv_usage=section.kv_usage, ttft_slo=section.ttft_slo,
            attainment=section.attainment, utilisation=section.utilisation, lookahead=section.lookahead,
            scale_up_after=section.scale_up_after,
            scale_down_after=section.scale_down_after, idle_to_zero=section.idle_to_zero, priority=section.priority,
            keep_warm=section.keep_warm)

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        replicas = draft["replicas"]
        autoscaled = False
        if isinstance(replicas, ReplicaRange):  # written as {min, max}: the deployment starts at its min
            valid = known(replicas.min, replicas.max) and replicas.min <= replicas.max
            draft.set("replicas", replicas.min if valid else INVALID)
            draft.set("bounds", (replicas.min, replicas.max) if valid else None)
            autoscaled = valid and replicas.max > replicas.min
        if draft.known("replicas", "autoscale") and draft["autoscale"] is not None and not autoscaled:
            draft.problem("autoscale", "applies to an autoscaled deployment: write its replicas as "
                                       "{min: N, max: M} with M above N")


@config_class
class AutoscaleConfig(Located):
    """The top-level ``autoscale:`` section: how often the leader decides, how many decisions it keeps."""

    interval: Annotated[float, Parse(parse_duration), at_least(0.05), at_most(60.0)] = setting(1.0)
    history: Annotated[int, at_least(10), at_most(100_000)] = setting(500)  # decisions kept for /admin/autoscale


@config_class
class MetricsConfig(Located):
    """The Prometheus endpoint on the control listener."""

    enabled: bool = setting(True)
    require_auth: bool = setting(False)  # true: /metrics needs an admin token like /admin/*


@config_class
class SentinelConfig(Located):
    """Redis Sentinel: ask these sentinels where the primary of ``service`` is, and again after a failover."""

    service: ProfileName = setting()  # the name the sentinels monitor (`sentinel monitor <service> ...`)
    addresses: Annotated[list[Address], non_empty("name at least one sentinel, e.g. 10.0.0.1:26379"),
                         at_most_items(16),
                         Check(lambda value: None if all(a.port for a in value) else "a sentinel's port is not 0")
                         ] = setting()
    username: Text | None = setting(None)  # the sentinels' ACL user (the primary's is state.username)
    password_env: EnvName | None = setting(None)  # the variable holding the sentinels' password
    database: Annotated[int, at_least(0), at_most(16383)] = setting(0)
    tls: bool = setting(False)  # TLS to the sentinels and the primary, with state.tls's files


REDIS_NEEDS_SECRET = ("backend redis needs a cluster secret: name the environment variable that holds it (at least "
                      "16 bytes, the same on every gateway), e.g. secret_env: LLMGW_CLUSTER_SECRET; without one, "
                      "anyone who can write to Redis steers routing (docs/security.md)")


@config_class
class StateConfig(Located):
    """Where the state that several gateways share lives (docs/scaling.md): this process (``local``), or Redis."""

    backend: Annotated[str, one_of("local", "redis")] = setting("local")
    url: Annotated[str, Parse(parse_redis_url)] | None = setting(None)  # redis://, rediss:// or unix://
    sentinel: SentinelConfig | None = setting(None)  # instead of url: find the primary through Redis Sentinel
    cluster: ProfileName = setting("llmgw")  # gateways with the same Redis and cluster name route as one
    username: Text | None = setting(None)  # Redis ACL user
    password_env: EnvName | None = setting(None)  # the environment variable holding the password
    secret_env: EnvName | None = setting(None)  # a variable holding the cluster secret that signs every record
    previous_secret_env: EnvName | None = setting(None)  # a second secret, accepted but never signed with (rotation)
    tls: UpstreamTls = setting(factory=UpstreamTls)  # rediss:// only: the CA, client certificate, verify
    timeout: PositiveDuration = setting(2.0)  # every Redis call
    load_interval: Annotated[float, Parse(parse_duration), at_least(0.005), at_most(5.0)] = setting(0.05)
    load_ttl: Annotated[float, Parse(parse_duration), at_least(0.1), at_most(600.0)] = setting(2.0)
    snapshot_interval: Annotated[float, Parse(parse_duration), at_least(0.1), at_most(3600.0)] = setting(10.0)
    stream_length: Annotated[int, at_least(1000), at_most(10_000_000)] = setting(20_000)  # log batches kept
    share_learning: bool = setting(True)  # predictions, prefix-tree routes, cost observations: every gateway's
    lease_ttl: Annotated[float, Parse(parse_duration), at_least(0.3), at_most(60.0)] = setting(2.0)  # leader lease
    lease_renew: Annotated[float, Parse(parse_duration), at_least(0.05), at_most(20.0)] = setting(0.5)

    @property
    def shared(self) -> bool:
        return self.backend == "redis"

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("backend", "url", "sentinel") and draft["backend"] == "redis" and not draft["url"] \
                and not draft["sentinel"]:
            draft.problem("url", "backend redis needs the server's URL, e.g. redis://127.0.0.1:6379/0 "
                                 "(or state.sentinel)")
        if draft.known("backend", "secret_env") and draft["backend"] == "redis" and not draft["secret_env"]:
            draft.problem("secret_env", REDIS_NEEDS_SECRET)
        if draft.known("secret_env", "previous_secret_env") and draft["previous_secret_env"]:
            if not draft["secret_env"]:
                draft.problem("previous_secret_env", "a previous secret is accepted beside the current one "
                                                     "(secret_env), which must be set too")
            elif draft["previous_secret_env"] == draft["secret_env"]:
                draft.problem("previous_secret_env", "names the same variable as secret_env: name the variable "
                                                     "holding the other secret of the rotation")
        if draft.known("url", "sentinel") and draft["url"] and draft["sentinel"]:
            draft.problem("sentinel", "give either url or sentinel: with sentinel, the sentinels say where "
                                      "the primary is")
        if draft.known("load_interval", "load_ttl") and draft["load_ttl"] < 4 * draft["load_interval"]:
            draft.problem("load_ttl", "must be at least 4 x load_interval: a live gateway's load must not expire")
        if draft.known("lease_ttl", "lease_renew") and draft["lease_ttl"] < 3 * draft["lease_renew"]:
            draft.problem("lease_renew", "must be at most a third of lease_ttl: a leader renews several times "
                                         "within its lease, so one slow answer does not cost it the lead")


MAX_CLASSES = 16  # priority classes: each is a label of the flow metrics
HeaderName = Annotated[str, matches(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}", "an HTTP header name (up to 64 characters)"),
                       Check(lambda value: None if value.lower() not in ("authorization", "content-type", "host")
                             else "is a header every request carries for another purpose")]
Fraction = Annotated[float, Check(lambda value: None if 0 < value <= 1 else "must be above 0 and at most 1")]
RetryAfter = Annotated[int, at_least(1), at_most(3600)]  # seconds


@config_class
class PriorityClassConfig(Located):
    """One priority class (a band) of ``flow.classes``: docs/overload.md."""

    name: Identifier = setting()
    rank: Annotated[int, at_least(0), at_most(1000)] = setting()  # bands are served by rank, 0 first
    max_wait: PositiveDuration = setting()  # the longest a request of the class waits at the gateway (then 429)
    max_fill: Fraction = setting(1.0)  # the share of a model's room the class may fill
    # the `priority` its requests carry to an engine in priority scheduling (lower first); default: its rank
    engine_priority: Annotated[int, at_least(-1_000_000), at_most(1_000_000)] | None = setting(None)

    def priority_class(self) -> PriorityClass:
        return PriorityClass(self.name, self.rank, self.max_wait, self.max_fill, self.engine_priority)


def _default_classes() -> list[PriorityClassConfig]:
    return [PriorityClassConfig(name=c.name, rank=c.rank, max_wait=c.max_wait, max_fill=c.max_fill,
                                engine_priority=c.engine_priority) for c in DEFAULT_CLASSES]


@config_class
class FlowConfig(Located):
    """Overload control at the gateway (docs/overload.md): priority classes, the queue per model, its bounds."""

    enabled: bool = setting(True)  # false: every request is routed at once, as before (no queue at the gateway)
    classes: Annotated[list[PriorityClassConfig], non_empty("name at least one class"),
                       at_most_items(MAX_CLASSES)] = setting(factory=_default_classes)
    default_class: Identifier = setting(DEFAULT_CLASS)  # a request's class when its key and team name none
    priority_header: HeaderName = setting("x-llmgw-priority")  # a request may lower (or, if its key may, raise) it
    max_queued: Count = setting(10_000)  # requests waiting per model, all classes
    max_queued_tokens: Annotated[int, at_least(1), at_most(MAX_LIMIT)] = setting(50_000_000)  # their tokens
    retry_after_min: RetryAfter = setting(1)  # the bounds of a shed request's Retry-After, seconds
    retry_after_max: RetryAfter = setting(60)
    # The room, learnt from the engines (docs/overload.md#room-what-the-engines-can-take).
    scrape_interval: Annotated[float, Parse(parse_duration), at_least(0.05), at_most(10.0)] = setting(0.25)
    kv_high: Fraction = setting(0.9)  # an engine's KV cache usage at which it counts as full
    kv_target: Fraction = setting(0.8)  # below it, a replica with requests waiting for it may take more
    # Of a request's max_tokens, the room reserves this quantile of what groups of the model's answers held
    # (docs/overload.md#the-output-allowance); learn_output false: max_tokens whole.
    learn_output: bool = setting(True)
    output_quantile: Annotated[float, at_least(0), at_most(1)] = setting(0.9)  # output_allowance's default

    def reserved_output_quantile(self) -> float | None:
        """What the router's output allowances reserve (None: ``max_tokens`` whole)."""
        return self.output_quantile if self.learn_output else None

    def settings(self) -> FlowSettings:
        return FlowSettings(
            enabled=self.enabled, classes=tuple(c.priority_class() for c in self.classes),
            default_class=self.default_class, priority_header=self.priority_header.lower(),
            max_queued=self.max_queued, max_queued_tokens=self.max_queued_tokens,
            retry_after_min=self.retry_after_min, retry_after_max=self.retry_after_max)

    def class_names(self) -> list[str]:
        return [c.name for c in self.classes]

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("classes"):
            crosschecks.report_duplicates(draft, draft["classes"], "name", "class name")
            crosschecks.report_duplicates(draft, draft["classes"], "rank", "class rank")
        if draft.known("classes", "default_class"):
            problem = crosschecks.class_problem(draft["default_class"], draft["classes"])
            if problem:
                draft.problem("default_class", problem)
        if draft.known("retry_after_min", "retry_after_max") and draft["retry_after_max"] < draft["retry_after_min"]:
            draft.problem("retry_after_max", "must be at least retry_after_min")
        if draft.known("kv_high", "kv_target") and draft["kv_target"] >= draft["kv_high"]:
            if draft.was_written("kv_target"):
                draft.problem("kv_target", "must be below kv_high")
            else:
                draft.problem("kv_high", "must be above kv_target (0.8 unless written)")


@config_class
class Config(Located):
    """A whole configuration file."""

    source: str = setting("", internal=True)  # the file it was read from
    listen: Address = setting(HostPort("127.0.0.1", 8000))
    control_listen: Address = setting(HostPort("127.0.0.1", 8001))
    data_tls: ListenerTls | None = setting(None)  # HTTPS on `listen`
    upstream_tls: UpstreamTls = setting(factory=UpstreamTls)  # default trust for https:// replicas
    models: list[ModelConfig] = setting(factory=list)
    api_keys: list[ApiKey] = setting(factory=list)
    admin_tokens: list[AdminToken] = setting(factory=list)  # empty: /admin/* is open (loopback only)
    allow_unauthenticated_admin: bool = setting(False)  # true: serve /admin/* without tokens on any address
    control_tls: ListenerTls | None = setting(None)  # HTTPS/WSS on control_listen
    limits: Limits = setting(factory=Limits)
    health: HealthConfig = setting(factory=HealthConfig)
    agents: AgentsConfig = setting(factory=AgentsConfig)
    profiles: list[Profile] = setting(factory=list)
    deployments: list[Deployment] = setting(factory=list)
    metrics: MetricsConfig = setting(factory=MetricsConfig)
    log_level: LogLevel = setting("info")
    access_log: bool = setting(False)  # one line per relayed request on the "llmgw.access" logger
    log_format: LogFormat = setting("text")
    state: StateConfig = setting(factory=StateConfig)  # shared by several gateways: docs/scaling.md
    teams: list[TeamConfig] = setting(factory=list)  # docs/tenants.md
    prices: list[PriceConfig] = setting(factory=list)  # USD per million tokens, by model
    tenancy: TenancyConfig = setting(factory=TenancyConfig)
    flow: FlowConfig = setting(factory=FlowConfig)  # overload control: docs/overload.md
    autoscale: AutoscaleConfig = setting(factory=AutoscaleConfig)  # docs/autoscaling.md

    def model_names(self) -> list[str]:
        """Names clients may ask for: every model under ``models``, then every deployed profile's served name."""
        deployed = {deployment.profile for deployment in self.deployments}
        names = [model.name for model in self.models]
        names += [profile.served_model_name for profile in self.profiles if profile.name in deployed]
        return list(dict.fromkeys(names))

    def autoscale_settings(self) -> dict[str, AutoscaleSettings]:
        """Each autoscaled deployment's settings, by its profile name (an autoscaled profile has one deployment)."""
        return {d.profile: d.autoscale_settings() for d in self.deployments if d.autoscaled}

    def profile(self, name: str) -> Profile:
        """The profile called ``name``; ``KeyError`` when there is none."""
        for profile in self.profiles:
            if profile.name == name:
                return profile
        raise KeyError(name)

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        draft.set("source", draft.where.file)
        crosschecks.check_config(draft)
