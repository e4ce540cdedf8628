"""Control-plane metrics (``llmgw_nodes``, ``llmgw_shards``, agent traffic, reconcile actions), on the gateway's
registry."""

from __future__ import annotations

from collections import Counter as Tally
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from .. import wire
from ..metrics import one_per_registry

NODE_STATES = ("connected", "suspect", "disconnected")


class ControlMetrics:
    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> "ControlMetrics":
        """The one instance of ``registry`` (a cluster candidate builds a control plane for every term it leads)."""
        return one_per_registry(cls, registry)

    def __init__(self, registry: CollectorRegistry):
        self.nodes = Gauge("llmgw_nodes", "Nodes known to the control plane, by state.", ["state"], registry=registry)
        self.shards = Gauge("llmgw_shards", "Engine shards agents report, by state.", ["state"], registry=registry)
        self.agent_messages = Counter("llmgw_agent_messages", "Messages received from agents, by node and type.",
                                      ["node", "type"], registry=registry)
        self.agent_refused = Counter("llmgw_agent_refused", "Agent connections or messages refused, by reason "
                                     "(bad_token, foreign_shard, protocol, ...).", ["reason"], registry=registry)
        self.agent_upgrades_refused = Counter(
            "llmgw_agent_upgrades_refused", "Websocket upgrades to /agent refused before any frame was read, by "
            "reason (missing_token, bad_token: a wrong token or node secret, no_token_configured, session_limit).",
            ["reason"], registry=registry)
        self.agent_websockets = Gauge("llmgw_agent_websockets", "Remote agent websockets open (admitted at the "
                                      "upgrade, registered or still registering); at most agents.max_sessions.",
                                      registry=registry)
        self.reconcile_actions = Counter("llmgw_reconcile_actions", "Actions the reconciler took, by kind "
                                         "(start, adopt, drain, stop, retire).", ["action"], registry=registry)
        self.placement_failures = Counter("llmgw_placement_failures", "Replicas that could not be placed "
                                          "(counted when a replica becomes unplaceable).", registry=registry)
        self.replica_build_failures = Counter("llmgw_replica_build_failures", "Deployed replicas that could not be "
                                              "built from their leader shard's report (an exception, logged once "
                                              "with its traceback): that replica stays out of routing, the others "
                                              "are unaffected.", registry=registry)
        self.reconcile_failures = Counter("llmgw_reconcile_failures", "Reconcile passes that raised (logged with "
                                          "the traceback); the control plane carries on with the next pass.",
                                          registry=registry)
        self.requests_held = Counter("llmgw_requests_held_at_start", "Requests that found no routable replica "
                                     "of their model during the adoption window after a start, and waited for "
                                     "the agents to report their running engines, by model and result "
                                     "(routed, none: answered 503 when the window ended).", ["model", "result"],
                                     registry=registry)
        self.proofs_reissued = Counter("llmgw_placement_proofs_reissued", "Placement proofs made with the previous "
                                       "cluster secret (state.previous_secret_env) issued anew with the current "
                                       "one to the running shard's agent (its engine runs on).", registry=registry)
        for state in NODE_STATES:
            self.nodes.labels(state).set(0)
        for shard_state in wire.ShardState:
            self.shards.labels(shard_state.value).set(0)

    def set_node_counts(self, states: Iterable[str]) -> None:
        counts = Tally(states)
        for state in NODE_STATES:
            self.nodes.labels(state).set(counts.get(state, 0))

    def set_shard_counts(self, states: Iterable[str]) -> None:
        counts = Tally(states)
        for shard_state in wire.ShardState:
            self.shards.labels(shard_state.value).set(counts.get(shard_state.value, 0))
