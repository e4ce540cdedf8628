"""Tools for testing llmgw and its plugins (in the spirit of ``trio.testing``); see docs/testing.md.

- :mod:`.processes`: run a child process (``python -m llmgw ...`` or any argv) in a trio nursery, wait until
  it is ready, read its output, stop its whole process group (:func:`start_child`, :func:`start_serve`).
- :mod:`.fake_upstream`: a fast fake OpenAI-compatible upstream (``python -m llmgw.testing.fake_upstream``).
- :mod:`.sims`: simulator engines, fake upstreams and a gateway in front of them as child processes.
- :mod:`.cluster`: :class:`Cluster`, ``llmgw serve`` and agents as processes, with an :class:`EngineReaper`.
- :mod:`.gateway`: a :class:`~llmgw.gateway.app.Gateway` in the test's own nursery (:func:`start_gateway_in_process`).
- :mod:`.metrics`: the one Prometheus text reader (:func:`metric_value`, :func:`scrape`).
- :mod:`.redis`: real redis-servers for tests, one per session or one a test may kill and restart.
- :mod:`.shared_state`: gateway processes sharing state through Redis (a control process and followers).
- :mod:`.two_gateways`: a control process and an in-process gateway of one cluster over two slow engines.
- :mod:`.load_reports`: a gateway's load sharing without Redis, and the report it would send.

Only the names below are imported here; the in-process gateway and the cluster are imported from their modules
(they pull in the whole gateway).
"""

from .metrics import metric_value, samples, scrape, scrape_value, series_sum
from .processes import Child, ChildFailed, free_port, llmgw_command, run_child, start_child, start_serve

__all__ = ["Child", "ChildFailed", "free_port", "llmgw_command", "metric_value", "run_child", "samples", "scrape",
           "scrape_value", "series_sum", "start_child", "start_serve"]
