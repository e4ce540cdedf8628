"""The HTTP transport: the thin Trio HTTP/1.1 server, the pooled upstream client, messages, deadlines,
bounded JSON bodies, TLS sockets and the connection-contained Hypercorn server. Nothing here knows
about models, replicas or routing; the applications on top live in :mod:`llmgw.gateway`."""
