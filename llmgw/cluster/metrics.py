"""The shared state's metrics (``llmgw_cluster_*``), on the gateway's registry (docs/metrics.md, "Cluster")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DELAY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ClusterMetrics:
    def __init__(self, registry: CollectorRegistry | None, role: str, cluster: str, origin: str):
        self.up = Gauge("llmgw_cluster_backend_up", "1 while Redis answers, 0 while the shared state is degraded "
                        "(routing goes on with the last known state).", registry=registry)
        self.info = Gauge("llmgw_cluster_info", "This process in its gateway cluster: its role (control: runs the "
                          "control plane and writes the shared state; gateway: follows it), always 1.",
                          ["role", "cluster", "origin"], registry=registry)
        self.info.labels(role, cluster, origin).set(1)
        self.errors = Counter("llmgw_cluster_redis_errors", "Redis calls that failed or timed out, by operation.",
                              ["operation"], registry=registry)
        self.batches = Counter("llmgw_cluster_log_batches", "Batches of shared-state changes written to (control) "
                               "or applied from (gateway) the cluster's log.", ["direction"], registry=registry)
        self.entries = Counter("llmgw_cluster_log_entries", "Shared-state changes written or applied, by "
                               "direction and kind (model, add, drain, remove, kv, ...).", ["direction", "kind"],
                               registry=registry)
        self.snapshots = Counter("llmgw_cluster_snapshots", "Snapshots of the shared state written (control) or "
                                 "loaded (gateway: at start, after a gap, a new writer or a Redis outage), by "
                                 "direction and reason.", ["direction", "reason"], registry=registry)
        self.bad_records = Counter("llmgw_cluster_bad_records", "Records read from Redis that this version cannot "
                                   "decode (skipped; a bad log batch makes the gateway re-read the snapshot).",
                                   ["stream"], registry=registry)
        self.log_delay = Histogram("llmgw_cluster_log_delay_seconds", "From the control plane writing a change to "
                                   "this gateway applying it (wall clocks of two processes: same host, or NTP).",
                                   buckets=DELAY_BUCKETS, registry=registry)
        self.peers = Gauge("llmgw_cluster_peers", "Other gateways whose load reports are live (not expired).",
                           registry=registry)
        self.load_reports = Counter("llmgw_cluster_load_reports", "Load reports sent (this gateway's own) and "
                                    "received (the others').", ["direction"], registry=registry)
        self.predictions = Counter("llmgw_cluster_predictions", "Routing predictions shared: sent (this process's "
                                   "own, to Redis), received (the others', applied to this process's KV index), "
                                   "dropped (own ones not sent: buffer full, expired waiting, Redis failed), "
                                   "ignored (others' not applied: expired on arrival, or for a replica this "
                                   "process does not route to).", ["direction"], registry=registry)
        self.tier_learning = Counter("llmgw_cluster_tier_learning", "What routing tiers learnt, shared (the prefix "
                                     "tree's routed prefixes, the cost model's observations): sent, received "
                                     "(applied by this process's tiers), dropped (own items not sent: buffer full, "
                                     "Redis failed), ignored (others' items no tier here takes).", ["direction"],
                                     registry=registry)
        self.leader = Gauge("llmgw_cluster_leader", "1 while this process holds the cluster's lease and runs its "
                            "control plane, else 0 (a follower; a --role gateway process is always 0).",
                            registry=registry)
        self.elections = Counter("llmgw_cluster_elections", "Terms this process won: it took the cluster's lease "
                                 "and started the control plane.", registry=registry)
        self.transitions = Counter("llmgw_cluster_leader_transitions", "Changes of this process's part: to "
                                   "leader (elected) or to follower (the lease not renewed in time, taken, a "
                                   "write fenced off), by reason.", ["to", "reason"], registry=registry)
        self.fenced_writes = Counter("llmgw_cluster_fenced_writes", "Writes of this process's control plane "
                                     "that Redis refused because the lease was no longer its term's (the term "
                                     "ends at the first one).", registry=registry)
        self.lease_restored = Counter("llmgw_cluster_lease_restored", "Renewals of this leader that found its "
                                      "lease deleted (by someone who writes to Redis; its generation counter "
                                      "still the term's) and put it back, keeping the term.", registry=registry)
        self.held = Counter("llmgw_cluster_held_replicas", "Replicas a new leader kept routing from the previous "
                            "one's table when its term started, by outcome: claimed (its own source added the "
                            "same replica: the config's, or a deployed one whose agent re-registered) or dropped "
                            "(not claimed within the hold).", ["outcome"], registry=registry)
        self.asks = Counter("llmgw_cluster_resync_asks", "The other gateways' KV resync asks the leader read, by "
                            "outcome: answered (the replica's agent resyncs it), repeated (the same replica was "
                            "resynced less than 5 s before: that resync answers it) or unknown (no such replica).",
                            ["outcome"], registry=registry)
        self.pool_recycles = Counter("llmgw_cluster_redis_pool_recycles", "New Redis clients opened because the "
                                     "old one's connection pool had lost half its slots (coredis keeps none for a "
                                     "call cancelled while connecting, nor for a connection that died in use).",
                                     registry=registry)
        self.previous_secret = Counter("llmgw_cluster_previous_secret_verifications", "Records (leases, log "
                                       "batches, load reports, node identities, API keys and teams...) that only "
                                       "the previous cluster secret (state.previous_secret_env) signed: while it "
                                       "grows, a process still signs with it or a stored record is not re-signed "
                                       "yet.", registry=registry)
        self.previous_secret_nodes = Gauge("llmgw_cluster_previous_secret_nodes", "Node identities in Redis, as "
                                           "this process last read them, that only the previous cluster secret "
                                           "signed (each new term's leader writes them all again, signed with its "
                                           "current secret): 0 before that secret is dropped.", registry=registry)
        self.up.set(0)
        self.leader.set(0)
