"""The state several gateway processes share through Redis, so that they route as one (docs/scaling.md).

- :mod:`.records`: the keys and the encoded records (the log's batches, snapshots, load reports);
- :mod:`.link`: the connection to Redis, and whether the shared state is healthy or degraded;
- :mod:`.writer`: the control process writes the replica table and the KV index's changes (log + snapshots);
- :mod:`.follower`: a ``--role gateway`` process follows them into its own table and index;
- :mod:`.load`: every process shares its own in-flight load and reads the others';
- :mod:`.learn`: every process shares the predictions its routing makes and applies the others';
- :mod:`.state`: one process's shared state, by role, as the gateway composes it.

Nothing here is on the request path: routing reads only the process's own copies (and its predictions are
only appended to a bounded buffer, sent from another task).
"""
