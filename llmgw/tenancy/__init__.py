"""Tenancy: who a request is (its API key, its team), what it may use, and what it used.

The parts, each testable alone (docs/tenants.md is the user's side):

- :mod:`.model`: the value types every part shares (a :class:`~.model.Tenant`, its
  :class:`~.model.Limits` and budgets, prices, an admission's :class:`~.model.Estimate`,
  an answer's :class:`~.model.Usage`), with money in integer nano-dollars;
- :mod:`.interfaces`: what the data plane calls, and nothing else: the key
  directory (who is this bearer token), the limiter (may it go now; settle what it
  used) and the usage sink (record what was used);
- the key directory and its stores (config keys, ``POST /admin/keys``; SQLite for one
  process, Redis for a cluster), the limiter (leased shares of every limit, taken from
  Redis so that N gateways x W workers admit as one), and usage (per key, team, model
  and hour).

The hot path only reads local copies and local leases: nothing in it waits on Redis
but a request whose key has no lease in hand yet (its first, or a burst's).
"""
