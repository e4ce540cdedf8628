"""Drift: when an engine's reported cached tokens contradict what the router's KV index predicted.

The rule (also in ``docs/kv-routing.md``). For a request the ``kv_index`` tier
routed by the index, with the engine's ``usage.prompt_tokens_details.cached_tokens``
(``actual``), in whole blocks of the replica's block size:

- ``confirmed``: the cached tokens the index's *confirmed* entries promised
  (the leading run the engine's events reported, capped so the last prompt
  token is computed, as vLLM does), taking the smaller of that run at the
  decision and that run when the response finishes (a block evicted meanwhile
  has had its removal event applied by then: the shortfall is explained);
- ``predicted``: the same counting the *predicted* entries of requests just
  routed (what the decision recorded).

``over``: ``actual <= confirmed - block_size``: the engine lacks at least one
block its own events said it holds. Concurrency cannot cause this (confirmed
blocks have landed; predicted entries are not in ``confirmed``), so it means
the index holds blocks the engine dropped: a reset, a removal or a whole batch
the index never saw. It is the harmful direction (requests follow a cache
that is not there) and the only one that counts towards *suspect*.

``under``: ``actual >= predicted + block_size``: the engine served at least
one block more than predicted. Legitimate causes exist (requests routed by
another gateway or by the tree's fallback, predicted entries that expired
before the events landed), so it is counted, never acted upon.

Otherwise ``match`` (a difference below one block is granularity: e.g. a
KV connector serving a partial block).

*Suspect*: ``suspect_after`` ``over`` drifts of one replica within
``window`` seconds mark its index suspect: the tier scores it as it scores
an unhealthy index, and its owner (the agent, or the gateway's own
subscription of a static replica) is asked to resync. The first resync asks
for a ``full`` copy of the owner's mirror (it heals an index that lost
changes on the way from the mirror); a replica turning suspect again within
``relapse_window`` seconds of a full-copy resync gets a ``reset`` (the mirror
itself is wrong, e.g. the engine never published an event: the owner drops
its mirror and relearns from the engine's next events).
"""

from __future__ import annotations

from dataclasses import dataclass

MATCH = "match"
OVER = "over"
UNDER = "under"

RESYNC_FULL = "full"
RESYNC_RESET = "reset"
RESYNC_MODES = (RESYNC_FULL, RESYNC_RESET)

DEFAULT_SUSPECT_AFTER = 3
DEFAULT_WINDOW = 60.0
DEFAULT_RELAPSE_WINDOW = 600.0
DEFAULT_RESYNC_RETRY = 30.0


@dataclass(frozen=True)
class DriftPolicy:
    """When drift makes a replica's index suspect (``suspect_after`` 0: never) and how its resync escalates."""

    suspect_after: int = DEFAULT_SUSPECT_AFTER
    window: float = DEFAULT_WINDOW
    relapse_window: float = DEFAULT_RELAPSE_WINDOW
    resync_retry: float = DEFAULT_RESYNC_RETRY


def cached_tokens(blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Tokens vLLM serves from cache for a leading run of ``blocks``: capped so the last prompt token is computed."""
    if prompt_tokens <= 0 or block_size <= 0:
        return 0
    return min(blocks, (prompt_tokens - 1) // block_size) * block_size


def classify(actual: int, confirmed: int, predicted: int, block_size: int) -> str:
    """``over``, ``under`` or ``match`` (module docstring); token counts, ``confirmed <= predicted``."""
    step = max(block_size, 1)
    if actual <= confirmed - step:
        return OVER
    if actual >= predicted + step:
        return UNDER
    return MATCH
