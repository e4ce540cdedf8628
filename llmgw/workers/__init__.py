"""``llmgw serve --workers N``: N gateway processes on one host, one data port, routing as one (docs/scaling.md).

- :mod:`.plan`: what the supervisor runs: the flags, each worker's command line, the private Redis's place;
- :mod:`.worker`: what a worker does differently from a lone ``llmgw serve`` (the private Redis in its
  config, its lifeline to the supervisor, its banner once it follows the shared state);
- :mod:`.supervisor`: the supervisor itself: it starts the workers, restarts the ones that die, and passes
  signals on;
- :mod:`.command`: around it, ``llmgw serve --workers``: the data port held, the state dir locked, and the
  private redis-server when the config names no Redis.

Each worker is an ordinary ``llmgw serve`` with internal flags: worker 0 runs the control plane (``--role
control``) on the configured control address, the others follow it (``--role gateway``) with their control
listener on an ephemeral loopback port; all bind the data address with ``SO_REUSEPORT``
(:mod:`llmgw.http.listeners`), so the kernel spreads new connections across them.
"""
